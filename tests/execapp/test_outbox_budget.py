"""An owner's outbox budget (execapp.outbox_budget): what all of one owner's outboxes on a worker
hold together is bounded, that owner alone is held, a frame bigger than the budget still goes out,
and the accounting balances (bytes in == bytes out, never negative)."""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from execapp import metrics
from execapp.connection import Connection
from execapp.engine import Engine
from execapp.outbox import Outbox, OutboxLimits
from execapp.outbox_budget import OutboxBudget
from execapp.protocol import Limits
from tests.conftest import wait_until_async

from .ws_fixtures import Admission, channel_layer, ws_worker  # noqa: F401

#: Each outbox alone could hold far more than the owner's budget: only the budget binds here.
ROOMY = OutboxLimits(max_frames=10_000, max_bytes=10_000_000)
REPLY = 2000  # characters of each reply of /big


def _big(ctx: Any) -> str:
    return "x" * REPLY


def _engine() -> Engine:
    engine = Engine(pool_enabled=False)  # inline handlers: an event's frames are queued as it is read
    engine.add(engine.make_matcher("command", "big", _big, plugin="test"))
    return engine


class Client:
    """One WebSocket client as a Connection sees it: its socket's sends wait while it does not read."""

    def __init__(self, reading: bool = True) -> None:
        self.reading = asyncio.Event()
        if reading:
            self.reading.set()
        self.frames: list[dict] = []

    async def send(self, text: str) -> None:
        await self.reading.wait()
        self.frames.append(json.loads(text))

    def dones(self) -> Counter:
        return Counter(f["id"] for f in self.frames if f.get("type") == "done")


async def test_an_owner_whose_clients_do_not_read_is_held_at_its_budget_while_another_owner_is_served(
        ws_worker: Any) -> None:
    """Owner a's 20 clients never read: together its outboxes stay within its budget (plus the
    frames of the one event read last), every one of its connections stops being read, and owner
    b's connection on the same worker keeps getting its replies; once a's clients read again,
    every event a sent gets exactly one done."""
    worker, engine = ws_worker, _engine()
    budget_bytes = 20_000  # ~4 events' frames; each outbox alone could take 10 MB
    for owner in ("tenant:a", "tenant:b"):
        for _ in range(20):
            assert worker.connection_opened(owner, 100)
    a_budget = worker.outbox_budget("tenant:a", budget_bytes)
    b_budget = worker.outbox_budget("tenant:b", budget_bytes)
    assert a_budget is not None and b_budget is not None and a_budget is not b_budget
    a_clients = [Client(reading=False) for _ in range(20)]
    a_conns = [Connection(engine, Admission(), Limits(4096, 1000), c.send, owner="tenant:a", outbox_limits=ROOMY,
                          outbox_budget=a_budget) for c in a_clients]
    sent = [0] * len(a_conns)
    holds_before = metrics.OWNER_OUTBOX_WAITS._value.get()

    async def flood(n: int, conn: Connection) -> None:  # each client sends 50 events without reading
        for i in range(50):
            await conn.receive(json.dumps({"id": f"a{n}-{i}", "text": "/big"}))
            sent[n] += 1

    floods = [asyncio.ensure_future(flood(n, c)) for n, c in enumerate(a_conns)]
    try:
        # Nothing is written to a's clients, so either the budget holds every connection of the
        # owner (what is asserted below) or they read all 1,000 events (the rule is gone).
        assert await wait_until_async(lambda: all(t.done() for t in floods)
                                      or sum(not f.done() for f in a_budget._waiters) == len(a_conns))
        queued = sum(c.outbox.bytes for c in a_conns)
        one_event = 2 * (REPLY + 200)  # its reply and its done, as frames
        assert queued == a_budget.bytes <= budget_bytes + one_event, (queued, sum(sent))
        assert sum(sent) < 20 and a_budget.holds >= len(a_conns)
        assert metrics.OWNER_OUTBOX_WAITS._value.get() - holds_before == a_budget.holds
        # Owner b on the same worker: not held, every reply and done arrives.
        b_client = Client()
        b_conn = Connection(engine, Admission(), Limits(4096, 1000), b_client.send, owner="tenant:b",
                            outbox_limits=ROOMY, outbox_budget=b_budget)
        for i in range(10):
            await asyncio.wait_for(b_conn.receive(json.dumps({"id": f"b{i}", "text": "/big"})), 5)
        assert await wait_until_async(lambda: len(b_client.dones()) == 10)
        assert [f["type"] for f in b_client.frames].count("reply") == 10 and b_budget.holds == 0
        # a's clients read again: every event they sent is read and done, once.
        for client in a_clients:
            client.reading.set()
        await asyncio.wait_for(asyncio.gather(*floods), 10)
        assert await wait_until_async(lambda: all(len(c.dones()) == 50 for c in a_clients))
        assert all(set(c.dones().values()) == {1} for c in a_clients)
        assert a_budget.bytes == 0 and not a_budget._waiters
        b_conn.close()
    finally:
        for task in floods:
            task.cancel()
        await asyncio.gather(*floods, return_exceptions=True)
        for conn in a_conns:
            conn.close()


