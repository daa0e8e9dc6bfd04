"""ExecPool: bounded tokens and queue, lazy workers, the exit protocol, failures and drains.

No timed assertions: waits are liveness bounds (a stranded task shows up as a wait that never
ends), never "took less than X".
"""
from __future__ import annotations

import random
import sys
import threading
import time

import pytest

from execapp.engine import ConfigError, ExecPool
from execapp.engine.fairqueue import FairQueue

from .helpers import LIVENESS, wait_until


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def bump(self) -> None:
        with self.lock:
            self.n += 1


@pytest.fixture
def pools():
    made: list[ExecPool] = []

    def make(*args, **kwargs) -> ExecPool:
        pool = ExecPool(*args, **kwargs)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.drain(timeout=5)


def test_runs_tasks_on_worker_threads(pools):
    pool = pools(4, 8)
    seen: list[int] = []
    done = threading.Event()

    def task() -> None:
        seen.append(threading.get_ident())
        done.set()

    assert pool.try_submit(task) is True
    assert done.wait(LIVENESS)
    assert seen and seen[0] != threading.get_ident()
    assert wait_until(lambda: pool.stats()["completed"] == 1)


def test_stats_have_the_documented_keys(pools):
    stats = pools(3, 5).stats()
    for key in ("capacity", "in_flight", "queued", "queue_capacity", "submitted", "completed", "failed",
                "rejected", "stuck", "stuck_total"):
        assert key in stats
    assert (stats["capacity"], stats["queue_capacity"]) == (3, 5)
    assert (stats["stuck"], stats["stuck_total"]) == (0, 0)


def test_full_pool_refuses_without_blocking(pools):
    pool = pools(2, 3)
    gate = threading.Event()
    accepted = [pool.try_submit(gate.wait) for _ in range(7)]
    assert accepted == [True] * 5 + [False] * 2  # 2 running + 3 queued, then refused
    # (the two started workers may take a moment to begin their tasks)
    assert wait_until(lambda: pool.stats()["in_flight"] == 2)
    stats = pool.stats()
    assert (stats["in_flight"], stats["queued"], stats["rejected"], stats["submitted"]) == (2, 3, 2, 5)
    gate.set()
    assert wait_until(lambda: pool.stats()["completed"] == 5)


def test_queue_size_zero_means_tokens_only(pools):
    pool = pools(1, 0)
    gate = threading.Event()
    assert pool.try_submit(gate.wait)
    assert not pool.try_submit(gate.wait)
    gate.set()
    assert wait_until(lambda: pool.busy() == 0)
    assert pool.try_submit(lambda: None)


def test_a_failing_task_is_counted_and_kills_no_worker(pools):
    pool = pools(1, 16, idle_seconds=5.0)  # one token: a dead worker would strand everything after
    threads: list[str] = []
    ran = Counter()

    def boom() -> None:
        threads.append(threading.current_thread().name)
        raise RuntimeError("task failure")

    def ok() -> None:
        threads.append(threading.current_thread().name)
        ran.bump()

    assert pool.try_submit(boom)
    assert wait_until(lambda: pool.stats()["failed"] == 1)
    for _ in range(5):
        assert pool.try_submit(ok)
    assert wait_until(lambda: ran.n == 5)
    # A task is counted done just after it returns: wait for the count, not only the effect.
    assert wait_until(lambda: pool.stats()["completed"] == 5)
    stats = pool.stats()
    assert (stats["failed"], stats["completed"], stats["submitted"]) == (1, 5, 6)
    assert len(set(threads)) == 1, "the same lingering worker ran every task after the failure"


def test_failing_task_notifies_listeners(pools):
    pool = pools(2, 2)
    events: list[tuple[str, float]] = []
    pool.add_listener(lambda kind, value: events.append((kind, value)))
    pool.try_submit(lambda: 1 / 0)
    assert wait_until(lambda: ("failed", 1.0) in events)
    assert any(kind == "delay" and value >= 0 for kind, value in events)


