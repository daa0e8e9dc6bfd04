"""Red team of the Lua sandbox: what a hostile plugin author tries beyond test_lua_containment.py and
test_lua_hostile.py, through LoadedPlugin.call.

Two groups:
- escapes found and fixed (each test fails without its fix): a table reply whose entries share one
  large string (copied into Python once per entry before any charge: gigabytes under a 16 MB cap),
  a text reply over MAX_REPLY_BYTES (copied into Python whole before plugins.loaded refused it),
  host-call arguments the sandbox checked natively and copied whole (a non-UTF-8 log line: one
  native gsub of seconds), ``string.format("%q")`` of a large string (~60 ns a byte in one C call),
  a timeout unwinding through thousands of looping ``__close`` handlers (10,000 instructions each),
  and a plain table's ``unpack`` over absent keys whose lookups walk a chain of colliding integer keys;
- attacks already contained, kept so they stay so: each ends with the expected code within
  2x its budget + 0.5 s, the process alive and the next call fine.

The runaways run in child processes with a hard timeout and an address-space limit, so an escape
fails its test instead of hanging or exhausting the suite's process.
"""
from __future__ import annotations

import time
import tracemalloc

import pytest

from execapp.engine import HandlerError
from plugins.errors import GuestTimeout
from plugins.loaded import LoadedPlugin
from plugins.runtimes import lua
from plugins.spec import PluginSpec

from .children import run_in_children

BUDGET = 0.3
BOUND = 2 * BUDGET + 0.5
HARD = 20.0  # seconds a child may spend on one case before it counts as hung
EVENT = {"id": "e", "type": "message", "text": "x", "args": "x", "data": {}, "session": "s"}

# A chain of n tables, each the __index and __newindex of the one before, the last holding `last`'s entries.
CHAIN = ("local function chain(n, last) local t = {} local cur = t for i = 1, n do local nx = {} "
         "setmetatable(cur, {__index = nx, __newindex = nx}) cur = nx end "
         "for k, v in pairs(last or {}) do cur[k] = v end return t end ")

