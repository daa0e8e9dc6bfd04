"""The server entry point: uvicorn with N worker processes and a drain before every shutdown.

    python -m execapp.serve --workers 2 --host 0.0.0.0 --port 8000

uvicorn's own shutdown closes every WebSocket (code 1012) before it waits for anything, which
would cut accepted events before their `done`. ``ExecServer`` runs the worker's drain first
(execapp.drain, bounded by EXECAPP['SHUTDOWN_GRACE_SECONDS']) and only then lets uvicorn close
the connections. With ``--workers N`` a small supervisor binds the socket once, runs N spawned
processes that share it (one Worker, ExecPool and engine each), forwards SIGTERM/SIGINT to
them, restarts one that dies, and waits for their drains. See docs/operations.md.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import Any, Sequence

import uvicorn
from uvicorn._subprocess import get_subprocess
from uvicorn.config import STARTUP_FAILURE

log = logging.getLogger("execapp.serve")

DEFAULT_APP = "config.asgi:application"
#: Seconds uvicorn gives clients to answer its 1012 close after the drain (then it cancels).
DEFAULT_CLOSE_TIMEOUT = 5
#: Longest wait at start for the worker's first round of service ticks (plugins loaded).
STARTUP_READY_SECONDS = 30


class ExecServer(uvicorn.Server):
    """uvicorn's server with the process's Worker started before listening and drained before closing."""

    def __init__(self, config: uvicorn.Config, grace: float | None = None) -> None:
        super().__init__(config)
        self.grace = grace
        self.worker: Any = None
        self.drain_report: dict[str, Any] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        from . import worker as worker_module

        # Built off the loop (its services may touch the database) and before the socket
        # listens, so the control listener is up and the plugins' matchers are installed (the
        # housekeeper's first round of ticks) before the first client arrives: a new worker of a
        # rolling deploy never answers an event with `matched: 0` because it was still starting.
        self.worker = await asyncio.to_thread(worker_module.get_worker)
        if not await asyncio.to_thread(self.worker.ready.wait, STARTUP_READY_SECONDS):
            log.warning("worker %s: services not ready after %d s; serving anyway", self.worker.id,
                        STARTUP_READY_SECONDS)
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # 1. No new connections to this process: siblings (or the next deploy) take them.
        for server in getattr(self, "servers", []):
            server.close()
        # 2. Drain in a thread: the loop must keep running to send the `done` frames waited for.
        if self.worker is not None and not self.force_exit:
            from . import conf
            from .drain import drain_worker

            grace = float(self.grace if self.grace is not None else conf.get("SHUTDOWN_GRACE_SECONDS"))
            log.info("draining worker %s before shutdown (grace %.1f s)", self.worker.id, grace)
            self.drain_report = await asyncio.to_thread(drain_worker, self.worker, grace,
                                                        abort=lambda: self.force_exit)
            if self.drain_report["ok"]:
                log.info("worker %s drained: %s events, %s tasks in %.2f s", self.worker.id,
                         self.drain_report["finished"]["events"], self.drain_report["finished"]["tasks"],
                         self.drain_report["elapsed_seconds"])
            else:
                log.error("worker %s NOT drained (%s) after %.2f s; still running: %s; %s events without done",
                          self.worker.id, self.drain_report["reason"], self.drain_report["elapsed_seconds"],
                          ", ".join(self.drain_report["still_running"]) or "-",
                          self.drain_report["events_in_flight"])
        # 3. uvicorn's own sequence: close connections (1012), wait for them, then the tasks.
        await super().shutdown(sockets)
        # 4. Stop the worker: final profile flush, leave the control group and registry.
        if self.worker is not None:
            await asyncio.to_thread(self.worker.stop, 1.0)


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


def _run_child(config: uvicorn.Config, grace: float | None, reuse_port: bool, sockets: list[socket.socket]) -> None:
    """Body of one spawned worker process (picklable: the supervisor hands it to multiprocessing)."""
    server = ExecServer(config, grace)
    if reuse_port:
        # Bound now but listening only once the worker is ready (ExecServer.startup), so the
        # kernel never hands a connection to a worker still loading its plugins.
        sockets = [reuse_port_socket(config, listen=False)]
    server.run(sockets=sockets)


class Supervisor:
    """Runs N ExecServer processes on one port; forwards stop signals and waits for the drains.

    ``reuse_port``: each worker listens on its own SO_REUSEPORT socket (Linux; even spread of
    connections). Otherwise the workers share one socket bound here.
    """

    def __init__(self, config: uvicorn.Config, grace: float | None, stop_timeout: float,
                 reuse_port: bool = False) -> None:
        self.config = config
        self.grace = grace
        self.stop_timeout = stop_timeout
        self.reuse_port = reuse_port
        self.should_exit = threading.Event()
        self.signals: list[int] = []
        self.processes: list[Any] = []
        self.exit_code = 0

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)
        self.should_exit.set()

    def _spawn(self, sock: socket.socket) -> Any:
        target = functools.partial(_run_child, self.config, self.grace, self.reuse_port)
        process = get_subprocess(self.config, target, [] if self.reuse_port else [sock])
        process.start()
        log.info("started worker process [%s]", process.pid)
        return process

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
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        self.processes = [self._spawn(sock) for _ in range(self.config.workers)]
        while not self.should_exit.wait(0.5):
            self._keep_alive(sock)
        self._stop_all()
        sock.close()
        return self.exit_code

    def _keep_alive(self, sock: socket.socket) -> None:
        for i, process in enumerate(self.processes):
            if process.is_alive() or self.should_exit.is_set():
                continue
            process.join()
            if process.exitcode == STARTUP_FAILURE:
                log.error("worker process [%s] failed to start; stopping (see its log above)", process.pid)
                self.exit_code = STARTUP_FAILURE
                self.should_exit.set()
                return
            log.warning("worker process [%s] died with exit code %s; starting another", process.pid,
                        process.exitcode)
            self.processes[i] = self._spawn(sock)

    def _stop_all(self) -> None:
        # SIGTERM each worker: it drains (bounded by the grace), closes its connections with
        # 1012 and exits. A SIGINT from a terminal reached them already; a second SIGINT (or a
        # second signal here) forces them, as uvicorn does.
        forced = len(self.signals) > 1
        for process in self.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGINT if forced else signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("worker process [%s] still running %.0f s after SIGTERM; killing it", process.pid,
                          self.stop_timeout)
                process.kill()
                process.join()
            log.info("worker process [%s] exited (%s)", process.pid, process.exitcode)


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
    return p


def make_config(args: argparse.Namespace) -> uvicorn.Config:
    """The uvicorn Config our server runs with (lifespan off: the Worker's life is ExecServer's)."""
    if args.workers < 1:
        raise SystemExit(f"--workers {args.workers}: need at least 1")
    return uvicorn.Config(
        args.app, host=args.host, port=args.port, workers=args.workers, lifespan="off",
        # permessage-deflate costs ~25% throughput on small JSON frames (runtime-facts.md).
        ws_per_message_deflate=False, timeout_graceful_shutdown=args.close_timeout,
        log_level=args.log_level, access_log=not args.no_access_log,
        forwarded_allow_ips=args.forwarded_allow_ips,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server: in this process for one worker, under a Supervisor for several."""
    args = build_parser().parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    sys.path.insert(0, os.getcwd())
    config = make_config(args)
    if config.workers == 1:
        ExecServer(config, args.grace).run()
        return 0
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Several processes: /metrics must add them up (prometheus_client's multiprocess mode,
        # docs/observability.md). Set before the workers start, as prometheus_client requires.
        path = os.path.join(tempfile.gettempdir(), f"execapp-prometheus-{config.port}")
        os.makedirs(path, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    import django

    django.setup()
    from . import conf

    grace = args.grace if args.grace is not None else float(conf.get("SHUTDOWN_GRACE_SECONDS"))
    log.info("execapp.serve: %d worker processes on %s:%d (metrics in %s)", config.workers, config.host, config.port,
             os.environ["PROMETHEUS_MULTIPROC_DIR"])
    reuse_port = hasattr(socket, "SO_REUSEPORT") and not args.shared_socket
    return Supervisor(config, args.grace, stop_timeout=grace + args.close_timeout + 10, reuse_port=reuse_port).run()


if __name__ == "__main__":
    sys.exit(main())
