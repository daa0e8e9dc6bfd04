"""End to end: a real uvicorn subprocess serving config.asgi, driven by the `websockets` client.

The servers run tests/execapp/e2e_settings.py: the project's settings plus the Python test
commands of ws_handlers.py (/ping, /slow N, /echo, /multi N, /boom, /late) and, per server, a
smaller pool and in-flight limit so the limits are reachable quickly. The suite runs once over
the in-memory channel layer and once over Redis (REDIS_URL). The last test is the new user's
path with the bundled plugins (`manage.py loadplugins`).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any, Iterator

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from execapp.engine import pool
from tests.conftest import REDIS_TEST_URL, AsgiServer, manage, redis_test_prefix, require_service, wait_until

pytestmark = pytest.mark.e2e

TIMEOUT = 10.0
SERVER_SETTINGS = {"POOL_MAX_WORKERS": 16, "POOL_QUEUE_SIZE": 16, "OVERFLOW_WAIT_SECONDS": 1.0,
                   "MAX_IN_FLIGHT_PER_CONNECTION": 20}


def _token(env: dict[str, str], name: str) -> str:
    result = manage("create_token", name, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def e2e_db(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One migrated SQLite file for this module's servers."""
    env = {"DATABASE_URL": f"sqlite:///{tmp_path_factory.mktemp('e2e-ws') / 'db.sqlite3'}"}
    result = manage("migrate", "--noinput", env=env)
    assert result.returncode == 0, result.stderr
    return env


class Server:
    """A running server and a token for it."""

    def __init__(self, server: AsgiServer, token: str, env: dict[str, str], layer: str) -> None:
        self.server, self.token, self.env, self.layer = server, token, env, layer
        self.url = f"{server.ws_url}/ws/events/"

    def connect(self, token: str | None = "", query: str = "", **kwargs: Any) -> Any:
        token = self.token if token == "" else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return connect(self.url + query, additional_headers=headers, max_size=2 ** 22, **kwargs)


