"""The deadline on a request's headers and the cap on connections waiting for them (execapp/handshake.py).

One real ``python -m execapp.serve --workers 1`` with a 1 s deadline and a cap of 8, driven by raw
sockets (the slowloris clients), the websockets library and urllib (the legitimate ones); and
uvicorn with the same protocol in this process, for a burst of connections on each event loop.
Time bounds are the deadline plus liveness slack, except where a test must tell "closed by the
cap" from "closed by the deadline".
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from websockets.asyncio.client import connect

from execapp import handshake
from tests.conftest import LIVENESS, InProcessServer, ServerProcess, manage, wait_until

TIMEOUT = 1.0
CAP = 8
#: Slack for a busy machine on top of the deadline: a liveness bound, never a timing.
SLACK = 2.0


class Server(ServerProcess):
    """``python -m execapp.serve --workers 1`` with a short header deadline and a small pending cap."""

    def __init__(self, env: dict[str, str], tmp: Path, settings: dict[str, Any] | None = None) -> None:
        (tmp / "metrics").mkdir()
        env = {**env, "DJANGO_SETTINGS_MODULE": "tests.execapp.e2e_settings", "REDIS_URL": "",
               "PROMETHEUS_MULTIPROC_DIR": str(tmp / "metrics"),
               "EXECAPP_TEST_SETTINGS": json.dumps({"HANDSHAKE_TIMEOUT_SECONDS": TIMEOUT,
                                                    "MAX_PENDING_CONNECTIONS": CAP, **(settings or {})})}
        super().__init__(["execapp.serve", "--workers", "1", "--log-level", "warning", "--no-access-log"], env,
                         "handshake")
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws/events/?token={env['TOKEN']}"
        try:
            assert wait_until(lambda: self.get("/healthz")[0] == 200, 60, interval=0.05), self.log()
        except BaseException:
            self.stop()
            raise

    def get(self, path: str) -> tuple[int, bytes]:
        """(status, body) of GET ``path``; (0, b"") when nothing answers."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as response:
                return response.status, response.read()
        except OSError:
            return 0, b""

    def closed(self, reason: str) -> float:
        """execapp_connections_closed_total{reason} as /metrics says now."""
        for line in self.get("/metrics")[1].decode().splitlines():
            if line.startswith(f'execapp_connections_closed_total{{reason="{reason}"}}'):
                return float(line.split()[-1])
        return 0.0

    def raw(self) -> socket.socket:
        """A connected TCP socket that has sent nothing yet."""
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)


def started(tmp_path_factory: pytest.TempPathFactory, name: str, settings: dict[str, Any] | None = None) -> Server:
    """A migrated database, a token and a Server on them (the module fixture of these server tests)."""
    tmp = tmp_path_factory.mktemp(name)
    env = {"DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}"}
    assert manage("migrate", "--noinput", env=env).returncode == 0
    token = manage("create_token", name, env=env)
    assert token.returncode == 0, token.stderr
    return Server({**env, "TOKEN": token.stdout.strip().splitlines()[-1]}, tmp, settings)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = started(tmp_path_factory, "handshake")
    yield server
    server.stop()


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True once the server closed ``sock`` (EOF or reset) within ``within`` seconds, reading what it sends."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        pass
    return True


