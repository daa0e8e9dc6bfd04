"""The metrics updater: a worker service keeping the Prometheus metrics in step with its worker.

Hot paths only append to a deque (the engine's run observer, the pool's delay listener); the
updater, ticked on the worker's housekeeping thread, turns those into histogram observations
and copies pool, engine, profile and plugin-pool counters into Prometheus as deltas. A scrape
refreshes the serving process's updaters first (``refresh_local``), so its own numbers are exact.
"""
from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
import weakref
from typing import Any, Callable

from . import conf, extensions, history
from . import metrics as m
from .codes import REFUSAL_CODES
from .metrics_forget import forget
from .metrics_live import live_filter
from .metrics_multiprocess import COMPACT_SECONDS, compact, multiprocess_dir, register_exit_hook
from .outbox import SessionFrameTotals
from .seams import WorkerLike
from .worker_slot import worker_slot

log = logging.getLogger("execapp.metrics")

#: (stats key, counter) pairs copied as deltas: profile fields, plugin-pool row keys, pool stats,
#: engine counts (execapp.engine.engine.COUNTERS).
_PROFILE_COUNTERS = (("promotions", m.PROMOTIONS), ("demotions", m.DEMOTIONS))
_PLUGIN_COUNTERS = (("timeouts_total", m.PLUGIN_TIMEOUTS), ("errors_total", m.PLUGIN_ERRORS),
                    ("waits_total", m.PLUGIN_WAITS))
_POOL_COUNTERS = (("submitted", m.POOL_SUBMITTED), ("completed", m.POOL_COMPLETED), ("failed", m.POOL_FAILED),
                  ("rejected", m.POOL_REJECTED), ("stuck_total", m.POOL_STUCK_TOTAL))
_ENGINE_COUNTERS = (("fallbacks", m.POOL_FALLBACKS), ("overloaded", m.POOL_OVERLOADED),
                    ("events", m.EVENTS_DISPATCHED))


class _Deltas:
    """Turns monotonic counters read from stats into Prometheus increments (never negative)."""

    def __init__(self) -> None:
        self._last: dict[Any, float] = {}

    def prime(self, key: Any, value: float) -> None:
        self._last[key] = value

    def inc(self, counter: Any, key: Any, value: float | None) -> None:
        if value is None:
            return
        last = self._last.get(key, 0)
        if value > last:
            counter.inc(value - last)
            self._last[key] = value
        elif value < last and key[0] == "plugin":
            self._last[key] = value  # a plugin pool was rebuilt (edited plugin): its counts restart


