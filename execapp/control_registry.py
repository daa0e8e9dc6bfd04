"""Who should answer a control request: workers beat with their info; ``live()`` lists the recent ones."""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Protocol, cast

from . import conf

#: Redis keys of the registry, after the channel layer's prefix (REDIS_PREFIX, "asgi" by
#: default): a sorted set (worker id -> last beat) and a hash (id -> info JSON).
REGISTRY_KEY = "execapp:control:workers"
REGISTRY_INFO_KEY = "execapp:control:info"
#: A worker whose last beat is older than this is not expected to answer (crashed or gone).
LIVE_SECONDS = 5.0


def process_namespace() -> str:
    """This kernel's boot and this process's pid namespace ('' where unknown: not Linux): two processes
    with the same one see the same pids, so one can tell that the other's process is gone."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def process_gone(info: dict[str, Any]) -> bool:
    """True when a registered worker's process provably no longer exists: it beat from this process's
    pid namespace (``info["pidns"]``) and its pid is gone or a zombie (SIGKILLed, not yet reaped).
    Anything unsure (another host or container, no namespace, a reused pid) is False: still expected."""
    pid, ns = info.get("pid"), info.get("pidns")
    if not ns or not isinstance(pid, int) or pid <= 0 or ns != process_namespace():
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[:1]
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return state == ["Z"]


class Registry(Protocol):
    """Who should answer: workers beat with their info; ``live()`` lists the recent ones."""

    def beat(self, worker_id: str, info: dict[str, Any]) -> None: ...

    def remove(self, worker_id: str) -> None: ...

    def live(self) -> dict[str, dict[str, Any]]: ...

    def silent(self, within: float) -> dict[str, tuple[float, dict[str, Any]]]: ...


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
        # The client does not decode responses: members come back as bytes.
        members = cast("list[bytes]", self.redis.zrangebyscore(self.key, time.time() - self.live_seconds, "+inf"))
        ids = [i.decode() for i in members]
        infos = self.redis.hmget(self.info_key, ids) if ids else []
        return {i: (json.loads(raw) if raw else {}) for i, raw in zip(ids, infos)}

    def silent(self, within: float) -> dict[str, tuple[float, dict[str, Any]]]:
        """Workers whose last beat is older than the live window but at most ``within`` s old:
        id -> (seconds since that beat, info)."""
        now = time.time()
        members = cast("list[tuple[bytes, float]]", self.redis.zrangebyscore(
            self.key, now - within, f"({now - self.live_seconds}", withscores=True))
        ids = [i.decode() for i, _ in members]
        infos = self.redis.hmget(self.info_key, ids) if ids else []
        return {i: (now - at, json.loads(raw) if raw else {}) for (i, (_, at), raw) in zip(ids, members, infos)}


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

    def silent(self, within: float) -> dict[str, tuple[float, dict[str, Any]]]:
        """As ``RedisRegistry.silent``."""
        now = time.time()
        with self._lock:
            return {i: (now - at, info) for i, (at, info) in self._beats.items()
                    if now - within <= at < now - self.live_seconds}


def default_registry() -> Registry | None:
    """The Redis registry when REDIS_URL is set, else None (answers are collected until the deadline)."""
    url = conf.redis_url()
    return RedisRegistry(url, conf.redis_prefix()) if url else None
