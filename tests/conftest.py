"""Shared fixtures: real services (Redis, PostgreSQL) and a real ASGI server in a subprocess.

Under CI (``EXECAPP_REQUIRE_SERVICES=1``) a missing service fails the test that needs it;
elsewhere it skips with the reason, so a laptop without Redis can still run the rest.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
REDIS_TEST_URL = os.environ.get("REDIS_TEST_URL", "redis://127.0.0.1:6379/15")
POSTGRES_TEST_URL = os.environ.get("POSTGRES_TEST_URL", "postgres://postgres@127.0.0.1:5432/test")


def _reachable(url: str) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=1.0):
            return True
    except OSError:
        return False


#: Seconds a test waits for work that must happen before calling it lost (a liveness bound, not a timing).
LIVENESS = 10.0


def wait_until(predicate: Callable[[], bool], timeout: float = LIVENESS) -> bool:
    """Poll ``predicate`` until it holds; False if it never did within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def require_service(name: str, url: str) -> str:
    """Return ``url`` if the service answers; otherwise fail under CI, skip elsewhere."""
    if _reachable(url):
        return url
    message = f"{name} is not reachable at {url}"
    if os.environ.get("EXECAPP_REQUIRE_SERVICES", "") in ("1", "true", "yes"):
        pytest.fail(f"{message} and EXECAPP_REQUIRE_SERVICES=1: start it (see README)")
    pytest.skip(message)


@pytest.fixture
def redis_url() -> str:
    """A reachable Redis URL (database 15, flushed before the test)."""
    url = require_service("Redis", REDIS_TEST_URL)
    import redis

    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture
def postgres_url() -> str:
    """A reachable PostgreSQL URL (the machine's `test` database)."""
    return require_service("PostgreSQL", POSTGRES_TEST_URL)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess (``python -m <args> --port <free port>``) with its own log file."""

    def __init__(self, args: list[str], env: dict[str, str], log_name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(f"/tmp/execapp-{log_name}-{self.port}.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", *args, "--port", str(self.port)], cwd=ROOT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        """The end of the server's output, for failure messages."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, as a container stop would; kill only if it outlives ``timeout``."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class AsgiServer(ServerProcess):
    """A real uvicorn process serving config.asgi, for end-to-end tests."""

    def __init__(self, env: dict[str, str], workers: int = 1) -> None:
        super().__init__(["uvicorn", "config.asgi:application", "--host", "127.0.0.1", "--workers", str(workers),
                          "--ws-per-message-deflate", "false", "--lifespan", "off", "--log-level", "warning"],
                         env, "e2e")
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.wait_ready()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"server did not listen within {timeout}s: {self.log()}")


def manage(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python manage.py ...`` in a subprocess, as an operator would."""
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def sqlite_env(tmp_path: Path) -> dict[str, str]:
    """Environment for a subprocess server on its own migrated SQLite file."""
    env = {"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}
    result = manage("migrate", "--noinput", env=env)
    assert result.returncode == 0, result.stderr
    return env


@pytest.fixture
def asgi_server_factory() -> Iterator:
    """Start real ASGI servers with a given environment; all are stopped after the test."""
    servers: list[AsgiServer] = []

    def start(env: dict[str, str], workers: int = 1) -> AsgiServer:
        server = AsgiServer(env, workers)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
