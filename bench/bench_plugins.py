"""Plugin call cost per runtime and strategy, against the bare library doing the same work.

Every "ours" row is ``LoadedPlugin.call`` (concurrency slot, strategy, instance, deadline,
event conversion, sandbox, reply conversion, counters) on a bundled example. Its baseline,
measured in the same run and interleaved with it, is the bare library doing the same work,
with none of our Python in between:

- Lua: lupa calling the same sandbox functions directly (the Lua ``call`` / ``fresh_call``
  of the sandbox: hook, guarded pcall, fresh environment) with the event built by
  ``table_from`` and a per-call deadline, then the status check. Our layer is everything in
  Python from ``LoadedPlugin.call`` to that lupa call. An unsandboxed lupa call and a
  fresh-runtime-per-call variant are shown for scale;
- WASM: the public wasmtime-py API on one instance (``Func.__call__`` for alloc and the
  handler, ``Memory.write``/``read``, the same JSON encoding); per request adds
  ``InstancePre.instantiate`` + ``exports()``;
- JS: a QuickJS Context with the same limits and source called with the JSON event
  (``JSON.stringify(upper(JSON.parse(ev)))``), reused, or new per call (per request).
  Since issue 14 ours passes the engine's event differently: its strings as call arguments
  (converted in C by the binding) and only ``data`` as JSON, and a string reply back as
  itself (when the binding can carry it: no NUL, no lone surrogate), so a second bare
  baseline does the same (``upper({id, type, text, data: JSON.parse(data), session, tenant, args})``,
  the string returned as is): against it the ratio is our layer alone; against the JSON one,
  what a call costs compared with the obvious way to use the library. mini-racer (V8) is
  measured when installed.

Both sides use the same JSON codec (plugins.runtimes.base.to_json / scan_json), so the ratio
is the layer's overhead, not a difference in JSON code. Every case starts after a
``gc.collect()`` (outside the timing) so that no case pays for another's garbage. The cases
take turns in 21 short rounds; a value is the median over the rounds, a ratio the median of
the per-round ratios (case and baseline from the same round).
"""
from __future__ import annotations

import gc
import time
from typing import Any, Callable

from bench.common import median, per_call_us, row, setup_django

BENCH = "plugins"
EVENT = {"args": "2 3", "text": "/add 2 3", "type": "message", "id": "bench", "session": "s1",
         "tenant": "5f0c6e2b9d1a4c37", "data": {}}


def _spec(name: str, runtime: str, code: Any, strategy: str) -> Any:
    from plugins.spec import PluginSpec
    return PluginSpec(name=name, runtime=runtime, code=code, strategy=strategy, timeout=5.0, pool_size=4,
                      shard_count=4, max_concurrency=64)


def _examples() -> dict[str, Any]:
    from plugins.bundled import EXAMPLES_DIR
    from plugins.runtimes.wasm import wat_to_wasm
    return {"lua": (EXAMPLES_DIR / "echo.lua").read_text(), "js": (EXAMPLES_DIR / "upper.js").read_text(),
            "wasm": wat_to_wasm((EXAMPLES_DIR / "add.wat").read_text())}


