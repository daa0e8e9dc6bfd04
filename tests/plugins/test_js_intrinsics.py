"""The JS prelude and guards use only what they captured before any guest code ran.

A guest may replace any global or built-in method (Math.clz32, String, ...). Whatever the guards or
the prelude look up at call time is then the guest's: each case replaces one such name, then makes
the call the guard exists for, and must still be stopped at its deadline or answered as before.
"""
from __future__ import annotations

import logging
from typing import Iterator

import pytest

from execapp.engine import HandlerTimeout
from plugins.errors import CompileError
from plugins.runtimes.js import JsCompiled
from plugins.spec import PluginSpec
from tests.plugins.test_js_containment import Worker
from tests.plugins.test_js_redteam import outcome_within_budget

BUDGET_SECONDS, MARGIN_SECONDS = 0.3, 0.4


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


# Each: a handler body that replaces an intrinsic, then calls a guarded built-in whose native work
# would run for seconds in one C call (measured at the default 16 MiB, before the fix: 10.7 s on a
# 0.3 s budget for the sort).
RUNAWAYS = {
    # the sort guard sized its work with Math.clz32: a guest's `() => 32` made it 0 and let the
    # native sort compare 3,000 references to one 4 MiB string (each comparison a 4 MiB memcmp)
    "Math.clz32 replaced, then a sort of long equal strings":
        "const s = 'a'.repeat(1 << 22); const a = new Array(3000).fill(s); Math.clz32 = () => 32; a.sort()",
    # a replace past the search guard's size runs in the slow path, whose `$&` substitution used the
    # native replace on a regexp of the guards' own, which read RegExp.prototype.exec: the guest's
    # result (a length of 200,000 on a 30,000-deep chain) had its captures read in C, unpolled (past
    # 60 s; a length of 2,000: 3.1 s)
    "RegExp.prototype.exec replaced, then a long replace":
        "let p = {}; for (let i = 0; i < 30000; i++) p = Object.create(p); let once = false;"
        " RegExp.prototype.exec = function () { if (once) return null; once = true;"
        "   const r = Object.create(p); r.length = 200000; r.index = 0; r[0] = '$'; return r; };"
        " ('x'.repeat(600000) + 'aaaaaaaaa').replace('aaaaaaaaa', '$&'); for (;;) {}",
}


@pytest.mark.parametrize("case", RUNAWAYS)
def test_a_replaced_intrinsic_does_not_switch_a_guard_off(worker: Worker, case: str) -> None:
    code = f"function f(e) {{ {RUNAWAYS[case]}; return 'finished'; }} function ok(e) {{ return 'fine'; }}"
    outcome, took = outcome_within_budget(worker, code, budget=BUDGET_SECONDS)
    assert isinstance(outcome, HandlerTimeout), outcome
    assert took < BUDGET_SECONDS + MARGIN_SECONDS, took


# A guest's String that returns an object: the prelude turned thrown values and log lines into text
# with it, so its object crossed to the host as the error (an AttributeError out of the runtime,
# not a handler error) or as the log line (its JSON, past the line's cut).
EVIL_STRING = "String = function () { return {length: 1, nested: [1, {deep: 'x'.repeat(5000)}]}; };"


def test_a_replaced_string_cannot_make_a_thrown_value_anything_but_text(worker: Worker) -> None:
    code = f"function f(e) {{ {EVIL_STRING} throw 5; }} function ok(e) {{ return 'fine'; }}"
    outcome, _ = outcome_within_budget(worker, code, budget=BUDGET_SECONDS)
    assert type(outcome).__name__ == "HandlerError", repr(outcome)
    assert str(outcome).endswith("js error: 5"), outcome


def test_a_replaced_string_cannot_make_a_log_line_anything_but_text(worker: Worker,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="plugins.guest")
    code = f"function f(e) {{ {EVIL_STRING} log(42); return 'logged'; }} function ok(e) {{ return 'fine'; }}"
    outcome, _ = outcome_within_budget(worker, code, budget=BUDGET_SECONDS)
    assert outcome == "logged"
    lines = [r.getMessage() for r in caplog.records if r.name == "plugins.guest"]
    assert lines == ["[jsc-pooled] 42"], lines


# -- the list of a plugin's functions, read once at validation ----------------------------------

def _compiled(code: str, memory_mb: int = 16) -> JsCompiled:
    # (a roomy budget: the top levels below build their state in ~0.2-0.6 s on a loaded machine)
    return JsCompiled(PluginSpec(name="jsi", runtime="js", code=code, timeout=2.0,
                                 memory_bytes=memory_mb << 20))


def test_the_function_list_is_made_with_intrinsics_captured_before_the_plugin_ran() -> None:
    # Before: the guest's JSON.stringify gave the list (here 200,001 numbers: at a 128 MiB cap, 10M
    # of them grew the process by 478 MB), and its Set.prototype.has added the prelude's names.
    code = ("const big = ('[' + '1000,'.repeat(2e5) + '1000]').slice(0); JSON.stringify = () => big;"
            " Set.prototype.has = () => false; Array.prototype.filter = function () { return this; };"
            " function f(e) { return 'x'; }")
    assert _compiled(code).handlers == {"f"}


def test_a_plugin_with_too_many_function_names_is_refused_at_validation() -> None:
    code = "for (let i = 0; i < 30000; i++) globalThis['handler_with_a_longish_name_' + i] = function () {};"
    with pytest.raises(CompileError, match="MAX_FUNCTION_LIST_CHARS"):
        _compiled(code, memory_mb=64)
