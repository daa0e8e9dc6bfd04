"""Resilience in one process (issue 13): bounded outboxes and `lagged`, backpressure on a client
that does not read, safe resend answered from the record, channel-layer memberships put back
after a Redis restart (our own redis-server, killed and restarted), control commands that say
`control_unavailable`. The same cases against real worker processes: test_resilience_e2e.py.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from io import StringIO
from typing import Any, Callable, Iterator

import pytest
from django.core.management import CommandError, call_command

from execapp import history_store, resend
from execapp import worker as worker_module
from execapp.connection import Connection
from execapp.engine import Engine
from execapp.layer_watch import LayerWatch
from execapp.outbox import Outbox, OutboxLimits
from execapp.protocol import Limits, ProtocolError, parse_request
from tests.conftest import free_port, wait_until, wait_until_async

from .ws_fixtures import Admission

WAIT = 10.0


# -- our own Redis server ------------------------------------------------------------------------

class RedisServer:
    """``redis-server --port <free> --save "" --appendonly no``: ours to kill and restart (a restart
    loses everything, as a Redis without persistence does). Nobody else uses it."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            from tests.conftest import require_service

            require_service("redis-server (the binary)", "redis://127.0.0.1:1")  # fails under CI, skips elsewhere
        self.binary = binary or "redis-server"
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start it and return once it answers PING."""
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(self.answers, WAIT, interval=0.01), f"redis-server on port {self.port} did not start"

    def answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        """SIGKILL: connections end at once, everything it held is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_timeout=2)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.kill()


@pytest.fixture
def stopped_redis(redis_server: RedisServer) -> Iterator[RedisServer]:
    """Our redis-server, SIGSTOPped: connections are accepted (the kernel's backlog), nothing answers."""
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        yield redis_server
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)


def redis_layer_settings(url: str, prefix: str = "resilience") -> dict[str, Any]:
    """CHANNEL_LAYERS for channels_redis on ``url``, as config/settings.py builds them."""
    return {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                        "CONFIG": {"hosts": [{"address": url, "socket_timeout": 15, "socket_connect_timeout": 2}],
                                   "capacity": 1500, "expiry": 30, "prefix": prefix}}}


# -- bounded outboxes ------------------------------------------------------------------------------

async def test_session_frames_past_the_limits_are_dropped_and_one_lagged_frame_says_how_many() -> None:
    gate = asyncio.Event()
    written: list[Any] = []

    async def write(item: Any) -> None:  # a client that stopped reading: every send waits
        await gate.wait()
        written.append(item)

    box = Outbox(write, "test", limits=OutboxLimits(max_frames=10, max_bytes=100_000),
                 lagged=lambda missed: (("lagged", dict(missed)), 10))
    box.push("own-0", size=100)  # the writer takes it and waits in the send
    assert await wait_until_async(lambda: box.pending() == 0)
    queued = [box.offer(f"s{i}", "room", 100) for i in range(40)]
    assert queued == [True] * 9 + [False] * 31  # 1 being written + 9 queued = the 10-frame limit
    for i in range(1, 4):  # the client's own frames are never dropped, even past the limit
        box.push(f"own-{i}", size=100)
    assert box.full and box.frames == 13 and box.missed == {"room": 31}
    assert box.offer("s-more", "other", 100) is False and box.missed == {"room": 31, "other": 1}

    gate.set()
    assert await wait_until_async(lambda: box.pending() == 0 and box.frames == 0)
    lagged = [item for item in written if isinstance(item, tuple)]
    assert lagged == [("lagged", {"room": 31, "other": 1})]  # exactly one, with every missed frame
    assert [w for w in written if isinstance(w, str) and w.startswith("own")] == ["own-0", "own-1", "own-2", "own-3"]
    assert written.index(lagged[0]) > written.index("s8")  # after what was queued before the lag
    # Caught up: frames are taken again, and the lag counter starts over.
    assert box.offer("after", "room", 100) is True and box.missed == {}
    assert await wait_until_async(lambda: written[-1] == "after")
    assert box.dropped_total == 32 and box.lagged_total == 1
    box.close()


async def test_a_single_frame_larger_than_the_byte_limit_still_goes_out() -> None:
    written: list[Any] = []

    async def write(item: Any) -> None:
        written.append(item)

    box = Outbox(write, "test", limits=OutboxLimits(max_frames=10, max_bytes=1000))
    assert box.offer("huge", "room", 5000) is True  # an empty outbox takes any one frame
    assert await wait_until_async(lambda: written == ["huge"])
    box.close()


