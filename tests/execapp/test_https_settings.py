"""Behind TLS: the HTTPS settings come from the environment (config/settings.py), `check --deploy`
is clean with them, the WebSocket Origin check agrees with them, and a bad value stops the start."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Iterator

import pytest

from tests.conftest import ROOT

#: A production-like environment: a real secret, a public host, the app's own settings module.
BASE_ENV = {"SECRET_KEY": "k" * 20 + "-not-the-default-" + "x" * 30, "ALLOWED_HOSTS": "exec.example.com",
            "DJANGO_SETTINGS_MODULE": "config.settings"}
TLS_ENV = {"HTTPS": "1", "SECURE_HSTS_SECONDS": "31536000", "SECURE_HSTS_INCLUDE_SUBDOMAINS": "1",
           "SECURE_HSTS_PRELOAD": "1", "SECURE_PROXY_SSL_HEADER": "HTTP_X_FORWARDED_PROTO,https",
           "CSRF_TRUSTED_ORIGINS": "https://exec.example.com"}

#: Run in a fresh interpreter: settings are read once, at import.
PROBE = """
import django
django.setup()
from django.conf import settings
from execapp.auth import origin_allowed
def scope(origin, scheme, extra=()):
    return {"type": "websocket", "path": "/ws/events/", "scheme": scheme, "query_string": b"",
            "headers": [(b"host", b"exec.example.com"), (b"origin", origin), *extra], "server": ("10.0.0.5", 8000)}
proxied = [(b"x-forwarded-proto", b"https")]
print("redirect", settings.SECURE_SSL_REDIRECT, settings.SESSION_COOKIE_SECURE, settings.CSRF_COOKIE_SECURE,
      settings.SECURE_HSTS_SECONDS, settings.SECURE_PROXY_SSL_HEADER, settings.CSRF_TRUSTED_ORIGINS)
print("wss-https", origin_allowed(scope(b"https://exec.example.com", "wss")))
print("wss-http", origin_allowed(scope(b"http://exec.example.com", "wss")))
print("proxied-https", origin_allowed(scope(b"https://exec.example.com", "ws", proxied)))
"""


def _run(args: list[str], extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in TLS_ENV and k != "SECURE_SSL_REDIRECT"}
    env.update(BASE_ENV)
    env.update(extra_env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_check_deploy_is_clean_with_the_https_environment() -> None:
    done = _run(["manage.py", "check", "--deploy", "--fail-level", "WARNING"], TLS_ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout, done.stdout + done.stderr


def test_without_it_check_deploy_names_the_https_settings() -> None:
    done = _run(["manage.py", "check", "--deploy"], {})
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in done.stdout + done.stderr


def test_the_websocket_origin_check_agrees_with_the_https_environment() -> None:
    done = _run(["-c", PROBE], TLS_ENV)
    assert done.returncode == 0, done.stderr
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert out["redirect"].startswith("True True True 31536000 ('HTTP_X_FORWARDED_PROTO', 'https')")
    assert out["wss-https"] == "True"  # a page of https://exec.example.com opening wss://
    assert out["wss-http"] == "False"  # a plain-HTTP page is another origin
    assert out["proxied-https"] == "True"  # TLS ended at the proxy, which says so


def test_each_variable_overrides_https_and_bad_values_say_what_to_use(tmp_path: Any) -> None:
    done = _run(["-c", PROBE], {**TLS_ENV, "SECURE_SSL_REDIRECT": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("redirect False True True")
    for name, value, hint in [("HTTPS", "maybe", "use 1 or 0"), ("SECURE_HSTS_SECONDS", "a year", "whole number"),
                              ("SECURE_PROXY_SSL_HEADER", "X-Forwarded-Proto: https", "HTTP_X_FORWARDED_PROTO,https")]:
        done = _run(["manage.py", "check"], {**TLS_ENV, name: value})
        assert done.returncode != 0
        assert f"{name}={value!r}" in done.stderr and hint in done.stderr, done.stderr[-500:]


@pytest.fixture
def quiet_worker(monkeypatch: pytest.MonkeyPatch, install_worker: Any) -> Iterator[Any]:
    """A Worker without services installed as this process's worker: /healthz would otherwise start
    the process's own (with its metrics updater), which outlives the test."""
    from execapp import worker as worker_module

    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", [])
    worker = install_worker(worker_module.Worker("probe-test"))
    worker.start()
    yield worker
    worker.stop(timeout=5)


def test_the_probe_and_the_scrape_are_not_redirected(client: Any, settings: Any, quiet_worker: Any) -> None:
    settings.SECURE_SSL_REDIRECT = True
    assert client.get("/admin/login/").status_code == 301
    assert client.get("/healthz").status_code != 301
    assert client.get("/metrics").status_code != 301
