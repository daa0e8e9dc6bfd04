"""Red-team cases against the JS sandbox, from the outside, as a hostile plugin author writes them.

Each case runs through the real plugin call path (plugins.loaded.LoadedPlugin) on the real
QuickJS-NG binding and asserts what an operator expects: stopped at the deadline (plus a small
margin) or refused, and the plugin serving on. The typed-array cases ran for seconds past their
budget in one C call before js_guards.js split them into polled chunks (a memory cap of up to
1 GiB makes their length, not the default 16 MiB).
"""
from __future__ import annotations

import json
import time
from typing import Any, Iterator

import pytest
import quickjs

from execapp.engine import HandlerTimeout
from plugins.runtimes import js
from tests.plugins.test_js_containment import BUDGET, Worker, event, make

MIB = 1 << 20


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


def outcome_within_budget(worker: Worker, code: str, memory_mb: int = 16,
                           budget: float = BUDGET) -> tuple[Any, float]:
    """(what calling ``f`` gave: its reply or its exception, seconds it took) on a pooled plugin."""
    plugin = make("pooled", code=code, timeout=budget, memory_bytes=memory_mb * MIB)
    try:
        def call() -> Any:
            try:
                return plugin.call("f", event())
            except Exception as exc:  # noqa: BLE001 - the timeout is the result under test
                return exc
        started = time.monotonic()
        outcome = worker.run(call, budget)  # fails the test if the call outlives twice its budget
        took = time.monotonic() - started
        assert plugin.call("ok", event()) == "fine"  # the plugin serves on
    finally:
        plugin.close()
    return outcome, took


# -- typed arrays: native loops over a length only the memory cap bounds --------------------------

# 64 Ki random doubles copied over the whole array, natively (sorting zeros is quick).
RANDOM = ("for (let i = 0; i < 65536; i++) a[i] = Math.random();"
          " for (let k = 65536; k < a.length; k *= 2) a.copyWithin(k, 0, k);")
# (memory cap in MiB, the handler's body): each one C call of 1.2-5 s at that cap unguarded (measured
# on the 2-core dev machine, Dec 2026), so even a machine twice as fast overruns the margin below
# without the guards. The set and constructor cases were 60-80M elements (0.5-0.8 s) until one of
# them finished inside its 1 s budget on a faster CI machine: a case must dwarf its budget.
TYPED_ARRAYS = {
    "sort of 28M doubles": (256, "const a = new Float64Array(28e6);" + RANDOM + " a.sort()"),
    "toSorted of 10M doubles": (256, "const a = new Float64Array(10e6);" + RANDOM + " a.toSorted()"),
    "join of 100M bytes": (256, "new Uint8Array(100e6).join('')"),
    "toString of 100M bytes": (256, "String(new Uint8Array(100e6))"),
    "set converting 150M bytes to 16 bits": (512, "new Uint16Array(150e6).set(new Uint8Array(150e6))"),
    "set converting on the same buffer": (512, "const b = new ArrayBuffer(300e6);"
                                               " new Uint16Array(b).set(new Uint8Array(b, 0, 150e6))"),
    "a constructor converting 150M bytes": (512, "new Uint16Array(new Uint8Array(150e6))"),
}
BUDGET_SECONDS, MARGIN_SECONDS = 0.3, 0.4  # the setup (at most ~0.1 s) fits in the budget


@pytest.mark.parametrize("case", TYPED_ARRAYS)
def test_a_typed_array_method_over_a_huge_length_stops_at_the_deadline(worker: Worker, case: str) -> None:
    memory_mb, body = TYPED_ARRAYS[case]
    code = f"function f(e) {{ {body}; return 'finished'; }} function ok(e) {{ return 'fine'; }}"
    outcome, took = outcome_within_budget(worker, code, memory_mb, budget=BUDGET_SECONDS)
    assert isinstance(outcome, HandlerTimeout), outcome
    assert took < BUDGET_SECONDS + MARGIN_SECONDS, took