async def test_a_frame_larger_than_the_budget_still_goes_out_from_an_owner_with_nothing_queued() -> None:
    written: list[Any] = []

    async def write(item: Any) -> None:
        written.append(item)

    budget = OutboxBudget(1000)
    first, second = (Outbox(write, "test", limits=ROOMY, budget=budget) for _ in range(2))
    assert not first.full and first.offer("huge", "room", 5000) is True  # the owner had nothing queued
    assert budget.bytes == 5000 and budget.over and second.full  # its other connections wait meanwhile
    assert second.offer("more", "room", 10) is False  # and its session frames are dropped
    await asyncio.wait_for(second.wait_room(), 5)  # returns once the big frame is written
    assert written[0] == "huge" and budget.bytes == 0 and not second.full
    second.push("own", size=5000)  # the client's own: never dropped, the same rule
    assert await wait_until_async(lambda: "own" in written)
    first.close()
    second.close()


async def test_session_frames_to_an_owner_over_its_budget_are_dropped_and_lagged_comes_once_it_drained() -> None:
    """An empty outbox of an owner over its budget drops session frames too; its one ``lagged``
    frame is sent by the budget once the owner is down to half (no writer of its own is running)."""
    gate = asyncio.Event()
    stalled: list[Any] = []
    reader: list[Any] = []

    async def stalled_write(item: Any) -> None:  # one client of the owner stopped reading
        await gate.wait()
        stalled.append(item)

    async def reader_write(item: Any) -> None:  # another reads everything
        reader.append(item)

    budget = OutboxBudget(10_000)
    slow = Outbox(stalled_write, "slow", limits=ROOMY, budget=budget)
    fast = Outbox(reader_write, "fast", limits=ROOMY, budget=budget,
                  lagged=lambda missed: (("lagged", dict(missed)), 10))
    for i in range(12):
        slow.push(f"own-{i}", size=1000)
    assert budget.over and fast.frames == 0
    assert [fast.offer(f"s{i}", "room", 100) for i in range(3)] == [False] * 3
    assert fast.missed == {"room": 3} and fast.dropped_total == 3 and reader == []
    gate.set()  # the stalled client reads: the owner drains, the reader is told what it missed
    assert await wait_until_async(lambda: reader == [("lagged", {"room": 3})])
    assert fast.offer("after", "room", 100) is True
    assert await wait_until_async(lambda: reader[-1] == "after" and budget.bytes == 0)
    slow.close()
    fast.close()


async def test_a_held_connection_that_closes_passes_its_turn_and_takes_its_bytes_off() -> None:
    gate = asyncio.Event()

    async def write(item: Any) -> None:
        await gate.wait()

    budget = OutboxBudget(1000)
    boxes = [Outbox(write, f"b{i}", limits=ROOMY, budget=budget) for i in range(3)]
    boxes[0].push("a", size=2000)
    waits = [asyncio.ensure_future(b.wait_room()) for b in boxes[1:]]
    assert await wait_until_async(lambda: len(budget._waiters) == 2)
    boxes[1].close()  # a held client leaves: its wait ends, the other stays held
    await asyncio.wait_for(waits[0], 5)
    assert not waits[1].done()
    boxes[0].close()  # the owner's bytes are gone with their connection: the last one reads on
    await asyncio.wait_for(waits[1], 5)
    assert budget.bytes == 0
    boxes[2].close()


def test_one_budget_per_owner_on_a_worker_forgotten_with_its_last_connection(ws_worker: Any) -> None:
    worker = ws_worker
    assert worker.outbox_budget("tenant:a", 0) is None  # 0: no owner budget
    assert worker.connection_opened("tenant:a", 10) and worker.connection_opened("tenant:a", 10)
    assert worker.connection_opened("tenant:b", 10)
    a = worker.outbox_budget("tenant:a", 1 << 20)
    assert a is not None and a.limit == 1 << 20
    assert worker.outbox_budget("tenant:a", 1 << 20) is a and worker.outbox_budget("tenant:b", 1 << 20) is not a
    worker.connection_closed("tenant:a")
    assert worker.outbox_budget("tenant:a", 1 << 20) is a  # one of its connections is still open
    worker.connection_closed("tenant:a")
    worker.connection_closed("tenant:b")
    assert not worker._outbox_budgets


async def test_a_consumer_s_outboxes_count_in_its_owner_s_budget(channel_layer: str, ws_worker: Any,
                                                                 settings: Any) -> None:
    from .ws_fixtures import Client as WsClient

    settings.EXECAPP = {**settings.EXECAPP, "OWNER_OUTBOX_BYTES": 123_456}
    async with WsClient() as c:
        await c.send({"id": "e", "text": "/ping"})
        assert [(await c.recv())["type"] for _ in range(2)] == ["reply", "done"]
        budget = ws_worker._outbox_budgets["token:test"]
        assert budget.limit == 123_456 and budget.bytes == 0
    assert not ws_worker._outbox_budgets


