"""Persisted execution profiles: warm start at worker start, batched background flushes, a merge rule.

Merge rule (several workers flushing the same matcher; docs/observability.md):

- Each flush runs in one transaction per batch: missing rows are inserted with
  ``INSERT ... ON CONFLICT DO NOTHING`` and every row of the batch is then locked with
  ``SELECT ... FOR UPDATE`` in matcher order (PostgreSQL; SQLite serializes writers on the
  database lock, which the insert takes first). So two flushes of one row never interleave.
- Counters (runs, errors, timeouts, promotions, demotions) are added as deltas since this
  worker's previous successful flush, so no worker's runs are lost or counted twice.
- ``promoted_at``/``demoted_at`` keep the latest value any worker reported; the state follows
  the most recent of the two (promotion or demotion, whichever happened last anywhere);
  a worker still learning never overrides a decision.
- Window: a writer whose latest transition is the row's (same regime) appends its new samples
  and the row keeps the most recent ``PROFILE_WINDOW``; a writer whose transition is newer
  replaces the window with its own (a promotion starts a fresh window, as in the engine); a
  writer whose transition is older than the row's adds its counters but not its samples.
- p50/p99 are recomputed from the merged window; ``last_error`` is the latest writer's when
  it reports new errors.
- ``proven_size`` (what inline was earned on) follows the window's regime rule: a newer
  regime's writer replaces it, a writer of the same regime raises it to the larger of the
  two, an outdated writer leaves it.
- ``quarantined``: a writer whose quarantine changed since its previous flush (set or
  released here) writes it; the others leave the row's (so one worker's release is not
  undone by workers that still hold the old pin in memory until they restart).
"""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from . import conf
from .circuit import Circuit
from .db_deadline import transaction_deadline
from .dbtext import clean_text
from .engine.profile import COUNTERS as PROFILE_COUNTERS
from .models import ExecProfileRecord
from .seams import EngineLike, WorkerLike

log = logging.getLogger("execapp.persistence")

#: The profile counters persisted per matcher (summed over workers as deltas).
COUNTERS = PROFILE_COUNTERS
_FIELDS = ["plugin", "state", "window", "p50_seconds", "p99_seconds", *COUNTERS, "promoted_at", "demoted_at",
           "last_error", "updated_at", "proven_size", "quarantined"]
_SAME_TIME = 0.001  # seconds: timestamps round-trip through the database at microsecond precision
BATCH = 100
#: Longest one batch's transaction may take on PostgreSQL (a locked execapp_execprofilerecord, a
#: database that does not answer): past it the flush fails (and is tried again at the next tick).
#: Without it a drain's flush (manage.py drain, SIGTERM) waited for as long as the lock was held:
#: a SIGTERM under a 60 s lock ran past its 25 s grace until the supervisor SIGKILLed both workers
#: at 40 s, and `drain` named the worker "did not answer".
FLUSH_DEADLINE_SECONDS = 5.0
#: After a flush failed on a database error, the flushes in the next this many seconds fail at once
#: (execapp/circuit.py): a SIGTERM under a stalled PostgreSQL waited for the tick's attempt, the
#: drain's and the final close's in turn (5-10 s each: the deadline, a new connection's
#: connect_timeout) and exited after 27 s, past its 25 s grace.
FLUSH_CIRCUIT_SECONDS = 10.0
T = TypeVar("T")


@dataclass
class _Flushed:
    """What this worker last wrote for one profile: its version and counters (the delta base),
    and its quarantine (written again only when it changes)."""

    version: int
    counters: dict[str, int]
    quarantined: str | None = None


