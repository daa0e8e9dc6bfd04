"""The supervisor's watchdog end to end (issue 9 item 3; issue 10 item 5's drain part).

Real ``python -m execapp.serve`` processes on SQLite with the Python test handlers of
ws_handlers.py: ``/stall N`` answers at once until asked to block in C for N seconds (on the
event loop once it has proven fast and runs inline: nothing can interrupt it), ``/wedge``
ignores its 0.2 s engine timeout in a pool thread. Time bounds are liveness bounds (the stall
limit plus a worker start plus generous slack), never tight timings.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import types
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from django.core import checks as django_checks
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from execapp import watchdog
from execapp.watchdog_quarantine import append_quarantine, read_quarantine
from execapp.watchdog_service import WatchdogService
from execapp.watchdog_worker import WorkerWatch
from tests.conftest import migrated_token_env, wait_until
from tests.execapp.supervised import SupervisedServer, starter

pytestmark = pytest.mark.e2e

STALL_LIMIT = 2.0
#: A worker process start (imports, Django, the first service ticks) on a busy 2-core machine.
START_BOUND = 20.0
WAIT = 20.0
SETTINGS = {"LOOP_STALL_SECONDS": STALL_LIMIT, "PROFILE_WINDOW": 10, "STUCK_THREADS_LIMIT": 2}


class Supervised(SupervisedServer):
    """The supervised server with this module's watchdog settings."""

    def __init__(self, env: dict[str, str], tmp: Path, workers: int) -> None:
        super().__init__(env, tmp, workers, settings=SETTINGS, log_name=f"watchdog{workers}")


@pytest.fixture(scope="module")
def db_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One migrated SQLite file and one API token for this module's servers."""
    return migrated_token_env(tmp_path_factory.mktemp("watchdog-db"), "watchdog")


@pytest.fixture
def start(db_env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    """Start a supervised server (its own database file: profiles persist between tests otherwise)."""
    yield from starter(db_env, tmp_path, Supervised)


async def event(ws: ClientConnection, text: str, eid: str, timeout: float = WAIT) -> list[dict]:
    """Send one event; its frames up to its `done`."""
    await ws.send(json.dumps({"id": eid, "type": "message", "text": text}))
    frames = []
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if frame.get("id") == eid:
            frames.append(frame)
            if frame["type"] == "done":
                return frames


async def stall_reply(ws: ClientConnection, eid: str) -> tuple[int, str]:
    """(pid of the worker, exec class) of one fast /stall."""
    frames = await event(ws, "/stall", eid)
    reply = frames[0]
    assert reply["type"] == "reply", frames
    return int(reply["text"].split()[1]), reply["exec"]


async def warm_inline(ws: ClientConnection, tag: str) -> int:
    """Send fast /stall until the worker runs it inline (proven fast); returns the worker's pid."""
    for i in range(40):
        pid, exec_class = await stall_reply(ws, f"{tag}-warm-{i}")
        if exec_class == "sync":
            return pid
    raise AssertionError("/stall never ran inline after 40 fast runs")


async def always_pooled(ws: ClientConnection, tag: str, runs: int = 12) -> int:
    """More fast /stall runs than the profile window: a non-quarantined matcher would be inline by then."""
    pids = set()
    for i in range(runs):
        pid, exec_class = await stall_reply(ws, f"{tag}-{i}")
        assert exec_class == "pool", f"{tag}: run {i} of /stall ran {exec_class} on worker {pid}: not quarantined"
        pids.add(pid)
    assert len(pids) == 1
    return pids.pop()


async def closed_code(ws: ClientConnection, timeout: float) -> int | None:
    """Wait for the server to close ``ws``; its close code (1006 when the TCP connection just died)."""
    try:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except ConnectionClosed:
        return ws.close_code


async def connection_to(server: Supervised, want: Any, tag: str, tries: int = 40) -> tuple[ClientConnection, int]:
    """A new connection that SO_REUSEPORT landed on a worker whose pid satisfies ``want``."""
    for i in range(tries):
        ws = await connect(server.ws_url)
        pid, _ = await stall_reply(ws, f"{tag}-probe-{i}")
        if want(pid):
            return ws, pid
        await ws.close()
    raise AssertionError(f"no connection reached the wanted worker in {tries} tries: {server.slots()}")


async def first_answer(server: Supervised, tag: str) -> int:
    """The pid of the first worker that answers a /stall on a new connection, retrying refused or
    reset connections (one that landed in a dead or closing listener's queue)."""
    n = 0
    while True:
        n += 1
        try:
            async with connect(server.ws_url, open_timeout=2) as ws:
                return (await stall_reply(ws, f"{tag}-{n}"))[0]
        except (OSError, ConnectionClosed, InvalidHandshake, asyncio.TimeoutError):
            await asyncio.sleep(0.05)  # the retry's pace (the caller bounds the whole wait)


def parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("\nPPid:\t", 1)[1].split("\n", 1)[0])


