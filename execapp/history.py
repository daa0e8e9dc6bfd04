"""Event history: every event's trace, recorded off the hot path, and how to find it again.

A trace is one event as an operator asks about it: its id, session, token owner, type, the
first ``HISTORY_TEXT_CHARS`` of its text, each handler that ran or was refused (matcher,
plugin, exec class, start, queue wait, duration, outcome code and message, replies up to
``HISTORY_REPLY_BYTES``), the worker, the times and the outcome. See docs/observability.md.

Recording is batched: the connection calls ``accepted``, ``delivered`` and ``refused`` on the
event loop and the engine calls this module's run observer after every handler run; they keep
each event in flight as one list and its done appends one tuple to one bounded buffer (a deque:
``append``/``popleft`` are atomic, so the loop and the pool threads need no lock). The
``Recorder`` (a worker service on the housekeeping thread) turns those tuples into traces every
``HISTORY_FLUSH_SECONDS``, adds them to the recent store (``execapp.history_store``), writes the
failures to the database (``EventTrace``, kept ``HISTORY_FAILURE_DAYS``) and counts failures by
matcher, plugin and code for the dashboard and /metrics. Without a running Recorder the hooks
return at once.

Readers: ``get(owner, event_id)`` (the newest trace of that pair: a resend can be answered from
its recorded replies and outcome), ``search(filters)`` and ``detail(uid)`` (the admin's Events page).
"""
from __future__ import annotations

import collections
import datetime as dt
import itertools
import json
import logging
import secrets
import threading
import time
from typing import Any, Iterable

from django.db import OperationalError, close_old_connections, connections

from . import conf
from .db_deadline import statement_deadline
from .dbtext import clean_json, clean_text
from .engine.event import Completion, Event, Failure, Reply
from .engine.pool import count_value
from .engine.profile import ExecClass
from .engine.ratelog import RateLimitedLog
from .history_query import DB_LOCKED_RETRY_SECONDS, cutoff, detail, get, prune, prune_owners, search
from .history_record import (
    H_CODE,
    H_MATCHER,
    H_MESSAGE,
    H_PLUGIN,
    H_START,
    OUTCOME,
    Record,
    to_json,
    view,
)
from .history_store import Filters, Summary, store
from .redis_deadline import redis_deadline
from .seams import WorkerLike

log = logging.getLogger("execapp.history")
_rare = RateLimitedLog(log, 60.0)

#: Most items the buffer holds between two flushes; past it new items are dropped and counted
#: (``Recorder.dropped``): a housekeeper stalled for seconds must not grow the worker without bound.
BUFFER_LIMIT = 200_000
#: Most bytes (approximate: each item's ``_ITEM_BYTES`` plus the text, replies and messages it
#: keeps) the buffer holds between two flushes; past it new items are dropped and counted like
#: past BUFFER_LIMIT. Items are cut as they enter (the event's text to HISTORY_TEXT_CHARS, a reply
#: whose frame is over HISTORY_REPLY_BYTES + REPLY_FRAME_SLACK to a mark), so this bounds what the
#: replies that fit in a trace can add up to while the housekeeper is behind.
BUFFER_BYTES = 64 * 1024 * 1024
#: What one buffered item costs besides the strings it keeps (its tuple, ids, times, counts).
_ITEM_BYTES = 512
#: A reply's frame carries more than its text and data (its event id, matcher, plugin, session,
#: times: well under this): a frame larger than HISTORY_REPLY_BYTES + this cannot fit in a trace,
#: and is replaced by a mark (``_CUT``) the moment it is delivered, not kept until the flush.
REPLY_FRAME_SLACK = 2048
#: Refusals of one owner traced per second at most (more are counted only: see ``refused``).
REFUSAL_TRACES_PER_SECOND = 20
#: Each owner's refusal-trace window: owner -> [window start (monotonic), traces in it].
_refusal_budgets: dict[str, list[float]] = {}
#: A trace whose event has not completed after this long is written as ``incomplete``.
PENDING_SECONDS = 900.0
#: Failed events of one owner written to the database per second at most, by this worker; the
#: rest are counted (``db_skipped``) and stay in the recent store. A quota on the database: a
#: tenant whose events all fail (a broken plugin, or on purpose) cannot fill the database, or take
#: every other tenant's place in a flush, at the rate it can send.
DB_ROWS_PER_OWNER_PER_SECOND = 100
#: Failed events written to the database per flush at most; the rest stay in the recent store only
#: (counted in ``Recorder.db_skipped``), so a failure storm cannot flood the database.
DB_ROWS_PER_FLUSH = 2000
#: Longest one write of failed traces may take on PostgreSQL (a locked or hung execapp_eventtrace):
#: past it the batch is skipped and counted (db_skipped), and the housekeeper's other work goes on.
DB_WRITE_DEADLINE_SECONDS = 5.0
#: How often a worker deletes database traces older than HISTORY_FAILURE_DAYS.
PRUNE_SECONDS = 3600.0
#: One hourly prune's statements end within this (a huge or locked table: the next hour tries again).
PRUNE_DEADLINE_SECONDS = 30.0
#: Outcome of an event whose done never came (its worker stopped first).
INCOMPLETE = "incomplete"

