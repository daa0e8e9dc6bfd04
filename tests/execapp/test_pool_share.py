"""An owner's share of the worker's thread pool (execapp.pool_share): counted per event with pooled
work until its done, and past its share, while another owner uses the pool, the owner's connections
wait before their next frame is read; alone, an owner keeps the whole pool."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from execapp.connection import Connection
from execapp.engine import Engine, ExecPool
from execapp.engine.backpressure import SlotWaiters
from execapp.pool_share import PoolShare, PoolShareGroup
from execapp.protocol import Limits

from ..engine.helpers import ManualClock, promote
from .ws_fixtures import Admission, channel_layer, ws_worker  # noqa: F401


def test_a_share_is_enforced_only_while_another_owner_holds_pooled_work(clock: ManualClock) -> None:
    group = PoolShareGroup(window=1.0)
    a, b = PoolShare(2, group), PoolShare(2, group)
    for _ in range(5):  # alone: the whole pool
        a.take()
    assert a.held == 5 and not group.contended and not a.over and not a.ahead()
    # b's first dispatch, parked before it counts: ahead of a's already (a holds the pool).
    assert b.ahead()
    b.take()  # another owner's event holds pooled work
    assert group.contended and a.over and not b.over and b.ahead() and not a.ahead()
    b.give()
    assert group.contended and a.over  # b was active within the window
    clock.now += 1.5
    a.give()  # a's count changes after the window: b held nothing since, forgotten
    assert not group.contended and not a.over and a.held == 4
    for _ in range(4):
        a.give()
    b.take()
    clock.now += 5
    b.give()  # a, idle and holding nothing for long, is forgotten: b alone
    assert not group.contended


def test_a_share_without_a_group_is_always_enforced() -> None:
    share = PoolShare(1)
    assert not share.over
    share.take()
    assert share.over
    with pytest.raises(ValueError):
        PoolShare(0)


async def test_waiting_connections_are_woken_one_by_one_as_the_owner_s_events_finish() -> None:
    group = PoolShareGroup(window=60.0)
    a, b = PoolShare(2, group), PoolShare(2, group)
    b.take()
    a.take()
    a.take()
    assert a.over
    inline = [False]

    async def connection() -> None:  # reads a frame once the share lets it: a pooled event, or an inline one
        await a.wait()
        if not inline[0]:
            a.take()

    waiting = [asyncio.ensure_future(connection()) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert not any(w.done() for w in waiting) and a.waits == 3
    a.give()  # room for one: the first reads on, its event takes the room; the next waits on
    await asyncio.sleep(0.01)
    assert [w.done() for w in waiting] == [True, False, False] and a.held == 2
    inline[0] = True
    a.give()  # room again: the next one's event runs inline, so the room is still there for the last
    await asyncio.sleep(0.01)
    assert [w.done() for w in waiting] == [True, True, True] and a.held == 1
    a.take()
    a.take()
    waiting = [asyncio.ensure_future(connection()) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert not any(w.done() for w in waiting)
    b.give()  # the other owner is done, and quiet for a window: alone again, every connection reads
    group.prune(time.monotonic() + 61)
    await asyncio.wait_for(asyncio.gather(*waiting), 5)
    assert not a._waiters


async def test_a_waiter_is_woken_when_the_other_owner_goes_quiet_without_any_count_changing() -> None:
    group = PoolShareGroup(window=0.05)
    a, b = PoolShare(1, group), PoolShare(1, group)
    b.take()
    b.give()
    a.take()
    assert a.over
    await asyncio.wait_for(a.wait(), 5)  # the group's one timer relaxes it a window later
    assert not group.contended


async def test_an_ahead_waiter_is_woken_before_earlier_ones() -> None:
    waiters = SlotWaiters(recheck=60.0)
    order: list[str] = []

    async def wait(name: str, ahead: bool) -> None:
        if await waiters.wait(5.0, ahead=ahead):
            order.append(name)

    tasks = [asyncio.ensure_future(wait("a1", False)), asyncio.ensure_future(wait("a2", False))]
    await asyncio.sleep(0)
    tasks.append(asyncio.ensure_future(wait("b", True)))
    await asyncio.sleep(0)
    assert len(waiters) == 3 and waiters
    for _ in range(3):
        waiters.notify()
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    assert order == ["b", "a1", "a2"]


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
def test_one_owner_s_connections_share_one_pool_share_kept_while_its_pooled_events_run(
        channel_layer: str, ws_worker: Any) -> None:
    worker = ws_worker
    assert worker.connection_opened("tenant:a", 10) and worker.connection_opened("tenant:b", 10)
    a = worker.pool_share("tenant:a", 0.5)
    assert worker.pool_share("tenant:a", 0.5) is a and worker.pool_share("tenant:b", 0.5) is not a
    assert a.limit == max(1, int(0.5 * worker.pool.max_workers))
    a.take()  # the owner's last connection leaves while one of its handlers runs in the pool
    worker.connection_closed("tenant:a")
    assert worker.connection_opened("tenant:a", 10)
    assert worker.pool_share("tenant:a", 0.5) is a  # still counted: its thread is still taken
    a.give()
    worker.connection_closed("tenant:a")
    assert worker.connection_opened("tenant:a", 10)
    assert worker.pool_share("tenant:a", 0.5) is not a
    worker.connection_closed("tenant:a")
    worker.connection_closed("tenant:b")


# -- in process: a real Engine and ExecPool --------------------------------------------------------

THREADS = 4
SLOW = 0.2  # seconds a flooding owner's handler holds its thread


class Tally:
    """Each owner's handlers running in the pool now, and the most seen while the other owner was active."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = {"a": 0, "b": 0}
        self.most_a_contended = 0
        self.watching = False

    def slow(self, ctx: Any) -> str:
        owner = ctx.args
        with self.lock:
            self.running[owner] += 1
            if self.watching:
                self.most_a_contended = max(self.most_a_contended, self.running["a"])
        try:
            time.sleep(SLOW if owner == "a" else 0.01)
        finally:
            with self.lock:
                self.running[owner] -= 1
        return "ok"


