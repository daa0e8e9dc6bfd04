"""Device cookies: a browser that signed a username in before gets its own sign-in lane.

The failure buckets per network and username (``execapp/login_throttle.py``) and the cap on
password checks (``execapp/login_limit.py``) hold a flood from one place, but a flood from many
addresses at once (a botnet, each address under its own burst) still took every check slot:
staff signing in were refused "try again in a moment" for as long as it lasted, and a username
under attack was held for its owner too (unless their network had signed it in on this worker).

After a successful sign-in the browser is given a signed cookie (``execapp_device``, signed with
``SECRET_KEY`` through ``django.core.signing``, valid ``MAX_AGE_SECONDS``) naming the username
and a random device id. An attempt that carries a valid one for the username it signs in with:

- is judged by its device's own failure bucket only (``LOGIN_FAILURES_BURST``, as the others), not
  by its network's or its username's, so a flood against the name does not hold its owner;
- may run its password check in one slot kept for device holders past ``MAX_PASSWORD_CHECKS``,
  so a flood that fills every other slot does not hold it either.

Nothing here is trusted without the password: the cookie only chooses which bucket and slot an
attempt uses. A stolen cookie gives its thief one device's burst of guesses, then that device
waits like anyone. The cookie is stateless (no table), so it holds on every worker process.
"""
from __future__ import annotations

import secrets
from typing import Any

from django.core import signing

#: The cookie's name, and the salt that keeps its signature from serving any other purpose.
COOKIE = "execapp_device"
SALT = "execapp.login_device"
#: How long a device cookie is honoured after the sign-in that gave it (renewed at each sign-in).
MAX_AGE_SECONDS = 30 * 24 * 3600
#: Longest cookie value read (a genuine one is ~100 characters): nothing longer is unsigned.
MAX_COOKIE_CHARS = 512
#: The request attribute a sign-in leaves for the middleware to turn into a cookie.
_PENDING = "_execapp_device_cookie"


def issue(username: str) -> str:
    """A new signed device cookie value for ``username`` (already in its throttle key form)."""
    return signing.dumps({"u": username, "d": secrets.token_urlsafe(12)}, salt=SALT)


def device(request: Any, username: str | None) -> str | None:
    """The device id of the request's cookie if it is valid and names ``username``, else None."""
    if username is None:
        return None
    cookies = getattr(request, "COOKIES", None) or {}
    value = cookies.get(COOKIE)
    if not isinstance(value, str) or not value or len(value) > MAX_COOKIE_CHARS:
        return None
    try:
        payload = signing.loads(value, salt=SALT, max_age=MAX_AGE_SECONDS)
    except signing.BadSignature:  # forged, altered, expired (SignatureExpired is a BadSignature)
        return None
    if not isinstance(payload, dict) or payload.get("u") != username or not isinstance(payload.get("d"), str):
        return None
    return payload["d"]


def signed_in(request: Any, username: str) -> None:
    """Called on a successful sign-in: the response to ``request`` will carry a new device cookie."""
    if request is not None:
        setattr(request, _PENDING, issue(username))


class LoginDeviceMiddleware:
    """Sets the device cookie on the response to a request that signed someone in."""

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        response = self.get_response(request)
        value = getattr(request, _PENDING, None)
        if value is not None:
            # HttpOnly: no script reads it; Lax: sent on the login form's own POST; Secure on HTTPS.
            response.set_cookie(COOKIE, value, max_age=MAX_AGE_SECONDS, httponly=True, samesite="Lax",
                                secure=request.is_secure(), path="/")
        return response
