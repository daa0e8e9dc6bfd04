"""The dashboard's data: every worker's published snapshot, merged into workers, totals, charts.

Reads what the workers' ``SnapshotPublisher`` services published (execapp.snapshots) and starts
nothing; only a worker of this process, if there is one, re-publishes first. Marks workers silent
for ``WORKER_STALE_SECONDS`` stale and drops those silent for ``WORKER_DROP_SECONDS``.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from . import conf
from .codes import REFUSAL_CODES
from .control_registry import process_gone
from .engine.engine import COUNTERS as ENGINE_COUNTERS
from .engine.profile import COUNTERS as PROFILE_COUNTERS
from .redis_deadline import RedisDeadline
from .snapshots import (
    RATE_WINDOW_SECONDS,
    SERIES_FIELDS,
    HistoryPoint,
    backend,
    local_snapshots,
    points,
    refresh_local,
)

log = logging.getLogger("execapp.dashboard")

#: The worst worker's value counts in the total series (a percentile is not summed); ``t`` is the latest.
_WORST = ("delay_p50", "delay_p99")
_SUMMED = tuple(f for f in SERIES_FIELDS if f != "t" and f not in _WORST)


def _total_series(workers: list[dict[str, Any]], period: float) -> list[HistoryPoint]:
    """Sum of the workers' histories on a common time grid (each worker's latest point counts
    while it is at most 2.5 periods old); scheduling delay is the worst worker's."""
    events = sorted((p.t, w["worker"], p) for w in workers for p in points(w["series"]))
    if not events:
        return []
    latest: dict[str, HistoryPoint] = {}
    out: list[HistoryPoint] = []
    i = 0
    # Only the slots a point is live in (its own and the next two: 2.5 periods), not every slot
    # from the first point to the last: a worker whose clock was stepped (booted at 1970, then
    # NTP) spread its points over decades, and the grid between them was billions of empty slots
    # walked on every poll of the dashboard.
    end = int(events[-1][0] // period)  # the grid ends at the newest point
    slots = sorted({s for t, _, _ in events for k in (0, 1, 2) if (s := int(t // period) + k) <= end})
    for slot in slots:
        t_end = (slot + 1) * period
        while i < len(events) and events[i][0] < t_end:
            latest[events[i][1]] = events[i][2]
            i += 1
        live = [p for p in latest.values() if t_end - p.t <= 2.5 * period]
        if not live:
            continue
        total: dict[str, Any] = {"t": round(max(p.t for p in live), 3)}
        for f in _SUMMED:
            total[f] = round(sum(getattr(p, f) or 0 for p in live), 3)
        for f in _WORST:
            values = [getattr(p, f) for p in live if getattr(p, f) is not None]
            total[f] = max(values) if values else None
        out.append(HistoryPoint(**total))
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
                                            "states": {}, "p50": None, "p99": None,
                                            **dict.fromkeys(PROFILE_COUNTERS, 0), "promoted_at": None,
                                            "demoted_at": None, "last_error": "", "workers": 0,
                                            "quarantined": None, "pool_only": None, "refused": 0, "failures": {},
                                            "last_failure": None}
            row["workers"] += 1
            row["classes"][m["exec_class"]] = row["classes"].get(m["exec_class"], 0) + 1
            row["states"][m["state"]] = row["states"].get(m["state"], 0) + 1
            for k in PROFILE_COUNTERS:
                row[k] += m.get(k) or 0
            for k in ("p50", "p99", "promoted_at", "demoted_at"):
                if m.get(k) is not None and (row[k] is None or m[k] > row[k]):
                    row[k] = m[k]
            if m.get("last_error"):
                row["last_error"] = m["last_error"]
            row["refused"] += m.get("refused") or 0
            for code, n in (m.get("failures") or {}).items():
                row["failures"][code] = row["failures"].get(code, 0) + n
            last = m.get("last_failure")
            if last and (row["last_failure"] is None or last.get("ts", 0) > row["last_failure"].get("ts", 0)):
                row["last_failure"] = last  # the newest over every worker
            if m.get("quarantined"):  # pinned to the pool on some worker (the watchdog's reason)
                row["quarantined"] = m["quarantined"]
            if m.get("pool_only"):  # never inline: its plugin's memory cap (plugins.sync)
                row["pool_only"] = m["pool_only"]
    for row in rows.values():
        row["exec_class"] = "/".join(sorted(row["classes"]))
        row["state"] = "/".join(sorted(row["states"]))
        if row["last_failure"]:  # the event history's newest failure, in full, with its trace
            last = row["last_failure"]
            row["last_error"] = f"{last.get('code')}: {last.get('message')}"
    return sorted(rows.values(), key=lambda r: r["matcher"])


def _total(live: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"workers": len(live)}
    for key in ("capacity", "in_flight", "queued", "queue_capacity", "workers", "idle_workers", "submitted",
                "completed", "failed", "rejected", "stuck", "stuck_total"):
        total["threads" if key == "workers" else key] = sum((w["pool"] or {}).get(key, 0) for w in live)
    for key in ENGINE_COUNTERS:
        total[key] = sum(w["counts"].get(key, 0) for w in live)
    room = total["capacity"] + total["queue_capacity"]
    total["saturation"] = (total["in_flight"] + total["queued"]) / room if room else 0.0
    total["events_per_second"] = sum(w.get("events_per_second", 0.0) for w in live)
    total["refused"] = sum(w.get("refused", 0) for w in live)
    refusals: dict[str, int] = {}
    for w in live:
        for code, n in _refusals(w).items():
            refusals[code] = refusals.get(code, 0) + n
    total["refusals"] = refusals
    total["session_frames_dropped"] = sum((w.get("session_frames") or {}).get("dropped", 0) for w in live)
    total["recycling"] = sum(1 for w in live if w.get("recycling"))
    # Scheduling delay over the last closed interval (what the charts plot), the worst worker's.
    for key in ("delay_p50", "delay_p99"):
        values = [v for w in live if (v := w.get(f"interval_{key}")) is not None]
        total[key] = max(values) if values else None
    return total


def _point_now(now: float, pool: dict[str, Any], counts: dict[str, Any], eps: float, refused: int,
               delay_p50: float | None, delay_p99: float | None) -> HistoryPoint:
    """A chart point made of the current snapshot (so a chart's last point equals the cards)."""
    return HistoryPoint(t=round(now, 3), capacity=pool.get("capacity", 0), in_flight=pool.get("in_flight", 0),
                        queued=pool.get("queued", 0), queue_capacity=pool.get("queue_capacity", 0),
                        events_per_second=round(eps, 3), delay_p50=delay_p50, delay_p99=delay_p99,
                        submitted=pool.get("submitted", 0), fallbacks=counts.get("fallbacks", 0),
                        failed=pool.get("failed", 0), overloaded=counts.get("overloaded", 0), refused=refused)


def _refusals(worker: dict[str, Any]) -> dict[str, int]:
    """One worker's refusals by code: its refused handlers and refused events."""
    out: dict[str, int] = {}
    for _, _, code, n in worker.get("failures") or []:
        if code in REFUSAL_CODES:
            out[code] = out.get(code, 0) + n
    for code, n in (worker.get("event_refusals") or {}).items():
        if code in REFUSAL_CODES:
            out[code] = out.get(code, 0) + n
    return out


def _plugin_refused(worker: dict[str, Any], plugin: Any) -> int:
    """Handlers of ``plugin`` refused on one worker (plugin_busy, overloaded, quotas...)."""
    return sum(n for _, p, code, n in worker.get("failures") or [] if p == plugin and code in REFUSAL_CODES)


def history_usage() -> dict[str, Any] | None:
    """The event history's recent store: traces and bytes held, and what it evicted (None: unreadable)."""
    from .history_store import store

    try:
        return store().usage().as_dict()
    except Exception:  # Redis down: the warning above says so already when the snapshots are there too
        log.debug("the event history's usage cannot be read", exc_info=True)
        return None


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
    warning = unavailable = ""
    try:
        loaded = store.load()
    except Exception as exc:  # Redis down (a restart): answer with this process's own workers, and say so
        # (Within the request's redis_deadline, a Redis that does not answer fails at the deadline.)
        unavailable = RedisDeadline.code
        warning = (f"{unavailable}: the {store.name} backend cannot be read ({type(exc).__name__}): showing only "
                   "this process's workers, without chart history")
        loaded = local_snapshots()
    for snap, series in loaded:
        age = now - snap.get("ts", 0)
        if age > drop_after or (snap.get("stopped") and age > stale_after):
            if not warning:
                try:
                    store.drop(snap["worker"])
                except Exception:  # Redis went away since the load: the next read drops it
                    log.debug("dropping %s failed", snap.get("worker"), exc_info=True)
            continue
        if not snap.get("stopped") and process_gone(snap):
            # Killed (a SIGKILL, the watchdog, a crash) on this machine: its last snapshot showed it
            # serving, and for WORKER_STALE_SECONDS it counted in the totals. Out of them at once.
            snap["stopped"] = snap["gone"] = True
        snap["age"] = age
        snap["stale"] = age > stale_after
        snap["series"] = series
        workers.append(snap)
    workers.sort(key=lambda w: (w.get("host", ""), w.get("started_at", 0), w["worker"]))
    live = [w for w in workers if not w["stale"] and not w.get("stopped")]
    plugin_pools = [{"worker": w["worker"], **row, "refused": _plugin_refused(w, row.get("plugin"))}
                    for w in workers for row in w.pop("plugin_pools", [])]
    matchers = _aggregate_matchers(live or workers)
    for w in workers:
        w["matcher_count"] = len(w.pop("matchers", []))
        w["refusals"] = _refusals(w)
        # The chart ends at this snapshot: its last point is what the cards and tables show.
        w["series"] = [*w["series"], _point_now(now, w["pool"] or {}, w.get("counts") or {},
                                                w.get("events_per_second", 0.0), w.get("refused", 0),
                                                w.get("interval_delay_p50"), w.get("interval_delay_p99"))]
    total = _total(live)
    series = _total_series([{**w, "series": w["series"][:-1]} for w in live], period)
    if live:
        series.append(_point_now(now, total, total, total["events_per_second"], total["refused"],
                                 total["delay_p50"], total["delay_p99"]))
    return {
        "now": now,
        "backend": store.name,
        "warning": warning,
        "unavailable": unavailable,  # the code of what could not be read ("": nothing missing)
        "history": history_usage(),
        "interval": period,
        "poll_seconds": min(2.0, max(0.5, period)),
        "stale_seconds": stale_after,
        "drop_seconds": drop_after,
        "series_fields": list(SERIES_FIELDS),
        "workers": workers,
        "rate_window_seconds": RATE_WINDOW_SECONDS,
        "total": {**total, "series": series},
        "matchers": matchers,
        "plugin_pools": plugin_pools,
    }
