"""Connections of a revoked (or deleted) API token are closed, not left running until they end;
so are those of a token moved to another tenant.

A token is judged at the handshake only, and a WebSocket may stay open for days: an operator who
revokes a leaked token expects its holder to be cut off, not only refused its next connection;
one who moves a token out of a tenant (a device handed on) expects it to stop reading that
tenant's sessions. Every ``EXECAPP['TOKEN_RECHECK_SECONDS']`` (10 s) each event loop with token
connections looks up, in one query, the tokens they were let in with, and closes with 1008 and a
reason naming the fix the connections whose token is gone or revoked, or whose owner (its
tenant) is no longer the one they connected as (docs/protocol.md, "Authentication").
0 turns the re-check off (revocation then refuses new connections only).

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
from .engine.ratelog import RateLimitedLog

log = logging.getLogger("execapp.auth")
_rare = RateLimitedLog(log, 60.0)

#: The close code (RFC 6455: policy violation) and reason of a connection whose token was revoked.
CLOSE_REVOKED = 1008
REVOKED_REASON = "token revoked: this connection's API token was revoked or deleted; reconnect with a live token"
MOVED_REASON = ("token moved: this connection's API token now belongs to another tenant; reconnect to use its "
                "new tenant's sessions")
#: Token ids per query (SQLite's older builds allow 999 variables in one statement).
_CHUNK = 500

#: What the watch closes: the consumer's coroutine that closes one connection.
Closer = Callable[[str], Coroutine[Any, Any, None]]


def revoked_connections_note() -> str:
    """What becomes of a revoked token's open connections, for the revoke command and admin action."""
    wait = interval()
    if wait <= 0:
        return ("its open connections keep running until they disconnect (EXECAPP['TOKEN_RECHECK_SECONDS'] is 0; "
                "set it above 0 to close them)")
    return f"its open connections are closed (1008) within {wait:g} s (EXECAPP['TOKEN_RECHECK_SECONDS'])"


def interval() -> float:
    """EXECAPP['TOKEN_RECHECK_SECONDS'] (0: off)."""
    return float(conf.get("TOKEN_RECHECK_SECONDS"))


@database_sync_to_async
def _live(ids: list[int]) -> dict[int, str]:
    """The owner of each of ``ids`` that is a token that exists and is not revoked."""
    from .models import ApiToken

    live: dict[int, str] = {}
    for start in range(0, len(ids), _CHUNK):
        rows = ApiToken.objects.filter(pk__in=ids[start:start + _CHUNK], revoked_at__isnull=True)
        live.update((pk, ApiToken.owner_of(tenant, name)) for pk, tenant, name in rows.values_list("pk", "tenant",
                                                                                                  "name"))
    return live


class TokenWatch:
    """One event loop's token connections, by token id, and the task that re-checks them."""

    def __init__(self) -> None:
        self._conns: dict[int, dict[Closer, tuple[str, str]]] = {}  # token id -> {closer: (token name, owner)}
        self._task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()

    def add(self, token_id: int, name: str, owner: str, closer: Closer) -> None:
        """Watch a connection let in with token ``token_id`` as ``owner`` (event loop); starts the
        re-check task."""
        self._conns.setdefault(token_id, {})[closer] = (name, owner)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="execapp-token-watch")

    def discard(self, token_id: int, closer: Closer) -> None:
        """The connection is gone (event loop)."""
        closers = self._conns.get(token_id)
        if closers is not None:
            closers.pop(closer, None)
            if not closers:
                del self._conns[token_id]

    async def _run(self) -> None:
        while self._conns:
            wait = interval()
            if wait <= 0:
                return
            await asyncio.sleep(wait)
            await self.check()

    async def check(self) -> int:
        """Close the connections of tokens no longer live or of another owner now; returns how many."""
        ids = list(self._conns)
        if not ids:
            return 0
        try:
            live = await _live(ids)
        except Exception as exc:  # the database is down: nothing is closed, tried again next time
            _rare.warning(("recheck", type(exc).__name__), "could not re-check the API tokens of open connections "
                          "(EXECAPP['TOKEN_RECHECK_SECONDS']); they keep running until the next check: %r", exc)
            return 0
        closed = 0
        for token_id in ids:
            owner = live.get(token_id)
            closers = self._conns.get(token_id, {})
            gone = [c for c, (_, was) in closers.items() if owner != was]
            if not gone:
                continue
            name = closers[gone[0]][0]
            log.info("closing %d connection(s) of API token %r: %s", len(gone), name,
                     "revoked or deleted" if owner is None else f"moved to {owner}")
            for closer in gone:
                self.discard(token_id, closer)
                self._close(closer, REVOKED_REASON if owner is None else MOVED_REASON)
                closed += 1
        return closed

    def _close(self, closer: Closer, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(closer(reason))  # each on its own: one slow socket holds no other
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def watched(self) -> int:
        """Connections watched now."""
        return sum(len(c) for c in self._conns.values())


_watches: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TokenWatch]" = weakref.WeakKeyDictionary()


def current() -> TokenWatch:
    """The running loop's TokenWatch (made on first use)."""
    loop = asyncio.get_running_loop()
    watch = _watches.get(loop)
    if watch is None:
        watch = _watches[loop] = TokenWatch()
    return watch


def watch(scope_auth: dict[str, Any], closer: Closer) -> int | None:
    """Watch a connection whose auth is ``scope_auth`` if it was let in by a token and the
    re-check is on; returns the token id to pass to ``current().discard`` (None: not watched)."""
    token_id = scope_auth.get("token_id")
    if scope_auth.get("kind") != "token" or not isinstance(token_id, int) or interval() <= 0:
        return None
    current().add(token_id, str(scope_auth.get("name", "")), str(scope_auth.get("owner", "")), closer)
    return token_id
