"""A deadline on the database for lookups a client waits on (PostgreSQL's statement_timeout).

A handshake's token lookup and the open connections' credential re-check run on the worker's one
sync thread (channels' database_sync_to_async): a query waiting on a lock (a migration, a VACUUM
FULL, an admin's long transaction on execapp_apitoken) held every handshake of every tenant on
that worker for as long as the lock was held (measured: 60 s, the client's own give-up). Within
``statement_deadline`` PostgreSQL cancels each statement, lock waits included, past the deadline:
the lookup fails with a DatabaseError, which the handshake answers 1013 "try again later".
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from django.db import connection, transaction

#: Longest a credential lookup's statement may take: they take 1-3 ms when the database answers.
LOOKUP_DEADLINE_SECONDS = 2.0


@contextmanager
def statement_deadline(seconds: float = LOOKUP_DEADLINE_SECONDS) -> Iterator[None]:
    """On PostgreSQL, a transaction whose statements are cancelled after ``seconds``; elsewhere
    nothing (SQLite's IMMEDIATE transactions would take its write lock for a read)."""
    if connection.vendor != "postgresql":
        yield
        return
    with transaction.atomic():
        with connection.cursor() as cursor:
            # is_local: the transaction's end restores the connection's own (kept, CONN_MAX_AGE).
            cursor.execute("SELECT set_config('statement_timeout', %s, true)", [f"{int(seconds * 1000)}ms"])
        yield
