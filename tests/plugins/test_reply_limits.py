"""A plugin's reply and error message are bounded for every runtime before they reach the engine:
what follows a handler (its frame, the outbox, the write, the history) runs on the event loop,
outside the handler's measured time, in time linear in what the guest returned."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from execapp.engine import Engine, Event, Failure, HandlerError, Reply
from execapp.protocol import outcome_frame
from plugins.loaded import LoadedPlugin
from plugins.runtimes.base import MAX_ERROR_CHARS, MAX_REPLY_BYTES, MAX_REPLY_DEPTH
from plugins.spec import PluginSpec

# Each handler takes "<n>" (or "<character> <n>") in its arguments and returns that much.
CODE = {
    "lua": r"""
function text(ev) local c, n = ev.args:match("^(%S+) (%d+)$"); return string.rep(c, tonumber(n)) end
function data(ev) return {s = string.rep("x", tonumber(ev.args))} end
function fail(ev) error(string.rep("e", tonumber(ev.args))) end
""",
    "js": r"""
function text(ev) { const [c, n] = ev.args.split(" "); return c.repeat(Number(n)); }
function data(ev) { return {s: "x".repeat(Number(ev.args))}; }
async function later(ev) { await null; return "x".repeat(Number(ev.args)); }
function fail(ev) { throw new Error("e".repeat(Number(ev.args))); }
""",
}
BIG = 1 << 20


@pytest.fixture(params=sorted(CODE))
def plugin(request: pytest.FixtureRequest) -> Iterator[LoadedPlugin]:
    loaded = LoadedPlugin(PluginSpec(name=f"r-{request.param}", runtime=request.param, code=CODE[request.param],
                                     timeout=5.0))
    yield loaded
    loaded.close()


def _frames(plugin: LoadedPlugin, handler: str, args: str) -> list[Any]:
    """The outcomes of one event run inline (as on the loop) by ``handler``, each with its frame."""
    engine = Engine(pool_enabled=False)
    engine.add(engine.make_matcher("command", "go", plugin.engine_handler(handler), plugin=plugin.name))
    outcomes: list[Any] = []
    engine.process_event_sync(Event(text=f"/go {args}"), outcomes.append)
    engine.shutdown()
    return [(o, outcome_frame(o)) for o in outcomes[:-1]]  # the last: the done


def test_a_reply_over_the_limit_is_the_handlers_error_and_its_frame_stays_small(plugin: LoadedPlugin) -> None:
    # "later" (a reply that comes back through a promise) exists where the runtime has promises.
    cases = [("text", f"x {BIG}"), ("data", str(BIG)), ("later", str(BIG))]
    cases = [(h, a) for h, a in cases if h in plugin.compiled.handlers]
    assert {"text", "data"} <= {h for h, _ in cases}
    for n, (handler, args) in enumerate(cases, 1):
        [(outcome, frame)] = _frames(plugin, handler, args)
        assert isinstance(outcome, Failure) and outcome.code == HandlerError.code, outcome
        assert f"{MAX_REPLY_BYTES} " in outcome.message and "(MAX_REPLY_BYTES" in outcome.message, outcome.message
        assert f"handler {handler!r}" in outcome.message
        assert len(frame) < 2048, len(frame)
        assert plugin.errors_total == n


def test_a_reply_at_the_limit_in_utf8_bytes_passes_and_one_byte_more_does_not(plugin: LoadedPlugin) -> None:
    # Two bytes a character: counted in bytes, as WASM's reply always was.
    [(at, _)] = _frames(plugin, "text", f"\u00e9 {MAX_REPLY_BYTES // 2}")
    assert isinstance(at, Reply) and len(at.text.encode()) == MAX_REPLY_BYTES
    [(over, _)] = _frames(plugin, "text", f"\u00e9\u00e9x {MAX_REPLY_BYTES // 5 + 1}")
    assert isinstance(over, Failure) and "MAX_REPLY_BYTES" in over.message


def test_a_huge_error_message_is_cut(plugin: LoadedPlugin) -> None:
    [(outcome, frame)] = _frames(plugin, "fail", str(BIG))
    assert isinstance(outcome, Failure) and outcome.code == HandlerError.code
    assert f"plugin {plugin.name!r} handler 'fail'" in outcome.message
    assert len(outcome.message) < MAX_ERROR_CHARS + 300, len(outcome.message)
    assert len(frame) < MAX_ERROR_CHARS + 600


def test_the_limits_leave_ordinary_replies_alone(plugin: LoadedPlugin) -> None:
    [(text, _)] = _frames(plugin, "text", "ab 3")
    [(data, _)] = _frames(plugin, "data", "3")
    assert (text.text, data.data) == ("ababab", {"s": "xxx"})


def _nested(runtime: str, depth: int) -> LoadedPlugin:
    """A plugin whose handler ``deep`` returns ``depth`` arrays nested in each other."""
    if runtime == "lua":
        code = f"function deep(ev) local a = {{}} for i = 2, {depth} do a = {{a}} end return a end"
    elif runtime == "js":
        code = f"function deep(ev) {{ let a = []; for (let i = 1; i < {depth}; i++) a = [a]; return a; }}"
    else:
        reply = "[" * depth + "]" * depth
        code = (f'(module (memory (export "memory") 1) (data (i32.const 4096) "{reply}")'
                '(func (export "alloc") (param i32) (result i32) (i32.const 16))'
                '(func (export "deep") (param i32 i32) (result i64) '
                f'(i64.or (i64.shl (i64.const 4096) (i64.const 32)) (i64.const {len(reply)}))))')
    return LoadedPlugin(PluginSpec(name=f"d-{runtime}", runtime=runtime, code=code, timeout=5.0))


@pytest.mark.parametrize("runtime", ["lua", "js", "wasm"])
def test_a_data_reply_nested_past_the_depth_limit_is_the_handlers_error(runtime: str) -> None:
    # A JS or WASM reply ~950 levels deep parsed, passed its handler, then failed its frame's
    # encoding at delivery: the client got a done counting a reply it never received.
    for depth in (MAX_REPLY_DEPTH, MAX_REPLY_DEPTH + 1, 950):
        plugin = _nested(runtime, depth)
        try:
            [(outcome, frame)] = _frames(plugin, "deep", "")
        finally:
            plugin.close()
        if depth == MAX_REPLY_DEPTH:
            data = frame[frame.index('"data":'):]  # (a Lua empty table is an object)
            assert isinstance(outcome, Reply) and data.count("[") + data.count("{") == depth, frame[:200]
            continue
        assert isinstance(outcome, Failure) and outcome.code == HandlerError.code, (depth, outcome)
        assert ("MAX_REPLY_DEPTH" in outcome.message or "deeper than" in outcome.message
                or "too deep" in outcome.message), outcome.message