# -- a stalled loop -------------------------------------------------------------------------------

@pytest.mark.parametrize("stall", ["30", "gil"])  # time.sleep (the GIL released), a regex (the GIL held)
async def test_one_worker_is_supervised_and_a_stalled_loop_is_replaced(start: Any, stall: str) -> None:
    server = await asyncio.to_thread(start, 1)
    (old,) = server.ready_pids()
    assert parent_of(old) == server.proc.pid, "--workers 1 runs its worker under the supervisor"
    async with connect(server.ws_url) as victim, connect(server.ws_url) as ws:
        assert await warm_inline(ws, "warm") == old
        stalled_at = time.monotonic()
        await ws.send(json.dumps({"id": "stall", "type": "message", "text": f"/stall {stall}"}))
        # The whole worker is stuck: every connection of it dies with the process (1006).
        assert await closed_code(ws, STALL_LIMIT + WAIT) == 1006
        assert await closed_code(victim, WAIT) == 1006
    killed_after = time.monotonic() - stalled_at
    assert killed_after < STALL_LIMIT + 10, f"killed {killed_after:.1f} s after the stall began"

    new = await asyncio.wait_for(first_answer(server, "after"), START_BOUND)
    served_after = time.monotonic() - stalled_at
    assert new != old
    assert served_after < STALL_LIMIT + START_BOUND, served_after
    # The replacement applied the quarantine list before it listened: never inline again.
    async with connect(server.ws_url) as ws:
        assert await always_pooled(ws, "replacement") == new
    # What the killed worker was running survived its SIGKILL in the supervisor's files.
    dead = [s for s in server.slots() if s["pid"] == old]
    assert len(dead) == 1 and dead[0]["inline"] == "command:stall", server.slots()
    assert dead[0]["heartbeat_age"] > STALL_LIMIT
    entries = read_quarantine(server.watch_dir)
    assert [e.matcher for e in entries] == ["command:stall"] and f"worker process {old}" in entries[0].reason
    log = server.log(tail=None)  # the whole log: every thread's stack follows the line
    assert f"worker process [{old}]: event loop stalled" in log and "running matcher command:stall inline" in log
    assert "most recent call first" in log, "the stalled worker's stacks were dumped before the kill"
    assert "in stall" in log, "the dump shows the handler, even with the GIL held (faulthandler writes from C)"
    print(f"\n{stall}: worker killed in {killed_after:.2f} s, replacement serving {served_after:.2f} s after the "
          f"stall began (LOOP_STALL_SECONDS {STALL_LIMIT:g})")


