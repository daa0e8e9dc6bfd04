"""The sharded strategy's two call paths (issue 14): the flat one, with its shard-by-session
memo, and ShardedGeneral for a plugin slot below the shard count (or a thread-bound runtime,
tests/plugins/test_js_threads.py)."""
from __future__ import annotations

import threading
import zlib

import pytest

from plugins import strategies
from plugins.errors import PluginBusy
from plugins.loaded import LoadedPlugin
from plugins.spec import PluginSpec
from tests.conftest import wait_until

from .guests import CODE


def make(**limits) -> LoadedPlugin:
    options = {"timeout": 2.0, "shard_count": 4, "max_concurrency": 8, "permissions": frozenset({"sleep"}), **limits}
    return LoadedPlugin(PluginSpec(name="t-sharded", runtime="lua", code=CODE["lua"], strategy="sharded", **options))


def event(session: str | None, eid: str = "e1", args: str = "") -> dict:
    return {"id": eid, "type": "message", "text": f"/x {args}", "args": args, "data": None, "session": session}


def test_the_remembered_shard_of_a_session_is_its_crc32_shard_across_memo_clears(monkeypatch):
    monkeypatch.setattr(strategies, "_SHARD_KEYS", 3)  # cleared every few keys
    plugin = make()
    try:
        assert type(plugin.strategy) is strategies.Sharded
        sessions = [f"user-{i}" for i in range(10)]
        counts: dict[str, list[int]] = {s: [] for s in sessions}
        for _ in range(3):
            for s in sessions:
                counts[s].append(int(plugin.call("count", event(s))))
                plugin.call("count", event(None, eid=f"no-session-{s}"))  # keyed by id: churns the memo
        memo = plugin.strategy._by_key  # type: ignore[attr-defined]
        assert len(memo) <= 3
        shards = plugin.strategy.shards  # type: ignore[attr-defined]
        for (tenant, session), shard in memo.items():
            assert tenant == "" and shard is shards[zlib.crc32(session.encode()) % 4]
        for s in sessions:
            assert counts[s] == sorted(counts[s]) and len(set(counts[s])) == 3  # one warm instance, in order
    finally:
        plugin.close()


def test_a_key_that_is_not_a_string_still_picks_a_stable_shard():
    plugin = make()
    try:
        odd = {"id": 42, "type": "message", "text": "", "args": "", "data": None, "session": None}
        assert [plugin.call("count", odd) for _ in range(2)] == ["1", "2"]
        assert plugin.strategy._by_key == {}  # type: ignore[attr-defined]
    finally:
        plugin.close()


@pytest.mark.parametrize("blocking", [False, True])
def test_a_slot_limit_below_the_shard_count_bounds_calls_across_shards(blocking: bool):
    plugin = make(max_concurrency=1, timeout=0.5)
    try:
        assert type(plugin.strategy) is strategies.ShardedGeneral
        a, b = "user-0", next(f"user-{i}" for i in range(1, 50)
                               if zlib.crc32(f"user-{i}".encode()) % 4 != zlib.crc32(b"user-0") % 4)
        napping = threading.Thread(target=plugin.call, args=("nap", event(a, args="400")))
        napping.start()
        assert wait_until(lambda: plugin.slots.busy == 1)
        with pytest.raises(PluginBusy):  # another shard, but no slot left (blocking: not within the wait)
            plugin.call("reply", event(b, args="x"), blocking, deadline=None if not blocking else 0.0)
        napping.join()
        assert plugin.call("reply", event(b, args="x")) == "hi x" and plugin.slots.busy == 0
    finally:
        plugin.close()
