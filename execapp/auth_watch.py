"""Open connections whose credentials were withdrawn are closed, not left running until they end.

A client is judged at the handshake only, and a WebSocket may stay open for days: an operator who
revokes (or deletes) a leaked token expects its holder to be cut off, not only refused its next
connection; one who moves a token to another tenant (a device handed on) expects it to stop
reading the old tenant's sessions; one who deactivates a staff user, or takes its staff status,
expects its dashboard sockets to go, and a staff user who logs out (or changes the password
after a cookie was stolen) expects those of that session to go. Every
``EXECAPP['AUTH_RECHECK_SECONDS']`` (10 s) each event loop with such connections looks up, in one
query per kind (tokens, users; one session load per staff socket), the credentials they were let
in with, and closes with 1008 and a reason naming the fix those whose credential is
gone, or whose owner is no longer the one they connected as (docs/protocol.md,
"Authentication"). 0 turns the re-check off (a withdrawn credential then refuses new
connections only).

A failed lookup (the database is down) closes nothing: it is logged once a minute and tried
again at the next interval, so an outage does not cut every client off.
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Callable, Coroutine

from channels.db import database_sync_to_async

from . import conf
from .db_deadline import statement_deadline
from .engine.ratelog import RateLimitedLog

log = logging.getLogger("execapp.auth")
_rare = RateLimitedLog(log, 60.0)

#: The close code (RFC 6455: policy violation) and the reasons of a connection closed here.
CLOSE_REVOKED = 1008
REVOKED_REASON = "token revoked: this connection's API token was revoked or deleted; reconnect with a live token"
MOVED_REASON = ("token moved: this connection's API token now belongs to another tenant; reconnect to use its "
                "new tenant's sessions")
#: (A close reason holds at most 123 bytes.)
STAFF_REASON = ("staff session ended: logged out, expired, password changed, or no longer active staff; log in again "
                "as active staff")
#: Ids per query (SQLite's older builds allow 999 variables in one statement).
_CHUNK = 500

#: What the watch closes: the consumer's coroutine that closes one connection with a reason.
Closer = Callable[[str], Coroutine[Any, Any, None]]
#: A watched credential: ("token", ApiToken pk) or ("user", User pk).
#: A credential: ("token", token id), ("session", session key) or ("user", user id).
Key = tuple[str, int | str]


def revoked_connections_note() -> str:
    """What becomes of a revoked token's open connections, for the revoke command and admin action."""
    wait = interval()
    if wait <= 0:
        return ("its open connections keep running until they disconnect (EXECAPP['AUTH_RECHECK_SECONDS'] is 0; "
                "set it above 0 to close them)")
    return f"its open connections are closed (1008) within {wait:g} s (EXECAPP['AUTH_RECHECK_SECONDS'])"


def interval() -> float:
    """EXECAPP['AUTH_RECHECK_SECONDS'] (0: off)."""
    return float(conf.get("AUTH_RECHECK_SECONDS"))


@database_sync_to_async
def _live(keys: list[Key]) -> dict[Key, str]:
    """The owner of each of ``keys`` that is still a live credential: a token that exists and is
    not revoked, a user that exists and is active staff."""
    from django.contrib.auth import get_user_model

    from .models import ApiToken

    # On the worker's one sync thread, ahead of handshakes: a locked table must not hold it.
    with statement_deadline():
        live: dict[Key, str] = {}
        tokens = [i for kind, i in keys if kind == "token"]
        users = [i for kind, i in keys if kind == "user"]
        for start in range(0, len(tokens), _CHUNK):
            rows = ApiToken.objects.filter(pk__in=tokens[start:start + _CHUNK], revoked_at__isnull=True)
            live.update((("token", pk), ApiToken.owner_of(tenant, name))
                        for pk, tenant, name in rows.values_list("pk", "tenant", "name"))
        for start in range(0, len(users), _CHUNK):
            rows = get_user_model().objects.filter(pk__in=users[start:start + _CHUNK], is_active=True, is_staff=True)
            live.update((("user", pk), f"user:{pk}") for pk in rows.values_list("pk", flat=True))
        live.update(_live_sessions([str(i) for kind, i in keys if kind == "session"]))
        return live


