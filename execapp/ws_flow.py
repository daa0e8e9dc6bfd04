"""The server's WebSocket protocol: uvicorn's sans-I/O one, which stops reading a client whose writes back up.

uvicorn answers every ping frame with a pong written straight to the socket, with no flow
control: a client that sends pings and never reads made the worker buffer every pong (about a
ping's size) in its transport, for as long as it kept sending: tens of MB a second for one
connection, until the worker ran out of memory. The app's own frames already wait while the
socket's writes are paused (uvicorn's ``send``, then execapp.outbox); what the protocol writes
by itself did not. ``BackpressuredWebSocketProtocol`` stops reading the client while the bytes
written to it are above the transport's high-water mark, and reads on once they drained below
its low-water mark: a client that does not read stops being read (TCP backpressure), whatever
it sends. One that never reads again is closed by the keepalive (``ws_ping_interval`` +
``ws_ping_timeout``: its pong never comes). Nothing runs per frame; two callbacks per backlog.
"""
from __future__ import annotations

from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol


class BackpressuredWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol that reads nothing from a client while its writes are backed up."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The transport's write buffer is above its high-water mark (pause_writing .. resume_writing).
        self.writes_backed_up = False

    def pause_writing(self) -> None:
        """The transport's write buffer went above its high-water mark: stop reading this client too."""
        super().pause_writing()
        self.writes_backed_up = True
        if not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        """The buffer drained below the low-water mark: read on, unless uvicorn holds reading for the app."""
        super().resume_writing()
        self.writes_backed_up = False
        # read_paused: uvicorn's own pause while a received message waits for the app.
        if not self.read_paused and not self.transport.is_closing():
            self.transport.resume_reading()

    async def receive(self) -> Any:
        """uvicorn's receive: the next message for the app; its resume of reading waits for the writes."""
        message = await self.queue.get()
        if self.read_paused and self.queue.empty():
            self.read_paused = False
            if not self.writes_backed_up:
                self.transport.resume_reading()
        return message
