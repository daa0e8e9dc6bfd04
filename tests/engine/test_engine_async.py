"""Engine.process_event_async: dispatch from an event loop and the overflow policies.

A full pool never blocks the loop unless the policy is ``inline``: ``wait`` awaits a slot (the
connection is backpressured) up to ``overflow_wait`` and then refuses the handler with code
``overloaded``; ``reject`` refuses at once. Every event still completes.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from execapp.engine import Completion, Engine, Event, ExecClass, ExecPool, NotStarted

from .helpers import LIVENESS, Gate, Outcomes, add_cmd, demote, parked, promote, wait_until, wait_until_async


@pytest.fixture
def full_pool():
    """A one-slot pool whose slot is taken until the test opens the gate."""
    pool = ExecPool(1, 0, idle_seconds=5.0)
    gate = Gate()
    gate.fill(pool)
    yield pool, gate
    gate.open()
    pool.drain(timeout=5)


def make_engine(pool: ExecPool, overflow: str, overflow_wait: float = LIVENESS) -> tuple[Engine, dict]:
    engine = Engine(pool=pool, overflow=overflow, overflow_wait=overflow_wait)
    ran = {"slow": [], "after": []}
    promote(add_cmd(engine, lambda ctx: ran["slow"].append(threading.get_ident()) or "slow", name="slow",
                    priority=1))
    demote(add_cmd(engine, lambda ctx: ran["after"].append(threading.get_ident()) or "after", name="after"))
    return engine, ran


async def refused_and_never_run(engine: Engine, ran: dict, pool: ExecPool, gate: Gate) -> Completion:
    """Dispatch /cmd on the full pool: the slow handler is refused with ``overloaded`` and never
    runs, not even once the pool frees; the rest of the event runs and the event completes."""
    out = Outcomes()
    run = await engine.process_event_async(Event(text="/cmd"), out)
    completion = await asyncio.wait_for(run, LIVENESS)
    assert [f.code for f in completion.errors] == ["overloaded"] and out.completions == [completion]
    assert ran["slow"] == [] and len(ran["after"]) == 1, "refused handler never runs; the rest still do"
    gate.open()
    assert wait_until(lambda: pool.busy() == 0)
    assert ran["slow"] == [], "a refused handler does not run later either"
    return completion


async def test_inline_handlers_run_on_the_loop_and_pooled_ones_in_threads():
    engine = Engine()
    try:
        ran: dict[str, int] = {}
        demote(add_cmd(engine, lambda ctx: ran.setdefault("inline", threading.get_ident()) and "i", name="i"))
        promote(add_cmd(engine, lambda ctx: ran.setdefault("pooled", threading.get_ident()) and "p", name="p",
                        priority=-1))
        out = Outcomes()
        run = await engine.process_event_async(Event(text="/cmd"), out)
        completion = await asyncio.wait_for(run, LIVENESS)
        assert isinstance(completion, Completion) and completion.replies == 2
        assert ran["inline"] == threading.get_ident() != ran["pooled"]
        assert {r.exec_class for r in out.replies} == {ExecClass.SYNC, ExecClass.POOL}
        assert await run == completion, "awaiting a completed run returns at once"
    finally:
        engine.shutdown(timeout=5)


async def test_policy_reject_refuses_at_once_and_the_event_completes(full_pool):
    pool, gate = full_pool
    engine, ran = make_engine(pool, "reject")
    completion = await refused_and_never_run(engine, ran, pool, gate)
    assert "'slow'" in completion.errors[0].message and "retry" in completion.errors[0].message
    assert engine.stats()["overloaded"] == 1


async def test_policy_wait_gets_its_slot_when_one_frees_without_blocking_the_loop(full_pool):
    pool, gate = full_pool
    engine, ran = make_engine(pool, "wait")
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.001)  # the ticker's pace: other work on the loop

    ticking = asyncio.create_task(ticker())
    dispatch = asyncio.create_task(engine.process_event_async(Event(text="/cmd")))
    assert await wait_until_async(lambda: parked(engine) == 1)
    assert not dispatch.done(), "the event waits for a slot"
    before = ticks
    assert await wait_until_async(lambda: ticks > before + 3), "the loop keeps running other work while the event waits"
    threading.Timer(0.02, gate.open).start()  # the slot frees from another thread
    run = await asyncio.wait_for(dispatch, LIVENESS)
    completion = await asyncio.wait_for(run, LIVENESS)
    stop.set()
    await ticking
    assert completion.errors == () and completion.replies == 2
    assert len(ran["slow"]) == 1 and ran["slow"][0] != threading.get_ident(), "it ran in the pool"
    assert len(ran["after"]) == 1
    stats = engine.stats()
    assert (stats["pooled"], stats["overloaded"], stats["fallbacks"]) == (1, 0, 0)


async def test_policy_wait_refuses_after_overflow_wait_and_the_event_completes(full_pool):
    pool, gate = full_pool
    engine, ran = make_engine(pool, "wait", overflow_wait=0.05)
    await refused_and_never_run(engine, ran, pool, gate)


async def test_policy_inline_runs_on_the_loop(full_pool):
    pool, gate = full_pool
    engine, ran = make_engine(pool, "inline")
    out = Outcomes()
    run = await engine.process_event_async(Event(text="/cmd"), out)
    completion = await asyncio.wait_for(run, LIVENESS)
    assert completion.errors == () and completion.replies == 2
    assert ran["slow"] == [threading.get_ident()]
    assert [r.exec_class for r in out.replies] == [ExecClass.SYNC, ExecClass.SYNC]
    assert engine.stats()["fallbacks"] == 1


@pytest.mark.parametrize("policy", ["wait", "reject"])
async def test_refused_blocking_handler_still_blocks(full_pool, policy):
    pool, gate = full_pool
    engine = Engine(pool=pool, overflow=policy, overflow_wait=0.02)
    lower: list[int] = []
    m = promote(add_cmd(engine, lambda ctx: "never", name="blocker", priority=1, block=True))
    demote(add_cmd(engine, lambda ctx: lower.append(1), name="lower"))
    run = await engine.process_event_async(Event(text="/cmd"))
    completion = await asyncio.wait_for(run, LIVENESS)
    assert completion.blocked_by == m.name and lower == []
    assert [f.code for f in completion.errors] == ["overloaded"]


async def test_cancelled_while_waiting_for_a_slot_still_completes_the_event(full_pool):
    pool, gate = full_pool
    engine, ran = make_engine(pool, "wait")
    out = Outcomes()
    dispatch = asyncio.create_task(engine.process_event_async(Event(text="/cmd"), out))
    assert await wait_until_async(lambda: parked(engine) == 1)
    dispatch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await dispatch
    assert len(out.completions) == 1, "a cancelled dispatch still ends in exactly one completion"
    gate.open()
    assert wait_until(lambda: pool.busy() == 0)
    assert ran["slow"] == []


async def test_many_concurrent_events_all_complete():
    pool = ExecPool(4, 8)
    engine = Engine(pool=pool, overflow="wait")
    try:
        promote(engine.on_command("slow", lambda ctx: "s"))
        demote(engine.on_command("fast", lambda ctx: "f"))
        runs = await asyncio.gather(*(engine.process_event_async(Event(text="/slow" if i % 3 else "/fast"))
                                      for i in range(300)))
        completions = await asyncio.wait_for(asyncio.gather(*runs), LIVENESS)
        assert all(c.replies == 1 and c.errors == () for c in completions)
        stats = engine.stats()
        assert stats["events"] == 300 and stats["pooled"] + stats["inline"] == 300
    finally:
        pool.drain(timeout=5)


async def test_policy_wait_serves_waiters_first_come_first_served_woken_by_finishing_tasks():
    """Parked dispatches get slots in arrival order, each woken by a pooled task finishing.

    The periodic re-check is pushed out of reach, so only the pool's "room freed" signal can
    move the line: if that hand-off were lost, the waiters would never run.
    """
    pool = ExecPool(1, 0, idle_seconds=5.0)
    engine = Engine(pool=pool, overflow="wait", overflow_wait=LIVENESS * 3, overflow_recheck=3600.0)
    gate = threading.Event()
    order: list[str] = []
    promote(add_cmd(engine, lambda ctx: gate.wait(LIVENESS) and None, name="gate", pattern="gate"))
    promote(add_cmd(engine, lambda ctx: order.append(ctx.args), name="work", pattern="work"))
    try:
        first = await engine.process_event_async(Event(text="/gate"))  # takes the only slot
        waiting = []
        for i in range(10):
            waiting.append(asyncio.create_task(engine.process_event_async(Event(text=f"/work {i}"))))
            assert await wait_until_async(lambda n=i + 1: parked(engine) == n)  # parked before the next one arrives
        assert order == [] and not any(t.done() for t in waiting)
        gate.set()
        runs = await asyncio.wait_for(asyncio.gather(*waiting), LIVENESS)
        completions = await asyncio.wait_for(asyncio.gather(first, *runs), LIVENESS)
        assert all(c.errors == () for c in completions)
        assert order == [str(i) for i in range(10)], "first come, first served"
        assert engine.stats()["pooled"] == 11 and engine.stats()["overloaded"] == 0
    finally:
        gate.set()
        pool.drain(timeout=5)


async def test_policy_wait_does_not_poll_the_pool(full_pool):
    """Hundreds of parked dispatches cost the loop nothing while the pool stays full."""
    pool, gate = full_pool
    calls = {"n": 0}
    real_try_submit = pool.try_submit

    def counting_try_submit(fn, **kwargs):
        calls["n"] += 1
        return real_try_submit(fn, **kwargs)

    pool.try_submit = counting_try_submit  # type: ignore[method-assign]
    engine = Engine(pool=pool, overflow="wait", overflow_wait=LIVENESS, overflow_recheck=3600.0)
    promote(engine.on_command("slow", lambda ctx: None))
    waiting = [asyncio.create_task(engine.process_event_async(Event(text="/slow"))) for _ in range(200)]
    assert await wait_until_async(lambda: parked(engine) == 200)
    await asyncio.sleep(0.1)  # the point: a stretch of time in which pollers would poll
    assert calls["n"] <= 2, f"{calls['n']} submission attempts while the pool stayed full: waiters poll"
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_waiters_are_refused_with_code_draining_when_the_pool_drains(full_pool):
    pool, gate = full_pool
    engine, ran = make_engine(pool, "wait")
    dispatch = asyncio.create_task(engine.process_event_async(Event(text="/cmd")))
    assert await wait_until_async(lambda: parked(engine) == 1)
    drained = threading.Thread(target=pool.drain, args=(LIVENESS,))
    drained.start()
    try:
        run = await asyncio.wait_for(dispatch, LIVENESS)
        completion = await asyncio.wait_for(run, LIVENESS)
    finally:
        gate.open()
        drained.join()
    assert [f.code for f in completion.errors] == ["draining"]
    assert ran["slow"] == [] and len(ran["after"]) == 1


async def test_a_dispatch_parked_ahead_gets_the_next_slot_before_earlier_ones():
    """``start_event(..., ahead)``: asked only when the dispatch parks; True puts it in the lane
    woken first (the app's choice: a tenant within its share of the pool, execapp.pool_share)."""
    pool = ExecPool(1, 0, idle_seconds=5.0)
    engine = Engine(pool=pool, overflow="wait", overflow_wait=LIVENESS * 3, overflow_recheck=3600.0)
    gate = threading.Event()
    order: list[str] = []
    asked: list[str] = []
    promote(add_cmd(engine, lambda ctx: gate.wait(LIVENESS) and None, name="gate", pattern="gate"))
    promote(add_cmd(engine, lambda ctx: order.append(ctx.args), name="work", pattern="work"))

    def ahead(name: str) -> bool:
        asked.append(name)
        return name == "urgent"

    try:
        first, rest = engine.start_event(Event(text="/gate"), None, lambda: ahead("gate"))
        assert rest is None and asked == []  # not parked: never asked
        waiting = []
        for i, name in enumerate(["1", "2", "3", "urgent"]):
            run, rest = engine.start_event(Event(text=f"/work {name}"), None, lambda n=name: ahead(n))
            assert rest is not None
            waiting.append(asyncio.create_task(rest))
            assert await wait_until_async(lambda n=i + 1: parked(engine) == n)
        gate.set()
        await asyncio.wait_for(asyncio.gather(*waiting), LIVENESS)
        assert asked == ["1", "2", "3", "urgent"]
        assert await wait_until_async(lambda: len(order) == 4)  # the last one submitted, maybe not run yet
        assert order == ["urgent", "1", "2", "3"]
    finally:
        gate.set()
        pool.drain(timeout=5)


async def test_a_fast_handler_that_cannot_start_inline_runs_in_the_pool_instead():
    # A handler proven fast whose plugin had every slot taken raised PluginBusy inline (the loop may
    # not wait): the event ended plugin_busy while a pool thread could have waited for the slot.
    engine = Engine()
    try:
        calls: list[tuple[ExecClass, int]] = []

        def handler(ctx):
            calls.append((ctx.exec_class, threading.get_ident()))
            if ctx.exec_class is ExecClass.SYNC:
                raise NotStarted("every slot is taken")
            return "ran"

        m = demote(add_cmd(engine, handler, name="busy"))
        runs = m.profile.runs
        out = Outcomes()
        run = await engine.process_event_async(Event(text="/cmd"), out)
        completion = await asyncio.wait_for(run, LIVENESS)
        assert not completion.errors and completion.replies == 1
        assert [r.exec_class for r in out.replies] == [ExecClass.POOL]
        assert [c[0] for c in calls] == [ExecClass.SYNC, ExecClass.POOL]
        assert calls[0][1] == threading.get_ident() != calls[1][1]
        assert engine.stats()["inline"] == 0 and engine.stats()["pooled"] == 1
        assert wait_until(lambda: m.profile.runs == runs + 1)  # the pooled run; the refusal was not measured
        # Without a pool to move to (the synchronous path), it is the handler's failure.
        completion = engine.process_event_sync(Event(text="/cmd"), Outcomes())
        assert [f.code for f in completion.errors] == ["not_started"]
    finally:
        engine.shutdown(timeout=5)
