"""The /ws/events/ consumer through Channels' WebsocketCommunicator, over both channel layers."""
from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
from collections import Counter
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from execapp.routing import websocket_application
from execapp.ws_flow import CONNECTION_LOST

from . import ws_handlers
from .ws_fixtures import Client, authed, channel_layer, demote, held_token_lookups, wait_for, ws_worker  # noqa: F401

pytestmark = pytest.mark.usefixtures("channel_layer", "ws_worker")


def msg(text: str, eid: str | None = None, **extra: Any) -> dict:
    frame: dict[str, Any] = {"type": "message", "text": text, **extra}
    if eid is not None:
        frame["id"] = eid
    return frame


# -- replies and done -----------------------------------------------------------------------------

async def test_ping_gets_a_pong_reply_then_one_done() -> None:
    async with Client() as c:
        await c.send(msg("/ping", "p1"))
        reply, done = await c.recv(), await c.recv()
        assert reply["type"] == "reply" and reply["id"] == "p1" and reply["text"] == "pong"
        assert reply["matcher"] == "command:ping" and reply["plugin"] == "test" and reply["exec"] in ("sync", "pool")
        assert done == {"type": "done", "id": "p1", "matched": 1, "replies": 1, "errors": 0, "blocked_by": None,
                        "elapsed_ms": done["elapsed_ms"]}
        assert await c.nothing()


async def test_an_event_without_id_gets_a_server_id_on_every_frame() -> None:
    async with Client() as c:
        await c.send(msg("/ping"))
        reply, done = await c.recv(), await c.recv()
        assert reply["id"] and reply["id"] == done["id"]


async def test_an_unmatched_event_still_gets_its_done() -> None:
    async with Client() as c:
        await c.send({"id": "u", "type": "nobody.listens", "data": {}})
        done = await c.recv()
        del done["elapsed_ms"]
        assert done == {"type": "done", "id": "u", "matched": 0, "replies": 0, "errors": 0, "blocked_by": None}


@pytest.mark.parametrize("exec_class", ["sync", "pool"])
async def test_done_comes_after_every_reply_of_its_event(ws_worker: Any, exec_class: str) -> None:
    if exec_class == "sync":
        demote(ws_worker, "command:multi")
    async with Client() as c:
        for i in range(20):
            await c.send(msg("/multi 4", f"m{i}"))
        frames = [await c.recv() for _ in range(20 * 5)]
    seen: dict[str, list[str]] = {}
    for f in frames:
        seen.setdefault(f["id"], []).append(f["type"])
        assert f.get("exec", exec_class) == exec_class
    assert len(seen) == 20
    assert all(kinds == ["reply"] * 4 + ["done"] for kinds in seen.values()), seen


async def test_a_fast_event_is_done_while_a_slow_handler_of_another_connection_runs() -> None:
    async with Client() as slow, Client() as fast:
        await slow.send(msg("/slow 3000", "s"))
        await wait_for(ws_handlers.slow_running.is_set)
        await fast.send(msg("/ping", "f"))
        frames = await fast.until_done("f")
        assert [f["type"] for f in frames] == ["reply", "done"]
        # Had /slow run on the event loop, nothing could have answered until it finished.
        assert ws_handlers.slow_running.is_set()
        assert await slow.nothing(0.05)


async def test_a_slow_event_does_not_hold_back_later_events_of_the_same_connection() -> None:
    async with Client() as c:
        await c.send(msg("/slow 3000", "s"))
        await wait_for(ws_handlers.slow_running.is_set)
        await c.send(msg("/ping", "f"))
        frames = await c.until_done("f")
        assert [f["id"] for f in frames] == ["f", "f"]
        assert ws_handlers.slow_running.is_set()


# -- every error code -----------------------------------------------------------------------------

@pytest.mark.parametrize("frame, code, eid", [
    ("{not json", "bad_json", None),
    ('{"id": "b1", "type": "message", "text": 3}', "bad_event", "b1"),
    ('{"id": "b2", "type": "message", "text": "/ping", "extra": 1}', "bad_event", "b2"),
    (b"\x00\x01binary", "bad_event", None),
])
async def test_bad_input_gets_an_error_and_the_connection_stays_usable(frame: Any, code: str,
                                                                       eid: str | None) -> None:
    async with Client() as c, Client() as other:
        await c.send(frame)
        error = await c.recv()
        assert (error["type"], error["code"], error["id"]) == ("error", code, eid)
        assert error["message"]
        await c.send(msg("/ping", "after"))
        assert [f["type"] for f in await c.until_done("after")] == ["reply", "done"]
        assert await other.nothing(0.05)


