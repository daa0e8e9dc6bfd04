"""The /ws/events/ frames: validation of incoming frames, the frames sent back, session group names.

Channels-free and connection-free: ``execapp.connection`` holds one client's state and uses
these; ``execapp.consumers`` adapts that to Channels. The frame formats are documented in
docs/protocol.md, the error codes in ``execapp.codes``.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

from . import conf
from .codes import ERROR_CODES  # noqa: F401  (the codes of an error frame; importable from here)
from .engine import Event, ExecAppError, Failure, Reply
from .engine.event import Completion, Outcome
from .engine.json_depth import json_depth  # noqa: F401  (also importable from here)
from .engine.profile import ExecClass

MAX_ID_CHARS = 64
MAX_SESSION_CHARS = 64
MAX_TYPE_CHARS = 64
#: Session groups one connection may join; each costs a channel-layer membership.
MAX_SESSIONS_PER_CONNECTION = 32
FIELDS = ("id", "type", "session", "text", "data", "resend")
_FIELD_SET = frozenset(FIELDS)
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
    """The per-connection limits, read from settings once per connection (defaults: conf.DEFAULTS)."""

    max_frame_bytes: int = conf.DEFAULTS["MAX_FRAME_BYTES"]
    max_in_flight: int = conf.DEFAULTS["MAX_IN_FLIGHT_PER_CONNECTION"]
    max_depth: int = conf.DEFAULTS["MAX_FRAME_DEPTH"]

    @classmethod
    def from_settings(cls) -> "Limits":
        """Limits from EXECAPP['MAX_FRAME_BYTES'], ['MAX_IN_FLIGHT_PER_CONNECTION'] and ['MAX_FRAME_DEPTH']."""
        return cls(conf.get("MAX_FRAME_BYTES"), conf.get("MAX_IN_FLIGHT_PER_CONNECTION"), conf.get("MAX_FRAME_DEPTH"))


# -- incoming frames ------------------------------------------------------------------------------

def owner_digest(owner: str) -> str:
    """The short, group-name-safe form of an owner key (e.g. ``tenant:acme``, ``user:7``)."""
    return hashlib.sha256(owner.encode("utf-8", "surrogatepass")).hexdigest()[:OWNER_DIGEST_CHARS]


def tenant_id(owner: str) -> str:
    """The opaque id plugins see as an event's ``tenant`` (Event.tenant): the owner's digest, the
    same one its session groups are named by; "" for no owner."""
    return owner_digest(owner) if owner else ""


def group_name(owner: str, session: str) -> str:
    """The channel-layer group of one owner's session: the same name under two owners is two groups."""
    return f"{GROUP_PREFIX}{owner_digest(owner)}.{session}"


def session_of(group: str) -> str:
    """The session name of a group made by ``group_name`` ("" for any other group)."""
    if not group.startswith(GROUP_PREFIX):
        return ""
    return group[len(GROUP_PREFIX) + OWNER_DIGEST_CHARS + 1:]


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
    """Turn one WebSocket frame into an Event, or raise ProtocolError with the code to send back
    (``parse_request`` also returns the frame's ``resend`` flag)."""
    return parse_request(text, data, limits)[0]


