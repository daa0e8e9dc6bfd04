"""ExecPool: bounded concurrency tokens, a bounded queue and lazy, lingering worker threads."""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from time import monotonic, perf_counter, sleep
from typing import Any, Callable

from .errors import ConfigError
from .fairqueue import FairQueue
from .ratelog import RateLimitedLog

log = logging.getLogger("execapp.pool")
_rlog = RateLimitedLog(log)

Task = Callable[[], Any]
_STOP = object()  # handed to an idle worker to make it exit (drain)

#: How often the watcher scans the running runs that have a deadline (seconds): an overrun is
#: reported at most this late. One scan of <= max_workers entries costs microseconds.
WATCH_INTERVAL = 0.05
#: How long the watcher thread lingers with nothing to watch before it exits (seconds).
WATCH_LINGER = 2.0
#: ExecPool's defaults, and EXECAPP['POOL_MAX_WORKERS'], ['POOL_QUEUE_SIZE'], ['POOL_IDLE_SECONDS']
#: (execapp/conf.py reads them from here). Why workers linger 2 s: see ExecPool.
MAX_WORKERS = 64
QUEUE_SIZE = 128
IDLE_SECONDS = 2.0
#: EXECAPP['POOL_RESERVE']'s default: the fraction of the threads no one owner's tasks may hold.
RESERVE = 0.125

#: How long the pool's starter thread (ExecPool._start) lingers with no worker to start before it
#: exits (seconds), and how long it waits before trying a failed start again.
STARTER_LINGER = 30.0
START_RETRY = 0.1

_RUNNING, _STUCK, _FINISHED = 0, 1, 2


def count_value(counter: itertools.count) -> int:
    """The current value of an itertools.count used as a lock-free counter."""
    # repr(count(5)) == "count(5)": the only way to read an itertools.count without bumping it.
    return int(repr(counter)[6:-1])


class _Worker:
    """One pool thread; ``slot`` is where a submitter hands it a task while it lingers idle."""

    __slots__ = ("slot",)

    def __init__(self) -> None:
        self.slot: queue.SimpleQueue = queue.SimpleQueue()


class Watch:
    """One running task with a deadline, in the pool's watch table (see ``ExecPool.watch``)."""

    __slots__ = ("deadline", "on_overrun", "state")

    def __init__(self, deadline: float, on_overrun: Callable[[], None]) -> None:
        self.deadline = deadline
        self.on_overrun = on_overrun
        self.state = _RUNNING


