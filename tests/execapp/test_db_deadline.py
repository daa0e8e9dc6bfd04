"""Credential lookups have a deadline on PostgreSQL (execapp/db_deadline.py): a locked
execapp_apitoken (or django_session, for a staff cookie) fails a handshake's lookup in about
LOOKUP_DEADLINE_SECONDS instead of holding it (and every handshake queued behind it on the worker's
one sync thread) for as long as the lock."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The real lookups (the handshake's and the re-check's), on a table of their own made by Django's
# schema editor, while another connection holds an ACCESS EXCLUSIVE lock on it (a migration does).
_SCRIPT = r"""
import asyncio, os, time, django
os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
django.setup()
import psycopg
from django.db import connection
from execapp import auth, auth_watch
from django.contrib.sessions.backends.db import SessionStore
from django.contrib.sessions.models import Session
from execapp.models import ApiToken

with connection.schema_editor() as editor:
    editor.create_model(ApiToken)
    editor.create_model(Session)
connection.close()
with psycopg.connect(os.environ["DATABASE_URL"]) as locker:
    locker.execute("LOCK TABLE execapp_apitoken IN ACCESS EXCLUSIVE MODE")
    locker.execute("LOCK TABLE django_session IN ACCESS EXCLUSIVE MODE")
    session = {"session": SessionStore(session_key="k" * 32)}  # a staff cookie's session, to be loaded
    for name, call in (("handshake", lambda: auth._authenticate("some-token")),
                       ("recheck", lambda: auth_watch._live([("token", 1)])),
                       ("session", lambda: auth._session_user(session)),
                       ("session_recheck", lambda: auth_watch._live([("session", "k" * 32)]))):
        started = time.monotonic()
        try:
            asyncio.run(asyncio.wait_for(call(), 20))
            outcome = "answered"
        except asyncio.TimeoutError:
            outcome = "held"
        except Exception as exc:
            outcome = type(exc).__name__
        print(name, outcome, round(time.monotonic() - started, 1))
"""


@pytest.mark.postgres
def test_a_locked_credential_table_fails_the_lookups_at_their_deadline(postgres_url: str) -> None:
    import psycopg

    name = "deadline_" + os.urandom(4).hex()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = postgres_url.rsplit("/", 1)[0] + "/" + name
    try:
        env = {**os.environ, "DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
        env.pop("REDIS_URL", None)
        proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=90)
        assert proc.returncode == 0, proc.stderr
        lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
        for lookup in ("handshake", "recheck", "session", "session_recheck"):
            outcome, seconds = lines[lookup].split()
            assert outcome == "OperationalError" and float(seconds) < 5, proc.stdout
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
