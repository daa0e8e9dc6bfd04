"""Shared fixtures: real services (Redis, PostgreSQL) and a real ASGI server in a subprocess.

Under CI (``EXECAPP_REQUIRE_SERVICES=1``) a missing service fails the test that needs it;
elsewhere it skips with the reason, so a laptop without Redis can still run the rest.

Runs of the suite on one machine share its Redis and PostgreSQL without meeting: each run writes
Redis keys under its own prefix only (``REDIS_RUN_PREFIX``; nobody flushes a database) and gets
its own PostgreSQL database (``postgres_url``); both are deleted when the run ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The Redis the runs share (one database for all: runs are told apart by key prefix, not flushed).
REDIS_TEST_URL = os.environ.get("REDIS_TEST_URL", "redis://127.0.0.1:6379/15")
#: The PostgreSQL database each run connects to first, to create (and drop) a database of its own.
POSTGRES_TEST_URL = os.environ.get("POSTGRES_TEST_URL", "postgres://postgres@127.0.0.1:5432/test")

#: This run's id: the pid tells whose it is, the random part keeps a recycled pid apart.
RUN_ID = f"{os.getpid()}-{secrets.token_hex(4)}"
#: Every Redis key of this run starts with it: the channel layer's and the app's (conf.redis_key)
#: in this process, and those of the servers the tests start (their REDIS_PREFIX).
REDIS_RUN_PREFIX = f"execapp-test-{RUN_ID}"
# Servers the tests start inherit the environment: a server given REDIS_URL and no REDIS_PREFIX
# of its own still writes inside this run's namespace.
os.environ["REDIS_PREFIX"] = REDIS_RUN_PREFIX


#: Test modules whose assertions are a sandbox's budget on the wall clock (a hostile guest stopped
#: within its deadline): under ``make test``'s two pytest-xdist processes they run one after
#: another in one process (``--dist loadgroup``), never two CPU-bound guests at once on a 2-core
#: machine, while the other process takes the server and database tests.
SANDBOX_TESTS = ROOT / "tests" / "plugins"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put every test under ``SANDBOX_TESTS`` in one xdist group (see SANDBOX_TESTS)."""
    group = pytest.mark.xdist_group("sandbox")
    for item in items:
        if Path(str(item.path)).is_relative_to(SANDBOX_TESTS):
            item.add_marker(group)


def _reachable(url: str) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=1.0):
            return True
    except OSError:
        return False


#: Seconds a test waits for work that must happen before calling it lost (a liveness bound, not a timing).
LIVENESS = 10.0


def wait_until(predicate: Callable[[], Any], timeout: float = LIVENESS, interval: float = 0.001) -> bool:
    """Poll ``predicate`` every ``interval`` seconds until it holds; False if it never did within
    ``timeout``. A larger ``interval`` for predicates that cost something (a subprocess, a scrape)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


async def wait_until_async(predicate: Callable[[], Any], timeout: float = LIVENESS, interval: float = 0.001) -> bool:
    """``wait_until`` for a test on an event loop: polls without blocking the loop, so the work
    it waits for (on the same loop) goes on meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(interval)
    return True


def require_service(name: str, url: str) -> str:
    """Return ``url`` if the service answers; otherwise fail under CI, skip elsewhere."""
    if _reachable(url):
        return url
    message = f"{name} is not reachable at {url}"
    if os.environ.get("EXECAPP_REQUIRE_SERVICES", "") in ("1", "true", "yes"):
        pytest.fail(f"{message} and EXECAPP_REQUIRE_SERVICES=1: start it (see README)")
    pytest.skip(message)


def redis_test_prefix(tag: str) -> str:
    """A fresh key prefix inside this run's namespace, for one test or one server (``tag`` says whose)."""
    return f"{REDIS_RUN_PREFIX}-{tag}-{secrets.token_hex(4)}"


def delete_redis_keys(url: str, prefix: str) -> int:
    """Delete every key starting with ``prefix`` (SCAN MATCH, never KEYS or FLUSHDB); how many."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10)
    try:
        deleted, batch = 0, []
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += client.delete(*batch)
                batch = []
        if batch:
            deleted += client.delete(*batch)
        return deleted
    finally:
        client.close()


def _with_layer_prefix(layers: dict[str, Any], prefix: str) -> dict[str, Any]:
    """CHANNEL_LAYERS with the default layer's key prefix set (any backend: in-memory ignores it)."""
    from channels import DEFAULT_CHANNEL_LAYER

    layer = dict(layers.get(DEFAULT_CHANNEL_LAYER) or {"BACKEND": "channels.layers.InMemoryChannelLayer"})
    layer["CONFIG"] = {**(layer.get("CONFIG") or {}), "prefix": prefix}
    return {**layers, DEFAULT_CHANNEL_LAYER: layer}


@pytest.fixture(scope="session", autouse=True)
def _redis_run_namespace() -> Iterator[None]:
    """This process's default channel layer prefix is the run's; at the end, the run's keys go.

    Runs before any test (session, autouse) and ends after every server fixture has stopped.
    """
    from django.conf import settings
    from django.test import override_settings

    # override_settings, not assignment: channels drops layers built from the old settings.
    namespaced = override_settings(CHANNEL_LAYERS=_with_layer_prefix(settings.CHANNEL_LAYERS, REDIS_RUN_PREFIX))
    namespaced.enable()
    yield
    namespaced.disable()
    if _reachable(REDIS_TEST_URL):
        delete_redis_keys(REDIS_TEST_URL, REDIS_RUN_PREFIX)