async def test_too_large_frames_are_refused(settings: Any) -> None:
    settings.EXECAPP = {**settings.EXECAPP, "MAX_FRAME_BYTES": 1024}
    async with Client() as c:
        await c.send(msg("/echo " + "x" * 1100, "big"))
        error = await c.recv()
        assert (error["code"], error["id"]) == ("too_large", None) and "1024" in error["message"]
        await c.send(msg("/echo " + "x" * 900, "ok"))
        assert (await c.until_done("ok"))[0]["text"] == "x" * 900


async def test_default_frame_limit_is_64_kib() -> None:
    async with Client() as c:
        await c.send(msg("/echo " + "x" * (64 * 1024), "big"))
        assert (await c.recv())["code"] == "too_large"
        await c.send(msg("/echo " + "x" * (60 * 1024), "ok"))
        assert (await c.recv())["type"] == "reply"


async def test_rate_limited_over_the_in_flight_limit(settings: Any) -> None:
    settings.EXECAPP = {**settings.EXECAPP, "MAX_IN_FLIGHT_PER_CONNECTION": 2}
    async with Client() as c, Client() as other:
        await c.send(msg("/slow 300", "a"))
        await c.send(msg("/slow 300", "b"))
        await c.send(msg("/ping", "c"))
        error = await c.recv()
        assert (error["code"], error["id"]) == ("rate_limited", "c")
        await other.send(msg("/ping", "o"))  # the limit is per connection
        assert (await other.until_done("o"))[-1]["type"] == "done"
        dones = set()
        while dones != {"a", "b"}:
            frame = await c.recv()
            if frame["type"] == "done":
                dones.add(frame["id"])
        await c.send(msg("/ping", "c"))
        assert [f["type"] for f in await c.until_done("c")] == ["reply", "done"]


@pytest.mark.parametrize("command, code", [("/boom", "handler_error"), ("/late", "timeout")])
@pytest.mark.parametrize("exec_class", ["sync", "pool"])
async def test_a_failed_handler_is_an_error_then_its_done(ws_worker: Any, command: str, code: str,
                                                         exec_class: str) -> None:
    if exec_class == "sync":
        demote(ws_worker, f"command:{command[1:]}")
    async with Client() as c:
        await c.send(msg(command, "x"))
        error, done = await c.recv(), await c.recv()
        assert (error["type"], error["id"], error["code"], error["matcher"], error["exec"]) == (
            "error", "x", code, f"command:{command[1:]}", exec_class)
        assert (done["type"], done["id"], done["errors"], done["replies"]) == ("done", "x", 1, 0)


@pytest.mark.parametrize("ws_worker", [
    {"POOL_MAX_WORKERS": 2, "POOL_QUEUE_SIZE": 2, "OVERFLOW_POLICY": "reject"},
    {"POOL_MAX_WORKERS": 2, "POOL_QUEUE_SIZE": 2, "OVERFLOW_POLICY": "wait", "OVERFLOW_WAIT_SECONDS": 0.2},
], indirect=True, ids=["reject", "wait"])
async def test_overloaded_when_the_pool_stays_full(ws_worker: Any) -> None:
    hold = threading.Event()
    ws_worker.engine.add(ws_worker.engine.make_matcher("command", "hold", lambda ctx: hold.wait(5) and "held",
                                                       plugin="test"))
    try:
        async with Client() as c:
            for i in range(4):
                await c.send(msg("/hold", f"h{i}"))
            await wait_for(lambda: ws_worker.pool.busy() >= 4)
            await c.send(msg("/ping", "refused"))
            error, done = await c.recv(), await c.recv()
            assert (error["code"], error["id"], error["matcher"]) == ("overloaded", "refused", "command:ping")
            assert (done["type"], done["id"], done["errors"]) == ("done", "refused", 1)
            hold.set()
            for i in range(4):
                await c.until_done(f"h{i}") if i == 3 else None
    finally:
        hold.set()