def _big(ctx: Any) -> str:
    return "x" * 2000


async def test_a_client_that_does_not_read_its_replies_stops_being_read_until_its_outbox_drains() -> None:
    engine = Engine(pool_enabled=False)  # every handler inline: replies are queued as frames arrive
    engine.add(engine.make_matcher("command", "big", _big, plugin="test"))
    gate = asyncio.Event()
    sent: list[dict] = []

    async def send(text: str) -> None:  # the client stopped reading: its socket's sends wait
        await gate.wait()
        sent.append(json.loads(text))

    conn = Connection(engine, Admission(), Limits(4096, 1000), send,
                      outbox_limits=OutboxLimits(max_frames=10, max_bytes=1_000_000))
    received = 0
    blocked: asyncio.Task | None = None
    for i in range(20):
        task = asyncio.ensure_future(conn.receive(json.dumps({"id": f"e{i}", "text": "/big"})))
        # An absence watched for a while: a receive that does not return within 0.2 s is the
        # backpressure (nothing else can hold it: the handler is inline and never waits).
        done, _ = await asyncio.wait({task}, timeout=0.2)
        if not done:
            blocked = task
            break
        received += 1
    assert blocked is not None, "every frame was read although nothing was written to the client"
    assert received == 5 and conn.outbox.frames >= 10  # 5 events x (reply + done) filled the 10-frame outbox
    gate.set()  # the client reads again
    await asyncio.wait_for(blocked, WAIT)
    assert await wait_until_async(lambda: sum(f["type"] == "done" for f in sent) == 6)
    assert [f["type"] for f in sent].count("reply") == 6
    conn.close()


async def test_a_channel_layer_slower_than_the_sender_holds_the_sender_back_and_drops_nothing() -> None:
    engine = Engine(pool_enabled=False)
    engine.add(engine.make_matcher("command", "big", _big, plugin="test"))
    gate = asyncio.Event()
    published: list[str] = []

    async def send(text: str) -> None:  # the client itself reads everything
        pass

    async def publish(group: str, text: str) -> None:  # the layer is slow: each publish waits
        await gate.wait()
        published.append(json.loads(text)["id"])

    async def join(group: str) -> None:
        pass

    conn = Connection(engine, Admission(), Limits(4096, 1000), send, publish=publish, join=join, owner="tenant:t",
                      outbox_limits=OutboxLimits(max_frames=10, max_bytes=1_000_000))
    blocked = None
    for i in range(20):
        task = asyncio.ensure_future(conn.receive(json.dumps({"id": f"e{i}", "text": "/big", "session": "s"})))
        done, _ = await asyncio.wait({task}, timeout=0.2)  # an absence watched for a while, as above
        if not done:
            blocked = task
            break
    assert blocked is not None and i == 5, "the sender was read on although its session frames could not go out"
    gate.set()
    await asyncio.wait_for(blocked, WAIT)
    assert await wait_until_async(lambda: len(published) == 12)  # 6 events x (reply + done): none dropped
    assert conn.group_outbox is not None and conn.group_outbox.dropped_total == 0
    conn.close()


# -- safe resend -----------------------------------------------------------------------------------

def test_resend_needs_a_boolean_and_the_client_s_own_id() -> None:
    limits = Limits()
    event, flag = parse_request('{"id": "a", "text": "/ping", "resend": true}', None, limits)
    assert flag is True and event.id == "a"
    assert parse_request('{"text": "/ping", "resend": false}', None, limits)[1] is False
    with pytest.raises(ProtocolError, match="resend: true needs your own id"):
        parse_request('{"text": "/ping", "resend": true}', None, limits)
    with pytest.raises(ProtocolError, match="resend must be true or false, got str"):
        parse_request('{"id": "a", "text": "/ping", "resend": "yes"}', None, limits)