# name -> (handler body, memory_mb, budget s, expected codes, a substring of the message or None).
# Already contained before this file: kept as regression cases.
CONTAINED: dict[str, tuple[str, int, float, tuple[str, ...], str | None]] = {
    # escapes of the environment
    "string_metatable": ("local mt = getmetatable('') if mt ~= false then return 'open' end "
                         "return (pcall(function() getmetatable('').__index.upper = nil end)) and 'open' or 'closed'",
                         16, BUDGET, ("ok",), None),
    "library_tables_readonly": ("local n = 0 for _, lib in ipairs({string, table, math, utf8, coroutine}) do "
                                "if pcall(function() lib.x = 1 end) then n = n + 1 end end "
                                "if rawget(string, 'rep') ~= nil or next(string) ~= nil then n = n + 1 end return n",
                                16, BUDGET, ("ok",), None),
    "no_ambient_authority": ("return tostring(rawset) .. tostring(load) .. tostring(string.dump) .. tostring(os) .. "
                             "tostring(io) .. tostring(debug) .. tostring(package) .. tostring(require) .. "
                             "tostring(collectgarbage) .. tostring(dofile) .. tostring(python) .. "
                             "tostring(getmetatable(_ENV)) .. tostring(('').dump)", 16, BUDGET, ("ok",), None),
    "main_coroutine": ("local m = coroutine.running() return tostring(coroutine.resume(m)) .. "
                       "tostring(pcall(coroutine.close, m)) .. tostring(pcall(coroutine.yield))", 16, BUDGET,
                       ("ok",), None),
    "gc_set_after_setmetatable": ("local mt = {} local t = setmetatable({}, mt) "
                                  "mt.__gc = function() while true do end end t = nil "
                                  "local x for i = 1, 3e5 do x = {} end return 'ok'", 16, BUDGET, ("ok",), None),
    # standard-library C functions with sizes from the guest
    "format_width": ("return string.format('%99999d', 1)", 16, BUDGET, ("handler_error",), "invalid conversion"),
    "rep_overflowing_size": ("return string.rep('x', math.maxinteger, 'y')", 16, BUDGET, ("memory_limit",),
                             "string.rep"),
    "move_string_bounds": ("return table.move({}, '1', '1e12', '1')", 16, BUDGET, ("timeout",), None),
    "move_wraps": ("return table.move({}, 1, math.maxinteger, 2)", 16, BUDGET, ("handler_error",), "wrap around"),
    "unpack_full_range": ("return select('#', table.unpack({}, math.mininteger, math.maxinteger))", 16, BUDGET,
                          ("handler_error",), "too many results"),
    "unpack_999k_loop": ("local t = {} while true do local n = select('#', table.unpack(t, 1, 999000)) end",
                         16, BUDGET, ("timeout",), None),
    "utf8_char_many_args": ("local t = {} for i = 1, 200000 do t[i] = 0x10FFFF end "
                            "while true do local s = utf8.char(table.unpack(t)) end", 16, BUDGET, ("timeout",), None),
    "string_char_many_args": ("local t = {} for i = 1, 200000 do t[i] = 65 end "
                              "while true do local s = string.char(table.unpack(t)) end", 16, BUDGET,
                              ("timeout",), None),
    "pack_many_args": ("local t = {} for i = 1, 200000 do t[i] = 1 end "
                       "while true do local s = string.pack(string.rep('j', 200000), table.unpack(t)) end",
                       16, BUDGET, ("memory_limit", "timeout"), None),
    "unpack_long_format": ("local f, s = string.rep('b', 200000), string.rep('a', 200000) "
                           "while true do local x = select('#', string.unpack(f, s)) end", 16, BUDGET,
                           ("timeout",), None),
    "unpack_huge_count": ("return string.unpack('c1000000000', 'x')", 16, BUDGET, ("handler_error",), "too short"),
    "concat_huge_separator": ("local t = {} for i = 1, 4000 do t[i] = 'a' end "
                              "while true do local x = table.concat(t, string.rep('s', 1e6)) end", 16, BUDGET,
                              ("memory_limit",), None),
    "sort_inconsistent_order": ("local t = {} for i = 1, 50000 do t[i] = i end "
                                "table.sort(t, function(a, b) return true end) return 'sorted'", 16, BUDGET,
                                ("handler_error",), "invalid order function"),
    "sort_nan": ("local t = {} for i = 1, 100000 do t[i] = (i % 3 == 0) and 0/0 or i end table.sort(t) return 'ok'",
                 16, BUDGET, ("ok", "handler_error", "timeout"), None),  # (a loaded machine: 0.42 s, timeout)
    "tonumber_base_loop": ("local s = string.rep('1', 1e6) while true do local x = tonumber(s, 2) end", 16, BUDGET,
                           ("timeout",), None),
    "gsub_whole_match_repeated": ("local s = string.rep('a', 2000) "
                                  "while true do local x = s:gsub('.+', string.rep('%0', 3000)) end", 16, BUDGET,
                                  ("timeout",), None),
    "gsub_capture_repeated": ("local s = string.rep('a', 1000) "
                              "while true do local x = s:gsub('(.*)', string.rep('%1', 3000)) end", 16, BUDGET,
                              ("timeout",), None),
    "balance_unclosed": ("local s = string.rep('(', 20000) while true do local x = s:find('%b()') end", 16, BUDGET,
                         ("timeout",), None),
    "backreference_chain": ("local s = string.rep('a', 60000) while true do local x = s:find('(a+)%1%1%1%1c') end",
                            16, BUDGET, ("timeout",), None),
    "frontier_runs": ("local s = string.rep('a', 60000) while true do local x = s:find('%f[a]a*%f[b]') end", 16,
                      BUDGET, ("timeout",), None),
    "gmatch_iterator_kept": ("local it = string.rep('a', 3000):gmatch('.-.-.-b') while true do it() end", 16,
                             BUDGET, ("timeout",), None),
    # control flow, metamethods, error objects
    "goto_loop": ("::a:: goto a", 16, BUDGET, ("timeout",), None),
    "recursion_in_pcall": ("local function f() return pcall(f) end while true do f() end", 16, BUDGET,
                           ("timeout",), None),
    "index_recursion": ("local t = setmetatable({}, {}) getmetatable(t).__index = function(t, k) return t[k] end "
                        "return t.x", 16, BUDGET, ("handler_error",), "stack overflow"),
    "ipairs_endless_index": ("local t = setmetatable({}, {__index = function(t, i) return i end}) "
                             "for i, v in ipairs(t) do end", 16, BUDGET, ("timeout",), None),
    "error_tostring_recursive": ("local mt = {} mt.__tostring = function(s) return tostring(setmetatable({}, mt)) end "
                                 "error(setmetatable({}, mt))", 16, BUDGET, ("handler_error",), "__tostring failed"),
    "error_tostring_huge": ("error(setmetatable({}, {__tostring = function() return string.rep('x', 6e6) end}))",
                            16, BUDGET, ("handler_error",), "(6000000 bytes)"),
    # print's arguments were read with select(i, ...) each (quadratic): 400,000 could not be printed
    "print_many_args": ("local t = {} for i = 1, 400000 do t[i] = 'x' end print(table.unpack(t)) return 'printed'",
                        64, 1.0, ("ok",), None),
    "close_in_coroutine_wrap": ("local f = coroutine.wrap(function() local x <close> = setmetatable({}, "
                                "{__close = function() while true do end end}) coroutine.yield() end) f() "
                                "while true do end", 16, BUDGET, ("timeout",), None),
    # a coroutine that fails keeps its to-be-closed variables open (resume, not wrap): only the main
    # thread's __close runs
    "close_chain_in_coroutine": ("local mt = {__close = function() while true do end end} local function f(n) "
                                 "local x <close> = setmetatable({}, mt) if n > 0 then return (f(n - 1)) end "
                                 "while true do end end local z <close> = setmetatable({}, mt) "
                                 "coroutine.wrap(function() local y <close> = setmetatable({}, mt) f(60000) end)()",
                                 64, 0.5, ("timeout",), "ran past its 500 ms timeout"),
}

