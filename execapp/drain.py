"""Draining one worker process: refuse new events, finish what was accepted, flush, report.

Run by the control listener (``manage.py drain``) and by the server's SIGTERM sequence
(execapp.server.ExecServer), always off the event loop: the loop must stay free to send the `done`
frames the drain is waiting for.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from . import conf
from .engine.engine import running_handlers
from .outbox import TerminalFrames
from .seams import WorkerLike
from .watchdog import HELD_ALL, HELD_ALONE

log = logging.getLogger("execapp.drain")

#: How often a drain re-checks its counters; a drain is rare, so polling is simpler than hooks.
POLL_SECONDS = 0.005


class UnreadClients:
    """Whether every event still in flight only waits for a client that reads nothing: its handlers
    are over and its `done` is queued (``TerminalFrames.pending``), and no outbox has written
    anything for ``limit`` seconds (EXECAPP['DRAIN_UNREAD_CLIENT_SECONDS']; 0: never)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self._writes = -1
        self._since = 0.0

    def only_unread(self, in_flight: int, now: float) -> bool:
        if self.limit <= 0 or in_flight <= 0 or TerminalFrames.pending < in_flight:
            self._writes = -1  # a handler still runs (or its done is not queued yet): wait for it
            return False
        if TerminalFrames.writes != self._writes:  # a client read something since: it may read the rest
            self._writes, self._since = TerminalFrames.writes, now
            return False
        return now - self._since >= self.limit


