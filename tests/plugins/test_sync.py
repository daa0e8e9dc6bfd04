"""The registry as engine matchers: the bundled examples through Engine, refreshes, stats, the KV store."""
from __future__ import annotations

import asyncio

import pytest
from django.core.management import call_command
from django.test import override_settings

from execapp import extensions
from execapp.engine import Engine, Event, ExecClass
from execapp.worker import service_factories
from plugins import kv, sync
from plugins.models import Binding, KVEntry, Plugin
from plugins.runtimes import kvstore

pytestmark = pytest.mark.django_db


@pytest.fixture
def engine():
    call_command("loadplugins", verbosity=0)
    eng = Engine(pool_enabled=False)
    assert sync.sync_engine(eng) is True
    yield eng
    sync.manager.clear()


def texts(engine: Engine, text: str, session: str | None = None) -> list[str]:
    replies = []
    completion = engine.process_event_sync(Event(text=text, session=session), on_outcome=replies.append)
    assert completion.errors == (), completion.errors
    return [r.text if r.text is not None else r.data for r in replies if hasattr(r, "text")]


def test_the_bundled_examples_answer_through_the_engine(engine: Engine) -> None:
    assert texts(engine, "/ping") == ["pong"]
    assert texts(engine, "/echo hello  world") == ["hello  world"]
    assert texts(engine, "/slow 20") == ["slept 20"]
    assert texts(engine, "/upper make me loud") == ["MAKE ME LOUD"]
    assert texts(engine, "/add 2 40") == ["42"]
    assert texts(engine, "/add -7 3") == ["-4"]
    assert texts(engine, "/count") == ["1"]
    assert texts(engine, "/count") == ["2"]
    assert texts(engine, "hello") == []


def test_guard_blocks_every_other_handler(engine: Engine) -> None:
    outcomes = []
    completion = engine.process_event_sync(Event(text="/echo this is forbidden"), on_outcome=outcomes.append)
    assert [o.text for o in outcomes if hasattr(o, "text")] == ["blocked"]
    assert completion.blocked_by == "guard.guard" and completion.matched == 1
    assert texts(engine, "/echo Forbidden!") == ["blocked"]
    assert texts(engine, "/echo forbiddenness") == ["forbiddenness"]  # not the word


def test_matchers_are_named_per_plugin_and_keep_their_profiles(engine: Engine) -> None:
    names = {m.name: m for m in engine.matchers}
    assert set(names) == {"ping.ping", "echo.echo", "slow.slow", "upper.upper", "add.add", "counter.count",
                          "guard.guard"}
    assert names["ping.ping"].plugin == "ping" and engine.matchers[0].name == "guard.guard"
    profile = names["ping.ping"].profile
    assert sync.sync_engine(engine) is False  # registry unchanged: nothing rebuilt
    assert sync.sync_engine(engine, force=True) is True
    assert {m.name: m for m in engine.matchers}["ping.ping"].profile is profile


def test_an_edited_plugin_takes_effect_on_the_next_event(engine: Engine, django_capture_on_commit_callbacks) -> None:
    assert texts(engine, "/ping") == ["pong"]
    plugin = Plugin.objects.get(name="ping")
    with django_capture_on_commit_callbacks(execute=True):
        plugin.source = 'function ping(event) return "pong v2" end'
        plugin.save()
    assert texts(engine, "/ping") == ["pong v2"]  # no explicit sync: the commit refreshed the engine
    with django_capture_on_commit_callbacks(execute=True):
        Binding.objects.create(plugin=plugin, kind="command", pattern="pong", handler="ping")
    assert texts(engine, "/pong") == ["pong v2"]
    with django_capture_on_commit_callbacks(execute=True):
        Plugin.objects.filter(name="echo").update(enabled=False)
        Plugin.objects.get(name="echo").save()
    assert texts(engine, "/echo hi") == []
    assert "echo" not in {row["plugin"] for row in sync.instance_pool_stats()}