def _contexts() -> tuple[Any, Any]:
    """(a Context with the prelude, its typed-array chunk lowered to 4 elements; a plain one)."""
    guarded, plain = quickjs.Context(), quickjs.Context()
    prelude = js._PRELUDE.replace("TA_CHUNK = 1 << 18", "TA_CHUNK = 4")
    assert "TA_CHUNK = 4" in prelude
    guarded.eval(prelude)
    return guarded, plain


GUARDED, PLAIN = _contexts()
VALUES = "[3, -0, 0, NaN, -1, 2.5, 0, -0, 1e300, -Infinity, Infinity, 7, NaN, -3, 2.5, 0.1, 300, -129]"


@pytest.mark.parametrize("expr", [
    *(f"Array.from(new {kind}({VALUES}).sort(), x => Object.is(x, -0) ? '-0' : String(x))"
      for kind in ("Float64Array", "Float32Array", "Int8Array", "Uint8Array", "Uint8ClampedArray", "Int16Array",
                   "Uint32Array", "Uint16Array")),
    *(f"Array.from(new {kind}(new Float64Array(41).map((_, i) => (i * 7919) % 300 - 150)).sort())"
      for kind in ("Int8Array", "Uint8Array", "Uint8ClampedArray", "Int16Array", "Uint16Array")),
    *(f"Array.from(new {kind}({VALUES}.slice(0, n)).toSorted(), x => Object.is(x, -0) ? '-0' : String(x))"
      for kind in ("Float64Array", "Int32Array") for n in (5, 8, 9, 13, 17)),
    "Array.from(new BigInt64Array([5n, -3n, 0n, 2n ** 63n - 1n, -(2n ** 63n), 7n, 1n, -1n, 0n]).sort(), String)",
    "Array.from(new BigUint64Array([5n, 3n, 0n, 2n ** 64n - 1n, 7n, 1n]).toSorted(), String)",
    "(() => { const a = new Float64Array([5, 4, 3, 2, 1, 0]), s = a.sort(); return [s === a, Array.from(a)]; })()",
    "Array.from(new Float64Array(new ArrayBuffer(80), 16, 7).fill(2).fill(1, 3).sort())",
    f"new Float64Array({VALUES}).join()", f"new Int8Array({VALUES}).join('')", f"String(new Uint8Array({VALUES}))",
    f"new Float32Array({VALUES}).join({{toString() {{ return '<>'; }}}})", f"new Int16Array({VALUES}).join(undefined)",
    "new BigInt64Array([1n, 2n, 3n, 4n, 5n, 6n]).join('-')", "new Uint8Array(9).join(null)",
    "Array.prototype.join.call(new Uint8Array([1, 2, 3, 4, 5]), '+')",
    "(() => { try { return Uint8Array.prototype.join.call([1, 2, 3, 4, 5, 6]); } catch (e) { return e.name; } })()",
    *(f"(() => {{ const t = new {dst}(12); t.set(new {src}({VALUES}.slice(0, 9)), 2);"
      f" return Array.from(t, String); }})()"
      for dst, src in (("Uint16Array", "Float64Array"), ("Float32Array", "Int8Array"), ("Int8Array", "Int8Array"),
                       ("Uint8ClampedArray", "Float64Array"))),
    *(f"(() => {{ try {{ new Int8Array(8).set(new Int8Array(6), {off}); return 'set'; }} "
      f"catch (e) {{ return e.name; }} }})()"
      for off in ("3", "-1", "'2'", "NaN", "Infinity", "2n", "{valueOf() { return 1; }}")),
    "(() => { try { new Int8Array(8).set(new BigInt64Array(6)); return 'set'; } catch (e) { return e.name; } })()",
    # overlapping views of one buffer, both directions, of one kind and of two
    *(f"(() => {{ const b = new ArrayBuffer(32), u8 = new Uint8Array(b); u8.forEach((_, i) => u8[i] = i * 3);"
      f" new Int8Array(b, {d}).set(new Int8Array(b, {s}, 13)); return Array.from(u8); }})()"
      for d, s in ((0, 3), (3, 0), (0, 0))),
    "(() => { const b = new ArrayBuffer(32), u8 = new Uint8Array(b); u8.forEach((_, i) => u8[i] = i * 3);"
    " new Uint16Array(b).set(new Uint8Array(b, 0, 12)); return Array.from(u8); })()",
    "(() => { const b = new ArrayBuffer(32), u8 = new Uint8Array(b); u8.forEach((_, i) => u8[i] = i * 3);"
    " new Uint8Array(b).set(new Uint16Array(b, 8, 10)); return Array.from(u8); })()",
    *(f"Array.from(new {dst}(new {src}({VALUES})), String)" for dst, src in
      (("Uint16Array", "Float64Array"), ("Float64Array", "Int8Array"), ("Uint8Array", "Uint8Array"))),
    "(() => { class U extends Uint8Array {} const u = new U(new Float64Array([1, 2, 3, 4, 5, 300]));"
    " return [u instanceof U, u.constructor === U, Array.from(u)]; })()",
    "(() => { try { return new Int8Array(new BigInt64Array(6)); } catch (e) { return e.name; } })()",
])
def test_chunked_typed_array_methods_answer_as_the_natives(expr: str) -> None:
    code = f"(() => {{ try {{ return JSON.stringify({expr}); }} catch (e) {{ return 'threw ' + e.name; }} }})()"
    assert GUARDED.eval(code) == PLAIN.eval(code), expr