class MetricsUpdater:
    """Worker service: keeps the Prometheus metrics in step with one worker's engine and pool."""

    def __init__(self, worker: WorkerLike, interval: float | None = None) -> None:
        self.worker = worker
        self.interval = interval if interval is not None else conf.get("SNAPSHOT_SECONDS")
        # Appended from the event loop and pool threads; drained here. deque.append/popleft are
        # atomic, and maxlen bounds memory if the housekeeper ever stalls.
        self._runs: collections.deque = collections.deque(maxlen=200_000)
        self._delays: collections.deque = collections.deque(maxlen=200_000)
        self._lock = threading.Lock()  # tick() runs on the housekeeper and on scrapes
        self._deltas = _Deltas()
        self._children: dict[tuple[str, str, Any], Any] = {}
        self._runs_by_outcome: dict[str, Any] = {}
        self._last_compact = time.monotonic()
        self._closed = False
        # The per-worker gauges' children, labelled with the worker's slot number (low cardinality).
        self.slot = worker_slot(worker)
        self._gauges = {g: g.labels(self.slot) for g in m.WORKER_GAUGES}
        # The process's outbox totals count from here (another worker of this process had its own start).
        self._dropped = m.SESSION_FRAMES_DROPPED.labels(self.slot)
        self._deltas.prime(("outbox", "dropped"), SessionFrameTotals.dropped)
        for name, profile in dict(worker.engine.profiles).items():  # restored counts are not new
            for field, _ in _PROFILE_COUNTERS:
                self._deltas.prime(("profile", field, name), getattr(profile, field))
        # Hot path (the event loop for inline runs, pool threads otherwise): one tuple append;
        # label lookup, Enum.value and the histogram's locks all wait for the housekeeper.
        append_run, append_delay = self._runs.append, self._delays.append
        worker.engine.add_observer(lambda matcher, exec_class, elapsed, outcome, event:
                                   append_run((matcher, exec_class, elapsed, outcome)))
        worker.pool.add_listener(lambda kind, value: append_delay(value) if kind == "delay" else None)
        _updaters.add(self)

    # -- housekeeper --------------------------------------------------------------------------

    def tick(self) -> None:
        """Drain buffered observations and copy gauges and counters into Prometheus."""
        m.flush_done()
        with self._lock:
            self._drain()
            self._sync_pool()
            self._sync_profiles()
            self._sync_plugins()
            self._sync_history()
        if time.monotonic() - self._last_compact >= COMPACT_SECONDS:
            self._last_compact = time.monotonic()
            self.forget_gone()

    def forget_gone(self) -> int:
        """Compact dead processes' metric files and forget the series of plugins and matchers no
        worker of this process serves (execapp.metrics_forget). Only while every such worker is
        ready (its plugins loaded): before, every plugin would look deleted. How many series went."""
        keep = _process_keep()
        if keep is None:
            if multiprocess_dir():
                compact()
            return 0
        gone = forget(keep)
        if gone:
            # The cached children of forgotten series: a plugin that comes back gets new ones.
            self._children = {k: c for k, c in self._children.items() if keep({"matcher": k[0], "plugin": k[1]})}
            log.info("forgot %d metric series of plugins or matchers no longer served", gone)
        return gone

    def _drain(self) -> None:
        # Batched per label set: each Prometheus increment takes the value's lock and, in
        # multiprocess mode, writes the worker's mmap file, so one observation per run cost
        # three of them (sum, bucket, outcome counter) on this thread, which shares the GIL
        # with the event loop. A tick now writes each touched value once.
        runs, delays = self._runs, self._delays
        durations: dict[tuple[str, str, Any], list[float]] = {}
        outcomes: dict[str, int] = {}
        for _ in range(len(runs)):
            matcher, exec_class, elapsed, outcome = runs.popleft()
            key = (matcher.name, matcher.plugin or "", exec_class)
            amounts = durations.get(key)
            if amounts is None:
                amounts = durations[key] = []
            amounts.append(elapsed)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        for key, amounts in durations.items():
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = m.HANDLER_DURATION.labels(key[0], key[1], key[2].value)
            observe_many(child, amounts)
        for outcome, count in outcomes.items():
            child = self._runs_by_outcome.get(outcome)
            if child is None:
                child = self._runs_by_outcome[outcome] = m.HANDLER_RUNS.labels(outcome)
            child.inc(count)
        if delays:
            observe_many(m.SCHEDULING_DELAY, [delays.popleft() for _ in range(len(delays))])

    def _sync_pool(self) -> None:
        stats = self.worker.engine.stats()
        pool = stats.get("pool") or {}
        g = self._gauges
        g[m.WORKER_DRAINING].set(1 if getattr(self.worker, "draining", False) else 0)
        if pool:
            g[m.POOL_IN_FLIGHT].set(pool["in_flight"])
            g[m.POOL_QUEUED].set(pool["queued"])
            g[m.POOL_CAPACITY].set(pool["capacity"])
            g[m.POOL_QUEUE_CAPACITY].set(pool["queue_capacity"])
            g[m.POOL_THREADS].set(pool["workers"])
            g[m.POOL_STUCK].set(pool.get("stuck") or 0)
            for key, counter in _POOL_COUNTERS:
                self._deltas.inc(counter, ("pool", key), pool.get(key))
        for key, counter in _ENGINE_COUNTERS:
            self._deltas.inc(counter, ("engine", key), stats.get(key))
        # Refused handlers never reach the run observer: count them from the engine.
        self._deltas.inc(m.HANDLER_RUNS.labels("overloaded"), ("engine", "overloaded_runs"), stats.get("overloaded"))
        self._deltas.inc(self._dropped, ("outbox", "dropped"), SessionFrameTotals.dropped)

    def _sync_profiles(self) -> None:
        # Profiles outlive their matchers (one re-added keeps its own): a removed matcher's series
        # are not made again here once forgotten (forget_gone); they have no runs to count.
        serving = {matcher.name for matcher in self.worker.engine.matchers}
        for name, profile in dict(self.worker.engine.profiles).items():
            if name not in serving:
                continue
            for field, counter in _PROFILE_COUNTERS:
                self._deltas.inc(counter.labels(name), ("profile", field, name), getattr(profile, field))

    def _sync_plugins(self) -> None:
        for row in extensions.rows("plugin_pools"):
            plugin = str(row.get("plugin", ""))
            for field, counter in _PLUGIN_COUNTERS:
                self._deltas.inc(counter.labels(plugin), ("plugin", field, plugin), row.get(field))
            m.PLUGIN_BUSY.labels(plugin).set(row.get("busy", 0))
            m.PLUGIN_IDLE.labels(plugin).set(row.get("idle", 0))
            m.PLUGIN_WAITING.labels(plugin).set(row.get("waiting", 0))

    def _sync_history(self) -> None:
        # The event history's recorder counts failed and refused handlers from every outcome the
        # connections delivered (refusals never reach the run observer).
        recorder = history.current()
        if recorder is None or getattr(recorder, "worker", None) is not self.worker:
            return
        for (matcher, plugin, code), count in list(recorder.handler_failures.items()):
            self._deltas.inc(m.HANDLER_FAILURES.labels(matcher, plugin, code), ("failures", matcher, plugin, code),
                             count)
        for code, count in list(recorder.event_refusals.items()):
            if code in REFUSAL_CODES:
                self._deltas.inc(m.EVENT_REFUSALS.labels(self.slot, code), ("refusals", code), count)
        self._deltas.inc(m.HISTORY_TRACES, ("history", "recorded"), recorder.recorded)
        self._deltas.inc(m.HISTORY_DROPPED, ("history", "dropped"), recorder.dropped)

    def close(self) -> None:
        """Final tick at worker stop; this worker's pool no longer counts in the live gauges."""
        if self._closed:
            return
        self.tick()
        self._closed = True
        _updaters.discard(self)
        for child in self._gauges.values():
            child.set(0)