def test_another_process_sees_the_change_at_its_next_poll(engine: Engine) -> None:
    other = Engine(pool_enabled=False)  # not tracked: stands for another worker process
    sync.sync_engine(other)
    Plugin.objects.filter(name="ping").update(source='function ping(e) return "changed" end')
    from plugins.models import RegistryState
    RegistryState.bump()  # what a save in that other process does
    assert texts(other, "/ping") == ["pong"]
    service = sync.RegistrySync(type("W", (), {"engine": other})())
    service.tick()
    assert texts(other, "/ping") == ["changed"]


def test_instance_pool_stats_rows(engine: Engine) -> None:
    texts(engine, "/add 1 1")
    rows = {row["plugin"]: row for row in sync.instance_pool_stats()}
    assert set(rows) == {"ping", "echo", "slow", "upper", "add", "counter", "guard"}
    add = rows["add"]
    for key in ("plugin", "runtime", "strategy", "capacity", "busy", "idle", "waiting", "waits_total",
                "timeouts_total", "errors_total"):
        assert key in add
    assert (add["runtime"], add["strategy"], add["capacity"], add["busy"], add["idle"]) == ("wasm", "pooled", 4, 0, 1)
    assert rows["ping"]["strategy"] == "per_request" and rows["upper"]["strategy"] == "pooled"


def test_timeouts_and_errors_reach_the_engine_with_their_codes(engine: Engine) -> None:
    Plugin.objects.filter(name="slow").update(timeout_ms=100)
    Plugin.objects.get(name="slow").save()
    sync.sync_engine(engine)
    outcomes = []
    completion = engine.process_event_sync(Event(text="/slow 1000"), on_outcome=outcomes.append)
    assert [(f.code, f.plugin) for f in completion.errors] == [("timeout", "slow")]
    assert "plugin 'slow' handler 'slow'" in completion.errors[0].message


async def test_inline_handlers_on_the_event_loop_never_wait_for_a_slot(engine: Engine) -> None:
    # While pool threads hold every one of ping's max_concurrency slots, an inline call on the
    # loop does not block the loop waiting for one: it goes to the pool (NotStarted), where a
    # thread waits for a slot, and runs once one frees (before: it ended plugin_busy at once).
    loaded = sync.manager.get("ping")
    held = loaded.spec.max_concurrency
    assert all(loaded.slots.acquire(True, 1.0) for _ in range(held))
    released = False
    eng = Engine(pool_enabled=True, max_workers=2)
    try:
        matcher = next(m for m in engine.matchers if m.name == "ping.ping")
        for _ in range(40):  # make it "proven fast" so the engine runs it inline
            matcher.profile.record(0.0001)
        eng.set_matchers([matcher])
        outcomes: list = []
        run = await eng.process_event_async(Event(text="/ping"), outcomes.append)
        ticks = 0
        for _ in range(5):  # the loop runs on while a pool thread waits for the slot
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 5 and not run.done
        for _ in range(held):
            loaded.slots.release()
        released = True
        completion = await asyncio.wait_for(run, 5)
        assert not completion.errors and [r.text for r in outcomes if hasattr(r, "text")] == ["pong"]
        assert [r.exec_class.value for r in outcomes if hasattr(r, "text")] == ["pool"]
    finally:
        eng.shutdown(1)
        if not released:
            for _ in range(held):
                loaded.slots.release()


def test_counter_keeps_counting_after_a_restart(engine: Engine) -> None:
    assert texts(engine, "/count") == ["1"]
    assert texts(engine, "/count") == ["2"]
    sync.manager.clear()  # a new process: nothing loaded, nothing cached in memory
    fresh = Engine(pool_enabled=False)
    sync.sync_engine(fresh)
    assert texts(fresh, "/count") == ["3"]
    assert KVEntry.objects.get(plugin="counter", key="count").value == "3"


