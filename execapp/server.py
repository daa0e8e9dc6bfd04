"""One worker process's server: uvicorn with the Worker started before listening and drained before closing.

uvicorn's own shutdown closes every WebSocket (code 1012) before it waits for anything, which
would cut accepted events before their `done`. ``ExecServer`` runs the worker's drain first
(execapp.drain, bounded by EXECAPP['SHUTDOWN_GRACE_SECONDS']) and only then lets uvicorn close
the connections; ``DrainGate`` closes new WebSockets meanwhile. The supervisor that starts these
processes and watches them is ``execapp.serve``. See docs/operations.md.
"""
from __future__ import annotations

import asyncio
import faulthandler
import gc
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from . import watchdog
from .watchdog_worker import WorkerWatch

if TYPE_CHECKING:  # types only: the supervisor (execapp.serve) imports this module and stays light
    from .seams import WorkerLike

log = logging.getLogger("execapp.serve")

#: Longest wait at start for the worker's first round of service ticks (plugins loaded).
STARTUP_READY_SECONDS = 30
#: The close a WebSocket client gets when it connects to a worker that is shutting down.
DRAINING_CLOSE = (1012, "draining: this worker is restarting; reconnect")


#: Container objects allocated (net) between two young collections of the cyclic GC: more than one
#: frame can make (a 64 KB frame of ``[]`` is ~22,000 lists), so a frame's objects are gone before a
#: collection sees them twice, and none is promoted to the old generation. Python's default (700)
#: promoted them all.
GC_YOUNG_THRESHOLD = 50_000


def tune_gc() -> int:
    """Set the cyclic GC up for a worker's event loop, once it is ready and before it listens: every
    object alive then (Django, the plugins, the worker's services) moved out of its reach
    (``gc.freeze``), and young collections made rare (GC_YOUNG_THRESHOLD). The number frozen.

    A full collection scans every object the GC tracks with the loop held, and it came every few
    frames that build many containers: a client sending 64 KB frames of ``[[],[],...]`` (15,000
    lists each) got their lists promoted to the old generation by the young collections during
    each parse (one every 700 containers) and so a full collection every ~6 frames: ~100 ms each
    over the worker's ~80,000 startup objects (measured: a bystander's /ping p99 159 ms, 85% of
    such a frame's cost was the collector), more with every open connection (~130 objects each:
    600 idle connections, p99 124 ms). The startup objects live as long as the process, so
    scanning them finds nothing; a frame's lists die with it, so with young collections rarer
    than a frame's allocations they never reach the old generation (both: p99 27 ms alone, 36 ms
    with the 600 connections). Cyclic garbage among the frozen objects is never collected.
    """
    gc.collect()  # what startup left behind goes first, not into the permanent generation
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)
    return gc.get_freeze_count()


class DrainGate:
    """ASGI wrapper: once its server shuts down, a new WebSocket handshake is accepted and closed
    at once with 1012 and a reason (reconnect), instead of joining a worker about to close it."""

    def __init__(self, app: Any, server: "ExecServer") -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket" and self.server.refusing:
            message = await receive()
            if message["type"] == "websocket.connect":
                await send({"type": "websocket.accept"})
                await send({"type": "websocket.close", "code": DRAINING_CLOSE[0], "reason": DRAINING_CLOSE[1]})
            return
        await self.app(scope, receive, send)


