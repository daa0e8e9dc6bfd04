"""Hostile WebSocket clients: each case is a way one client could stall a worker, grow its memory,
starve other connections or lose an event's terminal frame, and the bound that stops it.

Cases that could hang if their bound broke run under a hard deadline (``asyncio.wait_for``, or a
daemon thread joined with a timeout), so a regression fails instead of hanging the suite.
"""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from execapp import resend
from execapp.connection import Connection
from execapp.engine import Engine
from execapp.outbox import OutboxLimits
from execapp.protocol import MAX_SESSIONS_PER_CONNECTION, Limits, ProtocolError, parse_request
from tests.conftest import wait_until_async

from .ws_fixtures import Admission, Client, channel_layer, ws_worker  # noqa: F401

#: A liveness bound (never a timing assertion): work that must happen, given ample time.
HARD = 30.0
N = 64 * 1024 - 200


def _engine() -> Engine:
    """An engine whose handlers all run inline: /ping, and /multi N (N replies)."""
    engine = Engine(pool_enabled=False)
    engine.add(engine.make_matcher("command", "ping", lambda ctx: "pong", plugin="test"))

    def multi(ctx: Any) -> None:
        for i in range(int(ctx.args or 3)):
            ctx.reply(f"part {i}")

    engine.add(engine.make_matcher("command", "multi", multi, plugin="test"))
    return engine


# -- frames: every hostile frame costs one error frame (or runs), parsed in bounded time ----------