def test_workers_start_lazily_and_exit_when_idle(pools):
    pool = pools(4, 4, idle_seconds=0.5)  # long enough to still see the worker right after its task
    assert pool.stats()["workers"] == 0, "no thread before there is work"
    done = Counter()
    for _ in range(3):
        pool.try_submit(done.bump)
    assert wait_until(lambda: done.n == 3)
    assert pool.stats()["workers"] >= 1
    assert wait_until(lambda: pool.stats()["workers"] == 0), "idle workers must exit"
    pool.try_submit(done.bump)  # and a new one starts for new work
    assert wait_until(lambda: done.n == 4)


def test_lingering_worker_takes_the_next_task_without_a_new_thread(pools):
    pool = pools(4, 4, idle_seconds=5.0)
    names: list[str] = []
    for _ in range(20):
        got = threading.Event()
        pool.try_submit(lambda got=got: (names.append(threading.current_thread().name), got.set()))
        assert got.wait(LIVENESS)
        assert wait_until(lambda: pool.stats()["idle_workers"] == 1)
    assert len(set(names)) == 1


@pytest.fixture
def tiny_switch_interval():
    """Switch the GIL between threads as often as possible, to interleave racing threads."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("idle_seconds", [0.0, 0.0005])
def test_exit_protocol_bursts_every_accepted_task_runs(pools, idle_seconds, tiny_switch_interval):
    """Thousands of submissions in bursts timed to land while workers exit; none is stranded.

    With few tokens and no (or a tiny) linger, workers exit the moment the queue looks empty.
    Each burst is submitted right as the previous one drains, i.e. while its workers are in
    their exit path: a task queued in that gap is only picked up if the exit protocol holds.
    After each burst we wait for every accepted task; a stranded one fails the wait.
    """
    pool = pools(2, 64, idle_seconds=idle_seconds)
    ran = Counter()
    accepted = 0
    rng = random.Random(1234)
    submitters = 3
    for burst in range(250):
        size = rng.randint(1, 12)
        results: list[bool] = []

        def submit(size: int = size, results: list[bool] = results) -> None:
            for _ in range(size):
                results.append(pool.try_submit(ran.bump))

        threads = [threading.Thread(target=submit) for _ in range(submitters)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        accepted += sum(results)
        assert wait_until(lambda accepted=accepted: ran.n == accepted, timeout=5.0), (
            f"burst {burst}: {accepted - ran.n} accepted task(s) stranded; stats={pool.stats()}")
        # Land the next burst at a worker's exit moment: right away, or after a pause of the
        # order of the linger / thread exit.
        pause = rng.choice([0.0, 0.0, 0.00005, 0.0002, idle_seconds])
        if pause:
            time.sleep(pause)
    assert accepted > 1000
    assert wait_until(lambda: pool.stats()["completed"] == accepted)
    stats = pool.stats()
    # A burst (<= 36 tasks) never exceeds tokens + queue (66): every submission is accepted.
    assert (stats["submitted"], stats["rejected"]) == (accepted, 0)
    assert stats["completed"] == ran.n == accepted


class WideningQueue(FairQueue):
    """The pool's real task queue, yielding the GIL at the two racy points of the exit protocol.

    A submitter pauses between "no token free" and "enqueued", and a worker pauses between
    "queue empty" and acting on it. The pauses only widen windows that exist anyway, so a
    broken protocol strands a task within a few hundred submissions instead of one in many
    thousands; a correct one must not care.
    """

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def _pause(self) -> None:
        time.sleep(self.rng.choice((0.0, 0.0, 0.00005, 0.0002)))

    def append(self, item, key="") -> None:
        self._pause()
        super().append(item, key)

    def popleft(self):
        try:
            return super().popleft()
        except IndexError:
            self._pause()
            raise

    def popleft_where(self, accept):
        try:
            return super().popleft_where(accept)
        except IndexError:
            self._pause()
            raise

    def __bool__(self) -> bool:  # what `if queue:` asks
        n = super().__len__()
        if n == 0:
            self._pause()
        return n > 0


@pytest.mark.parametrize("max_workers, idle_seconds, reserve", [(1, 0.0, 0), (2, 0.0, 0), (2, 60.0, 0), (2, 0.0, 1),
                                                                (2, 60.0, 1)])
def test_exit_protocol_chained_submissions_every_accepted_task_runs(pools, max_workers, idle_seconds, reserve):
    """3 threads x 700 submissions, each landing as the previous task's worker exits or idles.

    Each submitter submits a task, waits for it to run, and submits the next at once: the
    worker that ran the first is then between its last queue check and giving its token
    back (idle_seconds=0), or between its last queue check and going idle (a long linger: a
    queued task missed by an idle worker would wait the whole linger, far past the wait
    below). Exactly the gaps the exit protocol closes. With a reserve, owner o0's two chains
    share its cap of one worker: its second task waits queued, passed over, until its first ends.
    """
    pool = pools(max_workers, 64, idle_seconds=idle_seconds, reserve=reserve)
    pool._queue = WideningQueue(seed=max_workers)  # white-box: widen the race windows
    chains, per_chain = 3, 700
    completed = Counter()
    stranded: list[str] = []

    def chain(c: int) -> None:
        for i in range(per_chain):
            ran = threading.Event()
            assert pool.try_submit(ran.set, owner=f"o{c % 2}")  # two owners: lines come and go
            if not ran.wait(LIVENESS):
                stranded.append(f"chain {c} task {i}: stats={pool.stats()}")
                return
            completed.bump()

    threads = [threading.Thread(target=chain, args=(c,)) for c in range(chains)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stranded == []
    assert completed.n == chains * per_chain
    assert wait_until(lambda: pool.stats()["completed"] == chains * per_chain)
    if idle_seconds == 0:
        assert wait_until(lambda: pool.stats()["workers"] == 0), "workers exit, and each returns its token"
    assert pool.try_submit(lambda: None)


def test_drain_finishes_queued_and_running_work(pools):
    pool = pools(2, 10)
    done = Counter()

    def slow() -> None:
        time.sleep(0.02)  # the point: work still running when drain() is called
        done.bump()

    for _ in range(8):
        assert pool.try_submit(slow)
    assert pool.drain(timeout=LIVENESS) is True
    assert done.n == 8, "drain returns only after queued and running tasks finished"
    stats = pool.stats()
    assert (stats["completed"], stats["in_flight"], stats["queued"]) == (8, 0, 0)


def test_drain_refuses_new_work_and_resume_accepts_it(pools):
    pool = pools(2, 2)
    assert pool.drain(timeout=1) is True
    assert pool.closed
    assert pool.try_submit(lambda: None) is False
    assert pool.stats()["rejected"] == 1
    pool.resume()
    done = threading.Event()
    assert pool.try_submit(done.set)
    assert done.wait(LIVENESS)


def test_drain_returns_false_when_work_cannot_finish_in_time(pools):
    pool = pools(1, 4)
    gate = threading.Event()
    done = Counter()
    assert pool.try_submit(gate.wait)
    assert pool.try_submit(done.bump)  # queued behind the stuck one
    assert pool.drain(timeout=0.05) is False
    assert done.n == 0
    gate.set()
    assert pool.drain(timeout=LIVENESS) is True
    assert done.n == 1, "the queued task still ran after the stuck one finished"


def test_drain_wakes_lingering_workers(pools):
    pool = pools(3, 3, idle_seconds=30.0)
    done = Counter()
    for _ in range(3):
        pool.try_submit(done.bump)
    assert wait_until(lambda: done.n == 3)
    assert pool.drain(timeout=LIVENESS)
    assert wait_until(lambda: pool.stats()["workers"] == 0), "drained pools do not keep idle threads"


def test_busy_counts_accepted_unfinished_tasks(pools):
    pool = pools(1, 2)
    gate = threading.Event()
    pool.try_submit(gate.wait)
    pool.try_submit(lambda: None)
    assert pool.busy() == 2
    gate.set()
    assert wait_until(lambda: pool.busy() == 0)


def test_in_flight_counts_tasks_handed_to_a_worker_before_they_start(pools):
    # A task that holds a worker is in flight even before its thread reaches it (here the new
    # threads are held back at their start, as a loaded machine may hold them): stats must not
    # report a full pool as half empty. The rest are queued.
    go = threading.Event()

    class SlowStartPool(ExecPool):
        def _work(self, task):
            go.wait(LIVENESS)
            return super()._work(task)

    pool = SlowStartPool(2, 1)
    try:
        for _ in range(3):
            assert pool.try_submit(lambda: None)
        stats = pool.stats()
        assert (stats["in_flight"], stats["queued"], stats["saturation"]) == (2, 1, 1.0)
    finally:
        go.set()
    assert wait_until(lambda: pool.stats()["in_flight"] == 0 and pool.stats()["completed"] == 3)
    pool.drain(LIVENESS)


@pytest.mark.parametrize("kwargs", [{"max_workers": 0}, {"queue_size": -1}, {"idle_seconds": -1}])
def test_impossible_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        ExecPool(**kwargs)


def test_worker_threads_are_started_by_the_starter_never_by_the_submitter(pools, monkeypatch):
    # Thread.start() waits until the new thread runs: while guests held the GIL each start took
    # 20-400 ms of the submitter's time, and the submitter is the event loop (64 starts: 1.3 s
    # with two busy threads). The submitter now only asks; the pool's starter thread starts.
    starts: list[tuple[str, threading.Thread]] = []
    real_start = threading.Thread.start

    def recording_start(thread: threading.Thread) -> None:
        starts.append((thread.name, threading.current_thread()))
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    pool = pools(4, 8, name="startpool")
    gate = threading.Event()
    for _ in range(12):  # every token (direct starts) and the queue (a drain worker's start)
        assert pool.try_submit(gate.wait)
    gate.set()
    wait_until(lambda: pool.busy() == 0)
    workers = [(name, by) for name, by in starts if name.startswith("startpool-") and name != "startpool-starter"]
    assert workers and all(by is not threading.current_thread() for _, by in workers), workers
    assert {by.name for _, by in workers} == {"startpool-starter"}


# -- owners take turns in the queue -----------------------------------------------------------------------

def test_a_queued_task_of_another_owner_runs_before_one_owners_backlog(pools):
    """Owner a holds the only worker and queues 10 tasks; owner b's one task, queued after them,
    runs after at most one of a's (round robin), not after all 10 (arrival order)."""
    pool = pools(1, 64)
    gate = threading.Event()
    order: list[str] = []
    assert pool.try_submit(lambda: gate.wait(LIVENESS), owner="a")
    for i in range(10):
        assert pool.try_submit(lambda i=i: order.append(f"a{i}"), owner="a")
    assert pool.try_submit(lambda: order.append("b"), owner="b")
    gate.set()
    assert wait_until(lambda: len(order) == 11)
    assert order == ["a0", "b"] + [f"a{i}" for i in range(1, 10)]


