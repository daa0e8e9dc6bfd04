"""Built-ins whose one native loop is quadratic in what the guest sizes: stopped or refused, not run for seconds.

Each case ran for seconds past a 0.3 s budget at the default 16 MiB before its guard in
js_guards.js (measured on the 2-core dev machine, Dec 2026): a replacer list of 100,000 keys
18 s (each key looked up in the keys before it), a proxy ownKeys trap returning 100,000 keys
1.3 s (checked for duplicates pairwise), JSON.parse of 20,000 keys sharing one atom hash 1.07 s
(QuickJS's atom table walks a bucket per new key; its hash is fixed, so colliding keys are easy).
"""
from __future__ import annotations

import json
import time
from typing import Iterator

import pytest
import quickjs

from execapp.engine import HandlerError, HandlerTimeout
from tests.plugins.test_js_containment import BUDGET, Worker, event, make
from tests.plugins.test_js_redteam import outcome_within_budget

MIB = 1 << 20

# 62,001 distinct 4-character keys with one QuickJS atom hash: (a, 263 * (248 - a)) hashes alike for
# every a, as a pair of characters.
COLLIDING_KEYS = ("const ks = []; for (let a = 0; a < 249; a++) for (let b = 0; b < 249; b++)"
                  " ks.push(String.fromCharCode(a, 263 * (248 - a), b, 263 * (248 - b)));")
CASES = {  # handler body -> a fragment of the refusal
    "a JSON.stringify replacer list of 100,000 keys": (
        "const r = []; for (let i = 0; i < 100000; i++) r.push('k' + i); return JSON.stringify({}, r)",
        "JSON.stringify's replacer list of 100000 keys"),
    "a replacer list of 2,000 long keys that differ at their ends": (
        "const r = []; for (let i = 0; i < 2000; i++) r.push('x'.repeat(4000) + i); return JSON.stringify({}, r)",
        "JSON.stringify's replacer list"),
    "a proxy ownKeys trap returning 100,000 keys": (
        "const ks = []; for (let i = 0; i < 100000; i++) ks.push('k' + i);"
        " return Object.keys(new Proxy({}, {ownKeys: () => ks})).length",
        "the ownKeys trap returned 100000 keys"),
    "a revocable proxy's ownKeys trap": (
        "const ks = []; for (let i = 0; i < 100000; i++) ks.push('k' + i);"
        " return Reflect.ownKeys(Proxy.revocable({}, {ownKeys: () => ks}).proxy).length",
        "the ownKeys trap returned 100000 keys"),
    "JSON.parse of 20,000 keys with one hash": (  # (20,169 of the keys made: a loaded machine's budget)
        COLLIDING_KEYS.replace("a < 249", "a < 81")
        + " let t = '{'; for (let i = 0; i < 20000; i++) t += JSON.stringify(ks[i]) + ':1,';"
        " return Object.keys(JSON.parse(t + '\"x\": 1}')).length",
        "distinct keys in one bucket"),
    "Object.fromEntries of 20,000 keys with one hash": (
        COLLIDING_KEYS + " const en = ks.slice(0, 20000).map((k) => [k, 1]); for (;;) Object.fromEntries(en)",
        "timeout"),
}


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


@pytest.mark.parametrize("case", CASES)
def test_a_quadratic_native_loop_is_refused_within_the_budget(worker: Worker, case: str) -> None:
    body, refusal = CASES[case]
    code = f"function f(e) {{ {body}; }} function ok(e) {{ return 'fine'; }}"
    outcome, took = outcome_within_budget(worker, code)
    if refusal == "timeout":  # moved to bytecode: stopped at the deadline
        assert isinstance(outcome, HandlerTimeout), outcome
        assert took < BUDGET + 0.2, took
        return
    assert isinstance(outcome, HandlerError) and not isinstance(outcome, HandlerTimeout), outcome
    assert refusal in str(outcome) and "sandbox allows at most" in str(outcome), outcome
    assert took < BUDGET + 0.2, took


