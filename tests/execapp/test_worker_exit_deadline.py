"""A worker told to stop must be gone in bounded time, or the supervisor kills it.

A worker SIGTERMed on its own (an operator restarting it, a recycle retiring it) drains, stops its
Worker and exits. If that never ends (a service's close that does not return while the loop keeps
beating), the supervisor did not see it: the worker stayed for ever, its slot counted as serving, and no
replacement was started. Real ``python -m execapp.serve`` processes with the test handlers of
ws_handlers.py (``HANG_AT_STOP``). Time bounds are liveness bounds.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.conftest import migrated_token_env, wait_until
from tests.execapp.supervised import InfoServer, alive, starter
from tests.execapp.ws_handlers import HANG_AT_STOP

pytestmark = pytest.mark.e2e

#: --grace 1 --close-timeout 1: the supervisor's stop deadline is 1 + 1 + 10 = 12 s.
STOP_DEADLINE = 12.0
#: The deadline, the stack dump, a replacement's start on a busy 2-core machine.
BOUND = STOP_DEADLINE + 40.0


@pytest.fixture(scope="module")
def db_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return migrated_token_env(tmp_path_factory.mktemp("exit-deadline-db"), "exitdeadline")


@pytest.fixture
def start(db_env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    yield from starter(db_env, tmp_path, partial(InfoServer, log_name="exitdeadline"))


async def test_a_worker_that_never_finishes_stopping_is_killed_and_replaced(start: Any) -> None:
    server = await asyncio.to_thread(start, env={HANG_AT_STOP: "close"}, workers=2,
                                     args=("--grace", "1", "--close-timeout", "1"))
    victim, sibling = sorted(server.ready_pids())
    began = time.monotonic()
    os.kill(victim, signal.SIGTERM)  # an operator restarting one worker
    replaced = await asyncio.to_thread(
        wait_until, lambda: not alive(victim) and len(server.ready_pids() - {victim, sibling}) == 1, BOUND)
    took = time.monotonic() - began
    states = [s for s in server.slots() if s["pid"] == victim]
    assert replaced, f"worker {victim} still there {took:.1f} s after its SIGTERM ({states}): {server.log()}"
    log = server.log(None)
    line = re.search(rf"worker process \[{victim}\] still (draining|exiting) ([\d.]+) s after it began to stop", log)
    assert line, log[-6000:]
    assert float(line.group(2)) >= STOP_DEADLINE, line.group(0)
    assert "most recent call first" in log, "its threads' stacks were dumped before the kill"
    assert sibling in server.ready_pids(), "the sibling served throughout"
