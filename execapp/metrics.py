"""Prometheus metrics of the app, the per-worker updater service, and the /metrics view.

Hot paths only append to a deque (the engine's run observer, the pool's delay listener);
the updater, ticked on the worker's housekeeping thread, turns those into histogram
observations and copies pool/engine/profile/plugin counters into Prometheus as deltas. A
scrape refreshes the serving process's updaters first, so its own numbers are exact.

Several worker processes: prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``
set before start). The usual pile-up of one file per dead pid is handled by compaction: at
each worker start and every ``COMPACT_SECONDS``, the files of pids that no longer run are
merged into one archive per metric type (counters and histograms keep their totals) and
deleted, under an exclusive lock that the /metrics view shares. Live gauges of dead pids are
pruned before every scrape (and at exit where atexit runs). See docs/observability.md.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import fcntl
import glob
import logging
import os
import threading
import time
import weakref
from typing import Any, Iterator

from django.http import HttpRequest, HttpResponse
from prometheus_client import Counter, Gauge, Histogram

from . import conf

log = logging.getLogger("execapp.metrics")

#: Handler durations: 100 us (a Lua call) .. 30 s (a stuck plugin).
DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)
#: Scheduling delay (submit -> start): 10 us (idle hand-off) .. 10 s (a long queue).
DELAY_BUCKETS = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: Outcomes of events a client was told about (execapp_events_total); anything else is "other".
EVENT_OUTCOMES = ("ok", "error", "overloaded", "draining", "bad_json", "bad_event", "too_large", "too_deep",
                  "rate_limited", "internal_error", "unauthorized")
COMPACT_SECONDS = 60.0

# Gauges are summed over live processes ("livesum"): a dead worker's pool leaves the total.
POOL_IN_FLIGHT = Gauge("execapp_pool_in_flight", "Handlers running in pool threads now.", multiprocess_mode="livesum")
POOL_QUEUED = Gauge("execapp_pool_queued", "Handlers waiting in pool queues now.", multiprocess_mode="livesum")
POOL_CAPACITY = Gauge("execapp_pool_capacity", "Pool concurrency tokens (threads) of all workers.",
                      multiprocess_mode="livesum")
POOL_QUEUE_CAPACITY = Gauge("execapp_pool_queue_capacity", "Pool queue slots of all workers.",
                            multiprocess_mode="livesum")
POOL_THREADS = Gauge("execapp_pool_threads", "Live pool threads (running or lingering idle).",
                     multiprocess_mode="livesum")
POOL_STUCK = Gauge("execapp_pool_stuck_threads", "Pool threads running a handler past its deadline now (the "
                   "handler ignored it; past EXECAPP['STUCK_THREADS_LIMIT'] the worker is recycled).",
                   multiprocess_mode="livesum")
POOL_STUCK_TOTAL = Counter("execapp_pool_stuck_total", "Pooled handler runs that overran their deadline and "
                           "held their thread after it (each was answered with `timeout`).")
POOL_SUBMITTED = Counter("execapp_pool_submitted_total", "Handlers accepted by a pool.")
POOL_COMPLETED = Counter("execapp_pool_completed_total", "Pooled handlers finished without a pool-level failure.")
POOL_FAILED = Counter("execapp_pool_failed_total", "Pool tasks that raised (a bug: handlers report their errors).")
POOL_REJECTED = Counter("execapp_pool_rejected_total", "Submissions refused by a full or closed pool.")
POOL_FALLBACKS = Counter("execapp_pool_fallbacks_total", "Handlers run inline because the pool was full.")
POOL_OVERLOADED = Counter("execapp_pool_overloaded_total",
                          "Handlers refused with 'overloaded' after the overflow wait.")
SCHEDULING_DELAY = Histogram("execapp_pool_scheduling_delay_seconds", "Pool submit-to-start delay.",
                             buckets=DELAY_BUCKETS)
HANDLER_DURATION = Histogram("execapp_handler_duration_seconds", "Handler run time by matcher and exec class.",
                             ["matcher", "plugin", "exec_class"], buckets=DURATION_BUCKETS)
HANDLER_RUNS = Counter("execapp_handler_runs_total", "Handler runs by outcome (ok, handler_error, timeout, "
                       "overloaded).", ["outcome"])
EVENTS = Counter("execapp_events_total", "Events by the terminal outcome their client was told.", ["outcome"])
EVENTS_DISPATCHED = Counter("execapp_events_dispatched_total", "Events handed to an engine.")
PROMOTIONS = Counter("execapp_profile_promotions_total", "Matchers promoted to the pool.", ["matcher"])
DEMOTIONS = Counter("execapp_profile_demotions_total", "Matchers demoted to inline.", ["matcher"])
PLUGIN_TIMEOUTS = Counter("execapp_plugin_timeouts_total", "Plugin calls stopped by their time budget.", ["plugin"])
PLUGIN_ERRORS = Counter("execapp_plugin_errors_total", "Plugin calls that failed.", ["plugin"])
PLUGIN_WAITS = Counter("execapp_plugin_instance_waits_total", "Plugin calls that waited for an instance.",
                       ["plugin"])
PLUGIN_BUSY = Gauge("execapp_plugin_instances_busy", "Plugin instances in use.", ["plugin"],
                    multiprocess_mode="livesum")
PLUGIN_IDLE = Gauge("execapp_plugin_instances_idle", "Plugin instances idle.", ["plugin"],
                    multiprocess_mode="livesum")
PLUGIN_WAITING = Gauge("execapp_plugin_instances_waiting", "Plugin calls waiting for an instance now.", ["plugin"],
                       multiprocess_mode="livesum")

_PROFILE_COUNTERS = (("promotions", PROMOTIONS), ("demotions", DEMOTIONS))
_PLUGIN_COUNTERS = (("timeouts_total", PLUGIN_TIMEOUTS), ("errors_total", PLUGIN_ERRORS),
                    ("waits_total", PLUGIN_WAITS))
_POOL_COUNTERS = (("submitted", POOL_SUBMITTED), ("completed", POOL_COMPLETED), ("failed", POOL_FAILED),
                  ("rejected", POOL_REJECTED), ("stuck_total", POOL_STUCK_TOTAL))
_ENGINE_COUNTERS = (("fallbacks", POOL_FALLBACKS), ("overloaded", POOL_OVERLOADED), ("events", EVENTS_DISPATCHED))


def count_event(outcome: str) -> None:
    """Count one event by the terminal outcome its client got (call once per event: ``done``
    -> ``ok`` or ``error``, a refusal -> its code)."""
    EVENTS.labels(outcome if outcome in EVENT_OUTCOMES else "other").inc()


def completion_outcome(completion: Any) -> str:
    """The events_total outcome of an engine Completion: ``ok`` or ``error``."""
    return "error" if completion.errors else "ok"


def plugin_pool_rows() -> list[dict[str, Any]]:
    """Instance-pool rows from the plugins app, or [] while it does not provide them."""
    try:
        from plugins.sync import instance_pool_stats
    except Exception:  # the plugins app is optional here (and lands separately)
        return []
    try:
        return list(instance_pool_stats())
    except Exception as exc:
        log.warning("plugins.sync.instance_pool_stats failed: %s", exc)
        return []


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

    def __init__(self, worker: Any, interval: float | None = None) -> None:
        self.worker = worker
        self.interval = interval if interval is not None else conf.get("SNAPSHOT_SECONDS")
        # Appended from the event loop and pool threads; drained here. deque.append/popleft are
        # atomic, and maxlen bounds memory if the housekeeper ever stalls.
        self._runs: collections.deque = collections.deque(maxlen=200_000)
        self._delays: collections.deque = collections.deque(maxlen=200_000)
        self._lock = threading.Lock()  # tick() runs on the housekeeper and on scrapes
        self._deltas = _Deltas()
        self._children: dict[tuple[str, str, Any], Any] = {}
        self._last_compact = time.monotonic()
        self._closed = False
        for name, profile in dict(worker.engine.profiles).items():  # restored counts are not new
            for field, _ in _PROFILE_COUNTERS:
                self._deltas.prime(("profile", field, name), getattr(profile, field))
        # Hot path (the event loop for inline runs, pool threads otherwise): one tuple append;
        # label lookup, Enum.value and the histogram's locks all wait for the housekeeper.
        append_run, append_delay = self._runs.append, self._delays.append
        worker.engine.add_observer(lambda m, exec_class, elapsed, outcome:
                                   append_run((m, exec_class, elapsed, outcome)))
        worker.pool.add_listener(lambda kind, value: append_delay(value) if kind == "delay" else None)
        _updaters.add(self)

    # -- housekeeper --------------------------------------------------------------------------

    def tick(self) -> None:
        """Drain buffered observations and copy gauges and counters into Prometheus."""
        with self._lock:
            self._drain()
            self._sync_pool()
            self._sync_profiles()
            self._sync_plugins()
        if multiprocess_dir() and time.monotonic() - self._last_compact >= COMPACT_SECONDS:
            self._last_compact = time.monotonic()
            compact()

    def _drain(self) -> None:
        runs, delays = self._runs, self._delays
        for _ in range(len(runs)):
            matcher, exec_class, elapsed, outcome = runs.popleft()
            key = (matcher.name, matcher.plugin or "", exec_class)
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = HANDLER_DURATION.labels(key[0], key[1], exec_class.value)
            child.observe(elapsed)
            HANDLER_RUNS.labels(outcome).inc()
        for _ in range(len(delays)):
            SCHEDULING_DELAY.observe(delays.popleft())

    def _sync_pool(self) -> None:
        stats = self.worker.engine.stats()
        pool = stats.get("pool") or {}
        if pool:
            POOL_IN_FLIGHT.set(pool["in_flight"])
            POOL_QUEUED.set(pool["queued"])
            POOL_CAPACITY.set(pool["capacity"])
            POOL_QUEUE_CAPACITY.set(pool["queue_capacity"])
            POOL_THREADS.set(pool["workers"])
            POOL_STUCK.set(pool.get("stuck") or 0)
            for key, counter in _POOL_COUNTERS:
                self._deltas.inc(counter, ("pool", key), pool.get(key))
        for key, counter in _ENGINE_COUNTERS:
            self._deltas.inc(counter, ("engine", key), stats.get(key))
        # Refused handlers never reach the run observer: count them from the engine.
        self._deltas.inc(HANDLER_RUNS.labels("overloaded"), ("engine", "overloaded_runs"), stats.get("overloaded"))

    def _sync_profiles(self) -> None:
        for name, profile in dict(self.worker.engine.profiles).items():
            for field, counter in _PROFILE_COUNTERS:
                self._deltas.inc(counter.labels(name), ("profile", field, name), getattr(profile, field))

    def _sync_plugins(self) -> None:
        for row in plugin_pool_rows():
            plugin = str(row.get("plugin", ""))
            for field, counter in _PLUGIN_COUNTERS:
                self._deltas.inc(counter.labels(plugin), ("plugin", field, plugin), row.get(field))
            PLUGIN_BUSY.labels(plugin).set(row.get("busy", 0))
            PLUGIN_IDLE.labels(plugin).set(row.get("idle", 0))
            PLUGIN_WAITING.labels(plugin).set(row.get("waiting", 0))

    def close(self) -> None:
        """Final tick at worker stop; this worker's pool no longer counts in the live gauges."""
        if self._closed:
            return
        self.tick()
        self._closed = True
        _updaters.discard(self)
        for gauge in (POOL_IN_FLIGHT, POOL_QUEUED, POOL_CAPACITY, POOL_QUEUE_CAPACITY, POOL_THREADS, POOL_STUCK):
            gauge.set(0)