@pytest.mark.redis
def test_counter_uses_redis_when_configured(engine: Engine, redis_url: str) -> None:
    with override_settings(REDIS_URL=redis_url):
        assert texts(engine, "/count") == ["1"]
        assert texts(engine, "/count") == ["2"]
        assert isinstance(kv.kv_store(), kv.RedisKV)
        from execapp.conf import redis_key  # namespaced by this test's prefix (the redis_url fixture)
        assert kv.kv_store().client.hget(redis_key("execapp:plugins:kv:counter"), "count") == "2"
    assert not KVEntry.objects.filter(plugin="counter").exists()


@pytest.mark.django_db(transaction=True)
def test_kv_from_an_inline_handler_on_the_event_loop(engine: Engine) -> None:
    # Django refuses ORM calls on a thread running an event loop; the KV store hops off it.
    async def inline() -> list[str]:
        return texts(engine, "/count") + texts(engine, "/count")

    assert asyncio.run(inline()) == ["1", "2"]


def test_pooled_dispatch_through_the_engine_pool(engine: Engine) -> None:
    pooled = Engine(max_workers=4)
    pooled.set_matchers(engine.matchers)
    replies = []
    run = pooled.process_event(Event(text="/slow 30"), on_outcome=replies.append)
    completion = run.wait(5)
    assert completion is not None and completion.errors == ()
    assert [r.text for r in replies if hasattr(r, "text")] == ["slept 30"]
    assert replies[0].exec_class.value == "pool"
    pooled.shutdown(2)


def test_the_worker_runs_the_registry_sync_service() -> None:
    # Registered by the plugins app's ready(): execapp names no plugins module.
    assert ("plugins.sync", sync.registry_sync) in service_factories()
    eng = Engine(pool_enabled=False)
    service = sync.registry_sync(type("W", (), {"engine": eng})())
    assert service.interval == 2.0
    call_command("loadplugins", verbosity=0)
    service.tick()
    assert texts(eng, "/ping") == ["pong"]
    service.close()


def test_the_plugins_app_provides_its_pool_stats_and_kv_store() -> None:
    sync.manager.clear()  # what earlier tests of this process loaded
    loaded = sync.manager.load(Plugin.objects.create(name="p", runtime="lua", source="function a(ev) return 'a' end"))
    rows = extensions.stats("plugin_pools")
    assert rows is not None and [r["plugin"] for r in rows] == ["p"] and rows == sync.instance_pool_stats()
    assert isinstance(kvstore.installed(), kv.ConfiguredKV)  # the host API's kv_get/kv_set use the settings' store
    sync.manager.retain(set())
    assert extensions.stats("plugin_pools") == [] and loaded.spec.name == "p"


def test_a_plugin_over_the_inline_memory_cap_runs_in_the_pool_only_until_its_cap_is_lowered(
        engine: Engine, settings) -> None:
    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "INLINE_MAX_MEMORY_MB": 16}
    Plugin.objects.filter(name="ping").update(memory_mb=64)
    assert sync.sync_engine(engine, force=True)
    ping = next(m for m in engine.matchers if m.name == "ping.ping")
    echo = next(m for m in engine.matchers if m.name == "echo.echo")
    for _ in range(40):  # both proven fast
        assert texts(engine, "/ping") == ["pong"] and texts(engine, "/echo x") == ["x"]
    assert ping.profile.should_pool() is ExecClass.POOL and "INLINE_MAX_MEMORY_MB" in ping.profile.pool_only
    assert echo.profile.should_pool() is ExecClass.SYNC and echo.profile.pool_only is None
    Plugin.objects.filter(name="ping").update(memory_mb=16)
    assert sync.sync_engine(engine, force=True)
    ping = next(m for m in engine.matchers if m.name == "ping.ping")
    assert ping.profile.pool_only is None
    for _ in range(40):
        texts(engine, "/ping")
    assert ping.profile.should_pool() is ExecClass.SYNC