@pytest.mark.parametrize("value, check_id", [(-1, "execapp.E067"), (1.5, "execapp.E067"), ("16M", "execapp.E067"),
                                             (True, "execapp.E067"), (0, "execapp.W067"), (1000, "execapp.W068")])
def test_the_owner_outbox_budget_is_checked(settings: Any, value: Any, check_id: str) -> None:
    from execapp.checks import check_execapp_settings

    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "OWNER_OUTBOX_BYTES": value}
    found = {m.id: m for m in check_execapp_settings()}
    assert check_id in found and "OWNER_OUTBOX_BYTES" in found[check_id].msg and found[check_id].hint
    settings.EXECAPP = {**settings.EXECAPP, "OWNER_OUTBOX_BYTES": 16 << 20}
    assert not {"execapp.E067", "execapp.W067", "execapp.W068"} & {m.id for m in check_execapp_settings()}


# -- the accounting, under random sequences ----------------------------------------------------------

LIMIT = 3000
ops = st.lists(st.tuples(st.sampled_from(["push", "offer", "write", "close"]), st.integers(0, 2),
                         st.integers(0, 2500)), max_size=60)


@settings(max_examples=150, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_the_budget_is_what_its_outboxes_hold_never_negative_and_bytes_in_equal_bytes_out(
        steps: list[tuple[str, int, int]]) -> None:
    asyncio.run(_accounting(steps))


async def _accounting(steps: list[tuple[str, int, int]]) -> None:
    budget = OutboxBudget(LIMIT)
    credits = [asyncio.Semaphore(0) for _ in range(3)]
    written = [0]
    queued_in = [0]
    closed_with = [0]

    def writer(n: int) -> Any:
        async def write(item: tuple[str, int]) -> None:  # a client that reads one frame per "write"
            await credits[n].acquire()
            written[0] += item[1]
        return write

    def lagged(missed: dict[str, int]) -> tuple[Any, int]:
        queued_in[0] += 7
        return ("lagged", 7), 7

    boxes = [Outbox(writer(n), f"b{n}", limits=OutboxLimits(max_frames=8, max_bytes=2000), lagged=lagged,
                    budget=budget) for n in range(3)]

    async def settle() -> None:
        for _ in range(4):
            await asyncio.sleep(0)

    for op, n, size in steps:
        box = boxes[n]
        before = budget.bytes
        if op == "push" and not box._closed:
            box.push(("own", size), size=size)
            queued_in[0] += size
        elif op == "offer":
            lagging = bool(box.missed)
            if box.offer(("session", size), "s", size):
                queued_in[0] += size
                # The rule: a session frame never takes the owner past its budget, unless it had nothing queued.
                assert before == 0 or before + size <= LIMIT
            elif not box._closed and not lagging and not box._own_over(size):
                assert before > 0 and before + size > LIMIT  # dropped for the owner's budget alone
        elif op == "write":
            credits[n].release()
        elif op == "close" and not box._closed:
            closed_with[0] += box.bytes  # its queue, and the frame being written if any
            box.close()
        await settle()
        assert budget.bytes == sum(b.bytes for b in boxes) >= 0
        assert all(b.bytes >= 0 and b.frames >= 0 for b in boxes)
        assert all(b.full == (b._own_over() or budget.bytes > LIMIT) for b in boxes if not b._closed)
    for sem in credits:  # every client reads again
        for _ in range(500):
            sem.release()
    for _ in range(3):  # a lagged frame queued by the last writes is written too
        await asyncio.gather(*(b.flush() for b in boxes if not b._closed))
        await settle()
    assert budget.bytes == 0 and not budget._lagging
    assert queued_in[0] == written[0] + closed_with[0]
    for box in boxes:
        box.close()


async def test_full_answers_an_empty_outbox_within_its_owner_s_budget_without_a_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``full`` is read before every frame a client sends (issue 14): the common answer costs no
    call, and an empty outbox of an owner whose other outboxes hold its budget is still full."""
    async def write(item: Any) -> None:
        pass

    budget = OutboxBudget(1000)
    ours, other = (Outbox(write, "test", limits=ROOMY, budget=budget) for _ in range(2))

    def no_call(self: Outbox, extra: int = 0) -> bool:
        raise AssertionError("the common case of full made a call")

    with monkeypatch.context() as m:
        m.setattr(Outbox, "_over", no_call)
        assert not ours.full and not Outbox(write, "test", limits=ROOMY).full
    budget.bytes = 1001  # the owner's other outbox holds more than the budget
    assert ours.full
    budget.bytes = 0
    ours.close()
    other.close()
