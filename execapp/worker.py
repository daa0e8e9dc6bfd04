"""The ASGI worker process's runtime: its one shared ExecPool, its Engine and background services."""
from __future__ import annotations

import importlib
import logging
import os
import secrets
import socket
import threading
import time
from functools import partial
from typing import Any

from . import conf, extensions
from .engine import Engine, ExecPool, ExecProfile
from .loop_share import LoopShare, ShareGroup
from .outbox_budget import OutboxBudget
from .pool_share import PoolShare, PoolShareGroup
from .seams import Service, ServiceFactory
from .watchdog_worker import WorkerWatch

log = logging.getLogger("execapp.worker")

__all__ = ["Service", "Worker", "current_worker", "get_worker", "reset_worker", "service_factories", "set_worker"]


#: In SERVICE_FACTORIES: the services the apps above execapp registered (execapp.extensions),
#: in their registration order; the plugins app's registry sync (plugins/sync.py) is one.
EXTENSION_SERVICES = "<execapp.extensions.services>"

#: ``factory(worker) -> Service`` by dotted path (imported when a worker starts: they use Django
#: models), built in this order. Tests replace the list to run a worker with fewer services.
SERVICE_FACTORIES: list[str] = [
    # First, so persisted profiles are restored before any matcher runs (docs/observability.md).
    "execapp.persistence.profile_store",
    # drain/undrain/execstatus over the channel layer (idle with the in-memory layer, which
    # cannot reach other processes); see execapp/control_thread.py and docs/operations.md.
    "execapp.control_thread.control_service",
    # The event history (before the metrics and snapshots, which read its failure counts).
    "execapp.history.recorder",
    # Prometheus gauges and the dashboard's per-worker snapshots.
    "execapp.metrics_updater.metrics_updater",
    "execapp.snapshots.snapshot_publisher",
    # The registered services: the plugin registry sync builds the engine's matchers.
    EXTENSION_SERVICES,
    # The supervisor's watchdog: applies its quarantine list (after the extensions, so a new
    # worker's first round of ticks pins the offenders among the matchers they installed
    # before it listens) and watches stuck pool threads.
    "execapp.watchdog_service.watchdog_service",
]


def service_factories() -> list[tuple[str, ServiceFactory]]:
    """(name, factory) of every service a worker starts now, in order: SERVICE_FACTORIES with
    EXTENSION_SERVICES replaced by what the apps registered."""
    factories: list[tuple[str, ServiceFactory]] = []
    for path in SERVICE_FACTORIES:
        if path == EXTENSION_SERVICES:
            factories += [(s.name, s.factory) for s in extensions.services()]
            continue
        module, _, name = path.rpartition(".")
        factories.append((path, getattr(importlib.import_module(module), name)))
    return factories


