"""Safe resend: an event sent with ``"resend": true`` runs at most once per (owner, id) while its
record is kept, and a resend after a lost connection is answered from that record.

The record is the event's trace in the event history (execapp/history.py): the history records
every event; for a resend event the connection makes that trace durable (the recorder flushes at
once and the trace is read back from the store) *before* it sends the ``done``, so a client that
received a ``done`` can always be answered from the record. What is kept here, per (owner, id)
in one key (Redis when ``REDIS_URL`` is set, else this process's memory), is where the event is:

- no key: it never ran here, or its record lapsed: a resend runs it (and claims the key);
- ``run <worker>``: a copy runs on ``<worker>``, which renews this lease every third of
  ``EXECAPP['RESEND_LEASE_SECONDS']`` (a thread of its own, so a busy loop cannot starve it): a
  resend gets ``resend_in_progress`` with the lease's remaining time. A killed worker stops
  renewing: its lease lapses and the next resend runs the event again (at-least-once for an
  event whose ``done`` never came);
- ``done <uid>``: it completed, its ``done`` was sent after the trace ``<uid>`` was durable; a
  resend gets that trace's replies, errors and ``done`` again, marked ``"replay": true``, for
  ``EXECAPP['RESEND_RETENTION_SECONDS']``. The trace itself lives as long as the history keeps
  it (the newest ``HISTORY_MAX_EVENTS``; failures also in the database): a resend whose key is
  there but whose trace is gone gets ``resend_expired`` and is not run again.

Keys are per owner (the history's ``pair_key``: a digest of the owner, then the id): no owner
can reach another's records. Without Redis a crash loses every record: that mode is
at-least-once only. See docs/protocol.md, "Resending after a lost connection".
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable, NamedTuple, Protocol

from . import conf, history
from .circuit import Circuit
from .engine.errors import ExecAppError
from .history_store import pair_key, store
from .redis_deadline import deadline_client, redis_deadline

log = logging.getLogger("execapp.resend")

#: Redis keys: conf.redis_key(KEY_PREFIX) + pair_key(owner, id).
KEY_PREFIX = "execapp:resend:"
#: Most records the in-process ledger keeps (without Redis); the oldest go first.
LOCAL_MAX_KEYS = 100_000
#: Most of them one owner may hold: past it that owner's own oldest go, never another owner's
#: (one tenant sending many distinct ids must not make other tenants' completed events run again).
LOCAL_MAX_KEYS_PER_OWNER = 10_000
#: Most records one owner may hold in the Redis ledger (~100 bytes each): past it that owner's
#: own oldest go, as in the in-process ledger, so one tenant's flood of distinct ids cannot grow
#: the Redis every worker (and the channel layer) shares without bound.
REDIS_MAX_KEYS_PER_OWNER = 100_000
NEW, RUNNING, DONE = "new", "running", "done"
#: How long the Redis ledger fails its calls at once after one found Redis unreachable (then one
#: call tries again): execapp/circuit.py.
CIRCUIT_OPEN_SECONDS = 1.0
#: All the Redis calls of one event's claim, and of its completion's record (the history's flush,
#: the trace read back, the ledger's ``done`` or release), end within EXECAPP[this] of its start:
#: each call was bounded, their sequence was not (~1 s a round trip: a `done` 10.3 s late).
DEADLINE_SETTING = "RESEND_DEADLINE_SECONDS"


class ResendError(ExecAppError):
    """A resend the server cannot serve now; sent as an ``error`` frame (no ``done`` follows)."""

    code = "resend_unavailable"

    def __init__(self, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.extra = extra


class Claim(NamedTuple):
    """Where one (owner, id) stands: ``new`` (claimed now: run it), ``running`` on ``worker``
    (``ttl`` seconds left of its lease) or ``done`` (its trace is ``uid``)."""

    state: str
    worker: str = ""
    uid: str = ""
    ttl: float = 0.0


def _parse(value: str | None, ttl_ms: int) -> Claim:
    if value is None:
        return Claim(NEW)
    kind, _, rest = value.partition(" ")
    if kind == "done":
        return Claim(DONE, uid=rest, ttl=max(0, ttl_ms) / 1000)
    return Claim(RUNNING, worker=rest, ttl=max(0, ttl_ms) / 1000)


class Ledger(Protocol):
    """Where each resend event stands (see the module docstring)."""

    name: str
    #: Fails the calls at once while the ledger's Redis is known down (None: nothing to fail).
    circuit: Circuit | None

    def claim(self, owner: str, event_id: str, worker: str, lease: float) -> Claim: ...

    def renew(self, pairs: list[tuple[str, str]], worker: str, lease: float) -> int: ...

    def done(self, owner: str, event_id: str, uid: str, retention: float) -> None: ...

    def release(self, owner: str, event_id: str, worker: str) -> None: ...


# Claim: an existing value wins (its remaining time too); otherwise this worker's lease, and the
# record joins its owner's share (KEYS[2], a sorted set scored by when the record may expire at
# the latest): past ARGV[3] records the owner's oldest are deleted. ARGV[4] is the retention. (A
# run that outlasts its first lease leaves the share that much before its record expires.)
_CLAIM = """
local v = redis.call('GET', KEYS[1])
if v then return {v, redis.call('PTTL', KEYS[1])} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local t = redis.call('TIME')
local now, life = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), tonumber(ARGV[4]) + tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZADD', KEYS[2], now + life, KEYS[1])
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if over > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], over)
  for i = 1, #old, 2 do redis.call('DEL', old[i]) end