SEMANTICS = r"""
function f(e) {
  const out = [];
  // replacer lists: numbers, String and Number objects become keys, duplicates and others are dropped
  const o = {a: 1, b: {a: 2, c: 3}, 1: 4, c: [{a: 5, z: 0}], z: 9};
  out.push(JSON.stringify(o, ["c", "a", 1, new String("b"), new Number(1), {}, null, "a"]));
  out.push(JSON.stringify(o, []), JSON.stringify(o, {length: 2, 0: "z", 1: "a"}, 1));
  // proxies: traps still found on the handler, `ownKeys` results as before, its errors as before
  const h = {seen: 0, get(t, k) { this.seen++; return k === "seen" ? this.seen : Reflect.get(t, k); },
             ownKeys() { return ["b", "a", Symbol.iterator]; },
             getOwnPropertyDescriptor() { return {value: 1, enumerable: true, configurable: true}; }};
  const p = new Proxy({}, h);
  out.push(Object.keys(p), p.seen, Reflect.ownKeys(new Proxy({x: 1}, {})), Object.keys(new Proxy([1, 2], {})));
  const many = []; for (let i = 0; i < 300; i++) many.push("k" + i);
  out.push(Object.keys(new Proxy({}, {ownKeys: () => many, getOwnPropertyDescriptor: () =>
    ({value: 1, enumerable: true, configurable: true})})).length);
  for (const bad of [() => [1], () => ["a", "a"], () => null])
    try { Reflect.ownKeys(new Proxy({}, {ownKeys: bad})); out.push("no error"); } catch (x) { out.push(x.name); }
  // JSON.parse past the scan threshold: escapes, repeated and unicode keys, a reviver
  const rows = []; for (let i = 0; i < 3000; i++) rows.push({id: i, "q\"\\": "\\\"" + i, ["é" + i % 7]: [i, null]});
  const text = JSON.stringify(rows);
  out.push(text.length > 16384, JSON.stringify(JSON.parse(text)) === text);
  out.push(JSON.parse(text, (k, v) => k === "id" ? v * 2 : v)[2].id, JSON.parse(" [1, \"a\" ] "));
  try { JSON.parse(text.slice(0, -1)); out.push("no error"); } catch (x) { out.push(x.name); }
  // Object.fromEntries: any iterable of objects, keys made property keys, `__proto__` an own key
  const made = Object.fromEntries([["a", 1], [2, "b"], [Symbol.for("s"), 3], ["__proto__", 4], ["a", 5]]);
  out.push(JSON.stringify(made), made[Symbol.for("s")], Object.getPrototypeOf(made) === Object.prototype,
           JSON.stringify(Object.fromEntries(new Map([["x", 1]]))), Object.fromEntries.length);
  for (const bad of [[1], undefined, 5])
    try { Object.fromEntries(bad); out.push("no error"); } catch (x) { out.push(x.name); }
  return out;
}
"""


@pytest.mark.parametrize("strategy", ["per_request", "pooled"])
def test_the_guarded_built_ins_answer_as_the_natives(strategy: str) -> None:
    plugin = make(strategy, code=SEMANTICS, timeout=2.0)
    try:
        out = plugin.call("f", event())
    finally:
        plugin.close()
    native = quickjs.Context()  # the natives alone, no guards
    native.eval(SEMANTICS)
    assert out == json.loads(native.eval("JSON.stringify(f())"))
    assert out[0] == '{"c":[{"a":5}],"a":1,"1":4,"b":{"c":3,"a":2}}'
    assert out[3:] == [["b", "a"], 1, ["x"], ["0", "1"], 300, "TypeError", "TypeError", "TypeError",
                       True, True, 4, [1, "a"], "SyntaxError",
                       '{"2":"b","a":5,"__proto__":4}', 3, True, '{"x":1}', 1, "TypeError", "TypeError", "TypeError"]


# -- replacement strings: GetSubstitution runs natively at every match, no poll between matches ---

# handler body -> its reply, or "timeout": each ran for seconds to minutes in one native call at 16 MiB
# before js_guards.js made such a replacement a function (measured on the 2-core dev machine, Dec 2026:
# the first, with 2e4 matches, 412 s). A `$<` with no `>` scanned to the end of the replacement at
# each one (quadratic at one match); in bytecode each `>` is searched for once, and it answers at once.
SUBSTITUTIONS = {
    "a regexp replacement of 2M characters that writes nothing, 500 matches":
        ("return 'a'.repeat(500).replace(/(b)?a/g, '$1'.repeat(1e6)).length", "timeout"),
    "the same through replaceAll": ("return 'a'.repeat(500).replaceAll(/(b)?a/g, '$1'.repeat(1e6)).length", "timeout"),
    "named captures that match nothing":
        ("return 'a'.repeat(500).replace(/(?<n>b)?a/g, '$<n>'.repeat(5e5)).length", "timeout"),
    "one match, 50,000 `$<` with no `>`": ("return 'a'.replace(/(?<n>a)/, '$<'.repeat(5e4) + 'x').length", "100001"),
    "an empty string needle at each of 4M characters":
        ("return 'x'.repeat(4e6).replaceAll('', '$&'.repeat(64)).length", "timeout"),
}