# -- host-side copies: what crosses into Python is outside the memory cap --------------------------

# 4M emoji are 8M UTF-16 units: 16 MB in QuickJS, and each crossing made Python allocate 76-137 MB
# (its UTF-8 text, its str, the JSON state parsed, a repr in an error message) before any check.
HUGE = "'\\u{1F600}'.repeat(4e6)"
CROSSINGS = {
    "a string reply": (f"function f(e) {{ return {HUGE}; }}", "the reply is 8000000 characters"),
    "a JSON reply": (f"function f(e) {{ return {{s: {HUGE}}}; }}", "the reply's JSON is 8000008 characters"),
    "an error message": (f"function f(e) {{ throw new Error({HUGE}); }}", "(cut: the message was 8000"),
    "a rejected promise": (f"async function f(e) {{ await null; throw {HUGE}; }}", "(cut: the message was 8000000"),
    "a log line": (f"function f(e) {{ log({HUGE}); return 'logged'; }}", None),
    "a kv value": (f"async function f(e) {{ await kv_set('k', {HUGE}); }}", "value of 65537 chars is over"),
    "a kv key": (f"async function f(e) {{ await kv_get({HUGE}); }}", "kv key must be a non-empty string"),
    "an async reply": ("async function f(e) { await null; return 'x'.repeat(9e6); }",
                       "the reply's JSON is 9000002 characters, over the limit of 262144"),
    # 300,000 references to one small tree: 8M characters of JSON, and ~240 MB of Python objects
    "an async reply of many objects": ("async function f(e) { await null;"
                                       " return new Array(3e5).fill({a: {a: {}}}); }",
                                       "the reply's JSON is 4500001 characters"),
    "a nested host call argument": ("async function f(e) {"
                                    " await kv_set('k', new Array(3e5).fill({a: {a: {a: {}}}})); }",
                                    "value must be a string or a number, not list"),
    "a reply with a log line queued": ("function f(e) { log('x'); return new Array(3e5).fill({a: {a: {a: {}}}}); }",
                                       "the reply's JSON is 6300001 characters"),
    "a replaced toJSON on the queue": ("async function f(e) { const t = new Array(3e5).fill({a: {a: {a: {}}}});"
                                       " Object.prototype.toJSON = () => t; Array.prototype.toJSON = () => t;"
                                       " await sleep(1); return 'done'; }", "no 'sleep' permission"),
}