def still_open(sock: socket.socket) -> bool:
    """True if the server has not closed ``sock`` (nothing to read, no EOF)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""  # b"": EOF (this test's clients are never sent anything else)
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.setblocking(True)


def trickle_until_closed(sock: socket.socket, prefix: bytes, repeat: bytes, within: float) -> float | None:
    """Send ``prefix``, then ``repeat`` over and over, a byte every 50 ms (a request whose headers never
    end) until the server closes ``sock``: the seconds that took, or None if still open after ``within``."""
    start = time.monotonic()
    i = 0
    while time.monotonic() - start < within:
        byte = prefix[i:i + 1] if i < len(prefix) else repeat[(i - len(prefix)) % len(repeat):][:1]
        try:
            sock.sendall(byte)
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - start
        i += 1
        if not still_open(sock):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def read_response(sock: socket.socket) -> bytes:
    """One HTTP response with a Content-Length body, read whole from a keep-alive connection."""
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the connection instead of answering: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                  if line.startswith(b"content-length"))
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection in the middle of a response"
        body += chunk
    return head


@pytest.mark.e2e
def test_a_silent_or_half_sent_request_is_closed_at_the_deadline(server: Server) -> None:
    before = server.closed("handshake_timeout")
    with server.raw() as half, server.raw() as silent:
        start = time.monotonic()
        half.sendall(b"GET /heal")
        assert closed_by_server(half, TIMEOUT + SLACK), "a half request line held its socket past the deadline"
        assert time.monotonic() - start >= TIMEOUT * 0.9  # the deadline closed it, not a parse error
        assert closed_by_server(silent, SLACK), "a connection that sent nothing outlived the deadline"
    assert server.closed("handshake_timeout") >= before + 2


@pytest.mark.e2e
def test_a_byte_a_time_sender_is_closed_at_the_deadline_though_it_keeps_sending(server: Server) -> None:
    with server.raw() as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        took = trickle_until_closed(sock, b"", b"X-Slow: aaaaaaaa\r\n", TIMEOUT + SLACK)
    assert took is not None, "a client sending its headers a byte at a time held its socket past the deadline"
    assert took >= TIMEOUT * 0.8


@pytest.mark.e2e
def test_the_next_request_on_a_keep_alive_connection_gets_the_deadline_from_the_previous_response(
        server: Server) -> None:
    """uvicorn's keep-alive timer only covers the idle wait: the next request's first byte cancels it."""
    with server.raw() as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b" 200 " in read_response(sock)
        took = trickle_until_closed(sock, b"GET /healthz HTTP/1.1\r\n", b"X-Slow: aaaaaaaa\r\n", TIMEOUT + SLACK)
    assert took is not None, "a keep-alive client trickling its next request held its socket past the deadline"
    assert took >= TIMEOUT * 0.8


@pytest.mark.e2e
@pytest.mark.parametrize("keep_alive", [False, True])
def test_a_request_whose_headers_pass_the_byte_limit_gets_431_and_is_closed(server: Server, keep_alive: bool) -> None:
    before = server.closed(handshake.HEADER_TOO_LARGE)
    with server.raw() as sock:
        if keep_alive:  # the limit counts again for the next request on the connection
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert b" 200 " in read_response(sock)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        got = b""
        try:
            for _ in range(4 * handshake.MAX_HEADER_BYTES // 4096):  # far past the limit, in reads
                sock.sendall(b"a" * 4096)
        except (ConnectionResetError, BrokenPipeError):
            pass
        try:
            sock.settimeout(5)
            while chunk := sock.recv(4096):
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    assert got == b"" or got.startswith(b"HTTP/1.1 431 "), got[:80]
    assert server.closed(handshake.HEADER_TOO_LARGE) >= before + 1


@pytest.mark.e2e
def test_headers_within_the_byte_limit_are_served(server: Server) -> None:
    with server.raw() as sock:
        cookie = b"c=" + b"a" * (handshake.MAX_HEADER_BYTES - 1024)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: " + cookie + b"\r\n\r\n")
        assert b" 200 " in read_response(sock)


async def ws_ping(server: Server, hold: float = 0.0) -> list[dict]:
    """Open a WebSocket, keep it ``hold`` seconds, then send /ping: its frames up to the done."""
    async with connect(server.ws_url, open_timeout=5) as ws:
        await asyncio.sleep(hold)
        await ws.send(json.dumps({"id": "p", "type": "message", "text": "/ping"}))
        return [json.loads(await asyncio.wait_for(ws.recv(), 5)) for _ in range(2)]


@pytest.mark.e2e
async def test_a_websocket_stays_open_far_past_the_deadline_after_its_handshake(server: Server) -> None:
    assert (await asyncio.to_thread(server.get, "/healthz"))[0] == 200
    frames = await ws_ping(server, hold=2.5 * TIMEOUT)  # the deadline ends with the handshake
    assert [f["type"] for f in frames] == ["reply", "done"] and frames[0]["text"] == "pong"


@pytest.mark.e2e
def test_a_keep_alive_client_idle_between_requests_is_uvicorns_not_cut_at_the_deadline(server: Server) -> None:
    """Idle between requests is bounded by uvicorn's keep-alive timeout (5 s), not by the header deadline."""
    with server.raw() as sock:
        for pause in (1.5 * TIMEOUT, 0):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert b" 200 " in read_response(sock)
            time.sleep(pause)