@pytest.mark.parametrize("case", SUBSTITUTIONS)
def test_a_long_replacement_string_stops_at_the_deadline(worker: Worker, case: str) -> None:
    body, expected = SUBSTITUTIONS[case]
    outcome, took = outcome_within_budget(worker, f"function f(e) {{ {body}; }} function ok(e) {{ return 'fine'; }}")
    if expected == "timeout":
        assert isinstance(outcome, HandlerTimeout), outcome
    else:
        assert outcome == expected, outcome
    assert took < BUDGET + 0.5, took  # (unguarded: 4 s and more)


def _substituting_everywhere() -> quickjs.Context:
    """A Context with the prelude whose every replacement string with a `$` takes the bytecode path."""
    from plugins.runtimes import js

    guarded = quickjs.Context()
    prelude = js._PRELUDE.replace("SUBST_MAX = 1 << 24", "SUBST_MAX = -1")
    assert "SUBST_MAX = -1" in prelude
    guarded.eval(prelude)
    return guarded


REPLACEMENTS = ["$", "x$", "$$", "$&", "$`", "$'", "[$1]", "$2", "$01", "$10", "$11", "$12", "$0", "$00", "$9x",
                "$<n>", "$<m>", "$<", "$<n", "a$<n>b$<>c$<n>>", "$<$1>", "$$1", "$&$&", "-$'-$`-", "$a$", "$<n>$<"]
SUBJECTS = [
    "'abcabc'.replace(/(?<n>b)(c)?/g, REP)", "'abcabc'.replace(/b/, REP)", "'abcabc'.replace('b', REP)",
    "'abcabc'.replaceAll('bc', REP)", "'abc'.replaceAll('', REP)", "'a1b2'.replace(/(\\d)/g, REP)",
    "'abcdefghijkl'.replace(/(a)(b)(c)(d)(e)(f)(g)(h)(i)(j)(k)/, REP)", "'xyz'.replace(/(?<n>q)?y/, REP)",
    "'aaa'.replace(/(?:)/g, REP)", "RegExp.prototype[Symbol.replace].call(/(?<n>b)/, 'abc', REP)",
    # a custom exec whose groups is a string, and one whose groups has a getter
    "(() => { const r = /b/; r.exec = function () { this.exec = () => null;"
    " return {0: 'b', length: 1, index: 1, groups: 'ng'}; }; return 'abc'.replace(r, REP); })()",
    "(() => { const r = /b/; r.exec = function () { this.exec = () => null;"
    " return {0: 'b', length: 2, 1: 7, index: 9, groups: {get n() { return 'got'; }}}; }; return 'abc'.replace(r, REP);"
    " })()",
]


@pytest.mark.parametrize("subject", SUBJECTS)
def test_replacements_in_bytecode_answer_as_the_natives(subject: str) -> None:
    guarded, plain = _substituting_everywhere(), quickjs.Context()
    for r in REPLACEMENTS:
        expr = subject.replace("REP", json.dumps(r))
        assert guarded.eval(expr) == plain.eval(expr), (expr, guarded.eval(expr), plain.eval(expr))


# -- compiling a pattern: not polled, and each `\k<name>` before its group scans the whole pattern ---

# 20,000 forward named back-references (100,000 characters): ~4 s in one native compile at 16 MiB
# (200,000 of them: 474 s), each way of making a regexp of a string. exec refused such a pattern, but
# only after it was compiled.
FORWARD = "'\\\\k<x>'.repeat(2e4) + '(?<x>a)'"
COMPILES = {
    "new RegExp": f"new RegExp({FORWARD})",
    "RegExp called": f"RegExp({FORWARD})",
    "an object's text": f"new RegExp({{toString() {{ return {FORWARD}; }}}})",
    "a regexp-like's source": f"new RegExp({{[Symbol.match]: true, source: {FORWARD}, flags: 'g'}})",
    "a subclass": f"new (class extends RegExp {{}})({FORWARD})",
    "compile": f"/a/.compile({FORWARD})",
    "String.prototype.match": f"'abc'.match({FORWARD})",
    "String.prototype.matchAll": f"'abc'.matchAll({FORWARD})",
    "String.prototype.search": f"'abc'.search({{toString() {{ return {FORWARD}; }}}})",
}


