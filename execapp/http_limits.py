"""A size limit and a deadline on every HTTP request's body, in front of Django.

Django's ASGI handler reads a whole request body before it looks at the request, into a
temporary file that rolls over to disk past FILE_UPLOAD_MAX_MEMORY_SIZE: a POST to any path
(the admin's login, ``/healthz``), no token or session needed, wrote as much to the worker's disk
as its sender streamed, for as long as it liked (the header deadline of execapp.handshake ends
with the headers). ``RequestBodyLimit`` answers ``413`` to a body past
``EXECAPP['MAX_REQUEST_BODY_BYTES']`` (at once when its Content-Length says so, else as soon as
the bytes pass it) and ``408`` to one not all in ``EXECAPP['REQUEST_BODY_TIMEOUT_SECONDS']`` after
the request started; the app is told the client left (Django drops the request), and the
connection is closed after the answer. A request without a body costs one dict lookup.

Those two bound one request; the bodies arriving at once on a worker were not bounded together.
Each request's body sits in Django's spool as it comes (in memory up to 2.5 MiB, then on disk), so
a client that opened many connections, sent most of an 8 MiB body on each and stalled held ~2.8 MB
of the worker's memory per connection for the whole body deadline (measured: 60 connections,
+167 MB), no login needed, limited only by the file-descriptor limit. ``PendingBodies`` counts the
bytes of the bodies still arriving on a worker: past ``EXECAPP['MAX_PENDING_BODY_BYTES']`` the body
arriving the longest is refused (``503``, the connection closed), as execapp.handshake closes the
oldest connection waiting for its headers: a flood of stalled bodies costs its sender its own
oldest ones, never a request whose body comes at once. A body stops counting once it is all in.
They are bounded in number too, an announced body counted from its request's start: a request
whose body never comes (headers, then silence) held its connection for the whole body deadline,
with no bytes to count. Past ``EXECAPP['MAX_PENDING_CONNECTIONS']`` bodies arriving at once (the
bound execapp.handshake keeps on connections still sending their headers) the oldest is refused
the same way.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from . import conf, metrics

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]

#: The ``reason`` labels of execapp_connections_closed_total for the refusals.
BODY_TOO_LARGE, BODY_TIMEOUT, BODY_PENDING_CAP = "body_too_large", "body_timeout", "body_pending_cap"


def _answer(status: int, text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    body = text.encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body})


class _Body:
    """One request's body while it arrives: its bytes so far, and how to cut it short."""

    __slots__ = ("received", "refused", "timeout", "crowded")

    def __init__(self) -> None:
        self.received = 0
        #: Why the body was refused (the first reason only), empty while it is not.
        self.refused: list[str] = []
        #: Refused for the number of bodies arriving (MAX_PENDING_CONNECTIONS), not their bytes.
        self.crowded = False
        #: The deadline of the receive under way (None between receives): rescheduled to now to end it.
        self.timeout: asyncio.Timeout | None = None

    def refuse(self, reason: str) -> None:
        if not self.refused:
            self.refused.append(reason)
        if self.timeout is not None and not self.timeout.expired():
            self.timeout.reschedule(asyncio.get_running_loop().time())  # ends the receive under way now


class PendingBodies:
    """A worker's request bodies still arriving, oldest first, and their bytes so far; past ``limit``
    bytes, or ``max_count`` bodies, the oldest are refused (``BODY_PENDING_CAP``). Event loop only: no lock."""

    def __init__(self) -> None:
        self.limit = int(conf.DEFAULTS["MAX_PENDING_BODY_BYTES"])
        #: Bodies arriving at once, announced ones counted from the request's start: a body that
        #: never comes (headers, then silence) holds its connection until the body deadline.
        self.max_count = int(conf.DEFAULTS["MAX_PENDING_CONNECTIONS"])
        self.bytes = 0
        # A dict keeps insertion order: its first key is the body arriving the longest.
        self._bodies: dict[_Body, None] = {}

    def __len__(self) -> int:
        return len(self._bodies)

    def remove(self, body: _Body) -> None:
        """``body`` is all in, refused, or its request ended: its bytes no longer count."""
        if body in self._bodies:
            del self._bodies[body]
            self.bytes -= body.received

    def grew(self, body: _Body, size: int) -> None:
        """``size`` more bytes of ``body`` came (0: it is announced): refuse the oldest bodies until
        the rest fit in the limits."""
        if body not in self._bodies:
            self._bodies[body] = None
        body.received += size
        self.bytes += size
        while self._bodies and (self.bytes > self.limit or len(self._bodies) > self.max_count):
            oldest = next(iter(self._bodies))
            oldest.crowded = self.bytes <= self.limit
            self.remove(oldest)
            oldest.refuse(BODY_PENDING_CAP)


