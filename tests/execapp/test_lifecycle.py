"""The worker lifecycle attacked from outside: an impatient operator, workers that die or crash at
every start, a drained deployment that loses a worker.

Real ``python -m execapp.serve`` processes on SQLite with the Python test handlers of
ws_handlers.py (``/slow N`` sleeps N ms in the pool, ``/stall`` answers with its pid). Time bounds
are liveness bounds (far from the mechanism's own numbers), never performance assertions.
"""
from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from websockets.asyncio.client import connect

from execapp import watchdog
from tests.conftest import ServerProcess, manage, wait_until

pytestmark = pytest.mark.e2e

#: A worker process start (imports, Django, the first service ticks) on a busy 2-core machine.
START_BOUND = 30.0
WAIT = 20.0


class Server(ServerProcess):
    """``python -m execapp.serve`` with the test handlers, its own watchdog directory and settings."""

    def __init__(self, env: dict[str, str], tmp: Path, workers: int = 1, settings: dict | None = None,
                 args: tuple[str, ...] = (), wait: bool = True) -> None:
        self.watch_dir = tmp / "watchdog"
        (tmp / "metrics").mkdir(exist_ok=True)
        env = {"REDIS_URL": "", **env, "DJANGO_SETTINGS_MODULE": "tests.execapp.e2e_settings",
               "EXECAPP_TEST_SETTINGS": json.dumps(settings or {}), watchdog.ENV_DIR: str(self.watch_dir),
               "PROMETHEUS_MULTIPROC_DIR": str(tmp / "metrics")}
        self.env = env
        super().__init__(["execapp.serve", "--workers", str(workers), "--log-level", "info", "--no-access-log",
                          *args], env, "lifecycle")
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws/events/?token={env['TOKEN']}"
        if wait:
            try:
                assert wait_until(lambda: len(self.ready_pids()) >= workers and self.healthz() == 200, 60), self.log()
            except BaseException:
                self.stop()
                raise

    def slots(self) -> list[dict[str, Any]]:
        try:
            return watchdog.SlotFile.open(self.watch_dir / watchdog.SLOTS_FILE).read()
        except watchdog.WatchdogError:
            return []

    def ready_pids(self) -> set[int]:
        return {s["pid"] for s in self.slots() if s["state"] == "ready" and s["heartbeat_age"] is not None
                and s["heartbeat_age"] < 1.0}

    def healthz(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0


@pytest.fixture(scope="module")
def db_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One migrated SQLite file and one API token for this module's servers."""
    env = {"DATABASE_URL": f"sqlite:///{tmp_path_factory.mktemp('lifecycle-db') / 'db.sqlite3'}"}
    result = manage("migrate", "--noinput", env=env)
    assert result.returncode == 0, result.stderr
    token = manage("create_token", "lifecycle", env=env)
    assert token.returncode == 0, token.stderr
    return {**env, "TOKEN": token.stdout.strip().splitlines()[-1]}


@pytest.fixture
def start(db_env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    servers: list[Server] = []

    def _start(**kwargs: Any) -> Server:
        db = tmp_path / "db.sqlite3"
        db.write_bytes(Path(db_env["DATABASE_URL"].removeprefix("sqlite:///")).read_bytes())
        env = {**db_env, "DATABASE_URL": f"sqlite:///{db}", **kwargs.pop("env", {})}
        server = Server(env, tmp_path, **kwargs)
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.stop()


async def first_frame(url: str, text: str, eid: str) -> dict:
    async with connect(url, open_timeout=5) as ws:
        await ws.send(json.dumps({"id": eid, "type": "message", "text": text}))
        return json.loads(await asyncio.wait_for(ws.recv(), WAIT))


# -- an impatient operator ------------------------------------------------------------------------

async def test_a_second_signal_to_the_supervisor_forces_the_draining_workers_out(start: Any) -> None:
    """SIGTERM drains for up to the grace; a second signal sent to the supervisor's pid (not a
    terminal's Ctrl+C, which reaches every process) used to be recorded and ignored: the server
    went on waiting the whole grace for a handler that sleeps 60 s."""
    server = await asyncio.to_thread(start, args=("--grace", "60"))
    async with connect(server.ws_url) as ws:
        await ws.send(json.dumps({"id": "long", "type": "message", "text": "/slow 60000"}))
        await ws.send(json.dumps({"id": "probe", "type": "message", "text": "/stall"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), WAIT))["id"] == "probe"  # /slow was accepted before it
        server.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(wait_until, lambda: "draining worker" in server.log(), WAIT), server.log()
        server.proc.send_signal(signal.SIGINT)
        # Far below the 60 s grace: the forced workers abandon the drain and exit.
        await asyncio.to_thread(server.proc.wait, WAIT)
    log = server.log()
    assert "second signal (SIGINT) while the workers drain: forcing them to exit now" in log, log
    assert "NOT drained (aborted)" in log, log
