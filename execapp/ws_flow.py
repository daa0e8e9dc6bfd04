"""The server's WebSocket protocol: uvicorn's sans-I/O one, bounded in what a client makes it do by itself.

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

Protocol frames are also work on the event loop that reaches no handler, so no owner's share of
the loop pays for it (execapp.loop_share charges the messages the app decodes): a client reading
its pongs (or sending pongs nobody asked for, which uvicorn parses and ignores) could keep a
worker's loop parsing them, and one message may come in a frame per byte (each a parse and a
Python object, 128 KiB of them within uvicorn's size limit). So at most
``MAX_CONTROL_FRAMES_PER_SECOND`` pings and pongs a second (keepalives are one every few seconds)
and ``MAX_FRAGMENTS`` frames per message (browsers send one); past either the connection is
closed, 1008 or 1009 with the reason, and counted in ``execapp_connections_closed_total{reason}``.

And what one socket read becomes: uvicorn hands the whole read (up to 256 KiB) to the frame
parser, and queues every message in it for the app at once. 256 KiB of empty 6-byte text frames
were ~43,000 queued messages, ~8 MB of Python objects per connection (measured: +8 MB of worker
memory per connection of a client that sends them and reads nothing), ~8 GB for one owner's
1,000 connections. The parser now gets a read ``PARSE_SLICE`` bytes at a time and stops once
``MAX_QUEUED_MESSAGES`` wait for the app; the rest of the read is kept as bytes and parsed as the
app takes the messages, before reading resumes. Same messages, same order.

And how long one connection's task holds the loop: the app takes a message with ``await receive()``,
which does not suspend while messages are queued (``asyncio.Queue.get`` returns at once), and a
handler proven fast runs inline, so a connection whose client had sent a socket read's worth of
small frames (up to 256 KiB: ~12,000 ``/ping`` frames) ran them all in one go, ~0.5 s, before the
loop read any other socket. The owner's loop share (execapp.loop_share) only stops it once its bank
is spent, and each owner has a bank of its own: ten tenants each writing 256 KiB of ``/ping``
frames at once held a worker's loop for 4.3 s (measured; a /ping of another tenant waited as
long, and past LOOP_STALL_SECONDS the watchdog kills the worker). ``receive`` now hands the loop
back (``asyncio.sleep(0)``: every other ready task and socket runs first) once this connection has
run ``LOOP_SLICE_SECONDS`` since it last waited: a task holds the loop for at most a slice (plus
its last message), whatever its client queued, and the busy connections take turns.

A WebSocket handshake the ``websockets`` parser refuses (a request line or header line over its 8 KiB,
more than 128 headers: well within execapp.handshake's 64 KiB) got no answer at all: uvicorn hands the
request to this protocol, whose parser sets its handshake error and queues an end of stream that
uvicorn never writes, and the connection stayed open for ever (measured: a 20 KB URL, still open after
40 s), past the header deadline, which ends at the hand-over, and outside the cap on pending
connections: any client could hold sockets without a token. It is now answered ``431`` (a line or
the headers past the parser's limits) or ``400`` (anything else it refuses) with what to fix, and
closed, counted as ``handshake_refused``.

A connection closed for a protocol error (these limits, or uvicorn's own: bad UTF-8, a frame over
the size limit) gets its close frame and then a *lingering* close: the server half-closes (FIN
after the close frame) and reads on, dropping what comes, until the client closes its side too or
``LINGER_SECONDS`` pass. uvicorn closed the socket at once: the next frame the client had already
sent drew a reset, its write failed, and its WebSocket library gave up on the close frame it had
not read yet (the client saw 1006 and no reason: seen in CI with ``websockets``).

And what the app sends: uvicorn wrote each frame with a socket write of its own, so an inline
event's reply and done were two syscalls (on loopback ~5 us of the worker's CPU per event, ~7%
of a ``/ping``). A text or binary frame is now encoded at once and written at the end of the loop
turn together with every other frame sent in it. The frames wait in the sans-I/O connection's
own buffer, which every write of uvicorn's (a pong, a close, the keepalive) takes whole first, so
nothing overtakes them; what parsing a read queues (pongs) finds them already written. Such a
frame's bytes are made here (``data_frame``: what websockets makes, without its Frame object), and
``send_text_now`` takes a text frame without a coroutine or a message dict (execapp.consumers
writes an event's reply and done through it): ~2.5 us of the loop a frame less than ``send``.

And how long a message may take to arrive: nothing bounded it. A client that sent a message in
fragments and answered the keepalive's pings between them held a partial message (up to
``ws_max_size``, 128 KiB) on the worker for ever (measured: 400 such connections, +52 MB); one that
trickled a single frame a byte at a time was ended only by the keepalive (40 s, 1011, no reason).
A message now has ``EXECAPP['WS_MESSAGE_TIMEOUT_SECONDS']`` from its first byte (the first byte of
its first frame) until its last frame is in; past it the client is closed 1008 with the reason,
counted as ``message_timeout``. Time while this server is not reading the client (the app has a
message of it waiting, its writes are backed up) does not count. A whole frame in one read, the
usual case, arms nothing; a partial one arms one timer per message, re-armed only when it fires.
"""
from __future__ import annotations

