"""ExecPool: bounded concurrency tokens, a bounded queue and lazy, lingering worker threads."""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Callable

from .errors import ConfigError

log = logging.getLogger("execapp.pool")

Task = Callable[[], Any]
_STOP = object()  # handed to an idle worker to make it exit (drain)


class _Worker:
    """One pool thread; ``slot`` is where a submitter hands it a task while it lingers idle."""

    __slots__ = ("slot",)

    def __init__(self) -> None:
        self.slot: queue.SimpleQueue = queue.SimpleQueue()


class ExecPool:
    """A bounded pool for slow handlers: ``max_workers`` tokens and a ``queue_size`` queue.

    ``try_submit`` never blocks. It hands the task to an idle worker, or takes a token and
    starts a worker, or queues the task, or returns False. Workers start when there is work
    and exit after ``idle_seconds`` without any (a Python thread costs ~94 us to start, so a
    short linger keeps bursty loads from paying that on every task; see docs/benchmarks.md).

    Exit protocol (design.md §2): a worker about to exit takes ``_exit_lock``, makes a last
    non-blocking check of the queue and only if it is empty returns its token; a submitter
    that queued a task takes the same lock and wakes an idle worker or starts a drain worker
    with a free token. So after a successful enqueue a live worker will see the task or a new
    one is started: no task is stranded. The direct paths (idle hand-off, token + start) never
    touch ``_exit_lock``.
    """

    def __init__(self, max_workers: int = 64, queue_size: int = 128, idle_seconds: float = 2.0,
                 name: str = "execpool") -> None:
        if max_workers < 1 or queue_size < 0 or idle_seconds < 0:
            raise ConfigError(f"ExecPool(max_workers={max_workers}, queue_size={queue_size}, "
                              f"idle_seconds={idle_seconds}): need max_workers >= 1, queue_size >= 0, "
                              "idle_seconds >= 0")
        self.max_workers = max_workers
        self.queue_size = queue_size
        self.idle_seconds = idle_seconds
        self.name = name
        self._tokens = threading.Semaphore(max_workers)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size) if queue_size else queue.Queue(maxsize=1)
        self._queue_enabled = queue_size > 0
        self._exit_lock = threading.Lock()
        # Idle workers waiting for a hand-off. list.pop/append/remove are atomic under the GIL,
        # which is what lets the hand-off path skip every lock.
        self._idle: list[_Worker] = []
        # Counters are bumped from many threads; "+=" on an attribute is not atomic, so they
        # share one small lock that is never held across a task.
        self._stats_lock = threading.Lock()
        self._closed = False
        self._workers = 0
        self._running = 0
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.rejected = 0
        self._delays: collections.deque[float] = collections.deque(maxlen=1024)
        self._listeners: list[Callable[[str, float], None]] = []
        self._thread_seq = 0

    # -- submission ---------------------------------------------------------------------------

    def try_submit(self, fn: Task) -> bool:
        """Run ``fn`` in the pool if there is room now; never blocks. False means full or closed."""
        # Count the task as submitted before checking `closed`: drain() sets `closed` first and
        # then waits for submitted == finished, so a submitter racing it is either counted or refused.
        with self._stats_lock:
            self.submitted += 1
        if self._closed:
            return self._reject()
        task = (fn, time.perf_counter())
        while True:  # 1. an idle, lingering worker takes it: no thread start, no lock
            try:
                worker = self._idle.pop()
            except IndexError:
                break
            worker.slot.put(task)
            return True
        if self._tokens.acquire(blocking=False):  # 2. a free token: start a worker for it
            self._start(task)
            return True
        if not self._queue_enabled:
            return self._reject()
        try:  # 3. queue it
            self._queue.put_nowait(task)
        except queue.Full:
            return self._reject()
        # 4. boundary: make sure a live worker will see the queued task.
        with self._exit_lock:
            try:
                self._idle.pop().slot.put(None)  # wake one idle worker to drain the queue
            except IndexError:
                if self._tokens.acquire(blocking=False):
                    self._start(None)
        return True

    def _reject(self) -> bool:
        with self._stats_lock:
            self.submitted -= 1
            self.rejected += 1
        return False

    def _start(self, task: tuple | None) -> None:
        with self._stats_lock:
            self._workers += 1
            self._thread_seq += 1
            seq = self._thread_seq
        threading.Thread(target=self._work, args=(task,), name=f"{self.name}-{seq}", daemon=True).start()

    # -- the worker ---------------------------------------------------------------------------

    def _work(self, task: tuple | None) -> None:
        me = _Worker()
        while True:
            if task is _STOP:
                return self._exit()
            if task is not None:
                self._run(task)
            try:
                task = self._queue.get_nowait()
                continue
            except queue.Empty:
                pass
            if self.idle_seconds > 0 and not self._closed:
                self._idle.append(me)
                try:
                    task = me.slot.get(timeout=self.idle_seconds)
                    continue
                except queue.Empty:
                    try:
                        self._idle.remove(me)
                    except ValueError:
                        # A submitter claimed this worker as it timed out: its task is on the way.
                        task = me.slot.get()
                        continue
            with self._exit_lock:
                try:
                    task = self._queue.get_nowait()  # the last check before giving the token back
                except queue.Empty:
                    return self._exit()

    def _exit(self) -> None:
        with self._stats_lock:
            self._workers -= 1
        self._tokens.release()

    def _run(self, task: tuple) -> None:
        fn, submitted_at = task
        started = time.perf_counter()
        delay = started - submitted_at
        with self._stats_lock:
            self._running += 1
            self._delays.append(delay)
        self._notify("delay", delay)
        ok = True
        try:
            fn()
        except BaseException:  # a task must never kill its worker
            ok = False
            log.exception("pool task %r failed", fn)
        with self._stats_lock:
            self._running -= 1
            if ok:
                self.completed += 1
            else:
                self.failed += 1
        if not ok:
            self._notify("failed", 1.0)

    # -- observers ----------------------------------------------------------------------------

    def add_listener(self, fn: Callable[[str, float], None]) -> None:
        """Call ``fn(kind, value)`` on pool events: ("delay", seconds) and ("failed", 1)."""
        self._listeners.append(fn)

    def _notify(self, kind: str, value: float) -> None:
        for fn in self._listeners:
            try:
                fn(kind, value)
            except Exception:
                log.exception("pool listener failed")

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True while draining or drained: ``try_submit`` refuses."""
        return self._closed

    def drain(self, timeout: float | None = None) -> bool:
        """Stop accepting work, finish queued and running tasks; True if all finished in time."""
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._release_idle()
            if self.busy() <= 0:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.002)

    def resume(self) -> None:
        """Accept work again after a drain."""
        self._closed = False

    def busy(self) -> int:
        """Accepted tasks not yet finished (queued, handed over or running)."""
        with self._stats_lock:
            return self.submitted - self.completed - self.failed

    def _release_idle(self) -> None:
        while True:
            try:
                self._idle.pop().slot.put(_STOP)
            except IndexError:
                return

    def stats(self) -> dict[str, Any]:
        """Counters and gauges of this pool, plus scheduling delay (submit -> start) p50/p99."""
        with self._stats_lock:
            delays = sorted(self._delays)
            s = {
                "capacity": self.max_workers,
                "in_flight": self._running,
                "queued": self._queue.qsize(),
                "queue_capacity": self.queue_size,
                "workers": self._workers,
                "idle_workers": len(self._idle),
                "submitted": self.submitted,
                "completed": self.completed,
                "failed": self.failed,
                "rejected": self.rejected,
                "closed": self._closed,
            }
        s["saturation"] = (s["in_flight"] + s["queued"]) / (self.max_workers + self.queue_size)
        s["delay_p50"] = delays[len(delays) // 2] if delays else None
        s["delay_p99"] = delays[min(len(delays) - 1, int(0.99 * len(delays)))] if delays else None
        return s
