"""A client whose writes back up stops being read (execapp/ws_flow.py), through the real server.

The case that grew a worker without bound: a client that sends ping frames and never reads the
pongs (uvicorn writes each pong straight to the socket). With the protocol, once the socket's
buffers are full the server reads nothing more from that client, so what the client can send
stops growing; without it the server read on (measured: ~28 MB/s of pongs held by the worker).
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import time
from typing import Iterator

import pytest
from websockets.asyncio.client import connect

from tests.conftest import manage

from .test_handshake import Server

PING = bytes([0x89, 0x80 | 125]) + b"\x00\x00\x00\x00" + b"p" * 125  # masked, 125-byte payload


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("ws_flow")
    env = {"DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}"}
    assert manage("migrate", "--noinput", env=env).returncode == 0
    token = manage("create_token", "ws-flow", env=env)
    assert token.returncode == 0, token.stderr
    server = Server({**env, "TOKEN": token.stdout.strip().splitlines()[-1]}, tmp)
    yield server
    server.stop()


def _upgraded(server: Server) -> socket.socket:
    """A raw socket past the WebSocket handshake of /ws/events/ (that reads nothing after it)."""
    sock = server.raw()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET /ws/events/?{server.ws_url.split('?', 1)[1]} HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    assert sock.recv(4096).startswith(b"HTTP/1.1 101"), "handshake refused"
    sock.setblocking(False)
    return sock


def _flood(sock: socket.socket, seconds: float) -> int:
    """Send whole ping frames for ``seconds`` without reading; the bytes the server took."""
    chunk, sent, until = PING * 2000, 0, time.monotonic() + seconds
    while time.monotonic() < until:
        try:
            sent += sock.send(chunk[sent % len(chunk):])  # a partial send goes on mid-frame
        except BlockingIOError:
            time.sleep(0.005)
    return sent


async def test_a_client_that_sends_pings_and_never_reads_stops_being_read(server: Server) -> None:
    sock = _upgraded(server)
    try:
        _flood(sock, 1.5)  # the socket buffers fill, and (without the protocol) the server reads on
        more = _flood(sock, 1.5)
        # Kernel buffers take a little more as they drain into the paused transport, but not the
        # MBs a reading server takes in 1.5 s.
        assert more < 1 << 20, f"the server read {more} more bytes of pings from a client that reads nothing"
    finally:
        sock.close()
    # The worker serves everyone else meanwhile and after.
    async with connect(server.ws_url) as ws:
        await ws.send('{"id": "p", "type": "message", "text": "/nothing-matches"}')
        frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert frame["type"] == "done" and frame["id"] == "p", frame
