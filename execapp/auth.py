"""Handshake authentication for WebSockets: an API token, else a logged-in staff session, else HTTP 403.

Each authenticated client gets an *owner* (``scope['execapp_auth']['owner']``): the namespace of
its session groups (docs/protocol.md, "Owners"). A token's owner is its tenant, a staff
session's owner is its user.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import logging
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs

from channels.auth import AuthMiddleware, get_user
from channels.db import database_sync_to_async
from channels.sessions import CookieMiddleware, SessionMiddleware
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.db import Error as DatabaseError
from django.middleware.csrf import CsrfViewMiddleware

from . import auth_throttle, conf, metrics
from .codes import AUTH_THROTTLED, UNAUTHORIZED
from .db_deadline import statement_deadline
from .engine.ratelog import RateLimitedLog

log = logging.getLogger("execapp.auth")
#: A database outage fails every handshake: one log line per cause per minute, with a count.
_rare = RateLimitedLog(log, 60.0)

#: WebSocket close codes of a handshake that could not be judged (RFC 6455 / IANA registry).
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_INTERNAL_ERROR = 1011
#: A close frame's reason is at most 123 bytes of UTF-8.
_MAX_REASON_BYTES = 123
#: Credential lookups (a token's, or a session's up to the gate) this process is running now
#: (event loop only; EXECAPP['MAX_TOKEN_LOOKUPS']).
_lookups = [0]


class _Judging:
    """One handshake's credentials being looked up: counted in ``_lookups`` until ``done``."""

    __slots__ = ("reached", "_counted")

    def __init__(self) -> None:
        #: The session gate ran: from there the socket may be read or answered.
        self.reached = False
        self._counted = True
        _lookups[0] += 1

    def done(self) -> None:
        if self._counted:
            self._counted = False
            _lookups[0] -= 1

#: Token lookups running now, by the presented token's SHA-256 (event loop only). Handshakes that
#: present a token already being looked up share that lookup: one tenant's burst of reconnects
#: (150 at once with one token, on a 2-worker deployment) took every one of a worker's
#: MAX_TOKEN_LOOKUPS and other tenants' handshakes were closed 1013 "checking too many
#: credentials"; now it is one lookup. (Distinct bad tokens are the failure throttle's.)
_token_lookups: "dict[str, asyncio.Future]" = {}


def _shared_lookup(raw: str) -> "asyncio.Future | None":
    """The lookup of token ``raw`` already running on this worker, or None."""
    return _token_lookups.get(hashlib.sha256(raw.encode()).hexdigest())


def _start_lookup(raw: str) -> "asyncio.Future":
    """Look token ``raw`` up once for every handshake presenting it meanwhile, counted in
    ``_lookups`` while it runs; a task, so that a handshake that goes away does not end it for the others."""
    key = hashlib.sha256(raw.encode()).hexdigest()
    judging = _Judging()
    task = asyncio.ensure_future(_authenticate(raw))

    def ended(done: "asyncio.Future") -> None:
        judging.done()
        if _token_lookups.get(key) is done:
            del _token_lookups[key]
        if not done.cancelled():
            done.exception()  # retrieved: the handshakes that awaited it have it too

    task.add_done_callback(ended)
    _token_lookups[key] = task
    return task


