"""The drain of one worker (execapp.drain) and the control protocol (execapp.control) in-process:
real Workers, engines and pools, the in-memory channel layer and real Redis (layer + registry)."""
from __future__ import annotations

import asyncio
import threading
import time
import types
from pathlib import Path
from typing import Any, Iterator

import pytest
from channels.layers import InMemoryChannelLayer
from django.core.management import call_command
from django.core.management.base import CommandError

from execapp import control_client as control
from execapp import watchdog
from execapp.control import UnknownWorker
from execapp.control_listener import ControlListener
from execapp.control_registry import LocalRegistry, RedisRegistry
from execapp.control_thread import ControlThread
from execapp.drain import drain_worker, undrain_worker
from execapp.engine import Completion
from execapp.engine.engine import running_handlers
from execapp.management.commands._control import drain_line, missing_lines, status_lines
from execapp.status import worker_status
from execapp.worker import Worker
from tests.conftest import redis_test_prefix, wait_until_async

WAIT = 10.0


class Gate:
    """A handler that blocks until opened: a straggler whose end the test decides."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()

    def __call__(self, ctx: Any) -> str:
        self.entered.set()
        assert self.opened.wait(WAIT), "gate never opened"
        return "through"


@pytest.fixture
def worker(settings: Any) -> Iterator[Worker]:
    settings.EXECAPP = {"POOL_IDLE_SECONDS": 0.2}
    w = Worker("unit-worker")
    yield w
    w.pool.resume()
    w.pool.drain(WAIT)


def admit(worker: Worker, text: str) -> bool:
    """What the consumer does for one frame: admit, dispatch, and end the event at its done."""
    if not worker.begin_event():
        return False

    def on_outcome(outcome: Any) -> None:
        if isinstance(outcome, Completion):
            worker.end_event()

    worker.engine.process_event({"text": text}, on_outcome)
    return True


def drain_in_thread(worker: Worker, timeout: float) -> tuple[threading.Thread, dict]:
    report: dict = {}
    t = threading.Thread(target=lambda: report.update(drain_worker(worker, timeout)))
    t.start()
    return t, report


# -- execapp.drain ---------------------------------------------------------------------------------

def test_drain_waits_for_running_and_queued_handlers_then_refuses_and_resumes(settings: Any) -> None:
    settings.EXECAPP = {"POOL_MAX_WORKERS": 1, "POOL_QUEUE_SIZE": 4, "POOL_IDLE_SECONDS": 0.2}
    w = Worker("small-pool")
    gate = Gate()
    w.engine.on_command("hold", gate)
    assert admit(w, "/hold") and admit(w, "/hold") and admit(w, "/hold")  # 1 running, 2 queued
    assert gate.entered.wait(WAIT)
    assert w.pool.stats()["queued"] == 2
    thread, report = drain_in_thread(w, WAIT)
    while not w.draining:
        threading.Event().wait(0.001)
    assert not admit(w, "/hold"), "a draining worker must refuse new events"
    assert thread.is_alive(), "the drain returned while handlers were still running"
    gate.opened.set()
    thread.join(WAIT)
    assert report["ok"] is True, report
    assert report["finished"] == {"events": 3, "tasks": 3}
    assert report["still_running"] == [] and report["events_in_flight"] == 0
    assert w.pool.closed
    assert undrain_worker(w) == {"worker": "small-pool", "ok": True, "was_draining": True}
    assert not w.pool.closed and not w.draining
    assert admit(w, "/hold")  # the gate is open: it runs through
    w.pool.drain(WAIT)


def test_drain_timeout_names_the_straggler_and_leaves_its_event_to_finish(worker: Worker) -> None:
    gate = Gate()
    worker.engine.on_command("slow", gate)
    worker.engine.on_command("ping", lambda ctx: "pong")
    assert admit(worker, "/slow") and admit(worker, "/ping")
    assert gate.entered.wait(WAIT)
    report = drain_worker(worker, 0.2)
    assert report["ok"] is False and report["reason"] == "timeout"
    assert report["still_running"] == ["command:slow"]
    assert report["events_in_flight"] == 1
    assert not worker.pool.closed, "a timed-out drain must leave the pool open for the stragglers"
    line = drain_line(report)
    assert "NOT drained (timeout)" in line and "still running: command:slow" in line
    gate.opened.set()
    # The straggler's event still completes; a second drain then finishes.
    assert drain_worker(worker, WAIT)["ok"] is True
    assert worker.events_in_flight == 0


def test_running_handlers_sees_inline_handlers_too(worker: Worker) -> None:
    gate = Gate()
    worker.engine.on_command("inline", gate)
    t = threading.Thread(target=lambda: worker.engine.process_event_sync({"text": "/inline"}))
    t.start()
    assert gate.entered.wait(WAIT)
    assert running_handlers() == ["command:inline"]
    gate.opened.set()
    t.join(WAIT)
    assert running_handlers() == []


def test_drain_flushes_services_and_reports_a_failed_flush(worker: Worker) -> None:
    calls: list[str] = []

    class Flushing:
        interval = 60.0

        def tick(self) -> None:
            calls.append("tick")

        def flush(self) -> None:
            calls.append("flush")

        def close(self) -> None:
            pass

    class TickOnly(Flushing):
        flush = None  # type: ignore[assignment]

    class Broken(Flushing):
        def flush(self) -> None:
            raise RuntimeError("database is down")

    worker.services[:] = [Flushing(), TickOnly(), Broken()]
    report = drain_worker(worker, WAIT)
    assert calls == ["flush"], "only flush() is called: ticks stay the housekeeper's"
    assert report["ok"] is True
    assert report["flush_errors"] == ["Broken: database is down"]
    assert "profile flush failed: Broken: database is down" in drain_line(report)


def test_begin_event_and_draining_are_atomic(worker: Worker) -> None:
    # Many admitting threads race a drain: every admitted event is counted before the drain
    # can see zero, so after an ok drain nothing is in flight and nothing is admitted.
    stop = threading.Event()
    admitted = [0]
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            if worker.begin_event():
                with lock:
                    admitted[0] += 1
                worker.end_event()

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    report = drain_worker(worker, WAIT)
    finished_at_drain = worker.events_finished
    stop.set()
    for t in threads:
        t.join(WAIT)
    assert report["ok"] and worker.events_in_flight == 0
    assert worker.events_finished == finished_at_drain == admitted[0]


def test_status_is_json_safe_and_printable(worker: Worker) -> None:
    worker.engine.on_command("ping", lambda ctx: "pong")
    worker.engine.process_event_sync({"text": "/ping"})
    status = worker_status(worker)
    assert status["worker"] == "unit-worker" and status["draining"] is False
    assert status["events"] == 1 and status["pool"]["capacity"] == worker.pool.max_workers
    text = "\n".join(status_lines(status))
    assert "worker unit-worker" in text and "pool: running 0/" in text and "engine: events 1" in text
    assert "  serving  " in text
    # A shutting-down worker is told apart from one an operator drained (undrain resumes only that one).
    assert "  DRAINING  " in status_lines({**status, "draining": True})[0]
    worker.begin_stop()
    assert "  STOPPING  " in status_lines(worker_status(worker))[0]
    assert "loop_silent_seconds" not in status, "no supervisor: nothing to say"


def test_status_says_when_the_loop_or_the_housekeeper_is_held(worker: Worker, tmp_path: Path) -> None:
    """The control listener answers on its own thread: a worker whose loop was blocked 7 s in an
    inline handler answered `execstatus` (exit 0) looking like any other, `events in flight 1`."""
    slots = watchdog.SlotFile.create(tmp_path / watchdog.SLOTS_FILE, 2)
    worker.watch = types.SimpleNamespace(slot=slots.slot(1))
    now = time.monotonic()
    worker.watch.slot.beat(now)
    worker.watch.slot.beat_house(now)
    text = "\n".join(status_lines(worker_status(worker)))
    assert "STALLED" not in text and "STUCK" not in text, text
    worker.watch.slot.beat(now - 7.0)
    worker.watch.slot.beat_house(now - 40.0)
    worker.watch.slot.mark_buffer()[:12] = b"command:stal"
    status = worker_status(worker)
    assert status["loop_silent_seconds"] >= 7.0 and status["running_inline"] == "command:stal"
    text = "\n".join(status_lines(status))
    assert "EVENT LOOP STALLED: no heartbeat for 7.0 s, running command:stal inline" in text, text
    assert "HOUSEKEEPER STUCK: silent for 40.0 s" in text, text


# -- execapp.control over a channel layer -----------------------------------------------------------

async def start_listeners(workers: list[Worker], layer: Any, registry: Any) -> list[asyncio.Task]:
    tasks = []
    for w in workers:
        listener = ControlListener(w, layer, registry)
        tasks.append(asyncio.create_task(listener.serve()))
        assert await wait_until_async(listener.ready.is_set), "a control listener never became ready"
    return tasks


async def stop_listeners(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_status_drain_undrain_reach_every_worker_over_the_in_memory_layer(settings: Any) -> None:
    settings.EXECAPP = {"POOL_IDLE_SECONDS": 0.2}
    layer, registry = InMemoryChannelLayer(), LocalRegistry()
    workers = [Worker("w1"), Worker("w2")]
    tasks = await start_listeners(workers, layer, registry)
    try:
        status = await control.request("status", layer=layer, registry=registry)
        assert sorted(status.answers) == ["w1", "w2"] and status.missing == []
        assert status.answers["w1"]["pool"]["capacity"] == workers[0].pool.max_workers

        drained = await control.request("drain", layer=layer, registry=registry, timeout=5)
        assert sorted(drained.answers) == ["w1", "w2"]
        assert all(a["ok"] for a in drained.answers.values())
        assert all(w.draining and w.pool.closed for w in workers)

        undrained = await control.request("undrain", layer=layer, registry=registry, worker="w2")
        assert list(undrained.answers) == ["w2"]
        assert not workers[1].draining and workers[0].draining

        with pytest.raises(UnknownWorker, match="no live worker 'w9'.*w1, w2"):
            await control.request("status", layer=layer, registry=registry, worker="w9")
    finally:
        await stop_listeners(tasks)
    assert registry.live() == {}, "a stopped listener leaves the registry"


async def test_a_registered_worker_that_stays_silent_is_named(settings: Any) -> None:
    layer, registry = InMemoryChannelLayer(), LocalRegistry()
    tasks = await start_listeners([Worker("alive")], layer, registry)
    registry.beat("hung", {"pid": 0})  # registered, but nothing listens for it
    try:
        result = await control.request("drain", layer=layer, registry=registry, timeout=0.1, wait=0.5)
        assert list(result.answers) == ["alive"] and result.missing == ["hung"]
    finally:
        await stop_listeners(tasks)


async def test_a_worker_that_stopped_beating_is_still_asked_and_a_silent_one_fails_the_drain(settings: Any) -> None:
    # Its loop stalled, or its Redis connection lost while the command's works: it stops beating and
    # may still serve. Before, it was not asked after LIVE_SECONDS, and a drain said all drained (exit 0).
    settings.EXECAPP = {"WORKER_DROP_SECONDS": 60.0}
    layer, registry = InMemoryChannelLayer(), LocalRegistry()
    tasks = await start_listeners([Worker("alive")], layer, registry)
    # "resumed" listens but its beats went elsewhere: it answers when asked, and counts.
    tasks += await start_listeners([Worker("resumed")], layer, LocalRegistry())
    now = time.time()
    registry._beats.update({"stalled": (now - 20, {"pid": 0}), "resumed": (now - 30, {"pid": 0}),
                            "forgotten": (now - 120, {"pid": 0})})  # past WORKER_DROP_SECONDS: not expected
    try:
        result = await control.request("drain", layer=layer, registry=registry, timeout=0.1, wait=1.0)
        assert sorted(result.answers) == ["alive", "resumed"] and result.missing == ["stalled"]
        assert set(result.silent) == {"stalled", "resumed"} and 19 <= result.silent["stalled"] <= 25
        [line] = missing_lines(result)
        assert line.startswith("worker stalled: did not answer within") and "silent for" in line
        assert "it may still be serving" in line
        assert (await control.request("status", layer=layer, registry=registry, worker="stalled", wait=0.3)
                ).missing == ["stalled"]  # named alone too, not "no live worker"
    finally:
        await stop_listeners(tasks)


@pytest.mark.redis
def test_the_redis_registry_lists_workers_that_stopped_beating(redis_url: str) -> None:
    registry = RedisRegistry(redis_url, redis_test_prefix("silent"))
    try:
        registry.beat("fresh", {"pid": 1})
        registry.beat("stalled", {"pid": 2})
        registry.redis.zadd(registry.key, {"stalled": time.time() - 20, "forgotten": time.time() - 120})
        assert sorted(registry.live()) == ["fresh"]
        silent = registry.silent(60.0)
        assert list(silent) == ["stalled"] and 19 <= silent["stalled"][0] <= 25 and silent["stalled"][1] == {"pid": 2}
    finally:
        for wid in ("fresh", "stalled", "forgotten"):
            registry.remove(wid)


def test_commands_explain_that_the_in_memory_layer_cannot_reach_the_server(settings: Any) -> None:
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    for command in ("drain", "undrain", "execstatus"):
        with pytest.raises(CommandError, match="control_unavailable.*set REDIS_URL.*SIGTERM"):
            call_command(command)


@pytest.mark.redis
def test_control_threads_over_real_redis_and_the_commands(redis_url: str, settings: Any) -> None:
    # The production shape: each worker's listener on its own thread, loop and layer instance;
    # the management commands in this thread, through settings (REDIS_URL, channels_redis).
    from channels_redis.core import RedisChannelLayer

    # A prefix of this test alone (inside the run's): concurrent runs of the suite share the Redis server.
    prefix, ops_redis = redis_test_prefix("ctl"), redis_url
    config = {"hosts": [{"address": ops_redis, "socket_timeout": 15}], "expiry": 30, "prefix": prefix}
    settings.REDIS_URL = ops_redis
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": config}}
    settings.EXECAPP = {"POOL_IDLE_SECONDS": 0.2}
    workers = [Worker("redis-w1"), Worker("redis-w2")]
    gate = Gate()
    workers[1].engine.on_command("slow", gate)
    threads = [ControlThread(w, RedisChannelLayer(**config), RedisRegistry(ops_redis, prefix)) for w in workers]
    try:
        assert all(t.start() for t in threads)
        live = RedisRegistry(ops_redis, prefix).live()
        assert sorted(live) == ["redis-w1", "redis-w2"] and live["redis-w1"]["channel"]

        import io
        out = io.StringIO()
        call_command("execstatus", stdout=out)
        assert "worker redis-w1" in out.getvalue() and "worker redis-w2" in out.getvalue()
        assert "2 workers answered" in out.getvalue()

        assert admit(workers[1], "/slow") and gate.entered.wait(WAIT)
        out = io.StringIO()
        with pytest.raises(CommandError, match=r"1 of 2 workers did not drain within 0.3 s: redis-w2 "
                                               r"\(still running: command:slow; 1 events without done\)"):
            call_command("drain", "--timeout", "0.3", stdout=out)
        lines = out.getvalue().splitlines()
        assert lines[0].startswith("worker redis-w1: drained in")
        assert lines[1].startswith("worker redis-w2: NOT drained (timeout)")

        # The straggler finishes while the second drain waits: that drain reports it.
        threading.Timer(0.2, gate.opened.set).start()
        out = io.StringIO()
        call_command("drain", "--worker", "redis-w2", "--timeout", "5", stdout=out)
        assert "worker redis-w2: drained in" in out.getvalue()
        assert "finished 1 events and 1 pooled tasks" in out.getvalue()

        out = io.StringIO()
        call_command("undrain", stdout=out)
        assert out.getvalue().splitlines() == ["worker redis-w1: resumed", "worker redis-w2: resumed"]
        assert not any(w.draining for w in workers)
    finally:
        for t in threads:
            t.stop()
    assert RedisRegistry(ops_redis, prefix).live() == {}


def test_healthz_answers_503_while_starting_or_draining(worker: Worker, client: Any, install_worker: Any) -> None:
    install_worker(worker)
    starting = client.get("/healthz")  # services not ticked yet (plugins not loaded)
    assert starting.status_code == 503 and starting.json()["status"] == "starting"
    worker.ready.set()
    ok = client.get("/healthz")
    assert ok.status_code == 200 and ok.json() == {"status": "ok", "worker": "unit-worker", "draining": False,
                                                   "events_in_flight": 0}
    drain_worker(worker, WAIT)
    draining = client.get("/healthz")
    assert draining.status_code == 503 and draining.json()["status"] == "draining"
    undrain_worker(worker)
    assert client.get("/healthz").status_code == 200


def test_drain_refuses_a_timeout_that_is_not_a_finite_number(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--timeout nan`` passed the ``< 0`` check and reached the workers (a drain of 0 s that said
    "within nan s"); ``inf`` left the command waiting forever on a straggler."""
    from execapp.management.commands import _control

    asked: list[Any] = []
    monkeypatch.setattr(_control, "request_sync", lambda *a, **k: asked.append(a))
    for value in ("nan", "inf", "-inf", "-1"):
        with pytest.raises(CommandError, match=rf"--timeout {float(value)}: use a finite number of seconds >= 0"):
            call_command("drain", f"--timeout={value}")
    assert asked == []


def test_ctrl_c_on_a_drain_says_the_workers_go_on_draining(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl+C while `manage.py drain` waited was a 40-line traceback, saying nothing of the workers,
    which go on draining without it: now one line naming execstatus and undrain, exit status 130."""
    from django.core.management import CommandError, call_command

    from execapp.management.commands import _control

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(_control, "request_sync", interrupted)
    with pytest.raises(CommandError) as drained:
        call_command("drain", "--timeout", "5")
    assert drained.value.returncode == 130
    assert str(drained.value).startswith("interrupted: the workers asked go on draining")
    assert "`manage.py undrain` resumes them" in str(drained.value)
    with pytest.raises(CommandError) as status:
        call_command("execstatus")
    assert str(status.value) == "interrupted: nothing was changed"