def _lua_bare(code: str) -> dict[str, Callable[[], Any]]:
    import lupa.lua55 as lupa

    from plugins.runtimes.lua import _LuaVM, compile_bytecode

    spec = _spec("echo", "lua", code, "pooled")
    bytecode = compile_bytecode(spec)
    vm = _LuaVM(spec, bytecode)
    env = vm.load_env(time.monotonic() + 5)
    plain = lupa.LuaRuntime(register_eval=False, register_builtins=False)
    plain.execute(code)
    echo = plain.globals().echo
    table_from = plain.table_from
    sandboxed_call, fresh_call, sandbox_table_from = vm._call, vm._fresh, vm._table_from
    now = time.monotonic

    def reused_sandboxed() -> Any:  # lupa + the sandbox's guarded call, no Python of ours
        status, value = sandboxed_call(env, "echo", sandbox_table_from(EVENT, recursive=True), now() + 5.0)
        if status:
            raise RuntimeError(value)
        return value

    def fresh_env() -> Any:  # lupa + the sandbox's fresh environment + guarded call
        # (its third value: coroutines to settle, none for echo)
        status, value, _ = fresh_call("echo", sandbox_table_from(EVENT, recursive=True), now() + 5.0)
        if status:
            raise RuntimeError(value)
        return value

    def fresh_runtime() -> Any:  # the seed's per-request D: new runtime + sandbox + load + call
        fresh = _LuaVM(spec, bytecode)
        return fresh.call_env(fresh.load_env(now() + 5), "echo", EVENT, now() + 5)

    def fresh_bare() -> Any:  # bare lupa: new runtime, load bytecode, one call, no sandbox
        rt = lupa.LuaRuntime(register_eval=False, register_builtins=False)
        rt.execute("local bc = ...; load(bc, 'echo', 'b')()", bytecode)
        return rt.globals().echo(rt.table_from(EVENT, recursive=True))

    return {
        "reused_sandboxed": reused_sandboxed,
        "fresh_env": fresh_env,
        "unsandboxed": lambda: echo(table_from(EVENT, recursive=True)),
        "fresh_runtime": fresh_runtime,
        "fresh_bare": fresh_bare,
    }


def _wasm_bare(module_bytes: bytes) -> dict[str, Callable[[], Any]]:
    import wasmtime

    from plugins.runtimes.base import to_json
    from plugins.runtimes.wasm import ENGINE, LINKER, _abi_event

    module = wasmtime.Module(ENGINE, module_bytes)
    pre = LINKER.instantiate_pre(module)

    def instance() -> tuple[Any, Any, Any, Any]:
        store = wasmtime.Store(ENGINE)
        store.set_epoch_deadline(1 << 30)
        inst = pre.instantiate(store)
        exports = inst.exports(store)
        return store, exports["memory"], exports["alloc"], exports["add"]

    def call(store: Any, memory: Any, alloc: Any, add: Any) -> Any:
        payload = to_json(_abi_event(EVENT)).encode()
        ptr = alloc(store, len(payload))
        memory.write(store, payload, ptr)
        packed = add(store, ptr, len(payload))
        rptr, rlen = packed >> 32, packed & 0xFFFFFFFF
        return bytes(memory.read(store, rptr, rptr + rlen)).decode()

    warm = instance()
    return {"reused": lambda: call(*warm), "fresh": lambda: call(*instance())}


def _js_bare(code: str) -> dict[str, Callable[[], Any]]:
    import quickjs

    from plugins.runtimes.base import scan_json, to_json

    def limited() -> Any:
        """A Context with our limits and the plugin's source, as each bare case starts."""
        ctx = quickjs.Context()
        ctx.set_memory_limit(16 << 20)
        ctx.set_max_stack_size(512 << 10)
        ctx.set_time_limit(5.0)
        ctx.eval(code)
        return ctx

    def context() -> Any:
        ctx = limited()
        ctx.eval("function __run(ev) { return JSON.stringify(upper(JSON.parse(ev))); }")
        return ctx.get("__run")

    def context_fields() -> Any:
        ctx = limited()
        # A string reply crosses as itself when the binding can carry it, as ours does.
        ctx.eval("function __run(id, type, text, data, session, tenant, args) {"
                 " const r = upper({id, type, text, data: JSON.parse(data), session, tenant, args});"
                 " return typeof r === 'string' && r.isWellFormed() && !r.includes('\\0') ? r : 0; }")
        return ctx.get("__run")

    def call_fields(run: Any) -> Any:  # the event's strings as arguments, its data as JSON
        e = EVENT
        data = e["data"]
        return run(e["id"], e["type"], e["text"], "{}" if not data else to_json(data), e["session"], e["tenant"],
                   e["args"])

    run, run_fields = context(), context_fields()
    return {"reused": lambda: scan_json(run(to_json(EVENT)), 0)[0],
            "fresh": lambda: scan_json(context()(to_json(EVENT)), 0)[0],
            "reused_fields": lambda: call_fields(run_fields),
            "fresh_fields": lambda: call_fields(context_fields())}


