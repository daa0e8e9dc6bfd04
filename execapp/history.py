"""Event history: every event's trace, recorded off the hot path, and how to find it again.

A trace is one event as an operator asks about it: its id, session, token owner, type, the
first ``HISTORY_TEXT_CHARS`` of its text, each handler that ran or was refused (matcher,
plugin, exec class, start, queue wait, duration, outcome code and message, replies up to
``HISTORY_REPLY_BYTES``), the worker, the times and the outcome. See docs/observability.md.

Recording is batched: the connection calls ``accepted``, ``delivered`` and ``refused`` on the
event loop and the engine calls this module's run observer after every handler run; each only
appends a tuple to one bounded buffer (a deque: ``append``/``popleft`` are atomic, so the loop
and the pool threads need no lock). The ``Recorder`` (a worker service on the housekeeping
thread) turns those tuples into traces every ``HISTORY_FLUSH_SECONDS``, adds them to the recent
store (``execapp.history_store``), writes the failures to the database (``EventTrace``, kept
``HISTORY_FAILURE_DAYS``) and counts failures by matcher, plugin and code for the dashboard and
/metrics. Without a running Recorder the hooks return at once.

Readers: ``get(owner, event_id)`` (the newest trace of that pair: a resend can be answered from
its recorded replies and outcome), ``search(filters)`` and ``detail(uid)`` (the admin's Events page).
"""
from __future__ import annotations

import collections
import contextvars
import datetime as dt
import itertools
import json
import logging
import secrets
import sys
import threading
import time
from types import FrameType
from typing import Any, Iterable

from django.db import close_old_connections

from . import conf
from .engine.event import Completion, EventRun, Failure, Reply
from .engine.pool import count_value
from .engine.profile import ExecClass
from .engine.ratelog import RateLimitedLog
from .history_query import detail, get, prune, search
from .history_record import (
    FLAT_LEN,
    H_CODE,
    H_MATCHER,
    H_MESSAGE,
    H_PLUGIN,
    H_START,
    OUTCOME,
    Record,
    flat,
    to_json,
    view,
)
from .history_store import Filters, Summary, store
from .seams import WorkerLike

log = logging.getLogger("execapp.history")
_rare = RateLimitedLog(log, 60.0)

#: Most items the buffer holds between two flushes; past it new items are dropped and counted
#: (``Recorder.dropped``): a housekeeper stalled for seconds must not grow the worker without bound.
BUFFER_LIMIT = 200_000
#: A trace whose event has not completed after this long is written as ``incomplete``.
PENDING_SECONDS = 900.0
#: Failed events written to the database per flush at most; the rest stay in the recent store only
#: (counted in ``Recorder.db_skipped``), so a failure storm cannot flood the database.
DB_ROWS_PER_FLUSH = 2000
#: How often a worker deletes database traces older than HISTORY_FAILURE_DAYS.
PRUNE_SECONDS = 3600.0
#: Outcome of an event whose done never came (its worker stopped first).
INCOMPLETE = "incomplete"

_POOL = ExecClass.POOL
_EXEC = {ExecClass.SYNC: "sync", ExecClass.POOL: "pool"}
#: Reply data a flat record may hold (see execapp/history_record.py).
_PLAIN = frozenset((str, int, float, bool, type(None)))

#: An event in flight, built on the hot path as a list (cheapest to make and to append to):
#: [conn, event, accepted wall time, accepted monotonic time, runs, outcomes]. ``runs`` holds the
#: run observer's (matcher, plugin, exec class, elapsed, code, end time) and ``outcomes`` the
#: replies and failures the connection delivered: each None, one item, or a list of several.
_CONN, _EVENT, _TS, _T0, _RUNS, _OUTS = range(6)
#: Events accepted and not yet completed: by (id(connection), event id) for the connection's
#: outcomes (loop thread only), and by id(event) for runs observed on pool threads.
_pending: dict[tuple[int, str], list[Any]] = {}
_by_event: dict[int, list[Any]] = {}
#: What the housekeeper takes, per finished event: its record, already built when the event was
#: the common kind (a flat tuple, see execapp/history_record.py), else (its list, its completion);
#: or a refusal (None, conn, code, message, event id, time).
_buffer: collections.deque = collections.deque()
_dropped = itertools.count()
#: The in-flight list of the event the current asyncio task is dispatching (set by
#: ``accepted``): an inline run's observer call happens inside that dispatch, in that task's context.
_current: contextvars.ContextVar[Any] = contextvars.ContextVar("execapp_history_event", default=None)
_recorder: "Recorder | None" = None


