"""The host key-value store: one namespace per plugin, in the database or in Redis."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

MAX_KEY_CHARS = 200
MAX_VALUE_CHARS = 64 * 1024


class KVStore(Protocol):
    """get/set of string values in a plugin's namespace; survives restarts."""

    def get(self, plugin: str, key: str, timeout: float) -> str | None: ...

    def set(self, plugin: str, key: str, value: str, timeout: float) -> None: ...


class DatabaseKV:
    """KV rows in plugins.KVEntry (the embedded default)."""

    def __init__(self) -> None:
        # Django refuses ORM calls on a thread running an event loop (a handler run inline),
        # and they would stall the loop: such calls hop to this one thread instead.
        self._hop = ThreadPoolExecutor(max_workers=2, thread_name_prefix="plugins-kv")

    def _run(self, fn, timeout: float):  # type: ignore[no-untyped-def]
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return fn()
        return self._hop.submit(_with_connection_cleanup, fn).result(timeout=max(timeout, 0.001))

    def get(self, plugin: str, key: str, timeout: float) -> str | None:
        from .models import KVEntry

        def query() -> str | None:
            row = KVEntry.objects.filter(plugin=plugin, key=key).values_list("value", flat=True).first()
            return row
        return self._run(query, timeout)

    def set(self, plugin: str, key: str, value: str, timeout: float) -> None:
        from .models import KVEntry

        def write() -> None:
            KVEntry.objects.update_or_create(plugin=plugin, key=key, defaults={"value": value})
        self._run(write, timeout)


def _with_connection_cleanup(fn):  # type: ignore[no-untyped-def]
    from django.db import close_old_connections
    close_old_connections()
    return fn()


class RedisKV:
    """KV in one Redis hash per plugin (``<REDIS_PREFIX>:execapp:plugins:kv:<plugin>``), shared by
    every worker."""

    def __init__(self, url: str) -> None:
        import redis

        from execapp.conf import redis_key
        self.client = redis.Redis.from_url(url, socket_timeout=5, decode_responses=True)
        self.prefix = redis_key("execapp:plugins:kv:")

    def get(self, plugin: str, key: str, timeout: float) -> str | None:
        return self.client.hget(self.prefix + plugin, key)

    def set(self, plugin: str, key: str, value: str, timeout: float) -> None:
        self.client.hset(self.prefix + plugin, key, value)


_store: KVStore | None = None
_store_url: str | None = None
_lock = threading.Lock()


def kv_store() -> KVStore:
    """The process's KV backend: Redis when settings.REDIS_URL is set, else the database."""
    global _store, _store_url
    from execapp import conf
    url = conf.redis_url()
    if _store is None or url != _store_url:
        with _lock:
            if _store is None or url != _store_url:
                _store = RedisKV(url) if url else DatabaseKV()
                _store_url = url
    return _store
