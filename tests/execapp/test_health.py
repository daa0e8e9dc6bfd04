"""A truthful /healthz: 503 naming the database or the channel layer's Redis while either does not
answer, 200 again by itself once it does; each check bounded in time and shared by all probes."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from django.db import connections

from execapp import health
from execapp import worker as worker_module
from execapp.drain import drain_worker
from tests.conftest import LIVENESS, free_port, wait_until


def get_health(url: str) -> tuple[int, dict[str, Any]]:
    """GET <url>/healthz: (status, JSON body)."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=LIVENESS) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def silent_port() -> Iterator[tuple[int, socket.socket]]:
    """A port that completes TCP handshakes (the kernel's backlog) and never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield listener.getsockname()[1], listener
    listener.close()


def postgres_at(port: int) -> dict[str, Any]:
    """Django settings of a PostgreSQL database at 127.0.0.1:<port>."""
    return {**connections.settings["default"], "ENGINE": "django.db.backends.postgresql", "NAME": "test",
            "USER": "postgres", "PASSWORD": "", "HOST": "127.0.0.1", "PORT": port, "OPTIONS": {}}


def accepted(listener: socket.socket) -> int:
    """How many connections wait in the listener's backlog (accepts and counts them)."""
    listener.setblocking(False)
    count = 0
    while True:
        try:
            listener.accept()[0].close()
        except BlockingIOError:
            return count
        count += 1


# -- the probe: bounded, cached, one check in flight --------------------------------------------

def test_a_silent_database_gets_a_bounded_answer_and_one_connection(
        silent_port: tuple[int, socket.socket]) -> None:
    port, listener = silent_port
    probe = health.DependencyProbe("database", "silent", lambda t: health.check_database(postgres_at(port), t))
    answers: list[str | None] = []

    def ask() -> None:
        answers.append(probe.failure(timeout=0.3, max_age=5.0))

    started = time.monotonic()
    threads = [threading.Thread(target=ask) for _ in range(10)]  # ten probes at once
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIVENESS)
    assert time.monotonic() - started < 2 * 0.3 + 0.5  # within 2x the timeout + 0.5 s, not libpq's 2 s
    assert answers == ["no answer within 0.3 s"] * 10
    assert probe.failure(timeout=0.3, max_age=5.0) == "no answer within 0.3 s"  # cached: answered at once
    seen = [0]  # accepted() takes what waits in the backlog: count every connection, not the last batch

    def connections() -> int:
        seen[0] += accepted(listener)
        return seen[0]

    assert wait_until(lambda: connections() >= 1)
    # Kept: an absence can only be watched for a while. Every probe's check had started before
    # its answer came back, so a second connection is at most a thread start away.
    time.sleep(0.2)
    assert connections() == 1  # ten probes, one connection


