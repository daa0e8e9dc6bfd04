"""A flood of sign-in attempts refuses its sender, not staff signing in from elsewhere
(execapp/login_limit.py, execapp/login_throttle.py).

Before: one global cap of MAX_PASSWORD_CHECKS checks at once per worker, and nothing else, so a
client holding those slots (or just posting wrong passwords fast enough) had every other sign-in
refused "try again in a moment" for as long as it kept going.
"""
from __future__ import annotations

import threading
from typing import Any

import pytest
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.models import User
from django.test import Client
from prometheus_client import REGISTRY

from execapp import login_limit, login_throttle
from execapp.checks import check_execapp_settings
from tests.conftest import LIVENESS, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

LOGIN = "/admin/login/"
ATTACKER, ATTACKER_V6, STAFF_NET, OTHER_NET = "203.0.113.9", "2001:db8:1:2::9", "198.51.100.4", "192.0.2.77"
WRONG = "Please enter the correct username"
FAST_HASHER = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # the limits are the point, not the hash


def _sign_in(address: str, username: str, password: str, **headers: str) -> tuple[int, str]:
    response = Client(REMOTE_ADDR=address).post(LOGIN, {"username": username, "password": password,
                                                        "next": "/admin/"}, **headers)
    return response.status_code, response.content.decode()


def _refused(reason: str) -> float:
    return REGISTRY.get_sample_value("execapp_password_checks_refused_total", {"reason": reason}) or 0.0


@pytest.fixture
def staff(settings: Any) -> User:
    settings.PASSWORD_HASHERS = FAST_HASHER
    return User.objects.create_user("admin", password="right-password", is_staff=True, is_superuser=True)


def test_a_flood_holding_the_check_slots_does_not_refuse_staff_from_another_network(
        settings: Any, staff: User, flood_checks: Any) -> None:
    settings.EXECAPP = {"MAX_PASSWORD_CHECKS": 2}
    release, held = flood_checks
    results: list[tuple[int, str]] = []
    flood = [threading.Thread(target=lambda: results.append(_sign_in(ATTACKER, "flood", "x")), daemon=True)
             for _ in range(4)]
    try:
        for thread in flood:
            thread.start()
        assert wait_until(lambda: len(results) == 3, LIVENESS)  # one check runs (held), the others refused
        assert len(held) == 1 and login_limit.running() == 1
        # Staff from elsewhere: the last slot was kept for another network (before: "login_busy").
        status, body = _sign_in(STAFF_NET, "admin", "right-password")
        assert status == 302, body
    finally:
        release.set()
        for thread in flood:
            thread.join(LIVENESS)
    assert all("checking 2 other sign-in attempts" in body for _, body in results[:3])
    assert login_limit.running() == 0


