"""A management command that reads or writes the database: when it cannot reach it, one line
with a code and what to check, not a traceback (``create_token``, ``revoke_token``,
``prune_history``, ``loadplugins``, ``runplugin``)."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, InterfaceError, OperationalError, connections

#: The code a command's error starts with when the database cannot be used.
CODE = "database_unavailable"


def database_where(alias: str = DEFAULT_DB_ALIAS) -> str:
    """The database as the operator set it, without its credentials: "postgresql host:port/name"."""
    db = connections.settings[alias]
    vendor = str(db.get("ENGINE", "")).rpartition(".")[2]
    if db.get("HOST") or db.get("PORT"):
        return f"{vendor} {db.get('HOST') or ''}:{db.get('PORT') or ''}/{db.get('NAME')}"
    return f"{vendor} {db.get('NAME')}"


def unavailable(exc: BaseException) -> str:
    """The message of a command whose database failed with ``exc``."""
    detail = " ".join(str(exc).split())[:300]  # libpq's message spans lines; one line for the operator
    return (f"{CODE}: the database ({database_where()}) cannot be used ({type(exc).__name__}: {detail}). "
            "Check that it is up, that this command has the server's DATABASE_URL, and that "
            "`manage.py migrate` ran")


class DatabaseCommand(BaseCommand):
    """BaseCommand whose database errors (down, refused, not migrated) are a CommandError."""

    def execute(self, *args: Any, **options: Any) -> Any:
        try:
            return super().execute(*args, **options)
        except (OperationalError, InterfaceError) as exc:
            raise CommandError(unavailable(exc)) from None
