"""One tenant joining many sessions at once does not take a worker's channel-layer connections from
the others (`python -m execapp.serve --workers 2` over Redis and PostgreSQL,
tests/execapp/test_operations.py's deployment).

Tenant A's 400 connections each joining 32 sessions (?session=...) at once ran ~12,800 joins at once
on the workers' layer pools: each worker held 104-105 Redis connections (the pool's 100, all of
them), tenant B's session frames took p90 290-620 ms (max 1.8 s; ~50 ms with the fix), and in some
bursts joins took over the 2 s join timeout (execapp.layer_watch.JOIN_TIMEOUT_SECONDS), so a worker
judged its whole layer down for every tenant and re-added thousands of memberships (seen 2-3 times
in a burst of 300 then 600). Joins and leaves now go through the owner's share of layer calls
(SESSION_PUBLISHES_PER_OWNER, 8, as publishes), the wait outside the join's timeout: 14-16
connections per worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from websockets.asyncio.client import connect

from tests.execapp.test_operations import Deployment, ops_env, two_tenant_deployment  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.postgres]

BURST = 400
SESSIONS = 32
#: Redis' port, as /proc/net/tcp writes it.
_REDIS_PORT = ":18EB"


def redis_sockets(pid: int) -> int:
    """TCP connections process ``pid`` holds to port 6379 (Redis)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in (line.split() for line in Path(table).read_text().splitlines()[1:]):
            if row[2].endswith(_REDIS_PORT) and row[3] == "01":  # 01: ESTABLISHED
                inodes.add(f"socket:[{row[9]}]")
    count = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/{pid}/fd/{fd}") in inodes
    return count


@pytest.fixture(scope="module")
def two_tenants(ops_env: dict[str, str]) -> Iterator[tuple[Deployment, str, str]]:  # noqa: F811
    yield from two_tenant_deployment(ops_env)


async def _session_rounds(sender: Any, listener: Any, stop: asyncio.Event) -> list[float]:
    """B's /ping into its session 'room' until ``stop``: how long each took to reach the listener."""
    took: list[float] = []
    n = 0
    while not stop.is_set():
        n += 1
        started = time.monotonic()
        await sender.send(json.dumps({"id": f"v{n}", "text": "/ping", "session": "room"}))
        while True:
            try:
                frame = json.loads(await asyncio.wait_for(listener.recv(), 6.0))
            except asyncio.TimeoutError:
                took.append(6.0)
                break
            if frame["type"] == "done" and frame["id"] == f"v{n}":
                took.append(time.monotonic() - started)
                break
        while json.loads(await sender.recv())["type"] != "done":
            pass
        await asyncio.sleep(0.02)
    return took


def test_a_tenant_joining_thousands_of_sessions_at_once_does_not_take_the_layer_down_for_others(
        two_tenants: tuple[Deployment, str, str]) -> None:
    d, flooder, victim = two_tenants
    before = d.log().count("the channel layer failed")
    pids = d.worker_pids()
    peak: dict[int, int] = {}
    sessions = ",".join(f"j{i}" for i in range(SESSIONS))

    async def hold(release: asyncio.Event, errors: list[str]) -> None:
        try:
            async with connect(d.ws_url + f"?session={sessions}", open_timeout=60,
                               additional_headers={"Authorization": f"Bearer {flooder}"}):
                await release.wait()
        except Exception as exc:  # the burst's own handshakes may be refused: only B is judged here
            errors.append(type(exc).__name__)

    async def run() -> list[float]:
        hdr = {"Authorization": f"Bearer {victim}"}
        async with connect(d.ws_url + "?session=room", additional_headers=hdr) as listener, \
                connect(d.ws_url, additional_headers=hdr) as sender:
            await asyncio.sleep(0.3)
            stop, release, errors = asyncio.Event(), asyncio.Event(), []
            rounds = asyncio.ensure_future(_session_rounds(sender, listener, stop))
            holders = [asyncio.ensure_future(hold(release, errors)) for _ in range(BURST)]
            for _ in range(60):  # the joins, then held
                await asyncio.sleep(0.1)
                for pid in pids:
                    peak[pid] = max(peak.get(pid, 0), redis_sockets(pid))
            release.set()
            await asyncio.gather(*holders)
            await asyncio.sleep(2.0)  # the leaves
            stop.set()
            took = await rounds
            print(f"burst refused {len(errors)} of its own handshakes")
            return took

    took = sorted(asyncio.run(run()))
    failed = d.log().count("the channel layer failed") - before
    print(f"B's session frames: {len(took)}, p50 {took[len(took) // 2] * 1000:.0f} ms, "
          f"p90 {took[int(len(took) * 0.9)] * 1000:.0f} ms, max {took[-1] * 1000:.0f} ms; layer judged down {failed}x; "
          f"Redis connections per worker at most {peak}")
    # One tenant's joins hold its share of each worker's layer connections (8), not all 100 of them
    # (LAYER_MAX_CONNECTIONS; the worker's other Redis clients add a few).
    assert max(peak.values()) < 50, peak
    assert failed == 0, d.log()[-3000:]
    assert took[-1] < 6.0  # every frame of B's session reached its other member
