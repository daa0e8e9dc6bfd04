"""The worker side of the control protocol: the listener that answers requests for one worker."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from typing import Any

from . import conf
from .control import ANSWER, CONTROL_GROUP, OPS, REQUEST
from .control_registry import Registry, process_namespace
from .drain import drain_worker, hold_drained, undrain_worker
from .engine.ratelog import RateLimitedLog
from .layer_watch import REFRESH_SECONDS, LayerWatch
from .seams import WorkerLike
from .status import worker_status

log = logging.getLogger("execapp.control")
#: A registry that cannot be reached fails every beat: one line per cause a minute.
_rare = RateLimitedLog(log, 60.0)

#: How often a worker checks its control membership (then beats the registry): at most this, and
#: at most EXECAPP['LAYER_CHECK_SECONDS'].
HEARTBEAT_SECONDS = 1.0
#: This process's pid namespace: a command on the same machine tells a dead worker from a silent one.
_PIDNS = process_namespace()
#: A receive that keeps failing while the layer answers backs off from the first to the second.
_RECEIVE_BACKOFF_SECONDS = (0.05, 1.0)


async def handle(worker: WorkerLike, message: dict[str, Any]) -> dict[str, Any] | None:
    """Carry out one request on ``worker``; the answer's result, or None if it is not for this worker."""
    target = message.get("worker")
    if target and target != worker.id:
        return None
    op = message.get("op")
    # Drains block (they poll counters until the events finish): a thread, so the listener's
    # loop keeps answering other requests (a status during a drain) meanwhile.
    if op == "drain":
        timeout = message.get("timeout")
        timeout = float(conf.get("DRAIN_TIMEOUT_SECONDS") if timeout is None else timeout)
        # A replacement of this worker starts drained too (until undrain); after a drain of every
        # worker, so does any worker that starts beside it (one restarting as the drain was sent).
        hold_drained(worker, True, everyone=not target)
        return await asyncio.to_thread(drain_worker, worker, timeout)
    if op == "undrain":
        return await asyncio.to_thread(undrain_worker, worker)
    if op == "status":
        return await asyncio.to_thread(worker_status, worker)
    return {"worker": worker.id, "ok": False, "error": f"unknown op {op!r}; use one of {', '.join(OPS)}"}


class ControlListener:
    """Answers control requests for one worker: joins the group, beats, serves until stopped.

    It survives the channel layer (a Redis restart): a failed receive waits for its LayerWatch,
    and every beat first checks the layer (``LayerWatch.check``: the group membership is re-added
    when Redis is back or lost it) and only then beats the registry, so commands expect this
    worker again only once its membership is back (docs/operations.md, "When Redis goes away").
    """

    def __init__(self, worker: WorkerLike, layer: Any, registry: Registry | None = None) -> None:
        self.worker = worker
        self.layer = layer
        self.registry = registry
        self.channel: str | None = None
        self.ready = threading.Event()
        self._tasks: set[asyncio.Task] = set()
        # The beat drives the checks (check, then beat): the watch runs no checker of its own.
        self.watch = LayerWatch(layer, f"control {worker.id}", autocheck=False)
        self.interval = min(HEARTBEAT_SECONDS, self.watch.interval)
        self._registry_failing = False

    def info(self) -> dict[str, Any]:
        """What a command learns about this worker before it answers."""
        return {"pid": os.getpid(), "host": socket.gethostname(), "pidns": _PIDNS, "channel": self.channel,
                "started_at": getattr(self.worker, "started_at", None)}

    async def serve(self) -> None:
        """Join, then answer requests until cancelled; on the way out leave the group and registry.

        Ready (``self.ready``) once it joined, or once it knows the layer is down (then it joins
        when the layer answers again, and beats only after that)."""
        self.channel = await self.layer.new_channel()
        await self.watch.add(CONTROL_GROUP, self.channel)  # never raises: a down layer is joined later
        if self.registry is not None and self.watch.up:  # expected by commands once reachable
            await asyncio.to_thread(self._beat_registry)
        beats = asyncio.create_task(self._beat())
        self.ready.set()
        backoff = _RECEIVE_BACKOFF_SECONDS[0]
        try:
            while True:
                try:
                    message = await self.layer.receive(self.channel)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis went away: wait for the watch to have it back
                    self.watch.failed(exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _RECEIVE_BACKOFF_SECONDS[1])
                    await self.watch.wait_up()
                    continue
                backoff = _RECEIVE_BACKOFF_SECONDS[0]
                if message.get("type") == REQUEST:
                    task = asyncio.create_task(self._answer(message))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        finally:
            beats.cancel()
            for task in list(self._tasks):  # a drain in progress keeps running in its thread
                task.cancel()
            await self.watch.discard(CONTROL_GROUP, self.channel)  # a down layer: its group expiry cleans up
            if self.registry is not None:
                await asyncio.to_thread(self._quietly, self.registry.remove, self.worker.id)

    async def _answer(self, message: dict[str, Any]) -> None:
        try:
            result = await handle(self.worker, message)
        except Exception as exc:
            log.exception("control op %r failed on %s", message.get("op"), self.worker.id)
            result = {"worker": self.worker.id, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if result is None or not message.get("reply_to"):
            return
        answer = {"type": ANSWER, "request": message.get("request"), "op": message.get("op"),
                  "worker": self.worker.id, "result": result}
        try:
            await self.layer.send(message["reply_to"], answer)
        except Exception:
            log.exception("could not answer control op %r from %s", message.get("op"), self.worker.id)

    async def _beat(self) -> None:
        # Check first (re-adding the membership if Redis lost it or was down), beat only then:
        # a command never expects a worker whose membership is not back yet.
        refreshed = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            refresh = time.monotonic() - refreshed >= REFRESH_SECONDS
            if await self.watch.check(refresh) and self.registry is not None:
                if refresh:
                    refreshed = time.monotonic()
                await asyncio.to_thread(self._beat_registry)

    def _beat_registry(self) -> None:
        """One registry beat; a failure is logged once until a beat works again (never raised)."""
        assert self.registry is not None
        try:
            self.registry.beat(self.worker.id, self.info())
        except Exception as exc:  # advisory: a failed beat must not stop the listener
            if not self._registry_failing:
                log.warning("control registry beat of %s failed (retrying every %.1f s): %r", self.worker.id,
                            self.interval, exc)
            self._registry_failing = True
            return
        if self._registry_failing:
            log.warning("control registry beat of %s works again", self.worker.id)
            self._registry_failing = False

    @staticmethod
    def _quietly(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # the registry is advisory: a failed beat must not stop the listener
            log.warning("control registry call %s failed", getattr(fn, "__name__", fn), exc_info=True)
