"""Hostile Lua plugins: what a guest does after its call (its reply, its error object), the garbage
collector it can drive, and the corners already contained, through LoadedPlugin.call for each
strategy.

Each case runs in a child process (one per strategy, restarted past a case that hangs) with a
hard timeout, so a guest that escapes its budget fails its test instead of hanging the suite.
A case passes when it ends with the expected code and message within 2x its budget + 0.5 s.
"""
from __future__ import annotations

import threading
import time

import lupa.lua55 as lupa
import pytest

from execapp.engine import HandlerError
from plugins.errors import CompileError
from plugins.loaded import LoadedPlugin
from plugins.runtimes import lua, lua_compile, lua_interrupt
from plugins.spec import PluginSpec

from .children import run_in_children

BUDGET = 0.3
BOUND = 2 * BUDGET + 0.5
HARD = 15.0  # seconds a child may spend on one case before it counts as hung
STRATEGIES = ("per_request", "pooled", "sharded")

# 40,000 single-entry ephemeron tables whose links zigzag through the collector's list: one link
# converges per pass, so one GC cycle is quadratic (5 s under a 16 MB cap, in one C call). The
# allocations that drive the collector never end: with weak tables off they only meet the deadline
# (a fixed 1e7 of them finished in 0.46 s on the 2-core dev machine, inside a faster one's budget).
EPHEMERONS = """
  local n = 40000
  local weak = {}
  local tabs, keys = {}, {}
  for i = 1, n do tabs[i] = setmetatable({}, weak); keys[i] = {} end
  weak.__mode = "k" -- set after setmetatable: no check at setmetatable can see it
  local mid = n // 2
  local perm = {mid}
  for j = 1, n - 1 do
    local d = (j + 1) // 2
    perm[j + 1] = (j % 2 == 1) and (mid - d) or (mid + d)
  end
  for j = 1, n do
    local ti = perm[j]
    if ti >= 1 and ti <= n then tabs[ti][keys[j]] = keys[j + 1] or {} end
  end
  root, holder = keys[1], tabs
  keys, perm = nil, nil
  local x
  while true do x = {} end
"""