@pytest.fixture(scope="module", params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def server(request: pytest.FixtureRequest, e2e_db: dict[str, str]) -> Iterator[Server]:
    env = {**e2e_db, "DJANGO_SETTINGS_MODULE": "tests.execapp.e2e_settings",
           "EXECAPP_TEST_SETTINGS": json.dumps(SERVER_SETTINGS)}
    if request.param == "redis":
        # Its own key prefix: `manage.py drain` reaches every worker of a prefix, and another
        # test run sharing this Redis must neither be drained nor drain this server.
        env["REDIS_URL"] = require_service("Redis", REDIS_TEST_URL)
        env["REDIS_PREFIX"] = redis_test_prefix("e2ews")
    else:
        env["REDIS_URL"] = ""
    token = _token(env, f"e2e-{request.param}")
    srv = AsgiServer(env)
    yield Server(srv, token, env, request.param)
    srv.stop()


async def recv(ws: ClientConnection, timeout: float = TIMEOUT) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def until_done(ws: ClientConnection, event_id: str, timeout: float = TIMEOUT) -> list[dict]:
    frames = []
    while True:
        frame = await recv(ws, timeout)
        frames.append(frame)
        if frame["type"] == "done" and frame["id"] == event_id:
            return frames


async def nothing_pending(ws: ClientConnection, wait: float = 0.05) -> bool:
    try:
        await asyncio.wait_for(ws.recv(), wait)
    except asyncio.TimeoutError:
        return True
    return False


def pool_load(server: Server) -> float:
    """Handlers running or queued in the server's pool now, from its /metrics (one worker process:
    the scrape refreshes the numbers of the process that answers)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.server.url}/metrics", timeout=TIMEOUT) as response:
        text = response.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name in ("execapp_pool_in_flight", "execapp_pool_queued"))


async def pool_reaches(server: Server, n: int) -> bool:
    """Wait (bounded) until the server's pool holds at least ``n`` handlers, running or queued."""
    return await asyncio.to_thread(wait_until, lambda: pool_load(server) >= n, TIMEOUT, 0.02)


def msg(text: str, eid: str | None = None, **extra: Any) -> str:
    frame: dict[str, Any] = {"type": "message", "text": text, **extra}
    if eid is not None:
        frame["id"] = eid
    return json.dumps(frame)


# -- the basics -----------------------------------------------------------------------------------

async def test_ping_pong_then_done_with_a_header_or_a_query_token(server: Server) -> None:
    async with server.connect() as ws:
        await ws.send(msg("/ping", "p"))
        reply, done = await recv(ws), await recv(ws)
        assert (reply["type"], reply["id"], reply["text"]) == ("reply", "p", "pong")
        assert (done["type"], done["id"], done["replies"], done["errors"]) == ("done", "p", 1, 0)
    async with server.connect(token=None, query=f"?token={server.token}") as ws:
        await ws.send(msg("/echo hello"))
        assert (await recv(ws))["text"] == "hello"


async def test_missing_unknown_and_revoked_tokens_are_refused_with_403(server: Server) -> None:
    revoked = _token(server.env, f"e2e-revoked-{server.layer}")
    assert manage("revoke_token", f"e2e-revoked-{server.layer}", env=server.env).returncode == 0
    for token, query in ((None, ""), ("not-a-token", ""), (None, "?token=nope"), (revoked, "")):
        with pytest.raises(InvalidStatus) as info:
            async with server.connect(token=token, query=query):
                pass
        assert info.value.response.status_code == 403


async def test_a_fast_event_finishes_while_a_slow_handler_of_another_connection_runs(server: Server) -> None:
    async with server.connect() as slow, server.connect() as fast:
        await slow.send(msg("/slow 1500", "s"))
        assert await pool_reaches(server, 1), "/slow never reached the pool"  # it runs while /ping is asked
        await fast.send(msg("/ping", "f"))
        assert [f["type"] for f in await until_done(fast, "f")] == ["reply", "done"]
        # Had /slow blocked the event loop, /ping could only have been answered after it, and
        # the slow connection's reply and done would already be here.
        assert await nothing_pending(slow)
        await slow.send(msg("/ping", "f2"))  # and the slow connection itself is not held either
        assert [f["id"] for f in await until_done(slow, "f2")] == ["f2", "f2"]
        assert [f["type"] for f in await until_done(slow, "s")] == ["reply", "done"]


async def test_done_after_every_reply_of_its_event(server: Server) -> None:
    async with server.connect() as ws:
        for i in range(20):
            await ws.send(msg("/multi 5", f"m{i}"))
        kinds: dict[str, list[str]] = {}
        while sum(k[-1:] == ["done"] for k in kinds.values()) < 20:
            frame = await recv(ws)
            kinds.setdefault(frame["id"], []).append(frame["type"])
        assert all(k == ["reply"] * 5 + ["done"] for k in kinds.values())


# -- every error code -----------------------------------------------------------------------------

async def test_protocol_errors_and_the_connection_and_its_neighbours_carry_on(server: Server) -> None:
    async with server.connect() as ws, server.connect() as neighbour:
        await neighbour.send(msg("/slow 300", "n"))
        cases = [
            ("{nope", "bad_json", None),
            ('{"id": "e1", "type": "message", "text": 5}', "bad_event", "e1"),
            ('{"id": "e2", "type": "message", "text": "/ping", "txt": "x"}', "bad_event", "e2"),
            ('[1, 2, 3]', "bad_event", None),
            (b"\x01\x02", "bad_event", None),
            (msg("/echo " + "x" * (64 * 1024), "big"), "too_large", None),
        ]
        for frame, code, eid in cases:
            await ws.send(frame)
            error = await recv(ws)
            assert (error["type"], error["code"], error["id"]) == ("error", code, eid), frame[:50]
        await ws.send(msg("/ping", "still"))
        assert [f["type"] for f in await until_done(ws, "still")] == ["reply", "done"]
        assert [f["type"] for f in await until_done(neighbour, "n")] == ["reply", "done"]


async def test_handler_error_and_timeout_are_errors_followed_by_done(server: Server) -> None:
    async with server.connect() as ws:
        for command, code in (("/boom", "handler_error"), ("/late", "timeout")):
            await ws.send(msg(command, code))
            error, done = await recv(ws), await recv(ws)
            assert (error["type"], error["code"], error["id"]) == ("error", code, code)
            assert (done["type"], done["id"], done["errors"]) == ("done", code, 1)


async def test_rate_limited_past_the_in_flight_limit(server: Server) -> None:
    limit = SERVER_SETTINGS["MAX_IN_FLIGHT_PER_CONNECTION"]
    async with server.connect() as ws:
        for i in range(limit + 1):
            await ws.send(msg("/slow 500", f"r{i}"))
        error = await recv(ws)
        assert (error["type"], error["code"], error["id"]) == ("error", "rate_limited", f"r{limit}")
        dones = set()
        while len(dones) < limit:
            frame = await recv(ws)
            assert frame["type"] in ("reply", "done"), frame
            if frame["type"] == "done":
                dones.add(frame["id"])
        await ws.send(msg("/ping", "after"))
        assert (await until_done(ws, "after"))[-1]["type"] == "done"


async def test_overloaded_when_the_pool_stays_full(server: Server) -> None:
    # One owner's: the pool's threads but its reserve (POOL_RESERVE, kept for another owner), and its queue.
    threads = SERVER_SETTINGS["POOL_MAX_WORKERS"]
    capacity = threads - int(threads * pool.RESERVE) + SERVER_SETTINGS["POOL_QUEUE_SIZE"]
    async with server.connect() as a, server.connect() as b, server.connect() as c:
        for i in range(capacity):  # two connections: each stays under its in-flight limit
            await (a if i % 2 else b).send(msg("/slow 1500", f"fill{i}"))
        assert await pool_reaches(server, capacity), "the pool never filled"
        await c.send(msg("/slow 100", "refused"))
        error, done = await recv(c), await recv(c)
        assert (error["code"], error["id"], done["type"], done["errors"]) == ("overloaded", "refused", "done", 1)
        for ws, n in ((a, capacity // 2), (b, capacity // 2)):
            dones = 0
            while dones < n:
                dones += (await recv(ws))["type"] == "done"


async def test_draining_refuses_new_events_until_undrained(server: Server) -> None:
    if server.layer != "redis":
        # The in-memory layer cannot reach another process: the command says so and changes nothing.
        result = manage("drain", "--timeout", "1", env=server.env, timeout=30)
        assert result.returncode != 0 and "control_unavailable" in result.stdout + result.stderr
        async with server.connect() as ws:
            await ws.send(msg("/ping", "still-served"))
            assert [f["type"] for f in await until_done(ws, "still-served")] == ["reply", "done"]
        return
    async with server.connect() as ws:
        await ws.send(msg("/slow 400", "running"))
        result = manage("drain", "--timeout", "10", env=server.env, timeout=30)
        assert result.returncode == 0, result.stdout + result.stderr
        assert [f["type"] for f in await until_done(ws, "running")] == ["reply", "done"]  # finished by the drain
        await ws.send(msg("/ping", "new"))
        error = await recv(ws)
        assert (error["type"], error["code"], error["id"]) == ("error", "draining", "new")
        result = manage("undrain", env=server.env, timeout=30)
        assert result.returncode == 0, result.stdout + result.stderr
        await ws.send(msg("/ping", "again"))
        assert (await until_done(ws, "again"))[-1]["type"] == "done"


# -- sessions and volume --------------------------------------------------------------------------

async def test_session_members_hear_each_other(server: Server) -> None:
    async with server.connect() as sender, server.connect(query="?session=e2e-room") as listener:
        await sender.send(msg("/echo hi", "s1", session="e2e-room"))
        own = await until_done(sender, "s1")
        heard = await until_done(listener, "s1")
        assert [f["type"] for f in own] == [f["type"] for f in heard] == ["reply", "done"]
        assert heard[0]["text"] == "hi" and heard[0]["session"] == "e2e-room"
        assert await nothing_pending(sender, 0.1)


async def test_exactly_one_done_for_each_of_1000_events_from_10_connections(server: Server) -> None:
    window = SERVER_SETTINGS["MAX_IN_FLIGHT_PER_CONNECTION"]

    async def client(n: int) -> tuple[list[str], Counter]:
        rng = random.Random(n)
        ids = [f"c{n}-{i}" for i in range(100)]
        dones: Counter = Counter()
        async with server.connect() as ws:
            sent = 0
            while sum(dones.values()) < len(ids):
                while sent < len(ids) and sent - sum(dones.values()) < window:
                    text = "/slow 60" if rng.random() < 0.1 else rng.choice(["/ping", "/multi 2", "/boom", "/echo x"])
                    await ws.send(msg(text, ids[sent]))
                    sent += 1
                frame = await recv(ws)
                assert frame["type"] != "error" or frame["code"] == "handler_error", frame
                if frame["type"] == "done":
                    dones[frame["id"]] += 1
            assert await nothing_pending(ws, 0.1)
        return ids, dones

    for ids, dones in await asyncio.gather(*(client(n) for n in range(10))):
        assert set(dones) == set(ids) and set(dones.values()) == {1}


# -- the new user's path with the bundled plugins -------------------------------------------------

def test_bundled_plugins_answer_ping_slow_echo_and_guard(e2e_db: dict[str, str]) -> None:
    env = {**e2e_db, "REDIS_URL": ""}
    result = manage("loadplugins", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    token = _token(env, "e2e-plugins")
    srv = AsgiServer(env)
    try:
        asyncio.run(_bundled(srv.ws_url + "/ws/events/", token))
    finally:
        srv.stop()


async def _bundled(url: str, token: str) -> None:
    async with connect(f"{url}?token={token}") as ws:
        # The worker syncs its matchers from the plugin registry when it starts (on the first
        # connection): wait for the first answered /ping (bounded) before the real checks.
        deadline = time.monotonic() + 15
        while True:
            await ws.send(msg("/ping", "warm"))
            frames = await until_done(ws, "warm")
            if frames[-1]["matched"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)  # the poll's pace (bounded by the deadline above)
        assert frames[0]["type"] == "reply" and frames[0]["text"] == "pong", frames
        await ws.send(msg("/slow 50", "slow"))
        await ws.send(msg("/echo hello there", "echo"))
        await ws.send(msg("this is forbidden /ping", "guard"))
        got: dict[str, list[dict]] = {}
        while sum(1 for v in got.values() if v[-1]["type"] == "done") < 3:
            frame = await recv(ws)
            got.setdefault(frame["id"], []).append(frame)
        assert got["slow"][0]["text"] == "slept 50" and got["slow"][0]["exec"] == "pool"
        assert got["echo"][0]["text"] == "hello there"
        assert got["guard"][-1]["blocked_by"] is not None and len(got["guard"]) == 2
