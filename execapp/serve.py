"""The server entry point: a supervisor, N uvicorn worker processes, a drain before every shutdown.

    python -m execapp.serve --workers 2 --host 0.0.0.0 --port 8000

Each worker process is an ``execapp.server.ExecServer`` (uvicorn that drains before it closes
connections). A ``Supervisor`` runs every worker, ``--workers 1`` included, as a spawned
process (one Worker, ExecPool and engine each): it forwards SIGTERM/SIGINT, restarts a process
that dies, waits for the drains, and is the watchdog (execapp.watchdog): it kills and replaces a
worker whose event loop stalls past EXECAPP['LOOP_STALL_SECONDS'], quarantining the matcher it
was running inline on every worker, and recycles (replacement first, then a drain) a worker with
EXECAPP['STUCK_THREADS_LIMIT'] pool threads stuck. Each worker closes connections whose request
headers are not in within EXECAPP['HANDSHAKE_TIMEOUT_SECONDS'] or pass 64 KiB (execapp.handshake),
and bounds what a WebSocket client makes the protocol do by itself (execapp.ws_flow). Bare uvicorn
or daphne have none of these.
See docs/operations.md.
"""
from __future__ import annotations

import argparse
import collections
import functools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Sequence

import uvicorn
from uvicorn._subprocess import get_subprocess
from uvicorn.config import STARTUP_FAILURE

from . import handshake, logjson, watchdog
from .restart_backoff import RestartBackoff
from .server import reuse_port_socket, run_worker_process
from .watchdog_quarantine import append_quarantine
from .ws_flow import BackpressuredWebSocketProtocol

log = logging.getLogger("execapp.serve")

DEFAULT_APP = "config.asgi:application"
#: Seconds uvicorn gives clients to answer its 1012 close after the drain (then it cancels).
DEFAULT_CLOSE_TIMEOUT = 5
#: How often the supervisor reads the workers' slots (heartbeats, recycle requests, exits).
POLL_SECONDS = 0.1
#: How long a stalled worker gets to write its threads' stacks (SIGUSR1) before its SIGKILL.
STACK_DUMP_SECONDS = 0.5


@dataclass(eq=False)
class Child:
    """One worker process of the supervisor and its watchdog slot."""

    process: Any
    slot: watchdog.Slot
    #: The process started to take this one's place (a recycle), until this one is gone.
    replacement: "Child | None" = None
    #: The process this one is to replace, until it takes over.
    replaces: "Child | None" = None
    retiring: bool = False  # SIGTERMed by the supervisor once its replacement listened
    killed: bool = False  # SIGKILLed by the watchdog
    started_at: float = 0.0  # time.monotonic() of its start
    #: When the supervisor first saw it stopping (SIGTERMed for a recycle, or its slot draining or
    #: exiting): it must be gone ``Supervisor.stop_timeout`` later (``_watch_stop``).
    stopping_at: float | None = None
    #: Its housekeeping thread was silent past ``Supervisor.house_limit``: recycled (``_watch_house``).
    house_stalled: bool = False
    #: ... but since before it listened: logged, not recycled (a replacement would start the same way).
    recycle_skipped: bool = False
    ready_at: float | None = None  # when the supervisor first saw it listening

    @property
    def pid(self) -> int:
        return int(self.process.pid)