end
redis.call('PEXPIRE', KEYS[2], life)
return false
"""
# Renew (or release, with ARGV[2] = 0) only the leases this worker still holds.
_RENEW = """
local n = 0
for _, k in ipairs(KEYS) do
  if redis.call('GET', k) == ARGV[1] then
    if ARGV[2] == '0' then redis.call('DEL', k) else redis.call('PEXPIRE', k, ARGV[2]) end
    n = n + 1
  end
end
return n
"""


class RedisLedger:
    """The ledger of every worker sharing ``REDIS_URL`` (it survives a worker's crash)."""

    name = "redis"

    def __init__(self, url: str) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # Short timeouts and no retries: a claim answers within ~2 s whatever Redis does, and the
        # client is told resend_unavailable rather than kept waiting; within claim's and
        # complete's redis_deadline every call shares their one deadline (RESEND_DEADLINE_SECONDS).
        self.client = deadline_client(url, socket_timeout=2, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))
        # ... and once one call found Redis unreachable, the calls queued behind it (on the event
        # loop's few executor threads) fail at once instead of waiting their 2 s each in turn.
        self._circuit = Circuit("the resend ledger's Redis", (redis.ConnectionError, redis.TimeoutError, OSError),
                                CIRCUIT_OPEN_SECONDS)
        self.circuit: Circuit | None = self._circuit
        self.prefix = conf.redis_key(KEY_PREFIX)
        self._claim = self.client.register_script(_CLAIM)
        self._renew = self.client.register_script(_RENEW)

    def _key(self, owner: str, event_id: str) -> str:
        return self.prefix + pair_key(owner, event_id)

    def claim(self, owner: str, event_id: str, worker: str, lease: float) -> Claim:
        share = self.prefix + "owner:" + pair_key(owner, "")
        retention = int(float(conf.get("RESEND_RETENTION_SECONDS")) * 1000)
        found = self._circuit.call(lambda: self._claim(
            keys=[self._key(owner, event_id), share],
            args=[f"run {worker}", int(lease * 1000), REDIS_MAX_KEYS_PER_OWNER, retention]))
        if not found:
            return Claim(NEW)
        value, ttl = found
        return _parse(value.decode() if isinstance(value, bytes) else value, int(ttl))

    def renew(self, pairs: list[tuple[str, str]], worker: str, lease: float) -> int:
        if not pairs:
            return 0
        return int(self._circuit.call(lambda: self._renew(keys=[self._key(o, i) for o, i in pairs],
                                                         args=[f"run {worker}", int(lease * 1000)])))

    def done(self, owner: str, event_id: str, uid: str, retention: float) -> None:
        self._circuit.call(lambda: self.client.set(self._key(owner, event_id), f"done {uid}", px=int(retention * 1000)))

    def release(self, owner: str, event_id: str, worker: str) -> None:
        self._circuit.call(lambda: self._renew(keys=[self._key(owner, event_id)], args=[f"run {worker}", 0]))


