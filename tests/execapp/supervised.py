"""A supervised server for the tests that hang, kill and restart its workers (test_watchdog, test_lifecycle)."""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

from execapp import watchdog
from tests.conftest import ServerProcess, wait_until


class SupervisedServer(ServerProcess):
    """``python -m execapp.serve --workers N`` with the test handlers, its own watchdog directory and
    ``settings`` (EXECAPP keys over tests/execapp/e2e_settings.py's); ready once N workers beat."""

    log_level = "warning"

    def __init__(self, env: dict[str, str], tmp: Path, workers: int = 1, settings: dict | None = None,
                 args: tuple[str, ...] = (), wait: bool = True, log_name: str = "supervised") -> None:
        self.workers = workers
        self.watch_dir = tmp / "watchdog"
        (tmp / "metrics").mkdir(exist_ok=True)
        self.env = env = {"REDIS_URL": "", **env, "DJANGO_SETTINGS_MODULE": "tests.execapp.e2e_settings",
                          "EXECAPP_TEST_SETTINGS": json.dumps(settings or {}), watchdog.ENV_DIR: str(self.watch_dir),
                          "PROMETHEUS_MULTIPROC_DIR": str(tmp / "metrics")}
        super().__init__(["execapp.serve", "--workers", str(workers), "--log-level", self.log_level,
                          "--no-access-log", *args], env, log_name)
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws/events/?token={env['TOKEN']}"
        if wait:
            try:
                assert wait_until(lambda: len(self.ready_pids()) >= workers and self.healthz()[0] == 200, 60), \
                    self.log()
            except BaseException:
                self.stop()
                raise

    def slots(self) -> list[dict[str, Any]]:
        """The watchdog slots as the supervisor's file holds them ([] before it exists)."""
        try:
            return watchdog.SlotFile.open(self.watch_dir / watchdog.SLOTS_FILE).read()
        except watchdog.WatchdogError:
            return []

    def ready_pids(self) -> set[int]:
        """Pids of the workers that listen now (their loop beating)."""
        return {s["pid"] for s in self.slots() if s["state"] == "ready" and s["heartbeat_age"] is not None
                and s["heartbeat_age"] < 1.0}

    def healthz(self) -> tuple[int, dict]:
        """(HTTP status, body) of GET /healthz; (0, {}) when nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")
        except OSError:
            return 0, {}


class InfoServer(SupervisedServer):
    """A supervised server logging at info: the tests read the supervisor's decisions from its log."""

    log_level = "info"


def alive(pid: int) -> bool:
    """True while process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def starter(db_env: dict[str, str], tmp_path: Path, make: Callable[..., SupervisedServer]
            ) -> Iterator[Callable[..., SupervisedServer]]:
    """A ``start`` fixture's body: each server gets a copy of ``db_env``'s migrated database (profiles
    persist between tests otherwise) and is stopped at the test's end."""
    servers: list[SupervisedServer] = []

    def _start(*args: Any, env: dict[str, str] | None = None, **kwargs: Any) -> SupervisedServer:
        db = tmp_path / "db.sqlite3"
        db.write_bytes(Path(db_env["DATABASE_URL"].removeprefix("sqlite:///")).read_bytes())
        server = make({**db_env, "DATABASE_URL": f"sqlite:///{db}", **(env or {})}, tmp_path, *args, **kwargs)
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.stop()
