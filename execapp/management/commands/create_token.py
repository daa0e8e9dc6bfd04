"""`manage.py create_token <name>`: issue an API token; the raw token is the last line of output."""
from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from execapp.db_command import DatabaseCommand
from execapp.models import ApiToken


class Command(DatabaseCommand):
    help = "Create an API token for WebSocket clients and print it (only its hash is stored)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="a unique name for the token, e.g. the client's name")
        parser.add_argument("--tenant", default="",
                            help="the owner of the token's sessions: tokens of one tenant share session names, "
                                 "other tenants never see them (default: the token's name, its own owner)")

    def handle(self, *args: Any, name: str, tenant: str = "", **options: Any) -> None:
        name, tenant = name.strip(), tenant.strip()
        if not name or len(name) > 100:
            raise CommandError(f"name {name!r} must be 1-100 characters")
        if len(tenant) > 100:
            raise CommandError(f"--tenant {tenant[:20]!r}... is {len(tenant)} characters; use at most 100")
        if ApiToken.objects.filter(name=name).exists():
            raise CommandError(f"a token called {name!r} already exists; pick another name "
                               f"(or `.venv/bin/python manage.py revoke_token {name}` to disable the old one)")
        why = ApiToken(name=name, tenant=tenant).joins_by_default()
        if why is not None:
            raise CommandError(why.replace("set the tenant to it explicitly", f"pass --tenant {name}"))
        token, raw = ApiToken.issue(name, tenant)
        # Information, not an error: stdout (stderr printed it red), with the token as its last line.
        self.stdout.write(f"Created API token {name!r} of tenant {token.tenant!r}. Copy it now: only its hash is "
                          "stored.\n"
                          "Connect with ws://HOST/ws/events/?token=<token> or 'Authorization: Bearer <token>'.\n"
                          "The token:")
        self.stdout.write(raw)