def test_fair_queue_round_robin_fifo_within_a_key_and_no_empty_lines_kept():
    q: FairQueue[str] = FairQueue()
    for item in ("a1", "a2", "a3"):
        q.append(item, "a")
    q.append("b1", "b")
    q.append("c1", "c")
    q.append("b2", "b")
    assert (len(q), q.keys()) == (6, 3)
    assert [q.popleft() for _ in range(6)] == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert (len(q), bool(q), q.keys()) == (0, False, 0)
    with pytest.raises(IndexError):
        q.popleft()
    for i in range(3):  # one key: plain FIFO
        q.append(str(i))
    assert [q.popleft() for _ in range(3)] == ["0", "1", "2"]


# -- the reserve: threads no one owner may hold ------------------------------------------------------------

def _blocked_tasks(pool: ExecPool, owner: str, n: int, gate: threading.Event) -> dict[str, int]:
    """Submit ``n`` tasks of ``owner`` that wait for ``gate``; the counts of them running now and at most."""
    seen = {"now": 0, "peak": 0}
    lock = threading.Lock()

    def task() -> None:
        with lock:
            seen["now"] += 1
            seen["peak"] = max(seen["peak"], seen["now"])
        gate.wait(LIVENESS)
        with lock:
            seen["now"] -= 1

    for _ in range(n):
        assert pool.try_submit(task, owner=owner)
    return seen


