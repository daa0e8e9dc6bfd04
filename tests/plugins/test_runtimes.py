"""Every runtime x every strategy, through the real lupa, wasmtime and QuickJS (no mocks)."""
from __future__ import annotations

import threading
import zlib

import pytest

from execapp.engine import HandlerError, HandlerTimeout
from plugins.errors import PluginBusy, PluginInvalid, PluginMemoryExceeded
from plugins.loaded import LoadedPlugin, validate
from plugins.runtimes.registry import STRATEGIES
from plugins.runtimes.wasm import wat_to_wasm
from plugins.spec import PluginSpec
from tests.conftest import wait_until

from .guests import CODE, LOOPS, SYNTAX_ERRORS

RUNTIMES = ["lua", "wasm", "js"]


def make(runtime: str, strategy: str, **limits) -> LoadedPlugin:
    options = {"timeout": 0.15, "memory_bytes": 8 << 20, "pool_size": 2, "shard_count": 2, "max_concurrency": 8,
               "permissions": frozenset({"log", "sleep"}), **limits}
    return LoadedPlugin(PluginSpec(name=f"t-{runtime}", runtime=runtime, code=CODE[runtime], strategy=strategy,
                                   **options))


def event(args: str = "", session: str | None = None, text: str | None = None) -> dict:
    return {"id": "e1", "type": "message", "text": text if text is not None else f"/x {args}", "args": args,
            "data": {"n": 1}, "session": session}


@pytest.fixture(params=[(r, s) for r in RUNTIMES for s in STRATEGIES], ids=lambda p: f"{p[0]}-{p[1]}")
def plugin(request):
    loaded = make(*request.param)
    yield loaded
    loaded.close()


def test_reply(plugin: LoadedPlugin) -> None:
    expected = "hi" if plugin.spec.runtime == "wasm" else "hi there"
    assert plugin.call("reply", event("there")) == expected
    data = plugin.call("data", event("x", session="s1"))
    assert data["session"] == "s1" and data["text"] == "/x x"


def test_warm_state_follows_the_strategy(plugin: LoadedPlugin) -> None:
    counts = [plugin.call("count", event(session="same")) for _ in range(3)]
    if plugin.spec.strategy == "per_request":
        assert counts == ["1", "1", "1"]  # a fresh instance every call
    else:
        assert counts == ["1", "2", "3"]  # one warm instance (pool of 2, used serially; same shard)


def test_loops_are_stopped_by_the_timeout(plugin: LoadedPlugin) -> None:
    for handler in LOOPS[plugin.spec.runtime]:
        with pytest.raises(HandlerTimeout) as info:
            plugin.call(handler, event())
        assert info.value.code == "timeout"
        assert f"plugin {plugin.name!r} handler {handler!r}" in str(info.value)
    assert plugin.call("count", event()) == "1" or plugin.spec.strategy == "per_request"
    assert plugin.timeouts_total == len(LOOPS[plugin.spec.runtime])


def test_memory_bomb_is_stopped_by_the_cap(plugin: LoadedPlugin) -> None:
    # The bomb needs ~60 ms of CPU to fill the cap; the budget is wall-clock time, so a busy
    # machine gets a budget far above that (the cap, not the timeout, must stop it).
    plugin = make(plugin.spec.runtime, plugin.spec.strategy, timeout=5.0)
    try:
        with pytest.raises(PluginMemoryExceeded) as info:
            plugin.call("bomb", event())
        assert info.value.code == "memory_limit" and "memory cap" in str(info.value)
        assert plugin.call("reply", event("again")) in ("hi again", "hi")
    finally:
        plugin.close()


def test_guest_error_is_a_handler_error(plugin: LoadedPlugin) -> None:
    with pytest.raises(HandlerError) as info:
        plugin.call("fail", event())
    assert type(info.value) is HandlerError and info.value.code == "handler_error"
    assert ("unreachable" if plugin.spec.runtime == "wasm" else "kaput") in str(info.value)
    assert plugin.call("reply", event("x")) in ("hi x", "hi")


def test_missing_handler_at_call_time(plugin: LoadedPlugin) -> None:
    with pytest.raises(HandlerError, match="nope"):
        plugin.call("nope", event())


def test_host_call_without_permission_fails_inside_the_guest(plugin: LoadedPlugin, caplog) -> None:
    with pytest.raises(HandlerError, match="no 'kv' permission"):
        plugin.call("denied", event())
    assert any("kv_get denied" in r.getMessage() for r in caplog.records)


def test_host_sleep_past_the_deadline_is_a_timeout(plugin: LoadedPlugin) -> None:
    args = "300"  # the WASM guest always sleeps 300 ms; the timeout is 150 ms
    with pytest.raises(HandlerTimeout, match="sleep"):
        plugin.call("nap", event(args))


