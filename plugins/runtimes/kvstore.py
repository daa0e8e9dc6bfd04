"""The key-value store the host API uses (``kv_get``/``kv_set``/``kv_incr``), as a protocol the process injects.

The runtimes never choose a backend: the plugins app installs one at ``AppConfig.ready``
(plugins.kv: the database, or Redis when ``REDIS_URL`` is set), and a script using the
runtimes without Django installs its own with ``install``. Both backends keep each plugin's
stored totals (keys, and UTF-8 bytes of keys plus values) and check a write against its quotas
atomically with the write itself, with the helpers below. A write that would grow a total past
its quota raises GuestQuota (code ``quota_kv``); overwriting a key with a value no larger is
always allowed, so a plugin over a lowered quota can still shrink. ``incr`` reads, adds and writes
in one atomic step of the backend (every thread and worker process alike), with the helpers
``incremented`` and ``KVValueError`` below deciding what it may count.
"""
from __future__ import annotations

import re
from typing import Protocol

from ..errors import GuestQuota
from ..spec import Quotas

MAX_KEY_CHARS = 200
MAX_VALUE_CHARS = 64 * 1024
#: The integers ``kv_incr`` keeps, its delta and its result alike: JavaScript's safe integers
#: (Number.MAX_SAFE_INTEGER), which every runtime reads exactly (a JS number is a double; Redis's
#: own limit, int64, is wider).
MAX_SAFE_INTEGER = 2**53 - 1
#: What ``kv_incr`` counts as a stored integer: decimal digits with an optional '-', no leading zero,
#: no '+' or spaces (Redis's own INCRBY form, so both backends accept the same values).
_INTEGER = re.compile(r"0|-?[1-9][0-9]{0,15}")


class KVStore(Protocol):
    """get/set of string values in a plugin's namespace; survives restarts."""

    def get(self, plugin: str, key: str, timeout: float) -> str | None: ...

    def set(self, plugin: str, key: str, value: str, timeout: float, quotas: Quotas | None = None) -> None:
        """Store ``value``; with ``quotas``, raise GuestQuota instead if a stored total would grow past one."""
        ...

    def incr(self, plugin: str, key: str, delta: int, timeout: float, quotas: Quotas | None = None) -> int:
        """Add ``delta`` to the integer stored under ``key`` (a missing key counts as 0) in one atomic
        step and return the new value; raise KVValueError if the stored value is not an integer or
        the result would leave +-MAX_SAFE_INTEGER (the value is then unchanged), GuestQuota as ``set``."""
        ...

    def usage(self, plugin: str) -> tuple[int, int]:
        """``(keys, bytes)`` the plugin has stored now."""
        ...


_installed: KVStore | None = None


def install(store: KVStore | None) -> KVStore | None:
    """Make ``store`` the KV store of every host call in this process (None: none); returns the
    one it replaces. Called once at startup (plugins.apps), before any guest runs."""
    global _installed
    previous, _installed = _installed, store
    return previous


def installed() -> KVStore | None:
    """The process's KV store, or None when nothing installed one."""
    return _installed


def entry_bytes(key: str, value: str) -> int:
    """What one entry counts against the byte quota: UTF-8 bytes of its key and its value."""
    return len(key.encode()) + len(value.encode())


class KVValueError(ValueError):
    """``kv_incr`` refused the stored value (not an integer) or its result (past MAX_SAFE_INTEGER);
    the guest sees the message as a failed, catchable host call."""


def incremented(key: str, stored: str | None, delta: int) -> int:
    """What ``kv_incr(key, delta)`` stores over ``stored`` (None: a missing key, which counts as 0);
    raises KVValueError naming the key and the fix."""
    if stored is None:
        old = 0
    elif _INTEGER.fullmatch(stored) and abs(old := int(stored)) <= MAX_SAFE_INTEGER:
        pass
    else:
        raise not_an_integer(key, stored, len(stored))
    new = old + delta
    if abs(new) > MAX_SAFE_INTEGER:
        raise out_of_range(key, old, delta)
    return new


def not_an_integer(key: str, stored: str, length: int) -> KVValueError:
    """The error for a ``kv_incr`` of a key holding ``stored`` (its start; ``length``: its whole length)."""
    shown = repr(stored[:40]) + (f"... ({length} characters)" if length > 40 else "")
    return KVValueError(f"kv_incr: the value stored under {key!r} is {shown}, not an integer kv_incr can count "
                        f"(decimal digits with an optional '-', within +-{MAX_SAFE_INTEGER}); store a number "
                        "there with kv_set first, or count under another key")


def out_of_range(key: str, old: int, delta: int) -> KVValueError:
    """The error for a ``kv_incr`` whose result would leave +-MAX_SAFE_INTEGER."""
    return KVValueError(f"kv_incr: {key!r} holds {old}, and adding {delta} would give {old + delta}, outside the "
                        f"integers kv_incr keeps (+-{MAX_SAFE_INTEGER}, JavaScript's safe integers); the value is "
                        "unchanged: reset it with kv_set, or count in larger units")


def check_quota(plugin: str, quotas: Quotas, keys: int, total: int, old_total: int, new_key: bool,
                call: str = "kv_set") -> None:
    """Raise GuestQuota if storing would leave ``keys``/``total`` past the plugin's quotas.

    Only growth is refused: a new key past the key quota, or more bytes than before past the
    byte quota.
    """
    if new_key and keys > quotas.kv_keys:
        raise keys_refused(plugin, quotas, keys - 1, call)
    if total > quotas.kv_bytes and total > old_total:
        raise bytes_refused(plugin, quotas, total, call)


def keys_refused(plugin: str, quotas: Quotas, stored: int, call: str = "kv_set") -> GuestQuota:
    """The error for a new key when the plugin already stores ``stored`` keys."""
    return GuestQuota("quota_kv", f"{call}: plugin {plugin!r} already stores {stored} keys, its KV keys quota is "
                                  f"{quotas.kv_keys}; overwrite an existing key, or raise the plugin's KV keys quota")


def bytes_refused(plugin: str, quotas: Quotas, total: int, call: str = "kv_set") -> GuestQuota:
    """The error for a write that would leave the plugin storing ``total`` bytes."""
    return GuestQuota("quota_kv", f"{call}: plugin {plugin!r} would store {total} bytes, over its KV bytes quota "
                                  f"of {quotas.kv_bytes}; store less, or raise the plugin's KV bytes quota")