def _declared_length(scope: dict[str, Any]) -> int | None:
    """The request's Content-Length; -1 for a chunked body (Transfer-Encoding); None when no body is announced."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses such a request before it gets here
        if name == b"transfer-encoding":
            return -1
    return None


class RequestBodyLimit:
    """ASGI middleware: HTTP request bodies within a size and a time (see the module docstring)."""

    def __init__(self, app: App) -> None:
        self.app = app
        #: This worker's bodies still arriving (one RequestBodyLimit per worker process: config.asgi).
        self.pending = PendingBodies()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = int(conf.get("MAX_REQUEST_BODY_BYTES"))
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(send, BODY_TOO_LARGE, 413, f"request body of {declared} bytes is over the limit of "
                                                          f"{limit} bytes (EXECAPP['MAX_REQUEST_BODY_BYTES'])\n")
            return
        timeout = float(conf.get("REQUEST_BODY_TIMEOUT_SECONDS"))
        deadline = asyncio.get_running_loop().time() + timeout
        pending = self.pending
        pending.limit = int(conf.get("MAX_PENDING_BODY_BYTES"))
        pending.max_count = int(conf.get("MAX_PENDING_CONNECTIONS"))
        body = _Body()
        refused = body.refused
        if declared is not None and declared != 0:  # a body is coming: it counts from now
            pending.grew(body, 0)
        started = False
        received = 0
        body_done = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received, body_done
            if refused:
                return {"type": "http.disconnect"}
            if body_done:  # Django listens for a disconnect while the view runs: no deadline on that
                return await receive()
            try:
                async with asyncio.timeout_at(deadline) as body.timeout:
                    message = await receive()
            except TimeoutError:
                body.refuse(BODY_TIMEOUT)  # the first reason stays: refused for the pending cap, it ended that way
                return {"type": "http.disconnect"}
            finally:
                body.timeout = None
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                received += size
                if received > limit:
                    body.refuse(BODY_TOO_LARGE)
                    return {"type": "http.disconnect"}
                body_done = not message.get("more_body", False)
                if body_done:
                    pending.remove(body)
                else:  # counted while it arrives; a body that comes whole in one message never is
                    pending.grew(body, size)
                    if refused:  # the oldest, and past the cap with these bytes
                        return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        finally:
            pending.remove(body)
        if refused and not started:
            if refused[0] == BODY_TOO_LARGE:
                await self._refuse(send, BODY_TOO_LARGE, 413, f"request body over the limit of {limit} bytes "
                                                              "(EXECAPP['MAX_REQUEST_BODY_BYTES'])\n")
            elif refused[0] == BODY_PENDING_CAP:
                over = (f"more than {pending.max_count} request bodies at once (EXECAPP['MAX_PENDING_CONNECTIONS'])"
                        if body.crowded else f"more than {pending.limit} bytes of request bodies at once "
                                             "(EXECAPP['MAX_PENDING_BODY_BYTES'])")
                await self._refuse(send, BODY_PENDING_CAP, 503, f"request body not all in while this server was "
                                   f"receiving {over}, and it had been arriving the longest; send it again\n")
            else:
                await self._refuse(send, BODY_TIMEOUT, 408, f"request body not all in {timeout:g} s "
                                                            "(EXECAPP['REQUEST_BODY_TIMEOUT_SECONDS'])\n")

    @staticmethod
    async def _refuse(send: Send, reason: str, status: int, text: str) -> None:
        metrics.CONNECTIONS_CLOSED.labels(reason).inc()
        start, body = _answer(status, text)
        await send(start)
        await send(body)