# name -> (handler body, expected codes, a substring of the message or None)
CASES: dict[str, tuple[str, tuple[str, ...], str | None]] = {
    # the reply crosses into Python after the deadline: no guest code may run, the work is bounded
    "reply_key_tostring": ("local k = setmetatable({}, {__tostring = function() while true do end end}) "
                           "return {[k] = 1}", ("handler_error",), "as a key"),
    "reply_shared_tables": ("local t = {1} for i = 1, 30 do t = {t, t} end return t",
                            ("handler_error",), "more than 131072 values"),
    "reply_shared_dict": ("local t = {a = 1} for i = 1, 30 do t = {a = t, b = t} end return t",
                          ("handler_error",), "more than 131072 values"),
    # a chain past 32 levels beside shared tables: refused for its depth before any is converted
    "reply_deep_beside_shared": ("local d = {} local c = d for i = 1, 40 do c.x = {} c = c.x end "
                                 "local t = {1} for i = 1, 30 do t = {t, t} end return {a = t, b = d, c = t, e = d}",
                                 ("handler_error",), None),
    "reply_wide": ("local t = {} for i = 1, 200000 do t[i] = i end return t", ("handler_error",),
                   "more than 131072 values"),
    "reply_shared_string": ('local s = string.rep("x", 1e6) local t = {} for i = 1, 64 do t[i] = s end return t',
                            ("handler_error",), "memory cap"),
    "reply_not_utf8": ('return "\\255"', ("handler_error",), "not valid UTF-8"),
    "reply_not_utf8_inside": ('return {a = {"\\255"}}', ("handler_error",), "not valid UTF-8"),
    # error objects: their __tostring is guest code, their text is bounded and valid text
    "error_tostring_loop": ("error(setmetatable({}, {__tostring = function() while true do end end}))",
                            ("timeout",), None),
    "error_tostring_not_string": ("error(setmetatable({}, {__tostring = function() return {} end}))",
                                  ("handler_error",), "__tostring failed: '__tostring' must return a string"),
    "error_tostring_raises": ("error(setmetatable({}, {__tostring = function() error({}) end}))",
                              ("handler_error",), "__tostring failed"),
    "error_huge": ('error(string.rep("x", 6e6), 0)', ("handler_error",), "x ... (6000000 bytes)"),
    "error_not_utf8": ('error("bad \\255 byte")', ("handler_error",), "bad ? byte"),
    # the collector: weak tables are off (an ephemeron chain makes one GC step quadratic)
    "ephemerons_late_mode": (EPHEMERONS, ("timeout", "memory_limit"), None),
    "weak_mode_refused": ('return setmetatable({}, {__mode = "k"})', ("handler_error",),
                          "weak tables (__mode) are not available"),
    # __call is off (lua_interrupt.retire_events): Lua 5.4 followed a chain of callable tables inside
    # one call instruction, shifting the arguments once per link until the stack overflows; the
    # cycle below, set after setmetatable, ran for more than 4 minutes under a 16 MB cap, no hook
    # or watchdog reaching it
    "call_cycle_after_setmetatable": ("local mt = {} local t = setmetatable({}, mt) mt.__call = t return t()",
                                      ("handler_error",), "attempt to call a table value"),
    "call_cycle_as_metamethod": ("local mt = {} local t = setmetatable({}, mt) mt.__call = t mt.__add = t "
                                 "return t + 1", ("handler_error",), "attempt to call a table value"),
    "call_refused": ("return setmetatable({}, {__call = function() return 1 end})", ("handler_error",),
                     "__call metamethods are not available in plugins"),
    # already contained: kept here so they stay so
    "close_after_timeout": ("local x <close> = setmetatable({}, {__close = function() while true do end end}) "
                            "while true do end", ("timeout",), None),
    "coroutine_close_swallows": ("while true do local co = coroutine.create(function() local x <close> = "
                                 "setmetatable({}, {__close = function() while true do end end}) coroutine.yield() "
                                 "end) coroutine.resume(co) coroutine.close(co) end", ("timeout",), None),
    "xpcall_handler_loops": ('return xpcall(function() error("x") end, function() while true do end end)',
                             ("timeout",), None),
    "yield_across_pcall": ("local co = coroutine.wrap(function() while true do pcall(coroutine.yield) end end) "
                           "while true do co() end", ("timeout",), None),
    "wrap_as_index": ("local t = setmetatable({}, {__index = coroutine.wrap(function() while true do "
                      "coroutine.yield(1) end end)}) local n = 0 while true do n = n + t.x end", ("timeout",), None),
    "index_chain": ("local t = {} for i = 1, 1990 do t = setmetatable({}, {__index = t}) end "
                    "while true do local x = t.foo end", ("timeout",), None),
    "name_huge": ('local t = setmetatable({}, {__name = string.rep("x", 5e6)}) while true do local s = tostring(t) end',
                  ("timeout",), None),
    "sort_lt_metamethod": ("local mt = {__lt = function(a, b) return a.v < b.v end} local t = {} for i = 1, 3000 do "
                           "t[i] = setmetatable({v = (i * 7919) % 3001}, mt) end while true do table.sort(t) end",
                           ("timeout",), None),
    "coroutines_memory": ("local t = {} for i = 1, 1e7 do t[i] = coroutine.create(function() end) end",
                          ("memory_limit",), None),
    "closures_memory": ("local t = {} for i = 1, 1e8 do local j = i t[i] = function() return j end end",
                        ("memory_limit",), None),
}

