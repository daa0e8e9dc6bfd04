"""Property-based fuzzing of the /ws/events/ protocol (hypothesis): in-process over
``connection.Connection`` with a real engine, then a shorter run over a real server.

Frames: well-formed events whose every field takes every JSON type, arbitrary JSON and text,
sizes around the frame limit (multi-byte characters included), nesting around the depth limit,
lone surrogates (raw and escaped, in values and keys), binary frames, duplicate ids.

Invariants: nothing raises out of ``receive``; every accepted event gets exactly one ``done``,
after all of its other frames; every refused frame gets exactly one ``error`` with a code of
ERROR_CODES and never a ``done``; no ``internal_error``; every frame the server writes is UTF-8
and strict JSON; the connection stays usable. Over the real server also: no HTTP 500, no
traceback in its log, and only a frame over uvicorn's ``--ws-max-size`` closes (1009).

Examples are derandomized (the same frames every run: no flakes); EXECAPP_FUZZ_EXAMPLES=2000
runs a longer search.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from execapp.codes import ERROR_CODES
from execapp.connection import Connection
from execapp.engine import Engine, ExecPool
from execapp.protocol import Limits
from execapp.serve import ws_max_size
from tests.conftest import AsgiServer, ServerProcess, manage, wait_until_async

from .ws_fixtures import Admission

EXAMPLES = int(os.environ.get("EXECAPP_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
#: Small limits, so sizes and depths around them are cheap to reach.
LIMITS = Limits(max_frame_bytes=2048, max_in_flight=6, max_depth=8)
#: Codes of a refused frame (no done follows); handler codes arrive with a matcher and a done.
REFUSALS = {"bad_json", "bad_event", "too_large", "too_deep", "rate_limited", "draining"}
IDS = ["a", "b", "c"]  # a small pool: the same id is often sent again while in flight

# -- frames ---------------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2 ** 80, max_value=2 ** 80)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
commands = st.sampled_from(["/ping", "/echo hi", "/hold", "/boom", "/nothing", "", "/"]) | st.builds(
    "/echo {}".format, st.text(max_size=20))


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: mostly a valid one, else any JSON type."""
    return st.one_of(valid, valid, values)


@st.composite
def events(draw: Any) -> dict:
    event: dict[str, Any] = {}
    if draw(st.booleans()):
        event["id"] = draw(field(st.sampled_from(IDS) | st.text(min_size=1, max_size=70)))
    if draw(st.integers(0, 3)):
        event["type"] = draw(field(st.sampled_from(["message", "message", "tick", "other.type"])))
    if draw(st.integers(0, 3)):
        event["text"] = draw(field(commands))
    if draw(st.booleans()):
        event["data"] = draw(field(st.dictionaries(st.text(max_size=6), values, max_size=3)))
    if not draw(st.integers(0, 4)):
        event["session"] = draw(field(st.sampled_from(["s1", "room-2"]) | st.text(max_size=70)))
    if not draw(st.integers(0, 9)):
        event[draw(st.text(max_size=8))] = draw(values)
    return event


def dumps(obj: Any, ascii_only: bool) -> str:
    return json.dumps(obj, ensure_ascii=ascii_only)


#: A frame: (text or bytes, the refusal code it must get, or None when any outcome is fine).
Frame = tuple[Any, "str | None"]