import asyncio
import struct
from time import perf_counter
from typing import Any

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets import http11
from websockets.exceptions import InvalidState
from websockets.frames import Frame
from websockets.protocol import OPEN

from .loop_turn import WORKER_TURN_SECONDS, loop_turn

#: Ping and pong frames one client may send in a second (window from its first) before it is closed (1008).
MAX_CONTROL_FRAMES_PER_SECOND = 20
#: Frames one message may be sent in (the first and its continuations) before the client is closed (1009).
MAX_FRAGMENTS = 64
#: Bytes of a socket read handed to the frame parser at a time (a read of one or a few frames: one).
PARSE_SLICE = 4096
#: Messages waiting for the app past which the parser stops, the rest of the read kept as bytes.
MAX_QUEUED_MESSAGES = 32
#: Seconds of loop time one connection's task may run messages back to back before it lets the
#: loop run everything else that is ready (a few hundred small frames; one loop turn is ~20 us).
LOOP_SLICE_SECONDS = 0.005
#: The websockets parser's limits on a handshake request (websockets.http11), named in the 431 answer.
MAX_LINE_BYTES, MAX_HEADERS = http11.MAX_LINE_LENGTH, http11.MAX_NUM_HEADERS
#: Seconds a connection closed for a protocol error keeps reading (and dropping) what the client sends.
LINGER_SECONDS = 2.0
#: The ``reason`` labels of execapp_connections_closed_total for these two closes.
TOO_MANY_CONTROL_FRAMES, TOO_MANY_FRAGMENTS = "too_many_control_frames", "too_many_fragments"
#: The ``reason`` label of a text message that is not valid UTF-8 (closed 1007, as RFC 6455 says).
INVALID_UTF8 = "invalid_utf8"
#: The ``reason`` label of a WebSocket handshake request the parser refused (answered 431 or 400).
HANDSHAKE_REFUSED = "handshake_refused"
#: The ``reason`` label of a message (or one frame) not all in within WS_MESSAGE_TIMEOUT_SECONDS (closed 1008).
MESSAGE_TIMEOUT = "message_timeout"

#: The first header byte of a whole (FIN) text and binary frame, and the longer length headers.
OP_TEXT, OP_BINARY = 0x81, 0x82
_HEAD16, _HEAD64 = struct.Struct("!BBH"), struct.Struct("!BBQ")

_message_timeout: float | None = None


def data_frame(opcode: int, payload: bytes) -> bytes:
    """A whole, unmasked data frame (``opcode``: OP_TEXT or OP_BINARY) as websockets serializes it
    for a server with no extension: the header (FIN, opcode, 7-, 16- or 64-bit length), then ``payload``."""
    n = len(payload)
    if n < 126:
        return bytes((opcode, n)) + payload
    return (_HEAD16.pack(opcode, 126, n) if n < 65536 else _HEAD64.pack(opcode, 127, n)) + payload