_updaters: "weakref.WeakSet[MetricsUpdater]" = weakref.WeakSet()


def metrics_updater(worker: Any) -> MetricsUpdater:
    """Service factory (SERVICE_FACTORIES): compacts dead processes' metric files, then tracks the worker."""
    if multiprocess_dir():
        try:
            compact()
        except Exception:
            log.exception("compacting %s failed", multiprocess_dir())
        _register_exit_hook()
    return MetricsUpdater(worker)


def refresh_local() -> None:
    """Bring this process's metrics up to date now (called before a scrape)."""
    for updater in list(_updaters):
        try:
            updater.tick()
        except Exception:
            log.exception("metrics refresh failed")


# -- multiprocess mode ----------------------------------------------------------------------------

def multiprocess_dir() -> str:
    """PROMETHEUS_MULTIPROC_DIR when prometheus_client runs in multiprocess mode, else ''."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")


@contextlib.contextmanager
def _dir_lock(path: str, exclusive: bool) -> Iterator[None]:
    """flock on a file in the metrics directory: compaction exclusive, scrapes shared."""
    with open(os.path.join(path, ".execapp.lock"), "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _merge_value(mode: str, old: tuple[float, float] | None, value: float, ts: float) -> tuple[float, float]:
    if old is None:
        return value, ts
    if mode == "min":
        return (value, ts) if value < old[0] else old
    if mode == "max":
        return (value, ts) if value > old[0] else old
    if mode == "mostrecent":
        return (value, ts) if ts > old[1] else old
    return old[0] + value, max(old[1], ts)  # counters, histograms, summaries, sum gauges


def _pid_of(file: str) -> tuple[str, int | None]:
    """("gauge_livesum", 123) for ".../gauge_livesum_123.db"; pid None for archives."""
    prefix, _, pid = os.path.basename(file)[:-3].rpartition("_")
    return prefix, int(pid) if pid.isdigit() else None


def _is_live_gauge(prefix: str) -> bool:
    return prefix.startswith("gauge_") and (prefix[6:].startswith("live") or prefix[6:] == "all")


def prune_dead_gauges(path: str | None = None) -> int:
    """Remove the live* and ``all`` gauge files of pids that no longer run (before every scrape).

    A uvicorn worker stopped by SIGTERM ends by re-raising the signal, so no atexit hook runs
    there; this keeps a dead worker's pool out of the live gauges whatever way it ended.
    """
    path = path or multiprocess_dir()
    removed = 0
    for file in glob.glob(os.path.join(path, "gauge_*.db")) if path else []:
        prefix, pid = _pid_of(file)
        if pid is not None and _is_live_gauge(prefix) and not _alive(pid):
            with contextlib.suppress(FileNotFoundError):  # a concurrent scrape or compaction won
                os.remove(file)
                removed += 1
    return removed


def compact(path: str | None = None) -> dict[str, int]:
    """Merge the metric files of dead pids into one archive per type and delete them.

    Counters, histograms, summaries and min/max/sum/mostrecent gauges keep their values
    in ``<type>_archive.db``; live* and ``all`` gauges of a dead pid are simply removed. Safe
    with several processes (an exclusive flock) and against scrapes through ``metrics_view``
    (they hold the lock shared, so they never see a file both archived and still present).
    """
    from prometheus_client.mmap_dict import MmapedDict

    path = path or multiprocess_dir()
    result = {"merged": 0, "removed": 0}
    if not path or not os.path.isdir(path):
        return result
    with _dir_lock(path, exclusive=True):
        groups: dict[str, list[str]] = collections.defaultdict(list)
        for file in glob.glob(os.path.join(path, "*.db")):
            prefix, pid = _pid_of(file)  # prefix: "counter", "histogram", "gauge_livesum", ...
            if pid is None or _alive(pid):
                continue  # an archive, or a live process's file
            if _is_live_gauge(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(file)
                    result["removed"] += 1
            else:
                groups[prefix].append(file)
        for prefix, files in groups.items():
            mode = prefix[6:] if prefix.startswith("gauge_") else "sum"
            archive = os.path.join(path, f"{prefix}_archive.db")
            merged: dict[str, tuple[float, float]] = {}
            for file in ([archive] if os.path.exists(archive) else []) + files:
                for key, value, ts, _ in MmapedDict.read_all_values_from_file(file):
                    merged[key] = _merge_value(mode, merged.get(key), value, ts)
            tmp = archive + ".tmp"
            if os.path.exists(tmp):
                os.remove(tmp)
            out = MmapedDict(tmp)
            try:
                for key, (value, ts) in merged.items():
                    out.write_value(key, value, ts)
            finally:
                out.close()
            os.replace(tmp, archive)  # atomic: a reader sees the old or the new archive
            for file in files:
                os.remove(file)
            result["merged"] += len(files)
    return result


_exit_hook_lock = threading.Lock()
_exit_hook_registered = False


def _register_exit_hook() -> None:
    global _exit_hook_registered
    with _exit_hook_lock:
        if not _exit_hook_registered:
            atexit.register(_mark_dead, os.getpid())
            _exit_hook_registered = True


def _mark_dead(pid: int) -> None:
    """At process exit: drop this pid's live gauges (counters wait for the next compaction)."""
    from prometheus_client import multiprocess

    path = multiprocess_dir()
    if path and os.getpid() == pid:
        multiprocess.mark_process_dead(pid, path)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics: django-prometheus's exporter, after refreshing this process's metrics and,
    in multiprocess mode, while holding the compaction lock shared. Only for the clients that
    execapp.metrics_access admits (allowed networks, bearer token); 403 with what to set otherwise."""
    from django_prometheus.exports import ExportToDjangoView

    from .metrics_access import refusal

    refused = refusal(request)
    if refused is not None:  # before any work: a refused client costs no refresh and no file read
        return HttpResponse(refused, status=403, content_type="text/plain; charset=utf-8")
    refresh_local()
    path = multiprocess_dir()
    if not path:
        return ExportToDjangoView(request)
    prune_dead_gauges(path)
    with _dir_lock(path, exclusive=False):
        return ExportToDjangoView(request)