class LocalLedger:
    """The ledger of this process (no Redis): lost with the process, so at-least-once only."""

    name = "local"
    circuit: Circuit | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()  # claims come from executor threads, renewals from the renewer
        self._items: dict[str, tuple[str, float, str]] = {}  # key -> (value, expires at (monotonic), owner)
        self._owners: dict[str, dict[str, None]] = {}  # owner -> its keys, oldest first

    def _get(self, key: str, now: float) -> tuple[str, float, str] | None:
        item = self._items.get(key)
        if item is not None and item[1] <= now:
            self._drop(key)
            return None
        return item

    def _drop(self, key: str) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            keys = self._owners.get(item[2])
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._owners[item[2]]

    def _put(self, owner: str, key: str, value: str, expires: float) -> None:
        """Store ``key`` as the newest (the oldest-first trims keep the newest): within the owner's
        share first, then within the ledger's."""
        self._drop(key)
        self._items[key] = (value, expires, owner)
        keys = self._owners.setdefault(owner, {})
        keys[key] = None
        while len(keys) > LOCAL_MAX_KEYS_PER_OWNER:
            self._drop(next(iter(keys)))
        while len(self._items) > LOCAL_MAX_KEYS:
            self._drop(next(iter(self._items)))

    def claim(self, owner: str, event_id: str, worker: str, lease: float) -> Claim:
        key, now = pair_key(owner, event_id), time.monotonic()
        with self._lock:
            item = self._get(key, now)
            if item is not None:
                return _parse(item[0], int((item[1] - now) * 1000))
            self._put(owner, key, f"run {worker}", now + lease)
            return Claim(NEW)

    def renew(self, pairs: list[tuple[str, str]], worker: str, lease: float) -> int:
        now, n = time.monotonic(), 0
        with self._lock:
            for owner, event_id in pairs:
                key = pair_key(owner, event_id)
                item = self._get(key, now)
                if item is not None and item[0] == f"run {worker}":
                    self._items[key] = (item[0], now + lease, owner)
                    n += 1
        return n

    def done(self, owner: str, event_id: str, uid: str, retention: float) -> None:
        key = pair_key(owner, event_id)
        with self._lock:
            self._put(owner, key, f"done {uid}", time.monotonic() + retention)

    def release(self, owner: str, event_id: str, worker: str) -> None:
        key = pair_key(owner, event_id)
        with self._lock:
            item = self._items.get(key)
            if item is not None and item[0] == f"run {worker}":
                self._drop(key)


_local: LocalLedger | None = None
_redis: dict[str, RedisLedger] = {}
_ledger_lock = threading.Lock()


def ledger() -> Ledger:
    """The ledger the settings select: Redis when REDIS_URL is set, else this process's memory."""
    global _local
    url = conf.redis_url()
    with _ledger_lock:
        if not url:
            if _local is None:
                _local = LocalLedger()
            return _local
        key = f"{url} {conf.redis_key(KEY_PREFIX)}"
        if key not in _redis:
            _redis[key] = RedisLedger(url)
        return _redis[key]