# Escapes found here and fixed: without the fix each ran far past its budget (or copied gigabytes).
FIXED: dict[str, tuple[str, int, float, tuple[str, ...], str | None]] = {
    # one native gsub over the whole non-UTF-8 line in the sandbox's host_call (~30 ns a byte):
    # ~3 s for 100 MB before the line was cut to what Host.log keeps
    "log_huge_binary_line": ("local s = string.rep('\\255', 100e6) log(s) return 'logged'", 512, 1.0, ("ok",),
                             None),
    # after the deadline the timeout unwinds through every frame's __close: each ran up to the hook's
    # 10,000 instructions first (60,000 frames: ~3 s past a 0.5 s budget, more with more frames)
    "close_chain": ("local mt = {__close = function() while true do end end} local function f(n) "
                    "local x <close> = setmetatable({}, mt) if n > 0 then return (f(n - 1)) end while true do end "
                    "end f(60000)", 64, 0.5, ("timeout",), "ran past its 500 ms timeout"),
    # a conversion's flags next to a large %q argument are matched on a bounded piece
    "format_q_long_flags": ("return string.format('%q%' .. string.rep('-', 1e6) .. 'd', string.rep('a', 7e4), 1)",
                            16, BUDGET, ("handler_error",), "invalid"),
    # string.format("%q") of 80 MB of control bytes: one C call of ~3 s before it ran in pieces (~3.5 s
    # in pieces to its end; string.rep takes ~0.1 s of the budget). Measured on the 2-core dev machine,
    # Dec 2026: 24 MB was 0.9 s either way, inside the bound unguarded, and near the budget on a
    # machine twice as fast.
    "format_q_large": ("local s = string.rep('\\0', 80e6) local x = string.format('%q', s) return #x", 640, BUDGET,
                       ("timeout",), None),
    # string.rep of a tiny unit whose result is over half the memory cap ran as one native loop of
    # k one-byte copies (the pieces needed room for two copies): 1e9 took 3.4 s on a 0.3 s budget
    # (now refused before any work: the result and its buffer are over the cap)
    "rep_tiny_unit_most_of_the_cap": ("local s = string.rep('a', 1e9) return #s", 1024, BUDGET,
                                      ("timeout", "memory_limit"), None),
    # lauxlib builds string.rep's result in a buffer and then copies it: a result over half the cap
    # failed only after all the copying, as a bare "memory cap exceeded"; now refused before any work
    "rep_result_and_buffer_over_the_cap": ("return #string.rep('a', 9e6)", 16, BUDGET, ("memory_limit",),
                                           "string.rep: the result and the buffer it is built in would be"),
    # a plain table's unpack ran natively over the whole range: integer keys hashed without a seed make
    # the chain an absent key's lookup walks as long as the table, and 800,000 such lookups next to a
    # chain of 16,382 colliding keys (built in ~0.3 s) ran 18 s in one native call on a 1.5 s budget
    "unpack_colliding_keys": ("local S = 1 << 15 local t = {} "
                              "for i = 1, S // 2 + 1 do t[i * 2 + 1000000] = true end "
                              "for i = 1, S // 2 + 1 do t[i * 2 + 1000000] = nil end "
                              "for i = 1, S // 2 - 2 do t[i * (S - 1)] = true end "
                              "return select('#', table.unpack(t, S, S + 799999))", 16, 1.5, ("timeout",), None),
    # coroutine.close runs a coroutine's pending __close handlers in it, and it was not tracked like a
    # resume: once the coroutine had left the tracked set (70 other coroutines resumed; or, pooled,
    # resumed in an earlier call) the watchdog could not reach a loop of 30 MB concatenations there,
    # ~3 ms each between two hooks of 10,000 instructions: 12 s past a 0.3 s budget
    "close_untracked_suspended": ("local co = coroutine.create(function() local x <close> = setmetatable({}, "
                                  "{__close = function() local s = string.rep('x', 30e6) "
                                  "while true do local y = s .. 'x' end end}) coroutine.yield() end) "
                                  "coroutine.resume(co) "
                                  "for i = 1, 70 do coroutine.resume(coroutine.create(function() end)) end "
                                  "coroutine.close(co) return 'closed'", 64, BUDGET, ("timeout",), None),
    # a coroutine that failed keeps its to-be-closed variables open: close runs them (dead, not suspended)
    "close_untracked_failed": ("local co = coroutine.create(function() local x <close> = setmetatable({}, "
                               "{__close = function() local s = string.rep('x', 30e6) "
                               "while true do local y = s .. 'x' end end}) error('boom') end) "
                               "coroutine.resume(co) "
                               "for i = 1, 70 do coroutine.resume(coroutine.create(function() end)) end "
                               "coroutine.close(co) return 'closed'", 64, BUDGET, ("timeout",), None),
    # string.format ran all its conversions in one native call, and each %s with a precision is a
    # strlen of the whole string: 2,000 x '%.1s' of one 30 MB string ran 5.5 s on a 0.3 s budget (the
    # guard charged the work but let the call run); now each conversion is its own native call
    "format_precision_many_args": ("local big = string.rep('x', 30e6) local t = {} for i = 1, 2000 do t[i] = big end "
                                   "return #string.format(string.rep('%.1s', 2000), table.unpack(t))", 64, BUDGET,
                                   ("timeout",), None),
    # the same through a table whose __tostring is a native (next: its key, the 30 MB string), a cost
    # no guard sees before the call: 4.9 s on a 0.3 s budget
    "format_native_tostring_many_args": ("local big = string.rep('x', 30e6) "
                                         "local o = setmetatable({[big] = true}, {__tostring = next}) "
                                         "local t = {} for i = 1, 2000 do t[i] = o end "
                                         "return #string.format(string.rep('%.1s', 2000), table.unpack(t))", 64,
                                         BUDGET, ("timeout",), None),
    # a C loop's access to a key a table lacks walks the table's __index chain natively, up to 2,000
    # tables (~30 us) an access, unseen by any hook: gsub with such a table as its replacement did
    # 600,000 lookups in one native call, 33 s on a 0.3 s budget (the guard counted 48 units a match)
    "gsub_index_chain": (CHAIN + "local t = chain(1990) return #string.gsub(string.rep('a', 600000), '.', t)",
                         64, BUDGET, ("timeout",), None),
    # the same with a chain of one table ending in a function that makes the chain 1,990 tables long at
    # the first lookup: 27 s (the chain's length when the call starts does not bound it)
    "gsub_index_rewired": (CHAIN + "local long = chain(1990) local t = setmetatable({}, {__index = function(t) "
                           "setmetatable(t, getmetatable(long)) end}) "
                           "return #string.gsub(string.rep('a', 600000), '.', t)", 64, BUDGET, ("timeout",), None),
    # gsub with a position capture looks its table up by integers, hashed without a seed: 800,000
    # absent positions next to a chain of 16,382 colliding keys, in one native call (the guard counted
    # 48 units a match), ran 41 s on a 3 s budget; now the lookups run in the Lua matcher
    "gsub_position_keys_colliding": ("local S = 1 << 15 local t = {} "
                                     "for i = 1, S // 2 + 1 do t[i * 2 + 1000000] = true end "
                                     "for i = 1, S // 2 + 1 do t[i * 2 + 1000000] = nil end "
                                     "for i = 1, S // 2 - 2 do t[i * (S - 1)] = 'x' end "
                                     "return select(2, string.gsub(string.rep('a', 799999), '()', t))", 64, 1.5,
                                     ("timeout",), None),
    # a traversal's first step scans the table's array part: one table of a million nil slots referenced
    # 60,000 times (each reference counted and converted) was read for 4.5 s past a 0.5 s budget, with
    # the clock read every 4,096 tables (1,024 in the converter); now before every table
    "reply_shared_sparse_table": ("local t = {} for i = 1, 1e6 do t[i] = i end for i = 1, 1e6 do t[i] = nil end "
                                  "local r = {} for i = 1, 60000 do r[i] = t end return r", 64, 0.5, ("timeout",),
                                  "while its reply was converted"),
    # a default-order sort of 4,095 elements with holes read through a 1,990-table chain ran natively
    # (its comparisons looked cheap): ~3 s on a 0.3 s budget; now the table is copied to a plain array
    "sort_holes_index_chain": (CHAIN + "local src = {} for i = 1, 4096 do src[i] = (i * 7919) % 4096 end "
                               "local t = {} for i = 1, 4096 do t[i] = i end for i = 2, 4095, 2 do t[i] = nil end "
                               "setmetatable(t, getmetatable(chain(1990, src))) local n = #t table.sort(t) "
                               "return n", 64, BUDGET, ("ok", "timeout"), None),
}