# -- the hot path: what the connection and the engine call ------------------------------------------
# Nothing the hot path keeps outlives its event but plain values: a list, an Event or a Reply held
# until the housekeeper's next flush would be walked by every garbage collection meanwhile (that
# cost more than the rest of the recording together), so a finished common event becomes its flat
# record (a tuple of plain values, untracked by the collector) right here.

def accepted(conn: Any, event: Any) -> None:
    """The connection accepted ``event`` (counted in flight) and is about to dispatch it (loop thread)."""
    if _recorder is None:
        return
    pending = [conn, event, time.time(), time.monotonic(), [], None]
    _current.set(pending)
    _pending[(id(conn), event.id)] = pending
    _by_event[id(event)] = pending


def delivered(conn: Any, outcome: Any) -> None:
    """One outcome of an accepted event (reply, failure or its completion) reached the connection
    (loop thread). The completion hands the event to the housekeeper."""
    rec = _recorder
    if rec is None:
        return
    if outcome.__class__ is Completion:
        pending = _pending.pop((id(conn), outcome.event_id), None)
        if pending is None:
            return  # accepted before the recorder started
        event = pending[_EVENT]
        del _by_event[id(event)]
        if len(_buffer) >= BUFFER_LIMIT:
            next(_dropped)
            return
        runs, out = pending[_RUNS], pending[_OUTS]
        if len(runs) == 1 and not outcome.errors and (out is None or (
                out.__class__ is Reply and out.matcher == runs[0][0] and out.data.__class__ in _PLAIN)):
            # The common event: one handler that replied once (or not at all), nothing failed.
            name, plugin, exec_class, elapsed, _, t_end = runs[0]
            start = t_end - elapsed - pending[_T0]
            if out is None:
                text = data = None
                kept = True
            else:
                text, data = out.text, out.data
                size = (len(text) if text is not None else 0) + (0 if data is None else len(str(data)))
                kept = size <= rec.reply_bytes
                if not kept:
                    text = data = None
            etext = event.text
            _buffer.append(flat(
                f"{rec.tag}-{next(rec.seq):x}", event.id, getattr(conn, "owner", "") or "", event.session, event.type,
                etext if len(etext) <= rec.text_chars else etext[:rec.text_chars], event.size, rec.worker_id,
                pending[_TS], outcome.elapsed, outcome.matched, outcome.replies, outcome.blocked_by, name, plugin,
                _EXEC[exec_class], start if start > 0.0 else 0.0,
                (start if start > 0.0 else 0.0) if exec_class is _POOL else None, elapsed, text, data, kept))
        else:
            _buffer.append((pending, outcome))
        return
    pending = _pending.get((id(conn), outcome.event_id))
    if pending is not None:
        outs = pending[_OUTS]
        if outs is None:
            pending[_OUTS] = outcome
        elif outs.__class__ is list:
            outs.append(outcome)
        else:
            pending[_OUTS] = [outs, outcome]


def refused(conn: Any, code: str, message: str, event_id: str | None) -> None:
    """The connection refused a frame before dispatch (``rate_limited``, ``draining``, ``bad_json``...)."""
    if _recorder is None:
        return
    if len(_buffer) < BUFFER_LIMIT:
        _buffer.append((None, conn, code, message, event_id, time.time()))
    else:
        next(_dropped)


def _observe(m: Any, exec_class: ExecClass, elapsed: float, code: str) -> None:
    # The engine's run observer (Engine.add_observer): after every handler run, on the thread that
    # ran it, before the run's outcome completes its event. On the loop the task's context holds
    # the event's list; on a pool thread the engine's own frame names the event (found by type
    # among its arguments, as engine.running_handlers does): ~1 us on that pool thread, nothing
    # on the loop.
    if _recorder is None:
        return
    pending = _current.get()
    if pending is None:
        run = _caller_run()
        if run is None:
            return
        pending = _by_event.get(id(run.event))
        if pending is None:
            return
    # list.append is atomic: the loop and pool threads of one event may append at once.
    pending[_RUNS].append((m.name, m.plugin, exec_class, elapsed, code, time.monotonic()))


_RUNNER_PARAMS: dict[Any, tuple[str, ...]] = {}


def _runner_params() -> dict[Any, tuple[str, ...]]:
    """The engine methods whose frames hold the EventRun of a handler run, with their parameters."""
    if not _RUNNER_PARAMS:
        from .engine.engine import Engine

        for name in ("_invoke", "_failed", "_overrun", "_run_inline"):
            fn = getattr(Engine, name, None)
            code = getattr(fn, "__code__", None)
            if code is not None:
                _RUNNER_PARAMS[code] = code.co_varnames[:code.co_argcount]
    return _RUNNER_PARAMS


