"""A bound on the framing of a chunked HTTP request body: chunk-size lines, extensions and trailers.

A ``Transfer-Encoding: chunked`` body is its data plus framing: a size line per chunk (with
optional extensions), a CRLF after each, and trailer header lines after the last. Nothing bounded
the framing. The body limits (execapp.http_limits) count the data the app receives, and the header
limit (execapp.handshake.MAX_HEADER_BYTES) ends with the headers, so:

- trailers: uvicorn appends each trailer line to the request's header list, and httptools keeps a
  header's bytes until its line ends, for as long as they come: one connection streaming trailer
  lines grew a worker by 1.3 GB in 8 s (measured; no login needed, the body deadline is 60 s);
- tiny chunks: a chunk is a parser callback and a Python call into uvicorn, so a body sent a byte
  per chunk cost ~0.2 us of the event loop per byte sent, ~60 ms per 256 KiB read (a bystander's
  WebSocket ``/ping`` waited 105 ms at the median while one client sent such a body).

``ChunkedFramingLimit`` counts the bytes of a chunked body that are not data (what each parsed
slice of a read held minus the data it gave the app). Past ``FRAMING_ALLOWANCE_BYTES`` plus one
``FRAMING_DATA_RATIO``-th of the data so far, the request is answered ``400`` with what to fix
(``431`` if it had no data yet) and the connection closed, counted in
``execapp_connections_closed_total{reason="body_framing"}``. Chunks of 48 bytes or more never come
near it, and no endpoint of this app takes trailers. Only chunked bodies pay (two integer updates
per slice parsed); a request whose body has a Content-Length never does.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:
    from .engine.ratelog import RateLimitedLog

log = logging.getLogger("execapp.handshake")

#: Framing bytes any chunked body may take whatever its data (trailers, extensions, the first chunks).
FRAMING_ALLOWANCE_BYTES = 16 * 1024
#: Past the allowance, framing may grow by one byte per this many bytes of data (chunks of ~48 bytes).
FRAMING_DATA_RATIO = 8
#: The ``reason`` label of execapp_connections_closed_total.
BODY_FRAMING = "body_framing"

_ratelog: "RateLimitedLog | None" = None


class ChunkedFramingLimit(HttpToolsProtocol):
    """uvicorn's httptools protocol with the framing of each chunked request body bounded (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: A chunked body is arriving: its headers are in and its end is not (on_message_complete).
        self._chunked_body = False
        #: Of the current chunked body: bytes parsed after its headers, and bytes of data among them.
        self._body_wire = 0
        self._body_data = 0

    def data_received(self, data: bytes) -> None:
        """uvicorn's parsing of ``data`` (a slice of a read: execapp.handshake feeds at most
        PARSE_SLICE bytes at a time), with a chunked body's framing in it counted and bounded."""
        counting = self._chunked_body  # bytes before the headers' end are the header limit's
        super().data_received(data)
        if counting and self._chunked_body:  # the body ended in this slice: its framing is done with
            self._body_wire += len(data)
            framing = self._body_wire - self._body_data
            if framing > FRAMING_ALLOWANCE_BYTES + self._body_data // FRAMING_DATA_RATIO:
                self._refuse_framing(framing)

    def on_headers_complete(self) -> None:
        """The headers are in: a chunked body's framing is counted from here."""
        super().on_headers_complete()
        self._body_wire = self._body_data = 0
        self._chunked_body = (self.parser is not None and not self.parser.should_upgrade()
                              and any(name == b"transfer-encoding" and b"chunked" in value.lower()
                                      for name, value in self.scope["headers"]))

    def on_body(self, body: bytes) -> None:
        """A chunk's data (or part of it): counted, then uvicorn's."""
        self._body_data += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        """The body's last chunk and trailers are in: nothing more to count."""
        self._chunked_body = False
        super().on_message_complete()

    def _refuse_framing(self, framing: int) -> None:
        """Answer 400 (431 for trailers before any data) unless a response started, tell the app the
        client left, and close the connection."""
        global _ratelog
        from . import metrics  # here: the supervisor imports this module and stays light
        from .engine.ratelog import RateLimitedLog

        self._chunked_body = False
        metrics.CONNECTIONS_CLOSED.labels(BODY_FRAMING).inc()
        if _ratelog is None:
            _ratelog = RateLimitedLog(log, interval=60.0)
        client = "%s:%d" % self.client if self.client else "?"
        _ratelog.warning(BODY_FRAMING, "closed a connection from %s: the framing of its chunked request body "
                         "(chunk-size lines, extensions, trailers) passed %d bytes for %d bytes of data", client,
                         framing, self._body_data)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            text = (f"chunked request body refused: its framing (chunk-size lines, chunk extensions, trailers) took "
                    f"{framing} bytes for {self._body_data} bytes of data, over {FRAMING_ALLOWANCE_BYTES} bytes plus "
                    f"1/{FRAMING_DATA_RATIO} of the data; send the body in larger chunks and without trailers, or "
                    "with a Content-Length\n").encode()
            status = b"431 Request Header Fields Too Large" if not self._body_data else b"400 Bad Request"
            self.transport.write(b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (status, len(text), text))
        if cycle is not None:
            # The app still waits for the body: its next receive says the client left, and what it
            # sends is dropped (uvicorn's send returns at once for a disconnected cycle).
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()
