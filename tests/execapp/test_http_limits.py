"""HTTP request bodies are bounded in size and time before Django reads them (execapp/http_limits.py).

One real ``python -m execapp.serve`` with a 64 KiB body limit and a 1 s body deadline, driven by
raw sockets. Without the middleware Django spooled any body to disk for as long as it came.
"""
from __future__ import annotations

import asyncio
import socket
import time
from typing import Any, Iterator

import pytest

from execapp import http_limits

from .test_handshake import Server, read_response, started

LIMIT = 64 * 1024
BODY_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = started(tmp_path_factory, "http-limits",
                     {"MAX_REQUEST_BODY_BYTES": LIMIT, "REQUEST_BODY_TIMEOUT_SECONDS": BODY_TIMEOUT})
    yield server
    server.stop()


def _post(length: int | None) -> bytes:
    head = b"POST /admin/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
    head += b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
    return head + b"\r\n"


def _answer_then_close(sock: socket.socket) -> bytes:
    """The response, and that the server then closed the connection."""
    response = read_response(sock)
    sock.settimeout(5)
    try:
        assert sock.recv(4096) == b"", "the connection stayed open after the refusal"
    except ConnectionResetError:
        pass
    return response


@pytest.mark.e2e
def test_a_body_announced_over_the_limit_is_refused_before_it_is_read(server: Server) -> None:
    before = server.closed(http_limits.BODY_TOO_LARGE)
    with server.raw() as sock:
        sock.sendall(_post(1 << 30))  # 1 GiB announced, nothing sent
        response = _answer_then_close(sock)
    assert response.startswith(b"HTTP/1.1 413 "), response[:200]
    assert server.closed(http_limits.BODY_TOO_LARGE) >= before + 1


@pytest.mark.e2e
def test_a_chunked_body_is_refused_once_it_passes_the_limit(server: Server) -> None:
    with server.raw() as sock:
        sock.sendall(_post(None))
        try:
            for _ in range(4 * LIMIT // 4096):
                sock.sendall(b"1000\r\n" + b"a" * 4096 + b"\r\n")
        except (ConnectionResetError, BrokenPipeError):
            pass
        response = read_response(sock)
    assert response.startswith(b"HTTP/1.1 413 "), response[:200]


@pytest.mark.e2e
def test_a_body_that_does_not_come_in_time_is_answered_408(server: Server) -> None:
    before = server.closed(http_limits.BODY_TIMEOUT)
    with server.raw() as sock:
        start = time.monotonic()
        sock.sendall(_post(100) + b"a" * 10)  # 90 bytes never come
        response = _answer_then_close(sock)
        took = time.monotonic() - start
    assert response.startswith(b"HTTP/1.1 408 "), response[:200]
    assert BODY_TIMEOUT * 0.9 <= took < BODY_TIMEOUT + 5
    assert server.closed(http_limits.BODY_TIMEOUT) >= before + 1


@pytest.mark.e2e
def test_a_body_within_the_limits_reaches_django(server: Server) -> None:
    body = b"username=a&password=" + b"b" * (LIMIT // 2)
    with server.raw() as sock:
        sock.sendall(_post(len(body)) + body)
        response = read_response(sock)
    # Django answers it (its CSRF check refuses a form without a token): not the limits.
    assert response.startswith(b"HTTP/1.1 403 "), response[:200]


@pytest.mark.parametrize("key, value, check_id", [
    ("MAX_REQUEST_BODY_BYTES", 0, "execapp.E003"), ("MAX_REQUEST_BODY_BYTES", 1.5, "execapp.E003"),
    ("MAX_REQUEST_BODY_BYTES", "8M", "execapp.E003"), ("REQUEST_BODY_TIMEOUT_SECONDS", 0, "execapp.E004"),
    ("REQUEST_BODY_TIMEOUT_SECONDS", "30", "execapp.E004"), ("REQUEST_BODY_TIMEOUT_SECONDS", None, "execapp.E004"),
])
def test_the_checks_refuse_a_bad_body_limit_or_deadline(settings: Any, key: str, value: Any, check_id: str) -> None:
    from execapp.checks import check_execapp_settings

    settings.EXECAPP = {key: value}
    found = {m.id: m for m in check_execapp_settings()}
    assert check_id in found and key in found[check_id].msg and found[check_id].hint
    settings.EXECAPP = {}
    assert not {"execapp.E003", "execapp.E004"} & {m.id for m in check_execapp_settings()}


async def test_the_deadline_ends_with_the_body_not_with_the_response(settings: Any) -> None:
    """Django listens for a disconnect while the view runs: after the body, receive() has no deadline."""
    settings.EXECAPP = {"REQUEST_BODY_TIMEOUT_SECONDS": 0.2}
    incoming: asyncio.Queue[dict] = asyncio.Queue()
    await incoming.put({"type": "http.request", "body": b"x=1", "more_body": False})
    sent: list[dict] = []
    seen: list[str] = []

    async def slow_view(scope: dict, receive: Any, send: Any) -> None:
        assert (await receive())["body"] == b"x=1"
        try:  # what Django's listen_for_disconnect does while the view takes longer than the body deadline
            seen.append((await asyncio.wait_for(receive(), 0.6))["type"])
        except asyncio.TimeoutError:
            seen.append("no disconnect")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message: dict) -> None:
        sent.append(message)

    await http_limits.RequestBodyLimit(slow_view)({"type": "http", "headers": [(b"content-length", b"3")]},
                                                  incoming.get, send)
    assert seen == ["no disconnect"] and sent[0]["status"] == 200
