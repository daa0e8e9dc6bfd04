"""Where event traces are kept: a bounded recent store, in Redis or in this process's memory.

Redis when ``settings.REDIS_URL`` is set, so the traces of every worker of a deployment are in
one place: each trace is a *summary* (the fields the Events page filters on, one line of a list)
and a *body* (the whole trace as JSON). This process's memory otherwise: the Records themselves
(nothing is serialized until someone reads one). Both keep ``EXECAPP['HISTORY_MAX_EVENTS']``
traces, within ``EXECAPP['HISTORY_LOCAL_MAX_BYTES']`` (local) or ``EXECAPP['HISTORY_REDIS_MAX_BYTES']``
(Redis) bytes, count what they evict (``usage``), and find a trace by its uid or by (owner, event
id) (the newest of that pair). Past their size the oldest trace *of the owner holding the most*
goes (``fair_cuts``; past the bytes, of the owner holding the most bytes): one tenant's flood
displaces its own traces, never the share of another, whose records a resend is answered from.
The database keeps the
failures longer (execapp.history, ``EventTrace``).
"""
from __future__ import annotations

import collections
import json
import marshal
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Protocol, Union, cast

from . import conf
from .history_record import (
    FLAT_LEN,
    HANDLERS,
    ID,
    OWNER,
    UID,
    Record,
    expand,
    key_of,
    owner_key,
    pair_key,
    to_json,
    to_json_data,
    view,
)

#: Redis keys: conf.redis_key(KEY_PREFIX) + "log" (the summaries, newest first), + "r:<uid>" (the
#: bodies), + "k:<owner digest>:<event id>" (the uid of the newest trace of that pair), + "o:<owner
#: digest>" (that owner's traces, newest first), + "owners" (a ZSET: traces held per owner digest)
#: and + "n" (traces held).
KEY_PREFIX = "execapp:history:"
#: Lists inside a summary line (matchers, plugins, codes) are joined with this (never in a name).
LIST_SEP = "\x1f"
#: Summaries read from Redis per round trip while scanning.
SCAN_CHUNK = 2000
#: What one trace costs the local store besides its strings (its tuple, uid, key, index entries).
RECORD_BYTES = 1000


