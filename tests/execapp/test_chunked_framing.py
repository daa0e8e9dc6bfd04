"""The framing of a chunked HTTP request body is bounded (execapp/chunked_framing.py).

One real ``python -m execapp.serve --workers 1`` driven by raw sockets, no login. Without the
bound, trailer lines streamed after a body's last chunk were kept by the worker for the whole body
deadline (1.3 GB in 8 s measured), and a body a byte per chunk held the event loop ~60 ms a read.
"""
from __future__ import annotations

import socket
from typing import Iterator

import pytest

from execapp import chunked_framing

from .test_handshake import Server, read_response, started

#: What each attack sends at most: far past the allowance, far below what the server would hold.
ATTACK_BYTES = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = started(tmp_path_factory, "chunked-framing")
    yield server
    server.stop()


def _chunked_post(path: str = "/admin/login/") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()


def _send_until_answered(sock: socket.socket, first: bytes, repeat: bytes) -> tuple[bytes, int]:
    """Send ``first``, then ``repeat`` until ATTACK_BYTES went or the server stopped reading: the
    response head and how many bytes were sent."""
    sent = 0
    sock.sendall(first)
    try:
        while sent < ATTACK_BYTES:
            sock.sendall(repeat)
            sent += len(repeat)
    except (ConnectionResetError, BrokenPipeError):
        pass
    return read_response(sock), sent


@pytest.mark.e2e
@pytest.mark.parametrize("first, repeat", [
    (b"5\r\nhello\r\n0\r\n", b"X-Trailer: " + b"t" * 200 + b"\r\n"),  # many trailer lines
    (b"5\r\nhello\r\n0\r\nX-Trailer: ", b"t" * 4096),  # one trailer line that never ends
    (b"", b"1\r\na\r\n" * 512),  # a byte per chunk
    (b"1;", b"e" * 4096),  # a chunk extension that never ends
], ids=["trailer-lines", "endless-trailer", "byte-chunks", "endless-extension"])
def test_a_chunked_body_whose_framing_passes_the_allowance_is_refused_and_closed(server: Server, first: bytes,
                                                                                 repeat: bytes) -> None:
    before = server.closed(chunked_framing.BODY_FRAMING)
    with server.raw() as sock:
        head, sent = _send_until_answered(sock, _chunked_post() + first, repeat)
        sock.settimeout(5)
        try:
            rest = sock.recv(65536)
            while rest and b"\r\n\r\n" not in head:
                rest = sock.recv(65536)
        except ConnectionResetError:
            pass
    assert head.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 431 ")), head[:200]
    assert sent < ATTACK_BYTES, "the server read everything sent instead of refusing it"
    assert server.closed(chunked_framing.BODY_FRAMING) >= before + 1


@pytest.mark.e2e
def test_the_refusal_says_what_to_fix(server: Server) -> None:
    with server.raw() as sock:
        sock.sendall(_chunked_post() + b"1\r\na\r\n" * 8192)
        sock.settimeout(5)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    assert data.startswith(b"HTTP/1.1 400 "), data[:200]
    assert b"larger chunks" in data and b"Content-Length" in data, data


@pytest.mark.e2e
@pytest.mark.parametrize("chunk", [48, 100, 4096])
def test_chunked_bodies_of_ordinary_chunks_and_a_trailer_reach_django_on_one_connection(server: Server,
                                                                                        chunk: int) -> None:
    body = b"username=a&password=" + b"b" * 60_000
    framed = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece)
                      for piece in (body[i:i + chunk] for i in range(0, len(body), chunk)))
    with server.raw() as sock:
        for _ in range(2):  # keep-alive: the second request's framing is its own
            sock.sendall(_chunked_post() + framed + b"0\r\nX-Checksum: abc\r\n\r\n")
            head = read_response(sock)
            # Django answers it (its CSRF check refuses a form without a token): not the bound.
            assert head.startswith(b"HTTP/1.1 403 "), head[:200]