_CHILD = r"""
import json, os, sys, time
import django
django.setup()
from plugins.errors import CompileError
from plugins.loaded import LoadedPlugin
from plugins.spec import PluginSpec
job = json.loads(sys.stdin.read())
event = {"id": "e", "type": "message", "text": "x", "args": "x", "data": {}, "session": "s"}
for name, body in job["cases"]:
    print(json.dumps({"start": name}), flush=True)
    plugin = LoadedPlugin(PluginSpec(name="hostile", runtime="lua", strategy=job["strategy"], timeout=job["budget"],
                                     code="function h(e) " + body + "\nend", memory_bytes=16 << 20, pool_size=1,
                                     shard_count=1, max_concurrency=1))
    start = time.monotonic()
    try:
        reply, code, message = plugin.call("h", event), "ok", ""
    except BaseException as exc:
        reply, code, message = None, getattr(exc, "code", type(exc).__name__), str(exc)
    elapsed = time.monotonic() - start
    print(json.dumps({"case": name, "code": code, "elapsed": elapsed, "message": message[:6000],
                      "reply": repr(reply)[:200]}), flush=True)
    plugin.close()
"""


def _run_cases(strategy: str, names: list[str], bodies: dict[str, str] | None = None) -> dict[str, dict]:
    """Each case's outcome in child processes; a case still running after HARD seconds is 'hung'."""
    body = bodies or {name: case[0] for name, case in CASES.items()}
    return run_in_children(_CHILD, lambda pending: {"strategy": strategy, "budget": BUDGET,
                                                    "cases": [(n, body[n]) for n in pending]}, names, HARD)


@pytest.fixture(scope="module", params=STRATEGIES)
def outcomes(request) -> tuple[str, dict[str, dict]]:
    return request.param, _run_cases(request.param, sorted(CASES))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_plugin_ends_within_its_budget_with_a_clear_error(outcomes, case: str) -> None:
    strategy, results = outcomes
    _, codes, text = CASES[case]
    got = results[case]
    assert got["code"] in codes, f"{case} [{strategy}]: {got['code']} after {got['elapsed']:.2f} s: " \
                                 f"{got['message'][:300] or got['reply']}"
    assert got["elapsed"] < BOUND, f"{case} [{strategy}] ran {got['elapsed']:.2f} s under a {BUDGET} s budget"
    if text is not None:
        assert text in got["message"], got["message"][:300]
    assert "<python>" not in got["message"]  # the sandbox's own source never shows
    assert len(got["message"]) < 4096 + 200


# Lua hashes numbers without a seed (an integer i at i % ((size-1)|1), a float at its frexp
# mantissa and exponent mod the same), so a guest picks keys that all collide once the table
# grows to S nodes. Lua 5.4 reinserted every key with a lookup inside the one assignment that
# grows the table: quadratic, ~2 s for 2^16 keys of each family here and ~25 s for 2^17 under the
# 16 MB cap, in one VM step no hook or watchdog reaches. Lua 5.5 reinserts without the lookup:
# ~3 ms for 2^17 keys of each family. KEYS is a handler prelude: ``keys`` holds S // 2 + 1 keys
# of ``family`` whose hash is 0 mod S - 1 (ints, negative ints (unsigned: 2^64 + i), ints near
# 2^63, floats with fractions over 80 exponents, their negatives), distinct and none integral.
KEYS = """
  local S = 1 << 17
  local family, n, M1 = FAMILY, S // 2 + 1, S - 1
  local keys = {}
  if family == "int" then
    for i = 1, n do keys[i] = i * M1 end
  elseif family == "negative_int" then
    local q = (-1 >> 1) // M1 * 2 -- 2^64 - 1 = -1 as unsigned: its remainder mod M1, then 2^64's
    local rem = -1 - q * M1
    while math.ult(M1 - 1, rem) do rem = rem - M1 end
    local r = (rem + 1) % M1
    for i = 1, n do keys[i] = -(r + i * M1) end
  elseif family == "huge_int" then
    local base = (math.maxinteger // M1 - n - 1) * M1
    for i = 1, n do keys[i] = base + i * M1 end
  else -- "float", "negative_float": x = M * 2^(e - 31) has mantissa M / 2^31 and exponent e
    local negative, i, e = family == "negative_float", 0, -40
    while i < n do
      local m = negative and (((1 << 30) - e - 1) // M1 + 1) * M1 + e + 1 or (((1 << 30) + e) // M1 + 1) * M1 - e
      while m < (1 << 31) and i < n do
        local x = m * 2.0 ^ (e - 31)
        if x ~= math.floor(x) then i = i + 1; keys[i] = negative and -x or x end
        m = m + M1
      end
      e = e + 1
    end
  end
"""
KEY_FAMILIES = ("int", "negative_int", "huge_int", "float", "negative_float")


