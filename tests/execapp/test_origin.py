"""The handshake's checks: the Origin rule for session-authenticated sockets (Django's CSRF origin
check: scheme, host and port), and a handshake that cannot be judged because the database is down."""
from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator

from execapp.auth import close_reason, origin_allowed
from execapp.routing import websocket_application
from tests.conftest import free_port

from .ws_fixtures import channel_layer, ws_worker  # noqa: F401


def scope(origin: bytes | None, host: bytes | None = b"127.0.0.1:8000", scheme: str = "ws",
          extra: list | None = None) -> dict:
    headers = [(b"host", host)] if host is not None else []
    if origin is not None:
        headers.append((b"origin", origin))
    return {"type": "websocket", "path": "/ws/events/", "scheme": scheme, "query_string": b"",
            "headers": headers + (extra or []), "server": ("127.0.0.1", 8000)}


@pytest.mark.parametrize("origin, allowed", [
    (b"http://127.0.0.1:8000", True),
    (b"http://127.0.0.1:1", False),  # the same host, another port (another site)
    (b"http://127.0.0.1", False),  # port 80 is another port too
    (b"https://127.0.0.1:8000", False),  # another scheme
    (b"http://127.0.0.1:8000.evil.example", False),  # look-alikes
    (b"http://127.0.0.1.evil.example:8000", False),
    (b"http://evil.example/http://127.0.0.1:8000", False),
    (b"http://localhost:8000", False),  # an allowed host, but not the one this request was made to
    (b"http://127.0.0.1:8000, http://evil.example", False),
    (b"null", False),  # sandboxed iframes, file:// pages
    (b"", False),
    (None, False),  # browsers always send Origin on a WebSocket handshake: none is not a browser page
    (b"http://[::1", False),  # malformed
])
def test_the_origin_must_be_this_requests_scheme_host_and_port(origin: bytes | None, allowed: bool) -> None:
    assert origin_allowed(scope(origin)) is allowed


def test_a_host_outside_allowed_hosts_never_vouches_for_its_own_origin(settings: Any) -> None:
    settings.ALLOWED_HOSTS = ["app.example.com"]
    assert origin_allowed(scope(b"http://app.example.com", b"app.example.com"))
    # DNS rebinding: evil.example resolving to this server sends Host: evil.example.
    assert not origin_allowed(scope(b"http://evil.example", b"evil.example"))
    assert not origin_allowed(scope(b"http://evil.example", None))  # no Host: the server's name, not allowed


def test_wss_compares_with_https_and_a_trusted_proxy_header_is_honoured(settings: Any) -> None:
    settings.ALLOWED_HOSTS = ["app.example.com"]
    assert origin_allowed(scope(b"https://app.example.com", b"app.example.com", scheme="wss"))
    assert not origin_allowed(scope(b"http://app.example.com", b"app.example.com", scheme="wss"))
    behind_tls = [(b"x-forwarded-proto", b"https")]
    assert not origin_allowed(scope(b"https://app.example.com", b"app.example.com", extra=behind_tls))
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    assert origin_allowed(scope(b"https://app.example.com", b"app.example.com", extra=behind_tls))


def test_csrf_trusted_origins_are_allowed_exactly_or_by_subdomain_wildcard(settings: Any) -> None:
    settings.CSRF_TRUSTED_ORIGINS = ["https://console.example.com", "https://*.example.org"]
    assert origin_allowed(scope(b"https://console.example.com"))
    assert not origin_allowed(scope(b"https://console.example.com:8443"))
    assert not origin_allowed(scope(b"http://console.example.com"))
    assert origin_allowed(scope(b"https://a.example.org"))
    assert not origin_allowed(scope(b"https://example.org.evil.example"))
    assert not origin_allowed(scope(b"https://evilexample.org"))


# -- the handshake, through the real middleware stack ---------------------------------------------

def _staff_cookie() -> str:
    from django.contrib.auth import get_user_model
    from django.test import Client as HttpClient

    user = get_user_model().objects.create_user("origin-staff", is_staff=True)  # no password: no hashing cost
    http = HttpClient()
    http.force_login(user)
    return http.cookies["sessionid"].value


async def _handshake(headers: list, path: str = "/ws/events/", scheme: str = "ws") -> bool:
    comm = WebsocketCommunicator(websocket_application, path, headers=headers)
    comm.scope["scheme"] = scheme
    connected, _ = await comm.connect(timeout=5)
    if connected:
        await comm.send_to(text_data=json.dumps({"type": "message", "text": "/ping", "id": "o"}))
        assert json.loads(await comm.receive_from(5))["text"] == "pong"
        await comm.disconnect()
    return connected