@pytest.mark.parametrize("case", CROSSINGS)
def test_what_crosses_into_python_is_bounded_before_it_crosses(case: str) -> None:
    from plugins.errors import GuestError

    code, message = CROSSINGS[case]
    outcome, peak = _call_traced(code, name="crossing", memory_bytes=64 * MIB)
    if message is None:
        assert outcome == "logged"
    else:
        assert isinstance(outcome, GuestError) and message in str(outcome), outcome
        assert len(str(outcome)) < 9000
    assert peak < 4 * MIB, peak


# -- attacks that were already contained (kept so that they stay so) ------------------------------

LOOP = "{ for (;;) {} }"
CONTAINED = {  # handler body -> "timeout" (stopped at the deadline) or a fragment of the error
    "Atomics.wait on a shared buffer": ("Atomics.wait(new Int32Array(new SharedArrayBuffer(16)), 0, 0)",
                                        "cannot block"),
    "a regexp backtracking through a lookbehind": ("/(?<=(a|a)+)b/.test('a'.repeat(50000) + 'c')", "timeout"),
    "a regexp backtracking through a group": ("/^(a+)+$/.test('a'.repeat(40) + 'b')", "timeout"),
    "Error.prepareStackTrace that loops": (f"Error.prepareStackTrace = () => {LOOP}; for (;;) {{}}", "timeout"),
    "Error.captureStackTrace on a thrown object": ("const o = {toString() " + LOOP + "}; Error.captureStackTrace(o);"
                                                   " throw o", "timeout"),
    "Number.prototype.toString(3) in a loop": ("for (;;) (Math.PI * 1e300).toString(3)", "timeout"),
    "JSON.parse 1M levels deep": ("JSON.parse('['.repeat(1e6) + ']'.repeat(1e6))", "call stack"),
    "a reply 100k levels deep": ("let a = []; for (let i = 0; i < 1e5; i++) a = [a]; return a", "call stack"),
    "a generator spread forever": ("function* g() { for (;;) yield 1; } [...g()]", "memory"),
    "Promise.all of 3M promises": ("return Promise.all(new Array(3e6).fill(null))", "memory"),
    "an async generator that never ends": ("return (async () => { async function* g() { for (;;) yield 1; }"
                                           " for await (const x of g()) {} })()", "timeout"),
}


@pytest.mark.parametrize("case", CONTAINED)
def test_an_attack_that_was_already_contained_stays_so(worker: Worker, case: str) -> None:
    body, expected = CONTAINED[case]
    code = f"function f(e) {{ {body}; }} function ok(e) {{ return 'fine'; }}"
    outcome, took = outcome_within_budget(worker, code)
    if expected == "timeout":
        assert isinstance(outcome, HandlerTimeout), outcome
        assert BUDGET <= took < BUDGET + 0.5, took
    else:
        assert expected in str(outcome), outcome
        assert took < BUDGET + 0.5, took


@pytest.mark.xfail(reason="not fixed: one BigInt-to-decimal conversion of the largest BigInt takes ~2.5 s in C, "
                          "and `'' + b` reaches it through an operator no guard can wrap", strict=False)
def test_the_largest_bigint_turned_into_text_stops_near_the_deadline(worker: Worker) -> None:
    code = ("function f(e) { const b = (1n << 1048000n) - 1n; return ('' + b).length; }"
            " function ok(e) { return 'fine'; }")
    outcome, took = outcome_within_budget(worker, code)
    assert isinstance(outcome, HandlerTimeout), outcome
    assert took < BUDGET + 0.5, took


def test_per_request_calls_share_nothing() -> None:
    code = """
    let n = 0;
    function f(e) { n++; globalThis.seen = (globalThis.seen || 0) + 1; Array.prototype.extra = 1;
                    Object.prototype.polluted = true; return [n, seen, typeof [].extra, typeof ({}).polluted].join(); }
    """
    plugin = make("per_request", code=code, timeout=1.0)
    try:
        assert [plugin.call("f", event()) for _ in range(3)] == ["1,1,number,boolean"] * 3
    finally:
        plugin.close()


