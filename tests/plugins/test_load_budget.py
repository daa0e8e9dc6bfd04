"""A plugin's top level gets at most LOAD_SECONDS when its code is validated, whatever its timeout.

Validation runs at save and in every worker whenever it loads a new version, on the registry
sync's one thread, plugin after plugin. Bounded by the plugin's own timeout_ms alone (up to 60 s),
a Lua top level of 100M additions (2.3 s) or a JS one (6.7 s) under a 30 s timeout was accepted,
and one of 25 s cost every worker 25 s at each start and version, every other plugin's change
waiting behind it.
"""
from __future__ import annotations

import pytest

from plugins.errors import CompileError
from plugins.runtimes import base
from plugins.runtimes.registry import compile_plugin
from plugins.spec import PluginSpec

LOOPING_TOP_LEVELS = {
    "lua": "while true do end\nfunction h(ev) return 'x' end",
    "js": "while (true) {}\nfunction h(ev) { return 'x'; }",
    "wasm": '(module (memory (export "memory") 1) (func (export "alloc") (param i32) (result i32) (i32.const 0))'
            ' (func (export "h") (param i32 i32) (result i64) (i64.const 0))'
            ' (func $spin (loop $l (br $l))) (start $spin))',
}


@pytest.mark.parametrize("runtime", sorted(LOOPING_TOP_LEVELS))
def test_a_top_level_is_stopped_at_the_load_budget_not_at_a_longer_timeout(runtime, monkeypatch) -> None:
    monkeypatch.setattr(base, "LOAD_SECONDS", 0.2)
    spec = PluginSpec(name=f"slow-{runtime}", runtime=runtime, code=LOOPING_TOP_LEVELS[runtime], timeout=5.0)
    with pytest.raises(CompileError) as info:
        compile_plugin(spec)
    assert info.value.code == "timeout"
    assert "ran past 200 ms" in str(info.value)
    assert "a top level may run at most 0.2 s when the plugin is loaded, whatever its timeout_ms" in str(info.value)


def test_a_top_level_within_a_shorter_timeout_keeps_the_timeouts_words() -> None:
    spec = PluginSpec(name="quick", runtime="lua", code=LOOPING_TOP_LEVELS["lua"], timeout=0.1)
    with pytest.raises(CompileError, match=r"ran past the plugin.s timeout of 100 ms .*; keep the top level to "
                                           r"definitions and do the work in handlers, or raise timeout_ms") as info:
        compile_plugin(spec)
    assert "LOAD_SECONDS" not in str(info.value)
