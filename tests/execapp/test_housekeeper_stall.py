"""A worker whose housekeeping thread is stuck is recycled by the supervisor.

The housekeeper ticks the worker's shared services: metrics, snapshots, history, and the
watchdog service that counts stuck pool threads and applies the quarantine list. A tick that
never returns stopped all of them while the loop beat on, and nothing saw it: the worker was
never recycled, not even for stuck pool threads (the housekeeper counts them). Real
``python -m execapp.serve`` processes with ws_handlers.py's ``HANG_HOUSEKEEPER``.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import pytest
from websockets.asyncio.client import connect

from tests.conftest import migrated_token_env, wait_until
from tests.execapp.supervised import InfoServer, alive, starter
from tests.execapp.ws_handlers import HANG_HOUSEKEEPER

pytestmark = pytest.mark.e2e

HOUSE_LIMIT = 3.0
#: The limit, a replacement's start on a busy 2-core machine, slack.
BOUND = HOUSE_LIMIT + 45.0


@pytest.fixture(scope="module")
def db_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return migrated_token_env(tmp_path_factory.mktemp("house-stall-db"), "housestall")


@pytest.fixture
def start(db_env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    yield from starter(db_env, tmp_path, partial(InfoServer, log_name="housestall"))


async def test_a_stuck_housekeeper_gets_its_worker_recycled_even_with_stuck_pool_threads(start: Any) -> None:
    server = await asyncio.to_thread(
        start, env={HANG_HOUSEKEEPER: "1"}, args=("--grace", "1", "--close-timeout", "1"),
        settings={"HOUSEKEEPER_STALL_SECONDS": HOUSE_LIMIT, "STUCK_THREADS_LIMIT": 2})
    (old,) = server.ready_pids()

    def house_age() -> float:
        return max([s["housekeeper_age"] or 0.0 for s in server.slots() if s["pid"] == old] or [0.0])

    assert await asyncio.to_thread(wait_until, lambda: house_age() > 1.0, 20), server.slots()  # hung now
    began = time.monotonic()
    async with connect(server.ws_url) as ws:  # two pool threads stuck past their deadline: the limit
        for i in range(2):
            await ws.send(json.dumps({"id": f"w{i}", "type": "message", "text": "/wedge 60"}))
        done = 0
        while done < 2:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 20))
            done += frame["type"] == "done"
    replaced = await asyncio.to_thread(wait_until, lambda: server.ready_pids() - {old}, BOUND)
    took = time.monotonic() - began
    slot = [s for s in server.slots() if s["pid"] == old]
    assert replaced, f"worker {old} not recycled {took:.1f} s on (its slot: {slot}): {server.log()}"
    log = server.log(None)
    line = re.search(rf"worker process \[{old}\]: its housekeeping thread has not come round for ([\d.]+) s", log)
    assert line and float(line.group(1)) >= HOUSE_LIMIT, log[-6000:]
    assert "in tick" in log, "the threads' stacks show the stuck tick"
    assert await asyncio.to_thread(wait_until, lambda: not alive(old), BOUND), f"{old} drains and exits: {server.log()}"