@pytest.mark.parametrize("case", COMPILES)
def test_a_pattern_too_long_to_run_is_refused_before_it_compiles(worker: Worker, case: str) -> None:
    code = f"function f(e) {{ return String({COMPILES[case]}); }} function ok(e) {{ return 'fine'; }}"
    outcome, took = outcome_within_budget(worker, code)
    assert isinstance(outcome, HandlerError) and not isinstance(outcome, HandlerTimeout), outcome
    assert "on a pattern of 100007 characters: the sandbox allows at most 16384" in str(outcome), outcome
    assert took < BUDGET + 0.5, took  # (unguarded: 4 s and more)


REGEXPS = r"""
function f(e) {
  const r = /a/g; class R extends RegExp {}; const x = new R('b', 'y'), out = [];
  out.push(RegExp(r) === r, new RegExp(r) !== r, RegExp(r, 'i') !== r, r.constructor === RegExp, /a/ instanceof RegExp,
           x instanceof R, x instanceof RegExp, x.flags, RegExp.name, RegExp.length, typeof RegExp.escape,
           RegExp(r, 'i').flags, RegExp[Symbol.species] === RegExp, Object.getPrototypeOf(x) === R.prototype,
           Object.getPrototypeOf(RegExp('c')) === RegExp.prototype, String(new RegExp()),
           String(RegExp(undefined, 'g')), new RegExp({toString() { return 'q'; }}).source,
           new RegExp({[Symbol.match]: true, source: 'z', flags: 'm'}).flags,
           new RegExp({[Symbol.match]: true, source: 'z', flags: 'm'}, 's').flags, String(new RegExp(42)),
           String(new RegExp('a/b\n')), 'a-b-c'.split(/-/), 'a-b-c'.split(new R('-')).length, 'aXbX'.match('X').index,
           [...'aXbX'.matchAll('X')].length, 'aXbX'.search('b'), 'aXbX'.search({toString() { return 'X'; }}),
           'abc'.match({[Symbol.match]: () => 'own'}), 'a.c'.search('.'), String('x'.match()), 'x'.search(),
           String(/a/.compile('b', 'g')), String(/a/.compile(/c/m)), String(/a/.compile({toString() { return 'd'; }})));
  for (const bad of [() => new RegExp('('), () => RegExp.prototype.compile.call({}, 'a'), () => /a/.compile(/b/, 'g'),
                     () => new RegExp(Symbol()), () => 'abc'.matchAll(/b/), () => new RegExp('a', 'qq')])
    try { bad(); out.push("no error"); } catch (x) { out.push(x.name); }
  return out;
}
"""


def test_the_guarded_regexp_constructor_answers_as_the_native() -> None:
    plugin = make("pooled", code=REGEXPS, timeout=2.0)
    try:
        out = plugin.call("f", event())
    finally:
        plugin.close()
    native = quickjs.Context()
    native.eval(REGEXPS)
    assert out == json.loads(native.eval("JSON.stringify(f())"))


def test_a_source_whose_regexp_literals_would_compile_for_seconds_is_refused_at_save() -> None:
    # A literal compiles while the source is parsed (no poll): this one held validation 3.1 s past
    # its 0.3 s budget before it was refused with `timeout`; 200,000 back-references take minutes.
    import time

    from plugins.errors import CompileError
    from plugins.runtimes.js import JsCompiled
    from plugins.spec import PluginSpec

    code = "function g() { return /" + "\\k<x>" * 20000 + "(?<x>a)/; }\nfunction f(e) { return 'x'; }"
    started = time.monotonic()
    with pytest.raises(CompileError) as refused:
        JsCompiled(PluginSpec(name="backrefs", runtime="js", code=code, timeout=BUDGET))
    assert time.monotonic() - started < BUDGET
    assert refused.value.code == "plugin_invalid", refused.value
    assert "the source has 20000 named back-references" in str(refused.value)
    # a few of them, as real patterns have, are fine
    fine = "function f(e) { return String(/(?<q>['\"])(.*?)\\k<q>/.exec(e.args)[2]); }"
    assert JsCompiled(PluginSpec(name="backrefs", runtime="js", code=fine, timeout=BUDGET)).handlers == {"f"}


