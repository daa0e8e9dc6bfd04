"""prometheus_client's multiprocess mode without the pile-up: compaction of dead processes' files.

Several worker processes: ``PROMETHEUS_MULTIPROC_DIR`` set before start (execapp.serve sets
it). Every process writes its own files and never removes them, so at each worker start and
every ``COMPACT_SECONDS`` the files of pids that no longer run are merged into one archive per
metric type (counters and histograms keep their totals) and deleted, under an exclusive lock
that the /metrics view holds shared. Live gauges of dead pids are pruned before every scrape
(and at exit where atexit runs). See docs/observability.md.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import fcntl
import glob
import json
import os
import threading
from typing import Callable, Iterator

#: How often a worker's metrics updater compacts the directory (seconds).
COMPACT_SECONDS = 60.0


def multiprocess_dir() -> str:
    """PROMETHEUS_MULTIPROC_DIR when prometheus_client runs in multiprocess mode, else ''."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")


@contextlib.contextmanager
def dir_lock(path: str, exclusive: bool) -> Iterator[None]:
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


def _labels_of(key: str) -> dict[str, str]:
    """The labels of an mmap file's key (prometheus_client's mmap_key: JSON [metric, name, labels, help])."""
    try:
        labels = json.loads(key)[2]
    except (ValueError, IndexError, TypeError):
        return {}
    return labels if isinstance(labels, dict) else {}


def compact(path: str | None = None, keep: Callable[[dict[str, str]], bool] | None = None) -> dict[str, int]:
    """Merge the metric files of dead pids into one archive per type and delete them.

    Counters, histograms, summaries and min/max/sum/mostrecent gauges keep their values
    in ``<type>_archive.db``; live* and ``all`` gauges of a dead pid are simply removed. Safe
    with several processes (an exclusive flock) and against scrapes through ``metrics_view``
    (they hold the lock shared, so they never see a file both archived and still present).
    ``keep`` (a test of a sample's labels, ``metrics_live.live_filter``): the archives' series it
    refuses (a deleted or renamed plugin's, its matchers') are dropped, counted in ``dropped``;
    scrapes left them out already, but every scrape read them, and plugin churn grew the archives
    for ever.
    """
    from prometheus_client.mmap_dict import MmapedDict

    path = path or multiprocess_dir()
    result = {"merged": 0, "removed": 0, "dropped": 0}
    if not path or not os.path.isdir(path):
        return result
    with dir_lock(path, exclusive=True):
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
        if keep is not None:  # archives with nothing new to merge are still filtered
            for archive in glob.glob(os.path.join(path, "*_archive.db")):
                groups.setdefault(os.path.basename(archive)[:-len("_archive.db")], [])
        for prefix, files in groups.items():
            mode = prefix[6:] if prefix.startswith("gauge_") else "sum"
            archive = os.path.join(path, f"{prefix}_archive.db")
            merged: dict[str, tuple[float, float]] = {}
            dropped = 0
            for file in ([archive] if os.path.exists(archive) else []) + files:
                for key, value, ts, _ in MmapedDict.read_all_values_from_file(file):
                    if keep is not None and not keep(_labels_of(key)):
                        dropped += 1
                        continue
                    merged[key] = _merge_value(mode, merged.get(key), value, ts)
            if not files and not dropped:
                continue  # nothing merged, nothing dropped: the archive stays as it is
            result["dropped"] += dropped
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


def register_exit_hook() -> None:
    """Once per process: at exit, drop this process's live gauges (where atexit runs at all)."""
    global _exit_hook_registered
    with _exit_hook_lock:
        if not _exit_hook_registered:
            atexit.register(mark_process_dead, os.getpid())
            _exit_hook_registered = True


def mark_process_dead(pid: int) -> None:
    """At process exit: drop this pid's live gauges (counters wait for the next compaction)."""
    from prometheus_client import multiprocess

    path = multiprocess_dir()
    if path and os.getpid() == pid:
        multiprocess.mark_process_dead(pid, path)