@st.composite
def sized(draw: Any) -> Frame:
    """A message frame within a few bytes of the size limit, in one- or two-byte characters."""
    target = LIMITS.max_frame_bytes + draw(st.integers(-3, 3))
    char = draw(st.sampled_from(["x", "é", "€"]))
    base = len(dumps({"type": "message", "text": "/echo "}, False).encode())
    pad = char * ((target - base) // len(char.encode()))
    text = dumps({"type": "message", "text": "/echo " + pad}, False)
    text += " " * (target - len(text.encode()))  # whitespace after the object tops it up exactly
    return text, ("too_large" if len(text.encode()) > LIMITS.max_frame_bytes else None)


@st.composite
def nested(draw: Any) -> Frame:
    """Arrays/objects nested around the depth limit (the event object is level 1, data level 2).

    Built as text: json.dumps itself recurses, and a 1100-level frame is one of the cases."""
    levels = draw(st.integers(LIMITS.max_depth - 4, LIMITS.max_depth + 1) | st.sampled_from([60, 400, 1100]))
    kinds = draw(st.lists(st.booleans(), min_size=levels, max_size=levels))
    inner = "".join("[" if k else '{"k": ' for k in kinds) + json.dumps(draw(scalars)) + "".join(
        "]" if k else "}" for k in reversed(kinds))
    if draw(st.booleans()):  # the whole frame one deep array: not an event, or too deep
        depth = levels + 1
        text = f"[{inner}, 1]"
        expect = "too_deep" if depth > LIMITS.max_depth else "bad_event"
    else:
        depth = levels + 2
        text = '{"type": "tick", "data": {"x": %s}}' % inner
        expect = "too_deep" if depth > LIMITS.max_depth else None
    if len(text.encode()) > LIMITS.max_frame_bytes:
        expect = "too_large"
    return text, expect


@st.composite
def surrogates(draw: Any) -> Frame:
    """An otherwise valid event with a lone surrogate in one of its strings or keys."""
    lone = draw(st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]))
    spot = draw(st.sampled_from(["text", "id", "key", "data", "session"]))
    event: dict[str, Any] = {"type": "message", "text": "/echo ok", "id": "s" + str(draw(st.integers(0, 9)))}
    if spot == "text":
        event["text"] = "/echo " + lone
    elif spot == "id":
        event["id"] = "x" + lone
    elif spot == "key":
        event["data"] = {"k" + lone: 1}
    elif spot == "data":
        event["data"] = {"a": [1, {"b": lone + "tail"}]}
    else:
        event["session"] = "s" + lone
    escaped = draw(st.booleans())  # as a JSON escape (what a real client can send) or a raw character
    return dumps(event, escaped), "bad_event"


binary = st.binary(max_size=16).map(lambda b: (b, "bad_event")) | st.integers(-2, 2).map(
    lambda d: (b"\x00" * (LIMITS.max_frame_bytes + d), "too_large" if d > 0 else "bad_event"))
frames = st.one_of(
    events().flatmap(lambda e: st.booleans().map(lambda a: (dumps(e, a), None))),
    events().map(lambda e: (dumps(e, True), None)),
    values.map(lambda v: (dumps(v, False), None)),
    st.text(max_size=40).map(lambda t: (t, None)),
    st.sampled_from(["", "{", "}", "[]", "null", '{"type": NaN}', '{"text": "/ping"} x', "\ud800"]).map(
        lambda t: (t, None)),
    sized(), nested(), surrogates(), binary,
)

# -- the in-process run ---------------------------------------------------------------------------


def _engine() -> Engine:
    engine = Engine(pool=ExecPool(4, 64, 0.5))
    engine.add(engine.make_matcher("command", "ping", lambda ctx: "pong", name="ping"))
    engine.profile_for("ping").restore("demoted", [0.0001] * 32)  # inline on the loop
    engine.add(engine.make_matcher("command", "echo", lambda ctx: ctx.args, name="echo"))
    engine.add(engine.make_matcher("command", "hold", lambda ctx: time.sleep(0.002) or "held", name="hold"))
    engine.add(engine.make_matcher("command", "boom", lambda ctx: 1 / 0, name="boom"))
    engine.add(engine.make_matcher("event", "tick", lambda ctx: {"seen": ctx.event.data}, name="tick"))
    return engine


def _strict(text: str) -> dict:
    """A frame as the client's side parses it: UTF-8 and strict JSON, or the test fails."""
    text.encode()

    def no_constant(name: str) -> None:
        raise AssertionError(f"{name} in a frame: {text[:200]}")

    return json.loads(text, parse_constant=no_constant)


def _client_id(payload: Any) -> str | None:
    try:
        eid = json.loads(payload).get("id")
    except Exception:
        return None
    return eid if isinstance(eid, str) else None