_CHILD = r"""
import json, resource, sys, time
import django
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
django.setup()
from plugins.loaded import LoadedPlugin
from plugins.spec import PluginSpec
job = json.loads(sys.stdin.read())
event = job["event"]
for name, (body, memory_mb, budget) in job["cases"]:
    print(json.dumps({"start": name}), flush=True)
    plugin = LoadedPlugin(PluginSpec(name="redteam", runtime="lua", strategy=job["strategy"], timeout=budget,
                                     code="function h(e) " + body + "\nend\nfunction ok(e) return 'fine' end",
                                     memory_bytes=memory_mb << 20, pool_size=1, shard_count=1, max_concurrency=1,
                                     permissions=frozenset({"log", "kv", "http", "sleep"})))
    start = time.monotonic()
    try:
        reply, code, message = plugin.call("h", event), "ok", ""
    except BaseException as exc:
        reply, code, message = None, getattr(exc, "code", type(exc).__name__), str(exc)
    elapsed = time.monotonic() - start
    try:
        after = plugin.call("ok", event)
    except BaseException as exc:
        after = repr(exc)
    print(json.dumps({"case": name, "code": code, "elapsed": elapsed, "message": message[:6000],
                      "reply": repr(reply)[:200], "after": after}), flush=True)
    plugin.close()
"""


