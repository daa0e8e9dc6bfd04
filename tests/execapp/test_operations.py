"""Operations end to end: `python -m execapp.serve --workers 2` on real Redis and PostgreSQL, the
bundled plugins, real WebSocket clients, and the operator's commands run as subprocesses.

Every accepted event must end in exactly one terminal frame (its `done`, or an event-level
refusal such as `draining`), through `manage.py drain` and through SIGTERM alike.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import websockets
from websockets.asyncio.client import connect

from tests.conftest import (
    REDIS_TEST_URL,
    ServerProcess,
    manage,
    redis_test_prefix,
    require_service,
    wait_until,
    wait_until_async,
)

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.postgres]

#: Event-level refusals: the event was never accepted, no `done` follows.
REFUSALS = {"draining", "rate_limited", "bad_json", "bad_event", "too_large"}
WAIT = 20.0
STRAGGLER_MS = 9000


# -- the deployment -------------------------------------------------------------------------------

class Deployment(ServerProcess):
    """`python -m execapp.serve --workers N` as an operator starts it, plus the operator's commands."""

    def __init__(self, env: dict[str, str], workers: int = 2, grace: float | None = None) -> None:
        self.env = env
        self.workers = workers
        args = ["execapp.serve", "--workers", str(workers), "--log-level", "warning", "--no-access-log"]
        if grace is not None:
            args += ["--grace", str(grace)]
        super().__init__(args, env, "ops")
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws/events/"
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def worker_pids(self) -> list[int]:
        """Pids of this deployment's workers registered for control (another one may share Redis)."""
        from execapp.control_registry import RedisRegistry

        pids = []
        for info in RedisRegistry(self.env["REDIS_URL"], self.env["REDIS_PREFIX"]).live().values():
            try:
                status = Path(f"/proc/{info.get('pid')}/status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{self.proc.pid}\n" in status:
                pids.append(info["pid"])
        return sorted(pids)

    def status(self) -> dict[str, dict]:
        """The workers' status answers, asked in-process (no manage.py start-up to wait for)."""
        from channels_redis.core import RedisChannelLayer

        from execapp.control_client import request
        from execapp.control_registry import RedisRegistry

        url, prefix = self.env["REDIS_URL"], self.env["REDIS_PREFIX"]
        layer = RedisChannelLayer(hosts=[{"address": url, "socket_timeout": 15}], prefix=prefix)
        return asyncio.run(request("status", layer=layer, registry=RedisRegistry(url, prefix))).answers

    def listening(self) -> int:
        """How many sockets listen on our port: one per worker once it is ready (SO_REUSEPORT)."""
        port = f":{self.port:04X}"
        rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        return sum(1 for row in rows if row[1].endswith(port) and row[3] == "0A")  # 0A: LISTEN

    def wait_ready(self) -> None:
        # Every worker registered for control and listening: a worker listens only once its
        # plugins are loaded, and the load should spread over both of them.
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            return len(self.worker_pids()) >= self.workers and self.listening() >= self.workers

        if not wait_until(ready, 60, interval=0.05):  # each check reads Redis and /proc
            raise RuntimeError(f"{self.workers} workers were not ready within 60 s: {self.log()}")

    def manage(self, *args: str) -> subprocess.CompletedProcess:
        return manage(*args, env=self.env, timeout=90)


@pytest.fixture(scope="module")
def ops_env(postgres_url: str) -> dict[str, str]:
    """REDIS_URL + DATABASE_URL (this run's own PostgreSQL database), migrated, bundled plugins
    loaded, one API token."""
    # REDIS_PREFIX: this deployment's own channels, groups and control registry (runs of the suite
    # overlap on one Redis; a drain must reach this deployment's workers only).
    env = {"REDIS_URL": require_service("Redis", REDIS_TEST_URL), "REDIS_PREFIX": redis_test_prefix("ops"),
           "DATABASE_URL": postgres_url, "EXECAPP_LOG_LEVEL": "WARNING"}
    for args in (("migrate", "--noinput"), ("loadplugins",)):
        result = manage(*args, env=env, timeout=120)
        assert result.returncode == 0, f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    result = manage("create_token", f"ops-{os.getpid()}-{random.randrange(10**6)}", env=env)
    assert result.returncode == 0, result.stderr
    return {**env, "TOKEN": result.stdout.strip().splitlines()[-1]}


@pytest.fixture(scope="module")
def deployment(ops_env: dict[str, str]) -> Iterator[Deployment]:
    """Two worker processes shared by the drain tests (each test leaves them undrained)."""
    d = Deployment(ops_env)
    yield d
    d.stop()


def two_tenant_deployment(ops_env: dict[str, str]) -> Iterator[tuple[Deployment, str, str]]:
    """Two worker processes and two tenants' tokens: ``(deployment, ops_env's token, a new
    tenant's token)``, for the e2e tests of one tenant's flood against another (a fixture body)."""
    made = manage("create_token", f"victim-{os.getpid()}-{random.randrange(10**6)}", env=ops_env, timeout=60)
    assert made.returncode == 0, made.stderr
    d = Deployment(ops_env, workers=2)
    try:
        yield d, ops_env["TOKEN"], made.stdout.strip().splitlines()[-1]
    finally:
        d.stop()


# -- WebSocket load ---------------------------------------------------------------------------------

@dataclass
class Outcome:
    """Everything one client learned about one event it sent."""

    text: str
    phase: int
    frames: list[dict] = field(default_factory=list)

    @property
    def terminals(self) -> list[dict]:
        return [f for f in self.frames if f["type"] == "done" or
                (f["type"] == "error" and f.get("code") in REFUSALS)]


class Load:
    """N WebSocket clients sending a mix of /ping and /slow events, each at most ``depth`` in flight.

    ``phase`` is set by the test (0 before the drain or SIGTERM, 1 while it runs, 2 after); every
    event records the phase it was sent in. After a `draining` refusal a client either stops
    sending (``stop_on_draining``) or goes on slowly. At the end it waits for every answer, then
    closes (or, with ``linger``, waits for the server to close the connection).
    """

    def __init__(self, url: str, token: str, clients: int = 8, depth: int = 8, slow_every: int = 5,
                 slow_ms: int = 300, stop_on_draining: bool = False, linger: bool = False) -> None:
        self.url = f"{url}?token={token}"
        self.clients = clients
        self.depth = depth
        self.slow_every = slow_every
        self.slow_ms = slow_ms
        self.stop_on_draining = stop_on_draining
        self.linger = linger
        self.phase = 0
        self.stop = asyncio.Event()
        self.events: dict[str, Outcome] = {}
        self.close_codes: list[int | None] = []
        self._seq = itertools.count()

    async def run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(self.clients)))

    async def _client(self, n: int) -> None:
        outstanding: set[str] = set()
        room = asyncio.Condition()
        refused = asyncio.Event()
        closed = asyncio.Event()
        async with connect(self.url, max_queue=None) as ws:
            async def receive() -> None:
                try:
                    async for raw in ws:
                        frame = json.loads(raw)
                        eid = frame.get("id")
                        if eid in self.events:
                            self.events[eid].frames.append(frame)
                        if frame["type"] == "error" and frame.get("code") == "draining":
                            refused.set()
                        if frame["type"] == "done" or (frame["type"] == "error" and frame.get("code") in REFUSALS):
                            async with room:
                                outstanding.discard(eid)
                                room.notify_all()
                except websockets.ConnectionClosed:
                    pass
                finally:
                    closed.set()
                    async with room:
                        room.notify_all()

            receiver = asyncio.create_task(receive())
            try:
                while not self.stop.is_set() and not closed.is_set():
                    if refused.is_set():
                        if self.stop_on_draining:
                            break
                        await asyncio.sleep(0.02)  # refused: keep probing, slowly
                    async with room:
                        await room.wait_for(lambda: len(outstanding) < self.depth or self.stop.is_set()
                                            or closed.is_set())
                    if self.stop.is_set() or closed.is_set():
                        break
                    i = next(self._seq)
                    text = f"/slow {self.slow_ms}" if i % self.slow_every == 0 else "/ping"
                    eid = f"c{n}-{i}"
                    self.events[eid] = Outcome(text, self.phase)
                    outstanding.add(eid)
                    await ws.send(json.dumps({"id": eid, "type": "message", "text": text}))
                async with room:  # every answer, or the server closed the connection
                    await asyncio.wait_for(room.wait_for(lambda: not outstanding or closed.is_set()), WAIT)
                if self.linger:
                    await asyncio.wait_for(closed.wait(), WAIT + 30)
                else:
                    await ws.close()
            except websockets.ConnectionClosed:
                pass
            finally:
                await asyncio.wait_for(receiver, WAIT)
                self.close_codes.append(ws.close_code)

    def answered(self, phase: int) -> int:
        """How many clients got a terminal frame for an event they sent in ``phase``."""
        return len({eid.split("-")[0] for eid, o in list(self.events.items()) if o.phase == phase and o.terminals})

    def check_exactly_one_terminal(self) -> None:
        """No event got two terminal frames, and no accepted event (one with a reply) missed its done."""
        for eid, o in self.events.items():
            assert len(o.terminals) <= 1, f"{eid} ({o.text}) got several terminals: {o.frames}"
            replies = [f for f in o.frames if f["type"] == "reply"]
            if replies:
                assert [t["type"] for t in o.terminals] == ["done"], f"{eid} replied without a done: {o.frames}"
                assert o.frames[-1]["type"] == "done", f"{eid}: a frame after its done: {o.frames}"

    def check_phase(self, phase: int, allowed: set[str]) -> int:
        """Every event sent in ``phase`` got exactly one terminal whose kind is in ``allowed``."""
        count = 0
        for eid, o in self.events.items():
            if o.phase != phase:
                continue
            count += 1
            kinds = [t["type"] if t["type"] == "done" else t["code"] for t in o.terminals]
            assert len(kinds) == 1 and kinds[0] in allowed, f"{eid} ({o.text}, phase {phase}): {o.frames}"
            if kinds[0] == "done":
                expected = "pong" if o.text == "/ping" else f"slept {self.slow_ms}"
                texts = [f.get("text") for f in o.frames if f["type"] == "reply"]
                assert texts == [expected], f"{eid} ({o.text}): {o.frames}"
        return count