def test_stack_trace_hooks_never_reach_the_bindings_exception_text() -> None:
    """Error.prepareStackTrace runs guest code when QuickJS makes its own InternalError (interrupted)
    and sets what it returns as the error's stack: the binding must never turn that into text.
    In a child process (test_js_escapes' harness): a regression hangs it, not the suite."""
    import subprocess
    import sys

    from tests.plugins.test_js_escapes import CHILD, ROOT

    obj = "Error.prepareStackTrace = () => ({toString() " + LOOP + "});"
    cases = {
        "an object for a stack, then a loop": f"function h(e) {{ {obj} for (;;) {{}} }}",
        "an object for a stack, then out of memory": f"function h(e) {{ {obj} const a = [];"
                                                     " for (;;) a.push('x'.repeat(1000) + a.length); }",
        "a huge stack": "function h(e) { Error.prepareStackTrace = () => 'x'.repeat(1 << 23); for (;;) {} }",
        # the hook's own getters on QuickJS's InternalError, which the binding reads: hung the
        # process (2 runs in 3) before Error.prepareStackTrace was fixed at undefined
        **{f"a getter on the interrupted error's {key}, run {n}": "function h(e) { Error.prepareStackTrace = (err) =>"
           " { Object.defineProperty(err, '" + key + "', {get() " + LOOP + "}); return ''; }; for (;;) {} }"
           for key in ("message", "name", "toString") for n in (1, 2)},
        "top_level, an object for a stack": f"{obj} for (;;) {{}}",
        "top_level, an object for a stack, a TypeError": f"{obj} null.x",
    }
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    for name, outcome in outcomes.items():
        # (the TypeError at the top level: refused as the plugin's own error, the hook not being offered)
        expected = ("refused: timeout", "refused: plugin_invalid") if name.startswith("top_level") else \
            ("timeout", "error: memory cap")
        assert outcome.startswith(expected), (name, outcome)


def test_error_prepare_stack_trace_is_not_offered(worker: Worker) -> None:
    code = """
    function f(e) {
      Error.prepareStackTrace = () => "hooked";
      let stack;
      try { null.x; } catch (err) { stack = err.stack; }
      return [typeof Error.prepareStackTrace, stack === "hooked"].join();
    }
    function ok(e) { return 'fine'; }
    """
    outcome, _ = outcome_within_budget(worker, code)
    assert outcome == "undefined,false"


@pytest.mark.parametrize("body", [
    "return JSON.parse('['.repeat(1200) + ']'.repeat(1200))",  # a plain value: its JSON read at once
    "let a = []; for (let i = 0; i < 1500; i++) a = [a]; return Promise.resolve(a)",  # through a step
])
def test_a_reply_nested_too_deep_for_python_is_a_handler_error(worker: Worker, body: str) -> None:
    # QuickJS writes ~1,000-3,000 levels; Python's JSON parser recursed into a RecursionError that
    # left the runtime raw (no caller expects it from a plugin: WASM's replies had the same fix).
    from execapp.engine import HandlerError

    outcome, took = outcome_within_budget(worker, f"function f(e) {{ {body}; }} function ok(e) {{ return 'fine'; }}")
    assert isinstance(outcome, HandlerError) and "nests too deep" in str(outcome), repr(outcome)


class _FreshKV:
    """A dict KV store that hands out a new string on every get, as a database does, and keeps of a
    value set only its first character and length (a test's peak counts what crossed, not what is kept)."""

    def __init__(self) -> None:
        self.data: dict = {}

    def get(self, plugin: str, key: str, timeout: float) -> str | None:
        value = self.data.get((plugin, key))
        return None if value is None else (value + ".")[:-1]

    def set(self, plugin: str, key: str, value: str, timeout: float, quotas: Any = None) -> None:
        self.data[(plugin, key)] = (value[:1], len(value))

    def usage(self, plugin: str) -> tuple[int, int]:
        return len(self.data), 0