def run_cases(strategy: str, cases: dict[str, tuple]) -> dict[str, dict]:
    """Each case's outcome in child processes; a case still running after HARD seconds is 'hung'."""
    return run_in_children(_CHILD, lambda pending: {"strategy": strategy, "event": EVENT,
                                                    "cases": [(n, cases[n][:3]) for n in pending]}, list(cases), HARD)


ALL = {**CONTAINED, **FIXED}


#: Each strategy's outcomes, run once: xdist's order can set a module fixture up again for a
#: param it already had (4 setups of ~13 s for 2 strategies in a full run).
_OUTCOMES: dict[str, dict[str, dict]] = {}


@pytest.fixture(scope="module", params=["per_request", "pooled"])
def outcomes(request) -> tuple[str, dict[str, dict]]:
    if request.param not in _OUTCOMES:
        _OUTCOMES[request.param] = run_cases(request.param, ALL)
    return request.param, _OUTCOMES[request.param]


@pytest.mark.parametrize("case", sorted(ALL))
def test_an_attack_ends_within_its_budget_and_the_next_call_is_fine(outcomes, case: str) -> None:
    strategy, results = outcomes
    _, _, budget, codes, text = ALL[case]
    got = results[case]
    assert got["code"] in codes, f"{case} [{strategy}]: {got['code']} after {got['elapsed']:.2f} s: " \
                                 f"{got['message'][:300] or got['reply']}"
    assert got["elapsed"] < 2 * budget + 0.5, f"{case} [{strategy}] ran {got['elapsed']:.2f} s under {budget} s"
    if text is not None:
        assert text in got["message"], got["message"][:300]
    assert got["after"] == "fine", got["after"]
    assert "'open'" not in got["reply"]


def test_contained_escapes_reply_as_expected(outcomes) -> None:
    _, results = outcomes
    assert results["string_metatable"]["reply"] == "'closed'"
    assert results["library_tables_readonly"]["reply"] == "'0'"
    assert results["no_ambient_authority"]["reply"] == "'nilnilnilnilnilnilnilnilnilnilnilfalsenil'"
    assert results["main_coroutine"]["reply"] == "'falsefalsefalse'"


# ---------------------------------------------------------------------------------------------
# Replies: what crosses into Python is bounded before it is copied.

def _python_peak(plugin: LoadedPlugin, handler: str) -> tuple[int, BaseException | None]:
    """Peak bytes Python allocated during one call (lupa's copies of Lua strings are Python objects)."""
    tracemalloc.start()
    try:
        try:
            plugin.call(handler, EVENT)
            exc = None
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            exc = e
        return tracemalloc.get_traced_memory()[1], exc
    finally:
        tracemalloc.stop()


def test_a_string_shared_by_every_entry_of_a_reply_is_not_copied_once_per_entry() -> None:
    # 200 entries x one 4 MB string: each entry's string was copied into Python (800 MB, ~1 s after
    # the deadline) before the first was charged against the reply's budget.
    plugin = LoadedPlugin(PluginSpec(name="shared", runtime="lua", timeout=2, memory_bytes=16 << 20, code=(
        "function h(e) local s = string.rep('a', 4e6) local t = {} for i = 1, 200 do t[i] = s end return t end "
        "function d(e) local s = string.rep('a', 4e6) local t = {} for i = 1, 200 do t['k' .. i] = s end "
        "return {x = t} end")))
    for handler in ("h", "d"):
        peak, exc = _python_peak(plugin, handler)
        assert isinstance(exc, HandlerError) and "reply's strings are longer than" in str(exc), exc
        assert peak < 64 << 20, f"{handler}: Python allocated {peak >> 20} MB converting the reply"


def test_a_text_reply_over_the_reply_limit_is_refused_before_it_crosses() -> None:
    plugin = LoadedPlugin(PluginSpec(name="long", runtime="lua", timeout=5, memory_bytes=128 << 20, code=(
        "function h(e) return string.rep('a', 40e6) end "
        "function fits(e) return string.rep('a', 262144) end")))
    peak, exc = _python_peak(plugin, "h")
    assert isinstance(exc, HandlerError) and "the reply is 40000000 bytes of text" in str(exc), exc
    assert "MAX_REPLY_BYTES" in str(exc)
    assert peak < 16 << 20, f"Python allocated {peak >> 20} MB for a refused reply"
    assert plugin.call("fits", EVENT) == "a" * 262144


# ---------------------------------------------------------------------------------------------
# Host-call arguments: bounded in the sandbox before any native work or copy.