@pytest.mark.parametrize("family", KEY_FAMILIES)
def test_a_table_of_colliding_number_keys_grows_within_the_budget(family: str) -> None:
    body = KEYS.replace("FAMILY", repr(family)) + (
        "local t = {} for i = 1, n - 1 do t[keys[i]] = true end "
        "t[keys[n]] = true return t[keys[1]] and t[keys[n]] and t[keys[n // 2]] and 'grown'")
    got = _run_cases("per_request", ["keys"], {"keys": body})["keys"]
    assert got["code"] == "ok" and got["reply"] == "'grown'" and got["elapsed"] < BOUND, got


# Lua 5.5 still walks a chain when the new key's main position holds a node of another chain
# (Brent's variation moves it, after finding the node before it from that chain's head). Keys
# placed so that the grown table's reinsertion first builds one chain of S/4 keys, then lands
# S/4 keys on its nodes, walk ~S^2/32 links in the one assignment that grows it: 1.9 s for
# S = 2^17 and 7.7 s for 2^18 under the 16 MB cap (table.create presizes the table, so filling
# it takes 2-6 ms). A chain is O(1) per key only with a seeded or keyed hash, which needs a
# change in Lua's C source (not fixed: docs/plugins.md, "Limit (not fixed)").
DISPLACED_CHAIN = """
  local S = 1 << 18
  local M1, H = S - 1, S // 2 - 1
  local function key_for(new, old) -- main position new at S nodes, old at S/2
    local m = (old - new) % H
    return new + (m == 0 and H or m) * M1
  end
  local k, keys = S // 4 - 2, {}
  for i = 1, k do keys[#keys + 1] = i * M1 end
  for j = 0, k - 3 do keys[#keys + 1] = key_for(S - 2 - j, k + 1 + j) end
  local d = 2 * k - 1
  while #keys < S // 2 do keys[#keys + 1] = key_for(S // 2 + #keys % 1000, d); d = d + 1 end
  local t = table.create(0, S // 2)
  for i = 1, #keys do t[keys[i]] = true end
  t[-1] = true
  return "grown"
"""


@pytest.mark.xfail(reason="not fixed: Lua 5.5 grows a table in one step that walks a displaced chain per key, "
                          "quadratic for keys placed on another chain's nodes; needs a seeded number hash", strict=True)
def test_a_table_of_keys_on_a_displaced_chain_grows_within_the_budget() -> None:
    got = _run_cases("per_request", ["chain"], {"chain": DISPLACED_CHAIN})["chain"]
    assert got["code"] in ("ok", "timeout") and got["elapsed"] < BOUND, got


def test_an_error_message_keeps_its_first_4_KiB() -> None:
    plugin = LoadedPlugin(PluginSpec(name="loud", runtime="lua", timeout=5, code=(
        'function h(e) error(string.rep("é", 3000), 0) end')))  # 6000 bytes: cut inside a character
    with pytest.raises(Exception) as info:
        plugin.call("h", {"id": "e", "type": "message", "text": "", "args": "", "data": {}, "session": None})
    message = str(info.value)
    assert "é" * 2000 in message and message.endswith("... (6000 bytes)")


