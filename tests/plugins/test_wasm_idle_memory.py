"""Linear memory that idle pooled WASM instances keep: at most wasm.IDLE_MEMORY_BYTES together.

Each pooled instance kept the memory its calls touched, up to its plugin's cap, for as long as the
plugin is loaded; nothing bounds the total over plugins. Measured: 10 plugins at the defaults
(pooled, 4 instances, 16 MiB), each called 4 at once by a guest touching its whole memory, left
the worker +639 MB while every one of them was idle; MAX_PLUGINS (100) of them, ~6.4 GB.
Past the budget an instance ending a call frees its store and instantiates again at its next call.
"""
from __future__ import annotations

import gc
import threading

import pytest

from plugins.loaded import LoadedPlugin
from plugins.runtimes import wasm
from plugins.spec import PluginSpec
from tests.plugins.test_wasm_hostile import EVENT, bounded, handler, module
from tests.plugins.test_wasm_redteam import _rss_mib

#: Grows to the default 16 MiB cap, touches all of it, and waits so that 4 calls overlap.
TOUCH_ALL = module(handler("(drop (memory.grow (i32.const 255))) (memory.fill (i32.const 0) (i32.const 1)"
                           " (i32.const 16711680)) (call $sleep (i32.const 200)) (i64.const 0)"),
                   imports='(import "env" "sleep" (func $sleep (param i32)))')


def test_idle_pooled_instances_keep_the_memory_their_calls_touched_within_one_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wasm, "IDLE_MEMORY_BYTES", 40 << 20)  # two and a half instances' 16 MiB
    gc.collect()
    before, counted_before = _rss_mib(), wasm.idle_memory()
    plugins = [LoadedPlugin(PluginSpec(name=f"idle{k}", runtime="wasm", code=TOUCH_ALL, timeout=2.0,
                                       memory_bytes=16 << 20, strategy="pooled", pool_size=4,
                                       permissions=frozenset({"sleep"}))) for k in range(10)]
    try:
        for plugin in plugins:
            threads = [threading.Thread(target=lambda p=plugin: bounded(lambda: p.call("run", dict(EVENT), True, None)))
                       for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert sum(plugin.strategy.idle() for plugin in plugins) == 40  # every instance idle in its pool
        kept = _rss_mib() - before
        counted = wasm.idle_memory()
        # and a call of an instance that freed its store instantiates again and answers
        assert bounded(lambda: plugins[0].call("run", dict(EVENT), True, None)) is None
    finally:
        for plugin in plugins:
            plugin.close()
    assert counted <= wasm.IDLE_MEMORY_BYTES
    assert kept < 100, f"40 idle instances of 10 plugins keep {kept} MiB"
    assert wasm.idle_memory() == counted_before, "closed instances count nothing"


def test_a_shard_keeps_its_state_past_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # A shard's memory is its session's state: counted, never freed for the budget.
    monkeypatch.setattr(wasm, "IDLE_MEMORY_BYTES", 0)
    count = module(handler("(i32.store (i32.const 0) (i32.add (i32.load (i32.const 0)) (i32.const 1)))"
                           " (i32.store (i32.const 4) (i32.add (i32.const 48) (i32.load (i32.const 0))))"
                           " (call $pack (i32.const 4) (i32.const 1))"))
    replies = {}
    for strategy in ("sharded", "pooled"):
        plugin = LoadedPlugin(PluginSpec(name=f"count_{strategy}", runtime="wasm", code=count, timeout=1.0,
                                         strategy=strategy, shard_count=1, pool_size=1))
        try:
            replies[strategy] = [bounded(lambda p=plugin: p.call("run", dict(EVENT), True, None)) for _ in range(3)]
        finally:
            plugin.close()
    assert replies == {"sharded": ["1", "2", "3"], "pooled": ["1", "1", "1"]}
