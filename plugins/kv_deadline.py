"""Database KV calls that wait for the database's locks no longer than their host call's budget.

``kv_set`` and ``kv_incr`` on the database first lock the plugin's KVUsage row (on SQLite: the
database's write lock, taken at BEGIN IMMEDIATE). Off the event loop they ran on the guest's own
thread with the database's own lock wait, SQLite's busy timeout of 20 s (config/settings.py) and
no limit on PostgreSQL: while another transaction held the lock (``loadplugins``, an admin's edit,
a stuck writer of another worker) a call with a 0.2 s budget returned after 20.1 s, holding its
pool thread all along. Here the wait ends with what is left of the budget: SQLite's busy timeout is
set to it for the transaction, PostgreSQL's ``statement_timeout`` (local to the transaction) too, and
a lock wait cut short raises TimeoutError, which the host reports as the guest's ``timeout``.
``kv_get`` too (``read``): an ACCESS EXCLUSIVE lock on PostgreSQL (a migration, VACUUM FULL) held a
read with a 0.2 s budget until it was released. A server that does not answer at all (a stall, a
partition) is cut off on this side ``CUTOFF_MARGIN_SECONDS`` after the deadline (execapp/db_cutoff.py),
also a TimeoutError: before, such a call held its pool thread for as long as the stall lasted.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager, suppress
from typing import Iterator

from django.db import OperationalError, connection, transaction

from execapp.db_cutoff import DatabaseDeadline, atomic_within

#: SQLSTATEs of a PostgreSQL statement ended by statement_timeout (query_canceled) or lock_timeout.
_PG_CUT_SHORT = frozenset({"57014", "55P03"})
#: How long after the deadline a PostgreSQL call with no answer at all has its connection cut.
CUTOFF_MARGIN_SECONDS = 0.5


@contextmanager
def write_transaction(deadline: float) -> Iterator[None]:
    """``transaction.atomic()`` whose lock waits end by ``deadline`` (time.monotonic()); TimeoutError
    when one did, or when no time is left before it starts."""
    ms = _ms_left(deadline)
    try:
        if connection.vendor == "sqlite":
            with _sqlite_busy_timeout(ms), transaction.atomic():
                yield
        elif connection.vendor == "postgresql":
            with atomic_within(ms / 1000 + CUTOFF_MARGIN_SECONDS), _pg_statement_timeout(ms):
                yield
        else:
            with transaction.atomic():
                yield
    except OperationalError as exc:
        raise _timeout(exc, ms) from exc


@contextmanager
def read(deadline: float) -> Iterator[None]:
    """Queries whose lock waits end by ``deadline``, as ``write_transaction``'s. SQLite's read is not
    made a transaction (IMMEDIATE would take the write lock); PostgreSQL's is, for the local timeout."""
    ms = _ms_left(deadline)
    try:
        if connection.vendor == "sqlite":
            with _sqlite_busy_timeout(ms):
                yield
        elif connection.vendor == "postgresql":
            with atomic_within(ms / 1000 + CUTOFF_MARGIN_SECONDS), _pg_statement_timeout(ms):
                yield
        else:
            yield
    except OperationalError as exc:
        raise _timeout(exc, ms) from exc


def _ms_left(deadline: float) -> int:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no time left of the call's budget for the KV call")
    return max(1, math.ceil(left * 1000))


def _timeout(exc: OperationalError, ms: int) -> Exception:
    """TimeoutError for a lock wait the deadline cut short, else ``exc`` itself."""
    if isinstance(exc, DatabaseDeadline):
        return TimeoutError(f"the KV store's database did not answer within the call's budget ({ms} ms)")
    if _cut_short(exc):
        return TimeoutError(f"the KV store's lock was not free within the call's budget ({ms} ms)")
    return exc


@contextmanager
def _sqlite_busy_timeout(ms: int) -> Iterator[None]:
    """The connection's busy timeout is ``ms`` inside, its own (settings' OPTIONS timeout) after."""
    connection.ensure_connection()
    own = int(float(connection.settings_dict.get("OPTIONS", {}).get("timeout", 5)) * 1000)
    with connection.cursor() as cursor:
        cursor.execute(f"PRAGMA busy_timeout = {int(ms)}")
    try:
        yield
    finally:
        with suppress(Exception), connection.cursor() as cursor:  # (a broken connection is closed anyway)
            cursor.execute(f"PRAGMA busy_timeout = {own}")


@contextmanager
def _pg_statement_timeout(ms: int) -> Iterator[None]:
    """statement_timeout ``ms`` until the transaction ends (set_config's is_local); inside a caller's
    own transaction the value it had is put back, as the outer transaction goes on."""
    nested = connection.in_atomic_block and len(connection.atomic_blocks) > 1
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('statement_timeout'), set_config('statement_timeout', %s, true)",
                       [f"{ms}ms"])
        previous = cursor.fetchone()[0]
    try:
        yield
    finally:
        if nested:
            with suppress(Exception), connection.cursor() as cursor:
                cursor.execute("SELECT set_config('statement_timeout', %s, true)", [previous])


def _cut_short(exc: OperationalError) -> bool:
    """Whether ``exc`` is a lock wait ended by the deadline (SQLite's busy timeout, PostgreSQL's)."""
    cause = exc.__cause__
    if getattr(cause, "sqlstate", None) in _PG_CUT_SHORT:
        return True
    return connection.vendor == "sqlite" and "database is locked" in str(exc)
