"""The control protocol: drain, undrain and status requests to every worker over the channel layer.

Every worker process runs a ``ControlListener`` on a thread of its own, with its own event loop
and its own channel-layer instance (channels_redis allows one receiving loop per layer
instance, and the ASGI loop's consumers already receive on the shared one). The listener joins
the group ``execapp.workers`` and, with Redis, beats a heartbeat into a registry so a command
knows which workers to expect. A command (``request``) makes a reply channel, group-sends one
request and collects one answer per worker until all expected workers answered or its deadline
passed; a worker that stayed silent is named in ``ControlResult.missing``.

Messages (msgpack'd by channels_redis, so plain data only):
  request: {"type": "execapp.control", "op": "status"|"drain"|"undrain", "request": <id>,
            "reply_to": <channel>, "worker": <id or None: every worker>, "timeout": <seconds>}
  answer:  {"type": "execapp.control.reply", "request": <id>, "op": ..., "worker": <id>,
            "result": {...}}  (drain: execapp.drain.drain_worker's report)
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from .engine.errors import ExecAppError

log = logging.getLogger("execapp.control")

#: The channel-layer group every worker's listener joins.
CONTROL_GROUP = "execapp.workers"
#: Redis keys of the registry, after the channel layer's prefix (REDIS_PREFIX, "asgi" by
#: default): a sorted set (worker id -> last beat) and a hash (id -> info JSON).
REGISTRY_KEY = "execapp:control:workers"
REGISTRY_INFO_KEY = "execapp:control:info"
HEARTBEAT_SECONDS = 1.0
#: A worker whose last beat is older than this is not expected to answer (crashed or gone).
LIVE_SECONDS = 5.0
#: A worker re-joins the group this often: channels_redis expires membership after a day, and a
#: Redis restarted without persistence has forgotten it.
REJOIN_SECONDS = 10.0
#: Extra time a command waits past a drain's own timeout for the answers to travel.
ANSWER_MARGIN_SECONDS = 3.0
OPS = ("status", "drain", "undrain")


class ControlUnavailable(ExecAppError):
    """The configured channel layer cannot reach workers in other processes (in-memory)."""

    code = "control_unavailable"


class UnknownWorker(ExecAppError):
    """``--worker ID`` names no live worker."""

    code = "unknown_worker"


# -- which layer, which registry -----------------------------------------------------------------

def layer_backend() -> str:
    """The dotted class path of the default channel layer ('' when none is configured)."""
    from channels import DEFAULT_CHANNEL_LAYER
    from django.conf import settings

    return (getattr(settings, "CHANNEL_LAYERS", {}) or {}).get(DEFAULT_CHANNEL_LAYER, {}).get("BACKEND", "")


def shared_layer_configured() -> bool:
    """True when the channel layer crosses processes (not in-memory): control can work."""
    backend = layer_backend()
    return bool(backend) and not backend.endswith("InMemoryChannelLayer")


def require_shared_layer() -> None:
    """Raise ControlUnavailable, saying what to do, unless the channel layer crosses processes."""
    if not shared_layer_configured():
        raise ControlUnavailable(
            f"the channel layer is {layer_backend() or 'not configured'}, which cannot reach the server from "
            "another process: set REDIS_URL (e.g. REDIS_URL=redis://127.0.0.1:6379/0) for the server and for this "
            "command. The embedded single-process server drains on its own when stopped: press Ctrl+C or send it "
            "SIGTERM (it waits up to EXECAPP['SHUTDOWN_GRACE_SECONDS'] for every accepted event's done); "
            "GET /healthz shows whether it is draining. See docs/operations.md.")


def new_layer() -> Any:
    """A private instance of the default channel layer (its own connections and receive loop)."""
    from channels import DEFAULT_CHANNEL_LAYER
    from channels.layers import channel_layers

    return channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)


class Registry(Protocol):
    """Who should answer: workers beat with their info; ``live()`` lists the recent ones."""

    def beat(self, worker_id: str, info: dict[str, Any]) -> None: ...

    def remove(self, worker_id: str) -> None: ...

    def live(self) -> dict[str, dict[str, Any]]: ...


class RedisRegistry:
    """The registry in Redis (the deployment's): a sorted set of last beats plus an info hash."""

    def __init__(self, url: str, prefix: str = "asgi", live_seconds: float = LIVE_SECONDS) -> None:
        import redis

        self.redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self.key = f"{prefix}:{REGISTRY_KEY}"
        self.info_key = f"{prefix}:{REGISTRY_INFO_KEY}"
        self.live_seconds = live_seconds

    def beat(self, worker_id: str, info: dict[str, Any]) -> None:
        now = time.time()
        pipe = self.redis.pipeline()
        pipe.zadd(self.key, {worker_id: now})
        pipe.hset(self.info_key, worker_id, json.dumps(info))
        # Forget workers that died without saying so, long after anyone could expect them.
        stale = self.redis.zrangebyscore(self.key, "-inf", now - 3600)
        if stale:
            pipe.zrem(self.key, *stale)
            pipe.hdel(self.info_key, *stale)
        pipe.execute()

    def remove(self, worker_id: str) -> None:
        pipe = self.redis.pipeline()
        pipe.zrem(self.key, worker_id)
        pipe.hdel(self.info_key, worker_id)
        pipe.execute()

    def live(self) -> dict[str, dict[str, Any]]:
        ids = [i.decode() for i in self.redis.zrangebyscore(self.key, time.time() - self.live_seconds, "+inf")]
        infos = self.redis.hmget(self.info_key, ids) if ids else []
        return {i: (json.loads(raw) if raw else {}) for i, raw in zip(ids, infos)}


class LocalRegistry:
    """An in-process registry (tests, and workers sharing one process)."""

    def __init__(self, live_seconds: float = LIVE_SECONDS) -> None:
        self.live_seconds = live_seconds
        self._beats: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def beat(self, worker_id: str, info: dict[str, Any]) -> None:
        with self._lock:
            self._beats[worker_id] = (time.time(), info)

    def remove(self, worker_id: str) -> None:
        with self._lock:
            self._beats.pop(worker_id, None)

    def live(self) -> dict[str, dict[str, Any]]:
        cutoff = time.time() - self.live_seconds
        with self._lock:
            return {i: info for i, (at, info) in self._beats.items() if at >= cutoff}


def default_registry() -> Registry | None:
    """The Redis registry when REDIS_URL is set, else None (answers are collected until the deadline)."""
    from . import conf

    url = conf.redis_url()
    return RedisRegistry(url, conf.redis_prefix()) if url else None


# -- the worker side -------------------------------------------------------------------------------

async def handle(worker: Any, message: dict[str, Any]) -> dict[str, Any] | None:
    """Carry out one request on ``worker``; the answer's result, or None if it is not for this worker."""
    from . import conf
    from .drain import drain_worker, undrain_worker, worker_status

    target = message.get("worker")
    if target and target != worker.id:
        return None
    op = message.get("op")
    # Drains block (they poll counters until the events finish): a thread, so the listener's
    # loop keeps answering other requests (a status during a drain) meanwhile.
    if op == "drain":
        timeout = message.get("timeout")
        timeout = float(conf.get("DRAIN_TIMEOUT_SECONDS") if timeout is None else timeout)
        return await asyncio.to_thread(drain_worker, worker, timeout)
    if op == "undrain":
        return await asyncio.to_thread(undrain_worker, worker)
    if op == "status":
        return await asyncio.to_thread(worker_status, worker)
    return {"worker": worker.id, "ok": False, "error": f"unknown op {op!r}; use one of {', '.join(OPS)}"}


class ControlListener:
    """Answers control requests for one worker: joins the group, beats, serves until stopped."""

    def __init__(self, worker: Any, layer: Any, registry: Registry | None = None) -> None:
        self.worker = worker
        self.layer = layer
        self.registry = registry
        self.channel: str | None = None
        self.ready = threading.Event()
        self._tasks: set[asyncio.Task] = set()

    def info(self) -> dict[str, Any]:
        """What a command learns about this worker before it answers."""
        return {"pid": os.getpid(), "host": socket.gethostname(), "channel": self.channel,
                "started_at": getattr(self.worker, "started_at", None)}

    async def serve(self) -> None:
        """Join, then answer requests until cancelled; on the way out leave the group and registry."""
        self.channel = await self.layer.new_channel()
        await self.layer.group_add(CONTROL_GROUP, self.channel)
        if self.registry is not None:  # ready means reachable and expected by commands
            await asyncio.to_thread(self._quietly, self.registry.beat, self.worker.id, self.info())
        beats = asyncio.create_task(self._beat())
        self.ready.set()
        failing = False
        try:
            while True:
                try:
                    message = await self.layer.receive(self.channel)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis went away: keep trying, a deploy may bring it back
                    if not failing:
                        log.warning("control receive failed on %s (retrying every second): %s: %s",
                                    self.worker.id, type(exc).__name__, exc)
                    failing = True
                    await asyncio.sleep(1.0)
                    continue
                if failing:
                    log.info("control receive of %s works again", self.worker.id)
                    failing = False
                if message.get("type") == "execapp.control":
                    task = asyncio.create_task(self._answer(message))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        finally:
            beats.cancel()
            for task in list(self._tasks):  # a drain in progress keeps running in its thread
                task.cancel()
            try:
                await self.layer.group_discard(CONTROL_GROUP, self.channel)
            except Exception:
                log.warning("could not leave %s on %s", CONTROL_GROUP, self.worker.id, exc_info=True)
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
        answer = {"type": "execapp.control.reply", "request": message.get("request"), "op": message.get("op"),
                  "worker": self.worker.id, "result": result}
        try:
            await self.layer.send(message["reply_to"], answer)
        except Exception:
            log.exception("could not answer control op %r from %s", message.get("op"), self.worker.id)

    async def _beat(self) -> None:
        last_join = time.monotonic()
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            if self.registry is not None:
                await asyncio.to_thread(self._quietly, self.registry.beat, self.worker.id, self.info())
            if time.monotonic() - last_join >= REJOIN_SECONDS:
                last_join = time.monotonic()
                try:
                    await self.layer.group_add(CONTROL_GROUP, self.channel)
                except Exception:
                    log.warning("could not re-join %s on %s", CONTROL_GROUP, self.worker.id, exc_info=True)

    @staticmethod
    def _quietly(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # the registry is advisory: a failed beat must not stop the listener
            log.warning("control registry call %s failed", getattr(fn, "__name__", fn), exc_info=True)


class ControlThread:
    """Runs a ControlListener on a daemon thread with its own event loop (one per worker process)."""

    def __init__(self, worker: Any, layer: Any = None, registry: Registry | None = None) -> None:
        self.listener = ControlListener(worker, layer if layer is not None else new_layer(), registry)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run, name="execapp-control", daemon=True)

    def start(self, wait: float = 10.0) -> bool:
        """Start the thread; True once the listener joined the group (False: not within ``wait``
        seconds, or it failed, e.g. Redis is down; the service's tick restarts it)."""
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

    def __init__(self, worker: Any) -> None:
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


def control_service(worker: Any) -> ControlService:
    """Factory for SERVICE_FACTORIES: the worker's control listener."""
    return ControlService(worker)


# -- the command side ------------------------------------------------------------------------------

@dataclass
class ControlResult:
    """The answers to one request, by worker id, and the expected workers that stayed silent."""

    op: str
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    expected: list[str] | None = None
    waited_seconds: float = 0.0


async def request(op: str, *, layer: Any, registry: Registry | None = None, worker: str | None = None,
                  timeout: float | None = None, wait: float | None = None) -> ControlResult:
    """Send ``op`` to every worker (or to ``worker``) and collect the answers.

    ``timeout`` is the drain's own timeout (passed to the workers); ``wait`` bounds how long to
    collect answers (default: the drain timeout plus a margin, 3 s for the other ops). With a
    registry the collection ends as soon as every live worker answered; without one it lasts
    until ``wait`` runs out (every answer is kept).
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; use one of {', '.join(OPS)}")
    expected: set[str] | None = None
    if registry is not None:
        live = await asyncio.to_thread(registry.live)
        if worker is not None and worker not in live:
            raise UnknownWorker(f"no live worker {worker!r}; live workers: {', '.join(sorted(live)) or 'none'} "
                                "(run `manage.py execstatus`)")
        expected = {worker} if worker is not None else set(live)
    elif worker is not None:
        expected = {worker}
    if wait is None:
        wait = (timeout or 0.0) + ANSWER_MARGIN_SECONDS if op == "drain" else ANSWER_MARGIN_SECONDS
    if expected is not None and not expected:  # nobody is registered: give stragglers the margin only
        wait = min(wait, ANSWER_MARGIN_SECONDS)
    result = ControlResult(op, expected=sorted(expected) if expected is not None else None)
    started = time.monotonic()
    deadline = started + wait
    reply_to = await layer.new_channel()
    rid = uuid.uuid4().hex
    await layer.group_send(CONTROL_GROUP, {"type": "execapp.control", "op": op, "request": rid,
                                           "reply_to": reply_to, "worker": worker, "timeout": timeout})
    while not (expected and expected <= set(result.answers)):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            message = await asyncio.wait_for(layer.receive(reply_to), remaining)
        except asyncio.TimeoutError:
            break
        if message.get("type") == "execapp.control.reply" and message.get("request") == rid:
            result.answers[message["worker"]] = message.get("result") or {}
    result.missing = sorted((expected or set()) - set(result.answers))
    result.waited_seconds = round(time.monotonic() - started, 3)
    return result


def request_sync(op: str, *, worker: str | None = None, timeout: float | None = None,
                 wait: float | None = None) -> ControlResult:
    """``request`` from synchronous code (the management commands), on the settings' layer and registry."""
    require_shared_layer()
    layer = new_layer()
    return asyncio.run(request(op, layer=layer, registry=default_registry(), worker=worker, timeout=timeout,
                               wait=wait))