def _live_sessions(session_keys: list[str]) -> dict[Key, str]:
    """Each session still logged in as active staff, as Django's own get_user judges it: not
    logged out, flushed or expired, and its password hash still the user's (a password change
    ends a stolen cookie's sessions). One session load per key: staff sockets are few."""
    from importlib import import_module

    from django.conf import settings
    from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model
    from django.utils.crypto import constant_time_compare

    if not session_keys:
        return {}
    engine = import_module(settings.SESSION_ENGINE)
    held = {}
    for key in session_keys:
        data = engine.SessionStore(session_key=key).load()  # {} when gone or expired
        if data.get(SESSION_KEY) is not None:
            held[key] = (str(data[SESSION_KEY]), str(data.get(HASH_SESSION_KEY) or ""))
    model = get_user_model()
    users = {str(u.pk): u for u in model.objects.filter(pk__in={model._meta.pk.to_python(pk) for pk, _ in
                                                               held.values()}, is_active=True, is_staff=True)}
    live: dict[Key, str] = {}
    for key, (pk, digest) in held.items():
        user = users.get(pk)
        if user is not None and constant_time_compare(digest, user.get_session_auth_hash()):
            live[("session", key)] = f"user:{user.pk}"
    return live


def _reason(kind: str, owner: str | None) -> tuple[str, str]:
    """The close reason, and what the log says, for a credential of ``kind`` now owned by ``owner``."""
    if kind in ("user", "session"):
        return STAFF_REASON, "logged out, expired or no longer active staff"
    return (REVOKED_REASON, "revoked or deleted") if owner is None else (MOVED_REASON, f"moved to {owner}")


class AuthWatch:
    """One event loop's watched connections, by credential, and the task that re-checks them."""

    def __init__(self) -> None:
        self._conns: dict[Key, dict[Closer, tuple[str, str]]] = {}  # credential -> {closer: (name, owner)}
        self._task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()

    def add(self, key: Key, name: str, owner: str, closer: Closer) -> None:
        """Watch a connection let in with credential ``key`` as ``owner`` (event loop); starts the
        re-check task."""
        self._conns.setdefault(key, {})[closer] = (name, owner)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="execapp-auth-watch")

    def discard(self, key: Key, closer: Closer) -> None:
        """The connection is gone (event loop)."""
        closers = self._conns.get(key)
        if closers is not None:
            closers.pop(closer, None)
            if not closers:
                del self._conns[key]

    async def _run(self) -> None:
        while self._conns:
            wait = interval()
            if wait <= 0:
                return
            await asyncio.sleep(wait)
            await self.check()

    async def check(self) -> int:
        """Close the connections whose credential is no longer live, or of another owner now;
        returns how many."""
        keys = list(self._conns)
        if not keys:
            return 0
        try:
            live = await _live(keys)
        except Exception as exc:  # the database is down: nothing is closed, tried again next time
            _rare.warning(("recheck", type(exc).__name__), "could not re-check the credentials of open connections "
                          "(EXECAPP['AUTH_RECHECK_SECONDS']); they keep running until the next check: %r", exc)
            return 0
        closed = 0
        for key in keys:
            owner = live.get(key)
            closers = self._conns.get(key, {})
            gone = [c for c, (_, was) in closers.items() if owner != was]
            if not gone:
                continue
            reason, why = _reason(key[0], owner)
            log.info("closing %d connection(s) of %s %r: %s", len(gone), "API token" if key[0] == "token" else "staff",
                     closers[gone[0]][0], why)
            for closer in gone:
                self.discard(key, closer)
                self._close(closer, reason)
                closed += 1
        return closed

    def _close(self, closer: Closer, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(closer(reason))  # each on its own: one slow socket holds no other
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def watched(self) -> int:
        """Connections watched now."""
        return sum(len(c) for c in self._conns.values())


_watches: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AuthWatch]" = weakref.WeakKeyDictionary()


def current() -> AuthWatch:
    """The running loop's AuthWatch (made on first use)."""
    loop = asyncio.get_running_loop()
    watch = _watches.get(loop)
    if watch is None:
        watch = _watches[loop] = AuthWatch()
    return watch


def watch(scope_auth: dict[str, Any], closer: Closer) -> Key | None:
    """Watch a connection whose auth is ``scope_auth`` (a token's or a staff session's, as
    execapp.auth sets it) if the re-check is on; returns the key to pass to ``current().discard``
    (None: not watched)."""
    kind = scope_auth.get("kind")
    ident = scope_auth.get("token_id" if kind == "token" else "user_id")
    if kind not in ("token", "session") or not isinstance(ident, int) or interval() <= 0:
        return None
    session_key = scope_auth.get("session_key") if kind == "session" else None
    # A staff socket lives as long as the session it was opened with (logging out ends it), not
    # only as long as its user is active staff.
    key: Key = ("session", session_key) if isinstance(session_key, str) and session_key else (
        "token" if kind == "token" else "user", ident)
    current().add(key, str(scope_auth.get("name", "")), str(scope_auth.get("owner", "")), closer)
    return key
