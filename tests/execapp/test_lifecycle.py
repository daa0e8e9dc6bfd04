"""The worker lifecycle attacked from outside: an impatient operator, workers that die or crash at
every start, a drained deployment that loses a worker.

Real ``python -m execapp.serve`` processes on SQLite with the Python test handlers of
ws_handlers.py (``/slow N`` sleeps N ms in the pool, ``/stall`` answers with its pid). Time bounds
are liveness bounds (far from the mechanism's own numbers), never performance assertions.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from websockets.asyncio.client import connect

from execapp.restart_backoff import STABLE_SECONDS, RestartBackoff
from tests.conftest import (
    REDIS_TEST_URL,
    manage,
    migrated_token_env,
    redis_test_prefix,
    require_service,
    wait_until,
)
from tests.execapp.supervised import SupervisedServer, starter
from tests.execapp.test_dashboard import publisher_only  # noqa: F401 (a fixture)
from tests.execapp.ws_handlers import CRASH_AT_START, HANG_AT_START

pytestmark = pytest.mark.e2e

#: A worker process start (imports, Django, the first service ticks) on a busy 2-core machine.
START_BOUND = 30.0
WAIT = 20.0


class Server(SupervisedServer):
    """The supervised server, its log at info (the tests read the supervisor's lines)."""

    log_level = "info"

    def __init__(self, env: dict[str, str], tmp: Path, **kwargs: Any) -> None:
        super().__init__(env, tmp, log_name="lifecycle", **kwargs)


@pytest.fixture(scope="module")
def db_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One migrated SQLite file and one API token for this module's servers."""
    return migrated_token_env(tmp_path_factory.mktemp("lifecycle-db"), "lifecycle")


@pytest.fixture
def start(db_env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    yield from starter(db_env, tmp_path, Server)


async def first_frame(url: str, text: str, eid: str) -> dict:
    async with connect(url, open_timeout=5) as ws:
        await ws.send(json.dumps({"id": eid, "type": "message", "text": text}))
        return json.loads(await asyncio.wait_for(ws.recv(), WAIT))


# -- an impatient operator ------------------------------------------------------------------------

async def test_a_second_signal_to_the_supervisor_forces_the_draining_workers_out(start: Any) -> None:
    """SIGTERM drains for up to the grace; a second signal sent to the supervisor's pid (not a
    terminal's Ctrl+C, which reaches every process) used to be recorded and ignored: the server
    went on waiting the whole grace for a handler that sleeps 60 s."""
    server = await asyncio.to_thread(start, args=("--grace", "60"))
    async with connect(server.ws_url) as ws:
        await ws.send(json.dumps({"id": "long", "type": "message", "text": "/slow 60000"}))
        await ws.send(json.dumps({"id": "probe", "type": "message", "text": "/stall"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), WAIT))["id"] == "probe"  # /slow was accepted before it
        server.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(wait_until, lambda: "draining worker" in server.log(), WAIT), server.log()
        server.proc.send_signal(signal.SIGINT)
        # Far below the 60 s grace: the forced workers abandon the drain and exit.
        await asyncio.to_thread(server.proc.wait, WAIT)
    log = server.log()
    assert "second signal (SIGINT) while the workers drain: forcing them to exit now" in log, log
    assert "NOT drained (aborted)" in log, log


# -- restart storms -------------------------------------------------------------------------------

STARTED = re.compile(r"^(\S+ \S+) INFO execapp\.serve started worker process", re.M)
BACKOFF = re.compile(r"died with exit code 17 before it listened \((\d+) failed starts in a row\): starting another "
                     r"in ([\d.]+) s")


async def test_a_worker_that_dies_at_every_start_is_restarted_with_a_growing_wait(start: Any) -> None:
    """A plugin whose top level kills its process at every load (here: the test handlers' service
    exits in the first service ticks) made the supervisor start another at once, forever."""
    server = await asyncio.to_thread(start, env={CRASH_AT_START: "1"}, settings={"RESTART_BACKOFF_MAX_SECONDS": 1.0},
                                     wait=False)
    assert await asyncio.to_thread(wait_until, lambda: len(BACKOFF.findall(server.log())) >= 3, 60), server.log()
    log = server.log()
    waits = [(int(n), float(s)) for n, s in BACKOFF.findall(log)][:3]
    assert waits == [(1, 0.5), (2, 1.0), (3, 1.0)], waits  # doubling, capped by the setting
    starts = [time.mktime(time.strptime(t.split(",")[0], "%Y-%m-%d %H:%M:%S")) + int(t.split(",")[1]) / 1000
              for t in STARTED.findall(log)]
    # Each start after a failed one waited at least its backoff (a lower bound: the mechanism, not speed).
    for (_, wait), before, after in zip(waits, starts, starts[1:]):
        assert after - before >= wait, (waits, starts)
    assert server.proc.poll() is None and server.healthz()[0] == 0, "the supervisor stays up, nothing serves"
    assert await asyncio.to_thread(server.stop, WAIT) == 0, "a SIGTERM during a backoff wait stops it at once"


async def test_a_young_worker_stopped_with_sigterm_is_replaced_at_once_not_as_a_failed_start(start: Any) -> None:
    """A worker that exits through its own shutdown (an operator's `kill -TERM <worker pid>`) a few
    seconds after it started is no crash: no backoff, no ERROR about failed starts."""
    server = await asyncio.to_thread(start)
    (old,) = server.ready_pids()
    os.kill(old, signal.SIGTERM)
    assert await asyncio.to_thread(wait_until, lambda: server.ready_pids() - {old}, START_BOUND), server.log()
    log = server.log()
    assert f"worker process [{old}] died with exit code -15; starting another" in log, log
    assert "failed starts in a row" not in log, log


async def test_a_worker_that_hangs_at_every_start_is_killed_and_replaced(start: Any) -> None:
    """A worker that hung while starting (a service factory that never returns, an import stuck on
    the network) was never watched: no stall (its loop beats, or has not started), never listening,
    counted as running for ever while nothing served."""
    server = await asyncio.to_thread(start, env={HANG_AT_START: "1"}, wait=False,
                                     settings={"WORKER_START_TIMEOUT_SECONDS": 2.0, "RESTART_BACKOFF_MAX_SECONDS": 0.5})
    hung = re.compile(r"worker process \[(\d+)\] did not listen within 2 s of its start "
                      r".*state starting, its loop beats")
    assert await asyncio.to_thread(wait_until, lambda: len(hung.findall(server.log())) >= 2, 60), server.log()
    first, second = hung.findall(server.log())[:2]
    assert first != second, "each hung start is killed, then another is started"
    assert "most recent call first" in server.log(), "its threads' stacks were dumped before the kill"
    assert server.proc.poll() is None


def test_a_streak_of_failed_starts_ends_only_when_a_worker_started_after_it_serves() -> None:
    backoff = RestartBackoff(cap=4.0)
    assert [backoff.failed(100.0 + i) for i in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert not backoff.may_start(104.0) and backoff.may_start(108.0)
    # A sibling serving since before the streak (started at 0) does not end it...
    assert backoff.served(0.0, 1.0, 200.0) and backoff.failures == 5
    # ...nor one started after it that has not listened STABLE_SECONDS yet; one that has does.
    assert not backoff.served(150.0, 195.0, 200.0) and backoff.failures == 5
    assert backoff.served(150.0, 195.0, 195.0 + STABLE_SECONDS) and backoff.failures == 0
    assert backoff.may_start(0.0) and backoff.failed(300.0) == 0.5
    assert RestartBackoff(cap=0.0).failed(1.0) == 0.0, "0 turns the wait off"


def test_checks_name_a_bad_restart_backoff_or_unread_client_wait(settings: Any) -> None:
    from execapp.checks import check_execapp_settings

    for key, value, code in (("RESTART_BACKOFF_MAX_SECONDS", -1, "execapp.E043"),
                             ("RESTART_BACKOFF_MAX_SECONDS", float("inf"), "execapp.E043"),
                             ("RESTART_BACKOFF_MAX_SECONDS", "5", "execapp.E043"),
                             ("RESTART_BACKOFF_MAX_SECONDS", 3600, "execapp.W043"),
                             ("DRAIN_UNREAD_CLIENT_SECONDS", -0.5, "execapp.E044"),
                             ("DRAIN_UNREAD_CLIENT_SECONDS", 30, "execapp.W044"),
                             ("WORKER_START_TIMEOUT_SECONDS", float("nan"), "execapp.E046"),
                             ("WORKER_START_TIMEOUT_SECONDS", 5, "execapp.W046")):
        settings.EXECAPP = {key: value}
        found = {m.id: m for m in check_execapp_settings()}
        assert code in found and key in found[code].msg and found[code].hint, (key, value)
    settings.EXECAPP = {"RESTART_BACKOFF_MAX_SECONDS": 0, "DRAIN_UNREAD_CLIENT_SECONDS": 0,
                        "WORKER_START_TIMEOUT_SECONDS": 0}
    assert not {m.id for m in check_execapp_settings()} & {"execapp.E043", "execapp.W043", "execapp.E044",
                                                           "execapp.W044", "execapp.E046", "execapp.W046"}


# -- a drained deployment loses a worker ----------------------------------------------------------

def worker_pids(server: Server) -> set[int]:
    return {s["pid"] for s in server.slots() if s["state"] in ("ready", "recycle")}


async def test_a_drained_worker_killed_is_replaced_by_a_drained_one_until_undrain(start: Any) -> None:
    """After `manage.py drain` (exit 0: the deploy may begin) a worker that died (OOM, SIGKILL, the
    watchdog) was replaced by one that served events: a deployment the operator drained took events
    again, in the middle of a schema change."""
    redis = {"REDIS_URL": require_service("Redis", REDIS_TEST_URL), "REDIS_PREFIX": redis_test_prefix("life")}
    server = await asyncio.to_thread(start, env=redis)
    (old,) = worker_pids(server)
    drained = await asyncio.to_thread(manage, "drain", "--timeout", "5", env=server.env)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert (await first_frame(server.ws_url, "/stall", "a"))["code"] == "draining"
    os.kill(old, signal.SIGKILL)
    assert await asyncio.to_thread(wait_until, lambda: worker_pids(server) - {old}, START_BOUND), server.log()
    (new,) = worker_pids(server) - {old}
    frame = await first_frame(server.ws_url, "/stall", "b")
    assert frame["type"] == "error" and frame["code"] == "draining", f"the replacement {new} took an event: {frame}"
    assert server.healthz()[0] == 503
    undrained = await asyncio.to_thread(manage, "undrain", env=server.env)
    assert undrained.returncode == 0, undrained.stdout + undrained.stderr  # the dead worker is not waited for
    assert (await first_frame(server.ws_url, "/stall", "c"))["text"] == f"pid {new}"
    assert "its replacement starts drained" in server.log() and "starts drained" in server.log()
    # Undrained, it is no longer held: the next replacement serves at once.
    os.kill(new, signal.SIGKILL)
    assert await asyncio.to_thread(wait_until, lambda: worker_pids(server) - {old, new}, START_BOUND), server.log()
    (newest,) = worker_pids(server) - {old, new}
    assert (await first_frame(server.ws_url, "/stall", "d"))["text"] == f"pid {newest}"


async def test_a_worker_restarting_while_every_worker_is_drained_starts_drained(start: Any) -> None:
    """A worker that died just before `manage.py drain` (its replacement still starting) was not
    reached by it: the drain said every worker drained (exit 0) and the replacement then served."""
    redis = {"REDIS_URL": require_service("Redis", REDIS_TEST_URL), "REDIS_PREFIX": redis_test_prefix("life")}
    server = await asyncio.to_thread(start, env=redis, workers=2)
    victim, other = sorted(worker_pids(server))
    os.kill(victim, signal.SIGKILL)  # the drain below is sent while its replacement starts
    drained = await asyncio.to_thread(manage, "drain", "--timeout", "5", env=server.env)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert await asyncio.to_thread(wait_until, lambda: len(worker_pids(server) - {victim}) == 2, START_BOUND), \
        server.log()
    (new,) = worker_pids(server) - {victim, other}
    status = await asyncio.to_thread(manage, "execstatus", "--json", env=server.env)
    states = {a["pid"]: a["draining"] for a in json.loads(status.stdout)["workers"].values()}
    assert states == {other: True, new: True}, f"the replacement {new} serves: {states}\n{server.log()}"
    undrained = await asyncio.to_thread(manage, "undrain", env=server.env)
    assert undrained.returncode == 0, undrained.stdout + undrained.stderr
    # A drain of one worker (--worker) holds that one only: a sibling's replacement serves.
    wid = next(w for w, a in json.loads(status.stdout)["workers"].items() if a["pid"] == other)
    assert (await asyncio.to_thread(manage, "drain", "--worker", wid, "--timeout", "5", env=server.env)).returncode == 0
    os.kill(new, signal.SIGKILL)
    assert await asyncio.to_thread(wait_until, lambda: len(worker_pids(server) - {victim, new}) == 2, START_BOUND)
    (newest,) = worker_pids(server) - {victim, new, other}
    status = await asyncio.to_thread(manage, "execstatus", "--json", env=server.env)
    states = {a["pid"]: a["draining"] for a in json.loads(status.stdout)["workers"].values()}
    assert states == {other: True, newest: False}, states


# -- a dead worker and the operator's commands ----------------------------------------------------

async def test_a_worker_whose_process_is_gone_is_not_waited_for_nor_counted_as_silent(settings: Any) -> None:
    """A worker SIGKILLed a moment ago stays in the registry for LIVE_SECONDS: `drain` then waited its
    whole timeout for it and failed ("did not answer"), `undrain` failed, though its process was gone."""
    from channels.layers import InMemoryChannelLayer

    from execapp import control_client as control
    from execapp.control import UnknownWorker
    from execapp.control_registry import LocalRegistry, process_namespace
    from execapp.worker import Worker
    from tests.execapp.test_control import start_listeners, stop_listeners

    settings.EXECAPP = {"POOL_IDLE_SECONDS": 0.2}
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is gone now (reaped)
    layer, registry = InMemoryChannelLayer(), LocalRegistry()
    tasks = await start_listeners([Worker("alive")], layer, registry)
    registry.beat("killed", {"pid": dead.pid, "pidns": process_namespace()})
    registry.beat("elsewhere", {"pid": dead.pid, "pidns": "another-machine:1"})  # unsure: still expected
    try:
        result = await control.request("drain", layer=layer, registry=registry, timeout=0.1, wait=0.5)
        assert list(result.answers) == ["alive"] and result.gone == {"killed": dead.pid}
        assert result.missing == ["elsewhere"]
        with pytest.raises(UnknownWorker, match=f"'killed' is gone: its process {dead.pid} no longer exists"):
            await control.request("undrain", layer=layer, registry=registry, worker="killed")
    finally:
        await stop_listeners(tasks)


async def test_a_worker_killed_while_it_is_asked_ends_the_wait_for_it(settings: Any) -> None:
    """A worker the watchdog (or anyone) killed mid-drain never answers: the command waited for it until
    the drain's timeout plus the margin, then said "did not answer"; it now sees the process die."""
    from channels.layers import InMemoryChannelLayer

    from execapp import control_client as control
    from execapp.control_registry import LocalRegistry, process_namespace
    from execapp.worker import Worker
    from tests.execapp.test_control import start_listeners, stop_listeners

    settings.EXECAPP = {"POOL_IDLE_SECONDS": 0.2}
    doomed = subprocess.Popen(["sleep", "60"])
    layer, registry = InMemoryChannelLayer(), LocalRegistry()
    tasks = await start_listeners([Worker("alive")], layer, registry)
    registry.beat("doomed", {"pid": doomed.pid, "pidns": process_namespace()})  # registered, never answers
    try:
        asking = asyncio.ensure_future(control.request("drain", layer=layer, registry=registry, timeout=60))
        await asyncio.sleep(0.3)  # the request is out and "alive" answered; "doomed" is waited for
        assert not asking.done()
        doomed.kill()  # a zombie until reaped: dead all the same
        result = await asyncio.wait_for(asking, WAIT)  # not the drain's 60 s + the margin
        assert list(result.answers) == ["alive"] and result.died == {"doomed": doomed.pid}
        assert result.missing == [] and result.gone == {}
    finally:
        doomed.kill()
        doomed.wait()
        await stop_listeners(tasks)


def test_the_dashboard_takes_a_killed_worker_out_of_the_totals_at_once(publisher_only: None) -> None:
    """A SIGKILLed worker's last snapshot said it served: it stayed live in the dashboard's totals for
    WORKER_STALE_SECONDS (10 s). On the same machine its missing process now says so at once."""
    from execapp import dashboard_data, snapshots
    from execapp.control_registry import process_namespace

    dead = subprocess.Popen(["true"])
    dead.wait()
    now = time.time()
    base = {"pool": {"capacity": 8, "queue_capacity": 8, "in_flight": 3, "queued": 0, "submitted": 5},
            "counts": {"events": 5}, "plugin_pools": [], "events_per_second": 0.0, "matchers": [],
            "pidns": process_namespace()}
    snapshots.backend().publish({**base, "worker": "alive", "pid": os.getpid(), "ts": now}, None)
    snapshots.backend().publish({**base, "worker": "killed", "pid": dead.pid, "ts": now}, None)
    data = dashboard_data.collect(refresh=False)
    state = {w["worker"]: (bool(w.get("stopped")), w.get("gone", False)) for w in data["workers"]}
    assert state == {"alive": (False, False), "killed": (True, True)}, state
    assert data["total"]["workers"] == 1 and data["total"]["in_flight"] == 3


# -- a client that stops reading during a drain ---------------------------------------------------

async def test_a_client_that_reads_nothing_does_not_hold_a_sigterm_drain_for_its_whole_grace(start: Any) -> None:
    """A client that stopped reading left its events' `done` frames queued: the SIGTERM drain waited
    for them until the grace ran out (60 s here) and logged them as events still running. Now the drain
    waits for every running handler (the reading client's /slow), then stops waiting for frames no client
    reads (DRAIN_UNREAD_CLIENT_SECONDS) and says so."""
    server = await asyncio.to_thread(start, settings={"DRAIN_UNREAD_CLIENT_SECONDS": 1.0},
                                     args=("--grace", "60", "--close-timeout", "1"))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its backlog is felt at once
    sock.connect(("127.0.0.1", server.port))
    async with connect(server.ws_url, sock=sock, max_queue=1) as mute, connect(server.ws_url) as reader:
        mute.transport.pause_reading()  # reads nothing from here on

        async def flood() -> None:  # until the server, its outbox over the limits, stops reading it
            for i in range(1000):
                await mute.send(json.dumps({"id": f"m{i}", "type": "message", "text": "/echo " + "x" * 60_000}))

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(flood(), 1.5)  # (the sends block: the point, not a pace)
        await reader.send(json.dumps({"id": "slow", "type": "message", "text": "/slow 1500"}))
        await reader.send(json.dumps({"id": "probe", "type": "message", "text": "/stall"}))
        assert json.loads(await asyncio.wait_for(reader.recv(), WAIT))["id"] == "probe"  # /slow is accepted
        server.proc.send_signal(signal.SIGTERM)
        frames = [json.loads(await asyncio.wait_for(reader.recv(), WAIT)) for _ in range(3)]
        assert [(f["id"], f["type"]) for f in frames if f["id"] == "slow"] == [("slow", "reply"), ("slow", "done")]
        await asyncio.to_thread(server.proc.wait, WAIT)  # far below the 60 s grace
    log = server.log()
    assert re.search(r"drained: \d+ events, \d+ tasks in [\d.]+ s; [1-9]\d* done frames were not read", log), log
    assert "NOT drained" not in log


# -- the supervisor itself dies -------------------------------------------------------------------

async def test_workers_of_a_supervisor_that_was_killed_drain_and_exit(start: Any) -> None:
    """SIGKILL the supervisor (the OOM killer's pick, `kill -9` of the wrong pid): its workers served on
    for ever, with no watchdog and nobody to restart them, beside whatever supervisor started next."""
    server = await asyncio.to_thread(start)
    (pid,) = server.ready_pids()
    try:
        async with connect(server.ws_url) as ws:
            await ws.send(json.dumps({"id": "slow", "type": "message", "text": "/slow 1000"}))
            await ws.send(json.dumps({"id": "probe", "type": "message", "text": "/stall"}))
            assert json.loads(await asyncio.wait_for(ws.recv(), WAIT))["id"] == "probe"  # /slow is accepted
            server.proc.kill()
            # The orphan drains like a SIGTERMed worker: the event in flight ends with its done, then 1012.
            frames = [json.loads(await asyncio.wait_for(ws.recv(), WAIT)) for _ in range(3)]
            assert [(f["id"], f["type"]) for f in frames if f["id"] == "slow"] == [("slow", "reply"),
                                                                                  ("slow", "done")]
        assert await asyncio.to_thread(wait_until, lambda: not Path(f"/proc/{pid}").exists(), WAIT), server.log()
        assert f"worker process [{pid}]: its supervisor is gone" in server.log()
    finally:
        if Path(f"/proc/{pid}").exists():  # the worker this test started, orphaned: never left serving
            os.kill(pid, signal.SIGKILL)
