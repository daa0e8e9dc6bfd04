"""The WASM compiling child parses large WebAssembly text (its priority: test_compile_priority.py)."""
from __future__ import annotations

import time

import pytest
import wasmtime

from plugins.errors import CompileError
from plugins.runtimes import wasm
from tests.plugins.test_wasm_hostile import bounded

# -- WebAssembly text: parsed in the bounded child past WAT_INPROCESS_CHARS ------------------------

def _branches_to_the_outermost(n: int) -> str:
    """n nested blocks and n branches from the innermost to the outermost: each `br $o` looks its
    label up through all n blocks (40,000 of each, 0.56 MB, parsed in 2.8 s in-process)."""
    return ('(module (memory (export "memory") 1) (func (export "alloc") (param i32) (result i32) (i32.const 0))'
            " (func (block $o " + "(block " * n + "br $o " * n + ")" * n + ")))")


def test_a_wat_that_parses_slowly_stops_at_the_compile_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wasm, "COMPILE_TIMEOUT_SECONDS", 1.0)
    text = _branches_to_the_outermost(80_000)  # 1.1 MB: ~10 s or more in-process (quadratic)
    started = time.monotonic()
    with pytest.raises(CompileError) as info:
        bounded(lambda: wasm.wat_to_wasm(text))
    took = time.monotonic() - started
    assert info.value.code == "timeout" and "parsing the .wat took more than 1 s" in str(info.value)
    assert took < 1.0 + 2.0, f"parsing ran {took:.1f} s on a 1 s limit"


def test_a_large_wat_parses_in_the_child_as_it_does_here() -> None:
    small = _branches_to_the_outermost(1_000)
    large = small.replace("(module", "(module" + " (global i32 (i32.const 7))" * 3_000, 1)
    assert len(small) <= wasm.WAT_INPROCESS_CHARS < len(large)
    assert wasm.wat_to_wasm(large) == bytes(wasmtime.wat2wasm(large))
    with pytest.raises(CompileError, match=r"the \.wat does not parse: .*unknown operator"):
        wasm.wat_to_wasm(large.replace("br $o", "br.bogus $o", 1))


@pytest.mark.parametrize("padding", [0, 70_000], ids=["here", "in_the_child"])
def test_a_wat_with_a_lone_surrogate_is_refused_as_not_parsing(padding: int) -> None:
    # Here it raised a bare UnicodeEncodeError; in the child, an exit read as running out of memory.
    with pytest.raises(CompileError, match=r"the \.wat does not parse: .*surrogates not allowed") as info:
        wasm.wat_to_wasm("(module (func))" + " " * padding + "\ud800")
    assert info.value.code == "plugin_invalid"