def test_a_worker_loads_no_more_bindings_of_a_plugin_than_it_may_have(engine: Engine, settings, caplog) -> None:
    # Rows written past the models' check (bulk_create, SQL, a limit lowered since): every regex
    # binding is a search of every message on the event loop, so the worker loads the first ones
    # only, for its matchers and for the unmatched hint alike.
    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "MAX_BINDINGS_PER_PLUGIN": 5,
                        "MAX_REGEX_BINDINGS_PER_PLUGIN": 2}
    plugin = Plugin.objects.get(name="echo")
    Binding.objects.bulk_create([Binding(plugin=plugin, kind="regex", pattern=f"x{i}y", handler="echo")
                                 for i in range(3000)])
    assert sync.sync_engine(engine, force=True)
    echo = [m for m in engine.matchers if m.plugin == "echo"]
    assert [m.kind.value for m in echo] == ["command", "regex", "regex"]  # the first by id
    assert "plugin echo: 2998 bindings skipped: a plugin may have at most 5 bindings, 2 of them regex" in caplog.text
    assert texts(engine, "x0y") == ["x0y"] and texts(engine, "x2y") == []
    Plugin.objects.filter(name="echo").update(enabled=False)
    assert sync.sync_engine(engine, force=True)
    assert sync.unmatched_hint("message", "x1y") is not None and sync.unmatched_hint("message", "x2y") is None
    assert len([key for key in sync._hints if key[0] == "regex"]) == 2


def test_a_worker_loads_no_more_plugins_and_regex_bindings_together_than_it_may(settings, caplog) -> None:
    # Rows written past the models' check (bulk_create, SQL, the list's enable action, a limit
    # lowered since): the plugins created first load, the others are never compiled here, and the
    # regex bindings of all loaded plugins together stay within MAX_REGEX_BINDINGS.
    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "MAX_PLUGINS": 3, "MAX_REGEX_BINDINGS": 4}
    plugins = Plugin.objects.bulk_create([
        Plugin(name=f"p{i}", runtime="lua", source=f"function h(ev) return 'p{i}' end") for i in range(5)])
    Binding.objects.bulk_create([Binding(plugin=p, kind="regex", pattern=f"r{j}x{p.name}", handler="h")
                                 for p in plugins for j in range(2)])
    Binding.objects.bulk_create([Binding(plugin=p, kind="command", pattern=p.name, handler="h") for p in plugins])
    engine = Engine(pool_enabled=False)
    try:
        assert sync.sync_engine(engine, force=True)
        loaded = sorted(m.name + "@" + m.kind.value for m in engine.matchers)
        assert {m.plugin for m in engine.matchers} == {"p0", "p1", "p2"}
        assert sum(m.kind.value == "regex" for m in engine.matchers) == 4
        assert [n for n in loaded if n.startswith("p2")] == ["p2.h@command"], "p2's regexes are past the total"
        assert {p.name for p in sync.manager.all()} == {"p0", "p1", "p2"}, "p3 and p4 were not compiled"
        assert "2 enabled plugins not loaded (p3, p4): at most 3 enabled plugins load, with at most" \
            in caplog.text
        assert "plugin p2: 2 regex bindings skipped: the enabled plugins may have at most 4 regex bindings" \
            in caplog.text
        assert "did not load (too_many_plugins)" in (sync.unmatched_hint("message", "/p4") or "")
        settings.EXECAPP = {**settings.EXECAPP, "MAX_TOTAL_CODE_BYTES": 2 * Plugin.objects.get(name="p0").code_size()}
        assert sync.sync_engine(engine, force=True)
        assert {m.plugin for m in engine.matchers} == {"p0", "p1"}
        assert "did not load (too_much_code)" in (sync.unmatched_hint("message", "/p2") or "")
        settings.EXECAPP = {**settings.EXECAPP, "MAX_TOTAL_CODE_BYTES": 32 << 20}
        assert sync.sync_engine(engine, force=True)
        assert texts(engine, "/p1") == ["p1"] and texts(engine, "/p4") == []
    finally:
        sync.manager.clear()