def test_one_owner_alone_leaves_the_reserve_for_the_next_owners_first_task(pools):
    """Owner a alone fans out to 20 slow tasks on 8 threads with a reserve of 2: 6 run and 14
    queue, and owner b's first task starts at once on a reserved thread instead of waiting for
    one of a's to finish; every queued task of a still runs once the gate opens."""
    pool = pools(8, 64, idle_seconds=60.0, reserve=2)
    gate = threading.Event()
    seen = _blocked_tasks(pool, "a", 20, gate)
    assert wait_until(lambda: seen["now"] == 6)
    b_ran = threading.Event()
    assert pool.try_submit(b_ran.set, owner="b")
    try:
        assert b_ran.wait(LIVENESS), f"b waited behind a's tasks: stats={pool.stats()}"
        assert seen["peak"] == 6 and pool.stats()["queued"] == 14
    finally:
        gate.set()
    assert wait_until(lambda: pool.stats()["completed"] == 21)
    assert seen["peak"] == 6 and pool._owned == {}


def test_tasks_of_no_owner_are_not_capped(pools):
    pool = pools(4, 64, idle_seconds=60.0, reserve=1)
    gate = threading.Event()
    seen = _blocked_tasks(pool, "", 4, gate)
    try:
        assert wait_until(lambda: seen["now"] == 4)
    finally:
        gate.set()
    assert wait_until(lambda: pool.stats()["completed"] == 4)


