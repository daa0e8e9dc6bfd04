"""Persisted execution profiles: the merge rule, warm start after a restart, and concurrent flushes
of one profile by two engines in two processes (SQLite file and PostgreSQL)."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any
from urllib.parse import urlparse

import pytest

from execapp import persistence
from execapp import worker as worker_module
from execapp.engine import Engine, Event, ExecClass, ExecProfile, ProfileState
from execapp.models import ExecProfileRecord
from execapp.persistence import ProfileStore, merge_into, off_loop
from tests.conftest import ROOT, manage

LIVENESS = 10.0


def _snap(**over: Any) -> dict[str, Any]:
    base = {"state": "learning", "window": [], "runs": 0, "errors": 0, "timeouts": 0, "promotions": 0,
            "demotions": 0, "promoted_at": None, "demoted_at": None, "last_error": ""}
    return {**base, **over}


def _deltas(**over: int) -> dict[str, int]:
    return {**dict.fromkeys(persistence.COUNTERS, 0), **over}


# -- the merge rule (pure) ------------------------------------------------------------------------

def test_same_regime_appends_samples_keeps_most_recent_and_adds_counters() -> None:
    row = ExecProfileRecord(matcher="m", state="learning", window=[0.1] * 30, runs=30)
    merge_into(row, _snap(window=[0.2] * 5, runs=5), _deltas(runs=5, errors=1), [0.2] * 5, 32, "p")
    assert row.runs == 35 and row.errors == 1
    assert row.window == [0.1] * 27 + [0.2] * 5  # the 32 most recent, this writer's last
    assert row.plugin == "p" and row.state == "learning"
    assert row.p50_seconds == 0.1 and row.p99_seconds == 0.2


def test_newer_transition_replaces_window_older_one_only_adds_counters() -> None:
    t0 = time.time() - 100
    row = ExecProfileRecord(matcher="m", state="demoted", window=[0.001] * 32, runs=100, demotions=1)
    row.demoted_at = persistence._ts(t0)
    # Worker A promoted after the row's demotion: its fresh window replaces, the state follows.
    merge_into(row, _snap(state="promoted", window=[0.3, 0.3], promoted_at=t0 + 50, demoted_at=t0, runs=103),
               _deltas(runs=3, promotions=1), [0.3, 0.3], 32, None)
    assert row.state == "promoted" and row.window == [0.3, 0.3] and row.promotions == 1 and row.runs == 103
    # Worker B still on the old demotion: its runs count, its fast samples do not dilute the window,
    # and it cannot demote the row back.
    merge_into(row, _snap(state="demoted", window=[0.001] * 32, demoted_at=t0, runs=10),
               _deltas(runs=10), [0.001] * 10, 32, None)
    assert row.state == "promoted" and row.window == [0.3, 0.3] and row.runs == 113
    # A later demotion anywhere wins over the earlier promotion.
    merge_into(row, _snap(state="demoted", window=[0.002] * 32, promoted_at=t0 + 50, demoted_at=t0 + 90),
               _deltas(runs=1, demotions=1), [0.002], 32, None)
    assert row.state == "demoted" and row.window == [0.002] * 32 and row.demotions == 2


def test_learning_writer_never_overrides_a_decision() -> None:
    row = ExecProfileRecord(matcher="m", state="promoted", window=[0.2], promotions=1)
    row.promoted_at = persistence._ts(time.time())
    merge_into(row, _snap(state="learning", window=[0.001]), _deltas(runs=1), [0.001], 32, None)
    assert row.state == "promoted" and row.window == [0.2] and row.runs == 1


# -- warm start -----------------------------------------------------------------------------------

def _fast(ctx: Any) -> str:
    return "ok"


def _slow(ctx: Any) -> str:
    time.sleep(0.11)  # one run over 2x the 50 ms threshold promotes at once
    return "slept"


def _register(engine: Engine) -> None:
    engine.add(engine.make_matcher("command", "fast", _fast, plugin="demo"))
    engine.add(engine.make_matcher("command", "slow", _slow, plugin="demo"))


@pytest.fixture
def store_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers of these tests run the profile store and nothing else."""
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", ["execapp.persistence.profile_store"])