async def run_load_around(load: Load, action: Any) -> Any:
    """Start the load, run ``action`` (blocking) in a thread once it is under way, finish once
    every client has met the outcome (a `draining` refusal, or its connection closed)."""
    task = asyncio.create_task(load.run())
    # Under way: every client had an answer and /slow events are out (the first of each client is one).
    assert await wait_until_async(lambda: load.answered(0) >= load.clients
                                  and any(o.text.startswith("/slow") for o in load.events.values()), WAIT), \
        "the load never got going"
    load.phase = 1
    # An event sent in phase 0 may still be on its way to the server: the action starts once every
    # phase-0 event has its terminal, so phase 0 is "before the drain" on the server too (phase-1
    # events, /slow ones among them, are what the drain meets in flight).
    assert await wait_until_async(lambda: all(o.terminals for o in list(load.events.values()) if o.phase == 0),
                                  WAIT), "phase-0 events never finished"
    result = await asyncio.to_thread(action)
    load.phase = 2
    assert await wait_until_async(lambda: load.answered(2) + len(load.close_codes) >= load.clients, WAIT), \
        "clients never met the drain"
    load.stop.set()
    await asyncio.wait_for(task, WAIT + 10)
    return result


async def one_event(url: str, token: str, text: str) -> list[dict]:
    """Send one event on a fresh connection and return its frames up to its terminal."""
    async with connect(f"{url}?token={token}") as ws:
        await ws.send(json.dumps({"id": "probe", "type": "message", "text": text}))
        frames = []
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), WAIT))
            frames.append(frame)
            if frame["type"] == "done" or (frame["type"] == "error" and frame.get("code") in REFUSALS):
                return frames