def test_silent_dependencies_are_checked_at_once_not_one_after_another(
        silent_port: tuple[int, socket.socket], settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    port, _ = silent_port
    settings.EXECAPP = {"HEALTH_CHECK_TIMEOUT_SECONDS": 0.5, "HEALTH_CHECK_CACHE_SECONDS": 5.0}
    probes = [health.DependencyProbe(f"pg{i}", "silent", lambda t: health.check_database(postgres_at(port), t))
              for i in range(2)]
    probes += [health.DependencyProbe(f"redis{i}", "silent", health.redis_checker(f"redis://127.0.0.1:{port}/0"))
               for i in range(2)]
    monkeypatch.setattr(health, "dependency_probes", lambda: probes)  # four silent services instead of two
    started = time.monotonic()
    failures = health.dependency_failures()
    assert time.monotonic() - started < 2 * 0.5 + 0.5  # one timeout for all four (in a row: 2 s)
    assert failures == {p.name: "no answer within 0.5 s" for p in probes}


def test_a_database_that_comes_back_is_healthy_again_by_itself(tmp_path: Path) -> None:
    sqlite = {**connections.settings["default"], "ENGINE": "django.db.backends.sqlite3",
              "NAME": str(tmp_path / "missing-dir" / "db.sqlite3"), "OPTIONS": {}}
    probe = health.DependencyProbe("database", "sqlite", lambda t: health.check_database(sqlite, t))
    assert probe.failure(timeout=1.0, max_age=0.05) == "cannot connect (OperationalError)"
    (tmp_path / "missing-dir").mkdir()
    assert wait_until(lambda: probe.failure(timeout=1.0, max_age=0.05) is None)


@pytest.mark.postgres
def test_a_reachable_postgres_is_healthy(postgres_url: str) -> None:
    port = int(postgres_url.rsplit(":", 1)[1].split("/")[0])
    probe = health.DependencyProbe("database", "pg", lambda t: health.check_database(postgres_at(port), t))
    assert probe.failure(timeout=2.0, max_age=1.0) is None


# -- the view, in process --------------------------------------------------------------------

@pytest.fixture
def process_worker(settings: Any, monkeypatch: pytest.MonkeyPatch,
                   install_worker: Any) -> Iterator[worker_module.Worker]:
    """A ready Worker without services, installed as this process's worker (what /healthz reports on)."""
    settings.EXECAPP = {"POOL_MAX_WORKERS": 2, "HEALTH_CHECK_TIMEOUT_SECONDS": 0.5,
                        "HEALTH_CHECK_CACHE_SECONDS": 0.05}
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", [])
    worker = worker_module.Worker("health-test")
    worker.start()
    assert worker.ready.wait(LIVENESS)
    install_worker(worker)
    yield worker
    worker.stop(timeout=5)


@pytest.mark.django_db
def test_healthz_names_the_channel_layer_while_its_redis_is_down(process_worker: worker_module.Worker,
                                                                client: Any, settings: Any) -> None:
    dead = free_port()
    settings.REDIS_URL = f"redis://:secret@127.0.0.1:{dead}/0"
    response = client.get("/healthz")
    body = response.json()
    assert response.status_code == 503 and body["status"] == "unavailable"
    assert body["unavailable"] == {"channel_layer": "cannot connect (ConnectionError)"}  # the database answers
    assert "secret" not in response.content.decode() and str(dead) not in response.content.decode()
    drain_worker(process_worker, LIVENESS)
    draining = client.get("/healthz")  # a drain answers at once, without waiting for any check
    assert draining.status_code == 503 and draining.json()["status"] == "draining"
    assert "unavailable" not in draining.json()
    process_worker.set_draining(False)
    settings.REDIS_URL = ""
    ok = client.get("/healthz")
    assert ok.status_code == 200 and ok.json() == {"status": "ok", "worker": "health-test", "draining": False,
                                                   "events_in_flight": 0}


# -- a real server -----------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_server_whose_database_and_redis_are_unreachable_answers_503_naming_them(
        asgi_server_factory: Any) -> None:
    db_port, redis_port = free_port(), free_port()
    server = asgi_server_factory({"DATABASE_URL": f"postgres://postgres@127.0.0.1:{db_port}/test",
                                  "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"})
    status, body = get_health(server.url)
    assert status == 503 and body["status"] == "unavailable", body
    assert set(body["unavailable"]) == {"database", "channel_layer"}, body
    assert "cannot connect" in body["unavailable"]["database"]
    assert "is unreachable" in server.log() and f"127.0.0.1:{db_port}" in server.log()  # the details: in the log


class RedisServer:
    """Our own redis-server on a free port (not the shared one), to kill and restart."""

    def __init__(self, port: int | None = None) -> None:
        if shutil.which("redis-server") is None:
            from tests.conftest import require_service

            require_service("redis-server (the binary)", "redis://127.0.0.1:1")  # fails under CI, skips elsewhere
        self.port = port or free_port()
        self.proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(self.port),
                                      "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(self._listening), "redis-server did not start"

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(LIVENESS)


@pytest.mark.e2e
def test_healthz_follows_redis_down_and_back_up(asgi_server_factory: Any, sqlite_env: dict[str, str]) -> None:
    redis = RedisServer()
    try:
        server = asgi_server_factory({**sqlite_env, "REDIS_URL": f"redis://127.0.0.1:{redis.port}/0"})
        assert wait_until(lambda: get_health(server.url)[0] == 200), (get_health(server.url), server.log())
        redis.kill()
        assert wait_until(lambda: get_health(server.url)[0] == 503), server.log()
        status, body = get_health(server.url)
        assert body["status"] == "unavailable" and set(body["unavailable"]) == {"channel_layer"}, body
        redis = RedisServer(redis.port)  # back, on the same port
        assert wait_until(lambda: get_health(server.url)[0] == 200), (get_health(server.url), server.log())
    finally:
        redis.kill()


def test_a_redis_that_refuses_writes_is_unavailable() -> None:
    # A Redis at its maxmemory answers PING while every write fails (OutOfMemoryError): sessions,
    # resend records and drains of every tenant failed for 21 s while /healthz said ok.
    import redis as redis_py

    server = RedisServer()
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        probe = health.DependencyProbe("channel_layer", "test", health.redis_checker(url))
        assert probe.failure(1.0, 0.0) is None
        redis_py.Redis(port=server.port).config_set("maxmemory", 1)  # our own redis-server: full at once
        assert probe.failure(1.0, 0.0) == "cannot connect (OutOfMemoryError)"
    finally:
        server.kill()
