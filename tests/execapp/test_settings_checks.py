"""Every EXECAPP number is checked for nan, inf and waits too long for a thread, whatever its own
check; settings of the wrong type never crash the checks (execapp/checks.py)."""
from __future__ import annotations

from typing import Any

import pytest

from execapp import conf
from execapp.checks import check_execapp_settings

NUMERIC = sorted(k for k, v in conf.DEFAULTS.items() if isinstance(v, (int, float)) and not isinstance(v, bool))


def _found(settings: Any, **values: Any) -> dict[str, list[Any]]:
    settings.EXECAPP = values
    found: dict[str, list[Any]] = {}
    for message in check_execapp_settings():
        found.setdefault(message.id, []).append(message)
    return found


@pytest.mark.parametrize("key", NUMERIC)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_number_is_an_error_naming_the_setting(settings: Any, key: str, value: float) -> None:
    # nan passed every range check (nan <= 0 is false): a threshold that never fired, silently.
    errors = _found(settings, **{key: value}).get("execapp.E122", [])
    assert any(key in e.msg and "must be a finite number" in e.msg and "default" in e.hint for e in errors)


def test_from_the_environment_too(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXECAPP_SLOW_THRESHOLD_SECONDS", "nan")
    [error] = _found(settings)["execapp.E122"]
    assert "SLOW_THRESHOLD_SECONDS" in error.msg and "environment" in error.msg


def test_seconds_past_what_a_thread_can_wait_are_refused(settings: Any) -> None:
    [error] = _found(settings, SNAPSHOT_SECONDS=1e12)["execapp.E122"]
    assert "SNAPSHOT_SECONDS" in error.msg and "at most 1e+09 seconds" in error.msg
    assert "execapp.E122" not in _found(settings, SNAPSHOT_SECONDS=86400.0, POOL_MAX_WORKERS=10**6)


@pytest.mark.parametrize("value", ["2", -1, None, True])
def test_pool_idle_seconds_is_checked(settings: Any, value: Any) -> None:
    # Unchecked before: ExecPool refused it at every worker start and the supervisor restarted
    # workers for ever, a traceback each time.
    [error] = _found(settings, POOL_IDLE_SECONDS=value)["execapp.E123"]
    assert "POOL_IDLE_SECONDS" in error.msg and repr(value) in error.msg
    assert "execapp.E123" not in _found(settings, POOL_IDLE_SECONDS=0)


@pytest.mark.parametrize("key", ["WORKER_STALE_SECONDS", "WORKER_DROP_SECONDS"])
@pytest.mark.parametrize("value", ["10", None, [10]])
def test_a_wrong_type_is_named_not_a_crash_of_the_checks(settings: Any, key: str, value: Any) -> None:
    # The W001 comparison of the two raised TypeError: `manage.py check` printed a traceback.
    errors = _found(settings, **{key: value})["execapp.E004"]
    assert any(key in e.msg for e in errors)


def test_the_defaults_pass(settings: Any) -> None:
    found = _found(settings)
    assert not {i for i in found if i.startswith("execapp.E")}


def test_the_server_does_not_start_with_a_settings_error_and_names_it(tmp_path: Any) -> None:
    # `python -m execapp.serve` ran no checks: a negative threshold served silently wrong, and a
    # value the workers' code refused crashed every start, restarted for ever.
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "EXECAPP_SLOW_THRESHOLD_SECONDS": "-1", "EXECAPP_POOL_IDLE_SECONDS": "later",
           "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "REDIS_URL": ""}
    done = subprocess.run([sys.executable, "-m", "execapp.serve", "--port", str(port)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "EXECAPP['SLOW_THRESHOLD_SECONDS'] is -1.0" in done.stderr and "POOL_IDLE_SECONDS" in done.stderr
    assert "not starting: 3 error(s)" in done.stderr and "started worker process" not in done.stderr  # E007 too


def test_warnings_alone_do_not_stop_the_server(settings: Any) -> None:
    from execapp.serve import settings_pass_checks

    settings.EXECAPP = {"WORKER_START_TIMEOUT_SECONDS": 2.0}  # a warning (W046)
    assert settings_pass_checks()
    settings.EXECAPP = {"SNAPSHOT_SECONDS": 0}
    assert not settings_pass_checks()


def test_the_public_secret_key_is_refused_once_a_non_local_host_is_served(settings: Any) -> None:
    """With the repository's SECRET_KEY anyone signs Django's signed values (a forged messages
    cookie put its HTML into the admin): fine on 127.0.0.1, refused once the site has a real name."""
    from execapp.checks import DEV_SECRET_KEY, check_secret_key
    from execapp.serve import settings_pass_checks

    settings.SECRET_KEY = DEV_SECRET_KEY
    settings.ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]", "testserver"]  # make run's defaults
    assert check_secret_key() == [] and settings_pass_checks()
    for hosts in (["execapp.example.com"], ["*"], ["127.0.0.1", "10.0.0.5"]):
        settings.ALLOWED_HOSTS = hosts
        (error,) = check_secret_key()
        assert error.id == "execapp.E130" and error.is_serious() and repr(hosts[-1]) in error.msg
        assert "SECRET_KEY environment variable" in error.hint
        assert not settings_pass_checks()
    settings.SECRET_KEY = "a-real-one-" + "x" * 50
    assert check_secret_key() == []


def test_the_redis_history_byte_bound_is_checked(settings: Any) -> None:
    [error] = _found(settings, HISTORY_REDIS_MAX_BYTES=-1)["execapp.E080"]
    assert "HISTORY_REDIS_MAX_BYTES" in error.msg and "268435456" in error.hint
    [warning] = _found(settings, HISTORY_REDIS_MAX_BYTES=4096)["execapp.W082"]
    assert "4096" in warning.msg and "1048576" in warning.hint
    assert "execapp.W082" not in _found(settings, HISTORY_REDIS_MAX_BYTES=4096, HISTORY_MAX_EVENTS=0)
    assert not _found(settings, HISTORY_REDIS_MAX_BYTES=conf.DEFAULTS["HISTORY_REDIS_MAX_BYTES"])


def test_snapshots_rarer_than_the_stale_mark_are_flagged(settings: Any) -> None:
    # A worker publishing every 30 s was shown stale (and out of the totals) 20 s of every 30, and
    # one publishing every 90 s was forgotten by every other worker's publish (WORKER_DROP_SECONDS).
    [warning] = _found(settings, SNAPSHOT_SECONDS=30.0)["execapp.W002"]
    assert "stale" in warning.msg and "forgotten" not in warning.msg
    [warning] = _found(settings, SNAPSHOT_SECONDS=90.0)["execapp.W002"]
    assert "forgotten by the others" in warning.msg
    assert "execapp.W002" not in _found(settings, SNAPSHOT_SECONDS=5.0)
    assert "execapp.W002" not in _found(settings, SNAPSHOT_SECONDS=30.0, WORKER_STALE_SECONDS=60.0,
                                        WORKER_DROP_SECONDS=120.0)


def test_the_events_search_rate_is_checked(settings: Any) -> None:
    [error] = _found(settings, HISTORY_SEARCHES_PER_MINUTE=0)["execapp.E048"]
    assert "HISTORY_SEARCHES_PER_MINUTE" in error.msg and "30.0" in error.hint
    assert "execapp.E048" not in _found(settings, HISTORY_SEARCHES_PER_MINUTE=120.0)