def test_a_huge_host_argument_is_refused_in_the_sandbox_with_what_fits() -> None:
    plugin = LoadedPlugin(PluginSpec(name="args", runtime="lua", timeout=5, memory_bytes=64 << 20,
                                     permissions=frozenset({"kv", "http"}), http_allowlist=("127.0.0.1",), code=(
        "function kv(e) return select(2, pcall(kv_set, 'k', string.rep('\\255', 20e6))) end "
        "function url(e) return select(2, pcall(http_get, 'http://127.0.0.1/' .. string.rep('a', 20e6))) end")))
    for handler, argument in (("kv", "argument 2 is 20000000 bytes"), ("url", "argument 1 is 20000017 bytes")):
        peak, exc = _python_peak(plugin, handler)
        assert exc is None
        reply = plugin.call(handler, EVENT)
        assert argument in reply and "more than a host call takes (262144 bytes" in reply, reply
        assert peak < 8 << 20


def test_a_long_log_line_is_cut_at_a_character_and_keeps_its_text(caplog) -> None:
    plugin = LoadedPlugin(PluginSpec(name="cut", runtime="lua", timeout=5, memory_bytes=64 << 20,
                                     permissions=frozenset({"log"}), code=(
        "function h(e) log(string.rep('\\u{20AC}', 3000)) log('x' .. string.rep('\\u{20AC}', 3000)) "
        "log(string.rep('\\255', 5e6)) return 'ok' end")))
    with caplog.at_level("INFO", logger="plugins.guest"):
        assert plugin.call("h", EVENT) == "ok"
    lines = [r.getMessage() for r in caplog.records if r.name == "plugins.guest"]
    assert lines[0] == "[cut] " + "\u20ac" * 2000  # what Host.log keeps (MAX_LOG_CHARS), not '?'s
    assert lines[1] == "[cut] x" + "\u20ac" * 1999
    assert lines[2] == "[cut] " + "?" * 2000


# ---------------------------------------------------------------------------------------------
# string.format("%q"): large arguments are escaped in pieces, with the native result.

def test_format_q_in_pieces_gives_the_native_result() -> None:
    spec = PluginSpec(name="q", runtime="lua", timeout=30, memory_bytes=128 << 20, code=r"""
        function h(e)
          math.randomseed(tonumber(e.args))
          local alphabet = {"\0", "\1", "\n", "\r", "\\", '"', "0", "1", "9", "a", "\127", "\31", "%"}
          local out = {}
          for _, n in ipairs({65535, 65536, 65537, 131072, 131073, 200001}) do
            local t = {} for i = 1, n do t[i] = alphabet[math.random(#alphabet)] end
            local s = table.concat(t)
            out[#out + 1] = string.format("x%%q%5.2fy%qz%s%q%d", 1.5, s, "mid", s:sub(1, 70000), 7)
            out[#out + 1] = string.format("%q", s)
          end
          -- a boundary that falls between a control byte and a digit
          out[#out + 1] = string.format("%q", string.rep("a", 65535) .. "\0" .. "7" .. string.rep("b", 70000))
          out[#out + 1] = string.format("%q", string.rep("a", 65534) .. "\0" .. "7" .. string.rep("b", 70000))
          local r, h = table.concat(out, "|"), 0
          for i = 1, #r, 4096 do  -- a digest: the result is over MAX_REPLY_BYTES
            local t = {r:byte(i, i + 4095)}
            for j = 1, #t do h = (h * 31 + t[j]) % 2147483647 end
          end
          return #r .. ":" .. h
        end""")
    bytecode = lua.compile_bytecode(spec)
    for seed in ("1", "2"):
        results = [lua._LuaVM(spec, bytecode, guards=guards).call_fresh("h", {"args": seed}, time.monotonic() + 30)
                   for guards in (False, True)]
        assert results[0] == results[1]


# Conversions run one native call each past a native call's work: the native's result and errors.
FORMATS = [
    "string.format('%5.2f|%d|%s|%q|%%|%-3s|%x', 1.5, 7, 'a', 'b\\0', true, 255)",
    "string.format(string.rep('%d', 10) .. '%d', 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 'x')",
    "string.format('%s %s %d', {}, {})", "string.format('%s %s %y', {}, {})", "string.format('%s %s %', {}, {})",
    "string.format('%s %s %y', {}, {}, 1)", "string.format('%s %s %', {}, {}, 1)",
    "#string.format('%s %s', {}, {}, 1, 2)",
    "string.format('%s|%s', setmetatable({}, {__tostring = function() return 'A' end}), "
    "setmetatable({}, {__name = 'NM'})):gsub('0x%x+', 'P')",
    "string.format('%s %s', {}, setmetatable({}, {__tostring = function() return {} end}))",
    "string.format('%s %s %d', {}, {}, 1.5)", "string.format('%s %s %c', {}, {}, 'x')",
    "string.format('%s %s %10.3q', {}, {}, 'x')", "string.format('%s %s %123d', {}, {}, 1)",
    "string.format('%s %s %q', {}, {}, {})", "string.format('%%%s%%%s%%', {}, {}):gsub('0x%x+', 'P')",
    "string.format('%.3s' .. string.rep('%s', 3), string.rep('y', 2e6), 'a', 'b', 'c')",
    "string.format('[%q|%q]', string.rep('\\0', 70000) .. '1', 'x'):sub(-20)",
    "string.format('%.1s|%-5.2s|%5s', string.rep('z', 5e6), string.rep('w', 5e6), 'ab')",
    "(function() local b = string.rep('ab', 4.5e6) local r = string.format('%%%s|%s%%|%5s|%d|%.3s', b, b, 'x', 3, b) "
    "return #r .. r:sub(1, 5) .. r:sub(9e6 - 2, 9e6 + 5) .. r:sub(-14) end)()",
    "string.format('%a %g', 1, 2.5, {}, {})", "string.format(nil, {}, {})", "string.format('%i', 1, {}, {})",
    "#string.format(string.rep('%d,', 2e5), table.unpack((function() local t = {} for i = 1, 2e5 do "
    "t[i] = i end return t end)()))",
]