@pytest.mark.xfail(reason="not fixed: a regexp literal in eval's or Function's source compiles inside the parser, "
                          "which no guard sees first: QuickJS makes `eval(src)` direct only when the callee is the "
                          "realm's own eval (a wrapped global eval turns `eval('local')` into a ReferenceError), "
                          "and a guarded Function alone would leave eval open; 20,000 forward named back-references "
                          "take ~2.5 s in one call (5.8 s under load), a flat run of them never reaching the stack "
                          "check that stops other parser work once the watchdog escalates", strict=False)
def test_a_regexp_literal_compiled_by_eval_stops_near_the_deadline(worker: Worker) -> None:
    code = ("function f(e) { return String(eval('/' + '\\\\k<x>'.repeat(2e4) + '(?<x>a)/')); }"
            " function ok(e) { return 'fine'; }")
    outcome, took = outcome_within_budget(worker, code)
    assert isinstance(outcome, (HandlerTimeout, HandlerError)), outcome
    assert took < BUDGET + 0.5, took


def test_colliding_keys_in_an_eval_literal_stop_near_the_deadline(worker: Worker) -> None:
    """The parser's atom work (5.9 s for 40,000 keys of one hash, unguarded) is not polled, but the
    watchdog's escalation (a stack limit the parser checks as it recurses) ends it."""
    code = ("function f(e) { " + COLLIDING_KEYS + " const src = '({' + ks.slice(0, 40000).map((k) =>"
            " JSON.stringify(k) + ':1').join(',') + '})'; return Object.keys(eval(src)).length; }"
            " function ok(e) { return 'fine'; }")
    outcome, took = outcome_within_budget(worker, code)
    assert isinstance(outcome, (HandlerTimeout, HandlerError)), outcome
    assert took < BUDGET + 0.5, took


# A guest's exec result of 6,000 captures behind a prototype chain 30,000 deep (each missing capture
# walks it in C): 9.8 s in one replace, 19.8 s in one split at 16 MiB before the regexp facade.
DEEP_RESULT = ("let p = {}; for (let i = 0; i < 30000; i++) p = Object.create(p);"
               " const res = Object.create(p); res.length = 6000; res[0] = 'a'; res.index = 0; let n = 0;"
               " const deep = () => n++ ? null : res;")
DEEP_EXEC = {
    "replace": "const r = /a/; r.exec = deep; return 'abc'.replace(r, 'x');",
    "replaceAll": "const r = /a/g; r.exec = deep; return 'abc'.replaceAll(r, 'x');",
    # exec swapped by a getter the native runs after any check a guard could make before calling it
    "exec swapped by a flags getter": "const r = /a/; Object.defineProperty(r, 'flags', {get() {"
                                      " r.exec = deep; return ''; }}); return 'abc'.replace(r, 'x');",
    "RegExp.prototype.exec replaced": "RegExp.prototype.exec = deep; return 'abc'.replace(/a/, 'x');",
    "a plain object through Symbol.replace": "return RegExp.prototype[Symbol.replace].call({exec: deep,"
                                             " flags: ''}, 'abc', 'x');",
    "a species splitter's exec": "const r = /a/; r.constructor = {[Symbol.species]: function () {"
                                 " return {exec: deep, lastIndex: 0}; }}; return 'abc'.split(r);",
    "a subclass's exec, split": "class R extends RegExp { exec() { return deep(); } }"
                                " return 'abc'.split(new R('a'));",
    # a getter that gives the sandbox's exec to a first read and the guest's to the next (5.2 s)
    "a getter for RegExp.prototype.exec, split": "const ours = RegExp.prototype.exec; let k = 0;"
        " const moved = function () { const r = deep(); if (r) this.lastIndex = 1; return r; };"
        " Object.defineProperty(RegExp.prototype, 'exec', {get() { return k++ ? moved : ours; }});"
        " return 'abc'.split(/a/);",
}


