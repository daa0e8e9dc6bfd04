"""The worker service of the watchdog: applies the quarantine list, asks for a recycle on stuck threads.

It runs on the worker's housekeeping thread (execapp.worker.SERVICE_FACTORIES, after the
services the apps registered, so it sees the matchers they install); its counterpart in the
supervisor is ``execapp.serve.Supervisor``. See docs/operations.md, "The watchdog".
"""
from __future__ import annotations

import logging

from . import conf
from .engine.engine import running_handlers
from .seams import EngineLike, WorkerLike
from .watchdog import STATE_READY, STATE_RECYCLE
from .watchdog_quarantine import QuarantineEntry, quarantine_path
from .watchdog_worker import WorkerWatch

log = logging.getLogger("execapp.watchdog")


class WatchdogService:
    """Worker service (SERVICE_FACTORIES): applies the quarantine list and watches stuck pool threads.

    Ticked on the housekeeping thread, so a new worker applies the list in its first round of
    ticks, before ``execapp.serve`` lets it listen; a running worker applies a new entry within
    ``interval``. Past ``EXECAPP['STUCK_THREADS_LIMIT']`` stuck pool threads it asks the
    supervisor for a replacement (slot state ``recycle``); the supervisor starts one, waits until
    it listens, then SIGTERMs this worker, which drains.
    """

    interval = 0.5

    def __init__(self, worker: WorkerLike, stuck_limit: int) -> None:
        self.worker = worker
        self.watch: WorkerWatch | None = getattr(worker, "watch", None)
        self.stuck_limit = stuck_limit
        self._list_size = -1
        self._entries: list[QuarantineEntry] = []
        self._applied: set[str] = set()

    def tick(self) -> None:
        """Apply new quarantine entries; publish the stuck-thread count; ask for a recycle past the limit."""
        if self.watch is not None:
            self._apply_quarantine()
        self._check_stuck()

    def _apply_quarantine(self) -> None:
        assert self.watch is not None
        try:
            size = quarantine_path(self.watch.directory).stat().st_size
        except FileNotFoundError:
            size = 0
        if size != self._list_size:  # appended to: read it again (it stays small)
            self._list_size = size
            self._entries = self.watch.quarantine_list()
        if not self._entries:
            return
        engine = self.worker.engine
        # Exact names are pinned even before their matcher is registered here (the profile is
        # kept by name); a name cut at 64 bytes pins every matcher it is a prefix of.
        names = {e.matcher for e in self._entries if not e.truncated}
        if any(e.truncated for e in self._entries):
            names |= set(engine.profiles) | {m.name for m in engine.matchers}
        for name in names:
            if name in self._applied and _is_quarantined(engine, name):
                continue
            entry = next((e for e in self._entries if e.matches(name)), None)
            if entry is None:
                continue
            engine.quarantine(name, entry.reason)
            if name not in self._applied:
                self._applied.add(name)
                log.warning("worker %s: matcher %s quarantined (pinned to the pool): %s", self.worker.id, name,
                            entry.reason)

    def _check_stuck(self) -> None:
        pool = self.worker.pool.stats()
        stuck = int(pool.get("stuck") or 0)
        watch = self.watch
        if watch is not None:
            watch.slot.stuck = stuck
        if stuck < self.stuck_limit or self.worker.recycling:
            return
        if watch is not None and watch.slot.state != STATE_READY:
            return  # starting or already draining: nothing to hand over to
        self.worker.recycling = True
        running = ", ".join(running_handlers()) or "-"
        if watch is None:
            log.error("worker %s: %d pool threads are stuck past their deadline (EXECAPP['STUCK_THREADS_LIMIT'] "
                      "is %d; still running: %s) and no execapp.serve supervisor can replace this worker: "
                      "restart it", self.worker.id, stuck, self.stuck_limit, running)
            return
        log.error("worker %s: %d pool threads are stuck past their deadline (EXECAPP['STUCK_THREADS_LIMIT'] is %d; "
                  "still running: %s): asking the supervisor to recycle this worker", self.worker.id, stuck,
                  self.stuck_limit, running)
        watch.slot.state = STATE_RECYCLE

    def close(self) -> None:
        pass


def _is_quarantined(engine: EngineLike, name: str) -> bool:
    profile = engine.profiles.get(name)
    return profile is not None and bool(getattr(profile, "quarantined", None))


def watchdog_service(worker: WorkerLike) -> WatchdogService:
    """Service factory (SERVICE_FACTORIES): the worker's side of the supervisor's watchdog."""
    return WatchdogService(worker, int(conf.get("STUCK_THREADS_LIMIT")))
