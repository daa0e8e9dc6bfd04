"""The /ws/events/ protocol: frame validation, error codes, outgoing frames and one connection's state.

Channels-free on purpose: ``execapp.consumers`` adapts it to a Channels consumer, and the tests
drive ``Connection`` directly. The frame formats are documented in docs/protocol.md.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
from array import array
from collections import deque
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Awaitable, Callable

from . import metrics
from .engine import Completion, Event, ExecAppError, Failure, Reply
from .engine.event import Outcome
from .engine.ratelog import RateLimitedLog

log = logging.getLogger("execapp.protocol")
#: Failures a client can cause on every frame are logged once per cause per minute, with a count.
_rare = RateLimitedLog(log, 60.0)

#: Every code an ``error`` frame can carry, with what it means. Handler codes come from the
#: engine and the plugin runtimes (``Failure.code``); any other ExecAppError code passes through.
ERROR_CODES: dict[str, str] = {
    "bad_json": "the text frame is not valid JSON",
    "bad_event": "the frame is JSON but not an event (the message names the field), a binary frame, or text "
                 "that is not valid Unicode (a lone surrogate such as \\ud800)",
    "too_large": "the frame is over EXECAPP['MAX_FRAME_BYTES'] bytes",
    "too_deep": "the frame nests arrays/objects deeper than EXECAPP['MAX_FRAME_DEPTH'] levels",
    "internal_error": "the server failed on this frame (a bug, logged); the connection stays open",
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
    # Host quotas (plugins.errors.QUOTA_CODES): the call was ended, the event still gets its done.
    "quota_kv": "a handler's kv_set would take its plugin's stored KV keys or bytes past their quota",
    "quota_kv_writes": "a handler made more kv_set calls in one call than its plugin's quota",
    "quota_http": "a handler made more http_get requests or received more response bytes in one call than its "
                  "plugin's quota",
}

MAX_ID_CHARS = 64
MAX_SESSION_CHARS = 64
MAX_TYPE_CHARS = 64
#: Session groups one connection may join; each costs a channel-layer membership.
MAX_SESSIONS_PER_CONNECTION = 32
FIELDS = ("id", "type", "session", "text", "data")
# Channels group names allow ASCII letters, digits, '-', '_' and '.', under 100 characters:
# prefix (16) + owner digest (16) + '.' + session (<= 64) = 97.
_SESSION_RE = re.compile(r"[A-Za-z0-9_.\-]{1,%d}\Z" % MAX_SESSION_CHARS)
GROUP_PREFIX = "execapp.session."
OWNER_DIGEST_CHARS = 16


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
    max_depth: int = 32

    @classmethod
    def from_settings(cls) -> "Limits":
        """Limits from EXECAPP['MAX_FRAME_BYTES'], ['MAX_IN_FLIGHT_PER_CONNECTION'] and ['MAX_FRAME_DEPTH']."""
        from . import conf  # Django settings: imported late so this module stays usable without them

        return cls(conf.get("MAX_FRAME_BYTES"), conf.get("MAX_IN_FLIGHT_PER_CONNECTION"), conf.get("MAX_FRAME_DEPTH"))


# -- incoming frames ------------------------------------------------------------------------------

def owner_digest(owner: str) -> str:
    """The short, group-name-safe form of an owner key (e.g. ``tenant:acme``, ``user:7``)."""
    return hashlib.sha256(owner.encode("utf-8", "surrogatepass")).hexdigest()[:OWNER_DIGEST_CHARS]


def group_name(owner: str, session: str) -> str:
    """The channel-layer group of one owner's session: the same name under two owners is two groups."""
    return f"{GROUP_PREFIX}{owner_digest(owner)}.{session}"


def check_session(value: Any, where: str = "session") -> str:
    """A valid session name, or ProtocolError(bad_event) naming ``where``."""
    if not isinstance(value, str) or not _SESSION_RE.match(value):
        raise ProtocolError("bad_event", f"{where} must be 1-{MAX_SESSION_CHARS} characters of A-Z a-z 0-9 _ . -, "
                                         f"got {_show(value)}")
    return value


def _too_large(size: int, limits: Limits) -> ProtocolError:
    return ProtocolError("too_large", f"frame of {size} bytes is over the limit of {limits.max_frame_bytes} bytes "
                                      "(EXECAPP['MAX_FRAME_BYTES'])")


