"""The bundled counter across worker processes: `/count` N times over `python -m execapp.serve
--workers 3` (tests/execapp/test_operations.py's deployment: real Redis, PostgreSQL, the bundled
plugins) counts exactly N, each value once.

counter.lua did kv_get then kv_set: two workers reading the same value both stored value + 1 (40
`/count` over 3 workers counted 30). It uses kv_incr, one atomic step of the KV store, now.
"""
from __future__ import annotations

import asyncio
import json
from typing import Iterator

import pytest
import redis
from websockets.asyncio.client import connect

from tests.execapp.test_operations import WAIT, Deployment, ops_env  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.postgres]

WORKERS = 3
CONNECTIONS = 12
PER_CONNECTION = 5


@pytest.fixture(scope="module")
def deployment(ops_env: dict[str, str]) -> Iterator[Deployment]:  # noqa: F811
    d = Deployment(ops_env, workers=WORKERS)
    yield d
    d.stop()


async def _counts(url: str, token: str, client: int) -> list[dict]:
    """Send PER_CONNECTION `/count` at once on one connection; each event's frames until its done."""
    ids = [f"count-{client}-{i}" for i in range(PER_CONNECTION)]
    frames: list[dict] = []
    async with connect(f"{url}?token={token}") as ws:
        for eid in ids:
            await ws.send(json.dumps({"type": "message", "text": "/count", "id": eid}))
        done = 0
        while done < len(ids):
            frame = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
            frames.append(frame)
            done += frame["type"] == "done"
    return frames


def test_count_over_three_workers_counts_every_run_exactly_once(deployment: Deployment,
                                                                ops_env: dict[str, str]) -> None:  # noqa: F811
    before = {a["pid"]: a["events"] for a in deployment.status().values()}

    async def load() -> list[dict]:
        got = await asyncio.gather(*(_counts(deployment.ws_url, ops_env["TOKEN"], n) for n in range(CONNECTIONS)))
        return [frame for frames in got for frame in frames]

    frames = asyncio.run(load())
    total = CONNECTIONS * PER_CONNECTION
    assert [f for f in frames if f["type"] == "error"] == []
    replies = sorted(int(f["text"]) for f in frames if f["type"] == "reply")
    # Each run got a value no other run got, and the counter stands at the number of runs.
    assert replies == list(range(1, total + 1)), f"{total} runs answered {replies}"
    client = redis.Redis.from_url(ops_env["REDIS_URL"], decode_responses=True)
    try:
        assert client.hget(f"{ops_env['REDIS_PREFIX']}:execapp:plugins:kv:counter", "count") == str(total)
    finally:
        client.close()
    # The runs were spread over worker processes (else this proves nothing about them).
    after = {a["pid"]: a["events"] for a in deployment.status().values()}
    served = [pid for pid, events in after.items() if events > before.get(pid, 0)]
    assert len(served) >= 2, f"only workers {served} of {sorted(after)} ran /count"
