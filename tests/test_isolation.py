"""Runs of the suite on one machine never meet: each run's Redis keys live under its own prefix
(nobody flushes a database) and it has its own PostgreSQL database; both are gone when it ends."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    POSTGRES_TEST_URL,
    REDIS_RUN_PREFIX,
    REDIS_TEST_URL,
    ROOT,
    RUN_ID,
    delete_redis_keys,
    redis_test_prefix,
    require_service,
)
from tests.isolation_probe import PROBE_OUT


def test_no_test_flushes_a_redis_database() -> None:
    # Another run's keys live in the same database: a flush there fails that run's tests. A test
    # that starts a redis-server of its own may flush that one, on a line saying so.
    banned = ("flush" + "db(", "flush" + "all(")
    offenders = [f"{path.relative_to(ROOT)}: {word}" for path in sorted((ROOT / "tests").rglob("*.py"))
                 for line in path.read_text().splitlines() for word in banned
                 if word in line and "# own redis-server" not in line]
    assert offenders == [], "delete this run's keys instead (tests.conftest.delete_redis_keys)"


def test_the_apps_redis_keys_are_in_the_runs_namespace_by_default() -> None:
    from execapp import conf

    assert conf.redis_key("execapp:obs:workers") == f"{REDIS_RUN_PREFIX}:execapp:obs:workers"
    # Servers the tests start inherit it as their REDIS_PREFIX.
    assert os.environ["REDIS_PREFIX"] == REDIS_RUN_PREFIX
    assert str(os.getpid()) in RUN_ID


@pytest.mark.redis
def test_a_redis_test_gets_a_namespace_of_its_own_inside_the_runs(redis_url: str) -> None:
    from execapp import conf

    key = conf.redis_key("execapp:plugins:kv:counter")
    assert key.startswith(REDIS_RUN_PREFIX + "-t-") and key != f"{REDIS_RUN_PREFIX}:execapp:plugins:kv:counter"


@pytest.mark.redis
def test_deleting_a_prefix_takes_its_keys_and_leaves_its_neighbours(redis_url: str) -> None:
    import redis

    mine, neighbour = redis_test_prefix("del"), redis_test_prefix("del")
    client = redis.Redis.from_url(redis_url)
    try:
        for prefix in (mine, neighbour):
            client.set(f"{prefix}:a", "1", ex=600)
            client.hset(f"{prefix}:h", "f", "1")
            client.rpush(f"{prefix}specific.x!y", "m")  # channels_redis: prefix + channel, no separator
        assert delete_redis_keys(redis_url, mine) == 3
        assert not client.exists(f"{mine}:a", f"{mine}:h", f"{mine}specific.x!y")
        assert client.exists(f"{neighbour}:a", f"{neighbour}:h", f"{neighbour}specific.x!y") == 3
    finally:
        delete_redis_keys(redis_url, neighbour)
        client.close()


@pytest.mark.postgres
def test_the_run_has_a_postgres_database_of_its_own(postgres_url: str) -> None:
    import psycopg

    with psycopg.connect(postgres_url) as conn:
        name = conn.execute("SELECT current_database()").fetchone()[0]
    assert name == "test_execapp_" + RUN_ID.replace("-", "_")
    assert name != POSTGRES_TEST_URL.rsplit("/", 1)[1]


@pytest.mark.redis
@pytest.mark.postgres
def test_a_run_leaves_no_database_and_no_redis_keys_behind(tmp_path: Path) -> None:
    import psycopg
    import redis

    require_service("Redis", REDIS_TEST_URL)
    base = require_service("PostgreSQL", POSTGRES_TEST_URL)
    out = tmp_path / "probe.json"
    env = {**os.environ, PROBE_OUT: str(out), "EXECAPP_REQUIRE_SERVICES": "1"}
    # A whole pytest run of its own (hypothesis' plugin left out: seconds of import, unused there).
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                          "tests/isolation_probe.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    used = json.loads(out.read_text())
    # It had its own of each, not ours ...
    assert used["prefix"] != REDIS_RUN_PREFIX and used["prefix"].startswith("execapp-test-")
    assert used["database"] == used["url_database"] != "test_execapp_" + RUN_ID.replace("-", "_")
    assert all(key.startswith(used["prefix"]) for key in used["keys"])
    # ... and both are gone now that it has ended.
    with psycopg.connect(base) as conn:
        assert conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (used["database"],)).fetchone() is None
    client = redis.Redis.from_url(REDIS_TEST_URL)
    try:
        assert list(client.scan_iter(match=f"{used['prefix']}*", count=1000)) == []
    finally:
        client.close()
