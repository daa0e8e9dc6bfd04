"""Each HTTP request's database calls end within REQUEST_DB_DEADLINE_SECONDS on a PostgreSQL that
does not answer (execapp/request_db_deadline.py): a proxy of the test's own in front of the real
PostgreSQL stops forwarding (sockets kept open), as test_db_cutoff.py does."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.conf import settings

from .test_db_cutoff import _SCRIPT, ROOT

#: The proxy and Django set up as test_db_cutoff's script does; then requests through the middleware.
_REQUESTS = _SCRIPT.split("from django.db import connection\n", 1)[0] + r"""
from django.db import connection
from django.http import HttpResponse
from django.test import RequestFactory
from execapp.request_db_deadline import RequestDatabaseDeadlineMiddleware

def view(request):
    with connection.cursor() as cursor:  # an admin page's query
        cursor.execute("SELECT 1")
    return HttpResponse("ok")

def failing_view(request):  # Django turns a view's exception into a 500 page inside get_response
    try:
        return view(request)
    except Exception:
        return HttpResponse("server error", status=500)

results = {}

def run(name, handler):
    started = time.monotonic()
    response = handler(RequestFactory().get("/admin/"))
    results[name] = f"{response.status_code} {time.monotonic() - started:.1f} {response.content.decode()[:40]!r}"

from concurrent.futures import ThreadPoolExecutor, wait
pool = ThreadPoolExecutor(1)  # one request thread, its connection kept (CONN_MAX_AGE)
for name, handler in (("plain", RequestDatabaseDeadlineMiddleware(view)),
                      ("page500", RequestDatabaseDeadlineMiddleware(failing_view))):
    pool.submit(run, "warm_" + name, handler).result(15)
    stalled.set()
    done, _ = wait([pool.submit(run, name, handler)], timeout=10)
    results.setdefault(name, "held 10")  # before the fix: as long as the stall
    stalled.clear()
    if not done:
        break
    pool.submit(run, "after_" + name, handler).result(15)
for name, line in results.items():
    print(name, line, flush=True)
os._exit(0)
"""


@pytest.mark.postgres
def test_a_request_on_a_stalled_database_answers_503_at_its_deadline(postgres_url: str) -> None:
    env = {**os.environ, "REAL_DATABASE_URL": postgres_url, "PYTHONPATH": str(ROOT),
           "EXECAPP_REQUEST_DB_DEADLINE_SECONDS": "0.5"}
    env.pop("REDIS_URL", None)
    proc = subprocess.run([sys.executable, "-c", _REQUESTS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    for name in ("plain", "page500"):
        assert lines.get("warm_" + name, "").startswith("200 "), proc.stdout + proc.stderr
        status, seconds, *body = lines[name].split(" ", 2)
        assert status == "503" and float(seconds) < 5, proc.stdout + proc.stderr  # "held 10" before
        assert body[0].startswith("'database_unavailable: "), body
        assert lines.get("after_" + name, "").startswith("200 "), proc.stdout + proc.stderr  # a new connection


def test_the_middleware_runs_before_the_session_and_user_lookups() -> None:
    order = list(settings.MIDDLEWARE)
    mine = order.index("execapp.request_db_deadline.RequestDatabaseDeadlineMiddleware")
    assert mine < order.index("django.contrib.sessions.middleware.SessionMiddleware")
    assert mine < order.index("django.contrib.auth.middleware.AuthenticationMiddleware")
