"""Handshake authentication for WebSockets: an API token, else a logged-in staff session, else HTTP 403."""
from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs, urlparse

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import OriginValidator
from django.conf import settings

log = logging.getLogger("execapp.auth")

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


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

    return ApiToken.authenticate(raw)


async def deny(scope: Scope, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]],
               code: str, message: str) -> None:
    """Refuse a handshake before accepting it: the server answers HTTP 403; the reason is logged.

    (An HTTP body through the ``websocket.http.response`` extension would carry the reason to
    the client, but uvicorn 0.54 then logs "ASGI callable returned without completing
    handshake" at ERROR for every refusal: noise an operator would page on.)
    """
    first = await receive()
    if first.get("type") != "websocket.connect":
        return
    log.info("refused WebSocket %s (%s): %s", scope.get("path"), code, message)
    await send({"type": "websocket.close"})


class _SessionGate:
    """Inside Channels' AuthMiddlewareStack: lets through active staff from an allowed Origin."""

    def __init__(self, inner: ASGIApp) -> None:
        self.inner = inner
        self.origins = OriginValidator(inner, _allowed_origins())

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        user = scope.get("user")
        if user is None or not user.is_authenticated:
            return await deny(scope, receive, send, "auth_required",
                              "pass an API token as ?token=<t> or 'Authorization: Bearer <t>' (create one with "
                              "`python manage.py create_token <name>`), or log in to the admin as staff")
        if not (user.is_active and user.is_staff):
            return await deny(scope, receive, send, "not_staff",
                              f"user {user.get_username()!r} is not active staff; use an API token")
        # Session cookies ride along on any page's request: only pages of our own hosts may use
        # them (cross-site WebSocket hijacking). Token clients are exempt: a token is never ambient.
        if not self.origins.valid_origin(_origin(scope)):
            return await deny(scope, receive, send, "bad_origin",
                              "a session-authenticated WebSocket must come from a page of this site "
                              "(Origin must match ALLOWED_HOSTS or CSRF_TRUSTED_ORIGINS)")
        scope["execapp_auth"] = {"kind": "session", "name": user.get_username()}
        return await self.inner(scope, receive, send)


class TokenAuthMiddleware:
    """Authenticates the WebSocket handshake; the consumer sees ``scope['execapp_auth']``.

    A request carrying a token is judged by the token alone (missing, unknown or revoked: 403);
    without a token, Channels' session auth decides (active staff from an allowed Origin).
    """

    def __init__(self, inner: ASGIApp) -> None:
        self.inner = inner
        self.session_app = AuthMiddlewareStack(_SessionGate(inner))

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "websocket":
            return await self.inner(scope, receive, send)
        raw = token_from_scope(scope)
        if raw is None:
            return await self.session_app(scope, receive, send)
        token = await _authenticate(raw)
        if token is None:
            return await deny(scope, receive, send, "bad_token",
                              "the API token is unknown or revoked; create one with "
                              "`python manage.py create_token <name>`")
        scope = {**scope, "execapp_auth": {"kind": "token", "name": token.name}}
        return await self.inner(scope, receive, send)


def _origin(scope: Scope) -> Any:
    for name, value in scope.get("headers", []):
        if name == b"origin":
            try:
                return urlparse(value.decode("latin-1"))
            except ValueError:
                return None
    return None


def _allowed_origins() -> list[str]:
    hosts = list(settings.ALLOWED_HOSTS) or (["localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    return hosts + list(getattr(settings, "CSRF_TRUSTED_ORIGINS", []))
