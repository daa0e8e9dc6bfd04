"""`manage.py revoke_token <name>`: refuse an API token from now on."""
from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from execapp.auth_watch import revoked_connections_note
from execapp.db_command import DatabaseCommand
from execapp.models import ApiToken


class Command(DatabaseCommand):
    help = "Revoke an API token: new connections with it are refused (HTTP 403), open ones closed (1008)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the token's name, as given to create_token")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        token = ApiToken.objects.filter(name=name).first()
        if token is None:
            known = ", ".join(ApiToken.objects.values_list("name", flat=True)[:20]) or "none"
            raise CommandError(f"no token called {name!r}; known tokens: {known}")
        if token.revoked_at is not None:
            self.stdout.write(f"Token {name!r} was already revoked at {token.revoked_at:%Y-%m-%d %H:%M:%S} UTC.")
            return
        token.revoke()
        self.stdout.write(f"Revoked token {name!r}; {revoked_connections_note()}")
