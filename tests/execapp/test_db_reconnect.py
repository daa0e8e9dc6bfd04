"""A PostgreSQL connection kept across requests (CONN_MAX_AGE) that the server ended meanwhile
(a restart, a failover, pg_terminate_backend) is replaced before use, not failed once per thread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# One process with the production settings: a call through channels' database_sync_to_async (the
# path of every handshake's token lookup and of the credential re-check) opens a connection and
# keeps it; its backend is terminated; the next call must still answer.
_SCRIPT = r"""
import asyncio, os, django
os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
django.setup()
import psycopg
from channels.db import database_sync_to_async
from django.db import connection

def backend_pid():
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]

async def main():
    call = database_sync_to_async(backend_pid)
    first = await call()
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (first,))
    try:
        second = await call()
    except Exception as exc:
        print(f"FAILED {type(exc).__name__}: {exc}")
        return
    print("ok" if second != first else "same backend")

asyncio.run(main())
"""


@pytest.mark.postgres
def test_a_kept_connection_whose_backend_was_terminated_is_replaced(postgres_url: str) -> None:
    env = {**os.environ, "DATABASE_URL": postgres_url, "CONN_MAX_AGE": "600", "PYTHONPATH": str(ROOT)}
    env.pop("REDIS_URL", None)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ok", proc.stdout + proc.stderr
