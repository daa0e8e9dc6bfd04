"""A plugin's slots (plugins.strategies.Slots) are handed out in turn among the tenants waiting for
them: a tenant whose many calls wait for a busy plugin does not make another tenant's call wait
behind all of them (tests/execapp/test_plugin_share_e2e.py is the same on a real deployment)."""
from __future__ import annotations

import threading
import time

import pytest

from plugins.errors import PluginBusy
from plugins.loaded import LoadedPlugin
from plugins.spec import PluginSpec
from plugins.strategies import Slots
from tests.conftest import wait_until


def _waiting(slots: Slots, tenant: str, got: list[str], wait: float = 10.0) -> threading.Thread:
    def run() -> None:
        if slots.wait(True, wait, tenant):
            got.append(tenant)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_freed_slot_goes_to_the_waiting_tenant_served_least_recently() -> None:
    slots = Slots(1)
    assert slots.take("a")
    got: list[str] = []
    threads = []
    for n in range(5):  # a's calls wait first
        threads.append(_waiting(slots, "a", got))
        assert wait_until(lambda n=n: slots.waiting == n + 1, 5)
    threads.append(_waiting(slots, "b", got))
    assert wait_until(lambda: slots.waiting == 6, 5)
    assert not slots.take("c"), "a new caller does not pass the callers in line"
    slots.give("a")
    assert wait_until(lambda: got == ["b"], 5), got  # b's one call, though it came last
    slots.give("b")
    assert wait_until(lambda: got == ["b", "a"], 5), got
    for _ in range(4):
        slots.give("a")
    slots.give("a")
    for thread in threads:
        thread.join(5)
    assert got == ["b", "a", "a", "a", "a", "a"] and slots.waiting == 0 and slots.busy == 0
    assert slots.take("c"), "nobody waits: a free slot is taken at once"
    slots.give("c")


def test_a_waiter_whose_wait_runs_out_leaves_the_line_and_is_counted() -> None:
    slots = Slots(1)
    assert slots.take("a")
    assert not slots.wait(True, 0.05, "b") and slots.waiting == 0 and slots.refused_total == 1
    assert not slots.wait(False, 1.0, "b") and slots.refused_total == 2
    slots.give("a")
    assert slots.busy == 0 and slots.take("b")


def test_many_threads_of_tenants_never_lose_or_add_a_slot() -> None:
    slots = Slots(3)
    running = [0]
    peak = [0]
    lock = threading.Lock()

    def worker(tenant: str) -> None:
        for _ in range(200):
            if slots.acquire(True, 5.0, tenant):
                with lock:
                    running[0] += 1
                    peak[0] = max(peak[0], running[0])
                with lock:
                    running[0] -= 1
                slots.give(tenant)

    threads = [threading.Thread(target=worker, args=(f"t{i % 4}",)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert peak[0] <= 3 and slots.busy == 0 and slots.waiting == 0 and slots.refused_total == 0


@pytest.mark.parametrize("strategy", ["per_request", "pooled"])
def test_a_plugin_s_calls_of_one_tenant_do_not_keep_another_tenant_s_call_waiting_until_refused(
        strategy: str) -> None:
    # 2 slots, a 1 s timeout (the longest a call waits for a slot); tenant a's 12 threads calling
    # 0.3 s calls: before, b's call waited among a's ~10 waiters in no order, often past its wait.
    spec = PluginSpec(name="turns", runtime="lua", code='function h(e) sleep(tonumber(e.args)) return "ok" end',
                      timeout=1.0, max_concurrency=2, pool_size=2, strategy=strategy,
                      permissions=frozenset({"log", "sleep"}))
    plugin = LoadedPlugin(spec)
    try:
        def call(tenant: str, ms: int) -> str:
            try:
                return plugin.call("h", {"id": "e", "type": "message", "text": "", "args": str(ms), "data": {},
                                         "session": None, "tenant": tenant}, True)
            except PluginBusy:
                return "plugin_busy"

        stop = threading.Event()

        def flood() -> None:
            while not stop.is_set():
                call("a", 300)

        floods = [threading.Thread(target=flood, daemon=True) for _ in range(12)]
        for t in floods:
            t.start()
        try:
            assert wait_until(lambda: plugin.slots.waiting >= 8, 5)
            for _ in range(4):
                started = time.monotonic()
                assert call("b", 10) == "ok"
                # one of a's calls (0.3 s) and b's, plus slack; far under the 1 s wait
                assert time.monotonic() - started < 0.9
        finally:
            stop.set()
            for t in floods:
                t.join(10)
    finally:
        plugin.close()


def test_a_shard_busy_with_one_tenant_s_sessions_serves_another_tenant_s_session_in_turn() -> None:
    # One shard (every session hashes to it), a 1 s timeout: tenant a's 12 threads keep it busy
    # with 0.3 s calls on their sessions; b's session waits for one of them, not for all.
    spec = PluginSpec(name="shard-turns", runtime="lua", code='function h(e) sleep(tonumber(e.args)) return "ok" end',
                      timeout=1.0, strategy="sharded", shard_count=1, max_concurrency=8,
                      permissions=frozenset({"log", "sleep"}))
    plugin = LoadedPlugin(spec)
    try:
        def call(tenant: str, session: str, ms: int) -> str:
            try:
                return plugin.call("h", {"id": "e", "type": "message", "text": "", "args": str(ms), "data": {},
                                         "session": session, "tenant": tenant}, True)
            except PluginBusy:
                return "plugin_busy"

        stop = threading.Event()

        def flood(n: int) -> None:
            while not stop.is_set():
                call("a", f"room-{n}", 300)

        floods = [threading.Thread(target=flood, args=(n,), daemon=True) for n in range(12)]
        for t in floods:
            t.start()
        try:
            assert wait_until(lambda: plugin.strategy.waiting >= 8, 5)
            for _ in range(4):
                started = time.monotonic()
                assert call("b", "room-1", 10) == "ok"
                assert time.monotonic() - started < 0.9  # one of a's calls (0.3 s) and b's, plus slack
        finally:
            stop.set()
            for t in floods:
                t.join(10)
    finally:
        plugin.close()


def test_a_tenant_taking_slot_after_slot_is_recorded_once_and_still_ordered_by_its_last_turn(monkeypatch) -> None:
    # The hot path: one tenant's calls back to back record its turn at the first of the run only
    # (a dict store and a new int per call saved); the order of the tenants' last turns is the same.
    records: list[str] = []
    record = Slots._record
    monkeypatch.setattr(Slots, "_record", lambda self, tenant: (records.append(tenant), record(self, tenant))[1])
    slots = Slots(2)
    for _ in range(50):
        assert slots.take("a")
        slots.give("a")
    assert records == ["a"]
    assert slots.take("b") and slots.take("a")  # a took after b: b is now the least recently served
    assert records == ["a", "b", "a"]
    got: list[str] = []
    threads = [_waiting(slots, "a", got)]
    assert wait_until(lambda: slots.waiting == 1, 5)
    threads.append(_waiting(slots, "b", got))
    assert wait_until(lambda: slots.waiting == 2, 5)
    slots.give("a")
    assert wait_until(lambda: got == ["b"], 5), got
    slots.give("b")
    assert wait_until(lambda: got == ["b", "a"], 5), got
    for thread in threads:
        thread.join(5)
