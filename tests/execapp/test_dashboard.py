"""The staff-only dashboard: access, its data against the engine's own stats, stale/dropped workers,
and every worker of a deployment through Redis."""
from __future__ import annotations

import json
import threading
import time
import types
from typing import Any, Iterator

import pytest
from django.contrib.auth.models import Permission, User

from execapp import dashboard, dashboard_data, snapshots
from execapp import worker as worker_module
from execapp.engine import Event

LIVENESS = 10.0
PAGE = "/admin/execapp/dashboard/"
DATA = "/admin/execapp/dashboard/data/"


def forget_local_snapshots() -> None:
    """Empty this process's snapshot store (the backend without REDIS_URL), through its own API."""
    store = snapshots.backend()
    assert isinstance(store, snapshots.LocalBackend), "REDIS_URL must be empty here"
    for snap, _ in store.load():
        store.drop(snap["worker"])


@pytest.fixture
def publisher_only(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.EXECAPP = {"POOL_MAX_WORKERS": 4, "POOL_QUEUE_SIZE": 4, "POOL_IDLE_SECONDS": 0.5}
    settings.REDIS_URL = ""
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", ["execapp.snapshots.snapshot_publisher"])
    forget_local_snapshots()


@pytest.fixture
def process_worker(publisher_only: None, install_worker: Any) -> Iterator[worker_module.Worker]:
    """A fresh Worker installed as this process's worker (what the data view reports on)."""
    worker = install_worker(worker_module.Worker("dash-test"))
    worker.start()
    yield worker
    worker.stop(timeout=5)
    forget_local_snapshots()


@pytest.fixture
def staff_client(client: Any, db: None) -> Any:
    user = User.objects.create_user("operator", password="pw", is_staff=True)  # staff, no model permissions
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_dashboard_requires_staff(client: Any, process_worker: worker_module.Worker) -> None:
    for url in (PAGE, DATA):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/admin/login/")
    client.force_login(User.objects.create_user("visitor", password="pw"))  # logged in, not staff
    for url in (PAGE, DATA):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/admin/login/")
    inactive = User.objects.create_user("gone", password="pw", is_staff=True, is_active=False)
    client.force_login(inactive)
    assert client.get(DATA).status_code == 302
    client.force_login(User.objects.create_user("operator", password="pw", is_staff=True))
    page = client.get(PAGE)
    assert page.status_code == 200 and b'id="dash"' in page.content and b"Live pool dashboard" in page.content
    assert b"admin/css/base.css" in page.content  # inside the admin's own layout
    assert client.get(DATA).status_code == 200
    index = client.get("/admin/").content.decode()
    assert 'href="/admin/execapp/dashboard/"' in index  # reachable from the admin index


@pytest.fixture
def reader_client(client: Any, db: None) -> Any:
    """Staff who may read Events (execapp.view_eventtrace): the dashboard shows them failure messages."""
    user = User.objects.create_user("reader", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_eventtrace", content_type__app_label="execapp"))
    client.force_login(user)
    return client


def _ok(ctx: Any) -> str:
    return "ok"


def _boom(ctx: Any) -> None:
    raise RuntimeError("boom")


def test_dashboard_data_matches_engine_stats(reader_client: Any, process_worker: worker_module.Worker) -> None:
    engine = process_worker.engine
    gate = threading.Event()
    engine.add(engine.make_matcher("command", "fast", _ok, plugin="demo"))
    engine.add(engine.make_matcher("command", "boom", _boom, plugin="demo"))
    engine.add(engine.make_matcher("command", "hold", lambda ctx: gate.wait(LIVENESS) and "ok", plugin="demo"))
    for _ in range(40):
        assert engine.process_event(Event(text="/fast")).wait(LIVENESS) is not None
    assert engine.process_event(Event(text="/boom")).wait(LIVENESS) is not None
    held = [engine.process_event(Event(text="/hold")) for _ in range(6)]  # 4 running + 2 queued

    data = reader_client.get(DATA).json()
    gate.set()
    for h in held:
        assert h.wait(LIVENESS) is not None

    assert data["backend"] == "local" and len(data["workers"]) == 1
    w = data["workers"][0]
    stats = engine.stats()
    assert w["worker"] == "dash-test" and not w["stale"] and not w["stopped"]
    assert w["counts"] == {k: stats[k] for k in ("events", "inline", "pooled", "fallbacks", "overloaded", "errors")}
    assert w["counts"]["events"] == 47 and w["counts"]["errors"] == 1
    pool = stats["pool"]
    for key in ("capacity", "queue_capacity", "submitted", "failed", "rejected"):
        assert w["pool"][key] == pool[key], key
    assert w["pool"]["in_flight"] == 4 and w["pool"]["queued"] == 2  # the moment of the request
    assert w["pool"]["saturation"] == pytest.approx(6 / 8)
    total = data["total"]
    assert total["in_flight"] == 4 and total["queued"] == 2 and total["capacity"] == 4
    assert total["saturation"] == pytest.approx(6 / 8) and total["submitted"] == pool["submitted"]
    rows = {m["matcher"]: m for m in data["matchers"]}
    fast = engine.profile_for("command:fast")
    assert rows["command:fast"]["runs"] == fast.runs == 40
    assert rows["command:fast"]["state"] == "demoted" and rows["command:fast"]["exec_class"] == "sync"
    assert rows["command:fast"]["demotions"] == 1 and rows["command:fast"]["plugin"] == "demo"
    assert rows["command:boom"]["errors"] == 1 and rows["command:boom"]["last_error"] == "boom"
    assert rows["command:fast"]["p50"] is not None and rows["command:fast"]["p99"] >= rows["command:fast"]["p50"]
    assert data["series_fields"][0] == "t" and len(w["series"]) >= 1
    assert data["poll_seconds"] <= 2.0


def test_stale_workers_are_marked_then_dropped(settings: Any, publisher_only: None) -> None:
    settings.EXECAPP = {"WORKER_STALE_SECONDS": 10.0, "WORKER_DROP_SECONDS": 60.0}
    now = time.time()
    base = {"pool": {"capacity": 8, "queue_capacity": 8, "in_flight": 8, "queued": 0, "submitted": 5},
            "counts": {"events": 5}, "plugin_pools": [], "events_per_second": 0.0,
            "matchers": [{"matcher": "m", "exec_class": "pool", "state": "learning", "runs": 5}]}
    snapshots.backend().publish({**base, "worker": "fresh", "ts": now}, [now, 8, 1, 0, 8, 0.0, None, None, 5, 0, 0, 0])
    snapshots.backend().publish({**base, "worker": "silent", "ts": now - 20}, None)
    snapshots.backend().publish({**base, "worker": "gone", "ts": now - 100}, None)
    data = dashboard_data.collect(refresh=False)
    state = {w["worker"]: w["stale"] for w in data["workers"]}
    assert state == {"fresh": False, "silent": True}
    assert data["total"]["workers"] == 1 and data["total"]["in_flight"] == 8  # stale ones leave the total
    assert "gone" not in {snap["worker"] for snap, _ in snapshots.backend().load()}  # dropped from the store
    again = dashboard_data.collect(refresh=False)  # collecting twice reads the same snapshots
    assert [m["runs"] for m in again["matchers"]] == [m["runs"] for m in data["matchers"]] == [5]


def test_total_series_sums_workers_on_a_common_grid() -> None:
    a = [[100.2, 4, 1, 0, 4, 10.0, 0.001, 0.002, 1, 0, 0, 0, 0], [101.2, 4, 2, 1, 4, 20.0, 0.001, 0.004, 3, 0, 0, 0, 2]]
    b = [[100.7, 4, 3, 0, 4, 5.0, 0.003, 0.003, 2, 0, 0, 0, 1], [101.7, 4, 4, 2, 4, 5.0, None, None, 2, 0, 0, 0, 1]]
    out = dashboard_data._total_series([{"worker": "a", "series": a}, {"worker": "b", "series": b}], 1.0)
    f = {name: i for i, name in enumerate(snapshots.SERIES_FIELDS)}
    assert [p[f["in_flight"]] for p in out] == [4, 6]
    assert [p[f["capacity"]] for p in out] == [8, 8]
    assert [p[f["events_per_second"]] for p in out] == [15.0, 25.0]
    assert [p[f["delay_p99"]] for p in out] == [0.003, 0.004]  # the worst worker's
    assert [p[f["refused"]] for p in out] == [1, 3]
    # A point of another shape (an older version's, during a rolling deploy) is left out.
    assert snapshots.points([a[0][:12], a[1]]) == [snapshots.HistoryPoint(*a[1])]


@pytest.mark.redis
def test_every_worker_of_the_deployment_through_redis(settings: Any, redis_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    settings.REDIS_URL = redis_url
    settings.EXECAPP = {"POOL_MAX_WORKERS": 3, "POOL_QUEUE_SIZE": 2, "WORKER_STALE_SECONDS": 10.0,
                        "WORKER_DROP_SECONDS": 60.0}
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", ["execapp.snapshots.snapshot_publisher"])
    one, two = worker_module.Worker("w-one"), worker_module.Worker("w-two")
    for w in (one, two):
        w.engine.add(w.engine.make_matcher("command", "fast", _ok, plugin="demo"))
        w.start()
    try:
        for _ in range(3):
            one.engine.process_event(Event(text="/fast")).wait(LIVENESS)
        two.engine.process_event(Event(text="/fast")).wait(LIVENESS)
        data = dashboard_data.collect()
        assert data["backend"] == "redis"
        assert sorted(w["worker"] for w in data["workers"]) == ["w-one", "w-two"]
        assert data["total"]["capacity"] == 6 and data["total"]["events"] == 4
        assert data["matchers"][0]["runs"] == 4 and data["matchers"][0]["workers"] == 2
        two.stop(timeout=5)  # publishes a last snapshot marked stopped
        data = dashboard_data.collect()
        stopped = {w["worker"]: w["stopped"] for w in data["workers"]}
        assert stopped == {"w-one": False, "w-two": True} and data["total"]["workers"] == 1
        # A worker that went silent (crashed): stale after WORKER_STALE_SECONDS, dropped after DROP.
        import redis

        from execapp.conf import redis_key

        r = redis.Redis.from_url(redis_url)
        workers_key = redis_key("execapp:obs:workers")  # under this test's prefix (the redis_url fixture)
        snap = json.loads(r.hget(workers_key, "w-one"))
        snap["ts"] -= 20
        r.hset(workers_key, "w-one", json.dumps(snap))
        one_pub = next(s for s in one.services if isinstance(s, snapshots.SnapshotPublisher))
        one.services.remove(one_pub)  # it stops publishing, as a crashed worker would
        snapshots._publishers.discard(one_pub)
        data = dashboard_data.collect()
        assert [w["stale"] for w in data["workers"] if w["worker"] == "w-one"] == [True]
        snap["ts"] -= 100
        r.hset(workers_key, "w-one", json.dumps(snap))
        data = dashboard_data.collect()
        assert [w["worker"] for w in data["workers"]] == ["w-two"]  # stopped: shown until it is stale
        assert not r.hexists(workers_key, "w-one")
        assert not r.exists(redis_key("execapp:obs:series:w-one"))
    finally:
        one.stop(timeout=5)
        two.stop(timeout=5)


# -- one snapshot, refusals, rates (issue 12) ------------------------------------------------------

def test_cards_charts_and_tables_come_from_one_snapshot(staff_client: Any, process_worker: worker_module.Worker
                                                        ) -> None:
    """The chart's last point is the snapshot the cards and tables show: a header read from the
    chart never disagrees with a card, whatever the load does between two history points."""
    engine = process_worker.engine
    gate = threading.Event()
    engine.add(engine.make_matcher("command", "hold", lambda ctx: gate.wait(LIVENESS) and "ok", plugin="demo"))
    held = [engine.process_event(Event(text="/hold")) for _ in range(7)]  # 4 running + 3 queued
    try:
        data = staff_client.get(DATA).json()
    finally:
        gate.set()
        for h in held:
            assert h.wait(LIVENESS) is not None
    f = {name: i for i, name in enumerate(data["series_fields"])}
    total, last = data["total"], data["total"]["series"][-1]
    assert last[f["t"]] == pytest.approx(data["now"], abs=0.01)
    for key in ("in_flight", "queued", "capacity", "queue_capacity", "submitted", "refused"):
        assert last[f[key]] == total[key], key
    assert last[f["events_per_second"]] == pytest.approx(total["events_per_second"], abs=0.001)
    assert (last[f["delay_p50"]], last[f["delay_p99"]]) == (total["delay_p50"], total["delay_p99"])
    assert (total["in_flight"], total["queued"]) == (4, 3)
    [w] = data["workers"]
    mine = w["series"][-1]
    assert (mine[f["in_flight"]], mine[f["queued"]], mine[f["capacity"]]) == (4, 3, 4)
    assert total["in_flight"] == w["pool"]["in_flight"] and total["queued"] == w["pool"]["queued"]


def test_events_per_second_keeps_a_burst_for_the_rate_window(process_worker: worker_module.Worker,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Bursty load: 60 events at once, then seconds of handlers running and no new events. The rate
    is over RATE_WINDOW_SECONDS, so the seconds after the burst still show it (not 0)."""
    # The publisher's clock from now on, moved by the test (the worker's first point is behind it).
    clock = [time.time()]
    monkeypatch.setattr(snapshots, "time", types.SimpleNamespace(time=lambda: clock[0]))
    engine = process_worker.engine
    engine.add(engine.make_matcher("command", "x", _ok, plugin="demo"))
    publisher = next(s for s in process_worker.services if isinstance(s, snapshots.SnapshotPublisher))
    publisher.publish(advance=True)
    for _ in range(60):
        assert engine.process_event(Event(text="/x")).wait(LIVENESS) is not None
    clock[0] += 0.3
    publisher.publish(advance=True)
    clock[0] += 0.6  # quiet: no event since the burst
    snap = publisher.publish(advance=True)
    window = snapshots.RATE_WINDOW_SECONDS
    assert 60 / window < snap["events_per_second"] <= 60 / 0.9  # the window holds the burst: not 0


@pytest.mark.django_db(transaction=True)
async def test_refusals_are_counted_per_matcher_plugin_and_worker(settings: Any, install_worker: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusals show in every place an operator looks: the matcher's row, the plugin's instance pool,
    the worker's refused count by code, /metrics, and the newest failure in full with its trace."""
    from asgiref.sync import sync_to_async

    from execapp import extensions, history, metrics, metrics_updater
    from execapp.engine.errors import ExecAppError
    from execapp.history_store import reset_local

    from .ws_fixtures import Client

    class Busy(ExecAppError):
        code = "plugin_busy"

    settings.EXECAPP = {"POOL_IDLE_SECONDS": 0.5, "MAX_IN_FLIGHT_PER_CONNECTION": 1}
    settings.REDIS_URL = ""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", ["execapp.history.recorder",
                                                             "execapp.metrics_updater.metrics_updater",
                                                             "execapp.snapshots.snapshot_publisher"])
    previous = extensions.add_stats_provider("plugin_pools", lambda: [{"plugin": "demo", "runtime": "lua",
                                                                       "strategy": "pooled", "capacity": 2}])
    forget_local_snapshots()
    reset_local()
    worker = install_worker(worker_module.Worker("refusing"))
    long_message = "plugin 'demo' is at its max_concurrency of 2 calls; " + "x" * 300

    def busy(ctx: Any) -> None:
        raise Busy(long_message)

    worker.engine.add(worker.engine.make_matcher("command", "busy", busy, name="demo.busy", plugin="demo"))
    worker.engine.add(worker.engine.make_matcher("command", "slow", lambda ctx: time.sleep(0.3) or "ok",
                                                 name="demo.slow", plugin="demo"))
    await sync_to_async(worker.start, thread_sensitive=False)()
    try:
        before = metrics.HANDLER_FAILURES.labels("demo.busy", "demo", "plugin_busy")._value.get()
        async with Client() as c:
            for i in range(3):
                await c.send({"type": "message", "id": f"b{i}", "text": "/busy"})
                await c.until_done(f"b{i}")
            await c.send({"type": "message", "id": "s", "text": "/slow"})
            await c.send({"type": "message", "id": "s2", "text": "/slow"})  # over MAX_IN_FLIGHT: rate_limited
            frames = await c.until_done("s")
        assert any(f.get("code") == "rate_limited" for f in frames)
        rec = history.current()
        await sync_to_async(rec.flush, thread_sensitive=False)()
        data = await sync_to_async(dashboard_data.collect, thread_sensitive=False)(True)
        await sync_to_async(metrics_updater.refresh_local, thread_sensitive=False)()  # what a scrape does first
    finally:
        await sync_to_async(worker.stop, thread_sensitive=False)(5)
        if previous is not None:
            extensions.add_stats_provider("plugin_pools", previous)
        else:
            extensions.remove_stats_provider("plugin_pools")
        forget_local_snapshots()
        reset_local()
    rows = {m["matcher"]: m for m in data["matchers"]}
    assert rows["demo.busy"]["refused"] == 3 and rows["demo.busy"]["failures"] == {"plugin_busy": 3}
    assert rows["demo.busy"]["last_error"] == f"plugin_busy: {long_message}"  # in full, the newest
    assert rows["demo.busy"]["last_failure"]["event_id"] == "b2" and rows["demo.busy"]["last_failure"]["uid"]
    [w] = data["workers"]
    assert w["refused"] == 4 and w["refusals"] == {"plugin_busy": 3, "rate_limited": 1}
    assert data["total"]["refused"] == 4 and data["total"]["refusals"] == {"plugin_busy": 3, "rate_limited": 1}
    [pool] = data["plugin_pools"]
    assert pool["plugin"] == "demo" and pool["refused"] == 3
    after = metrics.HANDLER_FAILURES.labels("demo.busy", "demo", "plugin_busy")._value.get()
    assert after - before == 3  # /metrics: execapp_handler_failures_total{code="plugin_busy"}


@pytest.mark.django_db(transaction=True)
async def test_resend_refusals_and_dropped_session_frames_are_counted_per_worker(
        settings: Any, install_worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusals that come before any matching (a resend that is neither run nor replayed) and the
    session frames a bounded outbox dropped for a member that fell behind show on the worker's row,
    in the total, in /metrics (by worker slot) and, for the resend, as a trace in the history."""
    import asyncio

    from asgiref.sync import sync_to_async

    from execapp import history, metrics, metrics_updater, resend
    from execapp.history_store import reset_local
    from execapp.outbox import Outbox, OutboxLimits, SessionFrameTotals

    from .ws_fixtures import Client

    settings.EXECAPP = {"POOL_IDLE_SECONDS": 0.5}
    settings.REDIS_URL = ""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", ["execapp.history.recorder",
                                                             "execapp.metrics_updater.metrics_updater",
                                                             "execapp.snapshots.snapshot_publisher"])

    def expired(owner: str, event_id: str, worker: str) -> Any:
        raise resend.ResendError("resend_expired", f"event {event_id!r} completed but its record is gone")

    monkeypatch.setattr(resend, "claim", expired)
    forget_local_snapshots()
    reset_local()
    worker = install_worker(worker_module.Worker("refusing-early"))
    await sync_to_async(worker.start, thread_sensitive=False)()
    try:
        updater = next(s for s in worker.services if isinstance(s, metrics_updater.MetricsUpdater))
        dropped_metric = metrics.SESSION_FRAMES_DROPPED.labels(updater.slot)
        refusal_metric = metrics.EVENT_REFUSALS.labels(updater.slot, "resend_expired")
        before = (dropped_metric._value.get(), refusal_metric._value.get(), SessionFrameTotals.dropped,
                  SessionFrameTotals.lagged)
        async with Client() as c:
            await c.send({"type": "message", "id": "again", "text": "/x", "resend": True})
            frame = await c.recv()
        assert (frame["type"], frame["code"], frame["id"]) == ("error", "resend_expired", "again")
        # A member that does not read: past 2 queued frames its session frames are dropped.
        gate = asyncio.Event()
        written: list[Any] = []

        async def write(item: Any) -> None:
            await gate.wait()
            written.append(item)

        box = Outbox(write, "test-member", limits=OutboxLimits(2, 0), lagged=lambda missed: (("lagged", missed), 0))
        queued = [box.offer(f"f{i}", "room", 1) for i in range(5)]
        gate.set()
        await wait_for_async(lambda: len(written) == 3)
        box.close()
        assert queued == [True, True, False, False, False] and written[-1] == ("lagged", {"room": 3})
        await sync_to_async(history.current().flush, thread_sensitive=False)()  # type: ignore[union-attr]
        data = await sync_to_async(dashboard_data.collect, thread_sensitive=False)(True)
        await sync_to_async(metrics_updater.refresh_local, thread_sensitive=False)()  # what a scrape does first
        trace = await sync_to_async(history.get, thread_sensitive=False)("token:test", "again")
    finally:
        await sync_to_async(worker.stop, thread_sensitive=False)(5)
        forget_local_snapshots()
        reset_local()
    [w] = data["workers"]
    assert w["refusals"] == {"resend_expired": 1} and w["refused"] == 1
    assert data["total"]["refusals"] == {"resend_expired": 1} and data["total"]["refused"] == 1
    assert (SessionFrameTotals.dropped - before[2], SessionFrameTotals.lagged - before[3]) == (3, 1)
    assert w["session_frames"]["dropped"] - before[2] == 3
    assert data["total"]["session_frames_dropped"] == w["session_frames"]["dropped"]
    assert dropped_metric._value.get() - before[0] == 3  # execapp_session_frames_dropped_total{worker}
    assert refusal_metric._value.get() - before[1] == 1  # execapp_event_refusals_total{worker,code}
    assert trace is not None and trace["outcome"] == "resend_expired" and "record is gone" in trace["message"]


async def wait_for_async(predicate: Any, timeout: float = LIVENESS) -> None:
    """Poll ``predicate()`` on the loop until it is true (a guard, never a timing assertion)."""
    from tests.conftest import wait_until_async

    assert await wait_until_async(predicate, timeout, interval=0.005), "condition not reached in time"


def test_the_data_answers_with_what_it_has_while_redis_is_down(staff_client: Any, settings: Any,
                                                               process_worker: worker_module.Worker) -> None:
    """Redis unreachable (a restart): the data endpoint still answers 200 with this process's own
    workers, built now, and says what is missing; the page shows it instead of looking live."""
    engine = process_worker.engine
    engine.add(engine.make_matcher("command", "x", _ok, plugin="demo"))
    assert engine.process_event(Event(text="/x")).wait(LIVENESS) is not None
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1: connection refused
    response = staff_client.get(DATA)
    assert response.status_code == 200
    data = response.json()
    assert data["backend"] == "redis" and "cannot be read" in data["warning"], data["warning"]
    [w] = data["workers"]
    assert w["worker"] == process_worker.id and w["counts"]["events"] == 1 and not w["stale"]
    assert data["total"]["events"] == 1 and [m["plugin"] for m in data["matchers"]] == ["demo"]
    settings.REDIS_URL = ""
    assert staff_client.get(DATA).json()["warning"] == ""
    from django.contrib.staticfiles import finders

    page = staff_client.get(PAGE).content.decode()
    assert 'src="/static/execapp/dashboard.js"' in page  # the page's script (a file: the CSP runs no inline one)
    script = open(finders.find("execapp/dashboard.js"), encoding="utf-8").read()
    assert "d.warning ?" in script  # the page's status line shows the warning


def test_a_matcher_pinned_to_the_pool_on_any_worker_shows_why() -> None:
    def row(**extra: Any) -> dict[str, Any]:
        return {"matcher": "big.h", "plugin": "big", "kind": "command", "pattern": "big", "exec_class": "pool",
                "state": "promoted", **extra}

    merged = dashboard_data._aggregate_matchers([{"matchers": [row(pool_only=None)]},
                                                 {"matchers": [row(pool_only="memory cap over 16 MiB")]}])
    assert merged[0]["pool_only"] == "memory cap over 16 MiB" and merged[0]["quarantined"] is None


def test_a_worker_whose_clock_was_stepped_costs_the_total_series_its_points_only() -> None:
    """A worker booted with its clock at 1970 then set by NTP holds points decades apart: the total
    series walks the slots its points are live in, not every second between them (before: about
    1.7 billion empty slots, a request thread spinning for hours on every poll)."""
    now = time.time()
    row = [4, 1, 0, 4, 10.0, 0.001, 0.002, 1, 0, 0, 0, 0]
    stepped = [[5.0, *row], [6.0, *row], [now - 1, *row], [now, *row]]
    steady = [[now - 0.5, *row]]
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(dashboard_data._total_series(
        [{"worker": "stepped", "series": stepped}, {"worker": "steady", "series": steady}], 1.0)), daemon=True)
    thread.start()
    thread.join(30)  # generous: the points alone take microseconds
    assert done, "the total series walked the empty grid between 1970 and now"
    f = {name: i for i, name in enumerate(snapshots.SERIES_FIELDS)}
    out = done[0]
    assert len(out) <= 3 * 5  # at most three slots per point
    assert [p[f["in_flight"]] for p in out if p[f["t"]] < 100] == [1, 1, 1]  # 1970: alone, live 2.5 periods
    assert out[-1][f["in_flight"]] == 2  # now: both workers


def _leak(ctx: Any) -> None:
    raise RuntimeError("card 4111-1111 of tenant acme")


def test_failure_messages_need_the_events_permission(client: Any, staff_client: Any,
                                                     process_worker: worker_module.Worker) -> None:
    """A handler's error is a plugin's text about a tenant's event: staff who may not open Events
    (403 there) see its code on the dashboard, not the text; with the permission, the text."""
    engine = process_worker.engine
    engine.add(engine.make_matcher("command", "leak", _leak, plugin="demo"))
    assert engine.process_event(Event(text="/leak")).wait(LIVENESS) is not None
    assert staff_client.get("/admin/execapp/eventtrace/").status_code == 403
    hidden = staff_client.get(DATA)
    assert b"4111" not in hidden.content
    row = {m["matcher"]: m for m in hidden.json()["matchers"]}["command:leak"]
    assert row["errors"] == 1 and row["last_error"] == f"error ({dashboard.HIDDEN_NOTE})"
    reader = User.objects.create_user("reader", password="pw", is_staff=True)
    reader.user_permissions.add(Permission.objects.get(codename="view_eventtrace", content_type__app_label="execapp"))
    client.force_login(reader)
    shown = {m["matcher"]: m for m in client.get(DATA).json()["matchers"]}["command:leak"]
    assert shown["last_error"] == "card 4111-1111 of tenant acme"


def test_a_recorded_failure_keeps_only_its_code_time_and_plugin() -> None:
    last = {"ts": 5.0, "code": "handler_error", "message": "lua error: secret", "event_id": "client-id-7",
            "uid": "w1-3", "plugin": "oops"}
    data = {"matchers": [{"matcher": "oops.oops", "last_error": "handler_error: lua error: secret",
                          "last_failure": dict(last)}, {"matcher": "fine", "last_error": "", "last_failure": None}]}
    out = dashboard.without_event_contents(data)
    assert "secret" not in json.dumps(out) and "client-id-7" not in json.dumps(out) and "w1-3" not in json.dumps(out)
    assert out["matchers"][0]["last_failure"] == {"ts": 5.0, "code": "handler_error", "plugin": "oops"}
    assert out["matchers"][0]["last_error"].startswith("handler_error (")
    assert out["matchers"][1]["last_error"] == "" and out["matchers"][1]["last_failure"] is None


@pytest.mark.django_db
def test_the_dashboard_serves_its_page_and_data_only(staff_client: Any) -> None:
    """Dashboard proxies ExecProfileRecord: the views ModelAdmin adds for a row (change, history,
    delete) showed any staff member a persisted profile, its last error (a tenant's text) with it."""
    from execapp.models import ExecProfileRecord

    record = ExecProfileRecord.objects.create(matcher="command:pay", plugin="p", last_error="card 4111 of acme")
    for suffix in (f"{record.pk}/change/", f"{record.pk}/history/", f"{record.pk}/delete/", f"{record.pk}/", "add/"):
        response = staff_client.get(PAGE + suffix)
        assert response.status_code == 404 and b"4111" not in response.content, (suffix, response.status_code)
    assert staff_client.get(PAGE).status_code == 200
    assert staff_client.get(DATA).status_code == 200


@pytest.mark.redis
def test_a_dead_worker_s_entry_expires_without_anyone_reading_the_dashboard(settings: Any, redis_url: str) -> None:
    """A worker that died (SIGKILL, OOM) publishes nothing again; its entry in obs:workers and its
    chart went only when someone opened the dashboard. Now every live worker's publish forgets
    workers silent for WORKER_DROP_SECONDS, and the keys expire when no worker is left."""


    settings.REDIS_URL = redis_url
    settings.EXECAPP = {"WORKER_DROP_SECONDS": 60.0}
    backend = snapshots.RedisBackend(redis_url)
    r = backend.client
    workers_key, seen_key = backend.workers_key, backend.seen_key
    now = time.time()
    # An older version's entry (no score) is adopted at a publish, then expires like the others.
    r.hset(workers_key, "w-legacy", json.dumps({"worker": "w-legacy", "ts": now - 500}))
    # A worker that published its last snapshot 61 s ago, then died.
    r.hset(workers_key, "w-dead", json.dumps({"worker": "w-dead", "ts": now - 61}))
    r.zadd(seen_key, {"w-dead": now - 61})
    r.rpush(backend._series_key("w-dead"), "[]")
    backend.publish({"worker": "w-live", "ts": now}, None)
    assert not r.hexists(workers_key, "w-dead"), "a worker silent for WORKER_DROP_SECONDS is forgotten"
    assert not r.exists(backend._series_key("w-dead")) and r.zscore(seen_key, "w-dead") is None
    assert r.hexists(workers_key, "w-live") and r.hexists(workers_key, "w-legacy")
    backend.publish({"worker": "w-live", "ts": now + 61}, None)
    assert not r.hexists(workers_key, "w-legacy") and r.hexists(workers_key, "w-live")
    assert 0 < r.ttl(workers_key) <= 120 and 0 < r.ttl(seen_key) <= 120


@pytest.mark.django_db
def test_a_tab_stuck_in_a_loop_is_told_to_wait_and_others_are_still_served(staff_client: Any, client: Any,
                                                                             settings: Any,
                                                                             publisher_only: None) -> None:
    """Each data request costs the worker ~9 ms of CPU beside its event loop; a tab asking in a
    tight loop got every answer, as fast as the worker could make them. Now one user gets a burst
    of twice DASHBOARD_REQUESTS_PER_SECOND, then 429 with Retry-After; another user is served."""
    from execapp import dashboard_limit

    settings.EXECAPP = {**settings.EXECAPP, "DASHBOARD_REQUESTS_PER_SECOND": 2.0}
    dashboard_limit.user_rate = dashboard_limit.UserRate(clock=lambda: 1000.0)  # time stands still
    statuses = [staff_client.get(DATA).status_code for _ in range(10)]
    assert statuses == [200] * 4 + [429] * 6, statuses
    refused = staff_client.get(DATA)
    assert refused["Retry-After"] == "1" and "DASHBOARD_REQUESTS_PER_SECOND" in refused.json()["error"]
    other = User.objects.create_user("operator2", password="pw", is_staff=True)
    client.force_login(other)
    assert client.get(DATA).status_code == 200
    dashboard_limit.user_rate = dashboard_limit.UserRate()


@pytest.mark.django_db
def test_data_requests_past_the_per_worker_cap_are_refused_at_once(staff_client: Any, settings: Any,
                                                                   publisher_only: None) -> None:
    from execapp import dashboard_limit

    settings.EXECAPP = {**settings.EXECAPP, "DASHBOARD_MAX_REQUESTS": 2}
    dashboard_limit.user_rate = dashboard_limit.UserRate()
    for _ in range(2):  # two requests running on other threads
        assert dashboard_limit.running.acquire(2)
    try:
        busy = staff_client.get(DATA)
        assert busy.status_code == 503 and busy["Retry-After"] == "1"
        assert "DASHBOARD_MAX_REQUESTS" in busy.json()["error"]
    finally:
        dashboard_limit.running.release()
        dashboard_limit.running.release()
    assert staff_client.get(DATA).status_code == 200
    assert dashboard_limit.running.now == 0  # every request gives its place back