def test_instances_are_not_leaked_after_timeouts_and_errors(plugin: LoadedPlugin) -> None:
    strategy = plugin.strategy
    for handler in ("loop", "fail", "bomb", "loop", "fail"):
        with pytest.raises(HandlerError):
            plugin.call(handler, event(session="k"))
        plugin.call("reply", event(session="k"))
    assert plugin.slots.busy == 0 and strategy.busy == 0
    if strategy.name == "per_request":
        assert strategy.live() == 0
    else:
        limit = plugin.spec.pool_size if strategy.name == "pooled" else plugin.spec.shard_count
        assert 1 <= strategy.live() <= limit  # poisoned instances were discarded, not kept
        assert strategy.discarded_total >= 2


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_compile_error_is_refused_with_the_runtimes_message(runtime: str) -> None:
    code, message = SYNTAX_ERRORS[runtime]
    spec = PluginSpec(name="broken", runtime=runtime, code=code)
    with pytest.raises(PluginInvalid) as info:
        validate(spec, ["handler_one"])
    text = str(info.value)
    assert "plugin 'broken'" in text and "handler_one" in text and message in text
    assert info.value.code == "plugin_invalid"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_missing_handler_is_refused(runtime: str) -> None:
    spec = PluginSpec(name="partial", runtime=runtime, code=CODE[runtime])
    with pytest.raises(PluginInvalid) as info:
        validate(spec, ["reply", "not_there"])
    assert "plugin 'partial': handler 'not_there' is not defined" in str(info.value)
    assert "reply" in str(info.value)  # lists what the code defines


@pytest.mark.parametrize("runtime", ["lua", "js"])
def test_top_level_code_cannot_run_away_or_call_the_host(runtime: str) -> None:
    loop = "while true do end" if runtime == "lua" else "while (true) {}"
    with pytest.raises(PluginInvalid, match="timeout"):
        validate(PluginSpec(name="spin", runtime=runtime, code=loop, timeout=0.1))
    host = 'x = kv_get("a")' if runtime == "lua" else 'kv_get("a")'
    with pytest.raises(PluginInvalid, match="not available while the plugin's top level runs"):
        validate(PluginSpec(name="eager", runtime=runtime, code=host, permissions=frozenset({"kv"})))


@pytest.mark.parametrize("what", ["os", "io", "require", "python", "load", "bytecode", "debug", "string",
                                  "metatable"])
@pytest.mark.parametrize("strategy", ["per_request", "pooled"])
def test_lua_sandbox_escapes_are_refused(what: str, strategy: str) -> None:
    plugin = make("lua", strategy)
    with pytest.raises(HandlerError) as info:
        plugin.call("escape", event(what))
    assert "nil value" in str(info.value) or "read-only" in str(info.value) or "attempt to index" in str(info.value)
    # Nothing leaked into the next call: string.upper still works.
    assert plugin.call("reply", event("ok")) == "hi ok"


def test_lua_bytecode_from_a_plugin_is_refused() -> None:
    with pytest.raises(PluginInvalid, match="bytecode"):
        validate(PluginSpec(name="bc", runtime="lua", code="\x1bLuaT\x00"))


@pytest.mark.parametrize("what", ["require", "process", "std", "import", "fetch"])
def test_js_has_no_ambient_authority(what: str) -> None:
    plugin = make("js", "per_request")
    with pytest.raises(HandlerError, match="not defined|could not load module"):
        plugin.call("escape", event(what))


def test_wasm_unknown_imports_are_refused() -> None:
    wat = '(module (import "wasi_snapshot_preview1" "fd_write" (func (param i32 i32 i32 i32) (result i32))))'
    with pytest.raises(PluginInvalid, match="unknown import wasi_snapshot_preview1.fd_write"):
        validate(PluginSpec(name="wasi", runtime="wasm", code=wat_to_wasm(wat)))