def test_format_in_pieces_gives_the_native_result() -> None:
    # (a native's error raised in the guarded VM carries no position of the guest's: compared without)
    body = "\n".join(f"r = {{pcall(function() return {c} end)}} "
                     "out[#out + 1] = (tostring(r[1]) .. ':' .. tostring(r[2])):gsub('^false:[^:]*:%d+: ', 'false:')"
                     for c in FORMATS)
    spec = PluginSpec(name="fmt", runtime="lua", timeout=30, memory_bytes=64 << 20,
                      code="function h(e) local out, r = {}\n" + body + "\nreturn table.concat(out, '\\n') end")
    bytecode = lua.compile_bytecode(spec)
    native, guarded = (lua._LuaVM(spec, bytecode, guards=guards).call_fresh("h", {}, time.monotonic() + 30).split("\n")
                       for guards in (False, True))
    for case, want, got in zip(FORMATS, native, guarded):
        assert got == want, case


def test_rep_in_pieces_gives_the_native_result() -> None:
    # The pieces are rep(X^m..s, q + 1, sep..X^j) with X = s..sep: every remainder m, separators
    # or none, an empty s, units of several bytes, and counts around the piece size.
    spec = PluginSpec(name="rep", runtime="lua", timeout=30, memory_bytes=256 << 20, code=r"""
        function h(e)
          local out = {}
          for _, s in ipairs({"a", "", "ab", "xyz\0", "\u{10FFFF}"}) do
            for _, sep in ipairs({"", ",", ";;", "\0-"}) do
              for _, k in ipairs({4097, 5000, 65535, 65536, 65537, 65536 * 3 + 1, 100003, 2 ^ 20 + 7}) do
                local r = string.rep(s, k, sep ~= "" and sep or nil)
                local h = 0
                for i = 1, #r, 65521 do h = (h * 31 + r:byte(i) + r:byte(-i) * 7) % 2147483647 end
                for i = 1, math.min(#r, 9) do h = (h * 31 + r:byte(i) + r:byte(-i) * 7) % 2147483647 end
                out[#out + 1] = #r .. ":" .. h
              end
            end
          end
          return table.concat(out, "|")
        end""")
    bytecode = lua.compile_bytecode(spec)
    results = [lua._LuaVM(spec, bytecode, guards=guards).call_fresh("h", {"args": ""}, time.monotonic() + 30)
               for guards in (False, True)]
    assert results[0] == results[1]


def test_tables_behind_metatable_chains_give_the_native_results() -> None:
    # gsub with a table replacement (a chain, one ending in a function, a plain table), and the range
    # functions and sort on tables behind __index/__newindex chains: as many elements as take the
    # smaller chunks, the Lua matcher, or sort's copy; the same results guarded and unguarded.
    spec = PluginSpec(name="chains", runtime="lua", timeout=30, memory_bytes=64 << 20, code=CHAIN + r"""
        local function sum(t, n) local h = 0 for i = 1, n do h = (h * 31 + (tonumber(t[i]) or 7)) % 2147483647 end
          return h end
        function h(e)
          local out, s = {}, string.rep("abcdefg", 700)
          local vals = {a = "1", b = "22", c = false, [3] = "three"}
          for _, repl in ipairs({chain(3, vals), chain(1500, vals), vals,
                                 setmetatable({}, {__index = function(t, k) return k == "d" and "D" or nil end})}) do
            local r, n = string.gsub(s, "(%a)", repl)
            out[#out + 1] = #r .. ":" .. n .. ":" .. r:sub(1, 40)
            r, n = string.gsub(s, "()c", repl, 500)
            out[#out + 1] = #r .. ":" .. n .. ":" .. r:sub(1, 40)
          end
          local src = {} for i = 1, 3000 do src[i] = tostring((i * 7919) % 3001) end
          local t = chain(400, src)
          out[#out + 1] = #table.concat(t, ",", 1, 3000)
          out[#out + 1] = sum(table.move(t, 1, 3000, 1, {}), 3000)
          local d = chain(400) table.move(src, 1, 3000, 2, d) out[#out + 1] = sum(d, 3001)
          out[#out + 1] = select("#", table.unpack(t, 1, 3000)) .. ":" .. table.concat({table.unpack(t, 10, 20)}, ",")
          local holes = {} for i = 1, 3000 do holes[i] = src[i] end for i = 2, 2999, 2 do holes[i] = nil end
          setmetatable(holes, {__index = chain(300, src)})
          table.insert(holes, 5, "x") out[#out + 1] = sum(holes, 3001)
          out[#out + 1] = tostring(table.remove(holes, 7)) .. sum(holes, 3000)
          table.sort(holes) out[#out + 1] = sum(holes, 3000)
          return table.concat(out, "|")
        end""")
    bytecode = lua.compile_bytecode(spec)
    native, guarded = (lua._LuaVM(spec, bytecode, guards=guards).call_fresh("h", {}, time.monotonic() + 30).split("|")
                       for guards in (False, True))
    assert len(guarded) == 15
    for i, (want, got) in enumerate(zip(native, guarded)):
        assert got == want, (i, want[:200], got[:200])