@pytest.mark.django_db
def test_warm_start_after_restart(store_only: None) -> None:
    first = worker_module.Worker("before-restart")
    first.start()
    _register(first.engine)
    for _ in range(40):
        first.engine.process_event_sync(Event(text="/fast"))
    first.engine.process_event_sync(Event(text="/slow"))
    assert first.engine.profile_for("command:fast").state is ProfileState.DEMOTED
    assert first.engine.profile_for("command:slow").state is ProfileState.PROMOTED
    assert ExecProfileRecord.objects.count() == 0  # nothing written on the event path
    first.stop(timeout=5)  # the final flush happens here

    rows = {r.matcher: r for r in ExecProfileRecord.objects.all()}
    assert rows["command:fast"].state == "demoted" and rows["command:fast"].runs == 40
    assert rows["command:slow"].state == "promoted" and rows["command:slow"].promotions == 1
    assert rows["command:fast"].plugin == "demo" and len(rows["command:fast"].window) == 32

    second = worker_module.Worker("after-restart")  # a new process's worker: fresh engine and pool
    second.start()
    try:
        _register(second.engine)  # matchers built after the load pick up the restored profiles
        fast = second.engine.profile_for("command:fast")
        slow = second.engine.profile_for("command:slow")
        assert fast.should_pool() is ExecClass.SYNC and fast.runs == 40
        assert slow.state is ProfileState.PROMOTED and slow.should_pool() is ExecClass.POOL
        # Their very first events: the known-fast one inline, the known-slow one in the pool.
        fast_run = second.engine.process_event(Event(text="/fast"))
        slow_run = second.engine.process_event(Event(text="/slow"))
        assert fast_run.completion is not None  # finished during dispatch: it ran inline
        assert slow_run.completion is None  # still running in a pool thread
        assert slow_run.wait(LIVENESS) is not None
        assert second.pool.stats()["submitted"] == 1
    finally:
        second.stop(timeout=5)
    assert ExecProfileRecord.objects.get(matcher="command:fast").runs == 41


@pytest.mark.django_db
def test_quarantine_and_proven_size_persist_and_one_workers_release_is_not_undone() -> None:
    a, b = Engine(pool_enabled=False), Engine(pool_enabled=False)
    store_a, store_b = ProfileStore(a), ProfileStore(b)
    for engine in (a, b):
        _register(engine)
        for _ in range(3):
            engine.process_event_sync(Event(text="/fast " + "x" * 2000))
    store_a.flush()
    store_b.flush()
    assert ExecProfileRecord.objects.get(matcher="command:fast").proven_size == 2006
    warm = Engine(pool_enabled=False)
    ProfileStore(warm).load()
    assert warm.profile_for("command:fast").proven_size == 2006  # what inline was earned on

    a.quarantine("command:fast", "stalled worker w1")
    b.quarantine("command:fast", "stalled worker w1")
    store_a.flush()
    store_b.flush()
    row = ExecProfileRecord.objects.get(matcher="command:fast")
    assert row.quarantined == "stalled worker w1" and row.state == "promoted"

    fresh = Engine(pool_enabled=False)  # a restarted worker: pinned before any event
    ProfileStore(fresh).load()
    assert fresh.profile_for("command:fast").should_pool() is ExecClass.POOL
    assert fresh.profile_for("command:fast").quarantined == "stalled worker w1"

    a.release_quarantine("command:fast")
    store_a.flush()
    b.process_event_sync(Event(text="/fast"))  # b still holds the old pin in memory
    store_b.flush()
    assert ExecProfileRecord.objects.get(matcher="command:fast").quarantined == ""


@pytest.mark.django_db
def test_flush_writes_only_changed_profiles() -> None:
    engine = Engine(pool_enabled=False)
    _register(engine)
    store = ProfileStore(engine)
    assert store.flush() == 0  # nothing ran yet
    for _ in range(3):
        engine.process_event_sync(Event(text="/fast"))
    assert store.flush() == 1
    assert store.flush() == 0  # version unchanged: no write
    engine.process_event_sync(Event(text="/fast"))
    assert store.flush() == 1
    assert ExecProfileRecord.objects.get(matcher="command:fast").runs == 4


@pytest.mark.django_db(transaction=True)
async def test_store_works_when_called_from_the_event_loop() -> None:
    """Worker.start()/stop() may run on the loop: the store does its ORM work off it."""
    engine = Engine(pool_enabled=False)
    _register(engine)
    engine.process_event_sync(Event(text="/fast"))
    store = ProfileStore(engine)
    store.close()  # final flush, from a coroutine
    assert off_loop(lambda: ExecProfileRecord.objects.get(matcher="command:fast").runs) == 1


# -- two engines, two processes, one profile ------------------------------------------------------

_FLUSHER = textwrap.dedent("""
    import json, os, sys, time
    import django
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()
    from execapp.engine import Engine
    from execapp.persistence import ProfileStore

    tag, rounds, per_round, start_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    engine = Engine(pool_enabled=False)
    profile = engine.profile_for("command:shared")
    store = ProfileStore(engine, window=32)
    sample = {"a": 0.001, "b": 0.002}[tag]  # each process's samples are recognisable
    while time.time() < start_at:  # a start line shared by two processes: they flush at once
        time.sleep(0.001)
    for i in range(rounds):
        for _ in range(per_round):
            profile.record(sample, error=f"{tag} failed" if i % 5 == 0 and _ == 0 else None)
        store.flush()
    print(json.dumps({"runs": profile.runs, "errors": profile.errors, "flushes": store.flushes}))
""")


