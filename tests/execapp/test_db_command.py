"""The commands that use the database, run while it cannot be reached: one line with a code and
what to check (exit status 1), never a traceback, never the database's password."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from ..conftest import ROOT, empty_postgres_database, manage

COMMANDS = (("create_token", "ops"), ("revoke_token", "ops"), ("prune_history",), ("loadplugins",),
            ("runplugin", "ping", "ping"), ("migrate", "--noinput"))


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: a[0])
def test_a_command_whose_database_is_down_says_so_in_one_line(args: tuple[str, ...]) -> None:
    # Nothing listens on port 1: connection refused at once.
    result = manage(*args, env={"DATABASE_URL": "postgres://ops:s3cret-pw@127.0.0.1:1/execapp"}, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "database_unavailable: the database (postgresql 127.0.0.1:1/execapp) cannot be used" in result.stderr
    assert "DATABASE_URL" in result.stderr and "s3cret-pw" not in result.stderr


def test_a_database_that_was_never_migrated_names_migrate(tmp_path: Path) -> None:
    result = manage("create_token", "ops", env={"DATABASE_URL": f"sqlite:///{tmp_path / 'new.sqlite3'}"}, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "no such table" in result.stderr and "`manage.py migrate` ran" in result.stderr


def test_loadplugins_run_by_every_replica_at_once_all_succeed(postgres_url: str, tmp_path: Path) -> None:
    """Every replica of a deployment commonly runs `migrate && loadplugins` as it starts. Two loads
    that both found a plugin missing both inserted it: one died with IntegrityError (a traceback,
    exit 1: the replica's start failed). Loads now wait for each other (an advisory lock)."""
    env = {"DATABASE_URL": postgres_url}
    assert manage("migrate", "--noinput", env=env).returncode == 0
    tag = secrets.token_hex(3)
    (tmp_path / "ping.lua").write_text('function ping(event) return "pong" end\n')
    names = [f"race-{tag}-{i}" for i in range(40)]
    manifest = {"plugins": [{"name": n, "runtime": "lua", "file": "ping.lua", "enabled": False,
                             "bindings": [{"kind": "command", "pattern": n, "handler": "ping"}]} for n in names]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    loads = [subprocess.Popen([sys.executable, "manage.py", "loadplugins", "--dir", str(tmp_path)], cwd=ROOT,
                              env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outputs = [load.communicate(timeout=120) for load in loads]
    for load, (_out, err) in zip(loads, outputs):
        assert load.returncode == 0 and "Traceback" not in err, err[-800:]
    created = sum(out.count(": created") for out, _ in outputs)
    unchanged = sum(out.count(": unchanged") for out, _ in outputs)
    assert (created, unchanged) == (40, 120)  # each plugin created once; the others found it


@pytest.fixture
def empty_postgres_url() -> Iterator[str]:
    """A PostgreSQL database of this test's own, never migrated; dropped after."""
    with empty_postgres_database(f"test_execapp_migrate_{secrets.token_hex(4)}") as url:
        yield url


def test_migrate_run_by_every_replica_at_once_all_succeed(empty_postgres_url: str) -> None:
    """Migrates that began together on an empty database all created the same tables and all but
    one failed (duplicate pg_type key, exit 1). They now run one at a time; the others apply nothing."""
    runs = [subprocess.Popen([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT,
                             env={**os.environ, "DATABASE_URL": empty_postgres_url}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [run.communicate(timeout=300) for run in runs]
    for run, (_out, err) in zip(runs, outputs):
        assert run.returncode == 0 and "Traceback" not in err, err[-800:]
    assert sum("No migrations to apply" in out for out, _ in outputs) == 2
    assert manage("migrate", "--check", env={"DATABASE_URL": empty_postgres_url}).returncode == 0