class Worker:
    """One per ASGI worker process: every consumer and engine in the process shares its pool."""

    def __init__(self, worker_id: str | None = None) -> None:
        self.id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        self.started_at = time.time()
        threads = conf.get("POOL_MAX_WORKERS")
        self.pool = ExecPool(threads, conf.get("POOL_QUEUE_SIZE"), conf.get("POOL_IDLE_SECONDS"), name="execpool",
                             reserve=int(threads * conf.get("POOL_RESERVE")))
        self.engine = Engine(
            pool=self.pool,
            overflow=conf.get("OVERFLOW_POLICY"),
            overflow_wait=conf.get("OVERFLOW_WAIT_SECONDS"),
            inline_timeout=conf.get("INLINE_TIMEOUT_SECONDS"),
            profile_factory=partial(ExecProfile, window=conf.get("PROFILE_WINDOW"),
                                    slow_threshold=conf.get("SLOW_THRESHOLD_SECONDS")),
        )
        self.draining = False
        #: Set for good when this worker began to stop (SIGTERM, a recycle): it drains to exit, and
        #: no `manage.py undrain` may make it take events again (begin_stop).
        self.stopping = False
        #: Open WebSocket connections by owner (connection_opened / connection_closed).
        self._connections: dict[str, int] = {}
        self._decode_shares: dict[str, LoopShare] = {}
        self._share_group = ShareGroup()  # enforces the shares only while two owners are active
        self._pool_shares: dict[str, PoolShare] = {}
        self._pool_group = PoolShareGroup()  # enforces them only while two owners use the pool
        self._outbox_budgets: dict[str, OutboxBudget] = {}
        #: Set once this worker asked its supervisor for a replacement (too many stuck pool threads).
        self.recycling = False
        # Under the execapp.serve supervisor: this process's watchdog slot. The engine marks every
        # inline run in it, so a loop stalled in a handler is named from outside after a SIGKILL.
        self.watch = WorkerWatch.from_env()
        if self.watch is not None:
            self.engine.set_inline_slot(self.watch.slot.mark_buffer())
        # Events accepted by this process's consumers whose `done` is not yet sent. Counted under
        # the same lock that flips `draining`, so an event is either refused or counted: a drain
        # never misses one accepted just as it started (see begin_event; docs/operations.md).
        self._events_lock = threading.Lock()
        self.events_in_flight = 0
        self.events_finished = 0
        self.services: list[Service] = []
        #: Set after the housekeeper's first round of service ticks (execapp.serve waits for it).
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._threads: list[threading.Thread] = []  # the own_thread services'

    def start(self) -> None:
        """Build the services and start the housekeeping thread (idempotent)."""
        if self._thread is not None:
            return
        for _, factory in service_factories():
            self.services.append(factory(self))
        shared = [s for s in self.services if not getattr(s, "own_thread", False)]
        # A service that runs code it does not control (the registry sync compiles plugins and
        # runs their top levels: up to a minute each) ticks on a thread of its own: on the shared
        # one it held the metrics, the snapshots, the history and the watchdog's quarantine list
        # for as long as it took.
        own = [(s, threading.Event()) for s in self.services if getattr(s, "own_thread", False)]
        self._threads = [threading.Thread(target=self._tick_alone, args=(s, first), daemon=True,
                                          name=f"execapp-{type(s).__name__}") for s, first in own]
        for thread in self._threads:
            thread.start()
        self._thread = threading.Thread(target=self._housekeep, args=(shared, [first for _, first in own]),
                                        name="execapp-housekeeper", daemon=True)
        self._thread.start()

    def _housekeep(self, services: list[Service], firsts: list[threading.Event]) -> None:
        # Runs every shared service's tick on its own interval, on this one thread: database and
        # Redis I/O of the background jobs never touches the event loop or the pool.
        due = {id(s): 0.0 for s in services}
        slot = self.watch.slot if self.watch is not None else None
        while not self._stop.is_set():
            now = time.monotonic()
            if slot is not None:  # a tick that never returns stops these: the supervisor sees it
                slot.beat_house(now)
            for service in services:
                if now >= due[id(service)]:
                    due[id(service)] = now + service.interval
                    self._tick(service)
            if not self.ready.is_set() and all(first.is_set() for first in firsts):
                self.ready.set()  # every service ticked once (plugins synced): execapp.serve listens now
            self._stop.wait(0.1)

    def _tick_alone(self, service: Service, first: threading.Event) -> None:
        """An ``own_thread`` service's ticks, every ``interval`` seconds, on this thread."""
        while True:
            self._tick(service)
            first.set()
            if self._stop.wait(service.interval):
                return

    @staticmethod
    def _tick(service: Service) -> None:
        try:
            service.tick()
        except Exception:
            log.exception("service %s failed", type(service).__name__)

    def stop(self, timeout: float | None = None) -> bool:
        """Drain the pool (bounded), stop the housekeeper and close every service (final flushes)."""
        drained = self.pool.drain(timeout)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        for thread in self._threads:
            thread.join(5)
        for service in self.services:
            try:
                service.close()
            except Exception:
                log.exception("closing service %s failed", type(service).__name__)
        return drained

    def status(self) -> dict[str, Any]:
        """This worker's identity, drain state, engine counters and pool stats."""
        return {"worker": self.id, "pid": os.getpid(), "started_at": self.started_at, "draining": self.draining,
                "stopping": self.stopping, "recycling": self.recycling,
                "events_in_flight": self.events_in_flight, "events_finished": self.events_finished,
                **self.engine.stats()}

    # -- event accounting and draining (execapp.drain, the consumers) ---------------------------

    def connection_opened(self, owner: str, limit: int) -> bool:
        """Count a new connection of ``owner``, unless it already holds ``limit`` here (False).
        Called on the event loop only (the consumers), so no lock."""
        n = self._connections.get(owner, 0)
        if n >= limit:
            return False
        self._connections[owner] = n + 1
        return True

    def connection_closed(self, owner: str) -> None:
        """One counted connection of ``owner`` is gone (event loop)."""
        n = self._connections.get(owner, 0) - 1
        if n > 0:
            self._connections[owner] = n
        else:
            self._connections.pop(owner, None)
            self._decode_shares.pop(owner, None)
            # Its outboxes close right after (each takes its bytes off the budget it holds).
            self._outbox_budgets.pop(owner, None)
            pool = self._pool_shares.get(owner)
            if pool is not None and not pool.held:  # else kept while its pooled events run (pool_share)
                del self._pool_shares[owner]

    @property
    def share_group(self) -> ShareGroup:
        """This worker's loop shares (WebSocket owners, and HTTP client networks: execapp.http_share)."""
        return self._share_group

    def decode_share(self, owner: str, share: float) -> LoopShare:
        """The share of this worker's loop ``owner``'s connections may spend on their frames while
        other owners are active, one for all of them (event loop; dropped with the owner's last
        connection)."""
        found = self._decode_shares.get(owner)
        if found is None:
            found = self._decode_shares[owner] = LoopShare(share, group=self._share_group, owner=owner)
        return found

    def pool_share(self, owner: str, share: float) -> PoolShare:
        """How many of ``owner``'s events may hold pooled work here while other owners' do too
        (``share`` of POOL_MAX_WORKERS, at least one), one for all its connections (event loop).
        Dropped with the owner's last connection once its pooled events are done."""
        found = self._pool_shares.get(owner)
        if found is None:
            shares = self._pool_shares
            if len(shares) > 2 * len(self._connections) + 16:  # amortized: owners gone since, work done
                for gone in [o for o, s in shares.items() if not s.held and o not in self._connections]:
                    del shares[gone]
            found = shares[owner] = PoolShare(max(1, int(share * self.pool.max_workers)), self._pool_group,
                                                owner=owner)
        return found

    def outbox_budget(self, owner: str, limit: int) -> OutboxBudget | None:
        """The bytes all of ``owner``'s outboxes here may hold together (``limit``; 0: no budget,
        None), one for all its connections (event loop; dropped with the owner's last connection)."""
        if limit <= 0:
            return None
        found = self._outbox_budgets.get(owner)
        if found is None:
            found = self._outbox_budgets[owner] = OutboxBudget(limit)
        return found

    def begin_event(self) -> bool:
        """Admit one event (True: now counted in flight) or refuse it (False: draining, reply `draining`)."""
        with self._events_lock:
            if self.draining:
                return False
            self.events_in_flight += 1
            return True

    def end_event(self) -> None:
        """One admitted event is over: its `done` was sent (or its client left and it completed)."""
        with self._events_lock:
            self.events_in_flight -= 1
            self.events_finished += 1

    def set_draining(self, draining: bool) -> bool:
        """Refuse (True) or admit again (False) new events; atomic with respect to begin_event.
        False when it admits none: the worker is stopping (begin_stop), it only drains."""
        with self._events_lock:
            if self.stopping and not draining:
                return False
            self.draining = draining
            return True

    def begin_stop(self) -> None:
        """This worker is shutting down: refuse new events from now on, for good. An `undrain`
        during the shutdown's drain had set it admitting again: /healthz said ok to the load
        balancer, and events accepted then could outlast the grace and lose their `done`."""
        with self._events_lock:
            self.stopping = True
            self.draining = True


_worker: Worker | None = None
_worker_lock = threading.Lock()


def get_worker() -> Worker:
    """The process's Worker, created and started on first use."""
    global _worker
    if _worker is None:
        with _worker_lock:
            if _worker is None:
                worker = Worker()
                worker.start()
                _worker = worker
    return _worker


def current_worker() -> Worker | None:
    """The process's Worker if one was created, else None (creates nothing: for readers such as
    the dashboard and the health probe's fast path)."""
    return _worker


def set_worker(worker: Worker | None) -> Worker | None:
    """Make ``worker`` the process's Worker (None: none) and return the one it replaces; the
    caller starts and stops them (tests, and embedders that build their own Worker)."""
    global _worker
    with _worker_lock:
        previous, _worker = _worker, worker
    return previous


def reset_worker() -> None:
    """Stop and forget the process's Worker (tests)."""
    global _worker
    with _worker_lock:
        if _worker is not None:
            _worker.stop(timeout=5)
        _worker = None
