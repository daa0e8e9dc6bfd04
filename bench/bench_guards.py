"""What the containment guards cost on the hot path (issue 9): guarded vs unguarded, each against the bare library.

Two handlers, each called through ``LoadedPlugin.call`` (pooled strategy, one warm instance):

- Lua: ``return (e.args:match("^%s*(.-)%s*$"))``: one ``string.match`` (the guarded pattern
  function: a step bound, then the native C matcher) against bare lupa running the same
  function with no sandbox;
- JS: the bundled ``upper`` handler (the wall-clock deadline slot the watchdog thread reads)
  against a bare QuickJS Context calling the same function with the JSON event.

Each plugin is built twice, with the guards on (``plugins.runtimes.lua.GUARDS``,
``plugins.runtimes.js.GUARDED``) and off; the rows give each one's ratio to the bare library,
measured in the same run with interleaved repetitions, and the guarded/unguarded quotient of
those ratios. Target: within 1.1x.

Run alone: ``python bench/run.py --only guards``.
"""
from __future__ import annotations

from typing import Any, Callable

from bench.common import interleaved, per_call_us, row, setup_django

BENCH = "guards"
LUA = 'function f(e) return (e.args:match("^%s*(.-)%s*$")) end'
EVENT = {"args": "  hello world  ", "text": "/trim   hello world  ", "type": "message", "id": "bench",
         "session": None, "data": {}}


def _plugin(name: str, runtime: str, code: str, handler: str, guarded: bool) -> Callable[[], Any]:
    """A LoadedPlugin whose one instance was made with the guards ``guarded`` (then warmed)."""
    from plugins.loaded import LoadedPlugin
    from plugins.runtimes import js, lua
    from plugins.spec import PluginSpec

    spec = PluginSpec(name=name, runtime=runtime, code=code, strategy="pooled", timeout=5.0, pool_size=1,
                      max_concurrency=1)
    before = lua.GUARDS, js.GUARDED
    lua.GUARDS = js.GUARDED = guarded
    try:
        plugin = LoadedPlugin(spec)
        plugin.call(handler, EVENT)  # the instance is made now, with the flag as set
    finally:
        lua.GUARDS, js.GUARDED = before
    return lambda: plugin.call(handler, EVENT)


def _lua_bare() -> Callable[[], Any]:
    import lupa.lua55 as lupa

    rt = lupa.LuaRuntime(register_eval=False, register_builtins=False)
    rt.execute(LUA)
    f = rt.globals().f
    table_from = rt.table_from
    return lambda: f(table_from(EVENT, recursive=True))


def _js_bare(code: str) -> Callable[[], Any]:
    import quickjs

    from plugins.runtimes.base import scan_json, to_json

    ctx = quickjs.Context()
    ctx.set_memory_limit(16 << 20)
    ctx.set_time_limit(5.0)
    ctx.eval(code)
    ctx.eval("function __run(ev) { return JSON.stringify(upper(JSON.parse(ev))); }")
    run = ctx.get("__run")
    return lambda: scan_json(run(to_json(EVENT)), 0)[0]


def run(quick: bool) -> list[dict[str, Any]]:
    """Interleave guarded, unguarded and bare calls of each handler; return the rows."""
    setup_django()
    from plugins.bundled import EXAMPLES_DIR

    js_code = (EXAMPLES_DIR / "upper.js").read_text()
    n, reps = (2000, 5) if quick else (10000, 15)
    cases = {
        "lua guarded": _plugin("g-lua-on", "lua", LUA, "f", True),
        "lua unguarded": _plugin("g-lua-off", "lua", LUA, "f", False),
        "lua bare": _lua_bare(),
        "js guarded": _plugin("g-js-on", "js", js_code, "upper", True),
        "js unguarded": _plugin("g-js-off", "js", js_code, "upper", False),
        "js bare": _js_bare(js_code),
    }
    assert cases["lua guarded"]() == cases["lua bare"]() == "hello world"
    us = interleaved({name: (lambda fn=fn: per_call_us(fn, n)) for name, fn in cases.items()}, reps)
    rows = []
    for rt, label in (("lua", "Lua string.match handler"), ("js", "JS upper handler")):
        on, off, bare = us[f"{rt} guarded"], us[f"{rt} unguarded"], us[f"{rt} bare"]
        rows.append(row(BENCH, f"{label}, guards on", on, "us/call", baseline=f"bare {rt} library", ratio=on / bare))
        rows.append(row(BENCH, f"{label}, guards off", off, "us/call", baseline=f"bare {rt} library",
                        ratio=off / bare))
        quotient = (on / bare) / (off / bare)
        rows.append(row(BENCH, f"{label}: ratio with guards / ratio without", quotient, "x",
                        target="<= 1.1x", ok=quotient <= 1.1))
    return rows
