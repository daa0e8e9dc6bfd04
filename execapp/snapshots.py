"""Worker snapshots for the dashboard: every worker publishes its state, the dashboard collects them.

Through Redis when ``settings.REDIS_URL`` is set (so the dashboard of any worker shows every
worker of the deployment), in this process's memory otherwise. Each worker keeps its latest
snapshot in one hash field and a short history of points (one per ``SNAPSHOT_SECONDS``,
``DASHBOARD_HISTORY_SECONDS`` long) for the charts. A worker silent for
``WORKER_STALE_SECONDS`` is marked stale; after ``WORKER_DROP_SECONDS`` it is dropped.
"""
from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time
import weakref
from typing import Any, Protocol

from . import conf
from .metrics import plugin_pool_rows

log = logging.getLogger("execapp.snapshots")

#: The fields of one history point, in order (the JSON carries arrays, not objects).
SERIES_FIELDS = ("t", "capacity", "in_flight", "queued", "queue_capacity", "events_per_second", "delay_p50",
                 "delay_p99", "submitted", "fallbacks", "failed", "overloaded")
_SUMMED = ("capacity", "in_flight", "queued", "queue_capacity", "events_per_second", "submitted", "fallbacks",
           "failed", "overloaded")
KEY_PREFIX = "execapp:obs:"


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

    def publish(self, snapshot: dict[str, Any], point: list | None) -> None: ...

    def remove(self, worker_id: str) -> None: ...

    def load(self) -> list[tuple[dict[str, Any], list[list]]]: ...

    def drop(self, worker_id: str) -> None: ...


class LocalBackend:
    """Snapshots of the workers of this process only (the embedded single-process default)."""

    name = "local"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, tuple[dict[str, Any], collections.deque]] = {}

    def publish(self, snapshot: dict[str, Any], point: list | None) -> None:
        with self._lock:
            _, series = self._workers.get(snapshot["worker"], (None, collections.deque(maxlen=history_points())))
            if point is not None:
                series.append(point)
            self._workers[snapshot["worker"]] = (snapshot, series)

    def remove(self, worker_id: str) -> None:
        self.drop(worker_id)

    def load(self) -> list[tuple[dict[str, Any], list[list]]]:
        with self._lock:
            return [(dict(snap), list(series)) for snap, series in self._workers.values()]  # collect() edits

    def drop(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)