_POOL = ExecClass.POOL
_EXEC = {ExecClass.SYNC: "sync", ExecClass.POOL: "pool"}
#: Reply data a flat record may hold (see execapp/history_record.py).
_PLAIN = frozenset((str, int, float, bool, type(None)))
_mono = time.monotonic

#: An event in flight, built on the hot path as a list (cheapest to make and to append to):
#: [conn, event, accepted monotonic time, outcomes, bytes kept, run, run...]. ``outcomes`` holds the
#: replies and failures the connection delivered (None, one item, or a list of several; a reply too
#: large for any trace as a ``_CUT`` mark), ``bytes kept`` their frames' sizes; each run the
#: observer saw is appended after it as (matcher, plugin, exec class, elapsed, code, end time).
_CONN, _EVENT, _T0, _OUTS, _KEPT = range(5)
_RUN0 = 5
#: Events accepted and not yet completed, by event id (a str key: no tuple to build per lookup);
#: an id another connection already has in flight goes under (id(connection), event id). Written
#: on the loop thread only; the pool threads' observer and the housekeeper only read it.
_pending: dict[Any, list[Any]] = {}
#: What the housekeeper takes, per finished event: the common kind's plain values (a tuple of
#: ``_COMMON_LEN``, made into its flat record by ``Recorder._take_all``), else
#: (its list, its completion or None, cost); or a refusal (None, conn, code, message, event id,
#: time, cost). The last value of each is what it counts against BUFFER_BYTES.
_buffer: collections.deque = collections.deque()
_COMMON_LEN = 20
_dropped = itertools.count()
#: Bytes put into the buffer (by the loop thread only) and taken out (by the housekeeper only):
#: each counter has one writer, so no lock; their difference is what the buffer holds now.
_bytes = [0, 0]  # [in, out]
#: The running recorder's cuts (set by ``Recorder.start``): the event text kept, and the largest
#: reply frame kept (HISTORY_REPLY_BYTES + REPLY_FRAME_SLACK).
_text_chars = 200
_reply_cap = 4096 + REPLY_FRAME_SLACK


#: The setting bounding a housekeeper flush's Redis calls together (execapp/redis_deadline.py).
FLUSH_SETTING = "HISTORY_FLUSH_DEADLINE_SECONDS"

class _Cut:
    """The data of a reply kept as a mark: its frame was over what any trace keeps."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<reply over HISTORY_REPLY_BYTES, not kept>"


_CUT = _Cut()
_recorder: "Recorder | None" = None
#: Wall-clock time minus monotonic time: the hot path reads the monotonic clock alone and the
#: housekeeper turns it into wall time with this (set at start, refreshed at every flush).
_wall_offset = 0.0


# -- the hot path: what the connection and the engine call ------------------------------------------
# Nothing the hot path keeps outlives its event but plain values: a list, an Event or a Reply held
# until the housekeeper's next flush would be walked by every garbage collection meanwhile (that
# cost more than the rest of the recording together), so a finished common event leaves only a
# tuple of plain values (untracked by the collector) right here; the housekeeper makes its record.
# Each hook does the least it can: one clock read at acceptance and one per run, one dict entry
# per event, no object but the in-flight list and the run tuples.

def accepted(conn: Any, event: Any) -> None:
    """The connection accepted ``event`` (counted in flight) and is about to dispatch it (loop thread)."""
    if _recorder is None:
        return
    pending = [conn, event, _mono(), None, 0]
    eid = event.id
    other = _pending.setdefault(eid, pending)
    if other is not pending:  # rare: this id is in flight already
        if other[_CONN] is conn:  # its earlier event never completed (the connection went away mid-event)
            _pending[eid] = pending
            _hand_over(other, None)  # recorded incomplete
        else:  # another connection's: ids are the clients' own
            _pending[(id(conn), eid)] = pending


def _find(conn: Any, eid: str) -> tuple[Any, list[Any] | None]:
    """The in-flight list of ``conn``'s event ``eid`` and its key in ``_pending`` (loop thread)."""
    pending = _pending.get(eid)
    if pending is not None and pending[_CONN] is conn:
        return eid, pending
    key = (id(conn), eid)
    return key, _pending.get(key)