class Summary(NamedTuple):
    """The filterable fields of one trace (one line of the store's log)."""

    uid: str
    key: str  # owner digest ":" event id (see pair_key)
    ts: float  # wall-clock time the event was accepted
    id: str
    owner: str
    session: str
    type: str
    outcome: str  # "ok", "error" (a handler failed), a refusal code, or "incomplete"
    codes: tuple[str, ...]  # the failure codes of its handlers
    matchers: tuple[str, ...]
    plugins: tuple[str, ...]
    worker: str
    duration: float | None

    def to_line(self) -> str:
        """The summary as one tab-separated line (tabs and newlines in values become spaces)."""
        return "\t".join((
            self.uid, self.key, repr(self.ts), _clean(self.id), _clean(self.owner), _clean(self.session),
            _clean(self.type), self.outcome, LIST_SEP.join(self.codes), LIST_SEP.join(map(_clean, self.matchers)),
            LIST_SEP.join(map(_clean, self.plugins)), _clean(self.worker),
            "" if self.duration is None else repr(self.duration)))

    @classmethod
    def from_line(cls, line: str | bytes) -> "Summary | None":
        """Parse a line written by ``to_line``; None for a line of another shape (another version)."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", "replace")
        f = line.split("\t")
        if len(f) != len(cls._fields):
            return None
        try:
            return cls(f[0], f[1], float(f[2]), f[3], f[4], f[5], f[6], f[7], _split(f[8]), _split(f[9]),
                       _split(f[10]), f[11], float(f[12]) if f[12] else None)
        except ValueError:
            return None

    def as_dict(self) -> dict[str, Any]:
        """The summary for templates and JSON."""
        return {**self._asdict(), "failed": self.outcome != "ok"}

    @classmethod
    def of(cls, stored: "Record | Summary | tuple") -> "Summary":
        """The summary of a record (a summary is its own)."""
        if isinstance(stored, Summary):
            return stored
        r = view(stored)
        return cls(r.uid, r.key, r.ts, r.id, r.owner, r.session or "", r.type, r.outcome, r.codes, r.matchers,
                   r.plugins, r.worker, r.duration)


def _clean(value: str) -> str:
    return value.replace("\t", " ").replace("\n", " ").replace(LIST_SEP, " ") if value else ""


def _split(value: str) -> tuple[str, ...]:
    return tuple(value.split(LIST_SEP)) if value else ()


@dataclass(frozen=True)
class Filters:
    """What the Events page asks for; an empty field matches everything.

    ``outcome``: ``ok``, ``failed`` (anything else), or one code (a refusal, or a handler's
    failure code such as ``timeout``). ``since``/``until``: wall-clock seconds (inclusive,
    exclusive). ``before`` and ``before_uid``: the paging cursor, the last row shown: only traces
    after it in (ts, uid) order, newest first, so traces sharing the cursor's ts are not skipped
    (``before`` alone: strictly older).
    """

    plugin: str = ""
    matcher: str = ""
    outcome: str = ""
    session: str = ""
    owner: str = ""
    id: str = ""
    since: float | None = None
    until: float | None = None
    before: float | None = None
    before_uid: str = ""

    def match(self, s: "Summary | Record") -> bool:
        """True when the summary (or the record) passes every filter."""
        before = self.before
        if before is not None and (s.ts > before or s.ts == before and (not self.before_uid
                                                                         or s.uid >= self.before_uid)):
            return False
        if self.until is not None and s.ts >= self.until:
            return False
        if self.since is not None and s.ts < self.since:
            return False
        if self.id and s.id != self.id:
            return False
        if self.owner and s.owner != self.owner:
            return False
        if self.session and (s.session or "") != self.session:
            return False
        if self.plugin and self.plugin not in s.plugins:
            return False
        if self.matcher and self.matcher not in s.matchers:
            return False
        if self.outcome:
            if self.outcome == "failed":
                return s.outcome != "ok"
            return s.outcome == self.outcome or self.outcome in s.codes
        return True

    @property
    def wants_failures_only(self) -> bool:
        """True when no successful event can match (the database holds failures only)."""
        return bool(self.outcome) and self.outcome != "ok"


#: What a store's scan yields: filterable by Filters.match, made a Summary by Summary.of.
Scanned = Union[Summary, Record]


class Store(Protocol):
    """A bounded store of recent traces (see the module docstring)."""

    name: str

    def add(self, records: list[tuple]) -> None: ...

    def scan(self) -> Iterator[Scanned]: ...

    def body(self, uid: str) -> str | None: ...

    def get(self, owner: str, event_id: str) -> str | None: ...

    def count(self) -> int: ...

    def usage(self) -> "Usage": ...


def fair_cuts(held: dict[str, int], k: int) -> dict[str, int]:
    """How many of each owner's traces go when ``k`` must: the recent stores' fairness rule.

    The store takes from the owner holding the most, one trace at a time, so the owners above
    a level come down to it (water-filling): one owner's flood only ever displaces its own traces
    while anyone else holds fewer, and every owner keeps at least its fair share (the store's
    size over the owners in it), and with it the records a resend is answered from. Computed
    once per flush: O(owners log owners), not a step per trace.
    """
    ranked = sorted(((n, owner) for owner, n in held.items()), reverse=True)
    total = 0
    for j, (n, _) in enumerate(ranked):
        total += n
        below = ranked[j + 1][0] if j + 1 < len(ranked) else 0
        if total - (j + 1) * below >= k:
            # The top j + 1 keep total - k between them, as evenly as counts allow.
            each, extra = divmod(max(total - k, 0), j + 1)
            return {owner: n - each - (i < extra) for i, (n, owner) in enumerate(ranked[:j + 1])}
    return {owner: n for owner, n in held.items()}


class Usage(NamedTuple):
    """What a store holds and what it evicted: traces past ``max_events`` (``by_count``) and past
    its byte bound (``by_bytes``), each with the wall-clock time of the last such eviction."""

    traces: int
    bytes: int
    max_events: int
    max_bytes: int
    by_count: int = 0
    by_count_ts: float | None = None
    by_bytes: int = 0
    by_bytes_ts: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """For templates and JSON."""
        return self._asdict()


class LocalStore:
    """The newest ``max_events`` traces of this process (the embedded single-process default),
    trimmed by the fairness rule of ``fair_cuts``.

    Records hold plain values only (the common event's flat record, one without handlers) or are
    kept marshalled (bytes), beside their uid and key in a flat tuple: the garbage collector
    tracks none of these, so 100,000 records add nothing to a collection of the worker (a tuple
    of tuples stays tracked for several full collections, one nesting level each)."""

    name = "local"

    def __init__(self, max_events: int, max_bytes: int | None = None) -> None:
        self.max_events = max_events
        #: About how many bytes the traces may take (each: RECORD_BYTES and its strings, or its
        #: marshalled bytes); past it traces go as past ``max_events``.
        self.max_bytes = int(conf.DEFAULTS["HISTORY_LOCAL_MAX_BYTES"]) if max_bytes is None else max_bytes
        self.bytes = 0
        #: Traces evicted past max_events and past max_bytes, and when the last of each went.
        self.evicted = {"count": 0, "bytes": 0}
        self.evicted_ts: dict[str, float] = {}
        self._lock = threading.Lock()  # the housekeeper adds, admin requests read
        # uid -> (key, record, its bytes): oldest first (a dict keeps insertion order and, unlike
        # a deque, lets the fairness rule take a trace out of the middle in O(1)).
        self._items: dict[str, tuple[str, tuple | bytes, int]] = {}
        self._by_owner: dict[str, collections.deque[str]] = {}  # owner -> its uids, oldest first
        self._by_key: dict[str, tuple | bytes] = {}  # pair key -> its newest trace

    def add(self, records: list[tuple]) -> None:
        if self.max_events <= 0:
            return
        with self._lock:
            items, by_key, by_owner = self._items, self._by_key, self._by_owner
            for r in records:
                uid, owner = r[UID], r[OWNER]
                if uid in items:  # (uids are unique; a repeat would break the counts)
                    continue
                # A record with nested handler tuples is marshalled; a flat one (the common event)
                # and one without handlers hold plain values only and are kept as they are.
                item = r if (len(r) == FLAT_LEN or not r[HANDLERS]) else _pack(r)
                key = pair_key(owner, r[ID])
                size = RECORD_BYTES + (len(item) if item.__class__ is bytes else
                                       sum(len(v) for v in item if v.__class__ is str))
                items[uid] = (key, item, size)
                self.bytes += size
                by_key[key] = item
                owned = by_owner.get(owner)
                if owned is None:
                    owned = by_owner[owner] = collections.deque()
                owned.append(uid)
            over = len(items) - self.max_events
            while over > 0 or (items and self.bytes > self.max_bytes):
                reason = "count"
                if over <= 0:  # past the bytes: about as many as the excess is traces, of the average size
                    over = max(1, (self.bytes - self.max_bytes) * len(items) // self.bytes)
                    reason = "bytes"
                before = len(items)
                for owner, cut in fair_cuts({o: len(d) for o, d in by_owner.items()}, over).items():
                    self._cut(owner, cut)
                self.evicted[reason] += before - len(items)
                self.evicted_ts[reason] = time.time()
                over = len(items) - self.max_events

    def _cut(self, owner: str, n: int) -> None:
        """Forget ``owner``'s ``n`` oldest traces (the lock held)."""
        owned, items, by_key = self._by_owner[owner], self._items, self._by_key
        for _ in range(n):
            key, item, size = items.pop(owned.popleft())
            self.bytes -= size
            if by_key.get(key) is item:
                del by_key[key]
        if not owned:
            del self._by_owner[owner]

    def scan(self) -> Iterator[Scanned]:
        with self._lock:
            stored = [item for _, item, _ in self._items.values()]
        return (view(_unpack(item)) for item in reversed(stored))

    def body(self, uid: str) -> str | None:
        """The trace with this uid as JSON (made now: the store keeps records), or None."""
        item = self._item(uid)
        return None if item is None else to_json(_unpack(item))

    def get(self, owner: str, event_id: str) -> str | None:
        """The newest trace of (owner, event id) as JSON, or None."""
        with self._lock:
            item = self._by_key.get(pair_key(owner, event_id))
        return None if item is None else to_json(_unpack(item))

    def record(self, uid: str) -> Record | None:
        """The Record with this uid (this process's traces only), or None."""
        item = self._item(uid)
        return None if item is None else view(_unpack(item))

    def _item(self, uid: str) -> tuple | bytes | None:
        with self._lock:
            kept = self._items.get(uid)
        return None if kept is None else kept[1]

    def count(self) -> int:
        with self._lock:
            return len(self._items)

    def held(self, owner: str) -> int:
        """How many traces ``owner`` holds here."""
        with self._lock:
            return len(self._by_owner.get(owner, ()))

    def usage(self) -> Usage:
        """Traces and bytes held, and what was evicted to stay within the bounds."""
        with self._lock:
            return Usage(len(self._items), self.bytes, self.max_events, self.max_bytes,
                         self.evicted["count"], self.evicted_ts.get("count"),
                         self.evicted["bytes"], self.evicted_ts.get("bytes"))

    def clear(self) -> None:
        """Forget every trace (tests)."""
        with self._lock:
            self._items.clear()
            self.bytes = 0
            self._by_owner.clear()
            self._by_key.clear()


def _unpack(item: tuple | bytes) -> tuple:
    return marshal.loads(item) if isinstance(item, bytes) else item


def _pack(r: tuple) -> bytes:
    """A record as bytes (marshal: this process writes and reads them back, nothing else does).
    A reply's data marshal cannot write (an object of a class) is kept as its JSON text."""
    try:
        return marshal.dumps(r)
    except ValueError:
        r = expand(r)
        handlers = tuple(h[:8] + (tuple((t, json.loads(to_json_data(d))) for t, d in h[8]),) for h in r[HANDLERS])
        return marshal.dumps(r[:HANDLERS] + (handlers,) + r[HANDLERS + 1:])


# One script per flush: the bodies, the (owner, id) pointers and the summaries go in together,
# each trace's uid at the head of its owner's list, and past ``max`` traces the oldest of the
# owner holding the most (fair_cuts' rule: ZSET "owners", owner digest -> traces held) is deleted:
# its body, and its pointer unless a newer trace of the same pair took it over. Past ``maxb``
# bytes (a trace costs its body's length and TRACE_OVERHEAD_BYTES) the oldest of the owner
# holding the most *bytes* goes the same way (ZSET "ob"): one tenant's large traces displace its
# own, and the total stays bounded whatever the traces weigh. Evictions are counted in the hash
# "evicted" (by reason: "count", "bytes", and when the last happened) for the Events page and the
# dashboard. The log of summaries (what the Events page lists) keeps the newest ``max`` lines
# whoever sent them. Atomic, so workers flushing at once never leak. A store written before the
# owners' lists existed (no "n") has them made from its log once, oldest first; one written
# before the byte bound (no "b") has its bytes counted from its bodies once.
_ADD_SCRIPT = """
local log, max, p, maxb, now = KEYS[1], tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), ARGV[4]
local overhead = tonumber(ARGV[5])
local owners, count, ob, bcount, ev = p .. 'owners', p .. 'n', p .. 'ob', p .. 'b', p .. 'evicted'
local function cost(uid)
  return redis.call('STRLEN', p .. 'r:' .. uid) + overhead
end
local function hold(uid, k)
  local o = string.sub(k, 1, (string.find(k, ':', 1, true) or 1) - 1)
  redis.call('LPUSH', p .. 'o:' .. o, uid .. '\t' .. k)
  redis.call('ZINCRBY', owners, 1, o)
  return o
end
local n = tonumber(redis.call('GET', count) or '-1')
if n < 0 then
  n = 0
  local old = redis.call('LRANGE', log, 0, -1)
  for j = #old, 1, -1 do
    local s = old[j]
    local t1 = string.find(s, '\t', 1, true)
    local t2 = t1 and string.find(s, '\t', t1 + 1, true)
    if t2 and redis.call('EXISTS', p .. 'r:' .. string.sub(s, 1, t1 - 1)) == 1 then
      hold(string.sub(s, 1, t1 - 1), string.sub(s, t1 + 1, t2 - 1))
      n = n + 1
    end
  end
end
local b = tonumber(redis.call('GET', bcount) or '-1')
if b < 0 then
  b = 0
  redis.call('DEL', ob)
  for _, o in ipairs(redis.call('ZRANGE', owners, 0, -1)) do
    for _, e in ipairs(redis.call('LRANGE', p .. 'o:' .. o, 0, -1)) do
      local c = cost(string.sub(e, 1, (string.find(e, '\t', 1, true) or 1) - 1))
      redis.call('ZINCRBY', ob, c, o)
      b = b + c
    end
  end
end
for i = 6, #ARGV, 4 do
  redis.call('SET', p .. 'r:' .. ARGV[i], ARGV[i + 3])
  redis.call('SET', p .. 'k:' .. ARGV[i + 1], ARGV[i])
  redis.call('LPUSH', log, ARGV[i + 2])
  local c = string.len(ARGV[i + 3]) + overhead
  redis.call('ZINCRBY', ob, c, hold(ARGV[i], ARGV[i + 1]))
  n = n + 1
  b = b + c
end
redis.call('LTRIM', log, 0, max - 1)
local by_count, by_bytes = 0, 0
while n > 0 and (n > max or b > maxb) do
  local over_count = n > max
  local o = redis.call('ZREVRANGE', over_count and owners or ob, 0, 0)[1]
  if not o then break end
  local e = redis.call('RPOP', p .. 'o:' .. o)
  if not e then
    redis.call('ZREM', owners, o)
    redis.call('ZREM', ob, o)
  else
    local t = string.find(e, '\t', 1, true)
    local uid, k = string.sub(e, 1, t - 1), string.sub(e, t + 1)
    local c = cost(uid)
    if redis.call('ZINCRBY', owners, -1, o) + 0 <= 0 then redis.call('ZREM', owners, o) end
    if redis.call('ZINCRBY', ob, -c, o) + 0 <= 0 then redis.call('ZREM', ob, o) end
    n = n - 1
    b = b - c
    redis.call('DEL', p .. 'r:' .. uid)
    if redis.call('GET', p .. 'k:' .. k) == uid then redis.call('DEL', p .. 'k:' .. k) end
    if over_count then by_count = by_count + 1 else by_bytes = by_bytes + 1 end
  end
end
if n <= 0 then b = 0 end
if by_count > 0 then
  redis.call('HINCRBY', ev, 'count', by_count)
  redis.call('HSET', ev, 'count_ts', now)
end
if by_bytes > 0 then
  redis.call('HINCRBY', ev, 'bytes', by_bytes)
  redis.call('HSET', ev, 'bytes_ts', now)
end
redis.call('SET', count, n)
redis.call('SET', bcount, b)
return n
"""

#: What one trace costs the Redis store besides its body: its summary line, pointer, list entries.
TRACE_OVERHEAD_BYTES = 400


def _encodable(body: str) -> str:
    """``body`` (a trace's JSON) as text UTF-8 can carry: a plugin's reply or error may hold a lone
    surrogate (JavaScript's ``"\\ud800"``), which the Redis client cannot encode; it failed the
    whole flush. Escaped instead, it reads back as it was kept (as in the in-process store)."""
    if not body.isascii():
        try:
            body.encode()
        except UnicodeEncodeError:
            return json.dumps(json.loads(body))  # ensure_ascii: every non-ASCII character escaped
    return body


class RedisStore:
    """The newest ``max_events`` traces of every worker sharing ``REDIS_URL`` (see KEY_PREFIX)."""

    name = "redis"

    def __init__(self, url: str, max_events: int, max_bytes: int | None = None) -> None:
        from .redis_deadline import deadline_client

        self.max_events = max_events
        #: The bytes the traces may take (bodies and TRACE_OVERHEAD_BYTES each); past it the oldest
        #: of the owner holding the most bytes go.
        self.max_bytes = int(conf.DEFAULTS["HISTORY_REDIS_MAX_BYTES"]) if max_bytes is None else max_bytes
        # Within an Events page's redis_deadline, its calls share the request's deadline.
        self.client = deadline_client(url, socket_timeout=5, socket_connect_timeout=2)
        self.prefix = conf.redis_key(KEY_PREFIX)
        self.log_key = self.prefix + "log"
        self._add = self.client.register_script(_ADD_SCRIPT)

    def add(self, records: list[tuple]) -> None:
        if self.max_events <= 0 or not records:
            return
        args: list[Any] = [self.max_events, self.prefix, self.max_bytes, repr(time.time()), TRACE_OVERHEAD_BYTES]
        for r in records:
            args += [r[UID], key_of(r), Summary.of(r).to_line(), _encodable(to_json(r))]
        self._add(keys=[self.log_key], args=args)

    def scan(self) -> Iterator[Scanned]:
        start = 0
        while True:
            lines = self.client.lrange(self.log_key, start, start + SCAN_CHUNK - 1)
            for line in lines:
                summary = Summary.from_line(line)
                if summary is not None:
                    yield summary
            if len(lines) < SCAN_CHUNK:
                return
            start += SCAN_CHUNK

    def body(self, uid: str) -> str | None:
        """The stored JSON of the trace with this uid, or None."""
        raw = self.client.get(self.prefix + "r:" + uid)
        return None if raw is None else cast(bytes, raw).decode()  # the client returns bytes

    def get(self, owner: str, event_id: str) -> str | None:
        """The newest trace of (owner, event id) as JSON, or None."""
        uid = self.client.get(self.prefix + "k:" + pair_key(owner, event_id))
        return None if uid is None else self.body(cast(bytes, uid).decode())

    def count(self) -> int:
        held = self.client.get(self.prefix + "n")
        return int(self.client.llen(self.log_key) if held is None else cast(bytes, held))

    def held(self, owner: str) -> int:
        """How many traces ``owner`` holds here."""
        return int(self.client.zscore(self.prefix + "owners", owner_key(owner)) or 0)

    def usage(self) -> Usage:
        """Traces and bytes held, and what was evicted to stay within the bounds."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.prefix + "n")
        pipe.get(self.prefix + "b")
        pipe.hgetall(self.prefix + "evicted")
        held, size, evicted = pipe.execute()
        ev = {k.decode(): v.decode() for k, v in cast(dict, evicted).items()}
        return Usage(int(held or 0), int(size or 0), self.max_events, self.max_bytes,
                     int(ev.get("count", 0)), _ts(ev.get("count_ts")), int(ev.get("bytes", 0)), _ts(ev.get("bytes_ts")))


def _ts(raw: str | None) -> float | None:
    return float(raw) if raw else None


_local: LocalStore | None = None
_redis: dict[tuple[str, str, int, int], RedisStore] = {}
_lock = threading.Lock()


def store() -> Store:
    """The store the settings select: Redis when REDIS_URL is set, else this process's memory."""
    global _local
    url, max_events = conf.redis_url(), int(conf.get("HISTORY_MAX_EVENTS"))
    with _lock:
        if not url:
            max_bytes = int(conf.get("HISTORY_LOCAL_MAX_BYTES"))
            if _local is None or _local.max_events != max_events or _local.max_bytes != max_bytes:
                _local = LocalStore(max_events, max_bytes)
            return _local
        max_redis_bytes = int(conf.get("HISTORY_REDIS_MAX_BYTES"))
        rkey = (url, conf.redis_key(KEY_PREFIX), max_events, max_redis_bytes)
        if rkey not in _redis:
            _redis[rkey] = RedisStore(url, max_events, max_redis_bytes)
        return _redis[rkey]


def reset_local() -> None:
    """Forget this process's local store (tests)."""
    global _local
    with _lock:
        _local = None