@pytest.mark.parametrize("ws_worker", [
    {"POOL_MAX_WORKERS": 2, "POOL_QUEUE_SIZE": 2, "OVERFLOW_POLICY": "wait", "OVERFLOW_WAIT_SECONDS": 5.0},
], indirect=True)
async def test_a_full_pool_holds_back_only_the_connection_that_waits_for_a_slot(ws_worker: Any) -> None:
    hold = threading.Event()
    ws_worker.engine.add(ws_worker.engine.make_matcher("command", "hold", lambda ctx: hold.wait(5) and "held",
                                                       plugin="test"))
    demote(ws_worker, "command:ping")
    try:
        async with Client() as waiting, Client() as other:
            for i in range(5):  # 2 running + 2 queued; the 5th waits for a slot in receive
                await waiting.send(msg("/hold", f"h{i}"))
            await waiting.send(msg("/ping", "behind"))
            await wait_for(lambda: ws_worker.pool.busy() >= 4)
            await other.send(msg("/ping", "free"))
            assert [f["type"] for f in await other.until_done("free")] == ["reply", "done"]
            assert await waiting.nothing(0.05)  # its /ping is behind the /hold waiting for a slot
            hold.set()
            frames = await waiting.until_done("behind")
            assert [f["id"] for f in frames if f["type"] == "done"][-1] == "behind"
            for i in range(5):
                if not any(f["id"] == f"h{i}" and f["type"] == "done" for f in frames):
                    frames += await waiting.until_done(f"h{i}")
            assert all(f["type"] != "error" for f in frames)
    finally:
        hold.set()


@pytest.mark.parametrize("ws_worker", [
    {"POOL_MAX_WORKERS": 1, "POOL_QUEUE_SIZE": 0, "OVERFLOW_POLICY": "wait", "OVERFLOW_WAIT_SECONDS": 30.0},
], indirect=True)
async def test_a_client_that_leaves_while_its_frame_waits_for_pool_slots_abandons_the_rest(ws_worker: Any) -> None:
    # The consumer reads the next ASGI message (its disconnect too, queued behind the frames the
    # client sent before it left) only once a frame is done: a client that left while its frame's
    # handlers waited for pool slots went unseen until each had a slot or its refusal, and 30
    # clients that sent a frame matching 100 handlers and left held a worker's pool full for
    # minutes. The server's CONNECTION_LOST (execapp.ws_flow) now abandons what was not submitted.
    hold = threading.Event()
    ran: list[str] = []

    def held(ctx: Any) -> str:
        hold.wait(10)
        ran.append(ctx.matcher.name)
        return "held"

    engine = ws_worker.engine
    for i in range(3):
        engine.add(engine.make_matcher("command", "fan", held, name=f"fan{i}", plugin="test"))
    lost = asyncio.Event()
    try:
        async with Client(app=authed({"extensions": {CONNECTION_LOST: lost}})) as c:
            await c.send(msg("/fan", "f"))
            await wait_for(lambda: engine.waiting == 1)  # fan0 holds the one thread, fan1 waits for it
            lost.set()  # the socket is gone (its disconnect is still behind in the ASGI queue)
            await wait_for(lambda: engine.waiting == 0)
            hold.set()
            await wait_for(lambda: ws_worker.pool.busy() == 0)
            assert ran == ["fan0"], "the handlers not submitted when the client left never ran"
    finally:
        hold.set()


async def test_draining_refuses_new_events_and_finishes_running_ones(ws_worker: Any) -> None:
    async with Client() as c:
        await c.send(msg("/slow 200", "running"))
        await wait_for(ws_handlers.slow_running.is_set)
        ws_worker.set_draining(True)
        await c.send(msg("/ping", "new"))
        error = await c.recv()
        assert (error["type"], error["code"], error["id"]) == ("error", "draining", "new")
        assert [f["type"] for f in await c.until_done("running")] == ["reply", "done"]
        ws_worker.set_draining(False)
        await c.send(msg("/ping", "again"))
        assert (await c.until_done("again"))[-1]["type"] == "done"


# -- session groups -------------------------------------------------------------------------------

async def test_session_members_receive_the_session_replies_and_the_sender_gets_its_own_once() -> None:
    async with Client() as sender, Client("/ws/events/?session=room-1") as listener, Client() as outsider:
        await sender.send(msg("/multi 2", "e1", session="room-1"))
        own = await sender.until_done("e1")
        assert [f["type"] for f in own] == ["reply", "reply", "done"]
        assert all(f["session"] == "room-1" for f in own)
        heard = await listener.until_done("e1")
        assert [(f["type"], f.get("text")) for f in heard] == [("reply", "part 0"), ("reply", "part 1"),
                                                             ("done", None)]
        assert await sender.nothing(0.1)  # no echo of its own frames through the group
        assert await outsider.nothing(0.05)


