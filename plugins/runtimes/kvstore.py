"""The key-value store the host API uses (``kv_get``/``kv_set``), as a protocol the process injects.

The runtimes never choose a backend: the plugins app installs one at ``AppConfig.ready``
(plugins.kv: the database, or Redis when ``REDIS_URL`` is set), and a script using the
runtimes without Django installs its own with ``install``. Both backends keep each plugin's
stored totals (keys, and UTF-8 bytes of keys plus values) and check a write against its quotas
atomically with the write itself, with the helpers below. A write that would grow a total past
its quota raises GuestQuota (code ``quota_kv``); overwriting a key with a value no larger is
always allowed, so a plugin over a lowered quota can still shrink.
"""
from __future__ import annotations

from typing import Protocol

from ..errors import GuestQuota
from ..spec import Quotas

MAX_KEY_CHARS = 200
MAX_VALUE_CHARS = 64 * 1024


class KVStore(Protocol):
    """get/set of string values in a plugin's namespace; survives restarts."""

    def get(self, plugin: str, key: str, timeout: float) -> str | None: ...

    def set(self, plugin: str, key: str, value: str, timeout: float, quotas: Quotas | None = None) -> None:
        """Store ``value``; with ``quotas``, raise GuestQuota instead if a stored total would grow past one."""
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


def check_quota(plugin: str, quotas: Quotas, keys: int, total: int, old_total: int, new_key: bool) -> None:
    """Raise GuestQuota if storing would leave ``keys``/``total`` past the plugin's quotas.

    Only growth is refused: a new key past the key quota, or more bytes than before past the
    byte quota.
    """
    if new_key and keys > quotas.kv_keys:
        raise keys_refused(plugin, quotas, keys - 1)
    if total > quotas.kv_bytes and total > old_total:
        raise bytes_refused(plugin, quotas, total)


def keys_refused(plugin: str, quotas: Quotas, stored: int) -> GuestQuota:
    """The error for a new key when the plugin already stores ``stored`` keys."""
    return GuestQuota("quota_kv", f"kv_set: plugin {plugin!r} already stores {stored} keys, its KV keys quota is "
                                  f"{quotas.kv_keys}; overwrite an existing key, or raise the plugin's KV keys quota")


def bytes_refused(plugin: str, quotas: Quotas, total: int) -> GuestQuota:
    """The error for a write that would leave the plugin storing ``total`` bytes."""
    return GuestQuota("quota_kv", f"kv_set: plugin {plugin!r} would store {total} bytes, over its KV bytes quota "
                                  f"of {quotas.kv_bytes}; store less, or raise the plugin's KV bytes quota")
