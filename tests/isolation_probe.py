"""A one-test run for tests/test_isolation.py (not collected by the suite: no test_ prefix).

Run as its own pytest process, it uses this run's PostgreSQL database and Redis namespace the way
the suite's tests do, and writes down their names; the caller then checks that the run left
neither behind.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from tests.conftest import REDIS_RUN_PREFIX

#: Where the probe writes what it used (set by the caller).
PROBE_OUT = "EXECAPP_ISOLATION_PROBE_OUT"


@pytest.mark.redis
@pytest.mark.postgres
def test_probe_uses_the_runs_database_and_redis_namespace(postgres_url: str, redis_url: str, settings: Any) -> None:
    import psycopg
    import redis

    from execapp.conf import redis_key

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE probe (n int)")  # the database is the run's to change
        database = conn.execute("SELECT current_database()").fetchone()[0]
    client = redis.Redis.from_url(redis_url)
    keys = [redis_key("probe:app"), f"{REDIS_RUN_PREFIX}:probe:run"]
    for key in keys:
        client.set(key, "1", ex=600)  # an expiry in case the run's clean-up were missing: the check fails anyway
    client.close()
    Path(os.environ[PROBE_OUT]).write_text(json.dumps({
        "database": database, "url_database": urlparse(postgres_url).path.lstrip("/"),
        "prefix": REDIS_RUN_PREFIX, "keys": keys}))
