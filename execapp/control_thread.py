"""The control listener's thread and the worker service that keeps it running."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from .control import new_layer, shared_layer_configured
from .control_listener import ControlListener
from .control_registry import Registry, default_registry
from .seams import WorkerLike

log = logging.getLogger("execapp.control")


class ControlThread:
    """Runs a ControlListener on a daemon thread with its own event loop (one per worker process)."""

    def __init__(self, worker: WorkerLike, layer: Any = None, registry: Registry | None = None) -> None:
        self.listener = ControlListener(worker, layer if layer is not None else new_layer(), registry)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run, name="execapp-control", daemon=True)

    def start(self, wait: float = 10.0) -> bool:
        """Start the thread; True once the listener is ready: joined, or knowing that the layer is
        down (it joins once Redis answers: execapp.layer_watch). False: not within ``wait``
        seconds, or the thread died (the service's tick restarts it)."""
        self._thread.start()
        deadline = time.monotonic() + wait
        while not self.listener.ready.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() >= deadline:
                return False
        return True

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            self._task = loop.create_task(self.listener.serve())
            loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # typically Redis unreachable; the service's tick restarts us
            log.warning("control listener of %s stopped: %s: %s", self.listener.worker.id, type(exc).__name__, exc)
        finally:
            loop.close()  # channels_redis closes this loop's connections on close

    def stop(self, timeout: float = 5.0) -> None:
        """Leave the group and the registry, stop the loop, join the thread."""
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop closed meanwhile
                pass
        self._thread.join(timeout)


class ControlService:
    """The worker service (execapp.worker.SERVICE_FACTORIES) that keeps the listener running."""

    interval = 5.0

    def __init__(self, worker: WorkerLike) -> None:
        self.worker = worker
        self.thread: ControlThread | None = None
        if shared_layer_configured():
            self._start()
        else:
            log.info("control listener off: the in-memory channel layer cannot reach other processes")

    def _start(self) -> None:
        self.thread = ControlThread(self.worker, registry=default_registry())
        if not self.thread.start():
            log.warning("control listener of %s not ready yet (is Redis up?)", self.worker.id)

    def tick(self) -> None:
        """Restart the listener if its thread died (it logs why)."""
        if self.thread is not None and not self.thread.is_alive():
            log.warning("control listener of %s died; restarting it", self.worker.id)
            self._start()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.stop()


def control_service(worker: WorkerLike) -> ControlService:
    """Factory for SERVICE_FACTORIES: the worker's control listener."""
    return ControlService(worker)