async def test_two_workers_keep_the_offender_off_every_loop(start: Any) -> None:
    server = await asyncio.to_thread(start, 2)
    first, second = sorted(server.ready_pids())
    a, pid_a = await connection_to(server, lambda pid: pid == first, "a")
    b, pid_b = await connection_to(server, lambda pid: pid == second, "b")
    try:
        # Proven fast (inline) on both workers before anything goes wrong.
        assert await warm_inline(a, "a") == pid_a and await warm_inline(b, "b") == pid_b
        await a.send(json.dumps({"id": "stall", "type": "message", "text": "/stall 30"}))
        assert await closed_code(a, STALL_LIMIT + WAIT) == 1006

        # The survivor never stopped serving, and its housekeeper pinned the matcher to the pool.
        async def pinned() -> None:
            n = 0
            while (await stall_reply(b, f"b-pin-{n}"))[1] != "pool":
                n += 1
                await asyncio.sleep(0.05)  # the poll's pace (bounded by the wait_for below)

        await asyncio.wait_for(pinned(), WAIT)
        assert await always_pooled(b, "survivor") == pid_b
    finally:
        await a.close()
        await b.close()
    # The replacement of the killed worker pins it before it listens.
    assert wait_until(lambda: len(server.ready_pids() - {pid_a}) == 2, START_BOUND), server.slots()
    c, pid_c = await connection_to(server, lambda pid: pid not in (pid_a, pid_b), "c")
    try:
        assert await always_pooled(c, "replacement") == pid_c
    finally:
        await c.close()
    assert [e.matcher for e in read_quarantine(server.watch_dir)] == ["command:stall"]
    log = server.log(tail=None)  # the whole log: every thread's stack follows the line
    assert f"worker process [{pid_a}]: event loop stalled" in log
    assert log.count("matcher command:stall quarantined (pinned to the pool)") >= 2, log


# -- stuck pool threads, then a SIGTERM drain -----------------------------------------------------

async def test_stuck_threads_recycle_the_worker_then_a_sigterm_drain_still_answers_probes(start: Any) -> None:
    # One server for both (a server start costs seconds): --workers 1, STUCK_THREADS_LIMIT 2.
    server = await asyncio.to_thread(start, 1)
    (old,) = server.ready_pids()
    async with connect(server.ws_url) as ws:
        for i in range(2):  # two handlers that ignore their deadline: two stuck pool threads
            frames = await event(ws, "/wedge", f"wedge-{i}")
            assert [f["type"] for f in frames] == ["error", "done"] and frames[0]["code"] == "timeout", frames
        # The drained worker closes its connections with 1012 (service restart: reconnect).
        assert await closed_code(ws, WAIT + START_BOUND) == 1012
    new = await asyncio.wait_for(first_answer(server, "after"), WAIT)
    assert new != old
    log = server.log(tail=None)  # the whole log: every thread's stack follows the line
    asked = log.index(f"worker process [{old}] asks to be recycled")
    listening = log.index(f"listens: draining worker process [{old}] (SIGTERM)")
    assert asked < log.index("started worker process", asked) < listening, "the replacement starts first"
    assert "pool threads are stuck past their deadline (EXECAPP['STUCK_THREADS_LIMIT'] is 2" in log
    assert "listener handed over to sibling workers" in log, "a recycled worker leaves new clients to its successor"
    assert "NOT drained" not in log, "the drain does not wait for threads stuck past their deadline"
    # Counted in /metrics (the recycled worker's counter survives it: multiprocess mode).
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=WAIT) as response:
        text = response.read().decode()
    stuck_total = [line for line in text.splitlines() if line.startswith("execapp_pool_stuck_total ")]
    assert stuck_total and float(stuck_total[0].split()[1]) == 2.0, stuck_total
    assert "execapp_pool_stuck_threads " in text

    # A SIGTERM drain of the whole server: the last worker keeps listening through it.
    async with connect(server.ws_url) as ws:
        await ws.send(json.dumps({"id": "slow", "type": "message", "text": "/slow 2000"}))
        assert await asyncio.to_thread(wait_until, lambda: server.healthz()[1].get("events_in_flight") == 1, WAIT)
        server.proc.send_signal(signal.SIGTERM)
        # Probes get an answer, and it is 503 `draining` (not a refused connection).
        assert await asyncio.to_thread(wait_until, lambda: server.healthz()[0] == 503, WAIT), server.log()
        status, body = await asyncio.to_thread(server.healthz)
        assert (status, body["status"], body["draining"]) == (503, "draining", True), body
        # A new WebSocket client is told to reconnect, with the reason.
        async with connect(server.ws_url) as late:
            assert await closed_code(late, WAIT) == 1012
            assert late.close_reason and late.close_reason.startswith("draining"), late.close_reason
        # The accepted event still completes, then its connection closes with 1012.
        frames = [json.loads(await asyncio.wait_for(ws.recv(), WAIT)) for _ in range(2)]
        assert [f["type"] for f in frames] == ["reply", "done"] and frames[0]["text"] == "slept 2000"
        assert await closed_code(ws, WAIT) == 1012
    assert await asyncio.to_thread(server.proc.wait, WAIT) == 0
    assert server.healthz()[0] == 0, "after the drain the listener is closed"
    assert "still listening" in server.log()