@pytest.mark.e2e
def test_past_the_cap_the_oldest_waiting_connection_is_closed_and_newcomers_get_in(server: Server) -> None:
    before = server.closed("pending_cap")
    oldest = server.raw()
    start = time.monotonic()
    silent = [server.raw() for _ in range(CAP)]  # one more than the cap is waiting now
    try:
        assert closed_by_server(oldest, TIMEOUT * 0.6), "the cap did not close the oldest waiting connection"
        # Closed by the cap long before its deadline would have closed it; the newer ones wait on.
        assert time.monotonic() - start < TIMEOUT * 0.6
        assert all(still_open(s) for s in silent)
        # A legitimate client still gets in while the silent ones fill the cap (each costs them their oldest).
        assert server.get("/healthz")[0] == 200
        assert asyncio.run(ws_ping(server))[0]["text"] == "pong"
    finally:
        oldest.close()
        for s in silent:
            s.close()
    assert server.closed("pending_cap") >= before + 1


async def ok_app(scope: dict, receive: Any, send: Any) -> None:
    """An ASGI app answering every request 200 ``ok``."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_a_burst_over_the_cap_whose_requests_are_in_is_served_whole(loop_name: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections accepted in one burst (here: while the loop was blocked) are read once before the
    cap trims, so only those still without their headers then count as the oldest."""
    monkeypatch.setattr(handshake, "_pending", handshake.PendingConnections(timeout=5.0, cap=CAP))
    with InProcessServer(ok_app, loop=loop_name, http=handshake.HandshakeDeadlineProtocol) as server:
        loop = server.loop
        blocked = threading.Event()

        def block() -> None:
            blocked.set()
            time.sleep(0.5)  # the burst waits in the backlog meanwhile

        loop.call_soon_threadsafe(block)
        assert blocked.wait(5)
        burst = []
        for _ in range(100):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            burst.append(sock)
        answered = 0
        for sock in burst:
            with sock:
                data = b""
                try:
                    while chunk := sock.recv(4096):
                        data += chunk
                except ConnectionResetError:
                    pass
                answered += data.startswith(b"HTTP/1.1 200")
        assert answered == len(burst)


def test_pipelined_requests_queue_a_bounded_number_and_are_all_answered_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn parsed a whole read of pipelined requests at once and queued them all (200 KB of small
    GETs: ~6,400 queued, +12 MB per connection); now at most MAX_PIPELINED and one slice's worth."""
    monkeypatch.setattr(handshake, "_pending", handshake.PendingConnections(timeout=30.0, cap=CAP))
    release = threading.Event()
    protocols: list[handshake.HandshakeDeadlineProtocol] = []
    longest = [0]
    made = handshake.HandshakeDeadlineProtocol.connection_made

    def connection_made(self: handshake.HandshakeDeadlineProtocol, transport: Any) -> None:
        protocols.append(self)
        made(self, transport)

    monkeypatch.setattr(handshake.HandshakeDeadlineProtocol, "connection_made", connection_made)

    async def held_app(scope: dict, receive: Any, send: Any) -> None:  # answers once released, its path
        longest[0] = max(longest[0], len(protocols[0].pipeline))
        while not release.is_set():
            await asyncio.sleep(0.01)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"8")]})
        await send({"type": "http.response.body", "body": scope["path"].encode().ljust(8)})

    with InProcessServer(held_app, http=handshake.HandshakeDeadlineProtocol) as server:
        try:
            count = 200_000 // len(b"GET /000000 HTTP/1.1\r\nHost: a\r\n\r\n")
            with socket.create_connection(("127.0.0.1", server.port), timeout=LIVENESS) as sock:
                sock.sendall(b"".join(b"GET /%06d HTTP/1.1\r\nHost: a\r\n\r\n" % i for i in range(count)))
                assert wait_until(lambda: protocols and protocols[0].pipeline, LIVENESS)  # the read was parsed
                # What the worker holds for this connection while the first request is held: a few requests.
                queued = len(protocols[0].pipeline)
                assert queued <= handshake.MAX_PIPELINED + handshake.PARSE_SLICE // 32, queued
                release.set()
                data = b""
                last = b"/%06d" % (count - 1)  # (the last answer's body, after its headers: read it too)
                while data.count(b"HTTP/1.1 200") < count or not data.rstrip().endswith(last):
                    chunk = sock.recv(1 << 16)
                    assert chunk, f"closed after {data.count(b'HTTP/1.1 200')} of {count} answers"
                    data += chunk
        finally:
            release.set()  # (before the server stops: the held request would hold its shutdown)
    paths = [int(part[:6]) for part in data.split(b"\r\n\r\n/")[1:]]
    assert paths == list(range(count)), "answers missing or out of order"
    assert longest[0] <= handshake.MAX_PIPELINED + handshake.PARSE_SLICE // 32, longest[0]