class RedisBackend:
    """Snapshots of every worker sharing ``REDIS_URL``: one hash of latest snapshots, one list per worker."""

    name = "redis"

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.key_prefix = conf.redis_key(KEY_PREFIX)
        self.workers_key = self.key_prefix + "workers"

    def _series_key(self, worker_id: str) -> str:
        return f"{self.key_prefix}series:{worker_id}"

    def publish(self, snapshot: dict[str, Any], point: list | None) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.workers_key, snapshot["worker"], json.dumps(snapshot, default=str))
        if point is not None:
            key = self._series_key(snapshot["worker"])
            pipe.rpush(key, json.dumps(point))
            pipe.ltrim(key, -history_points(), -1)
            pipe.expire(key, int(conf.get("WORKER_DROP_SECONDS")) + 60)  # a crashed worker's list goes too
        pipe.execute()

    def remove(self, worker_id: str) -> None:
        self.drop(worker_id)

    def load(self) -> list[tuple[dict[str, Any], list[list]]]:
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
        return [(snap, [json.loads(p) for p in points]) for snap, points in zip(snaps, series)]

    def drop(self, worker_id: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hdel(self.workers_key, worker_id)
        pipe.delete(self._series_key(worker_id))
        pipe.execute()


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


def matcher_rows(engine: Any, recent: dict[str, collections.deque] | None = None) -> list[dict[str, Any]]:
    """One row per registered matcher: its plugin, kind and profile (without the window).

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
        rows.append({"matcher": m.name, "plugin": m.plugin, "kind": m.kind.value, "pattern": m.pattern, **snap})
    return rows


class SnapshotPublisher:
    """Worker service: publishes the worker's snapshot and a history point every ``interval``."""

    def __init__(self, worker: Any, store: Backend | None = None, interval: float | None = None) -> None:
        self.worker = worker
        self.store = store or backend()
        self.interval = interval if interval is not None else conf.get("SNAPSHOT_SECONDS")
        self.host = socket.gethostname()
        self._lock = threading.Lock()  # the housekeeper and dashboard refreshes both publish
        self._delays: collections.deque = collections.deque(maxlen=100_000)
        self._runs: collections.deque = collections.deque(maxlen=100_000)
        self._recent: dict[str, collections.deque] = {}
        self._last: tuple[float, int] | None = None  # (time, events) at the last point
        self._eps = 0.0
        self._interval_delay: tuple[float | None, float | None] = (None, None)
        self.stopped = False
        # Hot path (pool threads at every task start; the loop or a pool thread after every
        # handler run): one append each, the rest happens at publish time.
        append_delay, append_run = self._delays.append, self._runs.append
        worker.pool.add_listener(lambda kind, value: append_delay(value) if kind == "delay" else None)
        worker.engine.add_observer(lambda m, exec_class, elapsed, outcome: append_run((m.name, elapsed)))
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

    def snapshot(self, advance: bool) -> tuple[dict[str, Any], list | None]:
        """Build the snapshot; with ``advance`` also close the interval and make a history point."""
        status = self.worker.status()
        pool = status.pop("pool", None) or {}
        now = time.time()
        events = status.get("events", 0)
        if advance:
            delays = sorted(self._delays.popleft() for _ in range(len(self._delays)))
            self._interval_delay = (_pct(delays, 0.50), _pct(delays, 0.99))
            if self._last is not None and now > self._last[0]:
                self._eps = max(0.0, (events - self._last[1]) / (now - self._last[0]))
            self._last = (now, events)
        counts = {k: status.pop(k) for k in ("events", "inline", "pooled", "fallbacks", "overloaded", "errors")
                  if k in status}
        snap = {
            **status,
            "host": self.host,
            "ts": now,
            "stopped": self.stopped,
            "pool": pool,
            "counts": counts,
            "events_per_second": self._eps,
            "interval_delay_p50": self._interval_delay[0],
            "interval_delay_p99": self._interval_delay[1],
            "matchers": matcher_rows(self.worker.engine, self._recent_runs()),
            "plugin_pools": plugin_pool_rows(),
        }
        point = None
        if advance:
            point = [round(now, 3), pool.get("capacity", 0), pool.get("in_flight", 0), pool.get("queued", 0),
                     pool.get("queue_capacity", 0), round(self._eps, 3), self._interval_delay[0],
                     self._interval_delay[1], pool.get("submitted", 0), counts.get("fallbacks", 0),
                     pool.get("failed", 0), counts.get("overloaded", 0)]
        return snap, point

    def publish(self, advance: bool = True) -> dict[str, Any]:
        """Publish now; ``advance=False`` refreshes the latest snapshot without a history point."""
        with self._lock:
            snap, point = self.snapshot(advance)
            self.store.publish(snap, point)
            return snap

    def tick(self) -> None:
        """Housekeeper tick: publish the snapshot and a history point."""
        self.publish(advance=True)

    def close(self) -> None:
        """At worker stop: publish a last snapshot marked stopped (the dashboard drops it when stale)."""
        self.stopped = True
        _publishers.discard(self)
        try:
            self.publish(advance=True)
        except Exception as exc:
            log.warning("final snapshot of %s not published: %s", self.worker.id, exc)


_publishers: "weakref.WeakSet[SnapshotPublisher]" = weakref.WeakSet()


def snapshot_publisher(worker: Any) -> SnapshotPublisher:
    """Service factory (SERVICE_FACTORIES): publishes this worker's snapshot for the dashboard."""
    publisher = SnapshotPublisher(worker)
    try:
        publisher.tick()  # visible at once, not one interval later
    except Exception as exc:
        log.warning("first snapshot of %s not published: %s", worker.id, exc)
    return publisher


def refresh_local() -> None:
    """Re-publish this process's workers' snapshots now, so the dashboard reads exact numbers."""
    for publisher in list(_publishers):
        try:
            publisher.publish(advance=False)
        except Exception as exc:
            log.warning("snapshot refresh failed: %s", exc)


# -- collection (the dashboard's side) ----------------------------------------------------------

def _total_series(workers: list[dict[str, Any]], period: float) -> list[list]:
    """Sum of the workers' histories on a common time grid (each worker's latest point counts
    while it is at most 2.5 periods old); scheduling delay is the worst worker's."""
    events = sorted((p[0], w["worker"], p) for w in workers for p in w["series"])
    if not events:
        return []
    idx = {f: i for i, f in enumerate(SERIES_FIELDS)}
    latest: dict[str, list] = {}
    out: list[list] = []
    i = 0
    start = int(events[0][0] // period)
    end = int(events[-1][0] // period)
    for slot in range(start, end + 1):
        t_end = (slot + 1) * period
        while i < len(events) and events[i][0] < t_end:
            latest[events[i][1]] = events[i][2]
            i += 1
        live = [p for p in latest.values() if t_end - p[0] <= 2.5 * period]
        if not live:
            continue
        point: list = [None] * len(SERIES_FIELDS)
        point[0] = round(max(p[0] for p in live), 3)
        for f in _SUMMED:
            point[idx[f]] = round(sum(p[idx[f]] or 0 for p in live), 3)
        for f in ("delay_p50", "delay_p99"):
            values = [p[idx[f]] for p in live if p[idx[f]] is not None]
            point[idx[f]] = max(values) if values else None
        out.append(point)
    return out


def _aggregate_matchers(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per matcher over every worker: counts summed, percentiles the worst worker's, classes listed."""
    rows: dict[str, dict[str, Any]] = {}
    for w in workers:
        for m in w.get("matchers", []):
            row = rows.get(m["matcher"])
            if row is None:
                row = rows[m["matcher"]] = {"matcher": m["matcher"], "plugin": m.get("plugin"),
                                            "kind": m.get("kind"), "pattern": m.get("pattern"), "classes": {},
                                            "states": {}, "p50": None, "p99": None, "runs": 0, "errors": 0,
                                            "timeouts": 0, "promotions": 0, "demotions": 0, "promoted_at": None,
                                            "demoted_at": None, "last_error": "", "workers": 0,
                                            "quarantined": None}
            row["workers"] += 1
            row["classes"][m["exec_class"]] = row["classes"].get(m["exec_class"], 0) + 1
            row["states"][m["state"]] = row["states"].get(m["state"], 0) + 1
            for k in ("runs", "errors", "timeouts", "promotions", "demotions"):
                row[k] += m.get(k) or 0
            for k in ("p50", "p99", "promoted_at", "demoted_at"):
                if m.get(k) is not None and (row[k] is None or m[k] > row[k]):
                    row[k] = m[k]
            if m.get("last_error"):
                row["last_error"] = m["last_error"]
            if m.get("quarantined"):  # pinned to the pool on some worker (the watchdog's reason)
                row["quarantined"] = m["quarantined"]
    for row in rows.values():
        row["exec_class"] = "/".join(sorted(row["classes"]))
        row["state"] = "/".join(sorted(row["states"]))
    return sorted(rows.values(), key=lambda r: r["matcher"])


def _total(live: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"workers": len(live)}
    for key in ("capacity", "in_flight", "queued", "queue_capacity", "workers", "idle_workers", "submitted",
                "completed", "failed", "rejected", "stuck", "stuck_total"):
        total["threads" if key == "workers" else key] = sum((w["pool"] or {}).get(key, 0) for w in live)
    for key in ("events", "inline", "pooled", "fallbacks", "overloaded", "errors"):
        total[key] = sum(w["counts"].get(key, 0) for w in live)
    room = total["capacity"] + total["queue_capacity"]
    total["saturation"] = (total["in_flight"] + total["queued"]) / room if room else 0.0
    total["events_per_second"] = sum(w.get("events_per_second", 0.0) for w in live)
    total["recycling"] = sum(1 for w in live if w.get("recycling"))
    for key in ("delay_p50", "delay_p99"):
        values = [(w["pool"] or {}).get(key) for w in live if (w["pool"] or {}).get(key) is not None]
        total[key] = max(values) if values else None
    return total


def collect(refresh: bool = True) -> dict[str, Any]:
    """Everything the dashboard shows: workers (stale marked, long-silent dropped), total, charts,
    matchers and plugin instance pools."""
    if refresh:
        refresh_local()
    store = backend()
    now = time.time()
    stale_after = conf.get("WORKER_STALE_SECONDS")
    drop_after = conf.get("WORKER_DROP_SECONDS")
    period = conf.get("SNAPSHOT_SECONDS")
    workers = []
    for snap, series in store.load():
        age = now - snap.get("ts", 0)
        if age > drop_after or (snap.get("stopped") and age > stale_after):
            store.drop(snap["worker"])
            continue
        snap["age"] = age
        snap["stale"] = age > stale_after
        snap["series"] = series
        workers.append(snap)
    workers.sort(key=lambda w: (w.get("host", ""), w.get("started_at", 0), w["worker"]))
    live = [w for w in workers if not w["stale"] and not w.get("stopped")]
    plugin_pools = [{"worker": w["worker"], **row} for w in workers for row in w.pop("plugin_pools", [])]
    matchers = _aggregate_matchers(live or workers)
    for w in workers:
        w["matcher_count"] = len(w.pop("matchers", []))
    return {
        "now": now,
        "backend": store.name,
        "interval": period,
        "poll_seconds": min(2.0, max(0.5, period)),
        "stale_seconds": stale_after,
        "drop_seconds": drop_after,
        "series_fields": list(SERIES_FIELDS),
        "workers": workers,
        "total": {**_total(live), "series": _total_series(live, period)},
        "matchers": matchers,
        "plugin_pools": plugin_pools,
    }
