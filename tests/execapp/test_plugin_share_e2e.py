"""One tenant cannot keep a plugin's slots (max_concurrency) from another, on the production topology
(`python -m execapp.serve --workers 2` over Redis and PostgreSQL, tests/execapp/test_operations.py's
deployment).

A plugin's slots are per worker process, shared by every tenant. Tenant A kept a slow plugin with
2 slots busy from many connections; its pooled events queued for the slots (up to its pool share,
32 per worker). Tenant B's event of the same plugin waited among A's, woken in no particular order,
and was refused ``plugin_busy`` once the plugin's timeout (its wait) was over: measured 20 of 24 of
B's events refused (plugins.strategies.Slots now hands a freed slot to the waiting tenant holding
the fewest: B waits for one of A's calls at most).
"""
from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from websockets.asyncio.client import connect

from tests.conftest import manage
from tests.execapp.test_operations import Deployment, ops_env, two_tenant_deployment  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.postgres]

#: The plugin: 2 slots, a 1 s timeout (so a wait for a slot lasts 1 s at most), a sleep per call.
MANIFEST = {"plugins": [{"name": "tshare", "runtime": "lua", "file": "tshare.lua", "permissions": ["log", "sleep"],
                         "timeout_ms": 1000, "max_concurrency": 2,
                         "bindings": [{"kind": "command", "pattern": "tshare", "handler": "tshare"}]}]}
SOURCE = 'function tshare(event) sleep(tonumber(event.args)) return "slept" end\n'
FLOOD_CONNECTIONS = 16
FLOOD_DEPTH = 8
VICTIM_EVENTS = 24


@pytest.fixture(scope="module")
def two_tenants(ops_env: dict[str, str]) -> Iterator[tuple[Deployment, str, str]]:  # noqa: F811
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, "manifest.json").write_text(json.dumps(MANIFEST))
        Path(directory, "tshare.lua").write_text(SOURCE)
        loaded = manage("loadplugins", "--dir", directory, env=ops_env, timeout=120)
        assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    yield from two_tenant_deployment(ops_env)


async def _flood(url: str, token: str, stop: asyncio.Event) -> int:
    """One of tenant A's connections: FLOOD_DEPTH `/tshare 300` in flight until ``stop``."""
    sent = 0
    async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, max_size=None) as ws:
        inflight = 0
        while not stop.is_set() or inflight:
            while inflight < FLOOD_DEPTH and not stop.is_set():
                await ws.send(json.dumps({"type": "message", "text": "/tshare 300"}))
                inflight += 1
                sent += 1
            try:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 5.0))
            except asyncio.TimeoutError:
                continue
            inflight -= frame["type"] == "done"
    return sent


async def _victim(url: str, token: str) -> list[str]:
    """Tenant B: VICTIM_EVENTS `/tshare 20`, one at a time over 2 connections; each event's outcome."""
    outcomes: list[str] = []

    async def one_connection(n: int) -> None:
        async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}) as ws:
            for _ in range(n):
                await ws.send(json.dumps({"type": "message", "text": "/tshare 20"}))
                codes = []
                while True:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 20.0))
                    if frame["type"] == "error":
                        codes.append(frame["code"])
                    if frame["type"] == "done":
                        break
                outcomes.append(codes[0] if codes else "ok")

    await asyncio.gather(*(one_connection(VICTIM_EVENTS // 2) for _ in range(2)))
    return outcomes


def test_a_tenant_flooding_a_plugin_does_not_get_another_tenant_s_events_refused_plugin_busy(
        two_tenants: tuple[Deployment, str, str]) -> None:
    d, flooder, victim = two_tenants

    async def run() -> list[str]:
        stop = asyncio.Event()
        floods = [asyncio.ensure_future(_flood(d.ws_url, flooder, stop)) for _ in range(FLOOD_CONNECTIONS)]
        await asyncio.sleep(2.0)  # A holds both slots of every worker, its events queued for them
        try:
            return await _victim(d.ws_url, victim)
        finally:
            stop.set()
            await asyncio.gather(*floods)

    outcomes = asyncio.run(run())
    refused = outcomes.count("plugin_busy")
    print(f"victim outcomes: {len(outcomes) - refused} ok, {refused} plugin_busy of {len(outcomes)}")
    # B's event waits for one of A's calls (300 ms) at most, well within its 1 s wait.
    assert refused == 0, outcomes