def parse_request(text: str | None, data: bytes | None, limits: Limits, tenant: str = "") -> tuple[Event, bool]:
    """Turn one WebSocket frame into (Event, resend), or raise ProtocolError with the code to send back.

    Checked in order of cost, each before the decoder sees the text: size, Unicode, nesting
    depth (so ``json.loads`` can never recurse deep), then JSON, then the event's fields.
    ``resend``: the client asked for a safe resend of this id (docs/protocol.md, "Resending
    after a lost connection"). ``tenant``: the sender's opaque id (``tenant_id``), set by the
    server, never read from the frame (a frame naming a ``tenant`` is refused as an unknown field).
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
        # The decoder's C scanner directly (decode() adds two whitespace regex matches and a
        # frame); anything it does not take whole (whitespace around, an error) goes through
        # decode(), which raises with the exact position.
        try:
            obj, end = _scan(text, 0)
        except (StopIteration, ValueError):
            end = -1
        if end != chars:
            obj = _decode(text)
    except RecursionError:  # a limit configured near the interpreter's own: still refused, not raised
        raise _too_deep(limits) from None
    except ValueError as exc:
        raise ProtocolError("bad_json", f"frame is not valid JSON: {_json_problem(exc)}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_event", f"frame must be a JSON object like {{\"type\": \"message\", \"text\": "
                                         f"\"/ping\"}}, got a JSON {type(obj).__name__}")
    # JSON escapes can spell what UTF-8 cannot: a lone surrogate ("\ud800") in any string, keys
    # included. Refused here, so handlers and outgoing frames only ever see valid text.
    # "\ud"/"\uD" start every surrogate escape (\ud800-\udfff) and a few valid ones: checked, not refused.
    if "\\u" in text and ("\\ud" in text or "\\uD" in text):
        _check_unicode(obj)
    return _event_from(obj, chars, tenant)


def _json_problem(exc: ValueError) -> str:
    """What the decoder's ``exc`` says, in the client's terms. Python's own message for an integer
    past its conversion limit tells the reader to call sys.set_int_max_str_digits(): a fix on the
    server, not one a client can make."""
    text = str(exc)
    if "integer string conversion" in text:
        return (f"an integer has more than {sys.get_int_max_str_digits()} digits, more than the server reads; "
                "send it as a string")
    return text


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (Python's decoder accepts it, browsers' JSON.parse does not)")


def _finite(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf or -inf: the literal is past a double's range
        raise ValueError(f"the number {text[:24]}{'...' if len(text) > 24 else ''} is past the range of a double "
                         "(about 1.8e308): send a smaller number, or the value as a string")
    return value


# Strict JSON: NaN and Infinity would come back out in reply frames no browser can parse, and a
# literal past a double's range (1e999) is Infinity by another name.
_decoder = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)
_decode = _decoder.decode
_scan: Callable[[str, int], tuple[Any, int]] = _decoder.scan_once  # type: ignore[attr-defined]


def _too_deep(limits: Limits) -> ProtocolError:
    return ProtocolError("too_deep", f"frame nests arrays/objects more than {limits.max_depth} levels deep (the event "
                                     "object is level 1; EXECAPP['MAX_FRAME_DEPTH']); send flatter data")


def _check_unicode(obj: Any) -> None:
    """Raise bad_event naming the first string (or key) of ``obj`` that is not valid Unicode."""
    try:
        _encode(obj).encode()
        return
    except UnicodeEncodeError:
        pass
    path = _unicode_path(obj)
    eid = obj.get("id")
    eid = eid if isinstance(eid, str) and 0 < len(eid) <= MAX_ID_CHARS and _valid_unicode(eid) else None
    raise ProtocolError("bad_event", f"{_clip(path or 'frame')}: not valid Unicode (a lone UTF-16 surrogate escape "
                                     "such as \\ud800); escape whole characters (a surrogate pair) or send UTF-8",
                        eid)


#: What the search below descends into or checks; numbers, booleans and null cannot be invalid.
_TEXT_OR_NESTED = frozenset((str, dict, list))


def _unicode_path(obj: Any) -> str:
    """Where in ``obj`` the first string (or key) that is not valid Unicode is, e.g. ``data.a[1].b``
    (``data.<key>`` for a key); "" if none is.

    O(size of obj): each value is reached through a link to its parent, ``(parent link, key or
    index)``, and only the found one's path is written out. (Writing every value's path as it was
    reached cost O(size x path length): a 64 KB frame of long nested keys over a list of 16,000
    numbers made 500 MB of path strings, 0.3 s on the event loop.)
    """
    stack: list[tuple[Any, Any]] = [(None, obj)]
    while stack:
        link, value = stack.pop()
        if value.__class__ is str:
            if not _valid_unicode(value):
                return _path(link)
        elif value.__class__ is dict:
            for key, item in value.items():
                if not _valid_unicode(key):
                    return _path((link, None))
                if item.__class__ in _TEXT_OR_NESTED:
                    stack.append(((link, key), item))
        elif value.__class__ is list:
            stack.extend(((link, i), item) for i, item in enumerate(value) if item.__class__ in _TEXT_OR_NESTED)
    return ""


def _path(link: Any) -> str:
    """The text of a ``_unicode_path`` link: keys joined by dots, indexes in brackets, None as ``<key>``."""
    steps: list[Any] = []
    while link is not None:
        link, step = link
        steps.append(step)
    out = ""
    for step in reversed(steps):
        if step.__class__ is int:
            out += f"[{step}]"
        else:
            name = "<key>" if step is None else step
            out = f"{out}.{name}" if out else name
    return out


def _valid_unicode(text: str) -> bool:
    try:
        text.encode()
        return True
    except UnicodeEncodeError:
        return False


def _clip(text: str, limit: int = 40) -> str:
    """``text`` cut to ``limit`` characters for an error message (field names are client input)."""
    return text if len(text) <= limit else text[:limit] + "..."


def _event_from(obj: dict[str, Any], size: int | None = None, tenant: str = "") -> tuple[Event, bool]:
    eid = obj.get("id")
    if eid is not None and (not isinstance(eid, str) or not eid or len(eid) > MAX_ID_CHARS):
        raise ProtocolError("bad_event", f"id must be a non-empty string of at most {MAX_ID_CHARS} characters, "
                                         f"got {_show(eid)}; or leave it out and the server assigns one")
    if not _FIELD_SET.issuperset(obj):
        unknown = [k for k in obj if k not in FIELDS]
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
    resend = False
    if "resend" in obj:
        resend = obj["resend"]
        if resend is not True and resend is not False:
            raise ProtocolError("bad_event", f"resend must be true or false, got {_show(resend)}", eid)
        if resend and eid is None:
            raise ProtocolError("bad_event", "resend: true needs your own id (the id is what a resend is matched by); "
                                             "add \"id\": \"<unique id>\"")
    return Event(type=etype, text=text, data=data, id=eid, session=session, size=size, tenant=tenant), resend


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


def lagged_frame(missed: dict[str, int]) -> str:
    """The ``lagged`` frame: this member fell behind and ``missed`` session frames were dropped
    (per session), like tokio's broadcast ``Lagged(n)``; frames after it arrive again."""
    return _encode({"type": "lagged", "missed": sum(missed.values()), "sessions": missed})