def test_a_network_past_its_failures_is_refused_unhashed_and_others_are_not(
        settings: Any, staff: User, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.EXECAPP = {"LOGIN_FAILURES_BURST": 3, "LOGIN_FAILURES_PER_MINUTE": 1.0}
    for i in range(3):  # three wrong passwords, each for a different name
        assert WRONG in _sign_in(ATTACKER, f"guess{i}", "wrong")[1]
    hashed: list[str] = []
    real = ModelBackend.authenticate
    monkeypatch.setattr(ModelBackend, "authenticate",
                        lambda self, request, username=None, password=None, **kw: hashed.append(username) or
                        real(self, request, username, password, **kw))
    before = _refused("network")
    # Refused before hashing, even with the right password; a forged X-Forwarded-For is not its address.
    status, body = _sign_in(ATTACKER, "admin", "right-password", HTTP_X_FORWARDED_FOR="10.9.8.7")
    assert status == 200 and "Too many failed sign-ins from your network; try again in 60 s." in body
    # An IPv6 client is judged by its /64: another address in it gains nothing.
    for i in range(3):
        _sign_in(ATTACKER_V6, f"v6-{i}", "wrong")
    assert "from your network" in _sign_in("2001:db8:1:2::beef", "admin", "right-password")[1]
    assert hashed == ["v6-0", "v6-1", "v6-2"] and _refused("network") == before + 2
    # Staff from another network sign in as ever.
    assert _sign_in(STAFF_NET, "admin", "right-password")[0] == 302


def test_a_username_guessed_from_many_networks_is_held_but_not_for_its_owners_network(
        settings: Any, staff: User) -> None:
    settings.EXECAPP = {"LOGIN_FAILURES_BURST": 3, "LOGIN_FAILURES_PER_MINUTE": 1.0}
    assert _sign_in(STAFF_NET, "admin", "right-password")[0] == 302  # the owner's network, known from now on
    before = _refused("username")
    for i in range(3):  # a distributed guess: one failure from each of three networks
        assert WRONG in _sign_in(f"203.0.113.{i + 1}", "Admin", "wrong")[1]  # case does not make a new name
    status, body = _sign_in(OTHER_NET, "admin", "right-password")
    assert status == 200 and "Too many failed sign-ins for this username" in body
    assert _refused("username") == before + 1
    # The owner, from the network that signed them in before, is not held by the flood on their name.
    assert _sign_in(STAFF_NET, "admin", "right-password")[0] == 302
    # Nor is anyone else's name.
    User.objects.create_user("ops", password="ops-password", is_staff=True)
    assert _sign_in(OTHER_NET, "ops", "ops-password")[0] == 302


def test_the_last_slot_rule_is_per_network_and_attempts_without_an_address_share_only_the_cap(settings: Any) -> None:
    from django.core.exceptions import ValidationError

    settings.EXECAPP = {"MAX_PASSWORD_CHECKS": 2}
    login_limit._begin(ATTACKER)
    with pytest.raises(ValidationError, match="checking 2 other sign-in attempts"):
        login_limit._begin(ATTACKER)  # its second check would take the last slot
    login_limit._begin(STAFF_NET)
    login_limit._end(ATTACKER)
    login_limit._end(STAFF_NET)
    login_limit._begin(None)  # no address (a Unix socket): one key for everyone, so no last-slot rule
    login_limit._begin(None)
    with pytest.raises(ValidationError):
        login_limit._begin(None)
    login_limit._end(None)
    login_limit._end(None)
    assert login_limit.running() == 0 and login_limit._running == {}


def test_burst_zero_turns_the_throttle_off(settings: Any, staff: User) -> None:
    settings.EXECAPP = {"LOGIN_FAILURES_BURST": 0}
    for _ in range(5):
        assert WRONG in _sign_in(ATTACKER, "admin", "wrong")[1]
    assert _sign_in(ATTACKER, "admin", "right-password")[0] == 302


def test_the_buckets_refill_and_stay_bounded() -> None:
    now = [0.0]
    throttle = login_throttle.LoginThrottle(2, 60.0, max_keys=4, clock=lambda: now[0])
    throttle.failed("n1", "a")
    throttle.failed("n1", "b")
    assert throttle.refusal("n1", "c") == ("network", pytest.approx(1.0))
    now[0] += 1.0  # 60 a minute: one failure earned back a second
    assert throttle.refusal("n1", "c") is None
    for i in range(10):  # many networks and names: each table keeps at most max_keys
        throttle.failed(f"m{i}", f"u{i}")
        throttle.succeeded(f"m{i}", f"u{i}")
    assert len(throttle._networks) <= 4 and len(throttle._usernames) <= 4 and len(throttle._known) <= 4
    assert login_throttle.username_key("  ADMIN ") == "admin" and login_throttle.username_key("") is None
    assert login_throttle.request_network(None) is None


@pytest.mark.parametrize(("key", "value"), [("LOGIN_FAILURES_BURST", -1), ("LOGIN_FAILURES_BURST", "10"),
                                            ("LOGIN_FAILURES_BURST", 2.5), ("LOGIN_FAILURES_BURST", True),
                                            ("LOGIN_FAILURES_PER_MINUTE", 0), ("LOGIN_FAILURES_PER_MINUTE", -6.0),
                                            ("LOGIN_FAILURES_PER_MINUTE", float("inf")),
                                            ("LOGIN_FAILURES_PER_MINUTE", "6")])
def test_a_bad_setting_is_a_check_error_naming_it(settings: Any, key: str, value: Any) -> None:
    settings.EXECAPP = {key: value}
    found = {m.id: m for m in check_execapp_settings()}
    check_id = "execapp.E120" if key == "LOGIN_FAILURES_BURST" else "execapp.E121"
    assert check_id in found and key in found[check_id].msg and repr(value) in found[check_id].msg
    assert "Default" in found[check_id].hint


def test_the_defaults_pass_the_checks(settings: Any) -> None:
    settings.EXECAPP = {}
    assert not {m.id for m in check_execapp_settings()} & {"execapp.E120", "execapp.E121"}
