"""A client-side deadline on a database connection: past it, its socket is shut down.

PostgreSQL's ``statement_timeout`` (execapp/db_deadline.py, plugins/kv_deadline.py) is a promise
the *server* keeps: it ends a statement waiting on a lock, but not a wait for a server that does
not answer at all. A network partition, a PostgreSQL host that stalls, or a pgbouncer queueing
clients while every server connection is busy leave the client reading its socket with no timeout
(libpq and psycopg have none): measured, every WebSocket handshake of a worker waited for its
token lookup as long as a stall in front of PostgreSQL lasted (60 s of 60 s), since the lookups
queue on the worker's one sync thread; a plugin's KV call held its pool thread for as long.

``cut_off_after(seconds)`` keeps the promise on this side: one daemon thread watches the armed
deadlines and, when one passes before its block ended, shuts the connection's socket down
(``shutdown(2)``, not ``close``: psycopg still owns the descriptor). The blocked read returns at
once, the statement fails, Django closes the broken connection (the next use opens a new one,
``CONN_HEALTH_CHECKS``), and the block raises :class:`DatabaseDeadline`, a Django
``OperationalError`` carrying the deadline, so every caller that already handles a database
error (a handshake's 1013, a history batch skipped, a KV call's timeout) handles this one.

A new connection's wait is bounded by libpq's ``connect_timeout`` instead (config/settings.py).
Only PostgreSQL connections are watched: SQLite is a local file (its busy timeout bounds its waits).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from django.db import DEFAULT_DB_ALIAS, OperationalError, connections, transaction

log = logging.getLogger("execapp.db_cutoff")


class DatabaseDeadline(OperationalError):
    """A database call cut off on this side: the server did not answer within its deadline."""

    code = "database_unavailable"

    def __init__(self, seconds: float, where: str, cause: BaseException | None) -> None:
        self.seconds = seconds
        reason = f" ({type(cause).__name__}: {str(cause).strip()[:200]})" if cause is not None else ""
        super().__init__(
            f"the database at {where} did not answer within {seconds:.3g} s, so its connection was closed "
            f"on this side{reason}; check that PostgreSQL and the network to it answer (a stalled host, a "
            f"partition, a pgbouncer whose pool is exhausted)")


class _Armed:
    """One block's deadline on one connection (``wrapper``: a Django DatabaseWrapper)."""

    __slots__ = ("at", "wrapper", "live", "fired")

    def __init__(self, at: float, wrapper: Any) -> None:
        self.at = at
        self.wrapper = wrapper
        self.live = True
        self.fired = False


_cond = threading.Condition(threading.Lock())
_heap: list[tuple[float, int, _Armed]] = []
_order = itertools.count()
_watcher: list[threading.Thread] = []
#: Connections cut since the process started (tests and the log read it).
cut_count = [0]


@contextmanager
def cut_off_after(seconds: float, alias: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
    """Run the block with this thread's connection ``alias`` shut down if it is still inside after
    ``seconds``; raises :class:`DatabaseDeadline` then (whatever the block did or raised meanwhile).

    Use it inside the block's ``transaction.atomic()``: the cut connection is closed inside it, so the
    transaction ends without a new connection (an atomic block left with a connection closed outside
    it reconnects to restore autocommit, and that waited connect_timeout on the stalled server)."""
    wrapper = connections[alias]
    if wrapper.vendor != "postgresql":
        yield
        return
    armed = _arm(time.monotonic() + seconds, wrapper)
    try:
        yield
    except Exception as exc:
        if _disarm(armed):
            _close(wrapper)
            raise DatabaseDeadline(seconds, _where(wrapper), exc) from exc
        raise
    if _disarm(armed):  # cut just as the block ended: its commit has not run, its connection is gone
        _close(wrapper)
        raise DatabaseDeadline(seconds, _where(wrapper), None)


@contextmanager
def atomic_within(seconds: float, alias: str = DEFAULT_DB_ALIAS) -> Iterator[None]:
    """``transaction.atomic()`` whose whole time on PostgreSQL, the kept connection's health check
    (``CONN_HEALTH_CHECKS``' ``SELECT 1``, which the transaction's start runs) included, is cut off
    after ``seconds``. A new connection waits libpq's ``connect_timeout`` at most (config/settings.py)."""
    wrapper = connections[alias]
    if wrapper.vendor != "postgresql":
        with transaction.atomic(using=alias):
            yield
        return
    deadline = time.monotonic() + seconds
    with cut_off_after(seconds, alias):  # outside any transaction: a cut check leaves no connection
        wrapper.close_if_health_check_failed()
    with transaction.atomic(using=alias), cut_off_after(max(0.0, deadline - time.monotonic()), alias):
        yield


def _close(wrapper: Any) -> None:
    """Drop the cut connection (the next use opens a new one)."""
    try:
        wrapper.close()
    except Exception as exc:  # closing a shut-down socket may itself complain
        log.debug("db cutoff: closing the cut connection: %s", exc)


def _arm(at: float, wrapper: Any) -> _Armed:
    armed = _Armed(at, wrapper)
    with _cond:
        heapq.heappush(_heap, (at, next(_order), armed))
        if not _watcher or not _watcher[0].is_alive():
            _watcher[:] = [threading.Thread(target=_watch, name="execapp-db-cutoff", daemon=True)]
            _watcher[0].start()
        elif _heap[0][2] is armed:
            _cond.notify()
    return armed


def _disarm(armed: _Armed) -> bool:
    """End ``armed``'s watch; whether its deadline had fired (the connection was cut)."""
    with _cond:
        armed.live = False  # left in the heap: the watcher drops it when it comes up
        return armed.fired


def _watch() -> None:
    while True:
        with _cond:
            while _heap and not _heap[0][2].live:
                heapq.heappop(_heap)
            if not _heap:
                _cond.wait(30.0)
                continue
            wait = _heap[0][0] - time.monotonic()
            if wait > 0:
                _cond.wait(wait)
                continue
            armed = heapq.heappop(_heap)[2]
            # Under the lock: the block cannot end (disarm) between the check and the cut.
            armed.fired = True
            _cut(armed.wrapper)


def _cut(wrapper: Any) -> None:
    raw = wrapper.connection
    try:
        fd = raw.pgconn.socket if raw is not None else -1
    except Exception:  # closed meanwhile (psycopg raises on a closed pgconn)
        fd = -1
    if fd < 0:
        return
    cut_count[0] += 1
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError as exc:
        log.debug("db cutoff: shutting down the connection's socket failed: %s", exc)
        return
    log.warning("a database call on thread %s had no answer from %s by its deadline: its connection was closed",
                getattr(wrapper, "_thread_ident", "?"), _where(wrapper))


def _where(wrapper: Any) -> str:
    settings = wrapper.settings_dict
    return f"{settings.get('HOST') or 'localhost'}:{settings.get('PORT') or 5432}/{settings.get('NAME') or ''}"