@pytest.mark.parametrize("case", DEEP_EXEC)
def test_a_custom_exec_result_with_a_deep_chain_stops_near_the_deadline(worker: Worker, case: str) -> None:
    code = f"function f(e) {{ {DEEP_RESULT} {DEEP_EXEC[case]} }} function ok(e) {{ return 'fine'; }}"
    outcome, took = outcome_within_budget(worker, code)
    assert isinstance(outcome, HandlerTimeout), outcome
    assert took < BUDGET + 0.5, took


# A genuine array's holes cost a short walk each, but its length is the guest's: 2**32 - 1 ran 2.7 s
# in one replace at 256 MiB (1e7: 1.5 s) before exec results were bounded.
@pytest.mark.parametrize("result", ["{length: 2 ** 30}",
                                    "(() => { const a = ['a']; a.length = 2 ** 32 - 1; return a; })()",
                                    "(() => { const a = ['a']; a.length = 1e7; return a; })()"])
def test_a_custom_exec_result_past_the_captures_limit_is_refused(worker: Worker, result: str) -> None:
    code = (f"function f(e) {{ const a = {result}; a.index = 0; const r = /a/; let n = 0;"
            " r.exec = () => n++ ? null : a; return 'abc'.replace(r, 'x'); } function ok(e) { return 'fine'; }")
    outcome, took = outcome_within_budget(worker, code, memory_mb=256)
    assert isinstance(outcome, HandlerError) and "a RegExp exec result of length" in str(outcome), outcome
    assert took < BUDGET + 0.5, took


# A default sort compares ToString of each pair in one native call: 1M numbers ran 1.36 s, 2M 3.1 s,
# 2M short strings 1.76 s at 256 MiB before sorts past SORT_MAX comparisons left the native's loop.
# (Not more: the native makes every element a string first, and past that the cap ends it sooner. Of
# these cases only the first overran reliably here without the fix, 4.2 s; the others ended at
# 0.3-1.8 s from one run to the next.)
# The array is built by an earlier call (each call of a pooled plugin has its own budget).
@pytest.mark.parametrize(("method", "values"), [("sort", "Math.random()"), ("toSorted", "Math.random()"),
                                                ("sort", "String(Math.random())")])
def test_a_default_sort_of_millions_stops_near_the_deadline(worker: Worker, values: str, method: str) -> None:
    code = ("const b = []; function build(e) { for (let i = 0; i < 50000; i++) b.push(" + values + ");"
            " return String(b.length); } function f(e) { return String(b." + method + "().length); }"
            " function ok(e) { return 'fine'; }")
    _built_then_stopped(worker, code, 40, "2000000", 256 * MIB)


def _built_then_stopped(worker: Worker, code: str, builds: int, length: str, memory: int) -> None:
    """``build`` called ``builds`` times (to ``length`` elements, each call its own budget), then
    ``f`` ends in a timeout near the deadline, and the plugin serves on."""
    # The builds get a roomy budget (a busy machine may take more than BUDGET to build); the
    # attack gets BUDGET as its call's deadline, which is the budget under test.
    plugin = make("pooled", code=code, timeout=BUDGET * 20, memory_bytes=memory)
    try:
        for _ in range(builds):
            built = plugin.call("build", event())
        assert built == length, built

        def call() -> object:
            try:
                return plugin.call("f", event(), deadline=time.monotonic() + BUDGET)
            except HandlerTimeout as exc:
                return exc
        started = time.monotonic()
        outcome = worker.run(call, BUDGET * 20)
        took = time.monotonic() - started
        assert isinstance(outcome, HandlerTimeout), outcome
        assert took < BUDGET + 0.5, took
        assert plugin.call("ok", event()) == "fine"
    finally:
        plugin.close()


def test_joining_millions_of_numbers_stops_near_the_deadline(worker: Worker) -> None:
    """join (and toString) makes each element a string in one native loop: 4M numbers ran 1.25 s at
    384 MiB before long genuine arrays were joined in runs. Built by earlier calls, as above."""
    code = ("const b = []; function build(e) { for (let i = 0; i < 200000; i++) b.push(Math.random());"
            " return String(b.length); } function f(e) { for (;;) String(b); } function ok(e) { return 'fine'; }")
    _built_then_stopped(worker, code, 20, "4000000", 384 * MIB)