def drain_worker(worker: WorkerLike, timeout: float, *, flush: bool = True,
                 abort: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Drain ``worker`` within ``timeout`` seconds and return the report sent to the operator.

    1. ``set_draining(True)``: consumers refuse new events with code ``draining``;
    2. wait until every admitted event has sent its `done` (its inline and pooled handlers,
       queued ones included, have all finished by then), or has only its `done` left to send to
       a client that has read nothing for DRAIN_UNREAD_CLIENT_SECONDS (``dones_unread`` in the
       report; the frame stays queued for it: a client that stops reading cannot hold a drain
       for its whole timeout, nor make it report running events that are over);
    3. drain the pool (closes it, so nothing else starts; ``undrain`` reopens it), not waiting
       for threads stuck past their deadline (their events were answered with `timeout`);
    4. flush the worker's services that can (persisted execution profiles).
    On timeout the pool stays open, so the stragglers' queued handlers still run and their
    events still complete; the report names the handlers still running.
    """
    started = time.monotonic()
    deadline = started + max(0.0, timeout)
    pool = worker.pool
    tasks_before = pool.completed + pool.failed
    events_before = worker.events_finished
    worker.set_draining(True)

    def stop_waiting() -> bool:
        return time.monotonic() >= deadline or (abort is not None and abort())

    unread = UnreadClients(float(conf.get("DRAIN_UNREAD_CLIENT_SECONDS")))
    dones_unread = 0
    while worker.events_in_flight > 0 and not stop_waiting():
        if unread.only_unread(worker.events_in_flight, time.monotonic()):
            dones_unread = max(0, worker.events_in_flight)
            break
        time.sleep(POLL_SECONDS)
    events_done = worker.events_in_flight <= 0 or dones_unread > 0
    ok = False
    reason = ""
    if not events_done:
        reason = "timeout" if time.monotonic() >= deadline else "aborted"
    elif not worker.draining:  # an undrain arrived while we waited: leave the pool open
        reason = "undrained during the drain"
    else:
        ok = drain_pool(pool, max(0.0, deadline - time.monotonic()))
        if not ok:
            reason = "timeout"
    still_running = [] if ok else running_handlers()
    flush_errors = flush_services(worker) if flush else []
    report = {
        "worker": worker.id,
        "ok": ok,
        "reason": reason,
        "elapsed_seconds": round(time.monotonic() - started, 4),
        "timeout_seconds": timeout,
        "finished": {"events": worker.events_finished - events_before,
                     "tasks": pool.completed + pool.failed - tasks_before},
        "still_running": still_running,
        "events_in_flight": max(0, worker.events_in_flight),
        # Events whose handlers are over and whose `done` waits, queued, for a client that reads nothing.
        "dones_unread": dones_unread,
        "tasks_queued": pool.stats()["queued"],
        # Pool threads still running past their deadline: their events already ended with
        # `timeout`, so the drain does not wait for them (execapp.watchdog_service recycles such workers).
        "stuck_threads": int(pool.stats().get("stuck") or 0),
        "flush_errors": flush_errors,
    }
    log.info("drain of %s: %s", worker.id, json.dumps(report))
    return report


def drain_pool(pool: Any, timeout: float) -> bool:
    """Close ``pool`` and wait up to ``timeout`` for its tasks, except those stuck past their deadline.

    A stuck thread (a handler that ignored its deadline) may never return; its event was
    answered with `timeout` when the deadline passed, so there is nothing left to wait for.
    True once every other task has finished.
    """
    deadline = time.monotonic() + timeout
    while True:
        if pool.drain(min(0.05, max(0.0, deadline - time.monotonic()))):
            return True
        stuck = int(pool.stats().get("stuck") or 0)
        if stuck and pool.busy() <= stuck:
            return True
        if time.monotonic() >= deadline:
            return False


def hold_drained(worker: WorkerLike, drained: bool, everyone: bool = False) -> None:
    """Note in the worker's watchdog slot that an operator's drain holds it (``manage.py drain``;
    ``undrain`` lets go), so a process the supervisor starts in its place (after a crash, a SIGKILL,
    a watchdog kill, a recycle) starts drained too: a drained deployment stays drained until
    ``undrain``. ``everyone``: the drain was of every worker (not ``--worker``), so any worker that
    starts while this one is held starts drained as well (``execapp.server``). A SIGTERM drain is
    not held: it ends in the worker's exit."""
    watch = getattr(worker, "watch", None)
    if watch is not None:
        watch.slot.drained = (HELD_ALL if everyone else HELD_ALONE) if drained else 0  # execapp.watchdog


def undrain_worker(worker: WorkerLike) -> dict[str, Any]:
    """Take new events again: reopen the pool, then admit events (the reverse of a drain). A
    worker shutting down (SIGTERM, a recycle) refuses: it drains to exit."""
    was_draining = worker.draining
    if getattr(worker, "stopping", False):
        log.warning("undrain of %s refused: it is shutting down (SIGTERM or a recycle) and drains to exit", worker.id)
        return {"worker": worker.id, "ok": False, "was_draining": was_draining,
                "error": "stopping: this worker is shutting down (SIGTERM or a recycle) and drains to exit; "
                         "its replacement, if any, takes events"}
    hold_drained(worker, False)
    worker.pool.resume()
    if not worker.set_draining(False):  # began to stop meanwhile: leave its pool as the shutdown wants it
        return {"worker": worker.id, "ok": False, "was_draining": was_draining,
                "error": "stopping: this worker began to shut down during the undrain"}
    log.info("undrain of %s (was draining: %s)", worker.id, was_draining)
    return {"worker": worker.id, "ok": True, "was_draining": was_draining}


def flush_services(worker: WorkerLike) -> list[str]:
    """Call ``flush()`` on every service that has one (the persisted profiles); returns the errors.

    Called from the drain's thread while the housekeeper may tick the same service: a service's
    ``flush`` must be thread-safe (execapp.persistence.ProfileStore.flush takes its lock).
    """
    from django.db import connections

    errors: list[str] = []
    for service in list(worker.services):
        fn = getattr(service, "flush", None)
        if not callable(fn):
            continue
        try:
            fn()
        except Exception as exc:  # a failed flush is reported to the operator, never fatal
            log.exception("flushing %s failed", type(service).__name__)
            errors.append(f"{type(service).__name__}: {exc}")
    connections.close_all()  # this thread's connections only: a drain must not leak one per call
    return errors
