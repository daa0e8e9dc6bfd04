"""The staff-only dashboard: access, its data against the engine's own stats, stale/dropped workers,
and every worker of a deployment through Redis."""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterator

import pytest
from django.contrib.auth.models import User

from execapp import snapshots
from execapp import worker as worker_module
from execapp.engine import Event

LIVENESS = 10.0
PAGE = "/admin/execapp/dashboard/"
DATA = "/admin/execapp/dashboard/data/"


@pytest.fixture
def publisher_only(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.EXECAPP = {"POOL_MAX_WORKERS": 4, "POOL_QUEUE_SIZE": 4, "POOL_IDLE_SECONDS": 0.5}
    settings.REDIS_URL = ""
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", ["execapp.snapshots.snapshot_publisher"])
    snapshots._local._workers.clear()


@pytest.fixture
def process_worker(publisher_only: None) -> Iterator[worker_module.Worker]:
    """A fresh Worker installed as this process's worker (what the data view reports on)."""
    worker = worker_module.Worker("dash-test")
    worker.start()
    previous, worker_module._worker = worker_module._worker, worker
    yield worker
    worker_module._worker = previous
    worker.stop(timeout=5)
    snapshots._local._workers.clear()


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


def _ok(ctx: Any) -> str:
    return "ok"


def _boom(ctx: Any) -> None:
    raise RuntimeError("boom")


def test_dashboard_data_matches_engine_stats(staff_client: Any, process_worker: worker_module.Worker) -> None:
    engine = process_worker.engine
    gate = threading.Event()
    engine.add(engine.make_matcher("command", "fast", _ok, plugin="demo"))
    engine.add(engine.make_matcher("command", "boom", _boom, plugin="demo"))
    engine.add(engine.make_matcher("command", "hold", lambda ctx: gate.wait(LIVENESS) and "ok", plugin="demo"))
    for _ in range(40):
        assert engine.process_event(Event(text="/fast")).wait(LIVENESS) is not None
    assert engine.process_event(Event(text="/boom")).wait(LIVENESS) is not None
    held = [engine.process_event(Event(text="/hold")) for _ in range(6)]  # 4 running + 2 queued

    data = staff_client.get(DATA).json()
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
    snapshots._local.publish({**base, "worker": "fresh", "ts": now}, [now, 8, 1, 0, 8, 0.0, None, None, 5, 0, 0, 0])
    snapshots._local.publish({**base, "worker": "silent", "ts": now - 20}, None)
    snapshots._local.publish({**base, "worker": "gone", "ts": now - 100}, None)
    data = snapshots.collect(refresh=False)
    state = {w["worker"]: w["stale"] for w in data["workers"]}
    assert state == {"fresh": False, "silent": True}
    assert data["total"]["workers"] == 1 and data["total"]["in_flight"] == 8  # stale ones leave the total
    assert "gone" not in {snap["worker"] for snap, _ in snapshots._local.load()}  # dropped from the store
    again = snapshots.collect(refresh=False)  # collecting twice reads the same snapshots
    assert [m["runs"] for m in again["matchers"]] == [m["runs"] for m in data["matchers"]] == [5]


def test_total_series_sums_workers_on_a_common_grid() -> None:
    a = [[100.2, 4, 1, 0, 4, 10.0, 0.001, 0.002, 1, 0, 0, 0], [101.2, 4, 2, 1, 4, 20.0, 0.001, 0.004, 3, 0, 0, 0]]
    b = [[100.7, 4, 3, 0, 4, 5.0, 0.003, 0.003, 2, 0, 0, 0], [101.7, 4, 4, 2, 4, 5.0, None, None, 2, 0, 0, 0]]
    out = snapshots._total_series([{"worker": "a", "series": a}, {"worker": "b", "series": b}], 1.0)
    f = {name: i for i, name in enumerate(snapshots.SERIES_FIELDS)}
    assert [p[f["in_flight"]] for p in out] == [4, 6]
    assert [p[f["capacity"]] for p in out] == [8, 8]
    assert [p[f["events_per_second"]] for p in out] == [15.0, 25.0]
    assert [p[f["delay_p99"]] for p in out] == [0.003, 0.004]  # the worst worker's


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
        data = snapshots.collect()
        assert data["backend"] == "redis"
        assert sorted(w["worker"] for w in data["workers"]) == ["w-one", "w-two"]
        assert data["total"]["capacity"] == 6 and data["total"]["events"] == 4
        assert data["matchers"][0]["runs"] == 4 and data["matchers"][0]["workers"] == 2
        two.stop(timeout=5)  # publishes a last snapshot marked stopped
        data = snapshots.collect()
        stopped = {w["worker"]: w["stopped"] for w in data["workers"]}
        assert stopped == {"w-one": False, "w-two": True} and data["total"]["workers"] == 1
        # A worker that went silent (crashed): stale after WORKER_STALE_SECONDS, dropped after DROP.
        import redis

        r = redis.Redis.from_url(redis_url)
        snap = json.loads(r.hget("asgi:execapp:obs:workers", "w-one"))
        snap["ts"] -= 20
        r.hset("asgi:execapp:obs:workers", "w-one", json.dumps(snap))
        one_pub = next(s for s in one.services if isinstance(s, snapshots.SnapshotPublisher))
        one.services.remove(one_pub)  # it stops publishing, as a crashed worker would
        snapshots._publishers.discard(one_pub)
        data = snapshots.collect()
        assert [w["stale"] for w in data["workers"] if w["worker"] == "w-one"] == [True]
        snap["ts"] -= 100
        r.hset("asgi:execapp:obs:workers", "w-one", json.dumps(snap))
        data = snapshots.collect()
        assert [w["worker"] for w in data["workers"]] == ["w-two"]  # stopped: shown until it is stale
        assert not r.hexists("asgi:execapp:obs:workers", "w-one")
        assert not r.exists("asgi:execapp:obs:series:w-one")
    finally:
        one.stop(timeout=5)
        two.stop(timeout=5)
