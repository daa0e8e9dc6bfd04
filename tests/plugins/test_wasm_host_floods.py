"""A WASM guest calling one cheap host function in a loop: each call is within every per-call
check, but the loop multiplies it by what the budget allows.

Measured before the KV read quotas (Redis, a 1 s budget, a loaded 2-core machine): a guest
re-reading one 256 KiB value made 215-234 kv_get round trips, ~60 MB fetched from the store for
one 20-byte event; a small value, ~550 round trips. Writes had their quota (100 per call), reads none.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from plugins.errors import QuotaExceeded
from plugins.loaded import LoadedPlugin
from plugins.spec import DEFAULT_QUOTAS, Quotas
from tests.plugins.test_wasm_hostile import EVENT, bounded, handler, module, spec

KV_GET = '(import "env" "kv_get" (func $kv_get (param i32 i32 i32 i32) (result i32)))'
#: kv_get("k") into an 8-byte buffer, for ever (the budget, or a quota, ends it).
REREAD = handler("(loop $l (drop (call $kv_get (i32.const 0) (i32.const 1) (i32.const 8) (i32.const 8))) (br $l))"
                 " (i64.const 0)")


class _CountingKV:
    """An in-process KV store that counts its reads and the characters they returned."""

    def __init__(self, value: str) -> None:
        self.value = value
        self.reads = self.chars = 0

    def get(self, plugin: str, key: str, timeout: float) -> str | None:
        self.reads += 1
        self.chars += len(self.value)
        return self.value

    def set(self, plugin: str, key: str, value: str, timeout: float, quotas: object = None) -> None:
        raise AssertionError("not written here")

    def usage(self, plugin: str) -> tuple[int, int]:
        return 1, len(self.value)


def _reread(value: str, quotas: Quotas = DEFAULT_QUOTAS, timeout: float = 2.0) -> tuple[BaseException, _CountingKV]:
    """What ends one call of REREAD against a store holding ``value``, and the store's counts."""
    from plugins.runtimes import kvstore

    store = _CountingKV(value)
    previous = kvstore.install(store)
    plugin = LoadedPlugin(replace(spec(module('(data (i32.const 0) "k")' + REREAD, imports=KV_GET), timeout),
                                  permissions=frozenset({"kv"}), quotas=quotas))
    try:
        with pytest.raises(Exception) as info:
            bounded(lambda: plugin.call("run", dict(EVENT), True, None))
    finally:
        plugin.close()
        kvstore.install(previous)
    return info.value, store


def test_rereading_a_large_value_stops_at_the_read_bytes_quota() -> None:
    # 256 KiB values: the 16 MiB default is 64 of them; the 65th read ends the call.
    error, store = _reread("v" * (256 << 10))
    assert isinstance(error, QuotaExceeded) and error.code == "quota_kv_reads", error
    assert "KV read bytes per call quota of 16777216" in str(error)
    assert store.reads == 65, f"{store.reads} reads, {store.chars / 1e6:.0f} MB from the store for one event"


def test_rereading_a_small_value_stops_at_the_reads_quota() -> None:
    error, store = _reread("1", quotas=Quotas(kv_reads=50))
    assert isinstance(error, QuotaExceeded) and error.code == "quota_kv_reads", error
    assert "KV reads per call quota is 50" in str(error)
    assert store.reads == 50, f"{store.reads} reads for one event"


def test_the_default_reads_quota_is_a_thousand_reads() -> None:
    error, store = _reread("1")
    assert isinstance(error, QuotaExceeded) and error.code == "quota_kv_reads", error
    assert store.reads == DEFAULT_QUOTAS.kv_reads == 1000