def _run_flushers(env: dict[str, str], rounds: int, per_round: int) -> list[dict[str, Any]]:
    start_at = time.time() + 2.0  # both processes are up by then (Django starts in < 1 s)
    procs = [subprocess.Popen([sys.executable, "-c", _FLUSHER, tag, str(rounds), str(per_round), str(start_at)],
                              cwd=ROOT, env={**__import__("os").environ, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for tag in ("a", "b")]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _check_row(row: tuple, results: list[dict[str, Any]], rounds: int) -> None:
    runs, errors, window, state = row
    window = json.loads(window) if isinstance(window, str) else window
    assert runs == sum(r["runs"] for r in results) == 2 * rounds * 10  # no lost or doubled delta
    assert errors == sum(r["errors"] for r in results)
    assert all(r["flushes"] == rounds for r in results)
    assert len(window) == 32 and set(window) <= {0.001, 0.002}
    assert state in ("learning", "demoted")


_ROW_SQL = "SELECT runs, errors, \"window\", state FROM execapp_execprofilerecord WHERE matcher = 'command:shared'"


def test_two_engines_flush_one_profile_concurrently_sqlite(sqlite_env: dict[str, str]) -> None:
    rounds = 30
    results = _run_flushers(sqlite_env, rounds, 10)
    path = urlparse(sqlite_env["DATABASE_URL"]).path
    with sqlite3.connect(path) as db:
        rows = db.execute(_ROW_SQL).fetchall()
    assert len(rows) == 1  # both inserted "if missing": one row
    _check_row(rows[0], results, rounds)


@pytest.mark.postgres
def test_two_engines_flush_one_profile_concurrently_postgres(postgres_url: str) -> None:
    import psycopg

    name = f"execapp_obs_{uuid.uuid4().hex[:8]}"
    admin_url = postgres_url
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = urlparse(admin_url)._replace(path=f"/{name}").geturl()
    try:
        env = {"DATABASE_URL": url}
        result = manage("migrate", "--noinput", env=env)
        assert result.returncode == 0, result.stderr
        rounds = 30
        results = _run_flushers(env, rounds, 10)
        with psycopg.connect(url) as conn:
            rows = conn.execute(_ROW_SQL).fetchall()
        assert len(rows) == 1
        _check_row(rows[0], results, rounds)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_profile_factory_window_is_respected_on_restore() -> None:
    """A row written with a larger window restores into the current, smaller one (latest samples)."""
    profile = ExecProfile(window=12)
    samples = [i / 1000 for i in range(20)]
    profile.restore("learning", samples, runs=20)
    assert profile.samples() == samples[-12:] and profile.runs == 20



_LOCKED_FLUSH = textwrap.dedent("""
    import os, time
    import django
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()
    import psycopg
    from django.db import connection
    from execapp import persistence
    from execapp.engine import Engine
    from execapp.models import ExecProfileRecord

    with connection.schema_editor() as editor:
        editor.create_model(ExecProfileRecord)
    persistence.FLUSH_DEADLINE_SECONDS = 0.5
    engine = Engine(pool_enabled=False)
    engine.profile_for("command:locked").record(0.001)
    store = persistence.ProfileStore(engine)
    with psycopg.connect(os.environ["DATABASE_URL"]) as locker:  # a migration, VACUUM FULL, an admin
        locker.execute("LOCK TABLE execapp_execprofilerecord IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        try:
            store.flush()
            outcome = "written"
        except Exception as exc:
            outcome = type(exc).__name__
        print(outcome, round(time.monotonic() - started, 1), store.flushes)
""")


@pytest.mark.postgres
def test_a_flush_into_a_locked_table_fails_at_its_deadline(postgres_url: str) -> None:
    """A drain's flush (manage.py drain, SIGTERM) waited for as long as execapp_execprofilerecord was
    locked: a SIGTERM under a 60 s lock ran past its grace until the supervisor SIGKILLed the workers."""
    from tests.conftest import empty_postgres_database

    with empty_postgres_database(f"execapp_flush_{uuid.uuid4().hex[:8]}") as url:
        env = {**__import__("os").environ, "DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
        env.pop("REDIS_URL", None)
        proc = subprocess.run([sys.executable, "-c", _LOCKED_FLUSH], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        outcome, seconds, flushes = proc.stdout.split()
        # statement_timeout at 0.5 s (the server answers): a database error, the profile still pending.
        assert outcome == "OperationalError" and float(seconds) < 3 and flushes == "0", proc.stdout


def test_after_a_failed_flush_the_next_ones_fail_at_once_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM under a stalled PostgreSQL waited for the tick's flush, the drain's and the final
    close's in turn (5-10 s each) and exited past its grace: a database known down is not waited for."""
    from django.db import OperationalError

    from execapp.circuit import CircuitOpen

    engine = Engine(pool_enabled=False)
    engine.profile_for("command:down").record(0.001)
    store = ProfileStore(engine)
    calls: list[int] = []

    def down(*args: Any) -> None:
        calls.append(1)
        raise OperationalError("the database did not answer")

    monkeypatch.setattr(store, "_write", down)
    with pytest.raises(OperationalError):
        store.flush()
    with pytest.raises(CircuitOpen, match="the profile store's database failed a moment ago"):
        store.flush()  # the drain's, the close's: no second wait
    assert len(calls) == 1 and store.flushes == 0
    store._circuit._open_until = 1.0  # the window passed: the next flush tries the database again
    monkeypatch.setattr(store, "_write", lambda *args: None)
    assert store.flush() == 1 and store.flushes == 1