def off_loop(fn: Callable[[], T]) -> T:
    """Run ``fn`` (database work) on a helper thread when called from an event loop, else here.

    Worker.start() may run inside a Channels consumer's ``connect`` and Worker.stop() inside a
    signal handler on the loop; Django refuses ORM calls on a thread with a running loop.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run, name="execapp-persistence", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _ts(value: float | None) -> dt.datetime | None:
    return None if value is None else dt.datetime.fromtimestamp(value, tz=dt.timezone.utc)


def _epoch(value: dt.datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def _latest(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _pct(ordered: list[float], q: float) -> float | None:
    """Nearest-rank percentile, as the engine computes it."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def merge_into(row: ExecProfileRecord, snap: dict[str, Any], deltas: dict[str, int], new_samples: list[float],
               window: int, plugin: str | None, *, quarantine_changed: bool = True) -> None:
    """Apply one worker's flush of one profile to its (locked) row: the merge rule above.

    ``quarantine_changed``: this writer's quarantine differs from what it last flushed or
    loaded, so its value (``snap["quarantined"]``, None: released) replaces the row's."""
    row_promoted, row_demoted = _epoch(row.promoted_at), _epoch(row.demoted_at)
    row_transition = _latest(row_promoted, row_demoted)
    local_transition = _latest(snap["promoted_at"], snap["demoted_at"])
    promoted = _latest(row_promoted, snap["promoted_at"])
    demoted = _latest(row_demoted, snap["demoted_at"])

    local_size = int(snap.get("proven_size") or 0)
    if local_transition is not None and (row_transition is None or local_transition > row_transition + _SAME_TIME):
        samples = list(snap["window"])  # this writer moved to a newer regime: its window replaces
        proven = local_size
    elif (row_transition is None) == (local_transition is None) and (
            row_transition is None or abs(row_transition - local_transition) <= _SAME_TIME):  # type: ignore[operator]
        samples = (list(row.window or []) + list(new_samples))  # same regime: the most recent samples
        proven = max(row.proven_size or 0, local_size)
    else:
        samples = list(row.window or [])  # an outdated regime: counters only
        proven = row.proven_size or 0
    samples = [float(s) for s in samples[-window:]]

    if promoted is None and demoted is None:
        state = row.state if row.state != "learning" else snap["state"]
    else:
        state = "promoted" if (promoted or 0.0) >= (demoted or 0.0) else "demoted"

    ordered = sorted(samples)
    row.plugin = plugin or row.plugin or ""
    row.state = state
    row.window = samples
    row.p50_seconds = _pct(ordered, 0.50)
    row.p99_seconds = _pct(ordered, 0.99)
    for name in COUNTERS:
        setattr(row, name, getattr(row, name) + deltas[name])
    row.promoted_at = _ts(promoted)
    row.demoted_at = _ts(demoted)
    if deltas["errors"] > 0 and snap["last_error"]:
        row.last_error = clean_text(snap["last_error"])  # a plugin's message: a NUL would fail the batch
    row.proven_size = proven
    if quarantine_changed:
        row.quarantined = snap.get("quarantined") or ""
    row.updated_at = timezone.now()