async def _run(batch: list[Frame]) -> None:
    engine = _engine()
    sent: list[str] = []

    async def send(text: str) -> None:
        sent.append(text)

    admission = Admission()
    conn = Connection(engine, admission, LIMITS, send)
    accepted: list[bool] = []
    try:
        for payload, _ in batch:
            before = admission.begun  # every accepted event was admitted once (begin_event)
            if isinstance(payload, bytes):
                await conn.receive(None, payload)
            else:
                await conn.receive(payload, None)
            accepted.append(admission.begun == before + 1)
        assert await wait_until_async(lambda: not conn.in_flight and not conn.outbox.pending()), \
            f"{len(conn.in_flight)} events never got their done"
        await asyncio.sleep(0)  # a yield, not a wait: the writer's last callbacks run
    finally:
        conn.close()
        engine.pool.drain(5)  # type: ignore[union-attr]
    frames_out = [_strict(t) for t in sent]
    codes = [f["code"] for f in frames_out if f["type"] == "error"]
    assert "internal_error" not in codes and set(codes) <= set(ERROR_CODES), codes
    refusals = [f for f in frames_out if f["type"] == "error" and "matcher" not in f]
    assert all(f["code"] in REFUSALS for f in refusals), refusals
    # One refusal per refused frame, in frame order, with the code the frame's kind calls for.
    refused = [expect for (payload, expect), ok in zip(batch, accepted) if not ok]
    assert len(refusals) == len(refused), (len(refusals), len(refused))
    for frame, expect in zip(refusals, refused):
        assert expect is None or frame["code"] == expect, (frame, expect)
    for (payload, expect), ok in zip(batch, accepted):
        assert not (ok and expect), f"accepted a frame that must get {expect}: {str(payload)[:100]}"
    # Exactly one done per accepted event, and nothing of an event after its done.
    dones = Counter(f["id"] for f in frames_out if f["type"] == "done")
    named = Counter(eid for (payload, _), ok in zip(batch, accepted) if ok and (eid := _client_id(payload)))
    assert sum(dones.values()) == sum(accepted) == conn.worker.begun == conn.worker.ended
    assert all(dones[eid] == n for eid, n in named.items()), (dones, named)
    open_events = Counter(dones)  # dones still to come, per id (an id may be used again after its done)
    for f in frames_out:
        if f["type"] == "done":
            open_events[f["id"]] -= 1
        elif f["type"] == "reply" or "matcher" in f:
            assert open_events[f["id"]] > 0, f"a frame of {f['id']!r} after its last done"


@FUZZ
@given(st.lists(frames, min_size=1, max_size=12))
def test_fuzzed_frames_over_a_connection_keep_every_invariant(batch: list[Frame]) -> None:
    asyncio.run(_run(batch))


@settings(FUZZ, max_examples=max(30, EXAMPLES // 3))
@given(st.lists(st.sampled_from(IDS), min_size=2, max_size=20))
def test_duplicate_ids_in_flight_are_refused_and_each_accepted_one_gets_one_done(ids: list[str]) -> None:
    asyncio.run(_run([(json.dumps({"id": eid, "text": "/hold"}), None) for eid in ids]))


# -- over a real server ---------------------------------------------------------------------------

#: The app's own limits, and the server's hard frame limit as execapp.serve derives it (uvicorn --ws-max-size).
SERVER_LIMITS = {"MAX_FRAME_BYTES": 4096, "MAX_FRAME_DEPTH": 8, "MAX_IN_FLIGHT_PER_CONNECTION": 50}
WS_MAX_SIZE = ws_max_size(SERVER_LIMITS["MAX_FRAME_BYTES"])


class FuzzServer(ServerProcess):
    """uvicorn serving config.asgi with a small --ws-max-size, so frames over it are cheap to send."""

    wait_ready = AsgiServer.wait_ready

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(["uvicorn", "config.asgi:application", "--host", "127.0.0.1", "--ws-max-size",
                          str(WS_MAX_SIZE), "--ws-per-message-deflate", "false", "--lifespan", "off",
                          "--log-level", "warning"], env, "fuzz")
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws/events/"
        self.wait_ready()


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FuzzServer, str]]:
    env = {"DATABASE_URL": f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'db.sqlite3'}", "REDIS_URL": "",
           "DJANGO_SETTINGS_MODULE": "tests.execapp.e2e_settings", "EXECAPP_TEST_SETTINGS": json.dumps(SERVER_LIMITS)}
    # One Django start for both (each manage.py command costs one).
    result = manage("shell", "-c", "from django.core.management import call_command\n"
                    "call_command('migrate', verbosity=0)\n"
                    "from execapp.models import ApiToken\nprint(ApiToken.issue('fuzz')[1])", env=env)
    assert result.returncode == 0, result.stderr
    server = FuzzServer(env)
    yield server, result.stdout.split()[-1]
    server.stop()
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and " 500" not in log and "ERROR" not in log, log


@pytest.fixture(scope="module")
def real_ws(real: tuple[FuzzServer, str]) -> Iterator[Any]:
    from websockets.sync.client import connect

    server, token = real
    with connect(server.ws_url, additional_headers={"Authorization": f"Bearer {token}"},
                 max_size=None) as ws:
        yield ws


