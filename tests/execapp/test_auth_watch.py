"""A revoked or deleted API token's open connections are closed (execapp/auth_watch.py), and a
token in a URL never reaches the log (execapp/logtext.py): through a real uvicorn and real
`websockets` clients, as a token holder and an operator would see them."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Iterator

import pytest
from django.core import checks
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from execapp import auth_watch
from execapp.logtext import redact_token
from execapp.models import ApiToken
from execapp.routing import websocket_application
from tests.conftest import InProcessServer

from .ws_fixtures import ws_worker  # noqa: F401

pytestmark = pytest.mark.usefixtures("ws_worker")

RECHECK = 0.2


@pytest.fixture
def server(transactional_db: Any, settings: Any) -> Iterator[str]:
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "AUTH_RECHECK_SECONDS": RECHECK}
    with InProcessServer(websocket_application) as srv:
        yield f"ws://127.0.0.1:{srv.port}/ws/events/"


def _open(url: str, raw: str) -> ClientConnection:
    return connect(url, additional_headers={"Authorization": f"Bearer {raw}"}, open_timeout=5)


def _pings(ws: ClientConnection, eid: str) -> bool:
    """Whether ``ws`` still answers a /ping (False: the server closed it)."""
    try:
        ws.send(json.dumps({"id": eid, "type": "message", "text": "/ping"}))
        while True:
            frame = json.loads(ws.recv(5))
            if frame["type"] == "done" and frame["id"] == eid:
                return True
    except ConnectionClosed:
        return False


def _closed(ws: ClientConnection, within: float) -> tuple[int, str] | None:
    """The close code and reason once the server closed ``ws`` (None: still open after ``within`` s)."""
    try:
        ws.recv(within)
    except TimeoutError:
        return None
    except ConnectionClosed as exc:
        assert exc.rcvd is not None
        return exc.rcvd.code, exc.rcvd.reason
    raise AssertionError("a frame nobody asked for")


def test_a_revoked_tokens_open_connections_are_closed_and_its_tenants_other_tokens_are_not(server: str) -> None:
    victim, raw = ApiToken.issue("leaked", tenant="acme")
    raw_other = ApiToken.issue("laptop", tenant="acme")[1]
    with _open(server, raw) as a, _open(server, raw) as b, _open(server, raw_other) as other:
        assert _pings(a, "a1") and _pings(b, "b1") and _pings(other, "o1")
        victim.revoke()
        started = time.monotonic()
        for ws in (a, b):  # both of its connections, within about one interval
            assert _closed(ws, 5) == (1008, auth_watch.REVOKED_REASON)
        assert time.monotonic() - started < RECHECK + 2
        # The tenant's other token is untouched (revoking one token is not revoking its tenant).
        time.sleep(2 * RECHECK)
        assert _pings(other, "o2")
    with pytest.raises(Exception, match="HTTP 403"):  # and the token gets no new connection
        _open(server, raw)


def test_a_deleted_tokens_connection_is_closed_too(server: str) -> None:
    token, raw = ApiToken.issue("deleted")
    with _open(server, raw) as ws:
        assert _pings(ws, "d1")
        token.delete()
        assert _closed(ws, 5) == (1008, auth_watch.REVOKED_REASON)


def test_a_token_moved_to_another_tenant_stops_reading_the_old_tenants_sessions(server: str) -> None:
    moved, raw = ApiToken.issue("handed-on", tenant="acme")
    raw_acme = ApiToken.issue("acme-laptop", tenant="acme")[1]
    with _open(server + "?session=room-1", raw) as ws, _open(server, raw_acme) as acme:
        acme.send(json.dumps({"id": "a1", "type": "message", "text": "/ping", "session": "room-1"}))
        assert _pings(acme, "a2")
        assert [json.loads(ws.recv(5))["type"] for _ in range(2)] == ["reply", "done"]  # a member of acme's room-1
        moved.tenant = "elsewhere"
        moved.save()
        assert _closed(ws, 5) == (1008, auth_watch.MOVED_REASON)
        assert _pings(acme, "a3")  # the tenant's other token is untouched
    with _open(server, raw) as ws:  # a new connection is the new tenant's
        assert _pings(ws, "n1") and _closed(ws, 3 * RECHECK) is None


@pytest.mark.parametrize("withdraw", ["deactivate", "unstaff"])
def test_a_staff_session_is_closed_once_its_user_is_no_longer_active_staff(server: str, settings: Any,
                                                                           withdraw: str) -> None:
    from django.contrib.auth import get_user_model
    from django.test import Client as HttpClient

    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    user = get_user_model().objects.create_user(f"watched-{withdraw}", is_staff=True)  # no password: no hashing
    http = HttpClient()
    http.force_login(user)
    origin = server.split("/ws/")[0].replace("ws://", "http://")
    with connect(server, additional_headers={"Cookie": f"sessionid={http.cookies['sessionid'].value}"},
                 origin=origin, open_timeout=5) as ws:
        assert _pings(ws, "s1")
        if withdraw == "deactivate":
            user.is_active = False
        else:
            user.is_staff = False
        user.save()
        assert _closed(ws, 5) == (1008, auth_watch.STAFF_REASON)


def test_with_the_recheck_off_a_revoked_tokens_connection_runs_on(server: str, settings: Any) -> None:
    settings.EXECAPP = {**settings.EXECAPP, "AUTH_RECHECK_SECONDS": 0}
    token, raw = ApiToken.issue("kept")
    with _open(server, raw) as ws:
        token.revoke()
        assert _closed(ws, 3 * RECHECK) is None and _pings(ws, "k1")


def test_a_database_outage_closes_nothing_and_is_logged(monkeypatch: Any, caplog: Any, settings: Any) -> None:
    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "AUTH_RECHECK_SECONDS": 0}  # no task: checked by hand
    closed: list[int] = []

    async def down(ids: list[int]) -> set[int]:
        raise ConnectionError("database is down")

    async def scenario() -> tuple[int, int]:
        watch = auth_watch.AuthWatch()

        async def closer(reason: str) -> None:
            closed.append(1)

        watch.add(("token", 7), "t", "tenant:t", closer)
        with caplog.at_level(logging.WARNING, logger="execapp.auth"):
            n = await watch.check()
        return n, watch.watched()

    monkeypatch.setattr(auth_watch, "_live", down)
    auth_watch._rare._seen.clear()
    assert asyncio.run(scenario()) == (0, 1) and closed == []
    assert any("could not re-check the credentials" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value", [-1, "10", None])
def test_the_checks_refuse_a_bad_recheck_interval(settings: Any, value: Any) -> None:
    settings.EXECAPP = {"AUTH_RECHECK_SECONDS": value}
    found = [m for m in checks.run_checks() if m.id == "execapp.E098"]
    assert found and "AUTH_RECHECK_SECONDS" in found[0].msg and "0 turns that off" in (found[0].hint or "")


# -- tokens in logged URLs ------------------------------------------------------------------------

@pytest.mark.parametrize("url, logged", [
    ("/ws/events/?token=s3cret", "/ws/events/?token=[redacted]"),
    ("/ws/events/?session=a&token=s3cret&x=1", "/ws/events/?session=a&token=[redacted]&x=1"),
    ("/ws/events/?tok%65n=s3cret", "/ws/events/?tok%65n=[redacted]"),  # the name as the server decodes it
    ("/ws/events/?token=s3cret&token=2 HTTP/1.1", "/ws/events/?token=[redacted]&token=[redacted] HTTP/1.1"),
    ("/ws/events/?tokens=1&Token=2", "/ws/events/?tokens=1&Token=2"),  # not the parameter the server reads
    ("/metrics", "/metrics"),
])
def test_a_token_in_a_query_string_is_redacted(url: str, logged: str) -> None:
    assert redact_token(url) == logged


def test_the_servers_websocket_log_line_carries_no_token(server: str) -> None:
    raw = ApiToken.issue("in-the-url")[1]
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    uvicorn_log = logging.getLogger("uvicorn.error")
    handler, level = Collect(), uvicorn_log.level
    uvicorn_log.addHandler(handler)
    uvicorn_log.setLevel(logging.INFO)  # uvicorn logs each handshake's URL at INFO
    try:
        for url in (f"{server}?token={raw}", f"{server}?session=x&tok%65n={raw}"):
            with connect(url, open_timeout=5) as ws:
                assert _pings(ws, "u1")  # let in: the server read the token
        with pytest.raises(Exception, match="HTTP 403"):
            connect(f"{server}?token=not-{raw}", open_timeout=5)
    finally:
        uvicorn_log.removeHandler(handler)
        uvicorn_log.setLevel(level)
    ws_lines = [line for line in lines if "WebSocket /ws/events/" in line]
    assert len(ws_lines) == 3 and all("[redacted]" in line for line in ws_lines), lines
    assert not any(raw in line for line in lines), lines


def test_a_connection_that_left_since_the_check_is_not_closed_again() -> None:
    from types import SimpleNamespace

    from execapp.consumers import EventConsumer

    sent: list[Any] = []
    consumer = EventConsumer()

    async def close(code: Any = None, reason: Any = None) -> None:
        sent.append(code)
        raise RuntimeError("Unexpected ASGI message 'websocket.close', after sending 'websocket.close'")

    consumer.close = close  # type: ignore[method-assign]
    consumer.conn = SimpleNamespace(closed=True)  # type: ignore[assignment]
    asyncio.run(consumer._withdrawn(auth_watch.REVOKED_REASON))  # left already: nothing sent
    assert sent == []
    consumer.conn = SimpleNamespace(closed=False, close=lambda: None)  # type: ignore[assignment]
    asyncio.run(consumer._withdrawn(auth_watch.REVOKED_REASON))  # leaves while being closed: no error escapes
    assert sent == [1008]


@pytest.mark.parametrize("end", ["logout", "password"])
def test_a_staff_socket_ends_with_the_session_it_was_opened_with(server: str, settings: Any, end: str) -> None:
    """Logging out (or a password change, which Django makes end every session) ends the staff
    sockets opened with that session: a stolen session cookie's socket ran on for as long as the
    user stayed active staff. Another session of the same user keeps its socket."""
    from django.contrib.auth import get_user_model
    from django.test import Client as HttpClient

    settings.ALLOWED_HOSTS = ["127.0.0.1"]
    user = get_user_model().objects.create_user(f"session-{end}", is_staff=True)
    stolen, other = HttpClient(), HttpClient()
    stolen.force_login(user)
    other.force_login(user)
    origin = server.split("/ws/")[0].replace("ws://", "http://")

    def open_with(http: HttpClient) -> ClientConnection:
        return connect(server, additional_headers={"Cookie": f"sessionid={http.cookies['sessionid'].value}"},
                       origin=origin, open_timeout=5)

    with open_with(stolen) as ws, open_with(other) as kept:
        assert _pings(ws, "s1") and _pings(kept, "k1")
        if end == "logout":
            stolen.logout()  # the browser's "Log out": the session is flushed
            assert _closed(ws, 5) == (1008, auth_watch.STAFF_REASON)
            assert _closed(kept, 4 * RECHECK) is None and _pings(kept, "k2")
        else:
            user.set_password("a-new-pw-41")  # as the admin's password change does, every session ends
            user.save()
            assert _closed(ws, 5) == (1008, auth_watch.STAFF_REASON)
            assert _closed(kept, 5) == (1008, auth_watch.STAFF_REASON)