class Supervisor:
    """Runs N ExecServer processes on one port: restarts, recycles, stops them, and watches their loops.

    ``reuse_port``: each worker listens on its own SO_REUSEPORT socket (Linux; even spread of
    connections). Otherwise the workers share one socket bound here. ``stall_limit``: seconds
    without a heartbeat after which a worker is killed and replaced (LOOP_STALL_SECONDS).
    ``watch_dir``: where the watchdog's slots and quarantine list live (a fresh temporary
    directory, removed at exit, when None). ``restart_backoff``: the longest wait before starting
    another worker after consecutive ones died before they served (RESTART_BACKOFF_MAX_SECONDS;
    execapp.restart_backoff). ``start_timeout``: a worker not listening this long after its start
    is killed and replaced (WORKER_START_TIMEOUT_SECONDS; 0: never). ``house_limit``: a ready worker
    whose housekeeping thread has not come round this long is recycled (HOUSEKEEPER_STALL_SECONDS; 0: never).
    """

    def __init__(self, config: uvicorn.Config, grace: float | None, stop_timeout: float,
                 reuse_port: bool = False, stall_limit: float = 5.0, watch_dir: str | None = None,
                 restart_backoff: float = 30.0, start_timeout: float = 90.0, house_limit: float = 30.0) -> None:
        self.config = config
        self.grace = grace
        self.stop_timeout = stop_timeout
        self.reuse_port = reuse_port
        self.stall_limit = stall_limit
        self.watch_dir = watch_dir
        self.should_exit = threading.Event()
        self.signals: list[int] = []
        self.children: list[Child] = []
        self.exit_code = 0
        self.backoff = RestartBackoff(restart_backoff)
        self.start_timeout = start_timeout
        self.house_limit = house_limit
        self.slots: watchdog.SlotFile | None = None
        self._free: collections.deque[int] = collections.deque()
        #: Starts still owed to workers that died while an operator's drain held them: those start drained.
        self._drained_owed = 0
        self._sock: socket.socket | None = None

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)
        self.should_exit.set()

    def _spawn(self, replaces: Child | None = None, drained: int = 0) -> Child | None:
        assert self.slots is not None and self._sock is not None and self.watch_dir is not None  # run() set them
        if not self._free:
            log.error("no free watchdog slot for a new worker process (%d in use); retrying", self.slots.count)
            return None
        # The slot released longest ago: a killed worker's slot (its last heartbeat and inline
        # mark, for a post-mortem) is reused as late as possible.
        slot = self.slots.slot(self._free.popleft())
        slot.clear()
        slot.drained = int(drained)  # the worker drains before it listens (execapp.drain.hold_drained; its scope kept)
        target = functools.partial(run_worker_process, self.config, self.grace, self.reuse_port, self.watch_dir,
                                   slot.index)
        process = get_subprocess(self.config, target, [] if self.reuse_port else [self._sock])
        process.start()
        assert process.pid is not None  # a started process has one
        slot.pid = process.pid
        child = Child(process, slot, replaces=replaces, started_at=time.monotonic())
        self.children.append(child)
        log.info("started worker process [%s] (watchdog slot %d)", process.pid, slot.index)
        return child

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; return the exit code (3 when a worker cannot start)."""
        if self.reuse_port:
            # Bound, never listening: checks the port is free and keeps it reserved; the kernel
            # only hands connections to the workers' listening sockets.
            sock = reuse_port_socket(self.config, listen=False)
            log.info("Uvicorn running on http://%s:%d (one SO_REUSEPORT socket per worker)", self.config.host,
                     self.config.port)
        else:
            sock = self.config.bind_socket()
            # Listen here, not only in the workers: a client arriving while they start waits in
            # the backlog for the first ready worker instead of being refused.
            sock.listen(self.config.backlog)
        self._sock = sock
        own_dir = self.watch_dir is None
        if own_dir:
            self.watch_dir = tempfile.mkdtemp(prefix=f"execapp-watchdog-{self.config.port}-")
        assert self.watch_dir is not None
        os.makedirs(self.watch_dir, exist_ok=True)
        # Room for every worker and a replacement of each (a recycle runs both for a while).
        count = 2 * self.config.workers + 2
        self.slots = watchdog.SlotFile.create(Path(self.watch_dir) / watchdog.SLOTS_FILE, count)
        self._free.extend(range(count))
        log.info("watchdog: slots and quarantine list in %s (loop stall limit %g s)", self.watch_dir,
                 self.stall_limit)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            for _ in range(self.config.workers):
                self._spawn()
            while not self.should_exit.wait(POLL_SECONDS):
                self._tick()
            self._stop_all()
        finally:
            sock.close()
            if own_dir:
                shutil.rmtree(self.watch_dir, ignore_errors=True)
        return self.exit_code

    def _tick(self) -> None:
        """One round of supervision: reap exits, catch stalls, run recycles."""
        now = time.monotonic()
        missing = self.config.workers - sum(1 for c in self.children if c.replaces is None)
        if missing > 0 and self.backoff.may_start(now):  # a death (after its backoff), or no free slot last round
            for _ in range(missing):
                owed = self._drained_owed > 0
                if self._spawn(drained=owed) is not None and owed:
                    self._drained_owed -= 1
        for child in list(self.children):
            if not child.process.is_alive():
                self._reap(child)
                continue
            if child.ready_at is None and child.slot.state in (watchdog.STATE_READY, watchdog.STATE_RECYCLE):
                child.ready_at = now
            self.backoff.served(child.started_at, child.ready_at, now)  # ends a streak of failed starts
            self._watch(child)
            if self.should_exit.is_set():
                return
            wanted = child.slot.state == watchdog.STATE_RECYCLE or (child.house_stalled and not child.recycle_skipped)
            if wanted and child.replacement is None and not child.retiring and self.backoff.may_start(now):
                log.warning("worker process [%s] %s: starting its replacement", child.pid,
                            "has a stuck housekeeping thread" if child.house_stalled else
                            f"asks to be recycled ({child.slot.stuck} pool threads stuck past their deadline)")
                child.replacement = self._spawn(replaces=child, drained=child.slot.drained)
            new = child.replacement
            if new is not None and not child.retiring and new.slot.state == watchdog.STATE_READY:
                log.warning("worker process [%s] listens: draining worker process [%s] (SIGTERM)", new.pid,
                            child.pid)
                child.retiring = True
                child.stopping_at = time.monotonic()
                os.kill(child.pid, signal.SIGTERM)

    def _reap(self, child: Child) -> None:
        """A worker process has exited: free its slot and decide whether to start another."""
        child.process.join()
        self.children.remove(child)
        self._free.append(child.slot.index)
        code = child.process.exitcode
        if code == STARTUP_FAILURE:
            log.error("worker process [%s] failed to start; stopping (see its log above)", child.pid)
            self.exit_code = STARTUP_FAILURE
            self.should_exit.set()
            return
        if self.should_exit.is_set():
            return
        if child.retiring:
            log.info("worker process [%s] recycled (exit code %s); [%s] serves in its place", child.pid, code,
                     child.replacement.pid if child.replacement else "?")
            if child.replacement is not None:
                child.replacement.replaces = None
            return
        now = time.monotonic()
        served = self.backoff.served(child.started_at, child.ready_at, now)
        # Held drained by an operator and gone without its own shutdown (a crash, a SIGKILL, the
        # watchdog): whatever takes its place starts drained. A SIGTERMed worker exits cleanly and
        # its replacement serves (the operator restarted it).
        # One killed by _watch_stop went through its shutdown too, only not to the end.
        drained = child.slot.drained if child.slot.state != watchdog.STATE_EXITING and child.stopping_at is None else 0
        if child.replaces is not None:  # a replacement died before taking over: the original serves on
            delay = self.backoff.failed(now)
            log.warning("replacement worker process [%s] died with exit code %s before it listened (%d failed "
                        "starts in a row): the next try in %.1f s", child.pid, code, self.backoff.failures, delay)
            child.replaces.replacement = None
            return
        if child.replacement is not None:  # it died while its replacement starts: that one takes over
            log.warning("worker process [%s] died with exit code %s; its replacement [%s] takes over", child.pid,
                        code, child.replacement.pid)
            child.replacement.replaces = None
            return
        if drained:
            log.warning("worker process [%s] was drained (manage.py drain) when it died: its replacement starts "
                        "drained (manage.py undrain resumes it)", child.pid)
            self._drained_owed += 1
        # A crash loop: back off (_tick starts the next one once the wait is over). A worker that
        # went through its own shutdown (SIGTERMed by an operator, orphaned) did not fail to start.
        if not served and child.slot.state != watchdog.STATE_EXITING:
            delay = self.backoff.failed(now)
            log.error("worker process [%s] died with exit code %s %s (%d failed starts in a row): starting another "
                      "in %.1f s (doubling each time, at most EXECAPP['RESTART_BACKOFF_MAX_SECONDS'] = %g s)",
                      child.pid, code, "before it listened" if child.ready_at is None else
                      "soon after it listened", self.backoff.failures, delay, self.backoff.cap)
            return
        if not child.killed:
            log.warning("worker process [%s] died with exit code %s; starting another", child.pid, code)
        if self._spawn(drained=drained) is not None and drained:
            self._drained_owed -= 1

    def _watch_start(self, child: Child) -> None:
        """Kill (and so replace, after the restart backoff) ``child`` if it has not listened within
        ``start_timeout`` of its start: hung in its imports (no heartbeat yet, nothing else watches
        it) or in building its Worker (a service factory, a database that never answers)."""
        if (child.killed or child.ready_at is not None or self.start_timeout <= 0
                or child.slot.state in (watchdog.STATE_READY, watchdog.STATE_RECYCLE, watchdog.STATE_DRAINING,
                                        watchdog.STATE_EXITING)):
            return
        waited = time.monotonic() - child.started_at
        if waited <= self.start_timeout:
            return
        child.killed = True
        log.error("worker process [%s] did not listen within %g s of its start (EXECAPP['WORKER_START_TIMEOUT_SECONDS']"
                  "; state %s, %s): killing it (its threads' stacks follow) and starting another", child.pid,
                  self.start_timeout, watchdog.STATE_NAMES.get(child.slot.state, "?"),
                  "its loop beats" if child.slot.heartbeat > 0 else "no heartbeat yet: stuck before its loop ran")
        self._dump_and_kill(child)

    def _dump_and_kill(self, child: Child) -> None:
        """SIGUSR1 (faulthandler writes every thread's stack to the log), then SIGKILL."""
        try:
            os.kill(child.pid, signal.SIGUSR1)
            time.sleep(STACK_DUMP_SECONDS)
            child.process.kill()
        except ProcessLookupError:
            pass

    def _watch_stop(self, child: Child) -> None:
        """Kill ``child`` if it is still there ``stop_timeout`` after it began to stop (the drain's
        grace, the close timeout and 10 s, as when the supervisor stops every worker). A worker told
        to stop alone (an operator's SIGTERM, a recycle) was never bounded: one whose stop hung (a
        service's close that never returns, with its loop beating; a thread its exit waits for, its
        loop over and so no heartbeat) stayed for ever, counted as a worker, and none replaced it."""
        state = child.slot.state
        if child.killed or self.stop_timeout <= 0:
            return
        now = time.monotonic()
        if child.stopping_at is None:
            if state in (watchdog.STATE_DRAINING, watchdog.STATE_EXITING):
                child.stopping_at = now
            return
        took = now - child.stopping_at
        if took <= self.stop_timeout:
            return
        child.killed = True
        log.error("worker process [%s] still %s %.1f s after it began to stop (limit %g s: the drain's grace, "
                  "--close-timeout and 10 s): killing it (its threads' stacks follow)%s", child.pid,
                  watchdog.STATE_NAMES.get(state, str(state)), took, self.stop_timeout,
                  "" if child.retiring or self.should_exit.is_set() else " and starting another")
        self._dump_and_kill(child)

    def _watch_house(self, child: Child) -> None:
        """Recycle a ready ``child`` whose housekeeping thread has not come round for ``house_limit``
        seconds: a service's tick that does not return. Its loop beats and it serves, but without
        the housekeeper it counts no stuck pool threads (so is never recycled for them), applies no
        new quarantine entry and publishes no metrics, snapshots or history; nothing saw it."""
        if child.killed or child.house_stalled or self.house_limit <= 0 or child.slot.state != watchdog.STATE_READY:
            return
        beat = child.slot.house_beat
        if beat <= 0:
            return  # not come round yet
        silent = time.monotonic() - beat
        if silent <= self.house_limit or time.monotonic() - child.slot.house_beat <= self.house_limit:
            return  # (read twice: a torn read)
        child.house_stalled = True
        if child.ready_at is not None and beat < child.ready_at:
            # Stuck since before it listened (its first round of ticks: the worker listened anyway
            # after STARTUP_READY_SECONDS): a replacement would most likely start the same way, and
            # recycling it again and again would close every client's connection each time.
            log.error("worker process [%s]: its housekeeping thread has not come round for %.1f s, since before "
                      "the worker listened (a service's first tick is stuck; the threads' stacks follow): not "
                      "recycled, a replacement would start the same way; restart the server once it is fixed",
                      child.pid, silent)
            child.recycle_skipped = True
        else:
            log.error("worker process [%s]: its housekeeping thread has not come round for %.1f s (limit %g s, "
                      "EXECAPP['HOUSEKEEPER_STALL_SECONDS']): a service's tick is stuck (the threads' stacks follow). "
                      "Without it the worker counts no stuck pool threads, applies no quarantine entry and publishes "
                      "no metrics, snapshots or history: recycling it (its replacement first, then it drains)",
                      child.pid, silent, self.house_limit)
        try:
            os.kill(child.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass

    def _watch(self, child: Child) -> None:
        """Kill and replace ``child`` if its loop has not beaten for ``stall_limit`` seconds, or if it
        has not started (``_watch_start``) or stopped (``_watch_stop``) in time; recycle it if its
        housekeeper is stuck (``_watch_house``)."""
        self._watch_start(child)
        self._watch_stop(child)
        self._watch_house(child)
        if child.killed or child.slot.state in (watchdog.STATE_EXITING, watchdog.STATE_EMPTY):
            return
        beat = child.slot.heartbeat
        if beat <= 0:
            return  # not beating yet: still importing (no loop to watch)
        stalled = time.monotonic() - beat
        if stalled <= self.stall_limit or time.monotonic() - child.slot.heartbeat <= self.stall_limit:
            return  # (read twice: an 8-byte read racing the write could be torn)
        child.killed = True
        name, truncated = child.slot.mark()
        if name:
            reason = (f"stalled the event loop of worker process {child.pid} for {stalled:.1f} s while running "
                      f"inline (EXECAPP['LOOP_STALL_SECONDS'] is {self.stall_limit:g})")
            assert self.watch_dir is not None
            append_quarantine(self.watch_dir, name, truncated, reason)
            log.error("worker process [%s]: event loop stalled for %.1f s (limit %g s) running matcher %s inline: "
                      "quarantined on every worker (it runs in the pool only from now on); killing the worker "
                      "and starting another", child.pid, stalled, self.stall_limit, name + ("..." if truncated else ""))
        else:
            log.error("worker process [%s]: event loop stalled for %.1f s (limit %g s) outside any inline handler "
                      "(server code, or a pooled handler holding the GIL: the threads' stacks follow); killing the "
                      "worker and starting another", child.pid, stalled, self.stall_limit)
        self._dump_and_kill(child)

    def _stop_all(self) -> None:
        # SIGTERM each worker: it drains (bounded by the grace), closes its connections with
        # 1012 and exits. The STOPPING flag tells each that it is not being replaced: it keeps
        # listening through its drain, so probes get 503. A SIGINT from a terminal reached them
        # already; a second SIGINT (or a second signal here) forces them, as uvicorn does.
        assert self.slots is not None
        self.slots.flags = self.slots.flags | watchdog.FLAG_STOPPING
        forced = len(self.signals) > 1
        self._signal_children(signal.SIGINT if forced else signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        while time.monotonic() < deadline and any(c.process.is_alive() for c in self.children):
            if not forced and len(self.signals) > 1:
                # A second signal while the workers drain (an impatient operator, `kill -INT` twice,
                # an orchestrator's second stop): force them, as a second Ctrl+C does in uvicorn. A
                # terminal's Ctrl+C reaches the workers by itself; a signal sent to this pid does not.
                forced = True
                log.warning("second signal (%s) while the workers drain: forcing them to exit now (events in "
                            "flight get no done)", signal.Signals(self.signals[-1]).name)
                self._signal_children(signal.SIGINT)
            for child in self.children:
                if child.process.is_alive():
                    self._watch(child)  # a drain that stalls its loop is a stall too
            time.sleep(POLL_SECONDS)
        for child in self.children:
            if child.process.is_alive():
                log.error("worker process [%s] still running %.0f s after SIGTERM; killing it", child.pid,
                          self.stop_timeout)
                child.process.kill()
            child.process.join()
            log.info("worker process [%s] exited (%s)", child.pid, child.process.exitcode)

    def _signal_children(self, sig: int) -> None:
        for child in self.children:
            if child.process.is_alive():
                try:
                    os.kill(child.pid, sig)
                except ProcessLookupError:  # exited since is_alive(): nothing to stop
                    pass


def build_parser() -> argparse.ArgumentParser:
    """The command-line options of ``python -m execapp.serve``."""
    env = os.environ
    p = argparse.ArgumentParser(prog="python -m execapp.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--app", default=DEFAULT_APP, help=f"ASGI application (default {DEFAULT_APP})")
    p.add_argument("--host", default=env.get("HOST", "127.0.0.1"), help="bind address (env HOST; 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(env.get("PORT", "8000")), help="bind port (env PORT; 8000)")
    p.add_argument("--workers", type=int, default=int(env.get("WORKERS", env.get("WEB_CONCURRENCY", "1"))),
                   help="worker processes, one ExecPool each (env WORKERS or WEB_CONCURRENCY; 1)")
    p.add_argument("--grace", type=float, default=None,
                   help="seconds a stopping worker waits for accepted events (EXECAPP['SHUTDOWN_GRACE_SECONDS'])")
    p.add_argument("--close-timeout", type=int, default=DEFAULT_CLOSE_TIMEOUT,
                   help=f"seconds to wait for connections to close after the drain ({DEFAULT_CLOSE_TIMEOUT})")
    p.add_argument("--log-level", default=env.get("LOG_LEVEL", "info"),
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--no-access-log", action="store_true", help="do not log every request")
    p.add_argument("--shared-socket", action="store_true",
                   help="workers share one listening socket instead of one SO_REUSEPORT socket each "
                        "(the default where SO_REUSEPORT exists: connections spread evenly)")
    p.add_argument("--forwarded-allow-ips", default=env.get("FORWARDED_ALLOW_IPS"),
                   help="proxies whose X-Forwarded-* headers are trusted (env FORWARDED_ALLOW_IPS)")
    p.add_argument("--skip-checks", action="store_true",
                   help="start even if `manage.py check` reports errors (by default the server does not start)")
    return p


#: uvicorn's limit on one WebSocket message, as a multiple of EXECAPP['MAX_FRAME_BYTES']. A held
#: connection (execapp.outbox) may hold two messages up to it, the one waiting for the app and the
#: one uvicorn reads meanwhile, so one owner's MAX_CONNECTIONS_PER_OWNER connections may hold
#: 1000 x 2 x 128 KiB on a worker at the defaults (4x with a 1 MiB floor: ~2 GiB; the floor served
#: nothing: no client needs a frame the app refuses anyway). Twice the app's limit still answers a
#: frame somewhat over it with a `too_large` error frame instead of a close.
WS_MAX_SIZE_FACTOR = 2


def ws_max_size(max_frame_bytes: int) -> int:
    """The largest WebSocket message the server reads (larger: closed with 1009)."""
    return WS_MAX_SIZE_FACTOR * max_frame_bytes


def make_config(args: argparse.Namespace) -> uvicorn.Config:
    """The uvicorn Config our server runs with (lifespan off: the Worker's life is ExecServer's)."""
    if args.workers < 1:
        raise SystemExit(f"--workers {args.workers}: need at least 1")
    from . import conf  # the settings module is named by now (main, or the tests' settings)

    try:
        handshake.read_limits()  # each worker reads them again at its first connection
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return uvicorn.Config(
        args.app, host=args.host, port=args.port, workers=args.workers, lifespan="off",
        # uvicorn's httptools protocol plus a deadline on each request's headers and a cap on the
        # connections waiting for them (slowloris; docs/operations.md).
        http=handshake.HandshakeDeadlineProtocol,
        # uvicorn's sans-I/O WebSocket protocol, which also stops reading a client whose writes
        # back up (a client sending pings it never reads the pongs of; execapp/ws_flow.py).
        ws=BackpressuredWebSocketProtocol,
        # permessage-deflate costs ~25% throughput on small JSON frames (runtime-facts.md).
        ws_per_message_deflate=False, timeout_graceful_shutdown=args.close_timeout,
        # uvicorn's default (16 MiB) let one client that does not read hold 16 MiB frames in the
        # worker before the app's own MAX_FRAME_BYTES refused them: a frame up to twice that still
        # gets a too_large error frame, a larger one closes the connection (1009).
        ws_max_size=ws_max_size(int(conf.get("MAX_FRAME_BYTES"))),
        log_level=args.log_level, access_log=not args.no_access_log,
        forwarded_allow_ips=args.forwarded_allow_ips,
        # LOG_FORMAT=json (config/settings.py): uvicorn's own lines are JSON as well.
        log_config=logjson.uvicorn_log_config(uvicorn.config.LOGGING_CONFIG) if logjson.wanted()
        else uvicorn.config.LOGGING_CONFIG,
    )


def settings_pass_checks() -> bool:
    """Django's system checks, as ``manage.py check`` runs them (the EXECAPP settings' among them),
    before any worker starts: False, with every error and its hint logged, when one fails."""
    from django.conf import settings
    from django.core import checks

    # Without this a mistake reached the workers: a value their code refused crashed each start
    # (the supervisor restarted them for ever, a traceback each), one it did not (a negative
    # threshold, nan) served silently wrong. Warnings are logged and the server starts.
    silenced = set(getattr(settings, "SILENCED_SYSTEM_CHECKS", ()))
    issues = [m for m in checks.run_checks() if m.id not in silenced and m.level >= checks.WARNING]
    for issue in issues:  # one record each: the plain log format keeps a record on one line
        log.log(logging.ERROR if issue.is_serious() else logging.WARNING, "%s: %s%s", issue.id, issue.msg,
                f" (hint: {issue.hint})" if issue.hint else "")
    errors = sum(1 for issue in issues if issue.is_serious())
    if errors:
        log.error("not starting: %d error(s) in the settings above (`manage.py check` lists them too; "
                  "--skip-checks starts anyway)", errors)
    return not errors


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server: a Supervisor (the watchdog) over ``--workers`` spawned worker processes, one included."""
    args = build_parser().parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, os.getcwd())
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Several processes (a recycle runs a replacement beside its predecessor even with one
        # worker): /metrics must add them up (prometheus_client's multiprocess mode,
        # docs/observability.md). Set before the workers start, as prometheus_client requires.
        path = os.path.join(tempfile.gettempdir(), f"execapp-prometheus-{args.port}")
        os.makedirs(path, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    import django

    django.setup()
    if not args.skip_checks and not settings_pass_checks():
        return STARTUP_FAILURE
    config = make_config(args)
    from . import conf

    grace = args.grace if args.grace is not None else float(conf.get("SHUTDOWN_GRACE_SECONDS"))
    log.info("execapp.serve: %d worker process%s on %s:%d (metrics in %s)", config.workers,
             "" if config.workers == 1 else "es", config.host, config.port, os.environ["PROMETHEUS_MULTIPROC_DIR"])
    reuse_port = hasattr(socket, "SO_REUSEPORT") and not args.shared_socket
    return Supervisor(config, args.grace, stop_timeout=grace + args.close_timeout + 10, reuse_port=reuse_port,
                      stall_limit=float(conf.get("LOOP_STALL_SECONDS")),
                      restart_backoff=float(conf.get("RESTART_BACKOFF_MAX_SECONDS")),
                      start_timeout=float(conf.get("WORKER_START_TIMEOUT_SECONDS")),
                      house_limit=float(conf.get("HOUSEKEEPER_STALL_SECONDS")),
                      watch_dir=os.environ.get(watchdog.ENV_DIR) or None).run()


if __name__ == "__main__":
    sys.exit(main())
