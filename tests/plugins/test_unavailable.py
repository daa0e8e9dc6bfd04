"""A closed plugin version refuses calls with plugin_unavailable; one list of strategy names."""
from __future__ import annotations

import threading
import time

import pytest

from execapp.codes import ERROR_CODES
from execapp.engine import Engine, Event
from plugins import strategies, sync
from plugins.errors import PluginUnavailable
from plugins.loaded import LoadedPlugin
from plugins.models import Binding, Plugin
from plugins.runtimes import registry
from plugins.spec import PluginSpec
from tests.conftest import wait_until

from .guests import CODE

RUNTIMES = ["lua", "wasm", "js"]
TIMEOUT = 2.0  # the plugin's budget: a call that hung on a stopped shard thread took this + 5 s


def make(runtime: str, strategy: str, **limits) -> LoadedPlugin:
    options = {"timeout": TIMEOUT, "memory_bytes": 8 << 20, "pool_size": 2, "shard_count": 2, "max_concurrency": 8,
               **limits}
    return LoadedPlugin(PluginSpec(name=f"u-{runtime}", runtime=runtime, code=CODE[runtime], strategy=strategy,
                                   **options))


def event(session: str = "s1") -> dict:
    return {"id": "e1", "type": "message", "text": "/x a", "args": "a", "data": None, "session": session}


@pytest.mark.parametrize("strategy", list(registry.STRATEGIES))
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_closed_plugin_refuses_calls_at_once(runtime: str, strategy: str) -> None:
    plugin = make(runtime, strategy)
    assert plugin.call("count", event()) == "1"  # warm: an instance (or shard thread) exists
    plugin.close()
    started = time.monotonic()
    for blocking in (True, False):
        with pytest.raises(PluginUnavailable) as info:
            plugin.call("count", event(), blocking)
        assert info.value.code == "plugin_unavailable"
        assert f"plugin 'u-{runtime}' handler 'count': version {plugin.spec.version} was replaced" in str(info.value)
    # At once, not after the budget (a sharded JS call used to wait TIMEOUT + 5 s for its stopped thread).
    assert time.monotonic() - started < TIMEOUT
    # Refusals hold nothing: every slot and shard is free again, and none was counted as a call.
    assert plugin.slots.busy == 0 and plugin.strategy.busy == 0 and plugin.calls_total == 1


@pytest.mark.parametrize("strategy", list(registry.STRATEGIES))
def test_a_call_waiting_for_its_slot_or_shard_when_the_plugin_closes_is_refused(strategy: str) -> None:
    # JS: a sharded call runs on its shard's thread, which close() stops; a caller that was
    # waiting for the shard used to hand its call to the stopped thread and wait TIMEOUT + 5 s.
    sharded = strategy == "sharded"
    plugin = make("js", strategy, max_concurrency=8 if sharded else 1)
    assert plugin.call("count", event()) == "1"
    if sharded:
        held = plugin.strategy.shards[plugin.strategy.shard_for(event())].slot  # type: ignore[attr-defined]
        assert held.acquire(True, 1.0)
        release, waiting = held.release, lambda: plugin.strategy.waiting
    else:
        assert plugin.slots.acquire(True, 1.0)
        release, waiting = plugin.slots.release, lambda: plugin.slots.waiting
    outcome: list[object] = []

    def call() -> None:
        try:
            outcome.append(plugin.call("count", event()))
        except Exception as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=call)
    waiter.start()
    try:
        assert wait_until(lambda: waiting() == 1)  # it waits for what the test holds
        plugin.close()
    finally:
        release()
    waiter.join(TIMEOUT + 1.0)
    assert not waiter.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], PluginUnavailable), outcome
    assert plugin.slots.busy == 0 and plugin.strategy.busy == 0


@pytest.mark.django_db
def test_an_event_matched_to_a_replaced_version_gets_plugin_unavailable() -> None:
    plugin = Plugin.objects.create(name="ver", runtime="lua", source='function v(ev) return "one" end')
    Binding.objects.create(plugin=plugin, kind="command", pattern="v", handler="v")
    engine = Engine(pool_enabled=False)
    try:
        assert sync.sync_engine(engine)
        first = sync.manager.get("ver")
        matched_before = list(engine.matchers)
        plugin.source = 'function v(ev) return "two" end'
        plugin.save()
        second = sync.manager.load(plugin)  # what sync_engine does first, before it switches the matchers
        assert second is not first and first is not None and not first.strategy.closed  # the old serves on
        assert sync.sync_engine(engine)
        assert sync.manager.get("ver") is second and first.strategy.closed  # closed once the engine switched
        # The engine's own matchers run the new version...
        replies: list = []
        assert engine.process_event_sync(Event(text="/v"), on_outcome=replies.append).errors == ()
        assert [r.text for r in replies if hasattr(r, "text")] == ["two"]
        # ...and an event matched before the switch (its matcher holds the old version) is told so.
        stale = Engine(pool_enabled=False)
        stale.set_matchers(matched_before)
        completion = stale.process_event_sync(Event(text="/v"))
        assert [(f.code, f.plugin) for f in completion.errors] == [("plugin_unavailable", "ver")]
        assert "send the event again" in completion.errors[0].message
    finally:
        sync.manager.clear()


def test_plugin_unavailable_is_a_protocol_code() -> None:
    assert PluginUnavailable.code in ERROR_CODES  # a client can be told it (and /metrics counts it by name)


def test_every_strategy_name_has_one_implementation_and_one_model_choice() -> None:
    assert list(strategies.IMPLEMENTATIONS) == list(registry.STRATEGIES)
    choices = Plugin._meta.get_field("strategy").choices
    assert [name for name, _ in choices] == ["", *registry.STRATEGIES]
