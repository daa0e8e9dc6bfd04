"""A cap on the password checks one worker process runs at once (the admin's login, anyone's).

Django's ``ModelBackend`` runs the password hasher on every sign-in attempt: PBKDF2 at 1,000,000
iterations, ~0.55 s of CPU here, and once for a user that does not exist too (so that the time
does not tell who does). The admin's login page needs no credentials to post to, and Django runs
each request in a thread of its own, so every concurrent POST was another thread hashing: 40
clients posting wrong passwords kept 40 threads busy on a 2-core machine, and ``/healthz`` took
2.7 s instead of 10 ms (measured with a scratch client against one worker). Nothing limited it.

``LimitedModelBackend`` is Django's ``ModelBackend`` that lets at most
``EXECAPP['MAX_PASSWORD_CHECKS']`` checks run at once per worker process: past it the attempt is
refused before any hashing with a ``ValidationError`` (code ``login_busy``), which the login form
shows as its error ("try again in a moment"). A flood of attempts then costs a worker at most that
many threads of CPU, whatever its size; a legitimate sign-in waits a moment behind it at worst.
Alone, that cap was a lockout: one client's attempts on a few connections held every slot and
staff signing in from anywhere else were refused while it lasted. So a client network that has a
check running may not take the last free slot (it is kept for another network), and failed
sign-ins are counted per client network and per username (``execapp/login_throttle.py``): past
``LOGIN_FAILURES_BURST`` of them an attempt from that network, or for that username from a network
that never signed it in, is refused before hashing (code ``login_throttled``, with the seconds to
wait). A browser that signed the username in before (a device cookie, ``execapp/login_device.py``)
is judged by its own device's failures and may use one more slot, kept for such browsers, so a
flood from many networks at once holds neither its name nor every slot against it. Refusals are
counted in ``execapp_password_checks_refused_total{reason}``.
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import ValidationError

from . import conf, login_device, login_throttle, metrics
from .engine.ratelog import RateLimitedLog

log = logging.getLogger("execapp.login_limit")
_rare = RateLimitedLog(log, 60.0)

#: The ValidationError code of a sign-in refused because the worker checks enough passwords already.
LOGIN_BUSY = "login_busy"
#: The ValidationError code of a sign-in refused because its network or username failed too often.
LOGIN_THROTTLED = "login_throttled"

# Django runs each request's view in a thread of its own (and aauthenticate on the loop): one
# lock for the count of checks running, in all and per client network ("" for no address).
_lock = threading.Lock()
_running: dict[str, int] = {}
_total = 0
#: Checks running in the slot kept for device holders (0 or 1), past MAX_PASSWORD_CHECKS.
_kept = 0
#: The key of a check that runs in the kept slot (it is not counted in _running or _total).
_KEPT = object()


def _refuse_busy(limit: int) -> None:
    metrics.PASSWORD_CHECKS_REFUSED.labels("busy").inc()
    _rare.warning(LOGIN_BUSY, "refused a sign-in attempt: %d password checks already run on this worker "
                  "(EXECAPP['MAX_PASSWORD_CHECKS']); a flood of login attempts?", limit)
    raise ValidationError(f"This server is checking {limit} other sign-in attempts right now; try again in a "
                          "moment.", code=LOGIN_BUSY)


def _refuse_throttled(reason: str, wait: float, network: str | None) -> None:
    metrics.PASSWORD_CHECKS_REFUSED.labels(reason).inc()
    seconds = max(1, math.ceil(wait)) if math.isfinite(wait) else 60
    _rare.warning(LOGIN_THROTTLED + reason, "refused a sign-in attempt unhashed: too many failed sign-ins %s "
                  "(EXECAPP['LOGIN_FAILURES_BURST']); last from network %s", f"for its {reason}", network)
    if reason == login_throttle.NETWORK:
        text = f"Too many failed sign-ins from your network; try again in {seconds} s."
    elif reason == login_throttle.DEVICE:
        text = f"Too many failed sign-ins from this browser; try again in {seconds} s."
    else:
        text = (f"Too many failed sign-ins for this username; try again in {seconds} s, or from a network "
                "it signed in from before.")
    raise ValidationError(text, code=LOGIN_THROTTLED)


def _begin(network: str | None, device: str | None = None) -> Any:
    """Count one password check in and return its key for ``_end``, or raise ``login_busy`` when the
    worker is at its cap (or at its last slot, and this network already has a check running); a
    known ``device`` may then take the one slot kept for device holders."""
    global _total, _kept
    limit = int(conf.get("MAX_PASSWORD_CHECKS"))
    key: Any = network or ""
    with _lock:
        mine = _running.get(key, 0)
        # No address (a Unix socket): every client would share one key, so the global cap alone.
        if _total >= limit or (mine and network and _total >= limit - 1):
            if device is not None and not _kept:
                _kept, key = 1, _KEPT
            else:
                key = None
        else:
            _running[key] = mine + 1
            _total += 1
    if key is None:
        _refuse_busy(limit)
    return key


def _end(key: Any) -> None:
    """Count a check out, by the key ``_begin`` gave it (a network, None or "" for none, or the kept slot)."""
    global _total, _kept
    key = "" if key is None else key
    with _lock:
        if key is _KEPT:
            _kept = 0
            return
        _total -= 1
        left = _running[key] - 1
        if left:
            _running[key] = left
        else:
            del _running[key]  # so the table holds only networks with a check running


def running() -> int:
    """Password checks running now in this process (the device holders' kept slot included)."""
    return _total + _kept


def _admit(request: Any, username: Any) -> tuple[Any, str | None, str | None, str | None, Any]:
    """Refuse an attempt whose device, network or username is throttled, then count its check in."""
    throttle = login_throttle.current()
    network, name = login_throttle.request_network(request), login_throttle.username_key(username)
    device = login_device.device(request, name)
    refusal = throttle.refusal(network, name, device)
    if refusal is not None:
        _refuse_throttled(*refusal, network)
    return throttle, network, name, device, _begin(network, device)


def _judged(request: Any, admitted: tuple[Any, str | None, str | None, str | None, Any], user: Any) -> Any:
    """Count a hashed attempt's outcome (no user: a failure; a user: its browser gets a device cookie)."""
    throttle, network, name, device, _ = admitted
    if user is None:
        throttle.failed(network, name, device)
    else:
        throttle.succeeded(network, name)
        if name is not None:
            login_device.signed_in(request, name)
    return user


def _username(username: str | None, kwargs: dict[str, Any]) -> Any:
    """The name an attempt signs in with (ModelBackend reads USERNAME_FIELD when ``username`` is not given)."""
    return username if username is not None else kwargs.get(get_user_model().USERNAME_FIELD)


class LimitedModelBackend(ModelBackend):
    """Django's ModelBackend, at most MAX_PASSWORD_CHECKS at once per process and failed sign-ins
    throttled per network and username (see the module)."""

    def authenticate(self, request: Any, username: str | None = None, password: str | None = None,
                     **kwargs: Any) -> Any:
        if password is None:  # nothing to hash: ModelBackend returns at once
            return None
        admitted = _admit(request, _username(username, kwargs))
        try:
            user = super().authenticate(request, username, password, **kwargs)
        finally:
            _end(admitted[-1])  # an exception (the database) is no verdict on the password: not counted
        return _judged(request, admitted, user)

    async def aauthenticate(self, request: Any, username: str | None = None, password: str | None = None,
                            **kwargs: Any) -> Any:
        if password is None:
            return None
        admitted = _admit(request, _username(username, kwargs))
        try:
            user = await super().aauthenticate(request, username, password, **kwargs)
        finally:
            _end(admitted[-1])  # an exception (the database) is no verdict on the password: not counted
        return _judged(request, admitted, user)