def healthz(d: Deployment) -> int:
    """The HTTP status of GET /healthz (whichever worker answers)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{d.port}/healthz", timeout=WAIT) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


# -- the tests ------------------------------------------------------------------------------------

def test_execstatus_lists_both_workers(deployment: Deployment) -> None:
    result = deployment.manage("execstatus", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert len(status["workers"]) == 2 and status["missing"] == []
    pids = sorted(w["pid"] for w in status["workers"].values())
    assert pids == deployment.worker_pids(), "the workers are the supervisor's children, one pool each"
    assert all(w["pool"]["capacity"] > 0 and w["draining"] is False for w in status["workers"].values())
    text = deployment.manage("execstatus")
    assert text.returncode == 0 and text.stdout.count("  pool: running") == 2
    assert text.stdout.count("  instance pool slow (lua, ") == 2, text.stdout  # the plugins' pools, per worker
    assert text.stdout.rstrip().endswith("2 workers answered")


async def test_drain_under_load_loses_nothing_and_undrain_resumes(deployment: Deployment,
                                                                   ops_env: dict[str, str]) -> None:
    load = Load(deployment.ws_url, ops_env["TOKEN"])
    try:
        result = await run_load_around(load, lambda: deployment.manage("drain", "--timeout", "15"))
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{deployment.log()}"
        lines = result.stdout.strip().splitlines()
        assert len(lines) == 2 and all(" drained in " in line for line in lines), result.stdout
        load.check_exactly_one_terminal()
        before = load.check_phase(0, {"done"})
        after = load.check_phase(2, {"draining"})
        load.check_phase(1, {"done", "draining"})
        assert before > 0 and after > 0, (before, after)
        assert any(o.text.startswith("/slow") and o.phase == 0 for o in load.events.values())
        # Drained workers keep their connections (a load balancer moves clients on `draining` or
        # /healthz 503) and refuse on fresh ones too.
        assert set(load.close_codes) == {1000}
        frames = await one_event(deployment.ws_url, ops_env["TOKEN"], "/ping")
        assert [f.get("code") for f in frames] == ["draining"]
        assert healthz(deployment) == 503
    finally:
        undrain = deployment.manage("undrain")
    assert undrain.returncode == 0, undrain.stderr
    assert undrain.stdout.count(": resumed") == 2
    frames = await one_event(deployment.ws_url, ops_env["TOKEN"], "/ping")
    assert [f["type"] for f in frames] == ["reply", "done"] and frames[0]["text"] == "pong"
    assert healthz(deployment) == 200


async def test_drain_timeout_names_the_straggler(deployment: Deployment, ops_env: dict[str, str]) -> None:
    async with connect(f"{deployment.ws_url}?token={ops_env['TOKEN']}") as ws:
        # Long enough to outlast the drain command's start-up (Django's, seconds on a loaded machine),
        # under the bundled plugin's 10 s budget: the drain must find it running.
        await ws.send(json.dumps({"id": "straggler", "type": "message", "text": f"/slow {STRAGGLER_MS}"}))
        started = await asyncio.to_thread(  # until its handler runs
            wait_until, lambda: any(a["pool"]["in_flight"] for a in deployment.status().values()), WAIT, 0.05)
        assert started, f"/slow {STRAGGLER_MS} never started in a worker's pool"
        try:
            result = await asyncio.to_thread(deployment.manage, "drain", "--timeout", "0.5")
            assert result.returncode == 1, f"{result.stdout}\n{result.stderr}"
            straggling = [line for line in result.stdout.splitlines() if "NOT drained (timeout)" in line]
            assert len(straggling) == 1 and "slow" in straggling[0].split("still running:")[1], result.stdout
            worker_id = straggling[0].split()[1].rstrip(":")
            assert f"1 of 2 workers did not drain within 0.5 s: {worker_id} (still running: " in result.stderr
            assert "1 events without done" in result.stderr
            # The straggler still completes, exactly once.
            frames = [json.loads(await asyncio.wait_for(ws.recv(), WAIT)) for _ in range(2)]
            assert [f["type"] for f in frames] == ["reply", "done"] and frames[0]["text"] == f"slept {STRAGGLER_MS}"
        finally:
            undrain = await asyncio.to_thread(deployment.manage, "undrain")
        assert undrain.returncode == 0, undrain.stderr


async def test_sigterm_under_load_loses_nothing(ops_env: dict[str, str]) -> None:
    d = await asyncio.to_thread(Deployment, ops_env, grace=15)
    try:
        load = Load(d.ws_url, ops_env["TOKEN"], stop_on_draining=True, linger=True)

        def sigterm() -> int:
            d.proc.send_signal(signal.SIGTERM)
            return d.proc.wait(60)

        code = await run_load_around(load, sigterm)
        assert code == 0, d.log()
        load.check_exactly_one_terminal()
        before = load.check_phase(0, {"done"})
        assert before > 0 and any(o.text.startswith("/slow") and o.phase == 0 for o in load.events.values())
        # Events sent while the workers drained were refused, never dropped after acceptance.
        for eid, o in load.events.items():
            if o.phase >= 1 and not o.terminals:
                assert not o.frames, f"{eid}: accepted but never done: {o.frames}"
        assert set(load.close_codes) <= {1012, 1000}, load.close_codes
        assert 1012 in load.close_codes, "a drained worker closes its connections with 1012 (service restart)"
        assert "NOT drained" not in d.log()
    finally:
        d.stop()