@pytest.mark.parametrize("key, value, check_id", [
    ("HANDSHAKE_TIMEOUT_SECONDS", 0, "execapp.E065"), ("HANDSHAKE_TIMEOUT_SECONDS", -1.0, "execapp.E065"),
    ("HANDSHAKE_TIMEOUT_SECONDS", "10", "execapp.E065"), ("HANDSHAKE_TIMEOUT_SECONDS", True, "execapp.E065"),
    ("HANDSHAKE_TIMEOUT_SECONDS", None, "execapp.E065"), ("HANDSHAKE_TIMEOUT_SECONDS", 0.2, "execapp.W065"),
    ("MAX_PENDING_CONNECTIONS", 0, "execapp.E066"), ("MAX_PENDING_CONNECTIONS", -5, "execapp.E066"),
    ("MAX_PENDING_CONNECTIONS", 2.5, "execapp.E066"), ("MAX_PENDING_CONNECTIONS", "256", "execapp.E066"),
    ("MAX_PENDING_CONNECTIONS", False, "execapp.E066"),
])
def test_the_checks_refuse_a_bad_deadline_or_cap(settings: Any, key: str, value: Any, check_id: str) -> None:
    from execapp.checks import check_execapp_settings

    settings.EXECAPP = {key: value}
    found = {m.id: m for m in check_execapp_settings()}
    assert check_id in found and key in found[check_id].msg and found[check_id].hint
    settings.EXECAPP = {}
    assert not {"execapp.E065", "execapp.E066", "execapp.W065", "execapp.W066"} & {
        m.id for m in check_execapp_settings()}


def test_the_checks_warn_of_a_cap_over_half_the_open_file_limit(settings: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from execapp import checks

    monkeypatch.setattr(checks, "_open_files_limit", lambda: 1024)  # a common `ulimit -n`
    settings.EXECAPP = {"MAX_PENDING_CONNECTIONS": 600}
    assert "execapp.W066" in {m.id for m in checks.check_execapp_settings()}
    settings.EXECAPP = {}  # the default, 256, is a quarter of it
    assert "execapp.W066" not in {m.id for m in checks.check_execapp_settings()}


@pytest.mark.e2e
def test_malformed_requests_are_answered_400_counted_and_logged_once_a_minute(server: Server) -> None:
    # uvicorn logged a WARNING for each: ~6,000 lines a second from one client, no login needed.
    before, log_before = server.closed(handshake.BAD_REQUEST), server.log_path.stat().st_size
    for _ in range(50):
        with server.raw() as sock:
            sock.sendall(b"GARBAGE\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 400 ")
    assert server.closed(handshake.BAD_REQUEST) >= before + 50
    logged = server.log_path.read_bytes()[log_before:]
    assert logged.count(b"Invalid HTTP request received.") <= 1, logged[-2000:]


def test_client_caused_lines_are_let_through_once_an_interval_with_the_count_held_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from execapp import client_noise

    now = [1000.0]
    monkeypatch.setattr(client_noise.time, "monotonic", lambda: now[0])
    noise = client_noise.ClientNoiseFilter()

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, None, None)

    assert noise.filter(record("Invalid HTTP request received."))
    assert not any(noise.filter(record("Invalid HTTP request received.")) for _ in range(5))
    assert noise.filter(record("Unsupported upgrade request."))  # its own interval
    assert noise.filter(record("Something else."))  # not a client's: always through
    now[0] += client_noise.INTERVAL_SECONDS
    later = record("Invalid HTTP request received.")
    assert noise.filter(later) and "and 5 more" in later.getMessage()
