"""Password checks run at once per worker are capped (execapp/login_limit.py).

Each sign-in attempt at the admin's login hashes a password (~0.5 s of CPU; for an unknown user
too), in a thread of its own per request: a flood of wrong passwords was as many threads hashing
at once. Here the hash is replaced by a wait on an Event, so "a check is running" is a state the
test holds, not a duration.
"""
from __future__ import annotations

import threading
from typing import Any

import pytest
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.models import User
from django.test import Client

from execapp import login_limit
from tests.conftest import LIVENESS, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

LOGIN = "/admin/login/"


@pytest.fixture
def held_checks(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every password check waits for ``release`` (and is counted in ``entered``) instead of hashing."""
    release = threading.Event()
    entered: list[str] = []

    def holding(self: Any, request: Any, username: str | None = None, password: str | None = None,
                **kwargs: Any) -> Any:
        entered.append(str(username))
        release.wait(LIVENESS * 3)
        return None

    monkeypatch.setattr(ModelBackend, "authenticate", holding)
    yield release, entered
    release.set()


def _post(results: list[Any], name: str, address: str = "127.0.0.1") -> None:
    response = Client(REMOTE_ADDR=address).post(LOGIN, {"username": name, "password": "wrong", "next": "/admin/"})
    results.append((name, response.status_code, response.content.decode()))


def test_past_max_password_checks_a_sign_in_is_refused_before_hashing(settings: Any, held_checks: Any) -> None:
    release, entered = held_checks
    settings.EXECAPP = {"MAX_PASSWORD_CHECKS": 2}
    results: list[Any] = []
    # From two networks: one network alone may not take the last slot (test_login_throttle.py).
    first = [threading.Thread(target=_post, args=(results, f"held{i}", f"192.0.2.{i + 1}"), daemon=True)
             for i in range(2)]
    for thread in first:
        thread.start()
    assert wait_until(lambda: len(entered) == 2, LIVENESS)  # two checks run (held): the cap
    late = threading.Thread(target=_post, args=(results, "late", "192.0.2.3"), daemon=True)
    late.start()
    late.join(LIVENESS)  # refused at once; without the cap it would wait in its own check
    release.set()
    for thread in [*first, late]:
        thread.join(LIVENESS)
    assert entered.count("late") == 0, "the third attempt ran a password check past the cap"
    answers = {name: (status, body) for name, status, body in results}
    status, body = answers["late"]
    assert status == 200 and "checking 2 other sign-in attempts right now; try again in a moment" in body
    # The held ones ended as ordinary wrong passwords, and the count is back to zero.
    assert all("Please enter the correct username" in answers[f"held{i}"][1] for i in range(2))
    assert login_limit.running() == 0


def test_once_a_check_ends_the_next_sign_in_runs_and_a_real_one_succeeds(settings: Any) -> None:
    settings.EXECAPP = {"MAX_PASSWORD_CHECKS": 1}
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast: the cap is the point
    User.objects.create_user("admin", password="right-password", is_staff=True, is_superuser=True)
    client = Client()
    for _ in range(3):  # one after the other: never over a cap of 1
        assert "Please enter the correct username" in client.post(LOGIN, {"username": "admin",
                                                                          "password": "wrong"}).content.decode()
    response = client.post(LOGIN, {"username": "admin", "password": "right-password", "next": "/admin/"})
    assert response.status_code == 302 and login_limit.running() == 0


def test_the_checks_name_the_unlimited_backend_and_a_bad_cap(settings: Any) -> None:
    from execapp.checks import check_execapp_settings

    settings.AUTHENTICATION_BACKENDS = ["django.contrib.auth.backends.ModelBackend"]
    found = {m.id: m for m in check_execapp_settings()}
    assert "execapp.W096" in found and "LimitedModelBackend" in found["execapp.W096"].hint
    settings.AUTHENTICATION_BACKENDS = ["execapp.login_limit.LimitedModelBackend"]
    settings.EXECAPP = {"MAX_PASSWORD_CHECKS": 0}
    found = {m.id: m for m in check_execapp_settings()}
    assert "execapp.W096" not in found and "MAX_PASSWORD_CHECKS" in found["execapp.E003"].msg