def test_idle_workers_do_not_spin_on_a_capped_owners_queue(pools, monkeypatch):
    """Queued tasks only of an owner at its cap: the idle workers wait, they do not poll the queue."""
    pool = pools(4, 64, idle_seconds=60.0, reserve=1)
    looks = Counter()
    take = pool._take_queued

    def counted():
        looks.bump()
        return take()

    monkeypatch.setattr(pool, "_take_queued", counted)
    gate = threading.Event()
    seen = _blocked_tasks(pool, "a", 3, gate)
    assert wait_until(lambda: seen["now"] == 3)
    assert pool.try_submit(lambda: None, owner="b")  # one worker is now idle beside a's three
    assert wait_until(lambda: pool.stats()["completed"] == 1)
    try:
        for _ in range(5):
            assert pool.try_submit(lambda: None, owner="a")  # queued: a is at its cap
        before = looks.n
        time.sleep(0.3)
        assert looks.n - before <= 2 and pool.stats()["queued"] == 5
    finally:
        gate.set()
    assert wait_until(lambda: pool.stats()["completed"] == 9)


def test_a_reserve_must_leave_one_thread():
    with pytest.raises(ConfigError, match="reserve=4"):
        ExecPool(4, 8, reserve=4)


def test_fair_queue_popleft_where_passes_over_keys_not_accepted():
    q: FairQueue[str] = FairQueue()
    for item, key in (("a1", "a"), ("a2", "a"), ("b1", "b"), ("c1", "c")):
        q.append(item, key)
    assert q.popleft_where(lambda k: k != "a") == "b1"
    assert q.any_key(lambda k: k == "c") and not q.any_key(lambda k: k == "b")
    assert q.popleft() == "a1"  # a kept its turn
    with pytest.raises(IndexError):
        q.popleft_where(lambda k: k == "z")
    assert [q.popleft(), q.popleft()] == ["c1", "a2"]