def parse_frame(text: str | None, data: bytes | None, limits: Limits) -> Event:
    """Turn one WebSocket frame into an Event, or raise ProtocolError with the code to send back.

    Checked in order of cost, each before the decoder sees the text: size, Unicode, nesting
    depth (so ``json.loads`` can never recurse deep), then JSON, then the event's fields.
    """
    if text is None:
        size = len(data or b"")
        if size > limits.max_frame_bytes:
            raise _too_large(size, limits)
        raise ProtocolError("bad_event", "frame: binary frames are not accepted; send the event as a JSON text frame")
    chars = len(text)
    if chars > limits.max_frame_bytes:  # at least one byte per character: over whatever its encoding
        raise _too_large(len(text.encode("utf-8", "surrogatepass")), limits)
    raw: bytes | None = None
    if not text.isascii():
        try:
            raw = text.encode()
        except UnicodeEncodeError as exc:  # a lone surrogate (a server decodes UTF-8, in-process callers may not)
            raise ProtocolError("bad_event", f"frame is not valid Unicode: a lone surrogate at character {exc.start}; "
                                             "send UTF-8 text") from None
        if len(raw) > limits.max_frame_bytes:
            raise _too_large(len(raw), limits)
    # Nesting depth, before the decoder: json.loads recurses per level (RecursionError near
    # 1000), and handlers deep-copy data. Fewer brackets than the limit cannot be too deep.
    if text.count("[") + text.count("{") > limits.max_depth:
        depth = json_depth(raw if raw is not None else text.encode(), limits.max_depth)
        if depth > limits.max_depth:
            raise _too_deep(limits)
    try:
        obj = _decode(text)
    except RecursionError:  # a limit configured near the interpreter's own: still refused, not raised
        raise _too_deep(limits) from None
    except ValueError as exc:
        raise ProtocolError("bad_json", f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_event", f"frame must be a JSON object like {{\"type\": \"message\", \"text\": "
                                         f"\"/ping\"}}, got a JSON {type(obj).__name__}")
    # JSON escapes can spell what UTF-8 cannot: a lone surrogate ("\ud800") in any string, keys
    # included. Refused here, so handlers and outgoing frames only ever see valid text.
    # "\ud"/"\uD" start every surrogate escape (\ud800-\udfff) and a few valid ones: checked, not refused.
    if "\\u" in text and ("\\ud" in text or "\\uD" in text):
        _check_unicode(obj)
    return _event_from(obj, chars)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (Python's decoder accepts it, browsers' JSON.parse does not)")


# Strict JSON: NaN and Infinity would come back out in reply frames no browser can parse.
_decode = json.JSONDecoder(parse_constant=_no_constant).decode


def _too_deep(limits: Limits) -> ProtocolError:
    return ProtocolError("too_deep", f"frame nests arrays/objects more than {limits.max_depth} levels deep (the event "
                                     "object is level 1; EXECAPP['MAX_FRAME_DEPTH']); send flatter data")


# bytes.translate tables: keep brackets and quotes; read '{' '}' as '[' ']'; brackets as +1/-1.
_NOT_BRACKETS_OR_QUOTES = bytes(b for b in range(256) if b not in b'[]{}"')
_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_BRACKET_SIGNS = bytes.maketrans(b"[]", b"\x01\xff")
_OPENER_RUNS: dict[int, re.Pattern[bytes]] = {}
#: Innermost-pair passes tried before summing: one per level, and real frames are shallow.
_PASSES = 6


def json_depth(raw: bytes, limit: int) -> int:
    """The nesting depth of JSON text ``raw`` (brackets inside strings ignored): exact for balanced
    text, except that a run of more than ``limit`` openers returns ``limit + 1`` at once.

    C-level bytes operations only, no per-character Python loop: strings are cut out and only
    the brackets kept; then each of a few passes removes the innermost ``[]`` pairs (one level
    each: a shallow frame is done), and what is left is summed as +1/-1 signed bytes.
    Unbalanced text counts its unclosed openers (the decoder refuses it anyway).
    """
    # Outside strings: escaped backslashes, then escaped quotes, go; what is left between
    # quotes is a string. (UTF-8 continuation bytes never equal an ASCII byte.)
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    kept = raw.translate(None, _NOT_BRACKETS_OR_QUOTES)
    # Two adjacent quotes enclose no bracket (a string without one, or the gap between two
    # strings): dropping them changes no bracket's inside/outside parity. Most strings go here.
    if b'"' in kept:
        kept = kept.replace(b'""', b"")
        if b'"' in kept:
            kept = b"".join(kept.split(b'"')[0::2])
    brackets = kept.translate(_AS_BRACKETS)
    run = _OPENER_RUNS.get(limit)
    if run is None:
        run = _OPENER_RUNS[limit] = re.compile(b"\\[{%d}" % (limit + 1))
    if run.search(brackets):  # the plain attack ("[[[[..."): found without counting
        return limit + 1
    depth = 0
    while brackets and depth < _PASSES:
        inner = brackets.replace(b"[]", b"")
        if len(inner) == len(brackets):  # nothing left to pair: unbalanced, its openers never close
            return depth + inner.count(b"[")
        depth += 1
        brackets = inner
    if not brackets:
        return depth
    return depth + max(accumulate(array("b", brackets.translate(_BRACKET_SIGNS))))


def _check_unicode(obj: Any) -> None:
    """Raise bad_event naming the first string (or key) of ``obj`` that is not valid Unicode."""
    try:
        _encode(obj).encode()
        return
    except UnicodeEncodeError:
        pass
    # The rare path: find where, iteratively (depth is already bounded, but no recursion anyway).
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _valid_unicode(value):
                break
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _valid_unicode(key):
                    path = f"{path}.<key>" if path else "<key>"
                    break
                stack.append((f"{path}.{key}" if path else key, item))
            else:
                continue
            break
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        path = "frame"
    eid = obj.get("id")
    eid = eid if isinstance(eid, str) and 0 < len(eid) <= MAX_ID_CHARS and _valid_unicode(eid) else None
    raise ProtocolError("bad_event", f"{_clip(path or 'frame')}: not valid Unicode (a lone UTF-16 surrogate escape "
                                     "such as \\ud800); escape whole characters (a surrogate pair) or send UTF-8",
                        eid)


def _valid_unicode(text: str) -> bool:
    try:
        text.encode()
        return True
    except UnicodeEncodeError:
        return False


def _clip(text: str, limit: int = 40) -> str:
    """``text`` cut to ``limit`` characters for an error message (field names are client input)."""
    return text if len(text) <= limit else text[:limit] + "..."


def _event_from(obj: dict[str, Any], size: int | None = None) -> Event:
    eid = obj.get("id")
    if eid is not None and (not isinstance(eid, str) or not eid or len(eid) > MAX_ID_CHARS):
        raise ProtocolError("bad_event", f"id must be a non-empty string of at most {MAX_ID_CHARS} characters, "
                                         f"got {_show(eid)}; or leave it out and the server assigns one")
    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        raise ProtocolError("bad_event", f"{_clip(unknown[0])}: unknown field; an event has only "
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
    # size: the frame's length in characters, so the engine can send an input much larger than
    # those a handler was proven fast on to the pool before it runs (Event.size).
    return Event(type=etype, text=text, data=data, id=eid, session=session, size=size)


def _show(value: Any) -> str:
    """A short, safe rendering of an offending value for an error message."""
    if value is None:
        return "nothing"
    shown = json.dumps(value, default=repr)
    return f"{type(value).__name__} {shown[:40]}{'...' if len(shown) > 40 else ''}"


# -- outgoing frames ------------------------------------------------------------------------------

# allow_nan=False: a NaN or Infinity in a handler's data is not JSON (browsers refuse the frame);
# outcome_frame then sends that data as its text instead.
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str, allow_nan=False).encode


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
        text = _encode(frame)
    except (TypeError, ValueError):  # e.g. a circular structure, or NaN, in a handler's data
        frame["data"] = repr(frame.get("data"))[:1000]
        text = _encode(frame)
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:  # a handler's lone surrogate: the socket could not send the frame at all
            text = text.encode("utf-8", "replace").decode()
    return text


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

    ``send(text)`` writes one frame to this client; ``publish(group, text)`` hands a frame to a
    session's channel-layer group (None: sessions are served to the sender only); ``join(group)``
    adds this connection to one. Group names come from ``group_name(owner, session)`` here and
    nowhere else, so a connection can only ever join or publish to its own owner's sessions.
    Outcomes arrive on any thread and are queued on the loop in arrival order: per event that is
    every reply/error, then its one done.
    """

    def __init__(self, engine: Any, worker: Any, limits: Limits, send: Callable[[str], Awaitable[None]],
                 publish: Callable[[str, str], Awaitable[None]] | None = None,
                 join: Callable[[str], Awaitable[None]] | None = None, owner: str | None = None) -> None:
        if (publish is not None or join is not None) and not owner:
            raise ValueError("a Connection with session groups needs its owner (e.g. 'tenant:acme'): group names "
                             "are namespaced by owner")
        self.engine = engine
        self.worker = worker
        self.limits = limits
        self.owner = owner or ""
        # group_name(owner, session) == this prefix + session: the digest is computed once.
        self._group_prefix = group_name(self.owner, "")
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
        this connection's next frames). Never raises: a failure of the server's own is an
        ``internal_error`` frame (logged once per cause per minute) and the connection stays."""
        try:
            await self._receive(text, data)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _rare.exception(("receive", type(exc).__name__), "a frame failed inside the server: %r", exc)
            metrics.count_event("internal_error")
            self.outbox.push(error_frame("internal_error", f"the server failed on this frame ({type(exc).__name__}); "
                                                           "it is logged; the connection stays open"))

    async def _receive(self, text: str | None, data: bytes | None) -> None:
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
        except Exception as exc:  # an engine bug; its run still completes (dispatch releases in `finally`)
            _rare.exception(("dispatch", type(exc).__name__), "dispatch of event %s failed", event.id)

    async def join_session(self, session: str, event_id: str | None = None) -> None:
        """Join a session's group (once per connection), within MAX_SESSIONS_PER_CONNECTION."""
        if session in self.sessions or self._join is None:
            return
        if len(self.sessions) >= MAX_SESSIONS_PER_CONNECTION:
            raise ProtocolError("bad_event", f"session: this connection already joined {MAX_SESSIONS_PER_CONNECTION} "
                                             f"sessions; open another connection for {session!r}", event_id)
        self.sessions.add(session)
        try:
            await self._join(self._group_prefix + session)
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
            self.group_outbox.push((self._group_prefix + session, frame))

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
