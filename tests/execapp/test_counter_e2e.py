"""The bundled counter across worker processes: `/count` N times over `python -m execapp.serve
--workers 3` counts exactly N, each value once, on both KV stores: Redis (tests/execapp/
test_operations.py's deployment: real Redis, PostgreSQL, the bundled plugins) and the embedded
default's database (an SQLite file, no Redis).

counter.lua did kv_get then kv_set: two workers reading the same value both stored value + 1 (40
`/count` over 3 workers counted 30). It uses kv_incr, one atomic step of the KV store, now.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
import redis
from websockets.asyncio.client import ClientConnection, connect

from tests.conftest import ServerProcess, manage, migrated_token_env, wait_until
from tests.execapp.test_operations import WAIT, Deployment, ops_env  # noqa: F401 (a fixture)

pytestmark = pytest.mark.e2e

WORKERS = 3
CONNECTIONS = 12
PER_CONNECTION = 5
#: Times a run refused `plugin_busy` is sent again (the refusal's own advice).
BUSY_RETRIES = 5


@dataclass
class Counting:
    """A server with the bundled plugins: where to connect, its process, and the stored count."""

    server: ServerProcess
    ws_url: str
    token: str
    stored: Callable[[], str | None]


def _listening(port: int) -> int:
    """Sockets listening on ``port``: one per worker once it is ready (SO_REUSEPORT)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(1 for row in rows if row[1].endswith(f":{port:04X}") and row[3] == "0A")  # 0A: LISTEN


@pytest.fixture(scope="module")
def on_redis(ops_env: dict[str, str]) -> Iterator[Counting]:  # noqa: F811
    d = Deployment(ops_env, workers=WORKERS)

    def stored() -> str | None:
        client = redis.Redis.from_url(ops_env["REDIS_URL"], decode_responses=True)
        try:
            return client.hget(f"{ops_env['REDIS_PREFIX']}:execapp:plugins:kv:counter", "count")
        finally:
            client.close()

    yield Counting(d, d.ws_url, ops_env["TOKEN"], stored)
    d.stop()


@pytest.fixture(scope="module")
def on_database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Counting]:
    directory = tmp_path_factory.mktemp("counter-db")
    env = {**migrated_token_env(directory, "counter"), "REDIS_URL": "", "EXECAPP_LOG_LEVEL": "WARNING"}
    loaded = manage("loadplugins", env=env)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    server = ServerProcess(["execapp.serve", "--workers", str(WORKERS), "--log-level", "warning", "--no-access-log"],
                           env, "counter")

    def stored() -> str | None:
        with contextlib.closing(sqlite3.connect(directory / "db.sqlite3")) as db:
            row = db.execute("SELECT value FROM plugins_kventry WHERE plugin = 'counter' AND key = 'count'").fetchone()
        return row[0] if row else None

    try:
        assert wait_until(lambda: server.proc.poll() is None and _listening(server.port) >= WORKERS, 60, 0.05), \
            server.log()
        yield Counting(server, f"ws://127.0.0.1:{server.port}/ws/events/", env["TOKEN"], stored)
    finally:
        server.stop()


@pytest.fixture(params=[pytest.param("redis", marks=[pytest.mark.redis, pytest.mark.postgres]), "database"])
def counting(request: pytest.FixtureRequest) -> Counting:
    return request.getfixturevalue("on_redis" if request.param == "redis" else "on_database")


def _workers_serving(server_pid: int, port: int, client_ports: set[int]) -> dict[int, int]:
    """Client port -> pid of the worker process holding that connection (read from /proc)."""
    inodes: dict[str, int] = {}
    for row in (line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]):
        local, remote = int(row[1].rsplit(":", 1)[1], 16), int(row[2].rsplit(":", 1)[1], 16)
        if local == port and remote in client_ports:
            inodes[f"socket:[{row[9]}]"] = remote
    workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and
               f"\nPPid:\t{server_pid}\n" in _read(f"/proc/{p}/status")]
    owners: dict[int, int] = {}
    for pid in workers:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link in inodes:
                        owners[inodes[link]] = pid
    return owners


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


async def _count_runs(c: Counting) -> tuple[list[dict], dict[int, int]]:
    """PER_CONNECTION `/count` on each of CONNECTIONS connections at once (all open first): every
    frame until each event's done, and which worker held each connection."""
    async with contextlib.AsyncExitStack() as stack:
        sockets = [await stack.enter_async_context(connect(f"{c.ws_url}?token={c.token}")) for _ in range(CONNECTIONS)]
        owners = await asyncio.to_thread(_workers_serving, c.server.proc.pid, c.server.port,
                                         {ws.local_address[1] for ws in sockets})

        async def runs(n: int, ws: ClientConnection) -> list[dict]:
            # One at a time per connection: CONNECTIONS runs race over the workers at any moment,
            # and no burst queues for SQLite's write lock past a call's budget on a busy machine.
            # `plugin_busy` (the counter's one slot taken by a pooled run while this worker ran it
            # inline, which never waits) counted nothing and says to retry: a client does.
            frames: list[dict] = []
            for i in range(PER_CONNECTION):
                for attempt in range(BUSY_RETRIES + 1):
                    await ws.send(json.dumps({"type": "message", "text": "/count", "id": f"count-{n}-{i}-{attempt}"}))
                    got: list[dict] = []
                    while not got or got[-1].get("type") != "done":
                        got.append(json.loads(await asyncio.wait_for(ws.recv(), WAIT)))
                    if not any(f.get("code") == "plugin_busy" for f in got):
                        break
                    await asyncio.sleep(0.01 * (attempt + 1))
                frames.extend(got)
            return frames

        got = await asyncio.gather(*(runs(n, ws) for n, ws in enumerate(sockets)))
    return [frame for frames in got for frame in frames], owners


def test_count_over_three_workers_counts_every_run_exactly_once(counting: Counting) -> None:
    frames, owners = asyncio.run(_count_runs(counting))
    total = CONNECTIONS * PER_CONNECTION
    assert [f for f in frames if f["type"] == "error"] == []
    replies = sorted(int(f["text"]) for f in frames if f["type"] == "reply")
    # Each run got a value no other run got, and the counter stands at the number of runs.
    assert replies == list(range(1, total + 1)), f"{total} runs answered {replies}"
    assert counting.stored() == str(total)
    # The runs were spread over worker processes (else this proves nothing about them).
    assert len(owners) == CONNECTIONS and len(set(owners.values())) >= 2, owners