async def test_a_client_joins_a_session_by_sending_in_it() -> None:
    async with Client() as a, Client() as b:
        await b.send(msg("/ping", "b1", session="room-2"))
        await b.until_done("b1")
        await a.send(msg("/echo hi", "a1", session="room-2"))
        await a.until_done("a1")
        heard = await b.until_done("a1")
        assert [f["type"] for f in heard] == ["reply", "done"] and heard[0]["text"] == "hi"


async def test_a_bad_session_in_the_url_is_reported_not_fatal() -> None:
    async with Client("/ws/events/?session=bad%20name") as c:
        error = await c.recv()
        assert (error["code"], error["id"]) == ("bad_event", None) and "session" in error["message"]
        await c.send(msg("/ping", "p"))
        assert (await c.until_done("p"))[-1]["type"] == "done"


# -- volume ---------------------------------------------------------------------------------------

async def test_exactly_one_done_for_each_of_1000_events_from_10_connections(ws_worker: Any) -> None:
    rng = random.Random(4)
    clients = [Client() for _ in range(10)]
    for c in clients:
        await c.__aenter__()
    try:
        sent: dict[int, list[str]] = {i: [] for i in range(10)}

        async def drive(i: int) -> Counter:
            c = clients[i]
            dones: Counter = Counter()
            for n in range(100):
                eid = f"c{i}-{n}"
                text = "/slow 20" if rng.random() < 0.1 else rng.choice(["/ping", "/multi 2", "/boom"])
                sent[i].append(eid)
                await c.send(msg(text, eid))
            while sum(dones.values()) < 100:
                frame = await c.recv(10)
                if frame["type"] == "done":
                    dones[frame["id"]] += 1
            assert await c.nothing(0.05)
            return dones

        results = await asyncio.gather(*(drive(i) for i in range(10)))
        for i, dones in enumerate(results):
            assert set(dones) == set(sent[i]) and set(dones.values()) == {1}
        assert ws_worker.events_in_flight == 0 and ws_worker.events_finished == 1000
    finally:
        for c in clients:
            await c.__aexit__(None, None, None)


# -- authentication at the handshake ----------------------------------------------------------------

@pytest.fixture
def token(transactional_db: Any) -> str:
    from execapp.models import ApiToken

    return ApiToken.issue("consumer-test")[1]


