"""Plugin call cost per runtime and strategy, against the bare library doing the same work.

Every "ours" row is ``LoadedPlugin.call`` (concurrency slot, strategy, host object, event
conversion, sandbox, reply conversion) on a bundled example. Its baseline, measured in the
same run and interleaved with it, is the bare library doing the same work:

- Lua: the same sandboxed function called straight through lupa (``_LuaVM.call`` /
  ``call_fresh``: table_from + the guarded call), so the ratio is our layer's overhead; an
  unsandboxed lupa call and a fresh-runtime-per-call variant are shown for scale;
- WASM: the public wasmtime-py API on one instance (``Func.__call__`` for alloc and the
  handler, ``Memory.write``/``read``, the same JSON encoding); per request adds
  ``InstancePre.instantiate`` + ``exports()``;
- JS: a QuickJS Context called with the JSON event (reused), or a new Context with the same
  limits and source per call (per request). mini-racer (V8) is measured when installed.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable

from bench.common import interleaved, per_call_us, row, setup_django

BENCH = "plugins"
EVENT = {"args": "2 3", "text": "/add 2 3", "type": "message", "id": "bench", "session": "s1", "data": {}}


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
    import lupa.lua54 as lupa
    from plugins.host import Host
    from plugins.runtimes.lua import _LuaVM, compile_bytecode

    spec = _spec("echo", "lua", code, "pooled")
    bytecode = compile_bytecode(spec)
    vm = _LuaVM(spec, bytecode)
    env = vm.load_env(time.monotonic() + 5)
    host = Host(spec, time.monotonic() + 3600)
    plain = lupa.LuaRuntime(register_eval=False, register_builtins=False)
    plain.execute(code)
    echo = plain.globals().echo
    table_from = plain.table_from

    def fresh_runtime() -> Any:  # the seed's per-request D: new runtime + sandbox + load + call
        fresh = _LuaVM(spec, bytecode)
        return fresh.call(fresh.load_env(time.monotonic() + 5), "echo", EVENT, host)

    def fresh_bare() -> Any:  # bare lupa: new runtime, load bytecode, one call, no sandbox
        rt = lupa.LuaRuntime(register_eval=False, register_builtins=False)
        rt.execute("local bc = ...; load(bc, 'echo', 'b')()", bytecode)
        return rt.globals().echo(rt.table_from(EVENT, recursive=True))

    return {
        "reused_sandboxed": lambda: vm.call(env, "echo", EVENT, host),
        "fresh_env": lambda: vm.call_fresh("echo", EVENT, host),
        "unsandboxed": lambda: echo(table_from(EVENT, recursive=True)),
        "fresh_runtime": fresh_runtime,
        "fresh_bare": fresh_bare,
    }


def _wasm_bare(module_bytes: bytes) -> dict[str, Callable[[], Any]]:
    import wasmtime
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
        payload = json.dumps(_abi_event(EVENT), separators=(",", ":"), ensure_ascii=False).encode()
        ptr = alloc(store, len(payload))
        memory.write(store, payload, ptr)
        packed = add(store, ptr, len(payload))
        rptr, rlen = packed >> 32, packed & 0xFFFFFFFF
        return bytes(memory.read(store, rptr, rptr + rlen)).decode()

    warm = instance()
    return {"reused": lambda: call(*warm), "fresh": lambda: call(*instance())}


def _js_bare(code: str) -> dict[str, Callable[[], Any]]:
    import quickjs

    def context() -> Any:
        ctx = quickjs.Context()
        ctx.set_memory_limit(16 << 20)
        ctx.set_max_stack_size(512 << 10)
        ctx.set_time_limit(5.0)
        ctx.eval(code)
        ctx.eval("function __run(ev) { return JSON.stringify(upper(JSON.parse(ev))); }")
        return ctx.get("__run")

    run = context()
    payload = lambda: json.dumps(EVENT, separators=(",", ":"))  # noqa: E731
    return {"reused": lambda: json.loads(run(payload())), "fresh": lambda: json.loads(context()(payload()))}


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


def run(quick: bool) -> list[dict[str, Any]]:
    setup_django()
    from plugins.loaded import LoadedPlugin

    code = _examples()
    reps = 3 if quick else 7
    fast_n, slow_n = (300, 60) if quick else (2000, 300)
    ours = {(rt, s): LoadedPlugin(_spec(f"bench-{rt}-{s}", rt, code[rt], s))
            for rt in ("lua", "wasm", "js") for s in ("per_request", "pooled", "sharded")}
    for loaded in ours.values():
        loaded.call("echo" if loaded.spec.runtime == "lua" else "upper" if loaded.spec.runtime == "js" else "add",
                    dict(EVENT))  # warm: per-thread runtimes, pooled instances, shard threads

    def our(rt: str, s: str, n: int) -> Callable[[], float]:
        handler = {"lua": "echo", "js": "upper", "wasm": "add"}[rt]
        loaded = ours[(rt, s)]
        return lambda: per_call_us(lambda: loaded.call(handler, dict(EVENT)), n)

    lua, wasm, js = _lua_bare(code["lua"]), _wasm_bare(code["wasm"]), _js_bare(code["js"])
    cases: dict[str, Callable[[], float]] = {
        "lua bare unsandboxed": lambda: per_call_us(lua["unsandboxed"], fast_n),
        "lua bare sandboxed": lambda: per_call_us(lua["reused_sandboxed"], fast_n),
        "lua bare fresh env": lambda: per_call_us(lua["fresh_env"], fast_n),
        "lua bare fresh runtime": lambda: per_call_us(lua["fresh_bare"], slow_n),
        "lua fresh runtime+sandbox": lambda: per_call_us(lua["fresh_runtime"], slow_n),
        "lua per_request": our("lua", "per_request", fast_n),
        "lua pooled": our("lua", "pooled", fast_n),
        "lua sharded": our("lua", "sharded", fast_n),
        "wasm bare reused": lambda: per_call_us(wasm["reused"], fast_n),
        "wasm bare fresh": lambda: per_call_us(wasm["fresh"], slow_n),
        "wasm per_request": our("wasm", "per_request", slow_n),
        "wasm pooled": our("wasm", "pooled", fast_n),
        "wasm sharded": our("wasm", "sharded", fast_n),
        "js bare reused": lambda: per_call_us(js["reused"], fast_n),
        "js bare fresh": lambda: per_call_us(js["fresh"], slow_n),
        "js per_request": our("js", "per_request", slow_n),
        "js pooled": our("js", "pooled", fast_n),
        "js sharded": our("js", "sharded", fast_n),
    }
    racer = _mini_racer(code["js"])
    if racer:
        cases["mini-racer reused"] = lambda: per_call_us(racer["reused"], slow_n // 3)
        cases["mini-racer fresh"] = lambda: per_call_us(racer["fresh"], 10)
    m = interleaved(cases, reps)
    for loaded in ours.values():
        loaded.close()

    def ratio(a: str, b: str) -> float:
        return m[a] / m[b]

    def mk(case: str, baseline: str, target_us: float | None = None, overhead: bool = True,
           label: str | None = None) -> dict[str, Any]:
        r = ratio(case, baseline)
        checks, words = [], []
        if target_us is not None:
            checks.append(m[case] <= target_us)
            words.append(f"<= {target_us:g} us")
        if overhead:
            checks.append(r <= 1.2)
            words.append("<= 1.2x")
        return row(BENCH, label or case, m[case], "us", baseline=baseline, ratio=r, target=", ".join(words),
                   ok=all(checks) if checks else None)

    rows = [
        row(BENCH, "lua bare unsandboxed (reused runtime)", m["lua bare unsandboxed"], "us"),
        mk("lua bare sandboxed", "lua bare unsandboxed", overhead=False,
           label="lua sandbox: hook + guarded call (cost of the sandbox)"),
        mk("lua pooled", "lua bare sandboxed", 10),
        mk("lua sharded", "lua bare sandboxed", 10),
        mk("lua per_request", "lua bare fresh env", 150, label="lua per_request (fresh env, per-thread runtime)"),
        mk("lua fresh runtime+sandbox", "lua bare fresh runtime", overhead=False,
           label="lua fresh runtime + sandbox per call (not used)"),
        row(BENCH, "lua bare fresh runtime, no sandbox", m["lua bare fresh runtime"], "us"),
        mk("wasm pooled", "wasm bare reused", 100, label="wasm pooled (JSON in, reply out)"),
        mk("wasm sharded", "wasm bare reused", 100),
        mk("wasm per_request", "wasm bare fresh", label="wasm per_request (Store+Instance per call)"),
        mk("js pooled", "js bare reused", 20, label="js pooled (per-thread Context)"),
        mk("js sharded", "js bare reused", overhead=False, label="js sharded (shard thread hop)"),
        mk("js per_request", "js bare fresh", 300, label="js per_request (new Context per call)"),
    ]
    if racer:
        rows.append(mk("mini-racer reused", "js bare reused", overhead=False, label="mini-racer (V8) reused call"))
        rows.append(mk("mini-racer fresh", "js bare fresh", overhead=False, label="mini-racer (V8) new context"))
    else:
        rows.append(row(BENCH, "mini-racer (V8): not installed; runtime-facts.md: 3.6 ms new context, 215 us call",
                        None, "us"))
    return rows
