"""Version churn: the caches of compiled plugin versions are bounded by bytes, not only by count.

Every save of a plugin is a new version. Bounded by count only (128 compiled versions, 64 WASM
modules), saving one plugin with 2.8 MB of Lua source again and again left ~5-8 MB per version
in every process that compiled it (245 MB after 16 versions, growing; ~1 GB at 128), never freed.
"""
from __future__ import annotations

import gc
import weakref

import pytest

from plugins import loaded
from plugins.runtimes import wasm
from plugins.runtimes.weighed_lru import WeighedLRU
from plugins.spec import PluginSpec

#: A Lua plugin of ~20 KB (compiled in this process: under lua_compile.INPROCESS_BYTES).
LUA = "local t = {" + ",".join(f'"s{i}"' for i in range(3000)) + "}\nfunction h(ev) return #t end\n"
WAT = ('(module (memory (export "memory") 1) (func (export "alloc") (param i32) (result i32) (i32.const 0))'
       ' (func (export "h") (param i32 i32) (result i64) (i64.const 0)) (global i32 (i32.const {n})))')


@pytest.fixture(autouse=True)
def empty_caches():
    loaded._drop_compiled()
    wasm.drop_caches()
    yield
    loaded._drop_compiled()
    wasm.drop_caches()


def _alive(refs: list[weakref.ref]) -> list[int]:
    gc.collect()
    return [i for i, ref in enumerate(refs) if ref() is not None]


def test_old_versions_of_a_plugin_are_freed_once_the_cache_holds_its_bytes(monkeypatch) -> None:
    size = len(LUA) + len(loaded.compiled_for(PluginSpec(name="big", runtime="lua", code=LUA)).bytecode)
    monkeypatch.setattr(loaded, "COMPILED_CACHE_BYTES", 3 * size + size // 2, raising=False)
    refs = [weakref.ref(loaded.compiled_for(PluginSpec(name="big", runtime="lua", code=f"-- v{i}\n{LUA}")))
            for i in range(8)]
    assert _alive(refs) == [5, 6, 7], "the three newest versions fit, the older ones are freed"
    assert loaded._compiled.bytes <= loaded.COMPILED_CACHE_BYTES, "the code and its bytecode are counted"
    again = loaded.compiled_for(PluginSpec(name="big", runtime="lua", code=f"-- v7\n{LUA}"))
    assert again is refs[7](), "a version still cached is not compiled again"


def test_old_wasm_modules_are_freed_once_the_module_cache_holds_their_bytes(monkeypatch) -> None:
    binaries = [wasm.wat_to_wasm(WAT.replace("{n}", str(n))) for n in range(6)]
    monkeypatch.setattr(wasm, "MODULE_CACHE_BYTES", 2 * wasm.compiled_module("probe", binaries[0])[1], raising=False)
    wasm.drop_caches()
    refs = [weakref.ref(wasm.compile_module(f"v{n}", binary)) for n, binary in enumerate(binaries)]
    assert _alive(refs) == [4, 5]


#: A module whose machine code is ~50x its binary: 1,000 empty functions, ~4 KB of wasm, ~210 KB compiled.
EMPTY_FUNCTIONS = ('(module (memory (export "memory") 1) (func (export "alloc") (param i32) (result i32) (i32.const 0))'
                   ' (global i32 (i32.const {n}))' + " (func)" * 1000 + ")")


def test_the_module_cache_counts_the_machine_code_a_module_holds_not_its_binary(monkeypatch) -> None:
    # Counted by binary (4 KB here), 64 versions of 80 KB of empty functions (4.2 MB of machine
    # code, ~4 MB of RSS each) were 5 MB of a 64 MiB cache: ~260 MB held.
    binaries = [wasm.wat_to_wasm(EMPTY_FUNCTIONS.replace("{n}", str(n))) for n in range(5)]
    native = wasm.compiled_module("probe", binaries[0])[1]
    assert native > 20 * len(binaries[0]), (native, len(binaries[0]))
    wasm.drop_caches()
    monkeypatch.setattr(wasm, "MODULE_CACHE_BYTES", 2 * native + native // 2, raising=False)
    refs = [weakref.ref(wasm.compile_module(f"v{n}", binary)) for n, binary in enumerate(binaries)]
    assert _alive(refs) == [3, 4], "two modules' machine code fits, the older ones are freed"
    assert wasm._modules.bytes <= wasm.MODULE_CACHE_BYTES


def test_the_compiled_versions_cache_counts_a_wasm_modules_machine_code(monkeypatch) -> None:
    # A WASM version keeps its module alive from the compiled versions' cache too (128 versions).
    specs = [PluginSpec(name="native", runtime="wasm", code=wasm.wat_to_wasm(EMPTY_FUNCTIONS.replace("{n}", str(n))))
             for n in range(5)]
    size = loaded.compiled_bytes(specs[0], loaded.compiled_for(specs[0]))
    assert size > 20 * len(specs[0].code), size
    monkeypatch.setattr(loaded, "COMPILED_CACHE_BYTES", 2 * size + size // 2, raising=False)
    refs = [weakref.ref(loaded.compiled_for(spec).module) for spec in specs]  # type: ignore[attr-defined]
    wasm.drop_caches()  # only the compiled versions' cache holds them now
    assert _alive(refs) == [3, 4]


def test_the_newest_entry_stays_whatever_its_size_and_a_repeat_is_counted_once() -> None:
    cache: WeighedLRU[str, str] = WeighedLRU()
    cache.put("a", "A", 10, max_entries=8, max_bytes=25)
    cache.put("b", "B", 10, max_entries=8, max_bytes=25)
    cache.put("a", "A2", 10, max_entries=8, max_bytes=25)
    assert cache.bytes == 20 and len(cache) == 2
    assert cache.get("b") == "B"  # b is now the most recently used
    cache.put("c", "C", 10, max_entries=8, max_bytes=25)
    assert "a" not in cache and cache.get("b") == "B" and cache.bytes == 20
    cache.put("huge", "H", 100, max_entries=8, max_bytes=25)
    assert len(cache) == 1 and cache.get("huge") == "H" and cache.bytes == 100
    cache.put("d", "D", 1, max_entries=1, max_bytes=25)
    assert len(cache) == 1 and cache.get("d") == "D"