class Counted:
    """/count: replies twice (the second names how many runs its id had); /hold waits for ``gate``."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.gate = threading.Event()
        self.holding = threading.Event()

    def count(self, ctx: Any) -> str:
        self.runs[ctx.event.id] += 1
        ctx.reply("first", {"n": 1})
        return f"run {self.runs[ctx.event.id]}"

    def hold(self, ctx: Any) -> str:
        self.runs[ctx.event.id] += 1
        self.holding.set()
        self.gate.wait(WAIT)
        return "held"


@pytest.fixture
def recording_worker(settings: Any, install_worker: Any, monkeypatch: pytest.MonkeyPatch,
                     transactional_db: Any) -> Iterator[tuple[worker_module.Worker, Counted]]:
    """The process's Worker with the history recorder (the resend record) and no Redis: the
    record and the ledger are this process's."""
    settings.REDIS_URL = ""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.EXECAPP = {"POOL_IDLE_SECONDS": 0.5, "HISTORY_MAX_EVENTS": 1000}
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", ["execapp.history.recorder"])
    monkeypatch.setattr(resend, "_local", None)
    history_store.reset_local()
    worker = install_worker(worker_module.Worker("resend-worker"))
    counted = Counted()
    worker.engine.add(worker.engine.make_matcher("command", "count", counted.count, plugin="test"))
    worker.engine.add(worker.engine.make_matcher("command", "hold", counted.hold, plugin="test"))
    worker.start()
    yield worker, counted
    counted.gate.set()
    worker.stop(timeout=10)
    history_store.reset_local()


def client(worker: worker_module.Worker, owner: str) -> tuple[Connection, list[dict]]:
    sent: list[dict] = []

    async def send(text: str) -> None:
        sent.append(json.loads(text))

    return Connection(worker.engine, worker, Limits(), send, owner=owner), sent


async def answer(conn: Connection, sent: list[dict], frame: dict, until: Callable[[dict], bool]) -> list[dict]:
    """Send ``frame``; its frames up to the first one ``until`` accepts."""
    start = len(sent)
    await conn.receive(json.dumps(frame))
    assert await wait_until_async(lambda: any(until(f) for f in sent[start:]), WAIT), sent[start:]
    return [f for f in sent[start:] if f.get("id") == frame["id"]]


def is_done(f: dict) -> bool:
    return f["type"] == "done"


def is_error(f: dict) -> bool:
    return f["type"] == "error"


async def test_a_resent_event_that_completed_is_answered_from_its_record_and_runs_nothing(
        recording_worker: tuple[worker_module.Worker, Counted]) -> None:
    worker, counted = recording_worker
    frame = {"id": "order-1", "text": "/count", "resend": True}
    first_conn, first_sent = client(worker, "tenant:acme")
    first = await answer(first_conn, first_sent, frame, is_done)
    assert [f["type"] for f in first] == ["reply", "reply", "done"] and first[-1]["recorded"] is True
    assert "replay" not in first[-1] and counted.runs["order-1"] == 1
    first_conn.close()  # the connection died; the client resends on a new one

    again_conn, again_sent = client(worker, "tenant:acme")
    again = await answer(again_conn, again_sent, frame, is_done)
    assert counted.runs["order-1"] == 1, "a resend of an event whose done was sent ran it again"
    assert all(f["replay"] is True for f in again)
    assert [(f["type"], f.get("text"), f.get("data")) for f in again] == \
        [(f["type"], f.get("text"), f.get("data")) for f in first]
    assert {k: again[-1][k] for k in ("matched", "replies", "errors", "blocked_by", "recorded")} == \
        {k: first[-1][k] for k in ("matched", "replies", "errors", "blocked_by", "recorded")}
    assert worker.events_in_flight == 0  # a replay is admitted and ended like any event

    # The record is the owner's: another tenant's event with the same id runs on its own.
    other_conn, other_sent = client(worker, "tenant:other")
    other = await answer(other_conn, other_sent, frame, is_done)
    assert counted.runs["order-1"] == 2 and "replay" not in other[-1] and other[0]["text"] == "first"
    # Without "resend" an id may be used again after its done, as before: it runs.
    plain = await answer(again_conn, again_sent, {"id": "order-1", "text": "/count"}, is_done)
    assert counted.runs["order-1"] == 3 and plain[-1].get("recorded") is None
    for conn in (again_conn, other_conn):
        conn.close()