def _mini_racer(code: str) -> dict[str, Callable[[], Any]] | None:
    try:
        from py_mini_racer import MiniRacer  # type: ignore[import-not-found]
    except ImportError:
        return None
    ctx = MiniRacer()
    ctx.eval(code)

    def fresh() -> Any:
        c = MiniRacer()
        c.eval(code)
        return c.call("upper", EVENT)

    return {"reused": lambda: ctx.call("upper", EVENT), "fresh": fresh}


def _rounds(cases: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """Each case's result in each of ``reps`` rounds, the cases taking turns within a round."""
    results: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            results[name].append(fn())
    return results


def run(quick: bool) -> list[dict[str, Any]]:
    setup_django()
    from plugins.loaded import LoadedPlugin

    code = _examples()
    # Many short rounds rather than a few long ones: the machine is shared, and a load burst
    # then spoils a few rounds out of 21 instead of one round out of 7.
    reps = 5 if quick else 21
    fast_n, slow_n = (300, 40) if quick else (600, 80)
    ours = {(rt, s): LoadedPlugin(_spec(f"bench-{rt}-{s}", rt, code[rt], s))
            for rt in ("lua", "wasm", "js") for s in ("per_request", "pooled", "sharded")}
    for loaded in ours.values():
        loaded.call("echo" if loaded.spec.runtime == "lua" else "upper" if loaded.spec.runtime == "js" else "add",
                    EVENT)  # warm: per-thread runtimes, pooled instances, shard instances

    def timed(fn: Callable[[], Any], n: int) -> Callable[[], float]:
        # Collect first (untimed): a case must not pay for the cycles another case left.
        return lambda: (gc.collect(), per_call_us(fn, n))[1]

    def our(rt: str, s: str, n: int) -> Callable[[], float]:
        handler = {"lua": "echo", "js": "upper", "wasm": "add"}[rt]
        call = ours[(rt, s)].call  # calls never change the event: no copy per call
        return timed(lambda: call(handler, EVENT), n)

    lua, wasm, js = _lua_bare(code["lua"]), _wasm_bare(code["wasm"]), _js_bare(code["js"])
    cases: dict[str, Callable[[], float]] = {
        "lua bare unsandboxed": timed(lua["unsandboxed"], fast_n),
        "lua bare sandboxed": timed(lua["reused_sandboxed"], fast_n),
        "lua bare fresh env": timed(lua["fresh_env"], fast_n),
        "lua bare fresh runtime": timed(lua["fresh_bare"], slow_n),
        "lua fresh runtime+sandbox": timed(lua["fresh_runtime"], slow_n),
        "lua per_request": our("lua", "per_request", fast_n),
        "lua pooled": our("lua", "pooled", fast_n),
        "lua sharded": our("lua", "sharded", fast_n),
        "wasm bare reused": timed(wasm["reused"], fast_n),
        "wasm bare fresh": timed(wasm["fresh"], slow_n),
        "wasm per_request": our("wasm", "per_request", slow_n),
        "wasm pooled": our("wasm", "pooled", fast_n),
        "wasm sharded": our("wasm", "sharded", fast_n),
        "js bare reused": timed(js["reused"], fast_n),
        "js bare fresh": timed(js["fresh"], slow_n),
        "js bare reused fields": timed(js["reused_fields"], fast_n),
        "js bare fresh fields": timed(js["fresh_fields"], slow_n),
        "js per_request": our("js", "per_request", slow_n),
        "js pooled": our("js", "pooled", fast_n),
        "js sharded": our("js", "sharded", fast_n),
    }
    racer = _mini_racer(code["js"])
    if racer:
        cases["mini-racer reused"] = timed(racer["reused"], slow_n // 3)
        cases["mini-racer fresh"] = timed(racer["fresh"], 10)
    rounds = _rounds(cases, reps)
    m = {name: median(values) for name, values in rounds.items()}
    for loaded in ours.values():
        loaded.close()

    def ratio(a: str, b: str) -> float:
        # The median of the per-round ratios: a case and its baseline ran in the same round, a
        # few milliseconds apart, so load that lasts a round cancels out.
        return median(x / y for x, y in zip(rounds[a], rounds[b]))

    def mk(case: str, baseline: str, target_us: float | None = None, overhead: bool = True,
           label: str | None = None, limit: float = 1.2) -> dict[str, Any]:
        r = ratio(case, baseline)
        checks, words = [], []
        if target_us is not None:
            checks.append(m[case] <= target_us)
            words.append(f"<= {target_us:g} us")
        if overhead:
            checks.append(r <= limit)
            words.append(f"<= {limit:g}x")
        return row(BENCH, label or case, m[case], "us", baseline=baseline, ratio=r, target=", ".join(words),
                   ok=all(checks) if checks else None)

    rows = [
        row(BENCH, "lua bare unsandboxed (reused runtime)", m["lua bare unsandboxed"], "us"),
        mk("lua bare sandboxed", "lua bare unsandboxed", overhead=False,
           label="lua bare sandboxed: lupa + hook + guarded call (cost of the sandbox)"),
        row(BENCH, "lua bare fresh env: lupa + sandbox, new env + top level + call", m["lua bare fresh env"], "us"),
        mk("lua pooled", "lua bare sandboxed", 10),
        mk("lua sharded", "lua bare sandboxed", 10),
        mk("lua per_request", "lua bare fresh env", 150, label="lua per_request (fresh env, per-thread runtime)"),
        mk("lua fresh runtime+sandbox", "lua bare fresh runtime", overhead=False,
           label="lua fresh runtime + sandbox per call (not used)"),
        row(BENCH, "lua bare fresh runtime, no sandbox", m["lua bare fresh runtime"], "us"),
        row(BENCH, "wasm bare reused (public API)", m["wasm bare reused"], "us"),
        row(BENCH, "wasm bare fresh (public API, new Store+Instance)", m["wasm bare fresh"], "us"),
        mk("wasm pooled", "wasm bare reused", 100, label="wasm pooled (JSON in, reply out)"),
        mk("wasm sharded", "wasm bare reused", 100),
        mk("wasm per_request", "wasm bare fresh", label="wasm per_request (Store+Instance per call)"),
        row(BENCH, "js bare reused (QuickJS Context, JSON in/out)", m["js bare reused"], "us"),
        row(BENCH, "js bare fresh (new Context + limits + source)", m["js bare fresh"], "us"),
        row(BENCH, "js bare reused, event strings as arguments (the marshalling ours uses)",
            m["js bare reused fields"], "us"),
        row(BENCH, "js bare fresh, event strings as arguments", m["js bare fresh fields"], "us"),
        mk("js pooled", "js bare reused", 20, label="js pooled (shared free list of Contexts)"),
        mk("js pooled", "js bare reused fields", overhead=False,
           label="js pooled vs bare with the same marshalling (our layer alone)"),
        mk("js sharded", "js bare reused", 20, label="js sharded (on the caller's thread)"),
        mk("js sharded", "js bare reused fields", overhead=False,
           label="js sharded vs bare with the same marshalling (our layer alone)"),
        mk("js per_request", "js bare fresh", 300, limit=1.3,
           label="js per_request (new Context per call, prelude from bytecode)"),
        mk("js per_request", "js bare fresh fields", overhead=False,
           label="js per_request vs bare fresh with the same marshalling"),
    ]
    if racer:
        rows.append(mk("mini-racer reused", "js bare reused", overhead=False, label="mini-racer (V8) reused call"))
        rows.append(mk("mini-racer fresh", "js bare fresh", overhead=False, label="mini-racer (V8) new context"))
    else:
        rows.append(row(BENCH, "mini-racer (V8): not installed; runtime-facts.md: 3.6 ms new context, 215 us call",
                        None, "us"))
    return rows
