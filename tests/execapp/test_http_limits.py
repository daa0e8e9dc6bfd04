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
from tests.conftest import wait_until_async

from .test_handshake import Server, read_response, started

LIMIT = 64 * 1024
BODY_TIMEOUT = 1.0
PENDING = 2 * LIMIT


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = started(tmp_path_factory, "http-limits",
                     {"MAX_REQUEST_BODY_BYTES": LIMIT, "REQUEST_BODY_TIMEOUT_SECONDS": BODY_TIMEOUT,
                      "MAX_PENDING_BODY_BYTES": PENDING})
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


@pytest.mark.e2e
def test_stalled_bodies_past_the_pending_bytes_cost_their_sender_its_oldest(server: Server) -> None:
    before = server.closed(http_limits.BODY_PENDING_CAP)
    socks = [server.raw() for _ in range(3)]
    try:
        for sock in socks:  # 3 x 3/4 of a body, then nothing: the third puts the worker over PENDING
            sock.sendall(_post(LIMIT) + b"a" * (LIMIT * 3 // 4))
        # One of them (the oldest as the worker saw them: the order is tested in-process) is refused
        # 503 for the pending bytes; the two others wait on, until their own deadline (408).
        statuses = sorted(_answer_then_close(sock).split(b" ")[1] for sock in socks)
        assert statuses == [b"408", b"408", b"503"], statuses
    finally:
        for sock in socks:
            sock.close()
    assert server.closed(http_limits.BODY_PENDING_CAP) >= before + 1
    body = b"username=a&password=b"
    with server.raw() as sock:  # a request whose body comes at once is served meanwhile
        sock.sendall(_post(len(body)) + body)
        assert read_response(sock).startswith(b"HTTP/1.1 403 ")


def test_the_checks_warn_of_pending_body_bytes_below_the_largest_body(settings: Any) -> None:
    from execapp.checks import check_execapp_settings

    settings.EXECAPP = {"MAX_PENDING_BODY_BYTES": 1000, "MAX_REQUEST_BODY_BYTES": 2000}
    found = {m.id: m for m in check_execapp_settings()}
    assert "execapp.W095" in found and "MAX_PENDING_BODY_BYTES" in found["execapp.W095"].msg
    settings.EXECAPP = {"MAX_PENDING_BODY_BYTES": 0}
    assert "execapp.E003" in {m.id for m in check_execapp_settings()}
    settings.EXECAPP = {}
    assert not {"execapp.W095", "execapp.E003"} & {m.id for m in check_execapp_settings()}


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


async def _each_request_s_app(scope: dict, receive: Any, send: Any) -> None:
    await scope["test_app"](scope, receive, send)


class _Request:
    """One request through a RequestBodyLimit in this process: its body fed by hand, its answer kept."""

    def __init__(self, limit: http_limits.RequestBodyLimit, length: int) -> None:
        self.incoming: asyncio.Queue[dict] = asyncio.Queue()
        self.sent: list[dict] = []
        self.app_saw: list[str] = []

        async def app(scope: dict, receive: Any, send: Any) -> None:
            while True:  # as Django's read_body: every part, until the last or a disconnect
                message = await receive()
                self.app_saw.append(message["type"])
                if message["type"] != "http.request" or not message.get("more_body"):
                    break
            if message["type"] == "http.request":
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"ok"})

        async def send(message: dict) -> None:
            self.sent.append(message)

        scope = {"type": "http", "headers": [(b"content-length", str(length).encode())], "test_app": app}
        self.task = asyncio.ensure_future(limit(scope, self.incoming.get, send))

    async def part(self, size: int, more: bool = True) -> None:
        await self.incoming.put({"type": "http.request", "body": b"a" * size, "more_body": more})
        await asyncio.sleep(0)  # the middleware takes it

    @property
    def status(self) -> int | None:
        return self.sent[0]["status"] if self.sent else None


async def test_past_the_pending_body_bytes_the_body_arriving_longest_is_refused_503(settings: Any) -> None:
    # Each body arriving sits in Django's spool: a client that sent most of a body on many
    # connections and stalled held ~2.8 MB of the worker per connection (measured: 60 of them,
    # +167 MB) until the body deadline. Bodies arriving at once are bounded in bytes together.
    settings.EXECAPP = {"MAX_PENDING_BODY_BYTES": 1000, "MAX_REQUEST_BODY_BYTES": 10_000,
                        "REQUEST_BODY_TIMEOUT_SECONDS": 3600.0}  # the deadline is not what ends them here
    limit = http_limits.RequestBodyLimit(_each_request_s_app)
    stalled = []
    for _ in range(3):  # three stalled bodies of 400 bytes: the third puts the worker over
        request = _Request(limit, 5000)
        await request.part(400)
        stalled.append(request)
    assert await wait_until_async(lambda: stalled[0].task.done(), 10)
    assert stalled[0].status == 503 and stalled[0].app_saw[-1] == "http.disconnect"
    assert b"MAX_PENDING_BODY_BYTES" in stalled[0].sent[1]["body"]
    assert not stalled[1].task.done() and not stalled[2].task.done()
    assert limit.pending.bytes == 800 and len(limit.pending) == 2

    # A body that comes whole is never counted, and one that completes stops counting: served.
    whole = _Request(limit, 300)
    await whole.part(300, more=False)
    await asyncio.wait_for(whole.task, 10)
    assert whole.status == 200 and limit.pending.bytes == 800
    stalled[2].incoming.put_nowait({"type": "http.request", "body": b"b" * 100, "more_body": False})
    await asyncio.wait_for(stalled[2].task, 10)
    assert stalled[2].status == 200 and limit.pending.bytes == 400 and len(limit.pending) == 1

    # A request that ends mid-body (the client left) gives its bytes back.
    stalled[1].incoming.put_nowait({"type": "http.disconnect"})
    await asyncio.wait_for(stalled[1].task, 10)
    assert limit.pending.bytes == 0 and len(limit.pending) == 0


async def test_past_max_pending_connections_bodies_that_never_come_cost_their_sender_its_oldest(settings: Any) -> None:
    # A request whose body never comes (headers, then silence) held its connection and its task
    # until the body deadline, counted nowhere: its bytes are none. Announced bodies are counted
    # from the request's start, and at most MAX_PENDING_CONNECTIONS arrive at once.
    settings.EXECAPP = {"MAX_PENDING_CONNECTIONS": 2, "REQUEST_BODY_TIMEOUT_SECONDS": 3600.0}
    limit = http_limits.RequestBodyLimit(_each_request_s_app)
    silent = [_Request(limit, 5000) for _ in range(3)]
    await asyncio.sleep(0)
    assert await wait_until_async(lambda: silent[0].task.done(), 10)
    assert silent[0].status == 503 and b"MAX_PENDING_CONNECTIONS" in silent[0].sent[1]["body"]
    assert not silent[1].task.done() and not silent[2].task.done() and len(limit.pending) == 2
    await silent[1].part(5000, more=False)  # the others are still served when their body comes
    await asyncio.wait_for(silent[1].task, 10)
    assert silent[1].status == 200 and len(limit.pending) == 1
    silent[2].incoming.put_nowait({"type": "http.disconnect"})
    await asyncio.wait_for(silent[2].task, 10)
    assert len(limit.pending) == 0