async def test_a_resend_while_the_first_copy_runs_gets_resend_in_progress_then_its_record(
        recording_worker: tuple[worker_module.Worker, Counted]) -> None:
    worker, counted = recording_worker
    frame = {"id": "long-1", "text": "/hold", "resend": True}
    first_conn, first_sent = client(worker, "tenant:acme")
    await first_conn.receive(json.dumps(frame))
    assert await asyncio.to_thread(counted.holding.wait, WAIT)
    first_conn.close()  # its client is gone; the handler keeps running on this live worker

    second_conn, second_sent = client(worker, "tenant:acme")
    refused = await answer(second_conn, second_sent, frame, is_error)
    assert refused[-1]["code"] == "resend_in_progress" and refused[-1]["retry_after_ms"] >= 100
    assert "still running on worker resend-worker" in refused[-1]["message"]

    counted.gate.set()  # the first copy completes: its record is written though nobody gets its done
    assert await wait_until_async(lambda: worker.events_in_flight == 0, WAIT)
    again = await answer(second_conn, second_sent, frame, is_done)
    assert again[-1]["replay"] is True and again[0]["text"] == "held" and counted.runs["long-1"] == 1
    second_conn.close()


async def test_resend_is_refused_when_the_event_history_is_off(
        recording_worker: tuple[worker_module.Worker, Counted], settings: Any) -> None:
    worker, counted = recording_worker
    settings.EXECAPP = {**settings.EXECAPP, "HISTORY_MAX_EVENTS": 0}
    conn, sent = client(worker, "tenant:acme")
    refused = await answer(conn, sent, {"id": "x", "text": "/count", "resend": True}, is_error)
    assert refused[-1]["code"] == "resend_unavailable" and "HISTORY_MAX_EVENTS" in refused[-1]["message"]
    assert counted.runs["x"] == 0 and worker.events_in_flight == 0
    conn.close()


def test_a_lease_nobody_renews_lapses_and_the_event_may_run_again() -> None:
    ledger = resend.LocalLedger()
    assert ledger.claim("tenant:a", "e", "w1", lease=0.2).state == resend.NEW
    held = ledger.claim("tenant:a", "e", "w2", lease=0.2)
    assert held.state == resend.RUNNING and held.worker == "w1" and 0 < held.ttl <= 0.2
    assert ledger.claim("tenant:b", "e", "w2", lease=0.2).state == resend.NEW  # another owner's id
    # w1 died (nothing renews its lease): once it lapsed, a resend claims the event again.
    assert wait_until(lambda: ledger.claim("tenant:a", "e", "w2", lease=5).state == resend.NEW, WAIT, interval=0.05)
    assert ledger.renew([("tenant:a", "e")], "w1", 5) == 0  # the dead worker's lease is not its any more
    ledger.done("tenant:a", "e", "uid-1", retention=5)
    assert ledger.claim("tenant:a", "e", "w3", lease=5) == resend.Claim(resend.DONE, uid="uid-1",
                                                                        ttl=pytest.approx(5, abs=0.5))


@pytest.mark.redis
def test_the_redis_ledger_claims_renews_and_records_atomically(redis_server: RedisServer, settings: Any) -> None:
    settings.REDIS_URL = redis_server.url
    ledger = resend.RedisLedger(redis_server.url)
    assert ledger.claim("tenant:a", "e", "w1", lease=0.3).state == resend.NEW
    assert ledger.claim("tenant:a", "e", "w2", lease=0.3).worker == "w1"
    assert ledger.renew([("tenant:a", "e")], "w1", 5) == 1  # w1 renews: it stays w1's
    held = ledger.claim("tenant:a", "e", "w2", lease=0.3)
    assert held.state == resend.RUNNING and held.ttl > 1
    ledger.done("tenant:a", "e", "uid-9", retention=60)
    assert ledger.claim("tenant:a", "e", "w2", lease=0.3)[:3] == (resend.DONE, "", "uid-9")
    redis_server.kill()  # Redis down: a claim fails fast (the connection answers resend_unavailable)
    started = time.monotonic()
    import redis

    with pytest.raises(redis.ConnectionError):
        ledger.claim("tenant:a", "f", "w1", lease=1)
    assert time.monotonic() - started < 3


# -- the channel layer going away ------------------------------------------------------------------