def delivered(conn: Any, outcome: Any, size: int = -1) -> None:
    """One outcome of an accepted event (reply, failure or its completion) reached the connection
    (loop thread). The completion hands the event to the housekeeper. ``size``: the bytes of a
    reply's or failure's frame (the connection has it; -1: estimated here). A reply whose frame is
    over what any trace keeps is kept as a mark from here on (``_CUT``), not held until the flush."""
    if _recorder is None:
        return
    eid = outcome.event_id
    pending = _pending.get(eid)
    key: Any = eid
    if pending is None or pending[_CONN] is not conn:
        key, pending = _find(conn, eid)
        if pending is None:
            return  # accepted before the recorder started
    if outcome.__class__ is not Completion:
        if not 0 <= size <= _reply_cap:  # one test for the common case: a small frame, its size known
            if size < 0:
                size = _size(outcome.text, outcome.data) if outcome.__class__ is Reply else 12 + len(outcome.message)
            if size > _reply_cap and outcome.__class__ is Reply:
                outcome = Reply(eid, outcome.matcher, outcome.plugin, None, _CUT, outcome.exec_class,
                                outcome.elapsed)
                size = _ITEM_BYTES
        pending[_KEPT] += size
        outs = pending[_OUTS]
        if outs is None:
            pending[_OUTS] = outcome
        elif outs.__class__ is list:
            outs.append(outcome)
        else:
            pending[_OUTS] = [outs, outcome]
        return
    del _pending[key]
    if _full():
        return
    out = pending[_OUTS]
    if len(pending) == 6 and not outcome.errors and (out is None or (
            out.__class__ is Reply and out.data.__class__ in _PLAIN and out.matcher == pending[_RUN0][0])):
        # The common event: one handler that replied once (or not at all), nothing failed. Only
        # plain values are kept (the exec class as "pooled or not"); the housekeeper builds its record.
        event = pending[_EVENT]
        name, plugin, exec_class, elapsed, _, t_end = pending[_RUN0]
        try:
            owner = conn.owner  # a Connection's is a str ("" for none)
        except AttributeError:
            owner = ""
        text = event.text
        n = len(text)
        if n > _text_chars:  # cut as it enters: the flush would keep no more
            text = text[:_text_chars]
            n = _text_chars
        cost = _ITEM_BYTES + n + pending[_KEPT]
        _bytes[0] += cost
        if out is None:
            _buffer.append((owner, eid, event.session, event.type, text, event.size, pending[_T0],
                            outcome.elapsed, outcome.matched, outcome.replies, outcome.blocked_by, name, plugin,
                            exec_class is _POOL, elapsed, t_end, False, None, None, cost))
        else:
            _buffer.append((owner, eid, event.session, event.type, text, event.size, pending[_T0],
                            outcome.elapsed, outcome.matched, outcome.replies, outcome.blocked_by, name, plugin,
                            exec_class is _POOL, elapsed, t_end, True, out.text, out.data, cost))
    else:
        _hand_over(pending, outcome)


def _full() -> bool:
    """The buffer is at BUFFER_LIMIT items or BUFFER_BYTES: the item at hand is dropped, and counted."""
    if len(_buffer) >= BUFFER_LIMIT or _bytes[0] - _bytes[1] >= BUFFER_BYTES:
        next(_dropped)
        return True
    return False


