"""One source for each list and each default, and the seams between the modules (issue 11): the
settings documented with their defaults, event outcomes derived from the error codes, the worker's
services with the registered ones in place, a dashboard read that starts nothing, handshake
refusals counted, benchmark routes only in bench/."""
from __future__ import annotations

import inspect
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from prometheus_client import REGISTRY

from execapp import conf, extensions, metrics, snapshots
from execapp import worker as worker_module
from execapp.codes import AUTH_THROTTLED, ERROR_CODES, EVENT_OUTCOMES, TOO_MANY_CONNECTIONS, UNAUTHORIZED
from execapp.engine import Engine, ExecPool, ExecProfile
from execapp.engine.engine import COUNTERS, OVERFLOW_POLICIES
from execapp.routing import websocket_application
from tests.conftest import ROOT

from .ws_fixtures import channel_layer, ws_worker  # noqa: F401


def _events_total(outcome: str) -> float:
    return REGISTRY.get_sample_value("execapp_events_total", {"outcome": outcome}) or 0.0


# -- one source for each default and each list ----------------------------------------------------

def test_every_setting_is_documented_with_its_default() -> None:
    doc = (ROOT / "docs" / "operations.md").read_text()
    table = doc[doc.index("## Settings"):]
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| `([^`]*)` \|", table, re.M))
    assert rows == {name: repr(value) for name, value in conf.DEFAULTS.items()}


def test_the_engine_and_the_settings_share_their_defaults() -> None:
    engine = Engine(pool_enabled=False)
    pool, profile = inspect.signature(ExecPool).parameters, ExecProfile()
    assert engine.overflow_wait == conf.DEFAULTS["OVERFLOW_WAIT_SECONDS"]
    assert engine.overflow == conf.DEFAULTS["OVERFLOW_POLICY"] == OVERFLOW_POLICIES[0]
    assert engine.inline_timeout == conf.DEFAULTS["INLINE_TIMEOUT_SECONDS"]
    assert (pool["max_workers"].default, pool["queue_size"].default, pool["idle_seconds"].default) == (
        conf.DEFAULTS["POOL_MAX_WORKERS"], conf.DEFAULTS["POOL_QUEUE_SIZE"], conf.DEFAULTS["POOL_IDLE_SECONDS"])
    assert (profile.window, profile.slow_threshold) == (conf.DEFAULTS["PROFILE_WINDOW"],
                                                        conf.DEFAULTS["SLOW_THRESHOLD_SECONDS"])


def test_every_overflow_policy_of_the_engine_passes_the_checks(settings: Any) -> None:
    from execapp.checks import check_execapp_settings

    for policy in OVERFLOW_POLICIES:
        settings.EXECAPP = {"OVERFLOW_POLICY": policy}
        assert not [e for e in check_execapp_settings() if e.id == "execapp.E005"], policy
    settings.EXECAPP = {"OVERFLOW_POLICY": "drop"}
    assert [e.id for e in check_execapp_settings() if e.id == "execapp.E005"] == ["execapp.E005"]


def test_every_error_code_is_counted_under_its_own_name() -> None:
    assert {"ok", "error", UNAUTHORIZED, TOO_MANY_CONNECTIONS, AUTH_THROTTLED} | set(ERROR_CODES) == EVENT_OUTCOMES
    other = _events_total("other")
    for code in ERROR_CODES:
        before = _events_total(code)
        metrics.count_event(code)
        assert _events_total(code) == before + 1, code
    assert _events_total("other") == other


def test_the_dashboard_counts_and_history_use_the_engine_s_names() -> None:
    point = snapshots.HistoryPoint(1.0, 4, 1, 0, 4, 2.0, None, 0.01, 3, 0, 0, 0, 0)
    assert snapshots.as_point(list(point)) == point and point.in_flight == 1
    assert snapshots.as_point([1.0, 2.0]) is None  # another shape (an older version's): skipped
    worker = worker_module.Worker("names")
    try:
        publisher = snapshots.SnapshotPublisher(worker, store=snapshots.LocalBackend(), interval=60)
        snap, history = publisher.snapshot(advance=True)
        assert tuple(snap["counts"]) == COUNTERS and isinstance(history, snapshots.HistoryPoint)
    finally:
        worker.stop(timeout=5)


# -- the worker's services: execapp's own, the registered ones, the watchdog ------------------------

def test_registered_services_run_between_execapp_s_own_and_the_watchdog() -> None:
    started: list[str] = []

    class Probe:
        interval = 60.0

        def __init__(self, name: str) -> None:
            started.append(name)

        def tick(self) -> None:
            pass

        def close(self) -> None:
            pass

    before = extensions.services()
    extensions.add_service("test.probe", lambda worker: Probe("probe"))
    extensions.add_service("test.removed", lambda worker: Probe("removed"))
    extensions.remove_service("test.removed")
    extensions.remove_service("test.later")  # removed before it is registered: stays out
    extensions.add_service("test.later", lambda worker: Probe("later"))
    try:
        names = [name for name, _ in worker_module.service_factories()]
        assert names.index("execapp.snapshots.snapshot_publisher") < names.index("test.probe")
        assert names.index("test.probe") < names.index("execapp.watchdog_service.watchdog_service")
        assert "test.removed" not in names and "test.later" not in names
    finally:
        extensions.remove_service("test.probe")
    assert [s.name for s in extensions.services()] == [s.name for s in before]


# -- the dashboard reads, it starts nothing -------------------------------------------------------

@pytest.mark.django_db
def test_a_dashboard_read_starts_no_worker(client: Any, settings: Any) -> None:
    settings.REDIS_URL = ""
    previous = worker_module.set_worker(None)
    try:
        threads = {t.name for t in threading.enumerate()}
        client.force_login(User.objects.create_user("looker", password="pw", is_staff=True))
        response = client.get("/admin/execapp/dashboard/data/")
        assert response.status_code == 200 and "workers" in response.json()
        assert worker_module.current_worker() is None
        assert "execapp-housekeeper" not in {t.name for t in threading.enumerate()} - threads
    finally:
        worker_module.set_worker(previous)


# -- a refused handshake is an "unauthorized" outcome ----------------------------------------------

@pytest.mark.usefixtures("ws_worker")
@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_refused_handshakes_are_counted_as_unauthorized(transactional_db: Any, channel_layer: str) -> None:
    from execapp.models import ApiToken

    async def handshake(headers: list, path: str = "/ws/events/") -> bool:
        comm = WebsocketCommunicator(websocket_application, path, headers=headers)
        connected, _ = await comm.connect(timeout=5)
        if connected:
            await comm.disconnect()
        return connected

    before = _events_total(UNAUTHORIZED)
    assert not await handshake([])  # no credentials
    assert not await handshake([(b"authorization", b"Bearer not-a-token")])
    assert _events_total(UNAUTHORIZED) == before + 2
    raw = (await sync_to_async(ApiToken.issue)("structure-token"))[1]
    assert not await handshake([(b"authorization", f"Bearer {raw}".encode())], "/ws/nowhere/")  # not auth
    assert await handshake([(b"authorization", f"Bearer {raw}".encode())])
    assert _events_total(UNAUTHORIZED) == before + 2


# -- benchmark routes live in bench/ only ----------------------------------------------------------

def test_production_code_has_no_benchmark_routes() -> None:
    for path in Path(ROOT, "execapp").rglob("*.py"):
        text = path.read_text()
        assert "ws/bench" not in text and "EXECAPP_BENCH_BASELINE" not in text, path


@pytest.mark.usefixtures("ws_worker")
@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_the_bench_app_serves_the_baselines_and_the_project(transactional_db: Any, channel_layer: str) -> None:
    import json

    from bench.bench_app import application
    from execapp.models import ApiToken

    raw = (await sync_to_async(ApiToken.issue)("bench-token"))[1]
    headers = [(b"authorization", f"Bearer {raw}".encode())]
    for path, text in (("/ws/bench/bare/", "pong"), ("/ws/bench/direct/", "pong"), ("/ws/events/", "pong")):
        comm = WebsocketCommunicator(application, path, headers=headers)
        connected, _ = await comm.connect(timeout=5)
        assert connected, path
        await comm.send_to(text_data=json.dumps({"id": "b1", "type": "message", "text": "/ping"}))
        reply = json.loads(await comm.receive_from(5))
        assert (reply["type"], reply["text"]) == ("reply", text), (path, reply)
        await comm.disconnect()
    comm = WebsocketCommunicator(application, "/ws/bench/bare/", headers=[])
    assert not (await comm.connect(timeout=5))[0]  # behind the same authentication