def message_timeout() -> float:
    """EXECAPP['WS_MESSAGE_TIMEOUT_SECONDS'], read at a worker's first connection (manage.py check vets it)."""
    global _message_timeout
    if _message_timeout is None:
        from . import conf  # here: the supervisor imports this module and stays light

        _message_timeout = float(conf.get("WS_MESSAGE_TIMEOUT_SECONDS"))
    return _message_timeout


#: The scope's extension (an asyncio.Event) set when the client's socket is gone, ahead of the
#: ``websocket.disconnect`` message, which an app reads only after the frames queued before it:
#: execapp.consumers abandons a frame's dispatch still waiting for pool slots when it is set.
CONNECTION_LOST = "execapp.connection_lost"


class BackpressuredWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol that reads nothing from a client while its writes are backed up."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The transport's write buffer is above its high-water mark (pause_writing .. resume_writing).
        self.writes_backed_up = False
        self._controls = 0
        self._controls_since = 0.0
        #: Bytes read but not yet parsed: the app had MAX_QUEUED_MESSAGES waiting (reading is paused).
        self._unparsed = b""
        #: Closed for a protocol error and half-closed: what comes is dropped (see the module).
        self._lingering = False
        #: App frames are encoded but not yet written: a flush is scheduled (see ``send``).
        self._flush_due = False
        #: loop.time() when the app's task last resumed from a wait (the start of its slice).
        self._slice_started = 0.0
        #: loop.time() when the message arriving now began (None: between messages; see the module).
        self._message_since: float | None = None
        self._message_timer: asyncio.TimerHandle | None = None
        #: The parser completed a frame (or the handshake request) since the last ``_track_message``.
        self._frame_done = False
        #: Set once the socket is gone (the scope's CONNECTION_LOST extension).
        self._lost = asyncio.Event()
        #: This loop's budget of frame work for the turn (shared by every connection on it).
        self._turn = loop_turn(self.loop)
        #: Whose reads these are for that budget: the connection, or its owner once the app says
        #: (execapp.consumers): owners take the turns in order (execapp.loop_turn).
        self.parse_key: object = self

    def handle_connect(self, event: Any) -> None:
        """uvicorn's, and the CONNECTION_LOST extension in the scope (before the app's task runs)."""
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope.setdefault("extensions", {})[CONNECTION_LOST] = self._lost

    def data_received(self, data: bytes) -> None:
        """Bytes from the client: parsed a slice at a time while the app keeps up (see the module)."""
        if self._lingering:
            return
        if self._flush_due:  # the app's frames go first: what parsing queues (pongs) may be dropped
            self._flush_writes()
        if self._unparsed:  # reading is paused; a read already under way still lands here
            self._unparsed += data
        elif self.handshake_complete and ((turn := self._turn).spent >= WORKER_TURN_SECONDS or turn.queued) and (
                not turn.admits(self.parse_key)):  # the turn is spent, or owners waiting go first
            self._unparsed = data
            self.transport.pause_reading()
            self._turn.wait(self.parse_key, self._parse_next_turn)
        else:
            started = perf_counter()
            if len(data) <= PARSE_SLICE:  # the common read: as uvicorn does
                super().data_received(data)
            else:
                self._parse(data)
            self._turn.spend(perf_counter() - started)
        if not self.handshake_initiated and self.conn.handshake_exc is not None and not self.transport.is_closing():
            self._refuse_handshake(self.conn.handshake_exc)
        self._track_message()

    def handle_events(self) -> None:
        """uvicorn's, noting that a frame was completed (the message deadline's bookkeeping)."""
        if self.conn.events:
            self._frame_done = True
        super().handle_events()

    def _track_message(self) -> None:
        """After parsing: a message (or a frame) left partial starts the message deadline, unless one
        runs; a completed frame with no fragmented message left ends it."""
        done, self._frame_done = self._frame_done, False
        if not self.handshake_complete or self.close_sent:
            return
        if done and not self.frames:
            self._message_since = None
        # Bytes that completed no frame (a header alone leaves the parser's buffer empty) start one too.
        if self._message_since is None and (self.frames or self.conn.reader.buffer or not done):
            since = self._message_since = self.loop.time()
            if self._message_timer is None:
                self._message_timer = self.loop.call_at(since + message_timeout(), self._message_due)

    def _message_due(self) -> None:
        """The message deadline's timer: close the client if its message is still not in, else re-arm."""
        self._message_timer = None
        since = self._message_since
        if since is None or self.close_sent or self.transport.is_closing():
            return
        timeout, now = message_timeout(), self.loop.time()
        if self._unparsed or self.read_paused or self.writes_backed_up:
            # This server is not reading the client: the rest may sit in the socket's buffers. Its
            # time starts again (a client that holds it so is ended by the keepalive: its pong is unread).
            since = self._message_since = now
        elif now - since >= timeout:
            # A close reason is at most 123 bytes (a control frame's payload): this one is ~110.
            self.refuse(1008, MESSAGE_TIMEOUT, f"message not all in {timeout:g} s after its first byte "
                        "(EXECAPP['WS_MESSAGE_TIMEOUT_SECONDS']); send it whole")
            return
        self._message_timer = self.loop.call_at(since + timeout, self._message_due)

    def connection_lost(self, exc: Exception | None) -> None:
        """uvicorn's, the message deadline's timer cancelled, and CONNECTION_LOST set."""
        if self._message_timer is not None:
            self._message_timer.cancel()
            self._message_timer = None
        self._lost.set()
        super().connection_lost(exc)

    def _refuse_handshake(self, exc: Exception) -> None:
        """Answer a handshake request the parser refused (431 or 400, saying why) and close the connection."""
        from websockets.exceptions import SecurityError

        from . import metrics  # here: the supervisor imports this module and stays light

        cause = exc.__cause__ or exc
        if isinstance(cause, SecurityError):
            status, text = "431 Request Header Fields Too Large", (
                f"WebSocket handshake refused: {cause}; a request line or header line may be at most "
                f"{MAX_LINE_BYTES} bytes and a request at most {MAX_HEADERS} headers; send a shorter URL "
                "(the token in an Authorization header) or fewer headers\n")
        else:
            status, text = "400 Bad Request", f"WebSocket handshake refused: {exc}: {cause}\n"
        body = text.encode("utf-8", "replace")
        metrics.CONNECTIONS_CLOSED.labels(HANDSHAKE_REFUSED).inc()
        self.handshake_initiated = self.handshake_complete = self.close_sent = True
        self.transport.write(f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close"
                             f"\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        self.transport.close()

    def _parse_later(self) -> None:
        """A read kept for a turn whose parsing was spent: parse it now, unless the app has messages
        waiting (its ``receive`` parses the rest once it took them) or this turn is spent too."""
        if not self._unparsed or self._lingering or self.close_sent or self.transport.is_closing():
            return
        if not self.queue.empty():
            return
        if self._waits_turn():
            self._turn.wait(self.parse_key, self._parse_next_turn)
            return
        self._parse_kept()
        if not self._unparsed and self.queue.empty():  # nothing for the app yet: read on
            self.read_paused = False
            if not self.writes_backed_up:
                self.transport.resume_reading()

    def _parse_kept(self) -> None:
        """Parse the bytes kept back, charged to this turn's parsing."""
        rest, self._unparsed = self._unparsed, b""
        started = perf_counter()
        self._parse(rest)
        self._turn.spend(perf_counter() - started)
        self._track_message()

    def _waits_turn(self) -> bool:
        """This connection's owner may not parse now (execapp.loop_turn): two attribute reads while
        the turn has budget left and no owner waits."""
        turn = self._turn
        return (turn.spent >= WORKER_TURN_SECONDS or turn.queued) and not turn.admits(self.parse_key)

    def _parse_next_turn(self) -> None:
        """Called at the turn this owner is called for: parse the kept read (``_parse_later``) then."""
        self.loop.call_soon(self._parse_later)

    def _parse(self, data: bytes) -> None:
        """Parse ``data`` slice by slice; once the app has MAX_QUEUED_MESSAGES waiting keep the rest."""
        view = memoryview(data)
        for start in range(0, len(data), PARSE_SLICE):
            end = start + PARSE_SLICE
            super().data_received(bytes(view[start:end]))
            if self.close_sent or self.transport.is_closing():
                return
            if end < len(data) and self.queue.qsize() >= MAX_QUEUED_MESSAGES:
                self._unparsed = bytes(view[end:])
                # uvicorn paused reading when it queued the first of them (read_paused).
                self.transport.pause_reading()
                return

    async def send(self, message: Any) -> None:
        """uvicorn's send, except that a text or binary frame is written at the end of the loop turn,
        with every other frame the app sent in it: one socket write for an event's reply and done."""
        if (message["type"] == "websocket.send" and self.handshake_complete and not self.close_sent
                and self.initial_response is None and self.writable.is_set() and not self.disconnected):
            text = message.get("text")
            data = message.get("bytes")
            if data is not None:
                self._queue_frame(OP_BINARY, data)
            elif text is not None:
                self._queue_frame(OP_TEXT, text.encode())
            return
        await super().send(message)

    def send_text_now(self, text: str) -> bool:
        """``send`` of one text frame without a coroutine or a message dict (execapp.consumers uses it
        when the ASGI send is this protocol's): queued the same way and True, or False when ``send``
        has to take it (not open yet or any more, writes paused). Raises ClientDisconnected as ``send``."""
        if (self.handshake_complete and not self.close_sent and self.initial_response is None
                and self.writable.is_set() and not self.disconnected):
            self._queue_frame(OP_TEXT, text.encode())
            return True
        return False

    def _queue_frame(self, opcode: int, payload: bytes) -> None:
        """One whole data frame into the sans-I/O connection's buffer, written at the end of the loop turn.

        Left in that buffer: every write of uvicorn's (a pong, a close, the keepalive's ping) takes the
        whole buffer first, so frames keep their order. The frame is the bytes websockets would make
        (a server's frames are not masked); built here, without its Frame object, check and stream
        (~1.5 us a frame), unless an extension (permessage-deflate) or debug logging is on, or a
        fragmented message is being sent: then websockets builds it."""
        conn = self.conn
        if conn.state is not OPEN:
            raise ClientDisconnected()
        if conn.extensions or conn.debug or conn.expect_continuation_frame:
            try:
                conn.send_binary(payload) if opcode == OP_BINARY else conn.send_text(payload)
            except InvalidState:
                raise ClientDisconnected() from None
        else:
            conn.writes.append(data_frame(opcode, payload))
        if not self._flush_due:
            self._flush_due = True
            self.loop.call_soon(self._flush_writes)

    def _flush_writes(self) -> None:
        """Write the frames the app sent since the last flush, in one write."""
        if not self._flush_due:
            return
        self._flush_due = False
        output = self.conn.data_to_send()
        if output and not self.transport.is_closing():
            self.transport.write(b"".join(output))

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
        """uvicorn's receive: the next message for the app. Once the app took every queued message, the
        bytes kept back are parsed first; reading resumes after them, and not while writes are backed up.
        A task that ran LOOP_SLICE_SECONDS without waiting lets the loop run the others first."""
        queue = self.queue
        if queue.empty():  # the get below waits: the loop runs others, a new slice starts after it
            message = await queue.get()
            self._slice_started = self.loop.time()
        else:
            now = self.loop.time()
            if now - self._slice_started >= LOOP_SLICE_SECONDS:
                await asyncio.sleep(0)  # behind every task and callback ready now (sockets read meanwhile)
                self._slice_started = self.loop.time()
            message = queue.get_nowait()
        if self.read_paused and self.queue.empty():
            if self._unparsed:
                if self._waits_turn():  # a later turn's (``_parse_later``); reading stays paused
                    self._turn.wait(self.parse_key, self._parse_next_turn)
                    return message
                self._parse_kept()
                if self._unparsed or not self.queue.empty():
                    return message  # more for the app first: reading stays paused
            self.read_paused = False
            if not self.writes_backed_up and not self.transport.is_closing():
                self.transport.resume_reading()
        return message

    def handle_ping(self) -> None:
        """A ping frame: answered (uvicorn) within MAX_CONTROL_FRAMES_PER_SECOND, else the client is closed."""
        if self.close_sent or self.transport.is_closing():
            self.conn.data_to_send()  # its pong: not for a connection on its way out
            return
        if self._within_control_rate():
            super().handle_ping()

    def handle_pong(self, event: Frame) -> None:
        """A pong frame (the keepalive's answer, or unasked): counted like a ping, then uvicorn's."""
        if not self.close_sent and self._within_control_rate():
            super().handle_pong(event)

    def _within_control_rate(self) -> bool:
        """Count one ping or pong; past MAX_CONTROL_FRAMES_PER_SECOND close the client (False)."""
        now = self.loop.time()
        if now - self._controls_since >= 1.0:
            self._controls, self._controls_since = 0, now
        self._controls += 1
        if self._controls <= MAX_CONTROL_FRAMES_PER_SECOND:
            return True
        self.refuse(1008, TOO_MANY_CONTROL_FRAMES, f"more than {MAX_CONTROL_FRAMES_PER_SECOND} pings and pongs a "
                    "second; ping less often")
        return False

    def handle_cont(self, event: Frame) -> None:
        """A continuation frame of a message: taken up to MAX_FRAGMENTS frames, else the client is closed."""
        if self.close_sent:
            return
        if len(self.frames) >= MAX_FRAGMENTS:
            self.refuse(1009, TOO_MANY_FRAGMENTS, f"a message in more than {MAX_FRAGMENTS} frames; send it in fewer")
            return
        super().handle_cont(event)

    def send_receive_event_to_app(self) -> None:
        """uvicorn's hand-over of a whole message to the app, except for a text message that is not
        UTF-8: closed 1007 with where and why, counted (uvicorn closed it with no reason and logged
        an ERROR with a traceback for it: ~2,000 lines a second from one client reconnecting)."""
        if self.curr_msg_data_type == "text" and not self.close_sent:
            data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
            if not data.isascii():  # ASCII (most JSON) is UTF-8: no second decode on the usual path
                try:
                    data.decode()
                except UnicodeDecodeError as exc:
                    self.refuse(1007, INVALID_UTF8, f"text message is not UTF-8 at byte {exc.start} "
                                f"({exc.reason}); send UTF-8 text")
                    return
            self.frames = [data]
        super().send_receive_event_to_app()

    def refuse(self, code: int, label: str, reason: str) -> None:
        """Close this client for a protocol limit: a close frame with ``reason``, the app told it left."""
        from . import metrics  # here: the supervisor imports this module and stays light

        metrics.CONNECTIONS_CLOSED.labels(label).inc()
        self.frames = []
        self.conn.data_to_send()  # pongs not yet written: the close goes first
        self.conn.send_close(code, reason)
        self.handle_parser_exception()

    def handle_parser_exception(self) -> None:
        """uvicorn's close after a protocol error (the close frame written, the app told the client
        left), with a lingering close in place of closing the socket at once (see the module)."""
        assert self.conn.close_sent is not None
        close = self.conn.close_sent
        self.queue.put_nowait({"type": "websocket.disconnect", "code": close.code, "reason": close.reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True  # uvicorn writes nothing more: the app's sends, pongs and keepalives are dropped
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self._lingering, self._unparsed = True, b""
        self.transport.write_eof()  # the FIN goes after the close frame
        # Reading resumes whatever paused it: dropping bytes holds nothing. The client's own close
        # ends it (eof_received: uvicorn's returns None, so the transport closes itself).
        self.transport.resume_reading()
        # As uvicorn's close timer: the app's end then leaves the transport to it (run_asgi).
        self.close_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)