# -- in-process pieces ----------------------------------------------------------------------------

def test_the_inline_mark_is_read_from_another_mapping_and_a_cut_name_quarantines_by_prefix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from execapp.engine import Engine, ExecPool

    slots = watchdog.SlotFile.create(tmp_path / watchdog.SLOTS_FILE, 2)
    pool = ExecPool(1, 1)
    engine = Engine(pool=pool)
    long_name = "command:" + "x" * 80
    engine.on_command("x" * 80, lambda ctx: "ok", matcher_name=long_name)
    seen = []
    engine.on_command("peek", lambda ctx: seen.append(watchdog.SlotFile.open(slots.path).slot(1).mark()))
    engine.set_inline_slot(slots.slot(1).mark_buffer())
    engine.process_event_sync({"type": "message", "text": "/peek"})
    assert seen == [("command:peek", False)]  # named while it runs (another mapping of the file reads it)
    assert slots.slot(1).mark() == ("", False)  # and cleared after
    # A name longer than the 64-byte mark is recorded cut, and pins every matcher it starts.
    append_quarantine(tmp_path, long_name.encode()[:watchdog.MARK_SIZE].decode(), True, "test")
    monkeypatch.setenv(watchdog.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(watchdog.ENV_SLOT, "0")
    worker = types.SimpleNamespace(id="w", recycling=False, engine=engine, pool=pool,
                                   watch=WorkerWatch.from_env())
    WatchdogService(worker, 8).tick()
    assert engine.profiles[long_name].quarantined == "test"
    assert engine.profiles["command:peek"].quarantined is None
    assert slots.slot(0).pid == os.getpid() and slots.slot(0).stuck == 0
    pool.drain(1)


def test_checks_name_bad_watchdog_settings(settings: Any) -> None:
    from execapp.checks import check_execapp_settings

    settings.EXECAPP = {"LOOP_STALL_SECONDS": 0, "STUCK_THREADS_LIMIT": 2.5, "HOUSEKEEPER_STALL_SECONDS": float("nan")}
    ids = {m.id for m in check_execapp_settings()}
    assert {"execapp.E040", "execapp.E041", "execapp.E049"} <= ids
    settings.EXECAPP = {"LOOP_STALL_SECONDS": 0.5, "STUCK_THREADS_LIMIT": 100, "POOL_MAX_WORKERS": 64,
                        "HOUSEKEEPER_STALL_SECONDS": 2}
    messages = {m.id: m for m in check_execapp_settings()}
    assert {"execapp.W040", "execapp.W042", "execapp.W049"} <= set(messages)
    assert all(m.level == django_checks.WARNING for k, m in messages.items() if k in ("execapp.W040", "execapp.W042"))
    settings.EXECAPP = {}
    assert not {m.id for m in check_execapp_settings()} & {"execapp.E040", "execapp.E041", "execapp.W040",
                                                           "execapp.W041", "execapp.W042", "execapp.E049",
                                                           "execapp.W049"}
