"""Connections of a revoked (or deleted) API token are closed, not left running until they end.

A token is judged at the handshake only, and a WebSocket may stay open for days: an operator who
revokes a leaked token expects its holder to be cut off, not only refused its next connection.
Every ``EXECAPP['TOKEN_RECHECK_SECONDS']`` (10 s) each event loop with token connections looks
up, in one query, which of the tokens they were let in with are still live, and closes the
connections of the others with 1008 and a reason naming the fix (docs/protocol.md,
"Authentication"). 0 turns the re-check off (revocation then refuses new connections only).

A failed lookup (the database is down) closes nothing: it is logged once a minute and tried
again at the next interval, so an outage does not cut every client off.
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Callable, Coroutine, Iterable

from channels.db import database_sync_to_async

from . import conf
from .engine.ratelog import RateLimitedLog

log = logging.getLogger("execapp.auth")
_rare = RateLimitedLog(log, 60.0)

#: The close code (RFC 6455: policy violation) and reason of a connection whose token was revoked.
CLOSE_REVOKED = 1008
REVOKED_REASON = "token revoked: this connection's API token was revoked or deleted; reconnect with a live token"
#: Token ids per query (SQLite's older builds allow 999 variables in one statement).
_CHUNK = 500

#: What the watch closes: the consumer's coroutine that closes one connection.
Closer = Callable[[], Coroutine[Any, Any, None]]


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
def _live(ids: list[int]) -> set[int]:
    """Which of ``ids`` are tokens that exist and are not revoked."""
    from .models import ApiToken

    live: set[int] = set()
    for start in range(0, len(ids), _CHUNK):
        live.update(ApiToken.objects.filter(pk__in=ids[start:start + _CHUNK], revoked_at__isnull=True)
                    .values_list("pk", flat=True))
    return live


class TokenWatch:
    """One event loop's token connections, by token id, and the task that re-checks them."""

    def __init__(self) -> None:
        self._conns: dict[int, dict[Closer, str]] = {}  # token id -> {closer: token name}
        self._task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()

    def add(self, token_id: int, name: str, closer: Closer) -> None:
        """Watch a connection let in with token ``token_id`` (event loop); starts the re-check task."""
        self._conns.setdefault(token_id, {})[closer] = name
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
        """Close the connections of tokens no longer live; returns how many were closed."""
        ids = list(self._conns)
        if not ids:
            return 0
        try:
            live = await _live(ids)
        except Exception as exc:  # the database is down: nothing is closed, tried again next time
            _rare.warning(("recheck", type(exc).__name__), "could not re-check the API tokens of open connections "
                          "(EXECAPP['TOKEN_RECHECK_SECONDS']); they keep running until the next check: %r", exc)
            return 0
        return self._close(i for i in ids if i not in live)

    def _close(self, revoked: Iterable[int]) -> int:
        closed = 0
        loop = asyncio.get_running_loop()
        for token_id in revoked:
            closers = self._conns.pop(token_id, {})
            if closers:
                log.info("closing %d connection(s) of revoked API token %r", len(closers), next(iter(closers.values())))
            for closer in closers:
                task = loop.create_task(closer())  # each on its own: one slow socket holds no other
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
                closed += 1
        return closed

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
    current().add(token_id, str(scope_auth.get("name", "")), closer)
    return token_id