def replay_frame(frame: dict[str, Any], session: str | None = None) -> str:
    """A recorded frame sent again to a resend (execapp.resend): marked ``"replay": true``."""
    if session is not None:
        frame["session"] = session
    frame["replay"] = True
    return _encode(frame)


def with_fields(frame: str, **fields: Any) -> str:
    """``frame`` (a JSON object's text) with ``fields`` added: the resend path's ``recorded`` and
    ``replay`` marks (never on the hot path)."""
    return _encode({**json.loads(frame), **fields})


# The two frames of nearly every event, written as text: the same bytes as ``_encode`` of the dict
# below (key order, separators, strings quoted by the encoder's own C function, floats by repr),
# without building the dict (checked against the general path in tests/execapp/test_protocol.py).
_quote = json.encoder.encode_basestring
_REPLY = '{"type":"reply","id":%s,"matcher":%s,"plugin":%s,"text":%s,"data":null,"exec":"%s","elapsed_ms":%s%s}'
_DONE = '{"type":"done","id":%s,"matched":%d,"replies":%d,"errors":%d,"blocked_by":%s,"elapsed_ms":%s%s}'
#: A reply's "exec" is written for these two by identity: an enum's ``.value`` is a Python-level property (~0.4 us).
_SYNC, _POOL = ExecClass.SYNC, ExecClass.POOL
#: Elapsed milliseconds written by ``_ms_text`` (beyond, or not finite: the general path).
_MAX_MS = 1e12


def _ms_text(ms: float) -> str:
    """``repr(round(ms, 3))`` for |ms| < _MAX_MS, the general path's bytes, at a third of its cost:
    both round the same way (correctly, to 3 decimals), and a decimal of at most 15 significant
    digits is its own shortest repr once its trailing zeros go (one is kept after the point)."""
    text = ("%.3f" % ms).rstrip("0")
    return text + "0" if text[-1] == "." else text


def outcome_frame(outcome: Outcome, session: str | None = None, hint: str | None = None) -> str:
    """The frame for one engine outcome: ``reply``, ``error`` (a failed handler) or ``done``
    (with ``hint`` when it matched nothing and something can say why, e.g. a disabled plugin)."""
    cls = outcome.__class__
    if cls is Reply:  # the common reply: text (or none) and no data
        o: Any = outcome
        text, plugin, ms, ec = o.text, o.plugin, o.elapsed * 1000, o.exec_class
        if o.data is None and (text is None or text.__class__ is str) and -_MAX_MS < ms < _MAX_MS:
            frame_text = _REPLY % (_quote(o.event_id), _quote(o.matcher), "null" if plugin is None else _quote(plugin),
                                   "null" if text is None else _quote(text),
                                   "sync" if ec is _SYNC else "pool" if ec is _POOL else ec.value, _ms_text(ms),
                                   "" if session is None else ',"session":' + _quote(session))
            if text is None or text.isascii():
                return frame_text
            return _valid_utf8(frame_text)
    elif cls is Completion and hint is None:
        o = outcome
        blocked, ms = o.blocked_by, o.elapsed * 1000
        if -_MAX_MS < ms < _MAX_MS:
            return _DONE % (_quote(o.event_id), o.matched, o.replies, len(o.errors),
                            "null" if blocked is None else _quote(blocked), _ms_text(ms),
                            "" if session is None else ',"session":' + _quote(session))
    return _outcome_frame(outcome, session, hint)


def _valid_utf8(text: str) -> str:
    """``text`` as the socket can send it: a handler's lone surrogate becomes U+FFFD."""
    try:
        text.encode()
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode()
    return text


def _outcome_frame(outcome: Outcome, session: str | None, hint: str | None) -> str:
    """``outcome_frame``'s general path: every field through the encoder."""
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
        if hint:
            frame["hint"] = hint
    if session is not None:
        frame["session"] = session
    try:
        text = _encode(frame)
    except (TypeError, ValueError):  # e.g. a circular structure, or NaN, in a handler's data
        frame["data"] = repr(frame.get("data"))[:1000]
        text = _encode(frame)
    except RecursionError:  # data nested past the interpreter's limit (plugins refuse it: MAX_REPLY_DEPTH)
        frame["data"] = "(the reply's data nests too deep to encode)"
        text = _encode(frame)
    if not text.isascii():  # a handler's lone surrogate: the socket could not send the frame at all
        text = _valid_utf8(text)
    return text