@pytest.mark.usefixtures("ws_worker")
@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
@pytest.mark.parametrize("origin, allowed", [
    (b"http://127.0.0.1:8000", True),
    (b"http://127.0.0.1:1", False),
    (b"http://127.0.0.1:8000.evil.example", False),
    (b"null", False),
    (None, False),
])
async def test_a_staff_session_is_let_in_only_from_a_page_of_this_site(
        transactional_db: Any, channel_layer: str, origin: bytes | None, allowed: bool) -> None:
    cookie = await sync_to_async(_staff_cookie)()
    headers = [(b"host", b"127.0.0.1:8000"), (b"cookie", f"sessionid={cookie}".encode())]
    if origin is not None:
        headers.append((b"origin", origin))
    assert await _handshake(headers) is allowed


@pytest.mark.usefixtures("ws_worker")
@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_token_clients_need_no_origin(transactional_db: Any, channel_layer: str) -> None:
    from execapp.models import ApiToken

    raw = (await sync_to_async(ApiToken.issue)("origin-token"))[1]
    assert await _handshake([(b"authorization", f"Bearer {raw}".encode())])
    assert await _handshake([(b"authorization", f"Bearer {raw}".encode()), (b"origin", b"null")])


@pytest.mark.usefixtures("ws_worker")
@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_behind_tls_a_plain_ws_socket_is_refused(transactional_db: Any, channel_layer: str,
                                                        settings: Any) -> None:
    """With SECURE_SSL_REDIRECT (HTTPS=1) plain HTTP is redirected, but a ws:// socket was served,
    tokens and session cookies in clear. It is refused now; wss://, or a trusted proxy's
    X-Forwarded-Proto (SECURE_PROXY_SSL_HEADER), is served."""
    from execapp.models import ApiToken

    raw = (await sync_to_async(ApiToken.issue)("tls-token"))[1]
    bearer = (b"authorization", f"Bearer {raw}".encode())
    settings.SECURE_SSL_REDIRECT = True
    assert not await _handshake([bearer])
    assert await _handshake([bearer], scheme="wss")
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    assert await _handshake([bearer, (b"x-forwarded-proto", b"https")])
    assert not await _handshake([bearer, (b"x-forwarded-proto", b"http")])
    settings.SECURE_SSL_REDIRECT = False
    assert await _handshake([bearer])  # without it, ws:// is served as before


# -- the database is unreachable ------------------------------------------------------------------

def test_a_close_reason_fits_a_close_frame() -> None:
    reason = close_reason("database unavailable: " + "é" * 200)
    assert len(reason.encode()) <= 123 and reason.startswith("database unavailable")


@pytest.mark.usefixtures("ws_worker")
@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_a_failure_while_connecting_is_a_1011_close_with_a_reason_not_an_http_500(channel_layer: str) -> None:
    from .ws_fixtures import authed

    comm = WebsocketCommunicator(authed({"execapp_auth": "not a dict"}), "/ws/events/")
    connected, _ = await comm.connect(timeout=5)
    assert connected  # accepted, so that the close can carry its code and reason
    closed = await comm.receive_output(5)
    assert closed["type"] == "websocket.close" and closed["code"] == 1011
    assert "internal error (AttributeError)" in closed["reason"]
    await comm.disconnect()


@pytest.mark.e2e
def test_handshakes_while_the_database_is_down_are_closed_with_1013_naming_it(asgi_server_factory: Any) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    # PostgreSQL on a port nothing listens on: every connection attempt is refused at once.
    server = asgi_server_factory({"DATABASE_URL": f"postgres://postgres@127.0.0.1:{free_port()}/none",
                                  "REDIS_URL": ""})
    url = f"{server.ws_url}/ws/events/"
    session = "sessionid=" + "a1" * 16  # a well-formed key (shorter ones are not even looked up)
    for headers in ({"Authorization": "Bearer some-token"},  # the token lookup needs the database
                    {"Origin": f"http://127.0.0.1:{server.port}", "Cookie": session}):  # so does a session
        for _ in range(3):  # every handshake, not just the first
            with connect(url, additional_headers=headers, open_timeout=10) as ws:  # not an HTTP 500
                with pytest.raises(ConnectionClosed) as info:
                    ws.recv(10)
            assert info.value.rcvd is not None, server.log()
            assert info.value.rcvd.code == 1013 and "database unavailable" in info.value.rcvd.reason, info.value
    log = server.log()
    assert "500" not in log and "Traceback" not in log, log
    # One log line per cause per minute, not one per handshake.
    assert log.count("the database is unavailable") == 1, log
