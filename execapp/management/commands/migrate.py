"""manage.py migrate: Django's, one at a time on PostgreSQL (every replica may run it as it starts)."""
from __future__ import annotations

from typing import Any

from django.core.management.commands.migrate import Command as DjangoMigrate
from django.db import connections

from execapp.db_command import DatabaseCommand

#: The PostgreSQL advisory lock a migrate holds for its whole run (any fixed number: "migrate").
MIGRATE_LOCK_KEY = 0x6D696772617465


class Command(DatabaseCommand, DjangoMigrate):
    """Django's migrate, holding a PostgreSQL advisory lock for the whole run; a database it cannot
    reach is one line with a code (DatabaseCommand), not a traceback.

    Every replica of a deployment commonly runs `migrate && loadplugins` as it starts: two
    migrates that began together both created the same tables, and all but one failed
    (``duplicate key value violates unique constraint "pg_type_typname_nsp_index"``, exit 1: the
    replica's start failed). With the lock, the others wait and then find nothing to apply.
    SQLite: its own write lock already serializes them."""

    def handle(self, *args: Any, **options: Any) -> Any:
        connection = connections[options["database"]]
        if connection.vendor != "postgresql":
            return super().handle(*args, **options)
        with connection.cursor() as cursor:
            # Session-level: held across the migrations' own transactions until released below.
            cursor.execute("SELECT pg_advisory_lock(%s)", [MIGRATE_LOCK_KEY])
        try:
            return super().handle(*args, **options)
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [MIGRATE_LOCK_KEY])
