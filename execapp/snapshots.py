"""Worker snapshots for the dashboard: what a worker publishes, where, and the service that does it.

Through Redis when ``settings.REDIS_URL`` is set (so the dashboard of any worker shows every
worker of the deployment), in this process's memory otherwise. Each worker keeps its latest
snapshot in one hash field and a short history of points (one per ``SNAPSHOT_SECONDS``,
``DASHBOARD_HISTORY_SECONDS`` long) for the charts. The dashboard's side, which reads them, is
``execapp.dashboard_data``.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import socket
import threading
import time
import weakref
from typing import Any, NamedTuple, Protocol, Sequence

from . import conf, extensions, history
from .codes import REFUSAL_CODES
from .control_registry import process_namespace
from .engine.engine import COUNTERS as ENGINE_COUNTERS
from .engine.ratelog import RateLimitedLog
from .outbox import SessionFrameTotals
from .redis_deadline import deadline_client, redis_deadline, remaining
from .redis_layer import layer_stats
from .seams import EngineLike, WorkerLike
from .worker_slot import worker_slot

log = logging.getLogger("execapp.snapshots")
_rare = RateLimitedLog(log, 60.0)


class HistoryPoint(NamedTuple):
    """One point of a worker's chart history, one per SNAPSHOT_SECONDS. Stored and sent as a JSON
    array in this field order (``SERIES_FIELDS``, which the dashboard's script reads)."""

    t: float
    capacity: int
    in_flight: int
    queued: int
    queue_capacity: int
    events_per_second: float
    delay_p50: float | None
    delay_p99: float | None
    submitted: int
    fallbacks: int
    failed: int
    overloaded: int
    refused: int  # handlers and events refused so far (REFUSAL_CODES), from the event history


SERIES_FIELDS = HistoryPoint._fields
KEY_PREFIX = "execapp:obs:"


def as_point(values: Sequence[Any]) -> HistoryPoint | None:
    """A stored array as a HistoryPoint, or None when it has another shape (a point written by an
    older version during a rolling deploy)."""
    return HistoryPoint(*values) if len(values) == len(SERIES_FIELDS) else None


def _pct(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def history_points() -> int:
    """How many points each worker keeps for the charts."""
    return max(2, int(conf.get("DASHBOARD_HISTORY_SECONDS") / conf.get("SNAPSHOT_SECONDS")))


class Backend(Protocol):
    """Where snapshots go: this process's memory or Redis."""

    name: str

    def publish(self, snapshot: dict[str, Any], point: HistoryPoint | None) -> None: ...

    def remove(self, worker_id: str) -> None: ...

    def load(self) -> list[tuple[dict[str, Any], list[HistoryPoint]]]: ...

    def drop(self, worker_id: str) -> None: ...


class LocalBackend:
    """Snapshots of the workers of this process only (the embedded single-process default)."""

    name = "local"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, tuple[dict[str, Any], collections.deque]] = {}

    def publish(self, snapshot: dict[str, Any], point: Sequence[Any] | None) -> None:
        with self._lock:
            _, series = self._workers.get(snapshot["worker"], (None, collections.deque(maxlen=history_points())))
            if point is not None:
                series.append(point)
            self._workers[snapshot["worker"]] = (snapshot, series)

    def remove(self, worker_id: str) -> None:
        self.drop(worker_id)

    def load(self) -> list[tuple[dict[str, Any], list[HistoryPoint]]]:
        with self._lock:
            workers = [(dict(snap), list(series)) for snap, series in self._workers.values()]  # collect() edits
        return [(snap, points(series)) for snap, series in workers]

    def drop(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)


class RedisBackend:
    """Snapshots of every worker sharing ``REDIS_URL``: one hash of latest snapshots, one list per worker."""

    name = "redis"

    def __init__(self, url: str) -> None:
        # Within a dashboard request's redis_deadline, its calls share the request's deadline.
        self.client = deadline_client(url, socket_timeout=2, socket_connect_timeout=2)
        self.key_prefix = conf.redis_key(KEY_PREFIX)
        self.workers_key = self.key_prefix + "workers"
        #: worker id -> wall-clock time of its last snapshot: what each publish expires dead workers by.
        self.seen_key = self.key_prefix + "workers:seen"
        #: When entries without a score (written by an older version's workers, during a rolling
        #: deploy) were last given one: they are looked for once per WORKER_DROP_SECONDS.
        self._adopted_at = float("-inf")

    def _series_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}series:{worker_id}"

    def publish(self, snapshot: dict[str, Any], point: HistoryPoint | None) -> None:
        """Write this worker's snapshot (and chart point), and forget workers silent for
        WORKER_DROP_SECONDS: a worker that died publishes nothing again, and before, its entry
        stayed until someone opened the dashboard."""
        drop_after = conf.get("WORKER_DROP_SECONDS")
        ts = float(snapshot.get("ts") or time.time())
        if time.monotonic() - self._adopted_at >= drop_after:
            self._adopt(time.time())
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.workers_key, snapshot["worker"], json.dumps(snapshot, default=str))
        pipe.zadd(self.seen_key, {snapshot["worker"]: ts})
        for key in (self.workers_key, self.seen_key):  # every worker gone: the whole entry goes too
            pipe.expire(key, int(drop_after) + 60)
        if point is not None:
            key = self._series_key(snapshot["worker"])
            pipe.rpush(key, json.dumps(point))
            pipe.ltrim(key, -history_points(), -1)
            pipe.expire(key, int(drop_after) + 60)  # a crashed worker's list goes too
        pipe.zrangebyscore(self.seen_key, "-inf", f"({ts - drop_after!r}")
        silent = pipe.execute()[-1]
        for raw in silent:  # rare: a worker that died (each deletion is idempotent: workers may race)
            worker_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            if worker_id != snapshot["worker"]:
                log.info("forgetting worker %s: no snapshot for %.0f s (WORKER_DROP_SECONDS)", worker_id, drop_after)
                self.drop(worker_id)

    def _adopt(self, now: float) -> None:
        """Score the entries written without seen_key (an older version's) as seen now."""
        known = self.client.hkeys(self.workers_key)
        if known:
            seen: dict[Any, float] = {k: now for k in known}  # (the members as Redis gave them: bytes)
            self.client.zadd(self.seen_key, seen, nx=True)
        self._adopted_at = time.monotonic()

    def remove(self, worker_id: str) -> None:
        self.drop(worker_id)

    def load(self) -> list[tuple[dict[str, Any], list[HistoryPoint]]]:
        raw = self.client.hgetall(self.workers_key)
        snaps = []
        for value in raw.values():
            try:
                snaps.append(json.loads(value))
            except ValueError:
                continue
        pipe = self.client.pipeline(transaction=False)
        for snap in snaps:
            pipe.lrange(self._series_key(snap["worker"]), 0, -1)
        series = pipe.execute() if snaps else []
        return [(snap, points(json.loads(p) for p in stored)) for snap, stored in zip(snaps, series)]

    def drop(self, worker_id: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hdel(self.workers_key, worker_id)
        pipe.zrem(self.seen_key, worker_id)
        pipe.delete(self._series_key(worker_id))
        pipe.execute()


def points(stored: Any) -> list[HistoryPoint]:
    """The stored arrays of one history as HistoryPoints (those of another shape left out)."""
    return [p for p in map(as_point, stored) if p is not None]


_local = LocalBackend()
_redis: dict[str, RedisBackend] = {}
_redis_lock = threading.Lock()


def backend() -> Backend:
    """The backend settings select: Redis when REDIS_URL is set, else this process's memory."""
    url = conf.redis_url()
    if not url:
        return _local
    with _redis_lock:
        if url not in _redis:
            _redis[url] = RedisBackend(url)
        return _redis[url]


RECENT_RUNS = 1000  # per matcher: the dashboard's p50/p99 are over these runs
#: Events per second is the rate over this many seconds (at most): one busy second between quiet
#: ones (a burst of events whose handlers then run for seconds) shows as a rate, not as 0.
RATE_WINDOW_SECONDS = 10.0


def matcher_rows(engine: EngineLike, recent: dict[str, collections.deque] | None = None,
                 failures: dict[str, dict[str, int]] | None = None,
                 last_failure: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per registered matcher: its plugin, kind and profile (without the window), and
    from the event history its failures and refusals by code and its newest failure.

    p50/p99 are over the matcher's last ``RECENT_RUNS`` runs in this worker when it has run
    here (``recent``); otherwise over the profile's window. The profile's own window is a
    decision window: a promotion empties it, so a handler always over 2x the slow threshold
    would show none.
    """
    rows = []
    for m in engine.matchers:
        snap = m.profile.snapshot()
        snap.pop("window", None)
        runs = sorted(recent[m.name]) if recent and recent.get(m.name) else None
        if runs:
            snap["p50"], snap["p99"] = _pct(runs, 0.50), _pct(runs, 0.99)
        codes = (failures or {}).get(m.name, {})
        rows.append({"matcher": m.name, "plugin": m.plugin, "kind": m.kind.value, "pattern": m.pattern, **snap,
                     "failures": codes, "refused": sum(n for c, n in codes.items() if c in REFUSAL_CODES),
                     "last_failure": (last_failure or {}).get(m.name)})
    return rows


def history_counts(worker: WorkerLike) -> tuple[list[list[Any]], dict[str, int], dict[str, dict[str, Any]]]:
    """This worker's failed and refused handlers ([matcher, plugin, code, count]), refused events
    by code, and each matcher's newest failure, from the event history's recorder (empty without one)."""
    rec = history.current()
    if rec is None or rec.worker is not worker:
        return [], {}, {}
    # dict(...) copies in one C call, safe while the housekeeper's flush updates the counters.
    failures = [[mt, plugin, code, n] for (mt, plugin, code), n in dict(rec.handler_failures).items()]
    return failures, dict(rec.event_refusals), dict(rec.last_failure)


#: All the Redis calls of one publish (the snapshot, its point, the silent workers' removal) end
#: within EXECAPP[this] of its start, not retried past it (execapp/redis_deadline.py).
PUBLISH_SETTING = "SNAPSHOT_PUBLISH_DEADLINE_SECONDS"


class SnapshotPublisher:
    """Worker service: publishes the worker's snapshot and a history point every ``interval``."""

    def __init__(self, worker: WorkerLike, store: Backend | None = None, interval: float | None = None) -> None:
        self.worker = worker
        self.store = store or backend()
        self.interval = interval if interval is not None else conf.get("SNAPSHOT_SECONDS")
        self.host = socket.gethostname()
        self.pidns = process_namespace()  # a dashboard on this machine sees at once that the process is gone
        self._lock = threading.Lock()  # the state snapshot() reads and advances (held for its ms only)
        # Publishes one at a time, in the order their snapshots were built: held while the backend
        # (Redis) is written, which the dashboard's fallback to snapshots built here needs not wait for.
        self._publishing = threading.Lock()
        self._delays: collections.deque = collections.deque(maxlen=100_000)
        self._runs: collections.deque = collections.deque(maxlen=100_000)
        self._recent: dict[str, collections.deque] = {}
        self._samples: collections.deque[tuple[float, int]] = collections.deque()  # (time, events) per point
        self._eps = 0.0
        self._interval_delay: tuple[float | None, float | None] = (None, None)
        self.stopped = False
        # Hot path (pool threads at every task start; the loop or a pool thread after every
        # handler run): one append each, the rest happens at publish time.
        append_delay, append_run = self._delays.append, self._runs.append
        worker.pool.add_listener(lambda kind, value: append_delay(value) if kind == "delay" else None)
        worker.engine.add_observer(lambda m, exec_class, elapsed, outcome, event: append_run((m.name, elapsed)))
        _publishers.add(self)

    def _recent_runs(self) -> dict[str, collections.deque]:
        runs, recent = self._runs, self._recent
        for _ in range(len(runs)):
            name, elapsed = runs.popleft()
            ring = recent.get(name)
            if ring is None:
                ring = recent[name] = collections.deque(maxlen=RECENT_RUNS)
            ring.append(elapsed)
        return recent

    def snapshot(self, advance: bool) -> tuple[dict[str, Any], HistoryPoint | None]:
        """Build the snapshot; with ``advance`` also close the interval and make a history point."""
        status = self.worker.status()
        pool = status.pop("pool", None) or {}
        now = time.time()
        events = status.get("events", 0)
        if advance:
            delays = sorted(self._delays.popleft() for _ in range(len(self._delays)))
            self._interval_delay = (_pct(delays, 0.50), _pct(delays, 0.99))
            self._samples.append((now, events))
            while len(self._samples) > 1 and self._samples[1][0] <= now - RATE_WINDOW_SECONDS:
                self._samples.popleft()
        self._eps = self._rate(now, events)
        counts = {k: status.pop(k) for k in ENGINE_COUNTERS if k in status}
        failures, event_refusals, last_failure = history_counts(self.worker)
        by_matcher: dict[str, dict[str, int]] = {}
        for mt, _, code, n in failures:
            by_matcher.setdefault(mt, {})[code] = by_matcher.get(mt, {}).get(code, 0) + n
        refused = (sum(n for _, _, code, n in failures if code in REFUSAL_CODES)
                   + sum(n for code, n in event_refusals.items() if code in REFUSAL_CODES))
        snap = {
            **status,
            "host": self.host,
            "pidns": self.pidns,
            "ts": now,
            "stopped": self.stopped,
            "pool": pool,
            "counts": counts,
            "slot": worker_slot(self.worker),
            "events_per_second": self._eps,
            "rate_window_seconds": RATE_WINDOW_SECONDS,
            "interval_delay_p50": self._interval_delay[0],
            "interval_delay_p99": self._interval_delay[1],
            "matchers": matcher_rows(self.worker.engine, self._recent_runs(), by_matcher, last_failure),
            "plugin_pools": extensions.rows("plugin_pools"),
            "failures": failures,
            "event_refusals": event_refusals,
            "refused": refused,
            # This process's outboxes: frames of other session members dropped for a member that
            # fell behind (it got one `lagged` frame each time it caught up).
            "session_frames": SessionFrameTotals.read(),
            # The Redis channel layer's buffers (execapp/redis_layer.py): at most one per live channel.
            "channel_layer": layer_stats(),
        }
        point = None
        if advance:
            point = HistoryPoint(
                t=round(now, 3), capacity=pool.get("capacity", 0), in_flight=pool.get("in_flight", 0),
                queued=pool.get("queued", 0), queue_capacity=pool.get("queue_capacity", 0),
                events_per_second=round(self._eps, 3), delay_p50=self._interval_delay[0],
                delay_p99=self._interval_delay[1], submitted=pool.get("submitted", 0),
                fallbacks=counts.get("fallbacks", 0), failed=pool.get("failed", 0),
                overloaded=counts.get("overloaded", 0), refused=refused)
        return snap, point

    def _rate(self, now: float, events: int) -> float:
        """Events per second since the oldest sample within RATE_WINDOW_SECONDS (the one at or
        just before the window's start): over whole published points, so it never reads 0 in
        the seconds after a burst while the window still holds it."""
        if not self._samples:
            return 0.0
        t0, e0 = self._samples[0]
        span = now - t0
        return max(0.0, (events - e0) / span) if span >= 0.5 * self.interval and span > 0 else self._eps

    def publish(self, advance: bool = True, wait: float | None = None) -> dict[str, Any]:
        """Publish now; ``advance=False`` refreshes the latest snapshot without a history point.
        ``wait``: how long to wait for a publish under way (the housekeeper's, which may be waiting
        on Redis) before giving up with TimeoutError; None: as long as it takes."""
        if not self._publishing.acquire(timeout=-1 if wait is None else wait):
            raise TimeoutError(f"the snapshot of {self.worker.id} is being published already (waiting on its backend)")
        try:
            with self._lock:
                snap, point = self.snapshot(advance)
            # The housekeeper's publish (or a stop's) gets its own deadline for all its Redis calls:
            # a Redis that does not answer must not hold the other services' ticks. Within a
            # request's deadline (refresh_local) the request's bounds it.
            bound = redis_deadline(setting=PUBLISH_SETTING) if remaining() is None else contextlib.nullcontext()
            with bound:
                self.store.publish(snap, point)
            return snap
        finally:
            self._publishing.release()

    def tick(self) -> None:
        """Housekeeper tick: publish the snapshot and a history point. While Redis is down (a
        restart) each tick tries again: one warning when publishing fails, one when it works again
        (not a traceback a second)."""
        try:
            self.publish(advance=True)
        except Exception as exc:
            if not getattr(self, "_publish_failing", False):
                log.warning("snapshot of %s not published (retrying every %.1f s): %r", self.worker.id,
                            self.interval, exc)
            self._publish_failing = True
            return
        if getattr(self, "_publish_failing", False):
            log.warning("snapshot of %s published again", self.worker.id)
            self._publish_failing = False

    def close(self) -> None:
        """At worker stop: publish a last snapshot marked stopped (the dashboard drops it when stale)."""
        self.stopped = True
        _publishers.discard(self)
        try:
            self.publish(advance=True)
        except Exception as exc:
            log.warning("final snapshot of %s not published: %s", self.worker.id, exc)


_publishers: "weakref.WeakSet[SnapshotPublisher]" = weakref.WeakSet()


def snapshot_publisher(worker: WorkerLike) -> SnapshotPublisher:
    """Service factory (SERVICE_FACTORIES): publishes this worker's snapshot for the dashboard."""
    publisher = SnapshotPublisher(worker)
    try:
        publisher.tick()  # visible at once, not one interval later
    except Exception as exc:
        log.warning("first snapshot of %s not published: %s", worker.id, exc)
    return publisher


def local_snapshots() -> list[tuple[dict[str, Any], list[HistoryPoint]]]:
    """This process's workers' snapshots built now, without chart history: what the dashboard
    shows while its backend (Redis) cannot be read."""
    out: list[tuple[dict[str, Any], list[HistoryPoint]]] = []
    for publisher in list(_publishers):
        try:
            with publisher._lock:  # (not held by a publish waiting on Redis: that holds _publishing)
                snap, _ = publisher.snapshot(advance=False)
        except Exception as exc:  # a worker stopping meanwhile: the others are still shown
            _rare.warning(("local", type(exc).__name__), "snapshot of a local worker failed: %r", exc)
            continue
        out.append((snap, []))
    return out


#: Within a request's redis_deadline, how long its refresh waits for a publish under way (one takes
#: ~1 ms; a longer one waits on Redis, and the request's deadline is for its own calls).
REFRESH_WAIT_SECONDS = 0.25


def refresh_local() -> None:
    """Re-publish this process's workers' snapshots now, so the dashboard reads exact numbers."""
    left = remaining()  # within a request's redis_deadline: a publish under way is waited for briefly
    wait = None if left is None else min(left, REFRESH_WAIT_SECONDS)
    for publisher in list(_publishers):
        try:
            publisher.publish(advance=False, wait=wait)
        except Exception as exc:  # Redis down: the dashboard polls every 2 s, one line a minute is enough
            _rare.warning(("refresh", type(exc).__name__), "snapshot refresh failed: %r", exc)
