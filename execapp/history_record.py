"""One event's trace as the stores keep it: a Record of Handler runs, and its dict and JSON forms.

Records are built on the housekeeping thread for every event (execapp.history) and the recent
store keeps up to 100,000 of them, so they are stored as *plain* tuples in the field order of
``Record`` and ``Handler`` below: the garbage collector stops tracking a plain tuple of plain
values, never a NamedTuple (100,000 tracked records made every full collection of the worker
walk them). ``view`` wraps one in its NamedTuple for readers. The JSON form is written by hand
for this one shape (the stdlib encoder on a dict costs several times more).
Readers get the JSON form, decoded: the admin, ``history.get`` (a resend answered from the
record) and the database's copy of a failure.
"""
from __future__ import annotations

import hashlib
from json import JSONEncoder
from json.encoder import encode_basestring
from typing import Any, NamedTuple

_encode_data = JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str, allow_nan=False).encode


class Handler(NamedTuple):
    """One handler of an event: ran (``exec`` sync/pool), or refused before it ran (``exec`` None)."""

    matcher: str
    plugin: str | None
    exec: str | None
    start: float | None  # seconds after the event was accepted
    wait: float | None  # pooled: seconds from acceptance to start (queue and pool-slot wait)
    duration: float
    code: str  # "ok" or the failure code
    message: str
    replies: tuple[tuple[str | None, Any], ...]  # (text, data), within HISTORY_REPLY_BYTES


class Record(NamedTuple):
    """One event's trace (docs/observability.md, "Event history")."""

    uid: str
    id: str
    owner: str
    session: str | None
    type: str
    text: str
    size: int
    worker: str
    ts: float  # wall-clock time it was accepted
    outcome: str  # "ok", "error", the code that refused it, or "incomplete"
    message: str  # a refusal's message
    codes: tuple[str, ...]
    duration: float | None
    matched: int | None
    replies: int | None
    errors: int
    blocked_by: str | None
    handlers: tuple[Handler, ...]
    replies_truncated: bool

    @property
    def matchers(self) -> tuple[str, ...]:
        return tuple(h[0] for h in self.handlers)

    @property
    def plugins(self) -> tuple[str, ...]:
        return tuple(sorted({h[1] for h in self.handlers if h[1]}))

    @property
    def key(self) -> str:
        return pair_key(self.owner, self.id)


#: Positions in a stored record (a plain tuple in Record's field order) and in its handlers.
UID, ID, OWNER, OUTCOME, HANDLERS = 0, 1, 2, 9, 17
H_MATCHER, H_PLUGIN, H_START, H_CODE, H_MESSAGE = 0, 1, 3, 6, 7


#: The common event (one handler that replied once, or not at all, with no failure) is stored
#: *flat*: Record's first 17 fields, then the handler's fields and its one reply, all plain
#: values: nothing nested, so the garbage collector stops tracking it at its first collection
#: and the store keeps it as it is (``expand`` rebuilds the Record).
FLAT_LEN = 27
_ATOMS = (str, int, float, bool, type(None))


def flat(uid: str, event_id: str, owner: str, session: str | None, type_: str, text: str, size: int, worker: str,
         ts: float, duration: float, matched: int, replies: int, blocked_by: str | None, matcher: str,
         plugin: str | None, exec_: str, start: float, wait: float | None, elapsed: float, reply_text: str | None,
         reply_data: Any, kept: bool, truncated: bool | None = None) -> tuple:
    """A stored flat record (see FLAT_LEN): outcome ok, no codes, one handler ``ok``, its reply
    (``kept`` False: none kept; ``truncated``, by default ``not kept``: left out, over
    HISTORY_REPLY_BYTES; a handler that did not reply: both False). ``reply_data`` must be a plain
    value. (The recorder's flush builds this same tuple inline, without a call per event: keep both in step.)"""
    return (uid, event_id, owner, session, type_, text, size, worker, ts, "ok", "", (), duration, matched, replies,
            0, blocked_by, matcher, plugin, exec_, start, wait, elapsed, reply_text, reply_data, kept,
            not kept if truncated is None else truncated)


def is_plain(value: Any) -> bool:
    """True for a value a flat record may hold (str, number, bool, None)."""
    return value.__class__ in _ATOMS


def expand(stored: tuple) -> tuple:
    """A stored record in Record's field order (a flat one rebuilt with its one handler)."""
    if len(stored) != FLAT_LEN:
        return stored
    *head, matcher, plugin, exec_, start, wait, elapsed, text, data, kept, truncated = stored
    replies = ((text, data),) if kept else ()
    return (*head, ((matcher, plugin, exec_, start, wait, elapsed, "ok", "", replies),), truncated)


def view(stored: tuple) -> Record:
    """A stored record (a plain tuple) as a Record, to read it by field name."""
    return stored if isinstance(stored, Record) else tuple.__new__(Record, expand(stored))


def key_of(stored: tuple) -> str:
    """The (owner, event id) key of a stored record."""
    return pair_key(stored[OWNER], stored[ID])


_digests: dict[str, str] = {}


def owner_key(owner: str) -> str:
    """The owner's part of its pair keys (a digest: no ':' in it)."""
    digest = _digests.get(owner)
    if digest is None:
        digest = hashlib.blake2b(owner.encode(), digest_size=8).hexdigest()
        if len(_digests) < 10_000:  # owners are few (tenants, staff users): a bounded cache
            _digests[owner] = digest
    return digest


def pair_key(owner: str, event_id: str) -> str:
    """The key of (owner, event id): an owner's ids never meet another owner's."""
    return owner_key(owner) + ":" + event_id


def _s(value: str | None) -> str:
    return "null" if value is None else encode_basestring(value)


def _f(value: float | None) -> str:
    return "null" if value is None else "%.6f" % value


def to_json_data(value: Any) -> str:
    """A reply's data as JSON; what JSON cannot hold (an object, a circular structure, NaN) as the
    JSON string of its repr."""
    if value is None:
        return "null"
    try:
        return _encode_data(value)
    except (TypeError, ValueError):
        return encode_basestring(repr(value)[:1000])


_data = to_json_data


def to_json(stored: tuple) -> str:
    """A record (stored or a Record) as JSON: an object with the Record's fields (times to the
    microsecond; handlers as objects with the Handler's fields; replies as [text, data] pairs)."""
    r = expand(stored)
    handlers = ",".join(
        '{"matcher":%s,"plugin":%s,"exec":%s,"start":%s,"wait":%s,"duration":%s,"code":%s,"message":%s,"replies":[%s]}'
        % (_s(h[0]), _s(h[1]), _s(h[2]), _f(h[3]), _f(h[4]), _f(h[5]), _s(h[6]), _s(h[7]),
           ",".join("[%s,%s]" % (_s(t), _data(d)) for t, d in h[8]))
        for h in r[17])
    return ('{"uid":%s,"id":%s,"owner":%s,"session":%s,"type":%s,"text":%s,"size":%d,"worker":%s,"ts":%s,'
            '"outcome":%s,"message":%s,"codes":[%s],"duration":%s,"matched":%s,"replies":%s,"errors":%d,'
            '"blocked_by":%s,"handlers":[%s],"replies_truncated":%s}') % (
        _s(r[0]), _s(r[1]), _s(r[2]), _s(r[3]), _s(r[4]), _s(r[5]), r[6], _s(r[7]), _f(r[8]), _s(r[9]), _s(r[10]),
        ",".join(map(_s, r[11])), _f(r[12]), "null" if r[13] is None else "%d" % r[13],
        "null" if r[14] is None else "%d" % r[14], r[15], _s(r[16]), handlers, "true" if r[18] else "false")
