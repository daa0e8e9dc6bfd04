"""The KV stores behind the host API's ``kv_get``/``kv_set``/``kv_incr``: one namespace per plugin, in
the database (the embedded default) or in Redis (when ``REDIS_URL`` is set).

The runtimes know only the protocol (plugins.runtimes.kvstore.KVStore); the plugins app installs
``ConfiguredKV`` at ``AppConfig.ready``, which sends each call to the backend the settings name
now. Both backends check a write against the plugin's quotas atomically with the write: the
database in one transaction holding the plugin's KVUsage row (its lock waits bounded by the call's
deadline: plugins.kv_deadline), Redis in one Lua script. ``incr`` reads, adds and writes in that
same one step, so counts made at once by several threads and worker processes all land (a guest's
kv_get then kv_set lost some: 40 ``/count`` over 3 workers counted 30).
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from django.db import IntegrityError, close_old_connections, transaction
from django.db.models import F
from django.utils import timezone

from execapp import conf

from . import kv_deadline
from .models import KVEntry, KVUsage
from .runtimes.kvstore import (
    MAX_SAFE_INTEGER,
    KVStore,
    bytes_refused,
    check_quota,
    entry_bytes,
    incremented,
    keys_refused,
    not_an_integer,
    out_of_range,
)
from .spec import Quotas

T = TypeVar("T")


class DatabaseKV:
    """KV rows in plugins.KVEntry (the embedded default)."""

    def __init__(self) -> None:
        # Django refuses ORM calls on a thread running an event loop (a handler run inline),
        # and they would stall the loop: such calls hop to this one thread instead.
        self._hop = ThreadPoolExecutor(max_workers=2, thread_name_prefix="plugins-kv")

    def _run(self, fn: Callable[[], T], timeout: float) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return fn()
        return self._hop.submit(_with_connection_cleanup, fn).result(timeout=max(timeout, 0.001))

    def get(self, plugin: str, key: str, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout

        def query() -> str | None:
            with kv_deadline.read(deadline):
                return KVEntry.objects.filter(plugin=plugin, key=key).values_list("value", flat=True).first()
        return self._run(query, timeout)

    def set(self, plugin: str, key: str, value: str, timeout: float, quotas: Quotas | None = None) -> None:
        deadline = time.monotonic() + timeout

        def write() -> None:
            with kv_deadline.write_transaction(deadline):
                usage = _locked_usage(plugin)
                old = KVEntry.objects.filter(plugin=plugin, key=key).values_list("pk", "value").first()
                _write(plugin, key, value, quotas, usage, old, "kv_set")
        self._run(write, timeout)

    def incr(self, plugin: str, key: str, delta: int, timeout: float, quotas: Quotas | None = None) -> int:
        deadline = time.monotonic() + timeout

        def add() -> int:
            # The read sits after _locked_usage's UPDATE: every write of this plugin, from any thread
            # or process, waits for that lock, so nothing can change the value between read and write.
            with kv_deadline.write_transaction(deadline):
                usage = _locked_usage(plugin)
                old = KVEntry.objects.filter(plugin=plugin, key=key).values_list("pk", "value").first()
                value = incremented(key, old[1] if old else None, delta)
                _write(plugin, key, str(value), quotas, usage, old, "kv_incr")
                return value
        return self._run(add, timeout)

    def usage(self, plugin: str) -> tuple[int, int]:
        row = KVUsage.objects.filter(plugin=plugin).values_list("keys", "bytes").first()
        return (row[0], row[1]) if row else recount(plugin)


def _write(plugin: str, key: str, value: str, quotas: Quotas | None, usage: KVUsage, old: tuple[int, str] | None,
           call: str) -> None:
    """Store ``value`` over ``old`` (its row's ``(pk, value)``, or None) and the plugin's new totals,
    inside the caller's transaction holding ``usage`` locked; GuestQuota first if they pass a quota."""
    keys = usage.keys + (old is None)
    total = usage.bytes - (entry_bytes(key, old[1]) if old else 0) + entry_bytes(key, value)
    if quotas is not None:
        check_quota(plugin, quotas, keys, total, usage.bytes, old is None, call)
    # update()/bulk_create() send no post_save: KVEntry's signal handlers (signals.py)
    # recount only after writes made elsewhere (the admin).
    if old:
        KVEntry.objects.filter(pk=old[0]).update(value=value, updated_at=timezone.now())
    else:
        KVEntry.objects.bulk_create([KVEntry(plugin=plugin, key=key, value=value)])
    KVUsage.objects.filter(pk=usage.pk).update(keys=keys, bytes=total)


def _with_connection_cleanup(fn: Callable[[], T]) -> T:
    close_old_connections()
    return fn()


def _locked_usage(plugin: str) -> KVUsage:
    """The plugin's KVUsage row, locked until the transaction ends (made from its entries if new).

    The first statement is an UPDATE: on SQLite it takes the database's write lock at once (a
    read first, upgraded later, can deadlock two writers), on PostgreSQL the row's lock; either
    way concurrent writes of one plugin are serialized and its totals stay exact.
    """
    for _ in range(2):
        if KVUsage.objects.filter(plugin=plugin).update(keys=F("keys")):
            return KVUsage.objects.select_for_update().get(plugin=plugin)
        keys, total = recount(plugin)
        try:
            with transaction.atomic():
                KVUsage.objects.create(plugin=plugin, keys=keys, bytes=total)
        except IntegrityError:  # another writer made it first: lock theirs
            continue
    return KVUsage.objects.select_for_update().get(plugin=plugin)


def recount(plugin: str) -> tuple[int, int]:
    """``(keys, bytes)`` of the plugin's database entries, counted from the rows themselves."""
    keys = total = 0
    for key, value in KVEntry.objects.filter(plugin=plugin).values_list("key", "value").iterator():
        keys += 1
        total += entry_bytes(key, value)
    return keys, total


def reset_usage(plugin: str) -> None:
    """Set the plugin's stored KVUsage from its entries (after entries were edited outside kv_set)."""
    with transaction.atomic():
        keys, total = recount(plugin)
        KVUsage.objects.update_or_create(plugin=plugin, defaults={"keys": keys, "bytes": total})


class RedisKV:
    """KV in one Redis hash per plugin (``<REDIS_PREFIX>:execapp:plugins:kv:<plugin>``), shared by
    every worker."""

    def __init__(self, url: str) -> None:
        # Imported on first use, like execapp's Redis clients: the embedded setup (no REDIS_URL)
        # never loads redis-py.
        import redis

        # redis-py waits up to its socket timeout (5 s) whatever the call's deadline: a handler
        # proven fast runs on the event loop, and a Redis that turned slow (paused, failing over,
        # busy with a long script) held the loop that long (measured: a 3 s pause stalled a
        # worker's every connection 2.8 s). Each call runs on these threads and is waited for only
        # until the call's deadline, as DatabaseKV's; a call past it is the guest's timeout.
        self._hop = ThreadPoolExecutor(max_workers=4, thread_name_prefix="plugins-kv-redis")

        # Any: redis-py's annotations cover async clients and bytes replies; with
        # decode_responses=True every reply here is a str (or an int for counts).
        self.client: Any = redis.Redis.from_url(url, socket_timeout=5, decode_responses=True)
        self.prefix = conf.redis_key("execapp:plugins:kv:")
        #: One hash of every plugin's stored bytes (field: plugin); keys are the hash's HLEN.
        self.usage_key = conf.redis_key("execapp:plugins:kvbytes")
        self._set = self.client.register_script(_REDIS_SET)
        self._incr = self.client.register_script(_REDIS_INCR)

    def _run(self, fn: Callable[[], T], timeout: float) -> T:
        """``fn()`` on a Redis thread, waited for at most ``timeout`` seconds (TimeoutError past it)."""
        return self._hop.submit(fn).result(timeout=max(timeout, 0.001))

    def get(self, plugin: str, key: str, timeout: float) -> str | None:
        return self._run(lambda: self.client.hget(self.prefix + plugin, key), timeout)

    def set(self, plugin: str, key: str, value: str, timeout: float, quotas: Quotas | None = None) -> None:
        limits = (quotas.kv_keys, quotas.kv_bytes) if quotas is not None else (-1, -1)
        status, keys, total = self._run(lambda: self._set(keys=[self.prefix + plugin, self.usage_key],
                                                          args=[key, value, *limits, plugin]), timeout)
        if status == 1:
            raise keys_refused(plugin, quotas, keys)  # type: ignore[arg-type]
        if status == 2:
            raise bytes_refused(plugin, quotas, total)  # type: ignore[arg-type]

    def incr(self, plugin: str, key: str, delta: int, timeout: float, quotas: Quotas | None = None) -> int:
        limits = (quotas.kv_keys, quotas.kv_bytes) if quotas is not None else (-1, -1)
        status, value, keys, total = self._run(lambda: self._incr(
            keys=[self.prefix + plugin, self.usage_key], args=[key, delta, *limits, plugin, MAX_SAFE_INTEGER]), timeout)
        if status == 1:
            raise keys_refused(plugin, quotas, keys, "kv_incr")  # type: ignore[arg-type]
        if status == 2:
            raise bytes_refused(plugin, quotas, total, "kv_incr")  # type: ignore[arg-type]
        if status == 3:  # value: the stored text's first 100 bytes, keys: its length
            raise not_an_integer(key, value, keys)
        if status == 4:
            raise out_of_range(key, int(value), delta)
        return int(value)

    def usage(self, plugin: str) -> tuple[int, int]:
        keys = self.client.hlen(self.prefix + plugin)
        total = self.client.hget(self.usage_key, plugin)
        if total is None:
            total = sum(entry_bytes(k, v) for k, v in self.client.hgetall(self.prefix + plugin).items())
        return keys, int(total)


# Atomic check-and-set of one plugin's key (Redis runs a script alone). KEYS: the plugin's hash,
# the bytes hash; ARGV: field, value, max keys, max bytes (-1: no quota), plugin. '#' is a byte
# length in Lua, as entry_bytes counts in Python. Returns {status, keys, bytes}: 0 stored (the
# new totals), 1 refused for keys, 2 refused for bytes (the totals the write would have made).
_REDIS_SET = """
local h, usage = KEYS[1], KEYS[2]
local field, value, max_keys, max_bytes, plugin = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local total = tonumber(redis.call('HGET', usage, plugin) or '')
if not total then
  total = 0
  local all = redis.call('HGETALL', h)
  for i = 1, #all, 2 do total = total + #all[i] + #all[i + 1] end
end
local keys = redis.call('HLEN', h)
local new_key = redis.call('HEXISTS', h, field) == 0
local old = 0
if not new_key then old = #field + redis.call('HSTRLEN', h, field) end
local new_total = total - old + #field + #value
if new_key then keys = keys + 1 end
if max_keys >= 0 and new_key and keys > max_keys then return {1, keys - 1, total} end
if max_bytes >= 0 and new_total > max_bytes and new_total > total then return {2, keys, new_total} end
redis.call('HSET', h, field, value)
redis.call('HSET', usage, plugin, new_total)
return {0, keys, new_total}
"""


# Atomic add to one plugin's key, checked like _REDIS_SET (quotas, totals) and, before any write,
# against the integer form kvstore.incremented accepts: HINCRBY alone takes any int64 (a "+5" or
# "007" stored by kv_set too, which the database store refuses) and lets the result pass
# MAX_SAFE_INTEGER. KEYS: the plugin's hash, the bytes hash; ARGV: field, delta, max keys, max bytes
# (-1: no quota), plugin, MAX_SAFE_INTEGER. Lua's numbers are doubles: exact up to 2^53, and a sum
# past it still compares past it. Returns {status, value, keys, bytes}: 0 the new value, 1 refused
# for keys, 2 for bytes, 3 the stored value is not an integer (its first 100 bytes and its length,
# for the message), 4 the result would pass MAX_SAFE_INTEGER (the stored value).
_REDIS_INCR = """
local h, usage = KEYS[1], KEYS[2]
local field, delta, plugin, max_int = ARGV[1], tonumber(ARGV[2]), ARGV[5], tonumber(ARGV[6])
local max_keys, max_bytes = tonumber(ARGV[3]), tonumber(ARGV[4])
local stored = redis.call('HGET', h, field)
local old = 0
if stored then
  local digits = string.match(stored, '^%-?([1-9]%d*)$')
  if stored ~= '0' and not (digits and #digits <= 16) then return {3, string.sub(stored, 1, 100), #stored, 0} end
  old = tonumber(stored)
  if math.abs(old) > max_int then return {3, stored, #stored, 0} end
end
local new = old + delta
if math.abs(new) > max_int then return {4, stored or '0', 0, 0} end
local text = string.format('%d', new)
local total = tonumber(redis.call('HGET', usage, plugin) or '')
if not total then
  total = 0
  local all = redis.call('HGETALL', h)
  for i = 1, #all, 2 do total = total + #all[i] + #all[i + 1] end
end
local keys = redis.call('HLEN', h)
local new_total = total + #text
if stored then new_total = new_total - #stored else new_total = new_total + #field; keys = keys + 1 end
if max_keys >= 0 and not stored and keys > max_keys then return {1, 0, keys - 1, total} end
if max_bytes >= 0 and new_total > max_bytes and new_total > total then return {2, 0, keys, new_total} end
local value = redis.call('HINCRBY', h, field, ARGV[2])
redis.call('HSET', usage, plugin, new_total)
return {0, value, keys, new_total}
"""


_store: KVStore | None = None
_store_url: str | None = None
_lock = threading.Lock()


def kv_store() -> KVStore:
    """The process's KV backend: Redis when settings.REDIS_URL is set, else the database."""
    global _store, _store_url
    url = conf.redis_url()
    if _store is None or url != _store_url:
        with _lock:
            if _store is None or url != _store_url:
                _store = RedisKV(url) if url else DatabaseKV()
                _store_url = url
    return _store


class ConfiguredKV:
    """The KVStore the plugins app installs for the host API: every call goes to ``kv_store()``,
    so a change of ``REDIS_URL`` (tests' settings overrides) takes effect at the next call."""

    def get(self, plugin: str, key: str, timeout: float) -> str | None:
        return kv_store().get(plugin, key, timeout)

    def set(self, plugin: str, key: str, value: str, timeout: float, quotas: Quotas | None = None) -> None:
        kv_store().set(plugin, key, value, timeout, quotas)

    def incr(self, plugin: str, key: str, delta: int, timeout: float, quotas: Quotas | None = None) -> int:
        return kv_store().incr(plugin, key, delta, timeout, quotas)

    def usage(self, plugin: str) -> tuple[int, int]:
        return kv_store().usage(plugin)