def _hand_over(pending: list[Any], completion: Any) -> None:
    """Buffer an event of the general kind (several handlers, a failure, a cut reply, or never
    completed): its list, with the event itself replaced by a small one when it is large (a frame's
    decoded data can be many times its size; the trace keeps its text's first characters only)."""
    if _full():
        return
    event = pending[_EVENT]
    if event.size > _text_chars or len(event.text) > _text_chars:
        text = event.text
        if not text and event.data:
            text = _json(event.data)
        pending[_EVENT] = Event(event.type, text[:_text_chars], None, event.id, event.session, event.size)
    cost = _ITEM_BYTES * (len(pending) - _KEPT) + pending[_KEPT] + _text_chars
    _bytes[0] += cost
    _buffer.append((pending, completion, cost))


def refused(conn: Any, code: str, message: str, event_id: str | None) -> None:
    """The connection refused a frame before dispatch (``rate_limited``, ``draining``, ``bad_json``...).

    Each refusal is counted; at most REFUSAL_TRACES_PER_SECOND of one owner's (all its
    connections to this worker) also leave a trace: a client sending bad frames as fast as it can,
    on as many connections as it may open, must not push every other tenant's events out of the
    bounded recent store (the rest are counted, with no event id to keep). Loop thread."""
    if _recorder is None:
        return
    if _full():
        return
    if event_id is not None and not _within_second(_refusal_budgets, getattr(conn, "owner", "") or "",
                                                   REFUSAL_TRACES_PER_SECOND):
        event_id = None
    cost = _ITEM_BYTES + len(message)
    _bytes[0] += cost
    _buffer.append((None, conn, code, message, event_id, time.time(), cost))


def _within_second(windows: dict[str, list[float]], owner: str, limit: int) -> bool:
    """Count one more for ``owner`` in its one-second window of ``windows`` (owner -> [window start
    (monotonic), count]); True while the count is within ``limit``."""
    now = _mono()
    window = windows.get(owner)
    if window is None or now - window[0] >= 1.0:
        if window is None and len(windows) >= 10_000:  # owners are few: a bounded table
            windows.clear()
        window = windows[owner] = [now, 0]
    window[1] += 1
    return window[1] <= limit


def _observe(m: Any, exec_class: ExecClass, elapsed: float, code: str, event: Any) -> None:
    # The engine's run observer (Engine.add_observer): after every handler run, on the thread that
    # ran it (the loop, or a pool thread), before the run's outcome completes its event, so the
    # event is still in ``_pending``. Reads ``_pending`` while the loop may write it: single
    # lookups, and (rarely) a scan of a copy.
    if _recorder is None:
        return
    pending = _pending.get(event.id)
    if pending is None or pending[_EVENT] is not event:
        for pending in list(_pending.values()):  # rare: its id is in flight on two connections at once
            if pending[_EVENT] is event:
                break
        else:
            return  # accepted before the recorder started, or not by a connection
    # list.append is atomic: the loop and pool threads of one event may append at once.
    pending.append((m.name, m.plugin, exec_class, elapsed, code, _mono()))


# -- the recorder: a worker service on the housekeeping thread ---------------------------------------