HOSTILE_FRAMES: list[tuple[str, str, str | None]] = [
    ("empty", "", "bad_json"),
    ("whitespace only", " " * N, "bad_json"),
    ("top-level array", "[" + ",".join("0" for _ in range(N // 2)) + "]", "bad_event"),
    ("huge id", json.dumps({"id": "i" * N, "text": "x"}), "bad_event"),
    ("huge type", json.dumps({"type": "t" * N, "text": "x"}), "bad_event"),
    ("huge session", json.dumps({"session": "s" * N, "text": "x"}), "bad_event"),
    ("huge unknown key", json.dumps({"k" * N: 1}), "bad_event"),
    ("many unknown keys", "{" + ",".join('"k%d":0' % i for i in range(N // 10)) + "}", "bad_event"),
    ("over the limit in characters", json.dumps({"text": "x" * (N + 400)}), "too_large"),
    ("over the limit in UTF-8 bytes", json.dumps({"text": "\u00e9" * (N // 2 + 400)}, ensure_ascii=False),
     "too_large"),
    ("a lone surrogate after 5000 valid pairs", '{"id":"a","text":"' + "\\ud83d\\ude00" * 5000 + '\\ud800"}',
     "bad_event"),
    ("a raw lone surrogate", '{"id":"a","text":"\ud800"}', "bad_event"),
    ("an integer of 60000 digits", '{"id":"a","data":{"a":' + "9" * 60000 + "}}", "bad_json"),
    ("a float past a double", '{"id":"a","data":{"a":1e999}}', "bad_json"),
    ("NaN", '{"id":"a","data":{"a":NaN}}', "bad_json"),
    ("one level too deep", '{"type":"t","data":' + '{"a":' * 32 + "0" + "}" * 32 + "}", "too_deep"),
    ("40000 openers", "[" * 40000, "too_deep"),
    ("a deep comb", '{"data":{"a":' + "[[]," * 5000 + "0" + "]" * 5000 + "}}", "too_deep"),
    ("many keys in data (runs)", '{"id":"a","type":"t","data":{' + ",".join('"k%d":0' % i for i in range(N // 10))
     + "}}", None),
    ("sawtooth brackets (runs)", '{"type":"t","data":{"a":[' + ",".join("[[[[[[[0]]]]]]]" for _ in range(N // 16))
     + "]}}", None),
    ("31 levels, repeated (runs)", '{"type":"t","data":{' + ",".join('"k%d":' % i + "[[" * 14 + "]]" * 14
                                                         for i in range(N // 70)) + "}}", None),
    ("NUL characters (runs)", json.dumps({"id": "a", "text": "\x00" * 1000}), None),
]


def test_each_hostile_frame_is_refused_with_its_code_or_accepted_within_the_limits() -> None:
    limits = Limits()
    outcomes: dict[str, str | None] = {}

    def parse_all() -> None:  # in a daemon thread: a frame that never finishes fails, not hangs
        for name, text, _ in HOSTILE_FRAMES:
            for _ in range(20):  # a tight loop of the same frame
                try:
                    parse_request(text, None, limits)
                    outcomes[name] = None
                except ProtocolError as exc:
                    outcomes[name] = exc.code
                    assert exc.message and len(exc.message) < 600, (name, exc.message[:200])

    thread = threading.Thread(target=parse_all, daemon=True)
    thread.start()
    thread.join(HARD)
    assert not thread.is_alive(), f"parsing stalled after {list(outcomes)[-1:]}"
    assert outcomes == {name: code for name, _, code in HOSTILE_FRAMES}


def _long_path_over_many_values(key_chars: int, depth: int, values: int) -> str:
    """A frame whose lone surrogate sits after ``values`` numbers, under ``depth`` keys of ``key_chars``."""
    inner = "[" + ",".join("0" for _ in range(values)) + ',"\\ud800"]'
    for _ in range(depth):
        inner = '{"%s":%s}' % ("K" * key_chars, inner)
    return '{"id":"u","type":"t","data":' + inner + "}"


def test_finding_a_lone_surrogate_costs_memory_linear_in_the_frame() -> None:
    # Naming where the surrogate is once wrote out the path of every value on the way: 16,000
    # numbers under a 32 KB path of keys were 500 MB of strings (0.3 s on the loop) for one frame.
    import tracemalloc

    frame = _long_path_over_many_values(1100, 29, 16000)
    assert len(frame) <= Limits().max_frame_bytes
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as err:
            parse_request(frame, None, Limits())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.code == "bad_event" and err.value.event_id == "u"
    assert err.value.message.startswith("data.KKKK") and "not valid Unicode" in err.value.message
    assert peak < 100 * len(frame), f"{peak} bytes at the peak for a {len(frame)}-character frame"


@pytest.mark.parametrize("frame, where", [
    ('{"type":"t","data":{"a":[0,{"b":[1,2,"\\udc00"]},3]}}', "data.a[1].b[2]"),
    ('{"type":"t","data":{"a":{"b":{"\\ud800":0}}}}', "data.a.b.<key>"),
])
def test_a_lone_surrogate_is_named_by_its_path(frame: str, where: str) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_request(frame, None, Limits())
    assert err.value.message.startswith(where + ": not valid Unicode"), err.value.message


@pytest.mark.parametrize("data", [b"", b"x" * 1000, b"x" * (70 * 1024)])
def test_binary_frames_are_refused_whatever_their_size(data: bytes) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_request(None, data, Limits())
    assert err.value.code == ("too_large" if len(data) > Limits().max_frame_bytes else "bad_event")


@pytest.mark.parametrize("limit", [1, 5, 32, 100])
def test_the_depth_check_is_exact_around_the_limit_for_runs_and_combs(limit: int) -> None:
    from execapp.protocol import json_depth

    for depth in (limit - 1, limit, limit + 1):
        if depth < 1:
            continue
        run = ("[" * depth + "]" * depth).encode()
        comb = ("[[]," * (depth - 1) + "[" + "]" * depth).encode()  # no run of openers longer than 2
        assert json_depth(run, limit) == depth, (limit, depth)
        assert json_depth(comb, limit) == depth, (limit, depth)
        assert json_depth(b",".join([run] * 500), limit) == depth  # many of them side by side


# -- the handshake's ?session=: bounded error frames ----------------------------------------------

@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_a_url_naming_thousands_of_sessions_costs_a_few_error_frames(channel_layer: str,
                                                                          ws_worker: Any) -> None:
    # One handshake's URL (some KB) must not turn into thousands of error frames queued for the
    # client past its outbox's limits (a 30x amplification of the bytes it sent).
    names = [f"s{i}" for i in range(1000)] + ["bad name"] * 50 + [f"bad*{i}" for i in range(500)]
    async with Client("/ws/events/?session=" + ",".join(names).replace(" ", "%20")) as c:
        await c.send({"id": "p", "text": "/ping"})
        frames = await asyncio.wait_for(c.until_done("p"), HARD)
        errors = [f for f in frames if f["type"] == "error"]
        assert 1 <= len(errors) <= 4, f"{len(errors)} error frames for one URL"
        text = " ".join(e["message"] for e in errors)
        assert f"{MAX_SESSIONS_PER_CONNECTION}" in text and "more" in text, text


def slow_records(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Resend claims that always run the event, and records that are written only once the
    returned gate is set (or HARD seconds pass)."""
    gate = threading.Event()
    monkeypatch.setattr(resend, "claim", lambda owner, eid, worker: (resend.Claim(resend.NEW), []))

    def complete(owner: str, eid: str, worker: str, elapsed: float) -> str:
        gate.wait(HARD)
        return "uid"

    monkeypatch.setattr(resend, "complete", complete)
    return gate


# -- resend: records still being written count as in flight --------------------------------------

async def test_resend_events_waiting_for_their_record_count_against_the_in_flight_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The record of a resend event is written (history flush + read back) after its handlers ran
    # and before its done. A client sending fast resend events while records are slow must not
    # pile up record tasks (and worker admissions) past its in-flight limit.
    gate = slow_records(monkeypatch)
    sent: list[dict] = []

    async def send(text: str) -> None:
        sent.append(json.loads(text))

    admission = Admission()
    conn = Connection(_engine(), admission, Limits(4096, 5), send, owner="tenant:t")
    try:
        # One deadline for all: without the bound, pending records hold every thread of the
        # default executor and the next claim never starts.
        frames = [{"id": f"r{i}", "text": "/ping", "resend": True} for i in range(50)]
        await asyncio.wait_for(_feed(conn, frames), 10)
        await asyncio.sleep(0.05)
        assert len(conn._recording) <= 5, f"{len(conn._recording)} records pending with an in-flight limit of 5"
        assert admission.begun - admission.ended <= 5
        refused = [f for f in sent if f["type"] == "error"]
        assert refused and all(f["code"] == "rate_limited" for f in refused)
    finally:
        gate.set()
    assert await wait_until_async(lambda: admission.ended == admission.begun, HARD)
    dones = [f["id"] for f in sent if f["type"] == "done"]
    assert len(dones) == len(set(dones)) == admission.begun and all(f["recorded"] for f in sent
                                                                   if f["type"] == "done")
    conn.close()


def test_one_owner_s_many_resend_ids_do_not_evict_another_owner_s_records(monkeypatch: pytest.MonkeyPatch) -> None:
    # The in-process ledger keeps at most LOCAL_MAX_KEYS records; without a per-owner share, one
    # tenant sending many distinct ids evicts every other tenant's: their resends then run again.
    monkeypatch.setattr(resend, "LOCAL_MAX_KEYS", 100)
    monkeypatch.setattr(resend, "LOCAL_MAX_KEYS_PER_OWNER", 10, raising=False)
    ledger = resend.LocalLedger()
    assert ledger.claim("tenant:victim", "order-1", "w", 60).state == resend.NEW
    ledger.done("tenant:victim", "order-1", "uid-1", 600)
    for i in range(1000):
        ledger.claim("tenant:hostile", f"id-{i}", "w", 60)
    assert ledger.claim("tenant:victim", "order-1", "w", 60).state == resend.DONE
    assert len(ledger._items) <= 100
    # The hostile owner's own oldest went, its newest are kept.
    assert ledger.claim("tenant:hostile", "id-999", "w", 60).state == resend.RUNNING
    assert ledger.claim("tenant:hostile", "id-0", "w", 60).state == resend.NEW


@pytest.mark.redis
def test_one_owner_s_flood_of_resend_ids_is_capped_in_the_redis_ledger(redis_url: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The Redis ledger had no share per owner: one tenant's distinct ids each left a record for
    # the retention (600 s) in the Redis every worker and the channel layer share.
    monkeypatch.setattr(resend, "REDIS_MAX_KEYS_PER_OWNER", 10)
    ledger = resend.RedisLedger(redis_url)
    assert ledger.claim("tenant:victim", "order-1", "w", 60).state == resend.NEW
    ledger.done("tenant:victim", "order-1", "uid-1", 600)
    for i in range(200):
        ledger.claim("tenant:hostile", f"id-{i}", "w", 60)
    from execapp.history_store import pair_key

    records = list(ledger.client.scan_iter(ledger.prefix + pair_key("tenant:hostile", "") + "*"))
    assert len(records) == 10  # the hostile owner's newest 10
    assert ledger.claim("tenant:victim", "order-1", "w", 60).state == resend.DONE
    # The hostile owner's own oldest went, its newest are kept.
    assert ledger.claim("tenant:hostile", "id-199", "w", 60).state == resend.RUNNING
    assert ledger.claim("tenant:hostile", "id-0", "w", 60).state == resend.NEW


async def test_resends_of_one_id_from_many_connections_run_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 connections of one owner resend the same id 10 times each while it runs: one run, every
    # other copy gets resend_in_progress (with retry_after_ms) or, on its own connection,
    # bad_event (already in flight there); every accepted copy ends in exactly one done.
    ledger = resend.LocalLedger()
    monkeypatch.setattr(resend, "_local", ledger)
    monkeypatch.setattr(resend.history, "current", lambda: object())

    def complete(owner: str, eid: str, worker: str, elapsed: float) -> str:
        resend.renewer.drop(ledger, worker, owner, eid)  # what resend.complete does, minus the history
        ledger.done(owner, eid, "u", 600)
        return "u"

    monkeypatch.setattr(resend, "complete", complete)
    release = threading.Event()
    runs: list[str] = []
    engine = Engine(max_workers=2)

    def hold(ctx: Any) -> str:
        runs.append(ctx.event.id)
        release.wait(HARD)
        return "held"

    engine.add(engine.make_matcher("command", "hold", hold, plugin="test"))
    sent: list[list[dict]] = [[] for _ in range(10)]
    admission = Admission()
    conns = []
    for i in range(10):
        async def send(text: str, out: list[dict] = sent[i]) -> None:
            out.append(json.loads(text))

        conns.append(Connection(engine, admission, Limits(), send, owner="tenant:t"))
    try:
        frame = json.dumps({"id": "dup", "text": "/hold", "resend": True})
        await asyncio.wait_for(asyncio.gather(*(_feed_raw(c, [frame] * 10) for c in conns)), HARD)
        assert await wait_until_async(lambda: len(runs) == 1, HARD)
    finally:
        release.set()
    assert await wait_until_async(lambda: admission.ended == admission.begun, HARD)
    frames = [f for out in sent for f in out]
    assert runs == ["dup"] and sum(f["type"] == "done" for f in frames) == 1
    errors = [f for f in frames if f["type"] == "error"]
    assert len(errors) == 99 and {f["code"] for f in errors} <= {"resend_in_progress", "bad_event"}
    assert all(f["retry_after_ms"] > 0 for f in errors if f["code"] == "resend_in_progress")
    for c in conns:
        c.close()
    engine.shutdown(HARD)


async def _feed_raw(conn: Connection, frames: list[str]) -> None:
    for frame in frames:
        await conn.receive(frame)


# -- exactly one terminal per accepted event, whatever the client does ------------------------------

async def test_a_client_that_disconnects_mid_event_ends_every_admitted_event_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = slow_records(monkeypatch)
    engine = Engine(max_workers=4)
    release = threading.Event()
    engine.add(engine.make_matcher("command", "hold", lambda ctx: release.wait(HARD) and "held", plugin="test"))
    engine.add(engine.make_matcher("command", "ping", lambda ctx: "pong", plugin="test"))
    stuck = asyncio.Event()

    async def send(text: str) -> None:  # the client never reads: every write waits
        await stuck.wait()

    admission = Admission()
    conn = Connection(engine, admission, Limits(4096, 50), send, owner="tenant:t",
                      outbox_limits=OutboxLimits(max_frames=4, max_bytes=1_000_000))
    frames = [{"id": "h1", "text": "/hold"}, {"id": "h2", "text": "/hold"},
              {"id": "r1", "text": "/ping", "resend": True}, {"id": "p1", "text": "/ping"},
              {"id": "p2", "text": "/ping"}]
    reading = asyncio.ensure_future(_feed(conn, frames))
    await asyncio.wait({reading}, timeout=0.5)  # it may block on the full outbox: that is fine
    conn.close()  # the client left mid-event
    release.set()
    gate.set()
    await asyncio.wait_for(reading, HARD)  # a close releases a receive held by backpressure
    assert await wait_until_async(lambda: admission.ended == admission.begun, HARD), (admission.begun,
                                                                                       admission.ended)
    await asyncio.sleep(0.1)
    assert admission.ended == admission.begun >= 3
    engine.shutdown(HARD)


async def _feed(conn: Connection, frames: list[dict]) -> None:
    for frame in frames:
        await conn.receive(json.dumps(frame))


# -- sessions: a member that never reads, fan-out --------------------------------------------------

async def test_a_session_member_that_never_reads_holds_a_bounded_outbox() -> None:
    stuck = asyncio.Event()

    async def send(text: str) -> None:
        await stuck.wait()

    async def publish(group: str, text: str) -> None:
        pass

    async def join(group: str) -> None:
        pass

    member = Connection(_engine(), Admission(), Limits(), send, publish=publish, join=join, owner="tenant:t",
                        outbox_limits=OutboxLimits(max_frames=50, max_bytes=100_000))
    frame = json.dumps({"type": "reply", "id": "x", "text": "y" * 500, "session": "s"})
    for _ in range(10_000):  # 10000 members' frames fanned out to it
        member.session_frame(frame, "s")
    assert member.outbox.frames <= 50 and member.outbox.bytes <= 100_000 + len(frame)
    assert member.outbox.dropped_total >= 10_000 - 50
    member.close()
    stuck.set()


async def test_a_client_that_never_reads_many_reply_events_stops_being_read() -> None:
    # /multi 50 from a client that never reads: each event queues 51 frames; the client is read
    # on only while its outbox is under its limits, so memory stays bounded by them plus one
    # frame's worth of events in flight.
    stuck = asyncio.Event()

    async def send(text: str) -> None:
        await stuck.wait()

    conn = Connection(_engine(), Admission(), Limits(4096, 100), send,
                      outbox_limits=OutboxLimits(max_frames=100, max_bytes=1_000_000))
    feeding = asyncio.ensure_future(_feed(conn, [{"id": f"m{i}", "text": "/multi 50"} for i in range(1000)]))
    await asyncio.wait({feeding}, timeout=0.5)
    assert not feeding.done(), "a client that never reads was read to the end"
    assert conn.outbox.frames <= 100 + 51
    conn.close()
    await asyncio.wait_for(feeding, HARD)


# -- a real server: clients that vanish mid-event, partial handshakes -------------------------------

def _healthz(url: str) -> dict:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 503 still has the body
        return json.loads(exc.read())


@pytest.mark.e2e
async def test_clients_that_vanish_mid_event_leave_no_event_open_on_a_real_server(
        sqlite_env: dict[str, str], asgi_server_factory: Any) -> None:
    from websockets.asyncio.client import connect

    from tests.conftest import manage, wait_until

    env = {**sqlite_env, "DJANGO_SETTINGS_MODULE": "tests.execapp.e2e_settings", "REDIS_URL": "",
           "EXECAPP_TEST_SETTINGS": json.dumps({"HISTORY_MAX_EVENTS": 1000})}
    token = manage("create_token", "hostile", env=env).stdout.strip().splitlines()[-1]
    server = asgi_server_factory(env)
    url = f"{server.ws_url}/ws/events/"
    headers = {"Authorization": f"Bearer {token}"}

    async def vanish(n: int, read: bool) -> None:
        ws = await connect(url, additional_headers=headers)
        for i in range(n):  # pooled, inline and resend events, a session too
            frame = {"id": f"e{i}", "text": ("/slow 300", "/ping", "/multi 20")[i % 3], "session": "s"}
            if i % 5 == 0:
                frame["resend"] = True
            await ws.send(json.dumps(frame))
        if read:
            await ws.recv()
        ws.transport.abort()  # gone without a close frame, events in flight

    await asyncio.wait_for(asyncio.gather(*(vanish(30, i % 2 == 0) for i in range(6))), HARD)
    assert wait_until(lambda: _healthz(server.url).get("events_in_flight") == 0, HARD, interval=0.1), \
        _healthz(server.url)
    async with connect(url, additional_headers=headers) as ws:  # the worker still serves
        await ws.send(json.dumps({"id": "after", "text": "/ping"}))
        frames = [json.loads(await asyncio.wait_for(ws.recv(), HARD)) for _ in range(2)]
        assert [f["type"] for f in frames] == ["reply", "done"]
    assert "Traceback" not in server.log(), server.log()
