"""A worker's slot number: the low-cardinality ``worker`` label of its per-worker metrics.

Under the execapp.serve supervisor it is the worker's watchdog slot (a replacement takes over
the slot of the worker it replaces). Elsewhere, with several processes sharing
PROMETHEUS_MULTIPROC_DIR (e.g. ``uvicorn --workers N``), each process claims the lowest free
number with an exclusive flock on ``worker-slot-<n>.lock`` there, released when it exits (so a
restarted process takes its predecessor's number). A single process is slot 0.
"""
from __future__ import annotations

import fcntl
import os
import threading

from .metrics_multiprocess import multiprocess_dir

#: The most slots claimed through lock files (far more than worker processes on one host).
MAX_SLOTS = 256

_lock = threading.Lock()
_claimed: tuple[int, str, int] | None = None  # (pid, directory, slot) of this process's claim; its fd stays open


def worker_slot(worker: object = None) -> str:
    """The slot number of this process's worker, as a label value ("0", "1", ...); ``worker``
    (a Worker, or None) gives its watchdog slot when it has one."""
    watch = getattr(worker, "watch", None)
    if watch is not None:
        return str(watch.slot.index)
    path = multiprocess_dir()
    if not path:
        return "0"
    return str(_claim(path))


def _claim(path: str) -> int:
    global _claimed
    with _lock:
        if _claimed is not None and _claimed[0] == os.getpid() and _claimed[1] == path:
            return _claimed[2]
        for n in range(MAX_SLOTS):
            fd = os.open(os.path.join(path, f"worker-slot-{n}.lock"), os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            # Kept open (and locked) for the life of the process: the claim ends when it exits.
            os.set_inheritable(fd, False)
            _claimed = (os.getpid(), path, n)
            return n
        return MAX_SLOTS  # every number taken: share one overflow label rather than fail
