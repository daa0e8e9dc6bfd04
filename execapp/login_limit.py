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
Refusals are counted in ``execapp_password_checks_refused_total``.
"""
from __future__ import annotations

import logging
from typing import Any

from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import ValidationError

from . import conf, metrics
from .engine.ratelog import RateLimitedLog
from .running_cap import RunningCap

log = logging.getLogger("execapp.login_limit")
_rare = RateLimitedLog(log, 60.0)

#: The ValidationError code of a sign-in refused because the worker checks enough passwords already.
LOGIN_BUSY = "login_busy"

# Django runs each request's view in a thread of its own (and aauthenticate on the loop): one
# count for both.
_checks = RunningCap()


def _begin() -> None:
    """Count one password check in, or raise the ``login_busy`` ValidationError when the worker is at the cap."""
    limit = int(conf.get("MAX_PASSWORD_CHECKS"))
    if _checks.acquire(limit):
        return
    metrics.PASSWORD_CHECKS_REFUSED.inc()
    _rare.warning(LOGIN_BUSY, "refused a sign-in attempt: %d password checks already run on this worker "
                  "(EXECAPP['MAX_PASSWORD_CHECKS']); a flood of login attempts?", limit)
    raise ValidationError(f"This server is checking {limit} other sign-in attempts right now; try again in a "
                          "moment.", code=LOGIN_BUSY)


def _end() -> None:
    _checks.release()


def running() -> int:
    """Password checks running now in this process."""
    return _checks.now


class LimitedModelBackend(ModelBackend):
    """Django's ModelBackend, at most MAX_PASSWORD_CHECKS at once per process (see the module)."""

    def authenticate(self, request: Any, username: str | None = None, password: str | None = None,
                     **kwargs: Any) -> Any:
        if password is None:  # nothing to hash: ModelBackend returns at once
            return None
        _begin()
        try:
            return super().authenticate(request, username, password, **kwargs)
        finally:
            _end()

    async def aauthenticate(self, request: Any, username: str | None = None, password: str | None = None,
                            **kwargs: Any) -> Any:
        if password is None:
            return None
        _begin()
        try:
            return await super().aauthenticate(request, username, password, **kwargs)
        finally:
            _end()