class Recorder:
    """Worker service: turns the buffered hook calls into traces, stores them, counts failures."""

    def __init__(self, worker: WorkerLike, interval: float | None = None) -> None:
        self.worker = worker
        self.worker_id = str(getattr(worker, "id", "?"))
        self.interval = interval if interval is not None else float(conf.get("HISTORY_FLUSH_SECONDS"))
        self.text_chars = int(conf.get("HISTORY_TEXT_CHARS"))
        self.reply_bytes = int(conf.get("HISTORY_REPLY_BYTES"))
        self.failure_days = float(conf.get("HISTORY_FAILURE_DAYS"))
        self.store = store()
        #: uids are "<tag>-<sequence, hex>": unique across workers and restarts (the hot path makes them too).
        self.tag = secrets.token_hex(4)
        self.seq = itertools.count(1)
        self._lock = threading.Lock()  # tick() runs on the housekeeper; close() and flush() elsewhere
        # Failed events' traces taken by a flush and not yet written to the database, and the lock
        # of that write: it is made outside _lock, so a resend's flush (which needs only Redis) never
        # waits for the database (a locked execapp_eventtrace held every resend's done for as long).
        self._unwritten: list[Record] = []
        self._db_lock = threading.Lock()
        # The thread that writes them (and prunes) for tick(): the housekeeper never waits for the database.
        self._db_thread: threading.Thread | None = None
        self._db_due = threading.Event()
        # Set by close(): the database thread ends (its writes and prunes would otherwise go on past
        # the worker's stop, on a database the process is tearing down or flushing).
        self._closing = threading.Event()
        #: Failed or refused handlers by (matcher, plugin, code), and refused events by code (before
        #: any matcher): totals since this recorder started. Read by the dashboard and /metrics.
        self.handler_failures: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.event_refusals: collections.Counter[str] = collections.Counter()
        #: The newest failure of each matcher: {"ts", "code", "message", "event_id", "uid"}.
        self.last_failure: dict[str, dict[str, Any]] = {}
        self.recorded = 0
        self.dropped = 0
        self.db_written = 0
        self.db_skipped = 0
        #: owner -> [window start (monotonic), failure rows written in it] (DB_ROWS_PER_OWNER_PER_SECOND).
        self._db_budgets: dict[str, list[float]] = {}
        self.store_errors = 0
        self._last_prune = 0.0
        worker.engine.add_observer(_observe)

    def start(self) -> None:
        """Become the process's recorder: the hooks start recording (one per process)."""
        global _recorder, _text_chars, _reply_cap
        _set_wall_offset()
        _text_chars, _reply_cap = self.text_chars, self.reply_bytes + REPLY_FRAME_SLACK
        _recorder = self

    def tick(self) -> None:
        """Housekeeper tick: flush what the hooks buffered to the store; the database work (the failed
        events' traces, the hourly prune) is handed to this recorder's own database thread.

        On the housekeeper, a database that did not answer held the metrics and the dashboard
        snapshots too: with PostgreSQL stalled and events failing, the worker's snapshot went 11.6 s
        old (stale, out of the dashboard's totals) at each write's deadline and reconnect.

        The store's Redis calls share one deadline (HISTORY_FLUSH_DEADLINE_SECONDS): on a Redis
        that does not answer, each waited its socket timeout and redis-py's retries, holding the
        metrics, the snapshots and the watchdog's ticks. Past it the flush's traces are lost, as
        when Redis is down (counted in ``store_errors``); the next tick tries again."""
        with redis_deadline(setting=FLUSH_SETTING):
            self.flush(database=False)
        with self._lock:
            if self._closing.is_set():
                return
            if self._db_thread is None or not self._db_thread.is_alive():
                self._db_thread = threading.Thread(target=self._database_loop, name="execapp-history-db",
                                                   daemon=True)
                self._db_thread.start()
        self._db_due.set()

    def _database_loop(self) -> None:
        try:
            self._database_turns()
        finally:
            connections.close_all()  # this thread's own connections (a thread's are its own in Django)

    def _database_turns(self) -> None:
        while True:
            self._db_due.wait()
            self._db_due.clear()
            if self._closing.is_set():
                return  # close() writes what is left itself
            with self._lock:
                failed, self._unwritten = self._unwritten, []
            if failed:
                with self._db_lock:
                    self._write_failures(failed)
            if self.failure_days > 0 and time.monotonic() - self._last_prune >= PRUNE_SECONDS:
                self._last_prune = time.monotonic()
                try:
                    close_old_connections()
                    with statement_deadline(PRUNE_DEADLINE_SECONDS):
                        prune(self.failure_days)
                        prune_owners()  # each owner's newest HISTORY_FAILURES_PER_OWNER, the rest deleted
                except Exception as exc:
                    _rare.warning(("prune", type(exc).__name__), "pruning old event traces failed: %r", exc)

    def flush(self, expire_all: bool = False, database: bool = True) -> int:
        """Turn every buffered item into traces and store the finished ones; how many were stored.
        ``database``: also write the failed ones taken so far to the database (else the next flush
        that does writes them: a resend's flush waits for Redis only)."""
        with self._lock:
            _set_wall_offset()
            records: list[tuple] = []
            self._take_all(records)
            self._expire(records, expire_all)
            dropped = count_value(_dropped)
            if dropped > self.dropped:
                _rare.warning(("dropped",), "event history buffer full: %d trace items dropped so far (the "
                              "housekeeper fell behind)", dropped)
                self.dropped = dropped
            if records:
                self._store(records)
            failed: list[Record] = []
            if database and self._unwritten:
                failed, self._unwritten = self._unwritten, []
        if failed:
            with self._db_lock:
                self._write_failures(failed)
        return len(records)

    def _take_all(self, records: list[tuple]) -> None:
        # One loop over every finished event (and refusal) the hot path handed over, in order (a
        # reused id's newest trace must come last). The common event's flat record is built right
        # here (see execapp/history_record.py, ``flat``: the same tuple without a call per event).
        trace, append, popleft = self._trace, records.append, _buffer.popleft
        tag, seq, worker_id, offset = self.tag, self.seq, self.worker_id, _wall_offset
        text_chars, reply_bytes = self.text_chars, self.reply_bytes
        taken = 0
        for _ in range(len(_buffer)):
            item = popleft()
            taken += item[-1]
            if len(item) == _COMMON_LEN:
                (owner, eid, session, type_, text, size, t0, duration, matched, replies, blocked_by, name, plugin,
                 pooled, elapsed, t_end, replied, reply_text, reply_data, _) = item
                start = t_end - elapsed - t0
                if start < 0.0:
                    start = 0.0
                # kept: its one reply is in the record; truncated: it replied over HISTORY_REPLY_BYTES.
                kept = replied
                if replied and ((len(reply_text) if reply_text is not None else 0)
                                + (0 if reply_data is None else len(str(reply_data)))) > reply_bytes:
                    kept = False
                    reply_text = reply_data = None
                append((f"{tag}-{next(seq):x}", eid, owner or "", session, type_,
                        text if len(text) <= text_chars else text[:text_chars], size, worker_id, t0 + offset, "ok",
                        "", (), duration, matched, replies, 0, blocked_by, name, plugin,
                        "pool" if pooled else "sync", start, start if pooled else None, elapsed, reply_text,
                        reply_data, kept, replied and not kept))
                continue
            pending = item[0]
            if pending is not None:
                append(trace(pending, item[1]))
            else:
                _, conn, code, message, event_id, ts, _ = item
                self.event_refusals[code] += 1
                if event_id is not None:
                    append(self._refusal(getattr(conn, "owner", "") or "", code, message, event_id, ts))
        _bytes[1] += taken

    def _expire(self, records: list[tuple], expire_all: bool) -> None:
        """Events accepted long ago (PENDING_SECONDS; all at close) that never completed: recorded
        ``incomplete``. Runs on the housekeeper while the loop may add to these dicts: copied first."""
        horizon = time.monotonic() - PENDING_SECONDS
        for key, pending in list(_pending.items()):
            if expire_all or pending[_T0] < horizon:
                if _pending.pop(key, None) is not None:
                    records.append(self._trace(pending, None))

    # -- building traces ------------------------------------------------------------------------

    def _uid(self) -> str:
        return f"{self.tag}-{next(self.seq):x}"

    def _refusal(self, owner: str, code: str, message: str, event_id: str, ts: float) -> tuple:
        return (self._uid(), event_id, owner, None, "", "", 0, self.worker_id, ts, code, message, (code,), 0.0, 0, 0,
                0, None, (), False)

    def _trace(self, p: list[Any], completion: Completion | None) -> tuple:
        """The stored record (a plain tuple in Record's field order) of an event the hot path did
        not make flat: several handlers, a failure, a refusal, or not completed (``completion``
        None). Its handlers come from the run observer's items (what ran, where, how long) merged
        with its outcomes (replies, failures, handlers refused before they ran)."""
        event = p[_EVENT]
        owner = getattr(p[_CONN], "owner", "") or ""
        text = event.text
        if len(text) > self.text_chars:
            text = text[:self.text_chars]
        elif not text and event.data:
            text = _json(event.data)[:self.text_chars]
        uid = f"{self.tag}-{next(self.seq):x}"
        ts = p[_T0] + _wall_offset
        handlers, codes, truncated = self._handlers(p)
        if completion is None:
            outcome, duration, matched, replies, errors, blocked_by = INCOMPLETE, None, None, None, len(codes), None
        else:
            outcome = "error" if completion.errors else "ok"
            duration, matched, replies = completion.elapsed, completion.matched, completion.replies
            errors, blocked_by = len(completion.errors), completion.blocked_by
        record = (uid, event.id, owner, event.session, event.type, text, event.size, self.worker_id, ts, outcome, "",
                  codes, duration, matched, replies, errors, blocked_by, handlers, truncated)
        if codes:
            for h in handlers:
                if h[H_CODE] != "ok":
                    self.last_failure[h[H_MATCHER]] = {"ts": ts + (h[H_START] or 0.0), "code": h[H_CODE],
                                                       "message": h[H_MESSAGE], "event_id": event.id, "uid": uid,
                                                       "plugin": h[H_PLUGIN]}
        return record

    def _handlers(self, p: list[Any]) -> tuple[tuple[tuple, ...], tuple[str, ...], bool]:
        """Every handler of an event (the general case: several, failed, refused, unattributed)."""
        t0 = p[_T0]
        found: dict[str, list[Any]] = {}
        for name, plugin, exec_class, elapsed, code, t_end in p[_RUN0:]:
            start = max(0.0, t_end - elapsed - t0)
            found[name] = [name, plugin, _EXEC[exec_class], start, start if exec_class is _POOL else None, elapsed,
                           code, "", []]
        budget = self.reply_bytes
        truncated = False
        codes: list[str] = []
        outs = p[_OUTS]
        for outcome in () if outs is None else outs if outs.__class__ is list else (outs,):
            h = found.get(outcome.matcher)
            if h is None:  # not observed (a refusal, or a run the observer could not attribute): no times
                exec_class = outcome.exec_class
                h = found[outcome.matcher] = [outcome.matcher, outcome.plugin,
                                              _EXEC[exec_class] if exec_class is not None else None, None, None,
                                              outcome.elapsed, "ok", "", []]
            if outcome.__class__ is Reply:
                if outcome.data is _CUT:  # over the cap when it was delivered (see ``delivered``)
                    truncated = True
                    continue
                size = _size(outcome.text, outcome.data)
                if size <= budget:
                    budget -= size
                    h[8].append((outcome.text, outcome.data))
                else:
                    truncated = True
            elif outcome.__class__ is Failure:
                h[6], h[7] = outcome.code, outcome.message
                codes.append(outcome.code)
                self.handler_failures[(outcome.matcher, outcome.plugin or "", outcome.code)] += 1
        # Plain tuples in Handler's field order (see execapp/history_record.py: not NamedTuples).
        handlers = tuple(sorted(((*h[:8], tuple(h[8])) for h in found.values()),
                                key=lambda h: -1.0 if h[H_START] is None else h[H_START]))
        return handlers, tuple(sorted(set(codes))), truncated

    # -- storing --------------------------------------------------------------------------------

    def _store(self, records: list[tuple]) -> None:
        self.recorded += len(records)
        try:
            self.store.add(records)
        except Exception as exc:  # Redis down: the dashboard counts go on, the traces of this flush are lost
            self.store_errors += 1
            _rare.warning(("store", type(exc).__name__), "event history store %s failed, %d traces lost: %r",
                          self.store.name, len(records), exc)
        self._unwritten.extend(view(r) for r in records if r[OUTCOME] != "ok")

    def _write_failures(self, failed: list[Record]) -> None:
        from .models import EventTrace

        failed = self._within_owner_budgets(failed)
        if len(failed) > DB_ROWS_PER_FLUSH:
            self.db_skipped += len(failed) - DB_ROWS_PER_FLUSH
            failed = failed[:DB_ROWS_PER_FLUSH]
        # Every string from a client or a plugin goes through clean_text/clean_json (execapp.dbtext):
        # a NUL in one event's id or text would fail the whole batch on PostgreSQL.
        rows = [EventTrace(uid=r.uid, event_id=clean_text(r.id[:64]), owner=clean_text(r.owner[:200]),
                           session=clean_text((r.session or "")[:64]), event_type=clean_text(r.type[:64]),
                           text=clean_text(r.text), outcome=clean_text(r.outcome[:40]),
                           codes=clean_text(",".join(r.codes)[:400]), matchers=clean_text(_commas(r.matchers)),
                           plugins=clean_text(_commas(r.plugins)), worker=r.worker[:200],
                           created_at=dt.datetime.fromtimestamp(r.ts, dt.timezone.utc), duration_seconds=r.duration,
                           trace=clean_json(json.loads(to_json(r))))
                for r in failed]
        # A locked table (SQLite's shared cache): written again after DB_LOCKED_RETRY_SECONDS; the rows
        # are the lasting record of failures, and ignore_conflicts makes a retry safe.
        for retry in (*DB_LOCKED_RETRY_SECONDS, None):
            try:
                close_old_connections()
                with statement_deadline(DB_WRITE_DEADLINE_SECONDS):  # a locked table: the rows are skipped
                    EventTrace.objects.bulk_create(rows, ignore_conflicts=True, batch_size=500)
                self.db_written += len(rows)
                return
            except OperationalError as exc:
                if retry is not None and "locked" in str(exc):
                    time.sleep(retry)  # (the housekeeper's thread, never the event loop)
                    continue
                error: Exception = exc
            except Exception as exc:
                error = exc
            self.db_skipped += len(rows)
            _rare.warning(("db", type(error).__name__), "writing %d failed event traces failed: %r", len(rows), error)
            return

    def _within_owner_budgets(self, failed: list[Record]) -> list[Record]:
        """The failures each owner's database budget still allows this second (the rest counted)."""
        kept = [r for r in failed if _within_second(self._db_budgets, r.owner, DB_ROWS_PER_OWNER_PER_SECOND)]
        self.db_skipped += len(failed) - len(kept)
        return kept

    def stats(self) -> dict[str, Any]:
        """What the recorder did: traces recorded, dropped, written to the database, pending."""
        return {"recorded": self.recorded, "dropped": self.dropped, "db_written": self.db_written,
                "db_skipped": self.db_skipped, "store_errors": self.store_errors, "pending": len(_pending),
                "store": self.store.name}

    def close(self) -> None:
        """At worker stop: record what is buffered (unfinished events as ``incomplete``), stop recording."""
        global _recorder
        active = _recorder is self
        if active:
            _recorder = None
        self._stop_database_thread()
        try:
            from .persistence import off_loop

            off_loop(lambda: self.flush(expire_all=active))  # another recorder's events are its own
        except Exception as exc:
            log.warning("final event history flush failed: %r", exc)


    def _stop_database_thread(self) -> None:
        # Bounded: a write in progress ends within its statement deadline; one still running past
        # that (or a long prune) is left, a daemon thread, and said: the worker's stop goes on.
        with self._lock:
            self._closing.set()
            thread = self._db_thread
        self._db_due.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(DB_WRITE_DEADLINE_SECONDS + 1.0)
            if thread.is_alive():
                log.warning("the event history's database thread did not end within %.0f s of the worker's "
                            "stop; left running", DB_WRITE_DEADLINE_SECONDS + 1.0)