def _caller_run() -> EventRun | None:
    runners = _runner_params()
    frame: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        params = runners.get(frame.f_code)
        if params is not None:
            f_locals = frame.f_locals
            for p in params:
                value = f_locals.get(p)
                if isinstance(value, EventRun):
                    return value
            return None
        frame = frame.f_back
    return None


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
        self.store_errors = 0
        self._last_prune = 0.0
        worker.engine.add_observer(_observe)

    def start(self) -> None:
        """Become the process's recorder: the hooks start recording (one per process)."""
        global _recorder
        _runner_params()
        _recorder = self

    def tick(self) -> None:
        """Housekeeper tick: flush what the hooks buffered; prune old database traces hourly."""
        self.flush()
        if self.failure_days > 0 and time.monotonic() - self._last_prune >= PRUNE_SECONDS:
            self._last_prune = time.monotonic()
            try:
                close_old_connections()
                prune(self.failure_days)
            except Exception as exc:
                _rare.warning(("prune", type(exc).__name__), "pruning old event traces failed: %r", exc)

    def flush(self, expire_all: bool = False) -> int:
        """Turn every buffered item into traces and store the finished ones; how many were stored."""
        with self._lock:
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
            return len(records)

    def _take_all(self, records: list[tuple]) -> None:
        # One loop over every finished event (and refusal) the hot path handed over.
        trace, append, popleft = self._trace, records.append, _buffer.popleft
        for _ in range(len(_buffer)):
            item = popleft()
            if len(item) == FLAT_LEN:  # the common event's record, built by the hot path
                append(item)
                continue
            pending = item[0]
            if pending is not None:
                append(trace(pending, item[1]))
            else:
                _, conn, code, message, event_id, ts = item
                self.event_refusals[code] += 1
                if event_id is not None:
                    append(self._refusal(getattr(conn, "owner", "") or "", code, message, event_id, ts))

    def _expire(self, records: list[tuple], expire_all: bool) -> None:
        """Events accepted long ago (PENDING_SECONDS; all at close) that never completed: recorded
        ``incomplete``. Runs on the housekeeper while the loop may add to these dicts: copied first."""
        horizon = time.monotonic() - PENDING_SECONDS
        for key, pending in list(_pending.items()):
            if expire_all or pending[_T0] < horizon:
                if _pending.pop(key, None) is not None:
                    _by_event.pop(id(pending[_EVENT]), None)
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
        ts = p[_TS]
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
        for name, plugin, exec_class, elapsed, code, t_end in p[_RUNS]:
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
        failed = [view(r) for r in records if r[OUTCOME] != "ok"]
        if failed:
            self._write_failures(failed)

    def _write_failures(self, failed: list[Record]) -> None:
        from .models import EventTrace

        if len(failed) > DB_ROWS_PER_FLUSH:
            self.db_skipped += len(failed) - DB_ROWS_PER_FLUSH
            failed = failed[:DB_ROWS_PER_FLUSH]
        rows = [EventTrace(uid=r.uid, event_id=r.id[:64], owner=r.owner[:200], session=(r.session or "")[:64],
                           event_type=r.type[:64], text=r.text, outcome=r.outcome[:40], codes=",".join(r.codes)[:400],
                           matchers=_commas(r.matchers), plugins=_commas(r.plugins), worker=r.worker[:200],
                           created_at=dt.datetime.fromtimestamp(r.ts, dt.timezone.utc), duration_seconds=r.duration,
                           trace=json.loads(to_json(r)))
                for r in failed]
        try:
            close_old_connections()
            EventTrace.objects.bulk_create(rows, ignore_conflicts=True, batch_size=500)
            self.db_written += len(rows)
        except Exception as exc:
            self.db_skipped += len(rows)
            _rare.warning(("db", type(exc).__name__), "writing %d failed event traces failed: %r", len(rows), exc)

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
        try:
            from .persistence import off_loop

            off_loop(lambda: self.flush(expire_all=active))  # another recorder's events are its own
        except Exception as exc:
            log.warning("final event history flush failed: %r", exc)


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


def current() -> Recorder | None:
    """The process's running recorder, or None."""
    return _recorder


__all__ = ["BUFFER_LIMIT", "INCOMPLETE", "Filters", "Recorder", "Summary", "accepted", "current", "delivered",
           "detail", "get", "prune", "recorder", "refused", "search"]
