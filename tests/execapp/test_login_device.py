"""A browser that signed a username in before keeps its own sign-in lane (execapp/login_device.py).

Before: a flood from many networks at once (each under its own failure burst) could take every
password-check slot and hold the username under attack for its owner on every network that had
not signed it in on this worker: staff were refused for as long as it lasted.
"""
from __future__ import annotations

import threading
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core import signing
from django.test import Client, RequestFactory
from prometheus_client import REGISTRY

from execapp import login_device, login_limit
from tests.conftest import LIVENESS, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

LOGIN = "/admin/login/"
STAFF_NET, OTHER_NET = "198.51.100.4", "192.0.2.77"
WRONG = "Please enter the correct username"


@pytest.fixture
def staff(settings: Any) -> User:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # the lanes are the point
    return User.objects.create_user("admin", password="right-password", is_staff=True, is_superuser=True)


def _sign_in(address: str, username: str, password: str, cookie: str | None = None) -> tuple[int, str, Any]:
    """One attempt from a new browser at ``address``, carrying device cookie ``cookie`` if given."""
    client = Client(REMOTE_ADDR=address)
    if cookie is not None:
        client.cookies[login_device.COOKIE] = cookie
    response = client.post(LOGIN, {"username": username, "password": password, "next": "/admin/"})
    return response.status_code, response.content.decode(), response.cookies.get(login_device.COOKIE)


def _device_cookie() -> str:
    status, body, morsel = _sign_in(STAFF_NET, "admin", "right-password")
    assert status == 302, body
    assert morsel is not None and morsel["httponly"] and morsel["samesite"] == "Lax"
    return morsel.value


def test_a_sign_in_gives_a_signed_cookie_that_names_only_its_username(staff: User) -> None:
    cookie = _device_cookie()
    request = RequestFactory().get("/")
    request.COOKIES[login_device.COOKIE] = cookie
    assert login_device.device(request, "admin")
    assert login_device.device(request, "ops") is None  # another username's attempt gets nothing from it
    assert WRONG in _sign_in(STAFF_NET, "admin", "wrong")[1]
    assert _sign_in(STAFF_NET, "admin", "wrong")[2] is None  # a failed attempt is given no cookie
    for forged in (cookie[:-2] + ("AA" if not cookie.endswith("AA") else "BB"),  # altered signature
                   signing.dumps({"u": "admin", "d": "x"}, salt="another purpose"),  # signed for something else
                   "x" * (login_device.MAX_COOKIE_CHARS + 1)):
        request.COOKIES[login_device.COOKIE] = forged
        assert login_device.device(request, "admin") is None


def test_an_expired_cookie_is_no_device(staff: User, monkeypatch: pytest.MonkeyPatch) -> None:
    cookie = _device_cookie()
    monkeypatch.setattr(login_device, "MAX_AGE_SECONDS", -1)
    request = RequestFactory().get("/")
    request.COOKIES[login_device.COOKIE] = cookie
    assert login_device.device(request, "admin") is None


def test_a_flood_from_many_networks_holding_every_slot_does_not_hold_a_device_holder(
        settings: Any, staff: User, flood_checks: Any) -> None:
    cookie = _device_cookie()
    settings.EXECAPP = {"MAX_PASSWORD_CHECKS": 2}
    release, held = flood_checks
    # Two networks, one check each: every slot is taken, and no per-network rule refuses them.
    flood = [threading.Thread(target=_sign_in, args=(f"203.0.113.{i + 1}", "flood", "x"), daemon=True)
             for i in range(2)]
    try:
        for thread in flood:
            thread.start()
        assert wait_until(lambda: len(held) == 2, LIVENESS)
        # Without its cookie the owner is refused (what the flood did before) ...
        status, body, _ = _sign_in(OTHER_NET, "admin", "right-password")
        assert "checking 2 other sign-in attempts right now" in body
        # ... with it, from anywhere, the kept slot checks the password.
        status, body, renewed = _sign_in(OTHER_NET, "admin", "right-password", cookie)
        assert status == 302, body
        assert renewed is not None and renewed.value != cookie  # a new device cookie at each sign-in
        assert login_limit.running() == 2  # the kept slot was given back
    finally:
        release.set()
        for thread in flood:
            thread.join(LIVENESS)
    assert login_limit.running() == 0


def test_the_kept_slot_is_one(settings: Any) -> None:
    from django.core.exceptions import ValidationError

    settings.EXECAPP = {"MAX_PASSWORD_CHECKS": 1}
    first = login_limit._begin("192.0.2.1")
    kept = login_limit._begin("192.0.2.2", device="d1")  # the cap is reached: a device takes the kept slot
    with pytest.raises(ValidationError) as refused:
        login_limit._begin("192.0.2.3", device="d2")  # ... and only one does
    assert refused.value.code == login_limit.LOGIN_BUSY
    login_limit._end(kept)
    again = login_limit._begin("192.0.2.3", device="d2")
    login_limit._end(again)
    login_limit._end(first)
    assert login_limit.running() == 0


def test_a_guessed_username_is_not_held_for_its_device_but_a_device_has_its_own_burst(
        settings: Any, staff: User) -> None:
    settings.EXECAPP = {"LOGIN_FAILURES_BURST": 3, "LOGIN_FAILURES_PER_MINUTE": 1.0}
    cookie = _device_cookie()  # (after the settings: a throttle made for other settings starts empty)
    for i in range(3):  # a distributed guess at the name, one failure from each network
        assert WRONG in _sign_in(f"203.0.113.{i + 1}", "admin", "wrong")[1]
    assert "Too many failed sign-ins for this username" in _sign_in(OTHER_NET, "admin", "right-password")[1]
    # The owner's browser, from a network that never signed the name in, is not held by it.
    assert _sign_in(OTHER_NET, "admin", "right-password", cookie)[0] == 302
    # A stolen cookie buys one device's burst of guesses, not more.
    for _ in range(3):
        assert WRONG in _sign_in(OTHER_NET, "admin", "wrong", cookie)[1]
    before = REGISTRY.get_sample_value("execapp_password_checks_refused_total", {"reason": "device"})
    status, body, _ = _sign_in(OTHER_NET, "admin", "right-password", cookie)
    assert status == 200 and "Too many failed sign-ins from this browser; try again in 60 s." in body
    assert REGISTRY.get_sample_value("execapp_password_checks_refused_total", {"reason": "device"}) == before + 1
    # Its failures were the device's: the owner's known network still signs in.
    assert _sign_in(STAFF_NET, "admin", "right-password")[0] == 302