class Renewer:
    """This process's running resend events: their leases renewed every third of the lease, on a
    daemon thread (a stalled event loop does not let them lapse; a dead process does)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[tuple[Ledger, str], set[tuple[str, str]]] = {}
        self._thread: threading.Thread | None = None

    def hold(self, store: Ledger, worker: str, owner: str, event_id: str) -> None:
        """Keep renewing the lease of (owner, id) until ``drop``."""
        with self._lock:
            self._running.setdefault((store, worker), set()).add((owner, event_id))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="execapp-resend-leases", daemon=True)
                self._thread.start()

    def drop(self, store: Ledger, worker: str, owner: str, event_id: str) -> None:
        """Stop renewing (owner, id): it completed (or its record failed and the lease was released)."""
        with self._lock:
            pairs = self._running.get((store, worker))
            if pairs is not None:
                pairs.discard((owner, event_id))
                if not pairs:
                    del self._running[(store, worker)]

    def running(self) -> int:
        """Leases held now."""
        with self._lock:
            return sum(len(p) for p in self._running.values())

    def _run(self) -> None:
        failing = False
        while True:
            lease = float(conf.get("RESEND_LEASE_SECONDS"))
            time.sleep(lease / 3)
            with self._lock:
                work = [(s, w, list(p)) for (s, w), p in self._running.items()]
            for store_, worker, pairs in work:
                try:
                    store_.renew(pairs, worker, lease)
                    if failing:
                        log.warning("renewing resend leases works again")
                    failing = False
                except Exception as exc:  # Redis down: a resend cannot be claimed meanwhile either
                    if not failing:
                        log.warning("renewing %d resend leases failed (retrying every %.1f s): %r", len(pairs),
                                    lease / 3, exc)
                    failing = True


renewer = Renewer()


# -- what the connection calls (on executor threads: every call may do I/O) -----------------------

def claim(owner: str, event_id: str, worker: str) -> tuple[Claim, list[str]]:
    """Claim (owner, id) for ``worker``: (claim, frames to replay). A ``new`` claim is held (its
    lease renewed) until ``complete``; ``done`` comes with the recorded frames.
    Raises ResendError (resend_in_progress, resend_expired, resend_unavailable) when the event is
    neither to be run nor answered from its record."""
    if history.current() is None or int(conf.get("HISTORY_MAX_EVENTS")) <= 0:
        raise ResendError("resend_unavailable", "resend needs the event history, which is off on this server "
                                                "(EXECAPP['HISTORY_MAX_EVENTS'] is 0, or its recorder is not "
                                                "running); send the event without \"resend\"")
    store_ = ledger()
    trace: dict[str, Any] | None = None
    with redis_deadline(setting=DEADLINE_SETTING):  # the claim and the record's read, together
        try:
            found = store_.claim(owner, event_id, worker, float(conf.get("RESEND_LEASE_SECONDS")))
        except Exception as exc:
            raise ResendError("resend_unavailable", f"the resend ledger ({store_.name}) cannot be reached now "
                                                    f"({type(exc).__name__}); retry in a few seconds") from exc
        if found.state == DONE:
            try:
                trace = _trace(found.uid, owner)
            except Exception as exc:
                raise ResendError("resend_unavailable", f"the record of event {event_id!r} cannot be read now "
                                                        f"({type(exc).__name__}); retry in a few seconds") from exc
    if found.state == NEW:
        renewer.hold(store_, worker, owner, event_id)
        return found, []
    if found.state == RUNNING:
        raise ResendError("resend_in_progress",
                          f"event {event_id!r} is still running on worker {found.worker} (its lease has "
                          f"{found.ttl:.1f} s left and is renewed while it runs); resend it after that: you get "
                          "its recorded outcome once it finished, or it runs again if its worker died",
                          retry_after_ms=max(100, int(found.ttl * 1000)))
    if trace is None:
        raise ResendError("resend_expired", f"event {event_id!r} completed (its done was sent) but its record is no "
                                            "longer kept (EXECAPP['HISTORY_MAX_EVENTS'] newest traces); it is not "
                                            "run again: use a new id to run it again")
    return found, replay_frames(trace)


def complete(owner: str, event_id: str, worker: str, elapsed: float) -> str:
    """The event completed: make its trace durable, then mark (owner, id) done; the trace's uid.
    Raises ResendError(resend_unavailable) when it could not be recorded (the lease is released:
    a resend then runs the event again). All its Redis calls end within RESEND_DEADLINE_SECONDS
    of its start, the release too (past it the lease lapses by itself, no longer renewed)."""
    store_ = ledger()
    renewer.drop(store_, worker, owner, event_id)
    with redis_deadline(setting=DEADLINE_SETTING):
        try:
            # Through the ledger's circuit: the trace lives in the same Redis, and a record whose Redis
            # is known down fails at once rather than after the history store's 5 s socket timeout.
            uid = (store_.circuit.call if store_.circuit is not None else _now)(
                lambda: _durable_trace(owner, event_id, worker, elapsed))
            store_.done(owner, event_id, uid, float(conf.get("RESEND_RETENTION_SECONDS")))
            return uid
        except Exception as exc:
            try:
                store_.release(owner, event_id, worker)
            except Exception:  # unreachable too (or past the deadline): the lease lapses by itself
                pass
            if isinstance(exc, ResendError):
                raise
            raise ResendError("resend_unavailable", f"the record could not be written ({type(exc).__name__}: {exc})"
                              ) from exc


def _now(fn: Callable[[], str]) -> str:
    return fn()


def _durable_trace(owner: str, event_id: str, worker: str, elapsed: float) -> str:
    """Flush the history's recorder now and read this run's trace back from its store: its uid."""
    recorder = history.current()
    if recorder is None:
        raise ResendError("resend_unavailable", "the event history stopped recording")
    recorder.flush(database=False)  # Redis only: a slow database must not hold the done
    body = store().get(owner, event_id)
    trace = json.loads(body) if body else None
    # The newest trace of the pair, by this worker, of this run (its duration is the done's, to the
    # microsecond the trace keeps).
    if trace is not None and _this_run(trace.get("worker"), trace.get("outcome"), trace.get("duration"), worker,
                                       elapsed):
        return str(trace["uid"])
    # A copy sent meanwhile may have been refused (resend_in_progress, an id already in flight):
    # its trace is then the pair's newest. Rare: look for this run among the pair's recent traces.
    for found in history.search(history.Filters(id=event_id, owner=owner), limit=RUN_SEARCH_LIMIT):
        if _this_run(found.worker, found.outcome, found.duration, worker, elapsed):
            return found.uid
    raise ResendError("resend_unavailable", "the history did not store this event's trace (its store failed or "
                                            "its buffer was full; see the worker's log)")


#: How many of a pair's newest traces the fallback above looks through for the run's own.
RUN_SEARCH_LIMIT = 20


def _this_run(trace_worker: Any, outcome: Any, duration: Any, worker: str, elapsed: float) -> bool:
    """A trace is this run's: by this worker, completed, with the done's duration (to the microsecond)."""
    return (trace_worker == str(worker) and outcome in ("ok", "error") and isinstance(duration, (int, float))
            and abs(duration - elapsed) <= 2e-6)


def _trace(uid: str, owner: str) -> dict[str, Any] | None:
    trace = history.detail(uid)
    if trace is None or trace.get("owner", "") != owner:  # the key is per owner; checked again anyway
        return None
    return trace


def replay_frames(trace: dict[str, Any]) -> list[str]:
    """The frames a resend gets from a completed event's trace: per handler (in the order they
    started) its replies and its error, then the ``done``; each marked ``"replay": true``."""
    from .protocol import replay_frame

    eid, session = trace["id"], trace.get("session")
    frames = []
    for h in trace.get("handlers") or []:
        common = {"id": eid, "matcher": h.get("matcher"), "plugin": h.get("plugin")}
        for text, data in h.get("replies") or []:
            frames.append(replay_frame({"type": "reply", **common, "text": text, "data": data, "exec": h.get("exec"),
                                        "elapsed_ms": round((h.get("duration") or 0.0) * 1000, 3)}, session))
        if h.get("code", "ok") != "ok":
            frames.append(replay_frame({"type": "error", "id": eid, "code": h["code"], "message": h.get("message", ""),
                                        "matcher": h.get("matcher"), "plugin": h.get("plugin"),
                                        "exec": h.get("exec")}, session))
    done = {"type": "done", "id": eid, "matched": trace.get("matched"), "replies": trace.get("replies"),
            "errors": trace.get("errors"), "blocked_by": trace.get("blocked_by"),
            "elapsed_ms": round((trace.get("duration") or 0.0) * 1000, 3), "recorded": True}
    if trace.get("replies_truncated"):
        done["truncated"] = True  # some replies were over HISTORY_REPLY_BYTES: not in the record
    frames.append(replay_frame(done, session))
    return frames