#: Scope key of the handshake's _Judging, which _SessionGate ends once it runs (see TokenAuthMiddleware).
_GATE_REACHED = "execapp_gate_reached"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def token_from_scope(scope: Scope) -> str | None:
    """The raw token of a handshake: ``Authorization: Bearer <t>`` or ``?token=<t>``; None if absent."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, raw = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer":
                return raw.strip()
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
    return values[0] if values else None


@database_sync_to_async
def _authenticate(raw: str) -> Any:
    from .models import ApiToken

    with statement_deadline():  # a locked or hung database fails the lookup (1013), never holds it
        return ApiToken.authenticate(raw)


async def deny(scope: Scope, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]],
               code: str, message: str, outcome: str | None = UNAUTHORIZED) -> None:
    """Refuse a handshake before accepting it: the server answers HTTP 403; the reason is logged,
    and ``outcome`` (an authentication refusal by default; None: not counted) is counted in
    ``execapp_events_total``.

    (An HTTP body through the ``websocket.http.response`` extension would carry the reason to
    the client, but uvicorn 0.54 then logs "ASGI callable returned without completing
    handshake" at ERROR for every refusal: noise an operator would page on.)
    """
    first = await receive()
    if first.get("type") != "websocket.connect":
        return
    # Once per code per minute: a client retrying bad tokens in a loop must not flood the log
    # (the refusals are counted in execapp_events_total all the same).
    _rare.log(logging.INFO, ("refused", code), "refused WebSocket %s (%s): %s", scope.get("path"), code, message)
    if outcome is not None:
        metrics.count_event(outcome)
    if outcome == UNAUTHORIZED:  # judged and refused: one failure of this client network
        auth_throttle.current().failed(auth_throttle.client_network(scope))
    await send({"type": "websocket.close"})


def close_reason(text: str) -> str:
    """``text`` cut to what a WebSocket close frame can carry (123 bytes of UTF-8)."""
    return text.encode("utf-8", "replace")[:_MAX_REASON_BYTES].decode("utf-8", "ignore")


async def refuse_unavailable(receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]],
                             code: int, reason: str) -> None:
    """Refuse a handshake that could not be judged, with a close code and a reason the client sees.

    A close before accept is an HTTP 403 without a reason, so the socket is accepted and closed
    at once. Call it only before anything of this socket was received or sent."""
    first = await receive()
    if first.get("type") != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.close", "code": code, "reason": close_reason(reason)})


def database_unavailable(path: Any, exc: BaseException) -> str:
    """Log a handshake refused for a database error (once per cause per minute); the close reason."""
    _rare.warning(("database", type(exc).__name__), "refused WebSocket %s: the database is unavailable: %s", path, exc)
    # The details (hosts, ports, the driver's message) stay in the log: the client is not trusted yet.
    return "database unavailable: the server cannot check credentials now; try again later"


@database_sync_to_async
def _session_user(scope: Scope) -> Any:
    """Channels' get_user (the session cookie's session, then its user) within the lookup deadline."""
    with statement_deadline():  # a locked django_session or auth_user fails it (1013), never holds it
        return get_user.func(scope)


class _DeadlineAuthMiddleware(AuthMiddleware):
    """Channels' AuthMiddleware whose session and user lookups have the token lookup's deadline: they
    run on the worker's one sync thread too, and a locked table held every handshake behind them."""

    async def resolve_scope(self, scope: Scope) -> None:
        scope["user"]._wrapped = await _session_user(scope)


class _SessionGate:
    """Inside Channels' session and auth middleware: lets through active staff from an allowed Origin."""

    def __init__(self, inner: ASGIApp) -> None:
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        # From here on the socket may be read or answered: TokenAuthMiddleware must not refuse it again.
        judging = scope.get(_GATE_REACHED)
        if judging is not None:  # the session and its user are looked up
            judging.reached = True
            judging.done()
        user = scope.get("user")
        if user is None or not user.is_authenticated:
            return await deny(scope, receive, send, "auth_required",
                              "pass an API token as ?token=<t> or 'Authorization: Bearer <t>' (create one with "
                              "`.venv/bin/python manage.py create_token <name>`), or log in to the admin as staff")
        if not (user.is_active and user.is_staff):
            return await deny(scope, receive, send, "not_staff",
                              f"user {user.get_username()!r} is not active staff; use an API token")
        # Session cookies ride along on any page's request: only pages of our own hosts may use
        # them (cross-site WebSocket hijacking). Token clients are exempt: a token is never ambient.
        if not origin_allowed(scope):
            return await deny(scope, receive, send, "bad_origin",
                              f"Origin {_header(scope, b'origin')!r} is not this site: a session-authenticated "
                              "WebSocket must come from a page of this site (Origin equal to the request's scheme "
                              "and Host, the Host in ALLOWED_HOSTS; or an origin listed in CSRF_TRUSTED_ORIGINS)")
        # A staff session is its own owner: its user (never a tenant of tokens; docs/protocol.md).
        session = scope.get("session")
        scope["execapp_auth"] = {"kind": "session", "name": user.get_username(), "owner": f"user:{user.pk}",
                                 "user_id": user.pk,  # re-checked while open, with the session (auth_watch)
                                 "session_key": getattr(session, "session_key", None)}
        return await self.inner(scope, receive, send)