@pytest.fixture
def redis_url(settings: Any) -> str:
    """A reachable Redis URL, with a key prefix of this test alone in the channel layer settings:
    the app's keys (conf.redis_key) start in an empty namespace, as a flushed database would give,
    without touching anyone else's keys."""
    url = require_service("Redis", REDIS_TEST_URL)
    settings.CHANNEL_LAYERS = _with_layer_prefix(settings.CHANNEL_LAYERS, redis_test_prefix("t"))
    return url


def _database_url(base: str, name: str) -> str:
    return urlparse(base)._replace(path=f"/{name}").geturl()


@contextlib.contextmanager
def empty_postgres_database(name: str) -> Iterator[str]:
    """The URL of a new empty PostgreSQL database ``name`` (through POSTGRES_TEST_URL), dropped after."""
    import psycopg

    base = require_service("PostgreSQL", POSTGRES_TEST_URL)
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _database_url(base, name)
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            # FORCE: a server a test started may still hold a connection (PostgreSQL 13+).
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """This run's own PostgreSQL database (``test_execapp_<pid>_<random>``), created empty on first
    use and dropped when the run ends; tests may migrate it."""
    with empty_postgres_database("test_execapp_" + RUN_ID.replace("-", "_")) as url:
        yield url


@pytest.fixture
def install_worker() -> Iterator[Callable[[Any], Any]]:
    """Install a Worker as this process's worker for one test (what ``get_worker()``, the views and
    the consumers see): ``install_worker(w)`` returns ``w``; the previous worker is put back after."""
    from execapp.worker import current_worker, set_worker

    previous = current_worker()

    def install(worker: Any) -> Any:
        set_worker(worker)
        return worker

    yield install
    set_worker(previous)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    """uvicorn serving ``app`` on an event loop (uvloop, or asyncio's) in a thread of this process,
    as a context manager; ``config``: more of uvicorn.Config's arguments (its ``http=``, ``ws=``)."""

    def __init__(self, app: Any, loop: str = "uvloop", **config: Any) -> None:
        import threading

        import uvicorn
        import uvloop

        self.server = uvicorn.Server(uvicorn.Config(app, port=free_port(), lifespan="off", log_level="warning",
                                                    access_log=False, **config))
        self.loop = uvloop.new_event_loop() if loop == "uvloop" else asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.server.serve(),), daemon=True)

    def __enter__(self) -> Any:
        self.thread.start()
        assert wait_until(lambda: self.server.started, 10), "the in-process server did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.loop.close()

    @property
    def port(self) -> int:
        return int(self.server.config.port)


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

    def log(self, tail: int | None = 6000) -> str:
        """The end of the server's output (its last ``tail`` characters; None: all of it)."""
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text if tail is None else text[-tail:]

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
        """Return once the server accepts connections; raise if it exits or never listens."""
        def listening() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return True
            except OSError:
                return False

        if not wait_until(listening, timeout, interval=0.05):
            raise RuntimeError(f"server did not listen within {timeout}s: {self.log()}")


def manage(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python manage.py ...`` in a subprocess, as an operator would."""
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def migrated_token_env(directory: Path, token_name: str) -> dict[str, str]:
    """Environment for subprocess servers on one migrated SQLite file in ``directory``, with the
    plaintext of one API token named ``token_name`` as ``TOKEN``."""
    env = {"DATABASE_URL": f"sqlite:///{directory / 'db.sqlite3'}"}
    result = manage("migrate", "--noinput", env=env)
    assert result.returncode == 0, result.stderr
    token = manage("create_token", token_name, env=env)
    assert token.returncode == 0, token.stderr
    return {**env, "TOKEN": token.stdout.strip().splitlines()[-1]}


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


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``time.monotonic`` as a tests.engine.helpers.ManualClock the test moves by hand (for tests
    without an event loop: asyncio reads the same clock)."""
    from .engine.helpers import ManualClock

    manual = ManualClock()
    monkeypatch.setattr(time, "monotonic", manual)
    return manual


@pytest.fixture
def flood_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[str]]]:
    """(release, held): password checks of the username "flood" are held running (each listed in
    ``held``) until ``release`` is set (at the latest when the test ends); every other sign-in is
    checked as ever."""
    from django.contrib.auth.backends import ModelBackend

    release = threading.Event()
    held: list[str] = []
    real = ModelBackend.authenticate

    def holding(self: Any, request: Any, username: str | None = None, password: str | None = None,
                **kwargs: Any) -> Any:
        if username != "flood":
            return real(self, request, username, password, **kwargs)
        held.append(username)
        release.wait(LIVENESS * 3)  # a password check the flood keeps running
        return None

    monkeypatch.setattr(ModelBackend, "authenticate", holding)
    yield release, held
    release.set()


@pytest.fixture(autouse=True)
def _fresh_login_throttle() -> None:
    """Each test starts with no failed sign-ins counted (execapp/login_throttle.py keeps them per
    process: one test's wrong passwords from 127.0.0.1 would throttle the next test's)."""
    from execapp import login_throttle

    login_throttle._current = None


@pytest.fixture(autouse=True)
def _no_remembered_refusals() -> Iterator[None]:
    """Each test validates its plugins afresh: a refusal is remembered for a few seconds per spec
    (plugins.loaded), and a test that tightens a runtime's limits must not see the one before's."""
    yield
    from plugins import loaded

    loaded.forget_refusals()