def test_a_kept_table_of_colliding_keys_is_read_back_within_the_budget() -> None:
    # One step of a table's traversal (lua_next) walks the chain of the key it left, and integer keys
    # (hashed without a seed) can make that chain as long as the table: a pooled plugin that built
    # 32,766 colliding keys over earlier calls and returned them had its reply read in two quadratic
    # walks, the sandbox's count and the converter, that checked the clock only between tables: 7.7 s
    # on a 5 s budget (3 s of it after the deadline) and `ok`. The clock is now read every 64 entries.
    budget = 0.5
    plugin = LoadedPlugin(PluginSpec(name="kept", runtime="lua", strategy="pooled", timeout=budget, pool_size=1,
                                     memory_bytes=64 << 20, code="""
        local S, T, done = 1 << 16, {}, 0
        for i = 1, S // 2 + 1 do T[i * 2 + 1000000] = true end
        for i = 1, S // 2 + 1 do T[i * 2 + 1000000] = nil end
        function build(e)
          local last = math.min(done + 300, S // 2 - 2)
          for i = done + 1, last do T[i * (S - 1)] = 'x' end
          done = last
          return tostring(done)
        end
        function ret(e) return T end"""))
    while plugin.call("build", EVENT) != str((1 << 15) - 2):
        pass
    started = time.monotonic()
    with pytest.raises(HandlerError) as info:
        plugin.call("ret", EVENT)
    elapsed = time.monotonic() - started
    assert info.value.code == "timeout", info.value
    assert elapsed < 2 * budget + 0.5, f"{elapsed:.2f} s on a {budget} s budget"


def test_a_top_level_environment_of_colliding_keys_is_read_within_the_load_budget() -> None:
    # Validation reads the top level's environment for handler names after the top level ran (its
    # deadline is over by then): 32,000 integer keys chosen to collide, stored by a top level within
    # its 2 s load budget, made that read walk a chain per step, 1.5 s more at every save and worker
    # start (3.3 s in all, and the plugin saved). The read now stops at the load deadline too.
    spec = PluginSpec(name="env", runtime="lua", timeout=30, memory_bytes=64 << 20, code="""
        local S = 1 << 16
        for i = 1, S // 2 + 1 do _ENV[i * 2 + 1000000] = true end
        for i = 1, S // 2 + 1 do _ENV[i * 2 + 1000000] = nil end
        for i = 1, 24000 do _ENV[i * (S - 1)] = 'x' end
        function h(e) return 'ok' end""")
    vm = lua._LuaVM(spec, lua.compile_bytecode(spec))
    env = vm.load_env(time.monotonic() + 60)
    started = time.monotonic()
    with pytest.raises(GuestTimeout, match="environment was still being read"):
        vm.functions(env, started + 0.1)
    assert time.monotonic() - started < 0.4
    small = PluginSpec(name="small", runtime="lua", timeout=1, code="x = 1 function h(e) end local function g() end "
                                                                     "function k(e) end")
    assert lua.LuaCompiled(small).handlers == {"h", "k"}


def test_a_per_request_call_does_not_load_the_plugins_code_again() -> None:
    # A per_request call loaded the plugin's bytecode into a fresh environment every time (lundump:
    # every prototype and string constant made again, before the call's deadline was set): a 4 MB
    # plugin of ~350,000 string constants in functions it never calls took 0.18-0.26 s of CPU a
    # call on a 50 ms budget, and answered ok. Now the chunk is loaded at a thread's first call.
    items = [f'"k{i:08d}"' for i in range(340_000)]
    code = "\n".join(f"local function d{j}() return {{{','.join(items[j:j + 30000])}}} end"
                     for j in range(0, len(items), 30000)) + "\nn = (n or 0) + 1 function h(e) return tostring(n) end"
    plugin = LoadedPlugin(PluginSpec(name="big", runtime="lua", strategy="per_request", timeout=0.05,
                                     memory_bytes=256 << 20, code=code))
    assert plugin.call("h", EVENT) == "1"
    for _ in range(5):
        started = time.thread_time()
        assert plugin.call("h", EVENT) == "1"  # a fresh environment still: no global of the last call
        assert time.thread_time() - started < 0.05