class ExecPool:
    """A bounded pool for slow handlers: ``max_workers`` tokens and a ``queue_size`` queue.

    ``try_submit`` never blocks. It hands the task to an idle worker, or takes a token and
    starts a worker, or queues the task, or returns False. Workers start when there is work
    and exit after ``idle_seconds`` without any.

    Why workers linger (default 2 s): a Python thread costs ~94 us to start (far more while
    other threads hold the GIL: ``Thread.start()`` waits until the new thread runs, so the
    pool's one starter thread starts workers, never the submitter, i.e. the event loop: see
    ``_start``). Measured on the 2-core build machine (bench/bench_engine.py,
    docs/benchmarks.md), a submit-to-completion round trip with ``idle_seconds=0`` cost
    1.6-2.6x a lingering worker's back to back (59 vs 26 us in one run) and 3.5-5.7x with one
    task every 2 ms (168 vs 38 us), the bursty case. An idle lingering worker blocks on its
    own queue and costs no CPU. Against ThreadPoolExecutor on the same task: round trip about
    parity (0.71-1.2x across runs), pipelined 0.18-0.24x per task (no Future, no lock on the
    hot path). A task that takes a token goes to a hand-off deque that its new worker checks
    first, so a worker just finishing can run it before the new thread is up, and the thread
    start (~94 us) is not on that task's critical path.

    Exit protocol (docs/architecture.md, "Design rules"): a worker about to exit takes ``_exit_lock``, makes a last
    non-blocking check of the queue and only if it is empty returns its token; a submitter
    that queued a task takes the same lock and wakes an idle worker or starts a drain worker
    with a free token. So after a successful enqueue a live worker will see the task or a new
    one is started: no task is stranded. The direct paths (idle hand-off, token + start) never
    touch ``_exit_lock``.

    Lock-free bookkeeping: free tokens and free queue slots are lists of placeholders and the
    hand-off is a deque, whose pop/append are atomic single C calls (under the GIL, and
    internally locked on free-threaded builds); counters are itertools.count objects, bumped
    with ``next`` for the same reason. The queue is a FairQueue (one line per owner, served in
    turn), whose append and popleft take its own leaf lock for a few O(1) steps; the direct
    paths (idle hand-off, token + start) take no lock at all.
    """

    def __init__(self, max_workers: int = MAX_WORKERS, queue_size: int = QUEUE_SIZE,
                 idle_seconds: float = IDLE_SECONDS, name: str = "execpool", reserve: int = 0) -> None:
        if max_workers < 1 or queue_size < 0 or idle_seconds < 0 or not 0 <= reserve < max_workers:
            raise ConfigError(f"ExecPool(max_workers={max_workers}, queue_size={queue_size}, "
                              f"idle_seconds={idle_seconds}, reserve={reserve}): need max_workers >= 1, "
                              "queue_size >= 0, idle_seconds >= 0 and 0 <= reserve < max_workers")
        self.max_workers = max_workers
        # The reserve: threads no one owner's tasks may hold (tasks of owner "" are nobody's).
        # Why: an owner alone on a worker took every thread with one frame's fan-out (the pool
        # share is work-conserving, enforced only once a second owner is seen), and the next
        # owner's first pooled handler waited for one of those to finish (1.2-1.6 s with 1.2 s
        # handlers, up to their timeout). Past its cap an owner's tasks queue; a worker takes a
        # queued task only of an owner under its cap, and the worker that ends an owner's task
        # looks at the queue right after, so a capped owner's queued tasks are never stranded.
        self.reserve = reserve
        self._owner_cap = max_workers - reserve if reserve else 0  # 0: no cap
        self._owned: dict[str, int] = {}  # owner -> its tasks holding a worker (under _owned_lock)
        self._owned_lock = threading.Lock()
        self.queue_size = queue_size
        self.idle_seconds = idle_seconds
        self.name = name
        self._tokens: list[None] = [None] * max_workers  # one per worker that may run
        self._slots: list[None] = [None] * queue_size  # one per task that may wait in the queue
        # One line per owner, served in turn (FairQueue): a newly arrived owner's task waits for
        # about one queued task of each other owner, not for another owner's whole backlog.
        self._queue: FairQueue[tuple[Task, float, str]] = FairQueue()
        # Tasks that took a token: each has a worker started after it was put here, but the
        # first worker free takes it (a worker just finishing beats a thread still starting).
        self._handoff: collections.deque[tuple[Task, float, str]] = collections.deque()
        self._exit_lock = threading.Lock()
        self._idle: list[_Worker] = []  # lingering workers, each waiting on its own slot
        self._closed = False
        self._attempts = itertools.count()  # try_submit calls
        self._refused = itertools.count()  # ...that returned False (rejected + uncounted retries)
        self._rejected = itertools.count()
        self._completed = itertools.count()
        self._failed = itertools.count()
        self._spawned = itertools.count()  # worker threads started
        # Worker starts asked of the starter thread (see _start); the lock orders a request
        # against the starter's exit.
        self._start_requests: queue.SimpleQueue = queue.SimpleQueue()
        self._starter: threading.Thread | None = None
        self._starter_lock = threading.Lock()
        self._exited = itertools.count()
        self._delays: collections.deque[float] = collections.deque(maxlen=1024)
        self._listeners: list[Callable[[str, float], None]] = []
        self._capacity_listeners: list[Callable[[], None]] = []
        # The watch table: touched by pool threads (watch/finish) and the watcher, under one lock.
        self._watch_lock = threading.Lock()
        self._watched: set[Watch] = set()
        self._watcher: threading.Thread | None = None
        self._stuck = 0  # watched tasks past their deadline whose function has not returned
        self._stuck_total = itertools.count()

    # -- submission ---------------------------------------------------------------------------

    def try_submit(self, fn: Task, *, count_rejection: bool = True, owner: str = "") -> bool:
        """Run ``fn`` in the pool if there is room now; never blocks. False means full or closed.

        ``owner``: whose task it is (the engine passes the event's tenant). Queued tasks are run
        owner by owner in turn (FairQueue), each owner's in arrival order.
        ``count_rejection=False``: a retry (an overflow wait trying for a slot) is not counted
        again in ``rejected`` each time it finds the pool still full."""
        # Counted before checking `closed`: drain() sets `closed` first and then waits for every
        # counted attempt to be refused or finished, so a racing submitter is never missed.
        next(self._attempts)
        if self._closed:
            return self._refuse(count_rejection)
        task = (fn, perf_counter(), owner)
        idle = self._idle
        tokens = self._tokens
        counted = bool(owner) and self._owner_cap > 0
        if counted and not self._own(owner):
            pass  # at its cap: only the queue, whatever threads are free (they are the reserve)
        elif self._direct(task, idle, tokens):
            return True
        elif counted:
            self._disown(owner)  # no worker free: it waits in the queue uncounted, like any other
        try:  # 3. a free queue slot: queue it
            self._slots.pop()
        except IndexError:
            return self._refuse(count_rejection)
        self._queue.append(task, owner)
        # 4. boundary: make sure a live worker will see the queued task.
        with self._exit_lock:
            try:
                idle.pop().slot.put(None)  # wake one idle worker to drain the queue
            except IndexError:
                try:
                    tokens.pop()
                except IndexError:
                    pass  # every token is held by a live worker, which checks the queue before exiting
                else:
                    try:
                        self._start(None)
                    except Exception as exc:
                        # The task is queued (accepted): the next submission or a live worker
                        # runs it; keep the token so that next start can be tried again.
                        tokens.append(None)
                        _rlog.error(("start", type(exc).__name__), "pool %s could not start a worker: %r",
                                    self.name, exc)
        return True

    def _direct(self, task: tuple[Task, float, str], idle: list[_Worker], tokens: list[None]) -> bool:
        """Hand ``task`` to a worker at once if one is free or may start (False: none)."""
        if idle:  # 1. a lingering worker takes it: no thread start, no lock
            try:
                worker = idle.pop()
            except IndexError:
                pass
            else:
                worker.slot.put(task)
                return True
        if tokens:  # 2. a free token: start a worker for it
            try:
                tokens.pop()
            except IndexError:
                pass
            else:
                self._handoff.append(task)
                try:
                    self._start(None)
                except BaseException:
                    # No thread (e.g. "can't start new thread"): take the task back if no other
                    # worker took it meanwhile, give the token back, and let the caller report it.
                    try:
                        self._handoff.remove(task)
                    except ValueError:
                        return True  # a live worker took it: it is accepted and will run
                    tokens.append(None)
                    if task[2] and self._owner_cap:
                        self._disown(task[2])
                    self._refuse(True)
                    raise
                return True
        return False

    # -- the reserve (owners' caps) -------------------------------------------------------------

    def _own(self, owner: str) -> bool:
        """Count one more task of ``owner`` holding a worker, unless it is at its cap (False)."""
        with self._owned_lock:
            n = self._owned.get(owner, 0)
            if n >= self._owner_cap:
                return False
            self._owned[owner] = n + 1
            return True

    def _disown(self, owner: str) -> None:
        with self._owned_lock:  # (never raises: it runs in a worker's finally)
            n = self._owned.get(owner, 0) - 1
            if n > 0:
                self._owned[owner] = n
            else:
                self._owned.pop(owner, None)

    def _may_take(self, owner: Any) -> bool:
        return not owner or self._owned.get(owner, 0) < self._owner_cap

    def _take_queued(self) -> tuple[Task, float, str]:
        """The next queued task a worker may run (an owner at its cap is passed over, counted
        when taken); IndexError when there is none."""
        if not self._owner_cap:
            return self._queue.popleft()
        with self._owned_lock:  # (then the queue's own lock: always in this order)
            task = self._queue.popleft_where(self._may_take)
            owner = task[2]
            if owner:
                self._owned[owner] = self._owned.get(owner, 0) + 1
            return task

    def _queued_runnable(self) -> bool:
        """A queued task some worker may take now (a hint, read without the locks)."""
        queue_ = self._queue
        if not self._owner_cap or not queue_:
            return bool(queue_)
        return queue_.any_key(self._may_take)

    def _refuse(self, count: bool) -> bool:
        next(self._refused)
        if count:
            next(self._rejected)
        return False

    def _start(self, task: tuple | None) -> None:
        """Have a worker started for a token just taken, by the pool's starter thread, not by the
        caller (the event loop): ``Thread.start()`` waits until the new thread runs, and while
        busy threads (guests) hold the GIL each start took 20-400 ms, 64 of them 1.3 s with two
        busy threads and 5.9 s with eight; on the loop every connection waited that long. Raises
        only when no starter thread can be started (then nothing was asked)."""
        with self._starter_lock:
            if self._starter is None:
                starter = threading.Thread(target=self._starts, name=f"{self.name}-starter", daemon=True)
                starter.start()  # may raise: nothing asked yet
                self._starter = starter
            self._start_requests.put(task)

    def _starts(self) -> None:
        """The starter thread: start a worker for each request; exit after STARTER_LINGER idle."""
        requests = self._start_requests
        while True:
            try:
                task = requests.get(timeout=STARTER_LINGER)
            except queue.Empty:
                with self._starter_lock:
                    if requests.empty():
                        self._starter = None
                        return
                continue
            while True:
                seq = next(self._spawned) + 1
                try:
                    threading.Thread(target=self._work, args=(task,), name=f"{self.name}-{seq}", daemon=True).start()
                    break
                except Exception as exc:
                    # Its token stays taken and its task waits (in the hand-off deque or the
                    # queue, where a live worker may take it first) until a start succeeds.
                    next(self._exited)  # counted as started above: it never was
                    _rlog.error(("start", type(exc).__name__), "pool %s could not start a worker, retrying every "
                                "%g s: %r", self.name, START_RETRY, exc)
                    sleep(START_RETRY)

    # -- the worker ---------------------------------------------------------------------------

    def _work(self, task: Any) -> None:
        me = _Worker()
        tasks = self._queue
        handoff = self._handoff
        idle = self._idle
        while True:
            stop = task is _STOP  # drain: exit, but through the same final check as any exit
            if task is not None and not stop:
                self._run(task)
            # Nothing in `handoff` is stranded: each task there has a worker started after it
            # was added, whose first step is this check, so checks pending >= tasks waiting.
            if handoff:
                try:
                    task = handoff.popleft()
                except IndexError:
                    pass
                else:
                    continue
            if tasks:
                try:
                    task = self._take_queued()
                except IndexError:
                    pass
                else:
                    self._slots.append(None)
                    if self._capacity_listeners:
                        self._capacity()  # a queue slot freed
                    continue
            if not stop and self.idle_seconds > 0 and not self._closed:
                idle.append(me)
                if self._queued_runnable():
                    # A task queued between our check and our joining `idle` may have found no
                    # idle worker to wake: look again now that we are visible.
                    try:
                        idle.remove(me)
                    except ValueError:
                        pass  # a submitter claimed us meanwhile: its hand-off is in our slot
                    else:
                        task = None
                        continue
                if self._capacity_listeners:
                    self._capacity()  # an idle worker is ready for a hand-off
                try:
                    task = me.slot.get(timeout=self.idle_seconds)
                    continue
                except queue.Empty:
                    try:
                        idle.remove(me)
                    except ValueError:
                        # A submitter claimed this worker as it timed out: its task is on the way.
                        task = me.slot.get()
                        continue
            with self._exit_lock:
                try:
                    task = self._take_queued()  # the last check before giving the token back
                except IndexError:
                    self._exit()
                    break
                self._slots.append(None)
        if self._capacity_listeners:
            self._capacity()  # a token came back

    def _exit(self) -> None:
        next(self._exited)
        self._tokens.append(None)

    def _run(self, task: tuple[Task, float, str]) -> None:
        fn, submitted_at, owner = task
        delay = perf_counter() - submitted_at
        self._delays.append(delay)
        if self._listeners:
            self._notify("delay", delay)
        try:
            fn()
        except BaseException as exc:  # a task must never kill its worker
            next(self._failed)
            _rlog.exception(("task", type(exc).__name__), "pool task %r failed", fn)
            if self._listeners:
                self._notify("failed", 1.0)
        else:
            next(self._completed)
        finally:
            if owner and self._owner_cap:
                self._disown(owner)  # before this worker looks at the queue (see __init__)

    # -- deadlines ----------------------------------------------------------------------------

    def watch(self, deadline: float, on_overrun: Callable[[], None]) -> Watch:
        """Watch the calling task until ``finish``: past ``deadline`` (time.monotonic()), the
        watcher thread calls ``on_overrun()`` once and counts the task as stuck. Cheap: one
        lock round trip; the thread starts only when something is watched."""
        w = Watch(deadline, on_overrun)
        with self._watch_lock:
            if self._watcher is None:
                # Started under the lock: the thread's first look at the table (and its exit,
                # which clears _watcher) waits for it, so exactly one watcher ever runs.
                watcher = threading.Thread(target=self._watch_loop, name=f"{self.name}-watcher", daemon=True)
                watcher.start()  # may raise (no threads left): nothing registered then
                self._watcher = watcher
            self._watched.add(w)
        return w

    def finish(self, w: Watch) -> bool:
        """The watched task's function is returning. True if it finished before its deadline was
        reported (its caller reports the result); False if ``on_overrun`` already ran (the late
        result must be discarded: the overrun was the outcome). Either way it is no longer stuck."""
        with self._watch_lock:
            if w.state == _RUNNING:
                self._watched.discard(w)
                w.state = _FINISHED
                return True
            if w.state == _STUCK:
                self._stuck -= 1
            w.state = _FINISHED
            return False

    def _watch_loop(self) -> None:
        # The one watcher thread of this pool: claims overdue entries under the lock, then calls
        # their on_overrun outside it (the callbacks emit outcomes and take other locks).
        idle_since = monotonic()
        while True:
            sleep(WATCH_INTERVAL)
            now = monotonic()
            with self._watch_lock:
                if not self._watched:
                    if now - idle_since >= WATCH_LINGER:
                        self._watcher = None  # under the lock: the next watch() starts a new one
                        return
                    continue
                idle_since = now
                due = [w for w in self._watched if w.deadline <= now]
                for w in due:
                    self._watched.discard(w)
                    w.state = _STUCK
                    self._stuck += 1
                    next(self._stuck_total)
            for w in due:
                try:
                    w.on_overrun()
                except Exception:  # the watcher must survive whatever a callback does
                    _rlog.exception(("overrun", type(w.on_overrun).__name__), "overrun callback %r failed",
                                    w.on_overrun)

    @property
    def stuck(self) -> int:
        """Tasks running past their deadline now (their threads are still busy)."""
        return self._stuck

    @property
    def stuck_total(self) -> int:
        """Tasks that ran past their deadline since the pool started."""
        return count_value(self._stuck_total)

    # -- observers ----------------------------------------------------------------------------

    def add_listener(self, fn: Callable[[str, float], None]) -> None:
        """Call ``fn(kind, value)`` on pool events: ("delay", seconds) and ("failed", 1)."""
        self._listeners.append(fn)

    def add_capacity_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` from a pool thread whenever room frees up: a worker went idle, took a
        task off the queue, or exited. It must be cheap and thread-safe (the engine's overflow
        wait uses it to hand freed slots to waiting dispatches without polling)."""
        self._capacity_listeners.append(fn)

    def _capacity(self) -> None:
        for fn in self._capacity_listeners:
            try:
                fn()
            except Exception:
                log.exception("pool capacity listener failed")

    def _notify(self, kind: str, value: float) -> None:
        for fn in self._listeners:
            try:
                fn(kind, value)
            except Exception:
                log.exception("pool listener failed")

    # -- counters -----------------------------------------------------------------------------

    @property
    def submitted(self) -> int:
        """Tasks accepted so far."""
        refused = count_value(self._refused)
        return count_value(self._attempts) - refused

    @property
    def completed(self) -> int:
        """Tasks that returned."""
        return count_value(self._completed)

    @property
    def failed(self) -> int:
        """Tasks that raised (logged; their worker went on)."""
        return count_value(self._failed)

    @property
    def rejected(self) -> int:
        """Submissions refused because the pool was full or closed (overflow-wait retries excluded)."""
        return count_value(self._rejected)

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True while draining or drained: ``try_submit`` refuses."""
        return self._closed

    def drain(self, timeout: float | None = None) -> bool:
        """Stop accepting work, finish queued and running tasks; True if all finished in time."""
        self._closed = True
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            self._release_idle()
            if self.busy() <= 0:
                return True
            if deadline is not None and monotonic() >= deadline:
                return False
            sleep(0.002)

    def resume(self) -> None:
        """Accept work again after a drain."""
        self._closed = False

    def busy(self) -> int:
        """Accepted tasks not yet finished (queued, handed over or running).

        Counters move while they are read; reading the finished ones before the attempts makes
        the answer an over-estimate, never an under-estimate, so drain() cannot stop early."""
        finished = count_value(self._completed) + count_value(self._failed) + count_value(self._refused)
        return count_value(self._attempts) - finished

    def _release_idle(self) -> None:
        while True:
            try:
                self._idle.pop().slot.put(_STOP)
            except IndexError:
                return

    def _delay_samples(self) -> list[float]:
        # Pool threads append while we copy; a copy that raced an append is simply retried.
        for _ in range(10):
            try:
                return list(self._delays)
            except RuntimeError:
                continue
        return []

    def stats(self) -> dict[str, Any]:
        """Counters and gauges of this pool, plus scheduling delay (submit -> start) p50/p99."""
        queued = len(self._queue)
        completed, failed = count_value(self._completed), count_value(self._failed)
        # In flight: accepted, not waiting in the bounded queue, not finished. That includes a
        # task on its way to a worker (an idle worker's slot, or the hand-off deque while its
        # thread starts): it already holds a worker, and counting only tasks whose function has
        # begun would under-report a pool that is in fact full.
        running = self.submitted - completed - failed - queued
        workers = count_value(self._spawned) - count_value(self._exited)
        delays = sorted(self._delay_samples())
        return {
            "capacity": self.max_workers,
            "in_flight": max(0, running),
            "queued": queued,
            "queue_capacity": self.queue_size,
            "workers": max(0, workers),
            "idle_workers": len(self._idle),
            "submitted": self.submitted,
            "completed": completed,
            "failed": failed,
            "rejected": self.rejected,
            "closed": self._closed,
            "saturation": (max(0, running) + queued) / (self.max_workers + self.queue_size),
            "delay_p50": delays[len(delays) // 2] if delays else None,
            "delay_p99": delays[min(len(delays) - 1, int(0.99 * len(delays)))] if delays else None,
            "stuck": self._stuck,
            "stuck_total": count_value(self._stuck_total),
        }
