"""The /ws/events/ protocol: frame validation, error codes, outgoing frames and one connection's state.

Channels-free on purpose: ``execapp.consumers`` adapts it to a Channels consumer, and the tests
drive ``Connection`` directly. The frame formats are documented in docs/protocol.md.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from . import metrics
from .engine import Completion, Event, ExecAppError, Failure, Reply
from .engine.event import Outcome

log = logging.getLogger("execapp.protocol")

#: Every code an ``error`` frame can carry, with what it means. Handler codes come from the
#: engine and the plugin runtimes (``Failure.code``); any other ExecAppError code passes through.
ERROR_CODES: dict[str, str] = {
    "bad_json": "the text frame is not valid JSON",
    "bad_event": "the frame is JSON but not an event (the message names the field), or a binary frame",
    "too_large": "the frame is over EXECAPP['MAX_FRAME_BYTES'] bytes",
    "rate_limited": "the connection already has EXECAPP['MAX_IN_FLIGHT_PER_CONNECTION'] events in flight",
    "draining": "this worker takes no new events (a deploy is draining it); reconnect",
    "handler_error": "a handler raised; the event still gets its done",
    "timeout": "a handler ran out of time; the event still gets its done",
    "overloaded": "the worker pool stayed full; the handler was refused, not run",
    # Handler codes of the plugin runtimes (plugins/errors.py), passed through the same way:
    "plugin_busy": "the plugin is at its own concurrency limit; the handler was refused, not run",
    "plugin_unavailable": "the plugin was disabled, deleted or replaced while the call was set up",
    "memory_limit": "a handler ran into its plugin's memory cap",
    "permission_denied": "a handler called a host function its plugin has no permission for",
}

MAX_ID_CHARS = 64
MAX_SESSION_CHARS = 64
MAX_TYPE_CHARS = 64
#: Session groups one connection may join; each costs a channel-layer membership.
MAX_SESSIONS_PER_CONNECTION = 32
FIELDS = ("id", "type", "session", "text", "data")
# Channels group names allow ASCII letters, digits, '-', '_' and '.', under 100 characters.
_SESSION_RE = re.compile(r"[A-Za-z0-9_.\-]{1,%d}\Z" % MAX_SESSION_CHARS)
GROUP_PREFIX = "execapp.session."


class ProtocolError(ExecAppError):
    """A frame the server refuses; sent back as an ``error`` frame, the connection stays open."""

    def __init__(self, code: str, message: str, event_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.event_id = event_id


@dataclass(frozen=True)
class Limits:
    """The per-connection limits, read from settings once per connection."""

    max_frame_bytes: int = 64 * 1024
    max_in_flight: int = 100

    @classmethod
    def from_settings(cls) -> "Limits":
        """Limits from EXECAPP['MAX_FRAME_BYTES'] and EXECAPP['MAX_IN_FLIGHT_PER_CONNECTION']."""
        from . import conf  # Django settings: imported late so this module stays usable without them

        return cls(conf.get("MAX_FRAME_BYTES"), conf.get("MAX_IN_FLIGHT_PER_CONNECTION"))


# -- incoming frames ------------------------------------------------------------------------------

def group_name(session: str) -> str:
    """The channel-layer group of one session."""
    return GROUP_PREFIX + session


def check_session(value: Any, where: str = "session") -> str:
    """A valid session name, or ProtocolError(bad_event) naming ``where``."""
    if not isinstance(value, str) or not _SESSION_RE.match(value):
        raise ProtocolError("bad_event", f"{where} must be 1-{MAX_SESSION_CHARS} characters of A-Z a-z 0-9 _ . -, "
                                         f"got {_show(value)}")
    return value


def parse_frame(text: str | None, data: bytes | None, limits: Limits) -> Event:
    """Turn one WebSocket frame into an Event, or raise ProtocolError with the code to send back."""
    if text is None:
        size = len(data or b"")
        if size > limits.max_frame_bytes:
            raise ProtocolError("too_large", f"frame of {size} bytes is over the limit of {limits.max_frame_bytes} "
                                             "bytes (EXECAPP['MAX_FRAME_BYTES'])")
        raise ProtocolError("bad_event", "frame: binary frames are not accepted; send the event as a JSON text frame")
    # A str of n characters is between n and 4n UTF-8 bytes: only encode when it could be over.
    if len(text) > limits.max_frame_bytes or (len(text) * 4 > limits.max_frame_bytes
                                             and len(text.encode()) > limits.max_frame_bytes):
        raise ProtocolError("too_large", f"frame of {len(text.encode())} bytes is over the limit of "
                                         f"{limits.max_frame_bytes} bytes (EXECAPP['MAX_FRAME_BYTES'])")
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise ProtocolError("bad_json", f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_event", f"frame must be a JSON object like {{\"type\": \"message\", \"text\": "
                                         f"\"/ping\"}}, got a JSON {type(obj).__name__}")
    return _event_from(obj)


def _event_from(obj: dict[str, Any]) -> Event:
    eid = obj.get("id")
    if eid is not None and (not isinstance(eid, str) or not eid or len(eid) > MAX_ID_CHARS):
        raise ProtocolError("bad_event", f"id must be a non-empty string of at most {MAX_ID_CHARS} characters, "
                                         f"got {_show(eid)}; or leave it out and the server assigns one")
    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        raise ProtocolError("bad_event", f"{unknown[0]}: unknown field; an event has only "
                                         f"{', '.join(FIELDS)}", eid)
    # A bare {"text": "/ping"} is a message: "type" defaults to "message" when left out.
    etype = obj.get("type", "message")
    if not isinstance(etype, str) or not etype or len(etype) > MAX_TYPE_CHARS:
        raise ProtocolError("bad_event", f"type must be a non-empty string of at most {MAX_TYPE_CHARS} characters "
                                         f"(\"message\" or your own event type), got {_show(etype)}", eid)
    text = obj.get("text")
    if etype == "message":
        if not isinstance(text, str):
            raise ProtocolError("bad_event", f"text must be a string for a \"message\" event, got {_show(text)}", eid)
    elif text is None:
        text = ""
    elif not isinstance(text, str):
        raise ProtocolError("bad_event", f"text must be a string, got {_show(text)}", eid)
    data = obj.get("data")
    if data is None:
        data = {}
    elif not isinstance(data, dict):
        raise ProtocolError("bad_event", f"data must be a JSON object, got {_show(data)}", eid)
    session = obj.get("session")
    if session is not None:
        try:
            check_session(session)
        except ProtocolError as exc:
            exc.event_id = eid
            raise
    if eid is None:
        return Event(type=etype, text=text, data=data, session=session)
    return Event(type=etype, text=text, data=data, id=eid, session=session)


def _show(value: Any) -> str:
    """A short, safe rendering of an offending value for an error message."""
    if value is None:
        return "nothing"
    shown = json.dumps(value, default=repr)
    return f"{type(value).__name__} {shown[:40]}{'...' if len(shown) > 40 else ''}"


# -- outgoing frames ------------------------------------------------------------------------------

_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str).encode


def error_frame(code: str, message: str, event_id: str | None = None, **extra: Any) -> str:
    """An ``error`` frame."""
    return _encode({"type": "error", "id": event_id, "code": code, "message": message, **extra})


def outcome_frame(outcome: Outcome, session: str | None = None) -> str:
    """The frame for one engine outcome: ``reply``, ``error`` (a failed handler) or ``done``."""
    if isinstance(outcome, Reply):
        frame: dict[str, Any] = {
            "type": "reply", "id": outcome.event_id, "matcher": outcome.matcher, "plugin": outcome.plugin,
            "text": outcome.text, "data": outcome.data, "exec": outcome.exec_class.value,
            "elapsed_ms": round(outcome.elapsed * 1000, 3)}
    elif isinstance(outcome, Failure):
        frame = {"type": "error", "id": outcome.event_id, "code": outcome.code, "message": outcome.message,
                 "matcher": outcome.matcher, "plugin": outcome.plugin,
                 "exec": outcome.exec_class.value if outcome.exec_class else None}
    else:
        frame = {"type": "done", "id": outcome.event_id, "matched": outcome.matched, "replies": outcome.replies,
                 "errors": len(outcome.errors), "blocked_by": outcome.blocked_by,
                 "elapsed_ms": round(outcome.elapsed * 1000, 3)}
    if session is not None:
        frame["session"] = session
    try:
        return _encode(frame)
    except (TypeError, ValueError):  # e.g. a circular structure in a handler's data
        frame["data"] = repr(frame.get("data"))[:1000]
        return _encode(frame)


# -- one connection -------------------------------------------------------------------------------

class Outbox:
    """A FIFO of frames written by one task, so the loop never awaits a send inside a callback.

    Each item may carry an ``after`` callback, run once the item is written, failed to write,
    or dropped because the outbox closed (the drain count of a ``done`` relies on it).
    """

    def __init__(self, write: Callable[[Any], Awaitable[None]], name: str, warn: bool = False) -> None:
        self._write = write
        self._items: deque[tuple[Any, Callable[[], None] | None]] = deque()
        self._wake: asyncio.Future[None] | None = None
        self._closed = False
        self._failed = not warn  # a client socket failing is routine (it left); a channel layer is not
        self._name = name
        self._task = asyncio.get_running_loop().create_task(self._run(), name=name)

    def push(self, item: Any, after: Callable[[], None] | None = None) -> None:
        """Queue one item (loop thread only)."""
        if self._closed:
            if after is not None:
                after()
            return
        self._items.append((item, after))
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        items = self._items
        while True:
            while items:
                item, after = items.popleft()
                try:
                    await self._write(item)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a dead socket or layer: keep the loop alive, drop the item
                    # With ``warn``, the first failure at WARNING, the rest at DEBUG (no log flood).
                    log.log(logging.DEBUG if self._failed else logging.WARNING, "%s: write failed, item dropped",
                            self._name, exc_info=True)
                    self._failed = True
                finally:  # also when cancelled mid-write by close()
                    if after is not None:
                        after()
            self._wake = loop.create_future()
            await self._wake
            self._wake = None

    def pending(self) -> int:
        """Items queued and not yet written."""
        return len(self._items)

    async def flush(self) -> None:
        """Wait until every queued item is written (tests, orderly close)."""
        while self._items and not self._task.done():
            await asyncio.sleep(0.001)

    def close(self) -> None:
        """Stop writing; queued items are dropped (the client is gone), their callbacks run."""
        self._closed = True
        self._task.cancel()
        while self._items:
            _, after = self._items.popleft()
            if after is not None:
                after()


class Connection:
    """One client's protocol state: admission, in-flight events, and ordered delivery of outcomes.

    ``send(text)`` writes one frame to this client; ``publish(session, text)`` hands a frame to
    the session's group (None: sessions are served to the sender only); ``join(session)`` adds
    this connection to a session's group. Outcomes arrive on any thread and are queued on the
    loop in arrival order: per event that is every reply/error, then its one done.
    """

    def __init__(self, engine: Any, worker: Any, limits: Limits, send: Callable[[str], Awaitable[None]],
                 publish: Callable[[str, str], Awaitable[None]] | None = None,
                 join: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.engine = engine
        self.worker = worker
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.outbox = Outbox(send, "execapp-ws-writer")
        self._publish = publish
        self.group_outbox = Outbox(self._publish_one, "execapp-ws-group", warn=True) if publish is not None else None
        self._join = join
        self.sessions: set[str] = set()
        #: event id -> its session (None without one), from acceptance until its done is queued.
        self.in_flight: dict[str, str | None] = {}
        self.closed = False
        self.accepted = 0

    async def receive(self, text: str | None = None, data: bytes | None = None) -> None:
        """Handle one incoming frame: refuse it with an error frame, or hand it to the engine and
        return as soon as its handlers are started (never wait for them: Channels would hold back
        this connection's next frames)."""
        try:
            event = parse_frame(text, data, self.limits)
            if len(self.in_flight) >= self.limits.max_in_flight:
                raise ProtocolError("rate_limited", f"this connection has {len(self.in_flight)} events in flight, "
                                                    f"the limit is {self.limits.max_in_flight} (EXECAPP["
                                                    "'MAX_IN_FLIGHT_PER_CONNECTION']); wait for a done first",
                                    event.id)
            if event.id in self.in_flight:
                raise ProtocolError("bad_event", f"id {event.id!r} is already in flight on this connection; use a new "
                                                 "id for each event", event.id)
            if event.session is not None:
                await self.join_session(event.session, event.id)
            # Last check: from here on the event counts as accepted for a drain (atomically
            # with the drain's flag), and end_event runs once its done is written.
            if not self.worker.begin_event():
                raise ProtocolError("draining", "this worker is draining for a restart and takes no new events; "
                                                "reconnect (the load balancer sends you to a live worker)", event.id)
        except ProtocolError as exc:
            metrics.count_event(exc.code)
            self.outbox.push(error_frame(exc.code, exc.message, exc.event_id))
            return
        self.in_flight[event.id] = event.session
        self.accepted += 1
        try:
            # Inline handlers run right here on the loop; pooled ones start in threads. With the
            # "wait" overflow policy this may await a pool slot: backpressure on this client only.
            await self.engine.process_event_async(event, self._on_outcome)
        except Exception:  # an engine bug; its run still completes (dispatch releases in `finally`)
            log.exception("dispatch of event %s failed", event.id)

    async def join_session(self, session: str, event_id: str | None = None) -> None:
        """Join a session's group (once per connection), within MAX_SESSIONS_PER_CONNECTION."""
        if session in self.sessions or self._join is None:
            return
        if len(self.sessions) >= MAX_SESSIONS_PER_CONNECTION:
            raise ProtocolError("bad_event", f"session: this connection already joined {MAX_SESSIONS_PER_CONNECTION} "
                                             f"sessions; open another connection for {session!r}", event_id)
        self.sessions.add(session)
        try:
            await self._join(session)
        except Exception:  # the channel layer is down: the sender still gets its own frames
            self.sessions.discard(session)
            log.warning("joining session %r failed; its group frames are not delivered", session, exc_info=True)

    def _on_outcome(self, outcome: Outcome) -> None:
        # Called from the loop (inline handlers) or from pool threads. Both paths go through the
        # loop's FIFO ready queue, so a pooled reply queued before its run's last release is
        # always delivered before the done that release produces, whichever thread emits it.
        try:
            if threading.get_ident() == self._loop_thread:
                self.loop.call_soon(self._deliver, outcome)
            else:
                self.loop.call_soon_threadsafe(self._deliver, outcome)
        except RuntimeError:  # the loop is closed: the server is shutting down, the client is gone
            pass

    def _deliver(self, outcome: Outcome) -> None:
        """Queue one outcome's frame for the client (and the session's group) on the loop."""
        eid = outcome.event_id
        session = self.in_flight.get(eid)
        done = outcome.__class__ is Completion
        if done:
            self.in_flight.pop(eid, None)
            metrics.count_event(metrics.completion_outcome(outcome))
        if self.closed:
            if done:
                self.worker.end_event()
            return
        frame = outcome_frame(outcome, session)
        self.outbox.push(frame, self.worker.end_event if done else None)
        if session is not None and self.group_outbox is not None:
            self.group_outbox.push((session, frame))

    async def _publish_one(self, item: tuple[str, str]) -> None:
        await self._publish(item[0], item[1])  # type: ignore[misc]

    def error(self, code: str, message: str, event_id: str | None = None) -> None:
        """Queue an error frame outside of an event (e.g. a bad ?session= on connect)."""
        self.outbox.push(error_frame(code, message, event_id))

    async def flush(self) -> None:
        """Wait until queued frames are written."""
        await self.outbox.flush()
        if self.group_outbox is not None:
            await self.group_outbox.flush()

    def close(self) -> None:
        """The client left: stop writing. Its running handlers finish; their outcomes are dropped."""
        self.closed = True
        self.outbox.close()
        if self.group_outbox is not None:
            self.group_outbox.close()
