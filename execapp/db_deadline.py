"""A deadline on the database for lookups a client waits on (PostgreSQL's statement_timeout).

A handshake's token lookup and the open connections' credential re-check run on the worker's one
sync thread (channels' database_sync_to_async): a query waiting on a lock (a migration, a VACUUM
FULL, an admin's long transaction on execapp_apitoken) held every handshake of every tenant on
that worker for as long as the lock was held (measured: 60 s, the client's own give-up). Within
``statement_deadline`` PostgreSQL cancels each statement, lock waits included, past the deadline:
the lookup fails with a DatabaseError, which the handshake answers 1013 "try again later".
statement_timeout is kept by the server; a server that does not answer at all (a stalled host, a
partition, pgbouncer's queue) is cut off on this side ``CUTOFF_MARGIN_SECONDS`` later
(execapp/db_cutoff.py): before, a stall in front of PostgreSQL held every handshake of the worker
for as long as it lasted (60 s of 60 s).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from django.db import connection, transaction

from .db_cutoff import atomic_within

#: Longest a credential lookup's statement may take: they take 1-3 ms when the database answers.
LOOKUP_DEADLINE_SECONDS = 2.0
#: How much longer than the statements' deadline the block may take before its connection is cut
#: on this side (the server's own cancellation comes first when the server answers).
CUTOFF_MARGIN_SECONDS = 1.0


@contextmanager
def statement_deadline(seconds: float = LOOKUP_DEADLINE_SECONDS) -> Iterator[None]:
    """On PostgreSQL, a transaction whose statements are cancelled after ``seconds``; elsewhere
    nothing (SQLite's IMMEDIATE transactions would take its write lock for a read). The whole block,
    its connection's health check and its statements, end within ``seconds`` +
    ``CUTOFF_MARGIN_SECONDS`` whatever the server does (db_cutoff.DatabaseDeadline)."""
    if connection.vendor != "postgresql":
        yield
        return
    with atomic_within(seconds + CUTOFF_MARGIN_SECONDS):
        with connection.cursor() as cursor:
            # is_local: the transaction's end restores the connection's own (kept, CONN_MAX_AGE).
            cursor.execute("SELECT set_config('statement_timeout', %s, true)", [f"{int(seconds * 1000)}ms"])
        yield


@contextmanager
def transaction_deadline(seconds: float) -> Iterator[None]:
    """A transaction everywhere (writes that must be atomic on SQLite too), bounded on PostgreSQL as
    ``statement_deadline``'s: a locked table or a database that does not answer fails it past
    ``seconds`` (+ the cutoff's margin) instead of holding its thread."""
    if connection.vendor != "postgresql":
        with transaction.atomic():
            yield
        return
    with statement_deadline(seconds):
        yield