class ExecServer(uvicorn.Server):
    """uvicorn's server with the process's Worker started before listening and drained before closing.

    Under the supervisor it also beats its watchdog slot from the loop and reports its state
    there (starting, ready, draining, exiting).
    """

    def __init__(self, config: uvicorn.Config, grace: float | None = None) -> None:
        super().__init__(config)
        self.grace = grace
        self.worker: WorkerLike | None = None
        self.drain_report: dict[str, Any] | None = None
        self.watch = WorkerWatch.from_env()
        self.refusing = False  # set at shutdown: DrainGate closes new WebSockets with 1012
        self.handed_over = False  # the listener closed at once: sibling workers serve its clients
        self._heartbeat: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        from . import worker as worker_module

        if self.watch is not None:
            # First of all: from here on the supervisor sees this loop beat (or stall).
            self.watch.slot.state = watchdog.STATE_STARTING
            self._heartbeat = self.watch.start_heartbeat(orphaned=self._orphaned)
        self.config.loaded_app = DrainGate(self.config.loaded_app, self)
        # Built off the loop (its services may touch the database) and before the socket
        # listens, so the control listener is up and the plugins' matchers are installed (the
        # housekeeper's first round of ticks, which also applies the watchdog's quarantine list)
        # before the first client arrives: a new worker of a rolling deploy never answers an
        # event with `matched: 0` because it was still starting.
        self.worker = await asyncio.to_thread(worker_module.get_worker)
        if not await asyncio.to_thread(self.worker.ready.wait, STARTUP_READY_SECONDS):
            log.warning("worker %s: services not ready after %d s; serving anyway", self.worker.id,
                        STARTUP_READY_SECONDS)
        tune_gc()
        if self.watch is not None and self.watch.slot.drained:
            await self._start_drained()
        elif self.watch is not None and self.watch.slots.drained_siblings(self.watch.slot.index, watchdog.HELD_ALL):
            # It was starting (or dead, its replacement not yet up) when `manage.py drain` was sent
            # to every worker, so the drain never reached it: before, `drain` said every worker
            # drained (exit 0) and this one then served.
            from .drain import hold_drained  # here: the supervisor imports this module, and no engine

            hold_drained(self.worker, True, everyone=True)
            await self._start_drained("a sibling worker is held drained by `manage.py drain` of every worker")
        await super().startup(sockets)
        if self.watch is not None and self.started and not self.should_exit:
            self.watch.slot.state = watchdog.STATE_READY  # listening: the supervisor may retire a predecessor

    def _orphaned(self) -> None:
        """The supervisor is gone (its parent changed): drain and exit, as on SIGTERM."""
        log.error("worker process [%s]: its supervisor is gone (killed?): draining and exiting, since no watchdog "
                  "would watch or replace this worker and a new supervisor would serve beside it", os.getpid())
        self.handle_exit(signal.SIGTERM, None)

    async def _start_drained(self, why: str = "the worker it replaces was drained (manage.py drain) when it died"
                             ) -> None:
        """An operator's drain holds this worker (it replaces one that was drained, or a drain of every
        worker holds a sibling): drain before listening, so no event is accepted until ``manage.py
        undrain`` (execapp.drain.hold_drained)."""
        from .drain import drain_worker

        assert self.worker is not None
        await asyncio.to_thread(drain_worker, self.worker, 0.0, flush=False)
        log.warning("worker %s starts drained: %s; it refuses events with `draining` until `manage.py undrain`",
                    self.worker.id, why)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # 1. New clients. If sibling workers serve (a recycle, or one worker stopped alone), close
        #    the listener now: the kernel sends new connections and probes to them. If this is the
        #    last worker serving (one worker, or the supervisor stops them all), keep listening
        #    through the drain, so a probe gets /healthz 503 `draining` instead of a refused
        #    connection; new WebSocket clients are closed with 1012 (DrainGate) meanwhile.
        self.refusing = True
        if self.watch is not None:
            self.watch.slot.state = watchdog.STATE_DRAINING
            self.handed_over = (not self.watch.supervisor_stopping
                                and self.watch.slots.serving_siblings(self.watch.slot.index) > 0)
        if self.handed_over:
            for server in getattr(self, "servers", []):
                server.close()
        # 2. Drain in a thread: the loop must keep running to send the `done` frames waited for.
        if self.worker is not None and not self.force_exit:
            from . import conf
            from .drain import drain_worker

            self.worker.begin_stop()  # /healthz says `draining` from this moment, and undrain cannot undo it
            grace = float(self.grace if self.grace is not None else conf.get("SHUTDOWN_GRACE_SECONDS"))
            log.info("draining worker %s before shutdown (grace %.1f s, %s)", self.worker.id, grace,
                     "listener handed over to sibling workers" if self.handed_over else "still listening")
            self.drain_report = await asyncio.to_thread(drain_worker, self.worker, grace,
                                                        abort=lambda: self.force_exit)
            if self.drain_report["ok"]:
                log.info("worker %s drained: %s events, %s tasks in %.2f s%s", self.worker.id,
                         self.drain_report["finished"]["events"], self.drain_report["finished"]["tasks"],
                         self.drain_report["elapsed_seconds"],
                         f"; {self.drain_report['dones_unread']} done frames were not read by their clients "
                         "(handlers over; the frames are dropped with the connections)"
                         if self.drain_report.get("dones_unread") else "")
            else:
                log.error("worker %s NOT drained (%s) after %.2f s; still running: %s; %s events without done",
                          self.worker.id, self.drain_report["reason"], self.drain_report["elapsed_seconds"],
                          ", ".join(self.drain_report["still_running"]) or "-",
                          self.drain_report["events_in_flight"])
        # 3. uvicorn's own sequence: close the listener, close connections (1012), wait for them.
        await super().shutdown(sockets)
        # 4. Stop the worker: final profile flush, leave the control group and registry.
        if self.worker is not None:
            await asyncio.to_thread(self.worker.stop, 1.0)
        if self.watch is not None:
            self.watch.slot.state = watchdog.STATE_EXITING  # the heartbeat ends with the loop: no stall
        if self._heartbeat is not None:
            self._heartbeat.cancel()


def reuse_port_socket(config: uvicorn.Config, listen: bool = True) -> socket.socket:
    """A socket bound to the config's host:port with SO_REUSEPORT: one per worker process, so the
    kernel spreads new connections evenly over the workers (a shared socket lets whichever
    process wakes first take a whole burst, and WebSocket connections stay where they land)."""
    family = socket.AF_INET6 if config.host and ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as exc:
        sock.close()
        log.error("cannot bind %s:%s: %s", config.host, config.port, exc)
        sys.exit(STARTUP_FAILURE)
    if listen:
        sock.listen(config.backlog)
    sock.set_inheritable(True)
    return sock


def run_worker_process(config: uvicorn.Config, grace: float | None, reuse_port: bool, watch_dir: str, slot: int,
                       sockets: list[socket.socket]) -> None:
    """Body of one spawned worker process (picklable: the supervisor hands it to multiprocessing)."""
    # The worker learns its watchdog slot from the environment (execapp.watchdog_worker.WorkerWatch).
    os.environ[watchdog.ENV_DIR] = watch_dir
    os.environ[watchdog.ENV_SLOT] = str(slot)
    # The supervisor sends SIGUSR1 before it kills a stalled worker: faulthandler writes every
    # thread's stack to stderr from the signal handler itself, even while the loop is stuck in C.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    server = ExecServer(config, grace)
    if reuse_port:
        # Bound now but listening only once the worker is ready (ExecServer.startup), so the
        # kernel never hands a connection to a worker still loading its plugins.
        sockets = [reuse_port_socket(config, listen=False)]
    server.run(sockets=sockets)