class ProfileStore:
    """Background service: loads persisted profiles into an engine and flushes the changed ones."""

    #: Ticked on a thread of its own (execapp/worker.py): a flush waits for the database, which the
    #: housekeeper's other services (metrics, snapshots, the history's Redis flush) do not need.
    #: On the shared thread a 20 s lock on execapp_execprofilerecord left the worker's dashboard
    #: snapshot 17 s old (stale, out of the totals) and its gauges frozen.
    own_thread = True

    def __init__(self, engine: EngineLike, *, window: int | None = None, interval: float | None = None) -> None:
        self.engine = engine
        self.window = window or conf.get("PROFILE_WINDOW")
        self.interval = interval if interval is not None else conf.get("PROFILE_FLUSH_SECONDS")
        self._flushed: dict[str, _Flushed] = {}
        # The housekeeper ticks while stop() may call close() from another thread.
        self._lock = threading.Lock()
        self._circuit = Circuit("the profile store's database", (DatabaseError,), FLUSH_CIRCUIT_SECONDS)
        self.flushes = 0
        self.rows_written = 0

    def load(self) -> int:
        """Restore every persisted profile not yet used in this engine; returns how many."""
        restored = 0
        for row in ExecProfileRecord.objects.all():
            profile = self.engine.profile_for(row.matcher)
            if profile.version != 0:
                continue  # already running here: its runs merge at the next flush instead
            profile.restore(row.state, list(row.window or []), runs=row.runs, errors=row.errors,
                            timeouts=row.timeouts, promotions=row.promotions, demotions=row.demotions,
                            promoted_at=_epoch(row.promoted_at), demoted_at=_epoch(row.demoted_at),
                            last_error=row.last_error, updated_at=_epoch(row.updated_at),
                            proven_size=row.proven_size, quarantined=row.quarantined or None)
            with self._lock:
                self._flushed[row.matcher] = _Flushed(profile.version, {c: getattr(row, c) for c in COUNTERS},
                                                      row.quarantined or None)
            restored += 1
        return restored

    def _pending(self) -> list[tuple[str, int, dict[str, Any], dict[str, int], list[float], bool]]:
        """Profiles whose version moved since their last flush, with deltas and new samples."""
        pending = []
        for name, profile in dict(self.engine.profiles).items():
            version = profile.version  # read before the snapshot: a later change flushes next time
            done = self._flushed.get(name)
            if (done.version if done else 0) == version:
                continue
            snap = profile.snapshot()
            base = done.counters if done else dict.fromkeys(COUNTERS, 0)
            deltas = {c: snap[c] - base[c] for c in COUNTERS}
            window = snap["window"]
            fresh = window[len(window) - min(max(deltas["runs"], 0), len(window)):]
            changed = snap["quarantined"] != (done.quarantined if done else None)
            pending.append((name, version, snap, deltas, fresh, changed))
        return pending

    def flush(self) -> int:
        """Write every changed profile (batched transactions); returns how many rows were written."""
        with self._lock:
            pending = self._pending()
            if not pending:
                return 0
            return self._circuit.call(lambda: self._flush(pending))

    def _flush(self, pending: list[tuple[str, int, dict[str, Any], dict[str, int], list[float], bool]]) -> int:
        """Write ``pending`` (under ``_lock``)."""
        plugins = {m.name: m.plugin for m in self.engine.matchers}
        written = 0
        for start in range(0, len(pending), BATCH):
            batch = sorted(pending[start:start + BATCH], key=lambda p: p[0])
            self._write(batch, plugins)
            for name, version, snap, *_ in batch:
                self._flushed[name] = _Flushed(version, {c: snap[c] for c in COUNTERS}, snap["quarantined"])
            written += len(batch)
        self.flushes += 1
        self.rows_written += written
        return written

    def _write(self, batch: list[tuple[str, int, dict[str, Any], dict[str, int], list[float], bool]],
               plugins: dict[str, str | None]) -> None:
        names = [p[0] for p in batch]
        with transaction_deadline(FLUSH_DEADLINE_SECONDS):
            # Insert first: on SQLite this takes the write lock before anything is read.
            ExecProfileRecord.objects.bulk_create([ExecProfileRecord(matcher=n) for n in names],
                                                  ignore_conflicts=True)
            rows = {r.matcher: r for r in
                    ExecProfileRecord.objects.select_for_update().filter(matcher__in=names).order_by("matcher")}
            for name, _, snap, deltas, fresh, changed in batch:
                merge_into(rows[name], snap, deltas, fresh, self.window, plugins.get(name),
                           quarantine_changed=changed)
            ExecProfileRecord.objects.bulk_update(list(rows.values()), _FIELDS)

    def tick(self) -> None:
        """Housekeeper tick: flush what changed."""
        close_old_connections()
        self.flush()

    def close(self) -> None:
        """Final flush at worker stop (off the event loop when called from it)."""
        off_loop(self.flush)


def profile_store(worker: WorkerLike) -> ProfileStore:
    """Service factory (SERVICE_FACTORIES): warm-starts the worker's engine, then flushes in the background."""
    store = ProfileStore(worker.engine)
    started = time.perf_counter()
    try:
        restored = off_loop(store.load)
    except Exception as exc:  # a worker without its database still serves events, cold
        log.warning("could not load persisted execution profiles, starting cold: %s", exc)
    else:
        log.info("restored %d execution profiles in %.1f ms", restored, (time.perf_counter() - started) * 1000)
    return store


__all__ = ["ProfileStore", "merge_into", "off_loop", "profile_store"]