async def _handshake(path: str, headers: list | None = None) -> tuple[bool, Any]:
    comm = WebsocketCommunicator(websocket_application, path, headers=headers)
    ok, detail = await comm.connect(timeout=5)
    if ok:
        await comm.send_to(text_data=json.dumps(msg("/ping", "auth")))
        assert json.loads(await comm.receive_from(5))["text"] == "pong"
        await comm.disconnect()
    return ok, detail


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_a_token_in_the_query_or_the_header_is_let_in(token: str) -> None:
    assert (await _handshake(f"/ws/events/?token={token}"))[0]
    assert (await _handshake("/ws/events/", [(b"authorization", f"Bearer {token}".encode())]))[0]


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_last_used_time_is_recorded(token: str) -> None:
    from execapp.models import ApiToken

    await _handshake(f"/ws/events/?token={token}")
    assert (await sync_to_async(ApiToken.objects.get)(name="consumer-test")).last_used_at is not None


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
@pytest.mark.parametrize("path, headers", [
    ("/ws/events/", None),
    ("/ws/events/?token=", None),
    ("/ws/events/?token=not-a-token", None),
    ("/ws/events/", [(b"authorization", b"Bearer not-a-token")]),
])
async def test_a_missing_or_unknown_token_is_refused(token: str, path: str, headers: list | None) -> None:
    assert await _handshake(path, headers) == (False, 1000)


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_a_client_retrying_bad_tokens_does_not_flood_the_log(token: str, caplog: Any) -> None:
    from execapp import auth

    auth._rare._seen.clear()  # a refusal logged by an earlier test would hide the first one here
    with caplog.at_level(logging.INFO, logger="execapp.auth"):
        for n in range(20):
            assert (await _handshake(f"/ws/events/?token=bad-{n}"))[0] is False
    refused = [r for r in caplog.records if "refused WebSocket" in r.getMessage()]
    assert len(refused) == 1, [r.getMessage() for r in refused]  # once per code per minute


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_a_network_that_failed_its_burst_is_closed_unjudged_until_it_earned_a_try_back(
        token: str, settings: Any, monkeypatch: Any) -> None:
    from execapp import auth_throttle
    from execapp.metrics import EVENTS

    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "AUTH_FAILURES_BURST": 3,
                        "AUTH_FAILURES_PER_MINUTE": 60.0}
    now = [1000.0]
    throttle = auth_throttle.current()
    monkeypatch.setattr(throttle, "_clock", lambda: now[0])

    def from_network(host: str) -> Any:
        async def app(scope: dict, receive: Any, send: Any) -> None:
            return await websocket_application({**scope, "client": (host, 40000)}, receive, send)
        return app

    async def handshake(host: str, raw: str) -> dict:
        comm = WebsocketCommunicator(from_network(host), f"/ws/events/?token={raw}")
        await comm.send_input({"type": "websocket.connect"})
        first = await comm.receive_output(5)
        if first["type"] == "websocket.accept":
            if not await comm.receive_nothing(0.2):  # accepted only to carry a close's code and reason
                return await comm.receive_output(5)
            await comm.disconnect()
        return first

    counted = {o: EVENTS.labels(o)._value.get() for o in ("unauthorized", "auth_throttled")}
    for n in range(3):  # judged and refused: HTTP 403 (a close before accept)
        assert await handshake("203.0.113.9", f"guess-{n}") == {"type": "websocket.close"}
    closed = await handshake("203.0.113.9", token)  # even a good token is not looked up now
    assert closed["code"] == 1013 and "retry in 1 s" in closed["reason"], closed
    assert (await handshake("198.51.100.7", token))["type"] == "websocket.accept"  # another network
    now[0] += 1.0  # one failure earned back: judged again
    assert (await handshake("203.0.113.9", token))["type"] == "websocket.accept"
    assert {o: EVENTS.labels(o)._value.get() - counted[o] for o in counted} == {"unauthorized": 3,
                                                                               "auth_throttled": 1}


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_past_max_token_lookups_a_handshake_is_closed_unjudged_until_one_ends(
        token: str, settings: Any, monkeypatch: Any) -> None:
    from execapp import auth

    slow_db, lookups = held_token_lookups(settings, monkeypatch)  # a database that answers when told
    waiting = [WebsocketCommunicator(websocket_application, f"/ws/events/?token={raw}") for raw in ("a", "b")]
    for comm in waiting:
        await comm.send_input({"type": "websocket.connect"})
    await wait_for(lambda: len(lookups) == 2)
    third = WebsocketCommunicator(websocket_application, f"/ws/events/?token={token}")
    await third.send_input({"type": "websocket.connect"})
    assert (await third.receive_output(5))["type"] == "websocket.accept"
    closed = await third.receive_output(5)
    assert closed["code"] == 1013 and "too many credentials" in closed["reason"] and lookups == ["a", "b"]
    # A session cookie is a lookup too (the session, then its user): refused the same way.
    cookie = WebsocketCommunicator(websocket_application, "/ws/events/", headers=[(b"cookie", b"sessionid=x")])
    await cookie.send_input({"type": "websocket.connect"})
    assert (await cookie.receive_output(5))["type"] == "websocket.accept"
    assert (await cookie.receive_output(5))["code"] == 1013
    slow_db.set()  # the two lookups end (bad tokens: refused); a handshake is judged again
    for comm in waiting:
        assert (await comm.receive_output(5)) == {"type": "websocket.close"}
    assert (await _handshake(f"/ws/events/?token={token}"))[0]
    assert (await _handshake("/ws/events/", [(b"cookie", b"sessionid=x")])) == (False, 1000)  # judged: 403
    assert auth._lookups == [0]  # every lookup, token or session, counted out


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_an_owner_over_its_connection_quota_is_closed_with_1008(token: str, settings: Any) -> None:
    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "MAX_CONNECTIONS_PER_OWNER": 2}
    path = f"/ws/events/?token={token}"
    first, second, third = (WebsocketCommunicator(websocket_application, path) for _ in range(3))
    assert (await first.connect(timeout=5))[0] and (await second.connect(timeout=5))[0]
    await third.connect(timeout=5)
    closed = await third.receive_output(5)
    assert closed["type"] == "websocket.close" and closed["code"] == 1008, closed
    assert "MAX_CONNECTIONS_PER_OWNER" in closed.get("reason", ""), closed
    await first.disconnect()  # its place is free again
    again = WebsocketCommunicator(websocket_application, path)
    assert (await again.connect(timeout=5))[0]
    await again.send_to(text_data=json.dumps(msg("/ping", "quota")))
    assert json.loads(await again.receive_from(5))["text"] == "pong"
    for comm in (second, again):
        await comm.disconnect()


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_a_revoked_token_is_refused(token: str) -> None:
    from execapp.models import ApiToken

    await sync_to_async(lambda: ApiToken.objects.get(name="consumer-test").revoke())()
    assert (await _handshake(f"/ws/events/?token={token}"))[0] is False


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_an_unknown_path_is_refused(token: str) -> None:
    assert (await _handshake(f"/ws/nothing/?token={token}"))[0] is False