@pytest.fixture
def fresh_kv() -> Iterator[_FreshKV]:
    from plugins.runtimes import kvstore

    store = _FreshKV()
    previous = kvstore.install(store)
    yield store
    kvstore.install(previous)


def _call_traced(code: str, handler: str = "f", name: str = "batches",
                 memory_bytes: int | None = None) -> tuple[Any, int]:
    """(the reply or the GuestError of one call on a fresh JS instance, peak bytes Python allocated)."""
    import tracemalloc

    from plugins.errors import GuestError
    from plugins.runtimes.js import JsCompiled
    from plugins.spec import PluginSpec, Quotas

    # KV read quotas far above the 2,000 reads of 64 KiB below: these tests are about the batches.
    spec = PluginSpec(name=name, runtime="js", code=code, timeout=5.0, permissions=frozenset({"log", "kv"}),
                      quotas=Quotas(kv_reads=1 << 20, kv_read_bytes=1 << 40),
                      **({} if memory_bytes is None else {"memory_bytes": memory_bytes}))
    inst = JsCompiled(spec).new_instance()
    tracemalloc.start()
    try:
        try:
            outcome: Any = inst.call(handler, event(), time.monotonic() + 5.0)
        except GuestError as exc:
            outcome = exc
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        inst.close()
    return outcome, peak


def test_host_results_cross_into_js_in_bounded_batches(fresh_kv: _FreshKV) -> None:
    # 2,000 kv_get of a 64 KiB value queued at once: all their results were held in Python, then
    # JSON-encoded whole (128M characters: ~440 MB of RSS for a plugin capped at 16 MiB).
    fresh_kv.data[("batches", "big")] = "x" * 65536
    code = """async function f(e) {
      let n = 0;
      for (let i = 0; i < 2000; i++) kv_get('big').then(v => { n += v.length; });
      await kv_get('missing');
      return String(n);
    }"""
    outcome, peak = _call_traced(code)
    assert outcome == str(2000 * 65536)
    assert peak < 8 * MIB, peak


def test_queued_host_calls_cross_into_python_in_bounded_batches_and_in_order(fresh_kv: _FreshKV) -> None:
    # 90 kv_set of 65,000 characters (5.9M characters of arguments) queued in one step: they cross in
    # batches of at most MAX_BATCH_CHARS, every one of them run, in the order queued.
    code = """async function f(e) {
      const p = [];
      for (let i = 0; i < 90; i++) { p.push(kv_set("k" + i, String(i % 10).repeat(65000))); log("set " + i); }
      await Promise.all(p);
      return 'stored';
    }"""
    outcome, peak = _call_traced(code)
    assert outcome == "stored"
    assert [fresh_kv.data[("batches", f"k{i}")] for i in range(90)] == [(str(i % 10), 65000) for i in range(90)]
    assert peak < 5 * MIB, peak  # (a batch: ~3 MiB; all at once: 11)


ROPES = """
function sync(e) { const s = 'a'.repeat(600); return s + s; }
async function later(e) { await null; const s = 'b'.repeat(600); return s + s; }
function logged(e) { log('x'); const s = 'c'.repeat(600); return s + s; }
const long = 'd'.repeat(600);
long + long;
"""


@pytest.mark.parametrize("strategy", ["per_request", "pooled", "sharded"])
def test_strings_concatenated_past_512_characters_cross_to_python(strategy: str) -> None:
    # QuickJS-NG makes a rope of a `+` past 512 characters, a value the binding cannot read
    # ("Unknown quickjs tag: -6"): such a reply was "the plugin broke the host protocol" (the
    # instance discarded), and a top level ending with one failed its load with a raw TypeError.
    plugin = make(strategy, code=ROPES, timeout=1.0)
    try:
        assert [plugin.call(h, event()) for h in ("sync", "later", "logged")] == ["a" * 1200, "b" * 1200, "c" * 1200]
    finally:
        plugin.close()
