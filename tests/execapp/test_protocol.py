"""execapp.protocol and execapp.connection without Channels: frame validation, outgoing frames, one
connection's ordering."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execapp.codes import ERROR_CODES
from execapp.connection import Connection, Outbox
from execapp.engine import Completion, Engine, ExecClass, ExecPool, Failure, Reply
from execapp.protocol import (
    MAX_SESSIONS_PER_CONNECTION,
    Limits,
    ProtocolError,
    error_frame,
    group_name,
    json_depth,
    outcome_frame,
    parse_frame,
)
from tests.conftest import wait_until_async

from .ws_fixtures import Admission

LIMITS = Limits(max_frame_bytes=1024, max_in_flight=3)


def refused(text: str | None, data: bytes | None = None, limits: Limits = LIMITS) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_frame(text, data, limits)
    return info.value


# -- parsing --------------------------------------------------------------------------------------

def test_a_message_event_parses_with_its_fields() -> None:
    event = parse_frame('{"id": "e1", "type": "message", "session": "s-1", "text": "/ping"}', None, LIMITS)
    assert (event.id, event.type, event.session, event.text, event.data) == ("e1", "message", "s-1", "/ping", {})


def test_the_server_assigns_an_id_when_the_client_gives_none() -> None:
    a = parse_frame('{"type": "message", "text": "/ping"}', None, LIMITS)
    b = parse_frame('{"type": "message", "text": "/ping", "id": null}', None, LIMITS)
    assert a.id and b.id and a.id != b.id


def test_other_event_types_carry_data() -> None:
    bare = parse_frame('{"text": "/ping"}', None, LIMITS)
    assert (bare.type, bare.text) == ("message", "/ping")
    event = parse_frame('{"type": "order.created", "data": {"n": 1}}', None, LIMITS)
    assert (event.type, event.text, event.data) == ("order.created", "", {"n": 1})


def test_invalid_json_is_bad_json() -> None:
    err = refused('{"type": "message", "text": "/ping"')
    assert (err.code, err.event_id) == ("bad_json", None)


@pytest.mark.parametrize("frame, ok", [
    (' {"text": "/ping"}\n', True),  # whitespace around the object: still one JSON value
    ('{"text": "/ping"} x', False),
    ('{"text": "/ping"}{}', False),
    ('{"text": "/ping"} 1', False),
])
def test_a_frame_is_exactly_one_json_value(frame: str, ok: bool) -> None:
    if ok:
        assert parse_frame(frame, None, LIMITS).text == "/ping"
    else:
        err = refused(frame)
        assert err.code == "bad_json" and "Extra data" in err.message


@pytest.mark.parametrize("frame, field, event_id", [
    ('[1, 2]', "JSON object", None),
    ('"hello"', "JSON object", None),
    ('{"type": "message", "text": "/ping", "id": 5}', "id", None),
    ('{"type": "message", "text": "/ping", "id": ""}', "id", None),
    ('{"type": "message", "text": "/ping", "id": "%s"}' % ("x" * 65), "id", None),
    ('{"id": "e", "type": "message", "txt": "/ping"}', "txt", "e"),
    ('{"id": "e", "type": "", "text": "/ping"}', "type", "e"),
    ('{"id": "e", "type": null, "text": "/ping"}', "type", "e"),
    ('{"id": "e", "type": 7, "text": "/ping"}', "type", "e"),
    ('{"id": "e", "type": "message"}', "text", "e"),
    ('{"id": "e", "type": "message", "text": ["/ping"]}', "text", "e"),
    ('{"id": "e", "type": "tick", "text": 1}', "text", "e"),
    ('{"id": "e", "type": "tick", "data": [1]}', "data", "e"),
    ('{"id": "e", "type": "message", "text": "/ping", "session": "no spaces"}', "session", "e"),
    ('{"id": "e", "type": "message", "text": "/ping", "session": 3}', "session", "e"),
])
def test_a_wrong_shape_is_bad_event_naming_the_field(frame: str, field: str, event_id: str | None) -> None:
    err = refused(frame)
    assert err.code == "bad_event"
    assert field in err.message
    assert err.event_id == event_id


def test_a_binary_frame_is_bad_event() -> None:
    err = refused(None, b'{"type": "message", "text": "/ping"}')
    assert err.code == "bad_event" and "binary" in err.message


def test_frames_over_the_limit_are_too_large_counted_in_utf8_bytes() -> None:
    limits = Limits(max_frame_bytes=100, max_in_flight=1)
    fits = json.dumps({"type": "message", "text": "€" * 25}, ensure_ascii=False)  # 75 + 28 bytes > 100
    assert len(fits) < 100
    assert refused(fits, limits=limits).code == "too_large"
    assert parse_frame(json.dumps({"type": "message", "text": "€" * 20}, ensure_ascii=False), None, limits)
    assert refused("x" * 101, limits=limits).code == "too_large"
    assert refused(None, b"x" * 101, limits=limits).code == "too_large"


# -- hostile frames -------------------------------------------------------------------------------

def test_the_issues_2_kb_frame_of_1100_nested_lists_is_too_deep_not_a_recursion_error() -> None:
    limits = Limits()  # the defaults: 64 KiB, depth 32
    frame = "[" * 1100 + "]" * 1100
    assert len(frame) == 2200
    err = refused(frame, limits=limits)
    assert err.code == "too_deep" and "MAX_FRAME_DEPTH" in err.message and "32" in err.message
    # Unbalanced and deep (the decoder would recurse before finding the missing brackets).
    assert refused("[" * 5000, limits=limits).code == "too_deep"
    assert refused('{"data": ' + '{"a": ' * 3000, limits=limits).code == "too_deep"


def test_the_depth_limit_counts_the_event_object_as_level_one() -> None:
    limits = Limits(max_frame_bytes=4096, max_in_flight=1, max_depth=32)

    def frame(levels_in_data: int) -> str:  # data itself is level 2
        return json.dumps({"type": "t", "data": {"x": json.loads("[" * levels_in_data + "]" * levels_in_data)}})

    assert parse_frame(frame(30), None, limits).data["x"] == json.loads("[" * 30 + "]" * 30)  # 1 + 1 + 30 = 32
    err = refused(frame(31), limits=limits)
    assert err.code == "too_deep"
    assert parse_frame(frame(31), None, Limits(4096, 1, 33)).type == "t"  # the limit is a setting


def test_brackets_inside_strings_do_not_count_towards_depth() -> None:
    text = "/echo " + "[{" * 400 + '\\"[' + "]" * 3
    event = parse_frame(json.dumps({"type": "message", "text": text, "data": {"k": "]]]" + "{" * 50}}), None,
                        Limits(8192, 1))
    assert event.text == text
    assert json_depth(json.dumps({"a": ["[[[", '\\', '"[', {"b": "\\\"["}]}).encode(), 32) == 3


@pytest.mark.parametrize("value, depth", [
    ([], 1), ({}, 1), ([[]], 2), ([[], [[]]], 3), ({"a": [{"b": []}]}, 4), ("[[[", 0), (["]", "["], 1),
    ([[[[[[[[[[]]]]]]]]]], 10),
])
def test_json_depth_is_exact_up_to_the_limit(value: object, depth: int) -> None:
    assert json_depth(json.dumps(value).encode(), 32) == depth


@pytest.mark.parametrize("frame, where", [
    ('{"id": "u1", "type": "message", "text": "/echo \\ud800"}', "text"),
    ('{"id": "u2", "type": "message", "text": "/echo \\udfff x"}', "text"),
    ('{"id": "u3", "type": "t", "data": {"a": [1, {"b": "\\ud83d"}]}}', "data.a[1].b"),
    ('{"id": "u4", "type": "t", "data": {"\\udc00": 1}}', "data.<key>"),
    ('{"id": "u5", "type": "message", "text": "/ping", "\\ud800": 1}', "<key>"),
    ('{"id": "\\ud800", "type": "message", "text": "/ping"}', "id"),
])
def test_a_lone_surrogate_anywhere_is_bad_event_at_the_edge(frame: str, where: str) -> None:
    err = refused(frame)
    assert err.code == "bad_event" and "Unicode" in err.message and err.message.startswith(where), err.message
    # The id is echoed only when it is valid text itself (the error frame must be sendable).
    assert err.event_id == (None if where == "id" else json.loads(frame)["id"])
    json.loads(error_frame(err.code, err.message, err.event_id)).items()
    error_frame(err.code, err.message, err.event_id).encode()  # valid UTF-8


def test_a_raw_lone_surrogate_in_the_text_is_bad_event_and_a_surrogate_pair_is_fine() -> None:
    err = refused('{"type": "message", "text": "/echo \ud800"}')  # the str itself holds U+D800
    assert err.code == "bad_event" and "Unicode" in err.message
    event = parse_frame('{"type": "message", "text": "/echo \\ud83d\\ude00 \\u00e9"}', None, LIMITS)
    assert event.text == "/echo \U0001f600 é"
    # Escaped backslash followed by "ud800": text, not an escape.
    assert parse_frame('{"type": "message", "text": "/echo \\\\ud800"}', None, LIMITS).text == "/echo \\ud800"


@pytest.mark.parametrize("frame", ['{"type": "message", "text": "/ping", "data": {"x": NaN}}',
                                   '{"type": "tick", "data": {"x": -Infinity}}',
                                   '{"type": "tick", "data": {"n": %s}}' % ("9" * 5000),
                                   '{"type": "tick", "data": {"n": 1e999}}',  # Infinity by another name
                                   '{"type": "tick", "data": [1.5, -2e400]}'])
def test_python_only_json_is_bad_json(frame: str) -> None:
    assert refused(frame, limits=Limits()).code == "bad_json"


def test_a_number_past_a_doubles_range_is_refused_with_what_to_send() -> None:
    error = refused('{"type": "tick", "data": {"n": 1e999}}', limits=Limits())
    assert "1e999 is past the range of a double" in error.message and "as a string" in error.message
    assert parse_frame('{"type": "tick", "data": {"n": 1.5e308, "m": -2.5}}', None, LIMITS).data == \
        {"n": 1.5e308, "m": -2.5}


def test_outgoing_frames_are_always_utf8_and_strict_json() -> None:
    def strict(text: str) -> dict:
        text.encode()  # a lone surrogate would make the socket's send fail: the frame lost

        def no_constant(name: str) -> None:
            raise AssertionError(name)

        return json.loads(text, parse_constant=no_constant)

    frame = strict(outcome_frame(Reply("e", "m", None, "bad \ud800 text", {"x": float("nan")}, ExecClass.POOL, 0.0)))
    assert frame["text"] == "bad ? text" and "nan" in frame["data"]


def test_a_reply_whose_data_nests_past_the_encoders_recursion_limit_still_has_a_frame() -> None:
    # Plugins refuse such data (MAX_REPLY_DEPTH); any other source of a Reply must not lose its
    # frame to a RecursionError at delivery (the client would get a done counting a lost reply).
    data: list = []
    for _ in range(5000):
        data = [data]
    frame = json.loads(outcome_frame(Reply("e", "m", None, None, data, ExecClass.POOL, 0.0)))
    assert frame["type"] == "reply" and "too deep" in frame["data"]


def test_a_long_unknown_field_name_is_clipped_in_the_message() -> None:
    err = refused(json.dumps({"type": "message", "text": "/ping", "k" * 500: 1}))
    assert err.code == "bad_event" and len(err.message) < 200


def test_the_event_size_is_the_frames_length_in_characters() -> None:
    frame = json.dumps({"type": "message", "text": "/echo " + "é" * 100}, ensure_ascii=False)
    assert parse_frame(frame, None, LIMITS).size == len(frame)


async def test_a_failure_inside_the_server_is_an_internal_error_frame_logged_once(caplog: Any) -> None:
    class Broken(Admission):
        def begin_event(self) -> bool:
            raise RuntimeError("admission is broken")

    engine = Engine(pool_enabled=False)
    engine.add(engine.make_matcher("command", "ping", lambda ctx: "pong", name="ping"))
    sent: list[dict] = []

    async def send(text: str) -> None:
        sent.append(json.loads(text))

    conn = Connection(engine, Broken(), LIMITS, send)
    with caplog.at_level(logging.ERROR, logger="execapp.connection"):
        for i in range(5):
            await conn.receive(json.dumps({"id": f"x{i}", "type": "message", "text": "/ping"}))
    await conn.flush()
    assert [f["code"] for f in sent] == ["internal_error"] * 5 and "RuntimeError" in sent[0]["message"]
    assert not conn.in_flight
    logged = [r for r in caplog.records if "failed inside the server" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    conn.worker = Admission()  # the connection is still usable
    await conn.receive(json.dumps({"id": "ok", "type": "message", "text": "/ping"}))
    await _settle(conn, sent, 1)
    assert [f["type"] for f in sent[5:]] == ["reply", "done"]
    conn.close()


def test_every_protocol_code_is_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    for code in ERROR_CODES:
        assert f"`{code}`" in doc, code


# -- outgoing frames ------------------------------------------------------------------------------

def test_outcome_frames_have_the_documented_fields() -> None:
    reply = json.loads(outcome_frame(Reply("e", "command:ping", "p", "pong", {"k": 1}, ExecClass.POOL, 0.0012)))
    assert reply == {"type": "reply", "id": "e", "matcher": "command:ping", "plugin": "p", "text": "pong",
                     "data": {"k": 1}, "exec": "pool", "elapsed_ms": 1.2}
    failure = Failure("e", "command:boom", None, "handler_error", "boom", ExecClass.SYNC, 0.0)
    assert json.loads(outcome_frame(failure, "s")) == {
        "type": "error", "id": "e", "code": "handler_error", "message": "boom", "matcher": "command:boom",
        "plugin": None, "exec": "sync", "session": "s"}
    done = json.loads(outcome_frame(Completion("e", 2, 1, (failure,), "command:guard", 0.5)))
    assert done == {"type": "done", "id": "e", "matched": 2, "replies": 1, "errors": 1,
                    "blocked_by": "command:guard", "elapsed_ms": 500.0}
    assert json.loads(error_frame("bad_json", "nope")) == {"type": "error", "id": None, "code": "bad_json",
                                                            "message": "nope"}


@pytest.mark.parametrize("outcome", [
    Reply("e1", "ping.ping", "ping", "pong", None, ExecClass.SYNC, 1.234567e-5),
    Reply('e"1\\', "m", None, None, None, ExecClass.POOL, 0.5),
    Reply("é-\u2028", "m", "p", "héllo \n\t\"\u0000", None, ExecClass.SYNC, 12.0),
    Reply("e", "m", "p", "lone \ud800 surrogate", None, ExecClass.SYNC, 1e-9),
    Reply("e", "m", "p", "t", {"a": [1, 2.5]}, ExecClass.SYNC, 0.0),
    Completion("e1", 1, 1, (), None, 2e-5),
    Completion("e1", 0, 0, (), "command:guard", 1e17),
    Completion("e2", 3, 2, (Failure("e2", "m", None, "c", "msg", None, 0.0),), None, 123.456789),
])
@pytest.mark.parametrize("session", [None, "room-1"])
def test_reply_and_done_frames_are_the_bytes_of_the_general_encoder(outcome: Any, session: str | None) -> None:
    # outcome_frame writes the common reply and done as text; the general path encodes a dict.
    from execapp.protocol import _outcome_frame

    assert outcome_frame(outcome, session) == _outcome_frame(outcome, session, None)
    frame = json.loads(outcome_frame(outcome, session))
    assert frame["id"] == outcome.event_id and frame.get("session") == session


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.floats(-1e12, 1e12, exclude_min=True, exclude_max=True),
                 st.floats(0, 10).map(lambda x: round(x, 4) + 0.0005), st.integers(0, 10 ** 9).map(float)))
def test_elapsed_ms_is_written_as_the_encoder_writes_its_rounded_value(ms: float) -> None:
    # outcome_frame writes elapsed_ms with "%.3f" and its trailing zeros cut (round() and repr()
    # cost ~3x as much): the same text as repr(round(ms, 3)), which the general path encodes.
    from execapp.protocol import _ms_text

    assert _ms_text(ms) == repr(round(ms, 3))


def test_data_that_is_not_json_is_sent_as_text_not_dropped() -> None:
    circular: dict = {}
    circular["self"] = circular
    frame = json.loads(outcome_frame(Reply("e", "m", None, None, circular, ExecClass.SYNC, 0.0)))
    assert frame["type"] == "reply" and isinstance(frame["data"], str)
    assert json.loads(outcome_frame(Reply("e", "m", None, None, {"when": object}, ExecClass.SYNC, 0.0)))["data"]


# -- one connection -------------------------------------------------------------------------------

async def _connection(engine: Engine, limits: Limits = LIMITS) -> tuple[Connection, list[dict]]:
    sent: list[dict] = []

    async def send(text: str) -> None:
        sent.append(json.loads(text))

    return Connection(engine, Admission(), limits, send), sent


async def _settle(conn: Connection, sent: list[dict], dones: int) -> None:
    assert await wait_until_async(lambda: sum(f["type"] == "done" for f in sent) >= dones
                                  and not conn.outbox.pending()), \
        f"only {sum(f['type'] == 'done' for f in sent)} of {dones} dones"


async def test_pooled_replies_always_precede_their_done_even_when_the_loop_completes_the_event() -> None:
    # A pooled handler replies from its thread while the loop is still dispatching the same
    # event's inline handler: the done is then produced on the loop, after the pooled reply
    # was queued from the other thread. Frame order must still be reply..., then done.
    engine = Engine(pool=ExecPool(8, 64, 0.5))
    gate = threading.Event()

    def pooled(ctx):  # type: ignore[no-untyped-def]
        ctx.reply("a")
        ctx.reply("b")

    def inline(ctx):  # type: ignore[no-untyped-def]
        gate.wait(0.0005)  # give the pooled thread time to emit while the loop still holds the run
        return "c"

    engine.add(engine.make_matcher("command", "x", pooled, name="pooled", priority=1))
    engine.add(engine.make_matcher("regex", "^/x", inline, name="inline"))
    engine.profile_for("inline").restore("demoted", [0.0001] * 32)
    conn, sent = await _connection(engine, Limits(1024, 1000))
    for i in range(300):
        await conn.receive(json.dumps({"id": f"e{i}", "type": "message", "text": "/x"}))
    await _settle(conn, sent, 300)
    per_event: dict[str, list[str]] = defaultdict(list)
    for frame in sent:
        per_event[frame["id"]].append(frame["type"])
    assert len(per_event) == 300
    for eid, kinds in per_event.items():
        assert kinds.count("done") == 1 and kinds[-1] == "done" and len(kinds) == 4, (eid, kinds)
    assert not conn.in_flight
    assert conn.worker.begun == conn.worker.ended == 300
    conn.close()
    engine.pool.drain(5)  # type: ignore[union-attr]


async def test_an_inline_event_s_frames_are_queued_before_its_receive_returns() -> None:
    # Outcomes produced on the loop go to the outbox at once (no call_soon hop per outcome).
    engine = Engine(pool_enabled=False)
    engine.add(engine.make_matcher("command", "ping", lambda ctx: "pong", name="ping"))
    gate = asyncio.Event()

    async def send(text: str) -> None:  # nothing is written until the gate opens
        await gate.wait()

    conn = Connection(engine, Admission(), LIMITS, send)
    await conn.receive(json.dumps({"id": "a", "type": "message", "text": "/ping"}))
    assert conn.outbox.frames == 2 and not conn.in_flight  # reply and done, no loop turn taken
    gate.set()
    assert await wait_until_async(lambda: conn.outbox.frames == 0)
    assert conn.worker.begun == conn.worker.ended == 1
    conn.close()


async def test_events_of_a_client_that_left_still_end_once_each_for_the_drain_count() -> None:
    engine = Engine(pool=ExecPool(8, 8, 0.5))
    release = threading.Event()
    engine.add(engine.make_matcher("command", "hold", lambda ctx: release.wait(5) and "held", name="hold"))
    engine.add(engine.make_matcher("command", "ping", lambda ctx: "pong", name="ping"))
    engine.profile_for("ping").restore("demoted", [0.0001] * 32)
    conn, sent = await _connection(engine)
    await conn.receive(json.dumps({"id": "h", "type": "message", "text": "/hold"}))
    await conn.receive(json.dumps({"id": "p", "type": "message", "text": "/ping"}))
    conn.close()  # before the writer ran: the ping's done is dropped unsent, the hold is still running
    assert await wait_until_async(lambda: conn.worker.ended >= 1)
    assert conn.worker.ended == 1, "the hold is still running: only the ping ended"
    release.set()
    assert await wait_until_async(lambda: conn.worker.ended >= 2)
    assert conn.worker.begun == conn.worker.ended == 2
    assert not conn.in_flight
    engine.pool.drain(5)  # type: ignore[union-attr]


async def test_draining_refuses_events_and_counts_none() -> None:
    engine = Engine(pool_enabled=False)
    conn, sent = await _connection(engine)
    conn.worker.draining = True
    await conn.receive(json.dumps({"id": "d", "type": "message", "text": "/ping"}))
    await conn.flush()
    assert [(f["code"], f["id"]) for f in sent] == [("draining", "d")]
    assert conn.worker.begun == 0 and not conn.in_flight
    conn.close()


async def test_in_flight_events_are_limited_and_freed_by_their_done() -> None:
    engine = Engine(pool=ExecPool(8, 8, 0.5))
    release = threading.Event()
    engine.add(engine.make_matcher("command", "hold", lambda ctx: release.wait(5) and "held", name="hold"))
    conn, sent = await _connection(engine)
    for i in range(4):
        await conn.receive(json.dumps({"id": f"h{i}", "type": "message", "text": "/hold"}))
    await conn.flush()
    assert [(f["id"], f["code"]) for f in sent] == [("h3", "rate_limited")]
    assert set(conn.in_flight) == {"h0", "h1", "h2"}
    await conn.receive(json.dumps({"id": "h0", "type": "tick"}))  # still over the limit
    release.set()
    await _settle(conn, sent, 3)
    await conn.receive(json.dumps({"id": "h0", "type": "message", "text": "/hold"}))  # an id may be reused after done
    await _settle(conn, sent, 4)
    assert sorted(f["id"] for f in sent if f["type"] == "done") == ["h0", "h0", "h1", "h2"]
    assert [f["code"] for f in sent if f["type"] == "error"] == ["rate_limited", "rate_limited"]
    conn.close()
    engine.pool.drain(5)  # type: ignore[union-attr]


async def test_an_id_already_in_flight_is_refused() -> None:
    engine = Engine(pool=ExecPool(2, 2, 0.5))
    release = threading.Event()
    engine.add(engine.make_matcher("command", "hold", lambda ctx: release.wait(5) and "held", name="hold"))
    conn, sent = await _connection(engine)
    await conn.receive(json.dumps({"id": "same", "type": "message", "text": "/hold"}))
    await conn.receive(json.dumps({"id": "same", "type": "message", "text": "/hold"}))
    await conn.flush()
    assert sent[0]["code"] == "bad_event" and "already in flight" in sent[0]["message"]
    release.set()
    await _settle(conn, sent, 1)
    conn.close()
    engine.pool.drain(5)  # type: ignore[union-attr]


async def test_sessions_per_connection_are_bounded() -> None:
    joined: list[str] = []

    async def join(session: str) -> None:
        joined.append(session)

    async def publish(session: str, frame: str) -> None:
        pass

    engine = Engine(pool_enabled=False)
    engine.add(engine.make_matcher("command", "ping", lambda ctx: "pong", name="ping"))
    sent: list[dict] = []

    async def send(text: str) -> None:
        sent.append(json.loads(text))

    conn = Connection(engine, Admission(), Limits(1024, 1000), send, publish=publish, join=join, owner="tenant:t")
    for i in range(MAX_SESSIONS_PER_CONNECTION + 1):
        await conn.receive(json.dumps({"id": f"e{i}", "type": "message", "text": "/ping", "session": f"s{i}"}))
        await conn.receive(json.dumps({"id": f"f{i}", "type": "message", "text": "/ping", "session": f"s{i}"}))
    await _settle(conn, sent, 2 * MAX_SESSIONS_PER_CONNECTION)
    assert joined == [group_name("tenant:t", f"s{i}") for i in range(MAX_SESSIONS_PER_CONNECTION)]
    errors = [f for f in sent if f["type"] == "error"]
    assert len(errors) == 2 and all(f["code"] == "bad_event" and "session" in f["message"] for f in errors)
    conn.close()


@pytest.mark.parametrize("eager", [False, True])
async def test_a_failing_write_does_not_stop_the_outbox(eager: bool) -> None:
    written: list[int] = []

    async def write(item: int) -> None:
        if item == 1:
            raise ConnectionError("socket gone")
        written.append(item)

    box = Outbox(write, "test", eager=eager)
    await asyncio.sleep(0)  # the writer parks (an eager outbox then writes at once)
    for i in range(3):
        box.push(i)
    await box.flush()
    assert await wait_until_async(lambda: written == [0, 2]), written
    box.close()
    box.push(9)
    assert box.pending() == 0


@pytest.mark.parametrize("eager", [False, True])
async def test_a_closed_outbox_still_runs_the_callbacks_of_what_it_drops(eager: bool) -> None:
    gate = asyncio.Event()
    ran: list[str] = []
    writing: list[str] = []

    async def write(item: str) -> None:
        writing.append(item)
        await gate.wait()

    box = Outbox(write, "test", eager=eager)
    await asyncio.sleep(0)
    box.push("a", lambda: ran.append("a"))  # being written when the box closes
    box.push("b", lambda: ran.append("b"))  # still queued
    assert await wait_until_async(lambda: writing == ["a"])
    box.close()
    box.push("c", lambda: ran.append("c"))  # after close
    assert await wait_until_async(lambda: sorted(ran) == ["a", "b", "c"]), ran


async def test_an_eager_outbox_writes_an_item_at_once_while_its_writer_is_idle() -> None:
    written: list[str] = []
    ran: list[str] = []

    async def write(item: str) -> None:
        written.append(item)

    box = Outbox(write, "test", eager=True)
    await asyncio.sleep(0)  # the writer parks
    box.push("a", lambda: ran.append("a"), 10)
    box.push("b", lambda: ran.append("b"), 10)
    # Written before push returned (no loop turn, no wake-up of the writer task), accounted for.
    assert written == ["a", "b"] and ran == ["a", "b"] and box.frames == box.bytes == 0
    box.close()


async def test_an_eager_outbox_writes_through_write_now_and_falls_back_to_write_when_it_declines() -> None:
    # The server protocol's own send (execapp.ws_flow send_text_now) takes a frame by a plain call:
    # no coroutine made and stepped per frame. One it declines (writes paused) goes through write.
    by_call: list[str] = []
    by_coroutine: list[str] = []
    ran: list[str] = []

    async def write(item: str) -> None:
        by_coroutine.append(item)

    counted: list[int] = []

    def write_now(item: str) -> bool:
        counted.append(box.frames)  # an item written at once is never counted in (and out again)
        if item == "gone":
            raise ConnectionError("socket gone")
        if item == "paused":
            return False
        by_call.append(item)
        return True

    box = Outbox(write, "test", eager=True, write_now=write_now)
    await asyncio.sleep(0)  # the writer parks
    for item in ("a", "gone", "paused", "b"):
        box.push(item, lambda item=item: ran.append(item), 10)
    assert by_call == ["a", "b"] and by_coroutine == ["paused"]
    assert ran == ["a", "gone", "paused", "b"] and box.frames == box.bytes == 0
    assert counted == [0, 0, 0, 0]
    box.close()


def _eager_schedule(ops: list[tuple[str, int]], sync: bool = False) -> None:
    """Run ``ops`` on an eager outbox whose writes wait when told to; check order and accounting.
    ``sync``: with a ``write_now`` that takes every item whose write would not wait."""

    async def main() -> None:
        gates: dict[int, asyncio.Event] = {}
        written: list[int] = []
        ran: list[int] = []

        async def write(item: int) -> None:
            gate = gates.get(item)
            if gate is not None:
                await gate.wait()
            written.append(item)

        def write_now(item: int) -> bool:
            gate = gates.get(item)
            if gate is not None and not gate.is_set():
                return False
            written.append(item)
            return True

        box = Outbox(write, "test", eager=True, write_now=write_now if sync else None)
        await asyncio.sleep(0)
        pushed: list[int] = []
        closed_at = None
        for op, arg in ops:
            if op == "push":
                n = len(pushed)
                if arg:  # this one's write waits until released
                    gates[n] = asyncio.Event()
                pushed.append(n)
                box.push(n, lambda n=n: ran.append(n), 1)  # type: ignore[misc]
            elif op == "release" and gates:
                next(iter(g for g in gates.values() if not g.is_set()), asyncio.Event()).set()
            elif op == "turn":
                for _ in range(arg):
                    await asyncio.sleep(0)
            elif op == "close" and closed_at is None:
                closed_at = len(pushed)
                box.close()
        for gate in gates.values():
            gate.set()
        if closed_at is None:
            assert await wait_until_async(lambda: len(ran) == len(pushed), 5), (ran, pushed)
            assert written == pushed  # every item, in the order pushed
        else:
            box.close()
            for _ in range(20):
                await asyncio.sleep(0)
            assert written == pushed[:len(written)]  # a prefix, in order: nothing after a gap
        assert sorted(ran) == pushed  # every callback once, written or dropped
        assert box.frames == 0 and box.bytes == 0
        box.close()

    asyncio.run(main())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("push"), st.integers(0, 1)), st.tuples(st.just("release"), st.just(0)),
                          st.tuples(st.just("turn"), st.integers(1, 3)), st.tuples(st.just("close"), st.just(0))),
                max_size=40))
def test_an_eager_outbox_keeps_order_and_runs_each_callback_once_whatever_waits(ops: list[tuple[str, int]]) -> None:
    _eager_schedule(ops)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("push"), st.integers(0, 1)), st.tuples(st.just("release"), st.just(0)),
                          st.tuples(st.just("turn"), st.integers(1, 3)), st.tuples(st.just("close"), st.just(0))),
                max_size=40))
def test_an_outbox_writing_through_write_now_keeps_order_and_runs_each_callback_once(
        ops: list[tuple[str, int]]) -> None:
    _eager_schedule(ops, sync=True)


def test_an_integer_past_python_s_digit_limit_is_bad_json_with_a_fix_the_client_can_make() -> None:
    # Python's own message said "use sys.set_int_max_str_digits() to increase the limit": a call on
    # the server, not anything the client sending the frame can do.
    import sys

    with pytest.raises(ProtocolError) as refused:
        parse_frame('{"id":"a","type":"t","data":{"n":' + "9" * 5000 + "}}", None, Limits())
    assert refused.value.code == "bad_json"
    assert f"more than {sys.get_int_max_str_digits()} digits" in refused.value.message
    assert "send it as a string" in refused.value.message and "set_int_max_str_digits" not in refused.value.message
