"""The commands that use the database, run while it cannot be reached: one line with a code and
what to check (exit status 1), never a traceback, never the database's password."""
from __future__ import annotations

from pathlib import Path

import pytest

from ..conftest import manage

COMMANDS = (("create_token", "ops"), ("revoke_token", "ops"), ("prune_history",), ("loadplugins",),
            ("runplugin", "ping", "ping"))


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