def test_wasm_initial_memory_over_the_cap_is_refused() -> None:
    wat = '(module (memory (export "memory") 400) (func (export "alloc") (param i32) (result i32) (i32.const 0)))'
    with pytest.raises(PluginInvalid, match=r"does not instantiate: .* \(the plugin's memory cap is 16777216 bytes, "
                                            r"256 pages of 64 KiB; declare fewer initial pages, or raise"):
        validate(PluginSpec(name="big", runtime="wasm", code=wat_to_wasm(wat), memory_bytes=16 << 20))
    wat = ('(module (memory (export "memory") 1) (table 200000 funcref) '
           '(func (export "alloc") (param i32) (result i32) (i32.const 0)))')
    with pytest.raises(PluginInvalid, match=r"\(a table may hold at most 100000 elements; declare a smaller table\)"):
        validate(PluginSpec(name="wide", runtime="wasm", code=wat_to_wasm(wat)))


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_other_calls_keep_running_while_one_loops(runtime: str) -> None:
    plugin = make(runtime, "pooled", timeout=1.0, pool_size=2)
    outcome: list[BaseException] = []
    started = threading.Event()

    def runaway() -> None:
        started.set()
        try:
            plugin.call("loop", event())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=runaway)
    thread.start()
    started.wait()
    replies = [plugin.call("reply", event("x")) for _ in range(5)]
    still_looping = thread.is_alive()
    thread.join()
    assert replies == ["hi x" if runtime != "wasm" else "hi"] * 5
    assert still_looping  # the five calls finished inside the loop's 1 s budget
    assert isinstance(outcome[0], HandlerTimeout)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_burst_above_the_concurrency_limit_waits_or_is_refused(runtime: str) -> None:
    plugin = make(runtime, "pooled", timeout=2.0, max_concurrency=2, pool_size=4)
    both_running = threading.Barrier(3)
    results: list = []

    def nap() -> None:
        both_running.wait()
        results.append(plugin.call("nap", event("300")))

    threads = [threading.Thread(target=nap) for _ in range(2)]
    for t in threads:
        t.start()
    both_running.wait()
    while plugin.slots.busy < 2:  # both naps hold their slot
        threading.Event().wait(0.005)
    # Inline on the event loop (blocking=False): refused at once with its own code.
    with pytest.raises(PluginBusy) as info:
        plugin.call("reply", event("inline"), blocking=False)
    assert info.value.code == "plugin_busy" and "max concurrency" in str(info.value)
    # In a pool thread (blocking=True): waits for a slot, then runs.
    assert plugin.call("reply", event("waited"), blocking=True) in ("hi waited", "hi")
    for t in threads:
        t.join()
    assert results == ["napped", "napped"]
    assert plugin.slots.waits_total >= 1 and plugin.slots.refused_total == 1
    assert plugin.slots.busy == 0


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_sharded_keeps_a_session_on_one_shard(runtime: str) -> None:
    plugin = make(runtime, "sharded", shard_count=4)
    sessions = [f"user-{i}" for i in range(8)]
    per_session: dict[str, list[str]] = {}
    for _ in range(2):
        for s in sessions:
            per_session.setdefault(s, []).append(plugin.call("count", event(session=s)))
    shard = {s: zlib.crc32(s.encode()) % 4 for s in sessions}
    for s in sessions:
        assert plugin.strategy.shard_for(event(session=s)) == shard[s]
        first, second = (int(x) for x in per_session[s])
        assert second > first  # same shard, same warm instance, in order
    plugin.close()


def test_a_busy_shard_refuses_inline_calls() -> None:
    plugin = make("lua", "sharded", timeout=2.0, shard_count=2)
    started = threading.Event()

    def hold() -> None:
        started.set()
        plugin.call("nap", event("300", session="a"))

    t = threading.Thread(target=hold)
    t.start()
    started.wait()
    while plugin.strategy.busy == 0:
        threading.Event().wait(0.005)
    with pytest.raises(PluginBusy, match="shard"):
        plugin.call("reply", event("x", session="a"), blocking=False)
    t.join()
    assert plugin.call("reply", event("x", session="a"), blocking=False) == "hi x"


def test_lua_per_thread_runtimes_are_counted_only_while_their_thread_lives() -> None:
    plugin = make("lua", "per_request")
    try:
        for _ in range(5):  # five short-lived threads, as lingering pool workers come and go
            t = threading.Thread(target=plugin.call, args=("reply", event("x")))
            t.start()
            t.join()
        plugin.call("reply", event("x"))  # this thread keeps its runtime
        assert plugin.compiled.idle_isolated() == 1 and plugin.strategy.idle() == 1
        napping = threading.Thread(target=plugin.call, args=("nap", event("100")))
        napping.start()  # a second thread's runtime, busy in host sleep: live but not idle
        # (its slot is taken before its runtime is made: wait for both)
        assert wait_until(lambda: plugin.slots.busy == 1 and plugin.compiled.idle_isolated() == 2)
        assert plugin.strategy.idle() == 1
        napping.join()
    finally:
        plugin.close()


def test_js_pooled_instances_of_exited_threads_are_not_counted_as_live() -> None:
    import gc

    plugin = make("js", "pooled")
    try:
        for _ in range(3):
            t = threading.Thread(target=plugin.call, args=("reply", event("x")))
            t.start()
            t.join()
        plugin.call("reply", event("x"))
        gc.collect()
        assert plugin.strategy.live() == 1 and plugin.strategy.idle() == 1
    finally:
        plugin.close()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_lua_guest_reads_an_integer_past_64_bits_as_a_float(strategy: str) -> None:
    """A client's JSON may hold any integer: past Lua's 64 bits it arrives as a float (as JS reads
    it), never as the conversion's OverflowError."""
    code = "function h(e) return math.type(e.data.n) .. ' ' .. tostring(e.data.m[2]) end"
    plugin = LoadedPlugin(PluginSpec(name="t-bigint", runtime="lua", strategy=strategy, timeout=1.0, code=code))
    try:
        ev = {**event(), "data": {"n": 2 ** 64, "m": [1, -10 ** 400]}}
        assert plugin.call("h", ev) == "float -inf"
        assert plugin.call("h", {**event(), "data": {"n": 2 ** 63 - 1, "m": [1, 2]}}) == "integer 2"
    finally:
        plugin.close()