def test_ordinary_replies_convert_as_before() -> None:
    plugin = LoadedPlugin(PluginSpec(name="replies", runtime="lua", timeout=5, code="""
        function h(e)
          local shared = {1, 2}
          return {list = {3, 1, 2}, nested = {a = {b = {c = "d"}}}, twice = {shared, shared}, n = 1.5,
                  flag = true, [7] = "seven", empty = {}, fn = h, [true] = "yes", [false] = "no"}
        end"""))
    reply = plugin.call("h", {"id": "e", "type": "message", "text": "", "args": "", "data": {}, "session": None})
    assert reply["list"] == [3, 1, 2] and reply["nested"] == {"a": {"b": {"c": "d"}}}
    assert reply["twice"] == [[1, 2], [1, 2]] and reply["n"] == 1.5 and reply["flag"] is True
    assert reply["7"] == "seven" and reply["empty"] == {} and reply["fn"].startswith("<Lua function")
    assert reply["true"] == "yes" and reply["false"] == "no"  # boolean keys as Lua writes them
    assert lua.MAX_REPLY_VALUES == lua.MAX_REPLY_BYTES // 2


def test_weak_modes_are_inert_in_a_sandbox_runtime() -> None:
    spec = PluginSpec(name="weak", runtime="lua", code="function h(e) end")
    vm = lua._LuaVM(spec, lua.compile_bytecode(spec))
    # the runtime's own globals still have collectgarbage: a weak table there keeps its entries
    kept = vm.rt.execute("""
        local t = setmetatable({}, {__mode = "k"}) t[{}] = 1
        local v = setmetatable({}, {__mode = "v"}) v[1] = {}
        collectgarbage() collectgarbage()
        return next(t) ~= nil and v[1] ~= nil""")
    assert kept is True
    assert lua_interrupt._tmname_at is not None and not lua_interrupt._weak_warned


