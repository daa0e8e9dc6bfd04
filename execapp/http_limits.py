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
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from . import conf, metrics

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]

#: The ``reason`` labels of execapp_connections_closed_total for the two refusals.
BODY_TOO_LARGE, BODY_TIMEOUT = "body_too_large", "body_timeout"


def _answer(status: int, text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    body = text.encode()
    return ({"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]},
            {"type": "http.response.body", "body": body})


def _declared_length(scope: dict[str, Any]) -> int | None:
    """The request's Content-Length, or None (no body announced, or a chunked one)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses such a request before it gets here
    return None


class RequestBodyLimit:
    """ASGI middleware: HTTP request bodies within a size and a time (see the module docstring)."""

    def __init__(self, app: App) -> None:
        self.app = app

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
        refused: list[str] = []
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
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                refused.append(BODY_TIMEOUT)
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused.append(BODY_TOO_LARGE)
                    return {"type": "http.disconnect"}
                body_done = not message.get("more_body", False)
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, tracked_send)
        if refused and not started:
            if refused[0] == BODY_TOO_LARGE:
                await self._refuse(send, BODY_TOO_LARGE, 413, f"request body over the limit of {limit} bytes "
                                                              "(EXECAPP['MAX_REQUEST_BODY_BYTES'])\n")
            else:
                await self._refuse(send, BODY_TIMEOUT, 408, f"request body not all in {timeout:g} s "
                                                            "(EXECAPP['REQUEST_BODY_TIMEOUT_SECONDS'])\n")

    @staticmethod
    async def _refuse(send: Send, reason: str, status: int, text: str) -> None:
        metrics.CONNECTIONS_CLOSED.labels(reason).inc()
        start, body = _answer(status, text)
        await send(start)
        await send(body)
