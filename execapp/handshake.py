"""A deadline on every connection until its request headers are in, and a cap on connections waiting for them.

uvicorn has no timeout for reading a request's line and headers: a client that opens connections
and sends a WebSocket handshake (or any request) a byte at a time, or nothing at all, holds a
file descriptor of the worker for as long as it likes, no token needed (slowloris). Our server
(``execapp.serve.make_config``) runs uvicorn with ``HandshakeDeadlineProtocol``, its httptools
protocol plus two bounds, per worker process:

- a connection whose request line and headers are not all in ``HANDSHAKE_TIMEOUT_SECONDS`` after
  it was accepted is closed (on a keep-alive connection: after the previous response ended, once
  the next request's first bytes came; the idle wait before them is uvicorn's
  ``timeout_keep_alive``). WebSocket upgrades alike: the deadline ends where uvicorn hands the
  connection to its WebSocket protocol, so nothing here runs for frames;
- at most ``MAX_PENDING_CONNECTIONS`` connections wait for their headers: past it the oldest of
  them is closed, so a flood of silent sockets costs its sender its own oldest ones, never a
  newcomer that sends its request at once.

Each close is counted in ``execapp_connections_closed_total{reason}`` and logged once per cause
per minute. See docs/operations.md ("What clients and load balancers see").
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from .chunked_framing import ChunkedFramingLimit

if TYPE_CHECKING:  # the rest lazily: the supervisor (execapp.serve) imports this module and stays light
    from .engine.ratelog import RateLimitedLog

log = logging.getLogger("execapp.handshake")

#: The ``reason`` label of execapp_connections_closed_total: the deadline passed.
HANDSHAKE_TIMEOUT = "handshake_timeout"
#: The ``reason`` label of execapp_connections_closed_total: closed as the oldest past the cap.
PENDING_CAP = "pending_cap"
#: The ``reason`` label of execapp_connections_closed_total: a request line and headers past MAX_HEADER_BYTES.
HEADER_TOO_LARGE = "header_too_large"
#: The ``reason`` label of execapp_connections_closed_total: a request the HTTP parser refused (answered 400).
BAD_REQUEST = "bad_request"
REASONS = (HANDSHAKE_TIMEOUT, PENDING_CAP, HEADER_TOO_LARGE, BAD_REQUEST)
#: Requests one keep-alive connection may have queued behind the one running (HTTP/1.1 pipelining)
#: before the rest of what it sent waits unparsed. uvicorn parses a whole socket read (up to 256 KiB)
#: at once and queues every request in it, and reads on after each response: 200 KB of 31-byte
#: GETs were ~6,400 queued requests, +12 MB of worker per connection (measured, 4 connections: +51 MB),
#: no login needed. Now at most this many plus one slice's worth (PARSE_SLICE bytes of requests) are
#: queued. Browsers do not pipeline; a client that does keeps its order and gets every answer.
MAX_PIPELINED = 4
#: Bytes of a read handed to the HTTP parser at a time once requests are queued (a usual read: one slice).
PARSE_SLICE = 4096
#: Bytes a request's line and headers may take, cookies included (nginx's default buffers hold
#: 32 KiB, Node's limit is 16 KiB). httptools keeps a header's bytes as they come, with no limit
#: of its own: one header streamed for the whole deadline made a worker hold it all (measured:
#: +108 MB for 76 MB sent in 6 s, no token needed). Past it: 431 and the connection closed.
MAX_HEADER_BYTES = 64 * 1024
_HEADER_TOO_LARGE_BODY = f"request line and headers over {MAX_HEADER_BYTES} bytes\n".encode()
_HEADER_TOO_LARGE_RESPONSE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8"
                              b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                              % (len(_HEADER_TOO_LARGE_BODY), _HEADER_TOO_LARGE_BODY))


def read_limits() -> tuple[float, int]:
    """HANDSHAKE_TIMEOUT_SECONDS and MAX_PENDING_CONNECTIONS, read now; ValueError if not usable
    (``manage.py check`` says why, with a hint: execapp.E065, execapp.E066)."""
    from . import conf

    timeout, cap = conf.get("HANDSHAKE_TIMEOUT_SECONDS"), conf.get("MAX_PENDING_CONNECTIONS")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"EXECAPP['HANDSHAKE_TIMEOUT_SECONDS'] is {timeout!r}, it must be a positive number of "
                         "seconds (manage.py check: execapp.E065)")
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"EXECAPP['MAX_PENDING_CONNECTIONS'] is {cap!r}, it must be a whole number of at least 1 "
                         "(manage.py check: execapp.E066)")
    return float(timeout), cap


class PendingConnections:
    """One worker process's connections still waiting for their request headers, oldest first, each
    with its deadline timer; past ``cap`` of them the oldest are closed."""

    def __init__(self, timeout: float, cap: int) -> None:
        self.timeout = timeout
        self.cap = cap
        # A dict keeps insertion order: its first key is the connection pending the longest.
        self._timers: dict[HandshakeDeadlineProtocol, asyncio.TimerHandle] = {}
        self._trim_due = False

    def add(self, protocol: "HandshakeDeadlineProtocol", since: float) -> None:
        """``protocol`` waits for its request headers, due ``timeout`` after ``since`` (loop time)."""
        loop = protocol.loop
        # One timer per waiting connection, nothing per byte: it is cancelled once the headers are in.
        self._timers[protocol] = loop.call_at(since + self.timeout, protocol.close_pending, HANDSHAKE_TIMEOUT)
        if len(self._timers) > self.cap and not self._trim_due:
            # Trimmed two loop rounds from now, not here. After a pause (a busy loop, a backlog
            # that filled) the loop accepts a burst of connections in one round and reads them
            # in the next; clients whose requests already wait in their sockets get that one read
            # first instead of being closed as "oldest" unread (a burst of 100 with a cap of 8:
            # all served on asyncio's loop and uvloop; 8 of 100 on asyncio's when trimmed at once).
            # So one accept burst (bounded by the listen backlog) may exceed the cap for two rounds.
            self._trim_due = True
            loop.call_soon(loop.call_soon, self._trim)

    def remove(self, protocol: "HandshakeDeadlineProtocol") -> None:
        """``protocol`` no longer waits: its headers are in, or it is closed."""
        timer = self._timers.pop(protocol, None)
        if timer is not None:
            timer.cancel()

    def _trim(self) -> None:
        """Close the oldest pending connections until at most ``cap`` remain."""
        self._trim_due = False
        while len(self._timers) > self.cap:
            next(iter(self._timers)).close_pending(PENDING_CAP)


_pending: PendingConnections | None = None
_ratelog: "RateLimitedLog | None" = None


def pending() -> PendingConnections:
    """This process's pending connections (made on first use, from the settings read then)."""
    global _pending
    if _pending is None:
        _pending = PendingConnections(*read_limits())
    return _pending