def test_the_interrupt_layout_found_is_lua_55s() -> None:
    # lstate.h of Lua 5.5 (64-bit): hookcount at 192 in a 208-byte lua_State; global_State ends
    # with its main thread, tmname 1,144 bytes before it (it was ~480 bytes after it in 5.4's LG).
    spec = PluginSpec(name="layout", runtime="lua", code="function h(e) end")
    lua._LuaVM(spec, lua.compile_bytecode(spec))
    assert lupa.LUA_VERSION == (5, 5)
    assert lua_interrupt._offset == 192 and not lua_interrupt._disabled
    assert lua_interrupt._tmname_at == (-1144 // 8, 24)


def test_a_layout_that_does_not_match_leaves_the_runtime_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = lupa.LuaRuntime()
    rt.execute("debug.sethook(function() end, '', 1000)")
    main = rt.execute("return tostring((coroutine.running()))")
    state = lua_interrupt.thread_address(main)
    monkeypatch.setattr(lua_interrupt, "_offset", None)
    monkeypatch.setattr(lua_interrupt, "_disabled", False)
    assert lua_interrupt.counter_address(state, 999) is None and lua_interrupt._disabled  # not its count
    # event names in another order are not found: nothing is written, weak modes stay on
    monkeypatch.setattr(lua_interrupt, "_tmname_at", None)
    monkeypatch.setattr(lua_interrupt, "_weak_warned", False)
    monkeypatch.setattr(lua_interrupt, "_EVENTS", tuple(reversed(lua_interrupt._EVENTS)))
    before = bytes(lua_interrupt.ctypes.string_at(state - lua_interrupt._TMNAME_SCAN, lua_interrupt._TMNAME_SCAN))
    assert lua_interrupt.retire_events(main) is False and lua_interrupt._weak_warned
    assert lua_interrupt.ctypes.string_at(state - lua_interrupt._TMNAME_SCAN, lua_interrupt._TMNAME_SCAN) == before


def test_compiling_the_source_stays_within_the_memory_cap() -> None:
    # The parser's tables and the bytecode (~3x the source here) were allocated with no cap, on the
    # thread that loads the plugin; the bytecode must fit the cap to be loaded anyway.
    code = "local t = {" + "{}," * (1 << 18) + "}\nfunction h(e) return 'ok' end"
    spec = PluginSpec(name="big", runtime="lua", code=code, memory_bytes=1 << 20)
    with pytest.raises(CompileError, match="compiling the source needs more than the plugin's memory cap of "
                                           "1048576 bytes") as info:
        lua.compile_bytecode(spec)
    assert info.value.code == "memory_limit"
    assert lua.compile_bytecode(PluginSpec(name="big", runtime="lua", code=code, memory_bytes=16 << 20))


def displaced_chain_keys(size: int) -> list[int]:
    """DISPLACED_CHAIN's keys for a table growing to ``size`` nodes, and one more that grows it."""
    m1, half = size - 1, size // 2 - 1

    def key_for(new: int, old: int) -> int:
        return new + ((old - new) % half or half) * m1

    k = size // 4 - 2
    keys = [i * m1 for i in range(1, k + 1)] + [key_for(size - 2 - j, k + 1 + j) for j in range(k - 2)]
    old = 2 * k - 1
    while len(keys) < size // 2:
        keys.append(key_for(size // 2 + len(keys) % 1000, old))
        old += 1
    return keys + [7 * size * m1 + 1]


def test_compiling_a_large_source_is_bounded_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lua's parser keeps every constant in one table, grown in one step as a guest's table is: 65,537
    # integer constants colliding at one place (multiples of 2^17 - 1, 712 KB) took 11 s to compile
    # under Lua 5.4; under 5.5 the same number placed on a displaced chain (708 KB) take ~2 s, in one
    # C call, on the thread saving or loading the plugin.
    monkeypatch.setattr(lua_compile, "TIMEOUT_SECONDS", 0.5)
    code = "local t = {" + ",".join(map(str, displaced_chain_keys(1 << 17))) + "}\nfunction h(e) return 'ok' end"
    started = time.monotonic()
    with pytest.raises(CompileError, match="compiling the source took more than 0.5 s") as info:
        lua.compile_bytecode(PluginSpec(name="slow", runtime="lua", code=code))
    assert info.value.code == "timeout" and time.monotonic() - started < 2


def test_a_large_source_compiles_in_a_child_to_the_same_bytecode() -> None:
    code = "local data = {" + ",".join(str(i) for i in range(20_000)) + "}\nfunction h(e) return tostring(#data) end"
    spec = PluginSpec(name="big", runtime="lua", code=code)
    assert len(code) > lua_compile.INPROCESS_BYTES
    assert lua.compile_bytecode(spec) == lua_compile._compile_here(code.encode(), "=big", spec.memory_bytes)[1]
    with pytest.raises(CompileError, match=r"^big:3: syntax error near <eof>$"):
        lua.compile_bytecode(PluginSpec(name="big", runtime="lua", code=code + "\noops"))


def test_weak_tables_still_work_in_a_plain_runtime() -> None:
    rt = lupa.LuaRuntime()
    assert rt.execute("""
        local t = setmetatable({}, {__mode = "k"}) t[{}] = 1
        collectgarbage() collectgarbage()
        return next(t) == nil""") is True


def test_an_isolated_call_does_not_inherit_the_last_calls_garbage() -> None:
    # string.rep builds in a lauxlib buffer, whose allocation fails at the cap without the
    # emergency collection: 12 MB of the previous call's garbage failed a 6 MB string here.
    plugin = LoadedPlugin(PluginSpec(name="rebuild", runtime="lua", strategy="per_request", timeout=5,
                                     memory_bytes=16 << 20, code=(
                                         'function h(e) local s = string.rep("x", 6e6) return #(s .. "y") end')))
    event = {"id": "e", "type": "message", "text": "", "args": "", "data": {}, "session": None}
    assert [plugin.call("h", event) for _ in range(4)] == ["6000001"] * 4


def test_an_isolated_call_leaves_no_garbage_in_its_threads_runtime() -> None:
    # Every thread keeps its own runtime of a per_request plugin, and a call's garbage stayed in it
    # until that thread's next call: 700 MB a thread under a 1 GiB cap, 2.6 GB for 4 pool threads of
    # a plugin limited to one call at a time. A suspended coroutine kept its locals too (the sandbox
    # holds the coroutines a call resumed, for the deadline watchdog, until the next call).
    plugin = LoadedPlugin(PluginSpec(name="litter", runtime="lua", strategy="per_request", timeout=5,
                                     memory_bytes=64 << 20, max_concurrency=1, code=(
                                         'function h(e) local t = {} for i = 1, 3 do t[i] = string.rep("x", 8e6) .. i '
                                         'end for i = 1, 2e5 do t[#t + 1] = {i} end return #t end\n'
                                         'function co(e) local c = coroutine.wrap(function() local s = '
                                         'string.rep("x", 3e7) .. "y" coroutine.yield(#s) end) return c() end')))
    event = {"id": "e", "type": "message", "text": "", "args": "", "data": {}, "session": None}
    for handler, reply in (("h", "200003"), ("co", "30000001")):
        assert plugin.call(handler, event) == reply
        (vm,) = plugin.compiled._live  # this thread's runtime
        assert vm.rt.get_memory_used() < lua.ISOLATED_KEEP_BYTES + (1 << 20), handler


def test_an_isolated_call_cannot_seed_the_next_calls_random_numbers() -> None:
    plugin = LoadedPlugin(PluginSpec(name="dice", runtime="lua", strategy="per_request", timeout=5, code=(
        'function h(e) if e.args == "seed" then math.randomseed(42) return "seeded" end '
        'return math.random(1, 1e9) end')))

    def call(args: str) -> str:
        return plugin.call("h", {"id": "e", "type": "message", "text": args, "args": args, "data": {},
                                 "session": None})

    first = [call("seed"), call("roll")]
    second = [call("seed"), call("roll")]
    assert first[0] == second[0] == "seeded" and first[1] != second[1]


def test_converting_a_reply_stops_at_the_calls_deadline() -> None:
    from plugins.errors import GuestTimeout

    rt = lupa.LuaRuntime()
    shared = rt.execute("local t = {1} for i = 1, 12 do t = {t, t} end return t")  # 8,191 tables
    assert len(str(lua._to_python(shared, 1 << 20, time.monotonic() + 60))) > 0
    with pytest.raises(GuestTimeout):
        lua._to_python(shared, 1 << 20, time.monotonic() - 1)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", ["reply_shared_tables", "reply_shared_dict", "reply_deep_beside_shared"])
def test_a_reply_over_its_value_or_depth_limit_is_refused_in_the_sandbox_before_python_reads_it(
        strategy: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Python reads a reply at ~1.5 us a value: one of 2^30 shared references ran into its call's
    # deadline there under load. The sandbox counts it first; the converter never sees it.
    converted: list[object] = []
    monkeypatch.setattr(lua, "_to_python", lambda value, *args: converted.append(value))
    plugin = LoadedPlugin(PluginSpec(name="refused", runtime="lua", strategy=strategy, timeout=5,
                                     code="function h(e) " + CASES[case][0] + "\nend"))
    with pytest.raises(Exception) as info:
        plugin.call("h", {"id": "e", "type": "message", "text": "", "args": "", "data": {}, "session": None})
    assert "more than 131072 values" in str(info.value) or "deeper than 32 levels" in str(info.value)
    assert converted == []
    plugin.close()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_large_strings_built_in_a_loop_are_collected_within_the_memory_cap(strategy: str) -> None:
    # Lua 5.5's collector does not count a string built in a lauxlib buffer (rep, format, gsub,
    # concat, upper...): a loop of 6 MB results under a 16 MB cap failed with memory_limit at the third.
    plugin = LoadedPlugin(PluginSpec(name="builder", runtime="lua", strategy=strategy, timeout=5,
                                     memory_bytes=16 << 20, code=(
                                         "function h(e) local s, n = string.rep('a', 2000), 0 for i = 1, 20 do "
                                         "n = n + #s:gsub('.+', string.rep('%0', 3000)) + #string.rep(s, 3000) "
                                         "+ #table.concat({string.rep(s, 1500), s:upper():rep(1500)}) "
                                         "+ #string.format('%s%s', string.rep(s, 1500), string.rep(s, 1500)) end "
                                         "return n end")))
    event = {"id": "e", "type": "message", "text": "", "args": "", "data": {}, "session": None}
    assert plugin.call("h", event) == str(20 * 4 * 6_000_000)
    plugin.close()


def test_an_isolated_call_leaves_no_built_strings_in_its_threads_runtime() -> None:
    # collectgarbage("count") leaves out Lua 5.5's built strings: 160 MB of them stayed behind.
    plugin = LoadedPlugin(PluginSpec(name="litter", runtime="lua", strategy="per_request", timeout=5,
                                     memory_bytes=256 << 20, max_concurrency=1, code=(
                                         'function h(e) local t = {} for i = 1, 20 do t[i] = string.rep("x", 8e6) '
                                         'end return #t end')))
    event = {"id": "e", "type": "message", "text": "", "args": "", "data": {}, "session": None}
    assert plugin.call("h", event) == "20"
    (vm,) = plugin.compiled._live
    assert vm.rt.get_memory_used() < lua.ISOLATED_KEEP_BYTES + (1 << 20)
    plugin.close()


def test_table_create_presizes_at_most_one_native_calls_work() -> None:
    # Lua 5.5's table.create(0, 2^24) cleared 2^24 hash nodes in one C call, 0.32 s under a 1 GiB cap.
    plugin = LoadedPlugin(PluginSpec(name="presize", runtime="lua", timeout=5, memory_bytes=1 << 30, code=(
        "function h(e) local t = table.create(tonumber(e.args), 1 << 24) t[1] = 1 t.x = 2 "
        "return #t end\nfunction bad(e) return table.create(-1) end")))
    event = {"id": "e", "type": "message", "text": "", "args": str(1 << 28), "data": {}, "session": None}
    plugin.call("h", event)  # warm
    started = time.monotonic()
    assert plugin.call("h", event) == "1"
    assert time.monotonic() - started < 0.1
    (vm,) = plugin.compiled._live
    assert vm.rt.get_memory_used() < 64 << 20
    with pytest.raises(Exception, match="bad argument #1 to 'create'"):
        plugin.call("bad", event)
    plugin.close()


@pytest.mark.parametrize("strategy", ("pooled", "sharded"))
def test_a_discarded_instance_is_freed_off_the_callers_thread_and_the_gil(strategy: str) -> None:
    # A timed-out instance is discarded on the thread of its call (maybe the event loop), and lupa
    # frees a runtime in lua_close with the GIL held: 14 million small tables left by earlier calls
    # took 0.6-0.8 s, the timeout answered that late and every Python thread (the loop) waited. Now
    # the runtime is collected on the reaper thread, in Lua (no GIL), before it is dropped.
    # The fills get a roomy timeout (a loaded machine may take more than a second for one); the
    # spin gets ``budget`` as its call's deadline, which is the budget under test.
    budget = 1.0
    plugin = LoadedPlugin(PluginSpec(name="hoard", runtime="lua", strategy=strategy, timeout=budget * 10,
                                     memory_bytes=1024 << 20, pool_size=1, shard_count=1, max_concurrency=1, code=(
                                         "local T, n = {}, 0 "
                                         "function fill(e) for i = 1, 1e6 do n = n + 1 T[n] = {} end return n end "
                                         "function spin(e) while true do end end function ok(e) return 'fine' end")))
    event = {"id": "e", "type": "message", "text": "", "args": "", "data": {}, "session": "s"}
    for i in range(12):
        assert plugin.call("fill", event) == str((i + 1) * 1_000_000)
    gaps, stop = [0.0], threading.Event()

    def ticker() -> None:  # what the event loop would see: how long a Python thread waits to run
        last = time.monotonic()
        while not stop.wait(0.002):
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(HandlerError):
            plugin.call("spin", event, deadline=time.monotonic() + budget)
        elapsed = time.monotonic() - start
        time.sleep(1.5)  # the reaper frees the runtime meanwhile
    finally:
        stop.set()
        thread.join()
    assert elapsed < budget + 0.3, f"the timeout answered after {elapsed:.2f} s"
    assert max(gaps) < 0.3, f"a Python thread waited {max(gaps):.2f} s for the GIL"
    assert plugin.call("ok", event) == "fine"
    plugin.close()
