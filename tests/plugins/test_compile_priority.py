"""The compiling children (WASM's, and Lua's for a large source) yield the CPU to serving (COMPILE_NICE).

Every worker compiles each new version at once. Two WASM compiles at nice 0 put a sleeping
thread's wake-up at 1.9 ms median and 17-26 ms p99 (0.1 ms and 2-3 ms idle) for their whole
7-10 s; at nice 10, 0.1 ms and 3.7-8.6 ms.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from plugins.runtimes import base, lua_compile, wasm
from plugins.spec import PluginSpec

#: ~1-2 s of compiling: long enough to see the child at work.
SLOW_WAT = ('(module (memory (export "memory") 1) (func (export "alloc") (param i32) (result i32) (i32.const 0))'
            + " (func)" * 3000 + ")")
#: Past lua_compile.INPROCESS_BYTES (2 MB of constants: ~0.1 s in the child after its start).
LARGE_LUA = "local t = {" + ",".join(str(i * 7919) for i in range(200_000)) + "} function f(e) return #t end"


def _children_niceness() -> dict[int, int]:
    """This process's child processes -> their niceness (from /proc)."""
    found = {}
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:  # it ended
                continue
            found[int(pid)] = int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice
    return found


def _wasm() -> Any:
    return wasm._compile_bounded(wasm.wat_to_wasm(SLOW_WAT))


def _lua() -> Any:
    assert len(LARGE_LUA) > lua_compile.INPROCESS_BYTES
    return lua_compile.compile_bytecode(PluginSpec(name="large", runtime="lua", code=LARGE_LUA,
                                                  memory_bytes=256 << 20))


@pytest.mark.parametrize("compile_", [_wasm, _lua], ids=["wasm", "lua"])
def test_the_compiling_child_runs_at_a_lower_priority(compile_: Callable[[], Any]) -> None:
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(compile_()), daemon=True)
    thread.start()
    seen: set[int] = set()
    while thread.is_alive():
        seen.update(_children_niceness().values())
        if base.COMPILE_NICE in seen:
            break
        time.sleep(0.002)
    thread.join(wasm.COMPILE_TIMEOUT_SECONDS + 5)
    assert base.COMPILE_NICE == 10
    assert base.COMPILE_NICE in seen, f"the compiling child ran at niceness {sorted(seen)}"
    assert result and result[0], "and it still compiled"