class TokenAuthMiddleware:
    """Authenticates the WebSocket handshake; the consumer sees ``scope['execapp_auth']``.

    A request carrying a token is judged by the token alone (missing, unknown or revoked: 403);
    without a token, Channels' session auth decides (active staff from an allowed Origin).
    """

    def __init__(self, inner: ASGIApp) -> None:
        self.inner = inner
        # Channels' AuthMiddlewareStack, its lookups under the deadline.
        self.session_app = CookieMiddleware(SessionMiddleware(_DeadlineAuthMiddleware(_SessionGate(inner))))

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "websocket":
            return await self.inner(scope, receive, send)
        # Behind TLS (SECURE_SSL_REDIRECT) plain HTTP is redirected; a plain ws:// socket cannot be,
        # and carried tokens and session cookies in clear: it is refused, saying to use wss://.
        if settings.SECURE_SSL_REDIRECT and not transport_secure(scope):
            return await deny(scope, receive, send, "insecure_transport",
                              "this server takes WebSocket connections over wss:// only (SECURE_SSL_REDIRECT): "
                              "connect to wss://<host>/ws/events/", outcome=None)
        # A client network that failed too often is not judged (no lookup): closed at once.
        network = auth_throttle.client_network(scope)
        wait = auth_throttle.current().retry_after(network)
        if wait > 0:
            _rare.log(logging.INFO, ("throttled",), "refused WebSocket %s from %s unjudged: too many failed "
                      "authentications (EXECAPP['AUTH_FAILURES_BURST'])", scope.get("path"), network)
            metrics.count_event(AUTH_THROTTLED)
            return await refuse_unavailable(receive, send, CLOSE_TRY_AGAIN_LATER,
                                            f"too many failed authentications from your network; retry in "
                                            f"{min(wait, 3600):.0f} s with a valid token")
        raw = token_from_scope(scope)
        shared = _shared_lookup(raw) if raw else None
        # Each lookup (a token's, a session cookie's and its user's) queues on the worker's one
        # sync thread: a flood of bad credentials from many networks (each within its own burst)
        # must not queue them without bound. A handshake whose token is being looked up already
        # adds no lookup: it waits for that one.
        if shared is None and _lookups[0] >= int(conf.get("MAX_TOKEN_LOOKUPS")):
            _rare.log(logging.INFO, ("lookups",), "refused WebSocket %s unjudged: %d credential lookups already "
                      "running (EXECAPP['MAX_TOKEN_LOOKUPS'])", scope.get("path"), _lookups[0])
            metrics.count_event(AUTH_THROTTLED)
            return await refuse_unavailable(receive, send, CLOSE_TRY_AGAIN_LATER,
                                            "the server is checking too many credentials at once; retry in a "
                                            "few seconds")
        # Token and session lookups need the database: without it no client can be judged, so
        # the handshake is closed with 1013 "try again later" instead of failing as HTTP 500.
        # (Only while nothing of the socket was read yet; the consumer covers its own part.)
        if raw is None:
            judging = _Judging()  # shared through Channels' scope copies; ended by _SessionGate
            try:
                return await self.session_app({**scope, _GATE_REACHED: judging}, receive, send)
            except DatabaseError as exc:  # the session or user lookup, before the gate
                if judging.reached:
                    raise
                return await refuse_unavailable(receive, send, CLOSE_TRY_AGAIN_LATER,
                                                database_unavailable(scope.get("path"), exc))
            finally:
                judging.done()  # refused before the gate (or the connection ended)
        try:
            token = await asyncio.shield(shared if shared is not None else _start_lookup(raw))
        except DatabaseError as exc:
            return await refuse_unavailable(receive, send, CLOSE_TRY_AGAIN_LATER,
                                            database_unavailable(scope.get("path"), exc))
        if token is None:
            return await deny(scope, receive, send, "bad_token",
                              "the API token is unknown or revoked; create one with "
                              "`.venv/bin/python manage.py create_token <name>`")
        scope = {**scope, "execapp_auth": {"kind": "token", "name": token.name, "owner": token.owner,
                                            "token_id": token.pk}}  # re-checked while open (auth_watch)
        return await self.inner(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lowercase), or None."""
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


#: The HTTP scheme a browser puts in the Origin of a page that opens a ws:// or wss:// socket.
_HTTP_SCHEME = {"ws": "http", "wss": "https", "http": "http", "https": "https"}


def _no_response(request: Any) -> None:
    return None


def _as_request(scope: Scope) -> ASGIRequest:
    """The handshake as a Django request (GET, its scheme as a page of it would have): Django's
    own checks then apply, SECURE_PROXY_SSL_HEADER and USE_X_FORWARDED_HOST included."""
    return ASGIRequest({**scope, "method": "GET",
                        "scheme": _HTTP_SCHEME.get(scope.get("scheme") or "ws", "http")}, io.BytesIO())


def transport_secure(scope: Scope) -> bool:
    """Whether the handshake came over TLS: wss://, or a trusted proxy says so (SECURE_PROXY_SSL_HEADER)."""
    try:
        return _as_request(scope).is_secure()
    except Exception:  # a malformed header: not a transport we can vouch for
        return False


def origin_allowed(scope: Scope) -> bool:
    """Whether the handshake's ``Origin`` passes Django's CSRF origin check.

    That is: the Origin equals ``<scheme>://<Host>`` of this request (scheme, host and port all
    compared; the Host must be in ALLOWED_HOSTS, DEBUG's defaults included), or it is listed in
    CSRF_TRUSTED_ORIGINS (``https://*.example.com`` allows subdomains). Reuses Django's own
    check (``CsrfViewMiddleware._origin_verified``) on a request built from the scope, so
    SECURE_PROXY_SSL_HEADER and USE_X_FORWARDED_HOST apply as they do to the admin's forms.
    A missing Origin is refused: browsers always send one on a WebSocket handshake.
    """
    if _header(scope, b"origin") is None:
        return False
    try:
        return bool(CsrfViewMiddleware(_no_response)._origin_verified(_as_request(scope)))
    except Exception:  # a malformed header: not an origin we can vouch for
        log.debug("origin check failed on a malformed handshake", exc_info=True)
        return False