def _session_cookie(is_staff: bool) -> str:
    from django.contrib.auth import get_user_model
    from django.test import Client as HttpClient

    user = get_user_model().objects.create_user(f"u{is_staff}", password="pw-123456", is_staff=is_staff)
    http = HttpClient()
    http.force_login(user)
    return http.cookies["sessionid"].value


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
@pytest.mark.parametrize("is_staff, host, origin, allowed", [
    (True, b"127.0.0.1:8000", b"http://127.0.0.1:8000", True),
    (True, b"localhost", b"http://localhost", True),
    (True, b"127.0.0.1:8000", b"https://evil.example", False),
    (True, b"127.0.0.1:8000", None, False),
    (False, b"127.0.0.1:8000", b"http://127.0.0.1:8000", False),
])
async def test_logged_in_staff_may_connect_with_their_session_from_this_site(
        transactional_db: Any, is_staff: bool, host: bytes, origin: bytes | None, allowed: bool) -> None:
    # The Origin is compared with the request's own scheme://Host (tests/execapp/test_origin.py).
    cookie = await sync_to_async(_session_cookie)(is_staff)
    headers = [(b"host", host), (b"cookie", f"sessionid={cookie}".encode())]
    if origin is not None:
        headers.append((b"origin", origin))
    assert (await _handshake("/ws/events/", headers))[0] is allowed


# -- metrics --------------------------------------------------------------------------------------

async def test_every_terminal_message_is_counted_in_events_total_by_outcome() -> None:
    from execapp.metrics import EVENTS
    from execapp.metrics_updater import refresh_local

    refresh_local()  # what earlier tests tallied

    def count(outcome: str) -> float:
        return EVENTS.labels(outcome)._value.get()

    before = {o: count(o) for o in ("ok", "bad_json", "bad_event")}
    async with Client() as c:
        await c.send(msg("/ping", "m1"))
        await c.until_done("m1")
        await c.send("{not json")
        await c.recv()
        await c.send('{"id": "m2", "type": "message", "text": 3}')
        await c.recv()
    # A done is tallied on the loop and reaches the counter at the next tick or scrape.
    assert count("ok") == before["ok"]
    refresh_local()
    assert {o: count(o) - before[o] for o in before} == {"ok": 1, "bad_json": 1, "bad_event": 1}


async def test_a_client_s_frame_reaches_its_connection_without_a_coroutine_of_the_consumer_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14: a frame is one coroutine (Connection.receive), not ``dispatch`` around it, and a
    frame out is the server's send itself, not a coroutine of the consumer's around it."""
    import inspect

    from execapp.consumers import EventConsumer

    routed: list[str] = []
    dispatch = EventConsumer.dispatch

    async def counting(self: EventConsumer, message: dict) -> None:
        routed.append(message["type"])
        await dispatch(self, message)

    monkeypatch.setattr(EventConsumer, "dispatch", counting)
    async with Client() as c:
        for n in range(3):
            await c.send(msg("/ping", f"p{n}"))
            assert [f["type"] for f in await c.until_done(f"p{n}")] == ["reply", "done"]
    assert "websocket.receive" not in routed and "websocket.connect" in routed
    assert not inspect.iscoroutinefunction(EventConsumer._send_text)


def test_the_consumer_writes_its_frames_through_the_server_protocol_s_own_send_now_when_it_has_one() -> None:
    # Under execapp.serve the ASGI send is execapp.ws_flow's protocol's: an event's frames then skip
    # its coroutine (Connection's outbox, write_now). Any other send (daphne, a middleware's, a test
    # communicator's) keeps the coroutine path.
    from execapp import ws_flow
    from execapp.consumers import _send_now_of

    protocol = object.__new__(ws_flow.BackpressuredWebSocketProtocol)
    assert _send_now_of(protocol.send) == protocol.send_text_now

    async def send(message: dict) -> None:
        pass

    assert _send_now_of(send) is None
    assert _send_now_of(protocol.send_text_now) is None