def _engine(tally: Tally, overflow_wait: float) -> tuple[Engine, ExecPool]:
    pool = ExecPool(THREADS, 0, idle_seconds=5.0)
    engine = Engine(pool=pool, overflow="wait", overflow_wait=overflow_wait)
    promote(engine.add(engine.make_matcher("command", "slow", tally.slow, name="slow", plugin="test")))
    return engine, pool


def _frames(sent: list[str]) -> list[dict]:
    return [json.loads(f) for f in sent]


async def test_a_flooding_owner_keeps_to_its_share_of_the_pool_while_another_owner_s_events_run() -> None:
    """Owner a floods slow pooled handlers over many connections (alone: the whole pool, and a
    dispatch parked on each connection); owner b's pooled events then run, none ``overloaded``
    (the first one waits ahead of a's parked dispatches), and a's events with pooled work stay
    within its share once it is back to it."""
    tally = Tally()
    # b's event must not wait behind a's parked dispatches: 30 of them take 30 / 4 * 0.2 = 1.5 s
    # of pool time, longer than the overflow wait (then b's would be refused ``overloaded``).
    engine, pool = _engine(tally, overflow_wait=1.0)
    group = PoolShareGroup(window=30.0)  # b counts as active for the whole test once it used the pool
    a_share, b_share = PoolShare(THREADS // 2, group), PoolShare(THREADS // 2, group)
    a_sent: list[str] = []
    b_sent: list[str] = []

    async def a_send(text: str) -> None:
        a_sent.append(text)

    async def b_send(text: str) -> None:
        b_sent.append(text)

    a_conns = [Connection(engine, Admission(), Limits(), a_send, owner="tenant:a", pool_share=a_share)
               for _ in range(30)]
    stop = False

    async def flood(conn: Connection, n: int) -> None:
        i = 0
        while not stop:
            await conn.receive(json.dumps({"id": f"a{n}-{i}", "text": "/slow a"}))
            i += 1

    floods = [asyncio.ensure_future(flood(c, n)) for n, c in enumerate(a_conns)]
    try:
        # Alone, a takes the whole pool (and more waits on every connection).
        await _until(lambda: tally.running["a"] == THREADS and a_share.held > THREADS)
        assert not group.contended and a_share.waits == 0
        b = Connection(engine, Admission(), Limits(), b_send, owner="tenant:b", pool_share=b_share)
        for i in range(5):
            await asyncio.wait_for(b.receive(json.dumps({"id": f"b{i}", "text": "/slow b"})), 10)
            await _until(lambda n=i + 1: sum(f.get("type") == "done" for f in _frames(b_sent)) == n)
            if i == 0:  # b is active from now on: once a is back to its share, it stays there
                await _until(lambda: a_share.held <= a_share.limit)
                tally.watching = True
        assert tally.watching and group.contended
        b_frames = _frames(b_sent)
        assert not [f for f in b_frames if f.get("type") == "error"], b_frames
        assert sum(f.get("type") == "reply" for f in b_frames) == 5
        assert tally.most_a_contended <= a_share.limit, tally.most_a_contended
        assert a_share.held <= a_share.limit and a_share.waits > 0
    finally:
        stop = True
        for task in floods:
            task.cancel()
        await asyncio.gather(*floods, return_exceptions=True)
        for c in a_conns:
            c.close()
        pool.drain(10)


async def test_alone_an_owner_keeps_the_whole_pool() -> None:
    tally = Tally()
    engine, pool = _engine(tally, overflow_wait=10.0)
    share = PoolShare(1, PoolShareGroup(window=30.0))
    sent: list[str] = []

    async def send(text: str) -> None:
        sent.append(text)

    conns = [Connection(engine, Admission(), Limits(), send, owner="tenant:a", pool_share=share) for _ in range(6)]
    try:
        for n, conn in enumerate(conns[:THREADS]):
            await asyncio.wait_for(conn.receive(json.dumps({"id": f"a{n}", "text": "/slow a"})), 10)
        assert share.held == THREADS and not share.over and share.waits == 0
        await _until(lambda: sum(f.get("type") == "done" for f in _frames(sent)) == THREADS)
        assert share.held == 0  # given back with each done
        assert not [f for f in _frames(sent) if f.get("type") == "error"]
    finally:
        for c in conns:
            c.close()
        pool.drain(10)


async def test_an_event_whose_handlers_run_inline_is_not_counted() -> None:
    engine = Engine(pool_enabled=False)
    engine.add(engine.make_matcher("command", "ping", lambda ctx: "pong", plugin="test"))
    sent: list[str] = []

    async def send(text: str) -> None:
        sent.append(text)

    share = PoolShare(1)
    conn = Connection(engine, Admission(), Limits(), send, owner="tenant:a", pool_share=share)
    for i in range(3):
        await conn.receive(json.dumps({"id": f"p{i}", "text": "/ping"}))
    assert share.held == 0 and not conn._pooled and share.waits == 0
    conn.close()


async def _until(predicate: Any, timeout: float = 15.0) -> None:
    """Wait on the loop until ``predicate()`` (a guard with a generous timeout, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_an_event_counts_each_of_its_pooled_handlers() -> None:
    # One frame matching many handlers (a plugin may bind 100 to one command) held that many pool
    # tasks while its owner's share counted it once: 32 such frames could hold 3,200 tasks while
    # another owner waited behind them.
    pool = ExecPool(8, 8)
    engine = Engine(pool=pool)
    gate = threading.Event()
    for i in range(5):
        promote(engine.add(engine.make_matcher("command", "fan", lambda ctx: gate.wait(10) and None,
                                               name=f"fan{i}", plugin="test")))
    sent: list[str] = []

    async def send(text: str) -> None:
        sent.append(text)

    share = PoolShare(3)  # alone in no group: always enforced
    conn = Connection(engine, Admission(), Limits(), send, owner="tenant:a", pool_share=share)
    try:
        await conn.receive(json.dumps({"id": "f1", "text": "/fan"}))
        assert share.held == 5 and share.over
        gate.set()
        await _until(lambda: any(json.loads(f).get("type") == "done" for f in sent))
        assert share.held == 0 and not conn._pooled
    finally:
        gate.set()
        conn.close()
        pool.drain(10)


async def test_one_owner_s_first_fan_out_leaves_the_reserve_to_another_owner() -> None:
    """An owner alone sends one frame that fans out to 8 slow pooled handlers on 8 threads with a
    reserve of 2 (EXECAPP['POOL_RESERVE']): 6 run, 2 queue, and another owner's first event is
    answered at once instead of after one of them ends (the work-conserving pool share could not
    stop that first frame: it counts only once a second owner is seen)."""
    pool = ExecPool(8, 8, idle_seconds=5.0, reserve=2)
    engine = Engine(pool=pool)
    gate = threading.Event()
    for i in range(8):
        promote(engine.add(engine.make_matcher("command", "fan", lambda ctx: gate.wait(10) and None,
                                               name=f"fan{i}", plugin="test")))
    promote(engine.add(engine.make_matcher("command", "hi", lambda ctx: "hi", name="hi", plugin="test")))
    a_sent: list[str] = []
    b_sent: list[str] = []

    async def a_send(text: str) -> None:
        a_sent.append(text)

    async def b_send(text: str) -> None:
        b_sent.append(text)

    group = PoolShareGroup(window=30.0)
    a = Connection(engine, Admission(), Limits(), a_send, owner="tenant:a", pool_share=PoolShare(4, group))
    b = Connection(engine, Admission(), Limits(), b_send, owner="tenant:b", pool_share=PoolShare(4, group))
    try:
        await a.receive(json.dumps({"id": "fan", "text": "/fan"}))
        await _until(lambda: pool.stats()["queued"] == 2)
        await b.receive(json.dumps({"id": "hi", "text": "/hi"}))
        await _until(lambda: any(json.loads(f).get("type") == "done" for f in b_sent), timeout=5.0)
        assert not gate.is_set() and [json.loads(f).get("text") for f in b_sent][0] == "hi"
        gate.set()
        await _until(lambda: any(json.loads(f).get("type") == "done" for f in a_sent))
        assert json.loads(a_sent[-1])["replies"] == 0 and json.loads(a_sent[-1])["errors"] == 0
    finally:
        gate.set()
        a.close()
        b.close()
        pool.drain(10)


@pytest.mark.parametrize("value", [-0.1, 1, 1.5, "some", True, None])
def test_a_reserve_that_is_not_a_fraction_below_one_fails_the_system_check(settings: Any, value: Any) -> None:
    from execapp.checks import check_execapp_settings

    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "POOL_RESERVE": value}
    found = {m.id: m for m in check_execapp_settings()}
    assert "execapp.E143" in found and "POOL_RESERVE" in found["execapp.E143"].msg and found["execapp.E143"].hint
    settings.EXECAPP = {**settings.EXECAPP, "POOL_RESERVE": 0}
    assert "execapp.E143" not in {m.id for m in check_execapp_settings()}


def test_the_worker_s_pool_keeps_its_reserve(settings: Any) -> None:
    from execapp.worker import Worker

    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "POOL_MAX_WORKERS": 16, "POOL_RESERVE": 0.25}
    assert Worker("reserve-test").pool.reserve == 4
