"""A KV write on the database waits for its lock no longer than the call's budget (plugins.kv_deadline).

Another connection holds the lock kv_set and kv_incr take first (SQLite's write lock; PostgreSQL's
KVUsage row), as ``loadplugins``, an admin's edit or a stuck writer of another worker may. Off the
event loop the write waited for the database's own limit: 20.1 s of a 0.2 s budget on SQLite (its
busy timeout), for ever on PostgreSQL. Run in a process of its own on a real database file or server
(the test database of pytest-django is an in-memory SQLite, whose locks fail at once).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, manage

pytestmark = pytest.mark.e2e

# {hold} takes the lock in another connection as ``holder``; {release} lets it go, 3 s later (a write
# that waits for the lock returns then, without the fix).
_SCRIPT = """
import json, threading, time
from plugins import kv
from plugins.runtimes.host import Host
from plugins.spec import PluginSpec
kv.kv_store().set("held", "n", "1", 5.0)  # the plugin's KVUsage row and its key exist
{hold}
release = threading.Timer(3.0, lambda: {release})
release.start()
spec = PluginSpec(name="held", runtime="lua", code="", permissions=frozenset({{"kv"}}), timeout=0.2)
results = {{}}
for call, args in {calls}:
    host = Host(spec, time.monotonic() + 0.2)
    started = time.monotonic()
    try:
        getattr(host, call)(*args)
        outcome = "returned"
    except Exception as exc:
        outcome = type(exc).__name__ + ": " + str(exc)
    results[call] = [time.monotonic() - started, outcome]
release.join()
results["after"] = kv.kv_store().incr("held", "n", 1, 5.0)
print("RESULT " + json.dumps(results))
"""


WRITES = (("kv_incr", ("n",)), ("kv_set", ("n", "5")))


def _run(env: dict[str, str], hold: str, release: str, calls: tuple = WRITES) -> dict:
    script = _SCRIPT.format(hold=hold, release=release, calls=repr(calls))
    proc = subprocess.run([sys.executable, "manage.py", "shell", "-c", script],
                          cwd=ROOT, env={**os.environ, "REDIS_URL": "", **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def _check(results: dict, calls: tuple = WRITES) -> None:
    for call, _ in calls:
        took, outcome = results[call]
        assert outcome.startswith(f"GuestTimeout: {call}: the KV store did not answer before the plugin's deadline"), \
            results
        assert took < 1.0, f"{call} took {took:.2f} s of its 0.2 s budget"
    assert results["after"] == 2  # neither write that timed out landed; the lock's holder gone, writes work


def test_a_held_sqlite_write_lock_ends_a_kv_write_at_the_call_s_deadline(sqlite_env: dict[str, str]) -> None:
    path = sqlite_env["DATABASE_URL"].removeprefix("sqlite:///")
    assert Path(path).exists()
    _check(_run(sqlite_env,
                f"import sqlite3\nholder = sqlite3.connect({path!r}, isolation_level=None, check_same_thread=False)\n"
                "holder.execute('BEGIN IMMEDIATE')",
                "holder.execute('COMMIT')"))


@pytest.fixture(scope="module")
def pg_env(postgres_url: str) -> dict[str, str]:
    env = {"DATABASE_URL": postgres_url}
    migrated = manage("migrate", "--noinput", env={**env, "REDIS_URL": ""}, timeout=180)
    assert migrated.returncode == 0, migrated.stderr
    return env


@pytest.mark.postgres
def test_a_held_postgresql_table_lock_ends_every_kv_call_at_the_call_s_deadline(pg_env: dict[str, str]) -> None:
    # An ACCESS EXCLUSIVE lock (a migration, VACUUM FULL, LOCK TABLE) blocks reads too: kv_get waited
    # for it on a pool thread, however short its budget.
    calls = (("kv_get", ("n",)), *WRITES)
    _check(_run(pg_env,
                f"import psycopg\nholder = psycopg.connect({pg_env['DATABASE_URL']!r})\n"
                "holder.execute('LOCK TABLE plugins_kventry IN ACCESS EXCLUSIVE MODE')",
                "holder.commit()", calls), calls)


@pytest.mark.postgres
def test_a_held_postgresql_row_lock_ends_a_kv_write_at_the_call_s_deadline(pg_env: dict[str, str]) -> None:
    postgres_url = pg_env["DATABASE_URL"]
    env = pg_env
    _check(_run(env,
                f"import psycopg\nholder = psycopg.connect({postgres_url!r})\n"
                "holder.execute(\"UPDATE plugins_kvusage SET keys = keys WHERE plugin = 'held'\")",
                "holder.commit()"))