_updaters: "weakref.WeakSet[MetricsUpdater]" = weakref.WeakSet()


def _process_keep() -> Callable[[dict[str, str]], bool] | None:
    """Keep a series that any running worker of this process serves (the registry is the process's:
    one worker's filter alone dropped another's series); None while one is not ready (or none runs)."""
    keeps = []
    for updater in list(_updaters):
        ready = getattr(updater.worker, "ready", None)
        keep = live_filter(updater.worker) if ready is None or ready.is_set() else None
        if keep is None:
            return None
        keeps.append(keep)
    if not keeps:
        return None
    return lambda labels: any(keep(labels) for keep in keeps)


def observe_many(histogram: Any, amounts: list[float]) -> None:
    """Observe every amount in ``histogram`` (a Histogram without labels, or a labelled child),
    touching its sum and each bucket once: what ``observe`` per amount leaves, at a fraction of
    the writes (tests/execapp/test_metrics_updater.py compares the two)."""
    if not amounts:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for amount in amounts:  # a prometheus_client whose internals differ: the public way
            histogram.observe(amount)
        return
    counts = [0] * len(bounds)
    for amount in amounts:
        # The first bucket whose upper bound holds the amount, as observe() picks it (the
        # last bound is +Inf). NaN holds in no bucket there, so in none here.
        if amount == amount:
            counts[bisect.bisect_left(bounds, amount)] += 1
    total.inc(sum(amounts))
    for i, count in enumerate(counts):
        if count:
            buckets[i].inc(count)


def metrics_updater(worker: WorkerLike) -> MetricsUpdater:
    """Service factory (execapp.worker.SERVICE_FACTORIES): compacts dead processes' metric files,
    then tracks the worker."""
    if multiprocess_dir():
        try:
            compact()
        except Exception:
            log.exception("compacting %s failed", multiprocess_dir())
        register_exit_hook()
    return MetricsUpdater(worker)


def refresh_local() -> None:
    """Bring this process's metrics up to date now (called before a scrape)."""
    m.flush_done()  # also in a process with no worker (yet)
    for updater in list(_updaters):
        try:
            updater.tick()
        except Exception:
            log.exception("metrics refresh failed")