def _set_wall_offset() -> None:
    """Refresh the offset from the monotonic clock the hot path reads to wall-clock time."""
    global _wall_offset
    _wall_offset = time.time() - time.monotonic()


def _size(text: str | None, data: Any) -> int:
    if data is None:
        return 12 + (len(text) if text else 0)
    return 12 + (len(text) if text else 0) + len(_json(data))


_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str).encode


def _json(value: Any) -> str:
    try:
        return _encode(value)
    except (TypeError, ValueError):  # a circular structure in a handler's data
        return json.dumps(repr(value)[:1000])


def _commas(names: Iterable[str]) -> str:
    names = [n.replace(",", " ") for n in names]
    return "," + ",".join(names) + "," if names else ""


def recorder(worker: WorkerLike) -> Recorder:
    """Service factory (execapp.worker.SERVICE_FACTORIES): records this worker's events."""
    rec = Recorder(worker)
    rec.start()
    return rec


def discard_buffer() -> None:
    """Forget what the hot path buffered, with its bytes (tests and benchmarks: nothing else may run)."""
    _buffer.clear()
    _bytes[1] = _bytes[0]


def current() -> Recorder | None:
    """The process's running recorder, or None."""
    return _recorder


__all__ = ["BUFFER_LIMIT", "INCOMPLETE", "Filters", "Recorder", "Summary", "accepted", "current", "delivered",
           "cutoff", "detail", "get", "prune", "prune_owners", "recorder", "refused", "search"]