class HandshakeDeadlineProtocol(ChunkedFramingLimit):
    """uvicorn's httptools HTTP protocol with a deadline on each request's line and headers, the
    connection counted among its worker's pending ones until they are in (``PendingConnections``);
    a chunked body's framing bounded as well (execapp.chunked_framing, fed a slice at a time here)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Loop time the last response ended, while the keep-alive connection idles for the next request.
        self._idle_since: float | None = None
        self._headers_in = False
        #: Bytes received since this request started, until its headers are in (MAX_HEADER_BYTES).
        self._header_bytes = 0
        #: Bytes read but not parsed: MAX_PIPELINED requests were queued (reading is paused meanwhile).
        self._unparsed = b""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Accepted: the request's headers are due within the timeout from now."""
        super().connection_made(transport)
        pending().add(self, self.loop.time())

    def data_received(self, data: bytes) -> None:
        """Bytes in: counted against MAX_HEADER_BYTES until the headers are in; the first ones after
        a keep-alive response start the next request's deadline."""
        since = self._idle_since
        if since is not None:
            # The next request on a keep-alive connection. uvicorn's keep-alive timer covered the
            # idle wait and these bytes just cancelled it; its headers are due a timeout after the
            # previous response ended. A request that arrives whole (the usual case) takes no timer.
            self._idle_since = None
            self._headers_in = False
            self._header_bytes = 0
        if not self._headers_in:
            self._header_bytes += len(data)
        self._feed(data)  # one read at most past the limit reaches the parser
        if self._headers_in or self.transport.is_closing():
            return
        if self._header_bytes > MAX_HEADER_BYTES:
            self.close_pending(HEADER_TOO_LARGE)
        elif since is not None:
            pending().add(self, since)

    def _feed(self, data: bytes) -> None:
        """uvicorn's parsing of ``data``, a slice at a time once it is large; past MAX_PIPELINED queued
        requests the rest is kept (``_unparsed``) and reading paused, until a response completes."""
        if self._unparsed:  # reading is paused; a read already under way still lands here
            self._unparsed += data
            return
        full = len(self.pipeline) >= MAX_PIPELINED
        if len(data) <= PARSE_SLICE and not full:  # the usual read: as uvicorn does
            super().data_received(data)
            return
        view = memoryview(data)
        for start in range(0, len(data), PARSE_SLICE):
            if len(self.pipeline) >= MAX_PIPELINED:  # checked before each slice: the queue never grows past it
                self._unparsed = bytes(view[start:])
                self.flow.pause_reading()
                return
            super().data_received(bytes(view[start:start + PARSE_SLICE]))
            if self.transport.is_closing() or self.transport.get_protocol() is not self:  # closed, or upgraded
                return

    def on_headers_complete(self) -> None:
        """The request's line and headers are in: its deadline ends (before a WebSocket upgrade
        hands the connection over, so no timer outlives the handshake)."""
        self._headers_in = True
        pending().remove(self)
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        """A response ended: if the connection now idles for another request, remember since when; bytes
        kept back for a full pipeline are read now, as a new read (deadlines and limits alike)."""
        super().on_response_complete()  # starts the next queued request, resumes reading
        if self.transport.is_closing():
            return
        if self.timeout_keep_alive_task is not None:
            self._idle_since = self.loop.time()
        if self._unparsed:
            rest, self._unparsed = self._unparsed, b""
            self.data_received(rest)
            if self._unparsed:  # still a full pipeline: the rest waits for the next response
                self.flow.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        """Closed, by either side: no longer pending."""
        pending().remove(self)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser refused: counted (its log line is rate-limited,
        execapp.client_noise), then uvicorn's 400 and close."""
        from . import metrics  # here, not at import: the supervisor imports this module too

        metrics.CONNECTIONS_CLOSED.labels(BAD_REQUEST).inc()
        super().send_400_response(msg)

    def close_pending(self, reason: str) -> None:
        """Close this connection waiting for its headers: its deadline passed, or it is the oldest past the cap."""
        pending().remove(self)
        if self.transport is None or self.transport.is_closing():
            return
        global _ratelog
        from . import metrics  # here, not at import: the supervisor imports this module too
        from .engine.ratelog import RateLimitedLog

        metrics.CONNECTIONS_CLOSED.labels(reason).inc()
        if _ratelog is None:
            _ratelog = RateLimitedLog(log, interval=60.0)  # one line per reason per minute
        client = "%s:%d" % self.client if self.client else "?"
        limits = pending()
        if reason == HANDSHAKE_TIMEOUT:
            _ratelog.warning(reason, "closed a connection from %s: its request headers were not all in %g s "
                             "(EXECAPP['HANDSHAKE_TIMEOUT_SECONDS']); a slow or silent client", client, limits.timeout)
        elif reason == HEADER_TOO_LARGE:
            _ratelog.warning(reason, "closed a connection from %s: its request line and headers passed %d bytes "
                             "(execapp.handshake.MAX_HEADER_BYTES)", client, MAX_HEADER_BYTES)
            self.transport.write(_HEADER_TOO_LARGE_RESPONSE)
        else:
            _ratelog.warning(reason, "closed a connection from %s: the oldest of more than %d waiting for their "
                             "request headers (EXECAPP['MAX_PENDING_CONNECTIONS']); a flood of silent or slow "
                             "connections?", client, limits.cap)
        self.transport.close()