def test_the_hints_read_a_bounded_number_of_disabled_bindings_without_their_plugins_code(monkeypatch) -> None:
    # Disabled plugins are not counted by MAX_PLUGINS: 2,000 of them with 100 bindings each made
    # every registry change cost each worker 40-60 s and ~390 MiB building 200,000 hints, and
    # each binding's row carried its plugin's whole source.
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    monkeypatch.setattr(sync, "MAX_HINT_BINDINGS", 30, raising=False)
    plugins = Plugin.objects.bulk_create([Plugin(name=f"off{i}", runtime="lua", enabled=False,
                                                 source="-- " + "x" * 10_000 + "\nfunction h(e) return 1 end")
                                          for i in range(5)])
    Binding.objects.bulk_create([Binding(plugin=p, kind="command", pattern=f"c{j}{p.name}", handler="h")
                                 for p in plugins for j in range(20)])
    engine = Engine(pool_enabled=False)
    with CaptureQueriesContext(connection) as queries:
        assert sync.sync_engine(engine, force=True)
    assert len(sync._hints) == 30, "the first 30 disabled bindings (by plugin, then id)"
    assert "plugin 'off0' is disabled" in (sync.unmatched_hint("message", "/c19off0") or "")
    assert "plugin 'off1' is disabled" in (sync.unmatched_hint("message", "/c9off1") or "")
    assert sync.unmatched_hint("message", "/c0off4") is None
    hint_query = next(q["sql"] for q in queries.captured_queries if "LIMIT" in q["sql"] and "binding" in q["sql"])
    assert '"source"' not in hint_query and '"module"' not in hint_query
    sync.manager.clear()


def test_a_worker_loads_one_copy_of_a_binding_and_counts_message_bindings_as_regexes(settings) -> None:
    # Rows written past the models' checks: 100 copies of an event binding of type message made
    # one message run the handler 100 times and send 100 replies.
    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "MAX_REGEX_BINDINGS_PER_PLUGIN": 3}
    plugin = Plugin.objects.create(name="amp", runtime="lua", source="function h(e) return 'x' end "
                                                                      "function g(e) return 'y' end")
    Binding.objects.bulk_create([Binding(plugin=plugin, kind="event", pattern="message", handler="h")
                                 for _ in range(100)])
    Binding.objects.bulk_create([Binding(plugin=plugin, kind="event", pattern="message", handler="g"),
                                 Binding(plugin=plugin, kind="regex", pattern="o", handler="g"),
                                 Binding(plugin=plugin, kind="regex", pattern="l", handler="g")])
    engine = Engine(pool_enabled=False)
    try:
        assert sync.sync_engine(engine, force=True)
        assert sorted(texts(engine, "hello")) == ["x", "y", "y"], "one copy of each, three that see every message"
    finally:
        sync.manager.clear()


def test_a_worker_runs_a_bounded_number_of_handlers_for_one_command(settings, caplog) -> None:
    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "MAX_BINDINGS_PER_PATTERN": 2}
    plugin = Plugin.objects.create(name="fan", runtime="lua", source="".join(
        f"function h{i}(e) return 'h{i}' end " for i in range(5)))
    Binding.objects.bulk_create([Binding(plugin=plugin, kind="command", pattern="x", handler=f"h{i}")
                                 for i in range(5)])
    engine = Engine(pool_enabled=False)
    try:
        assert sync.sync_engine(engine, force=True)
        assert sorted(texts(engine, "/x")) == ["h0", "h1"], "the first two by id"
        assert "plugin fan: 3 bindings skipped: at most 2 bindings of all enabled plugins may share one command or " \
            "event type (EXECAPP['MAX_BINDINGS_PER_PATTERN']" in caplog.text
    finally:
        sync.manager.clear()