@pytest.mark.redis
async def test_a_layer_watch_puts_memberships_back_after_redis_restarts_or_loses_them(
        redis_server: RedisServer) -> None:
    from channels_redis.core import RedisChannelLayer

    layer = RedisChannelLayer(**redis_layer_settings(redis_server.url)["default"]["CONFIG"])
    watch = LayerWatch(layer, "test", interval=0.1)
    channel = await layer.new_channel()
    await watch.add("room", channel)

    async def delivered() -> bool:
        await layer.group_send("room", {"type": "x"})
        try:
            return (await asyncio.wait_for(layer.receive(channel), 1.0))["type"] == "x"
        except (asyncio.TimeoutError, Exception):
            return False

    assert await delivered()
    assert await wait_until_async(lambda: watch.marked, WAIT)  # the first check set its marker

    # 1. A restart: connections fail (the watch sees it), then Redis is back empty.
    redis_server.kill()
    redis_server.start()
    assert await wait_until_async(lambda: watch.restores >= 1 and watch.up, WAIT), watch.stats()
    assert await delivered(), "the membership was not put back after the restart"

    # 2. Data lost without any error seen (a failover, a FLUSHALL): the marker is gone too.
    restores = watch.restores
    redis_server.client().flushall()  # own redis-server: nobody else's keys
    assert await wait_until_async(lambda: watch.restores > restores, WAIT), watch.stats()
    assert await delivered()
    await watch.discard("room", channel)
    await watch.stop()
    await layer.close_pools()


@pytest.mark.redis
def test_control_commands_answer_control_unavailable_when_redis_is_down(settings: Any) -> None:
    port = free_port()  # nothing listens there: Redis is down
    settings.REDIS_URL = f"redis://127.0.0.1:{port}/0"
    settings.CHANNEL_LAYERS = redis_layer_settings(settings.REDIS_URL)
    for command, args in (("execstatus", ()), ("drain", ("--timeout", "1")), ("undrain", ())):
        out = StringIO()
        with pytest.raises(CommandError, match=rf"control_unavailable: the channel layer's Redis at "
                                               rf"127.0.0.1:{port} cannot be reached \(ConnectionError"):
            call_command(command, *args, "--json", stdout=out)
        body = json.loads(out.getvalue())
        assert body["ok"] is False and body["error"]["code"] == "control_unavailable", body
        assert body["error"]["reason"].startswith(f"redis at 127.0.0.1:{port} unreachable: ConnectionError"), body
        with pytest.raises(CommandError, match="control_unavailable"):  # and in plain text, no traceback
            call_command(command, *args, stdout=StringIO())


def test_a_replay_is_built_from_the_event_s_trace() -> None:
    # The record is the trace the history keeps (execapp.history): its handlers' replies and
    # codes, in the order the handlers started, then the done's counts.
    trace = {"id": "e", "session": "room", "matched": 2, "replies": 2, "errors": 1, "blocked_by": None,
             "duration": 0.5, "replies_truncated": True,
             "handlers": [{"matcher": "m1", "plugin": "p", "exec": "pool", "duration": 0.1, "code": "ok",
                           "replies": [["a", None], ["b", {"k": 1}]]},
                          {"matcher": "m2", "plugin": None, "exec": "sync", "duration": 0.0, "code": "handler_error",
                           "message": "boom", "replies": []}]}
    frames = [json.loads(f) for f in resend.replay_frames(trace)]
    assert [(f["type"], f.get("text"), f.get("code")) for f in frames] == [
        ("reply", "a", None), ("reply", "b", None), ("error", None, "handler_error"), ("done", None, None)]
    assert all(f["replay"] is True and f["session"] == "room" and f["id"] == "e" for f in frames)
    assert frames[-1]["truncated"] is True and frames[-1]["elapsed_ms"] == 500.0 and frames[-1]["recorded"] is True


@pytest.mark.redis
def test_a_control_command_on_a_hung_redis_ends_at_its_deadline(redis_server: RedisServer, settings: Any) -> None:
    # On a Redis answering in ~1 s a call (a slow link) `execstatus` took 16 s and `drain --timeout 2`
    # 15.5 s, against their 3 s and 5 s: the deadline began after the registry reads and the send.
    from execapp.control import ControlUnavailable
    from execapp.control_client import request_sync

    settings.REDIS_URL = redis_server.url
    settings.CHANNEL_LAYERS = redis_layer_settings(redis_server.url, "hung")
    redis_server.client().execute_command("CLIENT", "PAUSE", 8000, "ALL")  # our own redis-server: hung
    started = time.monotonic()
    with pytest.raises(ControlUnavailable, match=r"Redis did not answer within the command's 1 s"):
        request_sync("status", wait=1.0)
    assert time.monotonic() - started < 2.5  # the registry's socket timeout alone is 5 s