def _recv(ws: Any) -> dict:
    return _strict(ws.recv(10))


_real_counter = iter(range(10 ** 9))
real_frames = st.one_of(
    events().map(lambda e: (dumps(e, True), None)),  # escapes only: any str is sendable UTF-8 then
    values.map(lambda v: (dumps(v, True), None)),
    st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40).map(lambda t: (t, None)),
    st.binary(max_size=16).map(lambda b: (b, "bad_event")),
    st.integers(-2, 2).map(lambda d: ('{"text": "/echo %s"}' % ("x" * (4096 - 18 + d)),
                                      "too_large" if d > 0 else None)),
    nested(), surrogates().filter(lambda f: f[0].isascii()),
)


@pytest.mark.e2e
@settings(max_examples=max(40, EXAMPLES // 4), deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(real_frames, min_size=1, max_size=10))
def test_fuzzed_frames_over_a_real_server_get_one_answer_each_and_the_connection_stays(
        real_ws: Any, batch: list[Frame]) -> None:
    # Pipelined, then a marker: every frame is answered by exactly one refusal or one done
    # (server-assigned ids are unknown here, so the count is the invariant), the marker's included.
    marker = f"marker-{next(_real_counter)}"
    for payload, _ in batch:
        real_ws.send(payload)
    real_ws.send(json.dumps({"id": marker, "text": "/ping"}))
    answers, seen_marker = 0, False
    while answers < len(batch) + 1 or not seen_marker:
        frame = _recv(real_ws)
        assert frame.get("code") != "internal_error", frame
        if frame["type"] == "done" or (frame["type"] == "error" and "matcher" not in frame):
            assert frame["type"] == "done" or frame["code"] in REFUSALS, frame
            answers += 1
            seen_marker = seen_marker or frame["id"] == marker and frame["type"] == "done"
        assert answers <= len(batch) + 1, "more answers than frames"


@pytest.mark.e2e
def test_the_real_server_refuses_over_its_own_limit_and_closes_only_over_uvicorns(
        real: tuple[FuzzServer, str], real_ws: Any) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    server, token = real
    # The frames: 1,100 nested lists in 2.2 KB (was RecursionError and 1006), a lone
    # surrogate for a handler (was handler_error), 900-deep data for a pooled handler (was a
    # silent done): each refused at the edge with its code, and the connection carries on.
    for frame, code in (("[" * 1100 + "]" * 1100, "too_deep"),
                        ('{"id": "u", "text": "/echo \\ud800"}', "bad_event"),
                        ('{"id": "d", "type": "tick", "data": {"x": %s}}' % ("[" * 900 + "]" * 900), "too_deep")):
        real_ws.send(frame)
        assert _recv(real_ws)["code"] == code
    # Over the app's limit (almost twice), under uvicorn's: too_large, and the connection carries on.
    real_ws.send('{"text": "/echo %s"}' % ("x" * (WS_MAX_SIZE - 200)))
    assert _recv(real_ws)["code"] == "too_large"
    real_ws.send('{"id": "after", "text": "/ping"}')
    assert [_recv(real_ws)["type"] for _ in range(2)] == ["reply", "done"]
    # Nothing stray is left over from the fuzz run.
    with pytest.raises(TimeoutError):
        real_ws.recv(0.3)
    with connect(server.ws_url, additional_headers={"Authorization": f"Bearer {token}"}, max_size=None) as ws:
        ws.send("x" * (WS_MAX_SIZE + 1))
        with pytest.raises(ConnectionClosed) as info:
            ws.recv(10)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009


@pytest.mark.e2e
@settings(max_examples=20, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.text(max_size=30), st.text(max_size=10))
def test_fuzzed_handshake_queries_never_get_an_http_500(real: tuple[FuzzServer, str], session: str,
                                                        other: str) -> None:
    from urllib.parse import urlencode

    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    server, token = real
    query = urlencode({"session": session, other or "x": session}, encoding="utf-8", errors="surrogatepass")
    try:
        with connect(f"{server.ws_url}?{query}", additional_headers={"Authorization": f"Bearer {token}"}) as ws:
            ws.send('{"id": "q", "text": "/ping"}')
            while (frame := _recv(ws))["type"] != "done":
                assert frame["type"] in ("reply", "error") and frame.get("code") != "internal_error", frame
    except InvalidStatus as exc:  # a token in the query (other == "token") may refuse: 403, never 500
        assert exc.response.status_code == 403, exc
