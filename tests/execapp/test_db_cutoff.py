"""A PostgreSQL that does not answer at all is cut off on this side (execapp/db_cutoff.py).

statement_timeout only ends waits the server sees: behind a stalled proxy (a partition, a stalled
host, pgbouncer's queue) a handshake's token lookup and a plugin's KV call each waited for as long
as the stall lasted. Here a proxy of the test's own, in front of the real PostgreSQL, stops
forwarding (sockets kept open), and each call must fail with a database error within its
deadline plus the margin, then answer again once the proxy forwards again.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import asyncio, os, socket, threading, time
from urllib.parse import urlparse

real = urlparse(os.environ["REAL_DATABASE_URL"])
stalled = threading.Event()

def pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            while stalled.is_set():
                time.sleep(0.02)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

def serve(listener):
    while True:
        client, _ = listener.accept()
        upstream = socket.create_connection((real.hostname, real.port or 5432))
        threading.Thread(target=pump, args=(client, upstream), daemon=True).start()
        threading.Thread(target=pump, args=(upstream, client), daemon=True).start()

listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(16)
threading.Thread(target=serve, args=(listener,), daemon=True).start()
port = listener.getsockname()[1]
os.environ["DATABASE_URL"] = real._replace(netloc=f"{real.username}@127.0.0.1:{port}").geturl()
os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
import django
django.setup()
from django.db import connection
from execapp import auth, db_deadline
from execapp.models import ApiToken
from plugins.kv import DatabaseKV
from plugins.models import KVEntry, KVUsage

with connection.schema_editor() as editor:
    for model in (ApiToken, KVEntry, KVUsage):
        editor.create_model(model)
kv = DatabaseKV()

def deadline_block():
    with db_deadline.statement_deadline(0.5), connection.cursor() as cursor:
        cursor.execute("SELECT 1")

results = {}

def run(name, call):
    started = time.monotonic()
    try:
        call()
        outcome = "answered"
    except Exception as exc:
        outcome = type(exc).__name__
    results[name] = f"{outcome} {time.monotonic() - started:.1f}"

def handshake():
    asyncio.run(asyncio.wait_for(auth._authenticate("some-token"), 10))

# Each case on a thread of its own whose connection is kept from a first call (CONN_MAX_AGE), as a
# worker's sync thread and pool threads keep theirs; "connect" opens a new one while stalled.
from concurrent.futures import ThreadPoolExecutor
cases = {"handshake": handshake, "kv_get": lambda: kv.get("p", "k", 0.3),
         "kv_set": lambda: kv.set("p", "k", "v", 0.3), "block": deadline_block}
threads = {name: ThreadPoolExecutor(1) for name in cases}
for name, pool in threads.items():
    pool.submit(run, "warm_" + name, cases[name]).result()
stalled.set()
futures = [pool.submit(run, name, cases[name]) for name, pool in threads.items()]
futures.append(ThreadPoolExecutor(1).submit(run, "connect", deadline_block))
from concurrent.futures import wait
wait(futures, timeout=15)
for name in list(cases) + ["connect"]:
    results.setdefault(name, "held 15")  # before the fix: held for as long as the stall
stalled.clear()
for name, pool in threads.items():
    pool.submit(run, "after_" + name, cases[name]).result(15)
for name, line in results.items():
    print(name, line, flush=True)
os._exit(0)  # threads still held (before the fix) must not hold the exit
"""


@pytest.mark.postgres
def test_a_stalled_database_is_cut_off_at_the_deadline_and_answers_again(postgres_url: str) -> None:
    import psycopg

    name = "cutoff_" + os.urandom(4).hex()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        env = {**os.environ, "REAL_DATABASE_URL": postgres_url.rsplit("/", 1)[0] + "/" + name,
               "PYTHONPATH": str(ROOT)}
        env.pop("REDIS_URL", None)
        proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=90)
        assert proc.returncode == 0, proc.stderr
        lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
        cases = ("handshake", "kv_get", "kv_set", "block")
        assert len(lines) == 3 * len(cases) + 1, proc.stdout + proc.stderr
        for call in cases:
            for when in ("warm_", "after_"):
                assert lines[when + call].split()[0] == "answered", proc.stdout + proc.stderr
        # Cut at the deadline plus its margin: the lookup's 2 + 1 s, the KV calls' 0.3 + 0.5 s, the
        # block's 0.5 + 1 s; a new connection within libpq's connect_timeout (5 s, config/settings.py).
        for call, error, bound in (("handshake", "DatabaseDeadline", 5), ("kv_get", "TimeoutError", 3),
                                   ("kv_set", "TimeoutError", 3), ("block", "DatabaseDeadline", 3),
                                   ("connect", "OperationalError", 9)):
            outcome, seconds = lines[call].split()
            assert outcome == error and float(seconds) < bound, proc.stdout + proc.stderr
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
