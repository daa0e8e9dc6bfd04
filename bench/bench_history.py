"""What recording the event history costs (issue 12): the hot path and the server's throughput.

1. **Inline dispatch with recording**: an event through the connection's path in process, as
   the server runs it (``history.accepted``, ``Engine.process_event`` with one demoted handler
   replying ``pong``, ``history.delivered`` for the reply and the done, the recorder's run
   observer), with the recorder running vs without one (the hooks return at once). Interleaved
   repetitions, medians. Target: the overhead over a direct handler call stays <= 5 us. The
   buffered items are turned into traces between repetitions (the housekeeper's work, off the
   hot path); its cost per event is measured on its own.
2. **The connection's path in process, GC on**: ``execapp.connection.Connection`` fed /ping
   frames (the frame parsed, the event dispatched inline, its reply and done encoded and
   written to a no-op socket) with the recorder vs without, the recorder's flushes included
   (every 2,500 events, as its housekeeper would), CPU time per event, the garbage collector
   running as in the server (the inline case above pauses it, as timeit does). The server's
   own code without the transport's noise; no target of its own.
3. **/ping WebSocket throughput**: bench_ws.py's closed loop (10 connections, the bundled Lua
   ``ping`` demoted to inline, a separate client process) against two servers, one with the
   recorder and one without (``BENCH_NO_HISTORY=1``, bench/bench_app.py), loaded one at a time
   in alternation, 6 runs of 4 s each. Target: with recording >= 0.9x without.

Run alone: ``python bench/run.py --only history`` (``--quick`` for a short run).
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench.common import cpu_per_call_us, interleaved, row, setup_django  # noqa: E402

BENCH = "event history"


def bench_inline(quick: bool) -> list[dict[str, Any]]:
    """Inline dispatch through the connection's hooks, recorder on vs off (see the docstring)."""
    from execapp import history
    from execapp.engine import Engine, Event

    n, reps = (20_000, 5) if quick else (50_000, 9)
    engine = Engine(pool_enabled=True)
    m = engine.on_command("ping", lambda ctx: "pong")
    m.profile.restore("demoted", [0.00001] * m.profile.window)
    recorder = history.Recorder(SimpleNamespace(engine=engine, id="bench"))  # registers its run observer
    conn = SimpleNamespace(owner="tenant:bench")
    event = Event(text="/ping")
    accepted, delivered = history.accepted, history.delivered

    def on_outcome(outcome: Any) -> None:  # what Connection._deliver adds: one call per outcome
        # With the size of the outcome's frame, which the connection has measured for its outbox
        # (the bench builds no frame: a reply's "pong" frame is ~140 bytes).
        delivered(conn, outcome, 140)

    def one() -> None:
        accepted(conn, event)
        engine.process_event(event, on_outcome)

    def handler_only() -> None:
        m.handler(None)

    def off() -> float:
        history._recorder = None
        return cpu_per_call_us(one, n)

    def on() -> float:
        recorder.start()
        try:
            return cpu_per_call_us(one, n)
        finally:
            history._recorder = None
            history.discard_buffer()  # the housekeeper's work is measured apart (below)

    results = interleaved({"direct": lambda: cpu_per_call_us(handler_only, n), "off": off, "on": on}, reps)
    if m.profile.should_pool().value != "sync":
        raise RuntimeError("the benchmark handler left the inline path")
    # The housekeeper: turning n events' buffered items into traces and storing them.
    flush_us = []
    for _ in range(3):
        recorder.start()
        for _ in range(n):
            one()
        history._recorder = None
        started = time.perf_counter()
        recorder.flush()
        flush_us.append((time.perf_counter() - started) / n * 1e6)
    base, off_us, on_us = results["direct"], results["off"], results["on"]
    overhead = on_us - base
    return [
        row(BENCH, "direct handler call (baseline)", base, "us"),
        row(BENCH, "inline event, connection hooks, no recorder", off_us, "us", baseline="direct call",
            ratio=off_us / base),
        row(BENCH, "inline event, recorder on (the server's path)", on_us, "us", baseline="no recorder",
            ratio=on_us / off_us),
        row(BENCH, "  recording's own cost per event (hot path)", on_us - off_us, "us"),
        row(BENCH, "  inline dispatch overhead with recording", overhead, "us", target="<= 5 us", ok=overhead <= 5.0),
        row(BENCH, "housekeeper: build + store one trace (off the hot path)", statistics.median(flush_us), "us"),
    ]


def bench_connection(quick: bool) -> list[dict[str, Any]]:
    """The connection's path in process, recorder on vs off, GC on (see the docstring)."""
    from execapp import conf, history
    from execapp.connection import Connection
    from execapp.engine import Engine
    from execapp.outbox_budget import OutboxBudget
    from execapp.protocol import Limits

    n, reps = (5_000, 3) if quick else (20_000, 7)

    class Admission:
        draining = False

        def begin_event(self) -> bool:
            return True

        def end_event(self) -> None:
            pass

    engine = Engine(pool_enabled=True)
    m = engine.on_command("ping", lambda ctx: "pong")
    m.profile.restore("demoted", [0.00001] * m.profile.window)
    recorder = history.Recorder(SimpleNamespace(engine=engine, id="bench"))
    frames = [f'{{"type":"message","id":"e{i}","text":"/ping"}}' for i in range(n)]
    flush_s: list[float] = []

    async def one_run(on: bool) -> float:
        written = [0]
        done = asyncio.Event()

        async def send(text: str) -> None:
            written[0] += 1
            if written[0] == 2 * n:  # every reply and done
                done.set()

        # With its owner's outbox budget, as execapp.consumers builds it (execapp.outbox_budget).
        conn = Connection(engine, Admission(), Limits(65536, 1000), send, owner="tenant:bench",
                          outbox_budget=OutboxBudget(conf.DEFAULTS["OWNER_OUTBOX_BYTES"]))
        if on:
            recorder.start()
        flushed = 0.0
        started = time.process_time()
        for i, frame in enumerate(frames):
            await conn.receive(frame)
            if i % 50 == 49:
                await asyncio.sleep(0)  # the writer task runs, as between a socket's reads
            if on and i % 2500 == 2499:
                f0 = time.process_time()
                recorder.flush()
                flushed += time.process_time() - f0
        await done.wait()
        if on:
            f0 = time.process_time()
            recorder.flush()
            flushed += time.process_time() - f0
            flush_s.append(flushed)
        elapsed = time.process_time() - started
        history._recorder = None
        conn.close()
        return elapsed / n * 1e6

    def case(on: bool) -> Callable[[], float]:
        return lambda: asyncio.run(one_run(on))

    results = interleaved({"off": case(False), "on": case(True)}, reps)
    off_us, on_us = results["off"], results["on"]
    return [
        row(BENCH, "connection path in process, GC on, no recorder (baseline)", off_us, "us/event"),
        row(BENCH, "connection path in process, GC on, recorder on", on_us, "us/event", baseline="no recorder",
            ratio=on_us / off_us),
        row(BENCH, "  of which the recorder's flushes (housekeeper)", statistics.median(flush_s) / n * 1e6,
            "us/event"),
    ]


def bench_ws(quick: bool) -> list[dict[str, Any]]:
    """/ping closed-loop throughput with and without the recorder (see the docstring)."""
    import bench_ws as ws

    seconds, reps = (2.0, 2) if quick else (4.0, 6)  # 6: single runs move by 2x on this machine
    workdir = tempfile.mkdtemp(prefix="bench-history-")
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{workdir}/db.sqlite3", "REDIS_URL": "",
           "BENCH_DIR": workdir, "PYTHONUNBUFFERED": "1",
           "EXECAPP_LOG_LEVEL": "WARNING", "DJANGO_SETTINGS_MODULE": "config.settings"}
    ws._manage(env, "migrate", "--noinput")
    ws._manage(env, "loadplugins")
    token = ws._manage(env, "create_token", "bench").strip().splitlines()[-1]
    servers = {"on": ws.Server("uvicorn", {**env, "BENCH_DIR": workdir}),
               "off": ws.Server("uvicorn", {**env, "BENCH_NO_HISTORY": "1"})}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    try:
        for server in servers.values():
            asyncio.run(ws._warm(server.url("/ws/events/"), token))
        for rep in range(reps):
            # Alternate which server is loaded first: the first of a pair loses ~0.03x on its own.
            for name in (("on", "off") if rep % 2 == 0 else ("off", "on")):
                server = servers[name]
                cpu0 = server.cpu_seconds()
                r = ws._load({"mode": "closed", "url": server.url("/ws/events/"), "token": token, "text": "/ping",
                              "connections": ws.CONNECTIONS, "seconds": seconds})
                r["rate"] = r["events"] / r["seconds"]
                r["cpu_us"] = (server.cpu_seconds() - cpu0) / r["events"] * 1e6
                runs[name].append(r)
                print(f"    history {name}: {r['rate']:.0f} events/s p99 {r['p99_ms']:.2f} ms cpu "
                      f"{r['cpu_us']:.0f} us/event", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("rate", "p99_ms", "cpu_us")}
           for name, rs in runs.items()}
    # The ratio is the median of each repetition's pair (run back to back: a burst of load from the
    # neighbours hits both alike), not the ratio of the medians.
    ratio = statistics.median(on["rate"] / off["rate"] for on, off in zip(runs["on"], runs["off"]))
    label = f"{ws.CONNECTIONS} conns closed loop, uvicorn"
    return [
        row(BENCH, f"/ping events/s without the recorder (baseline, {label})", med["off"]["rate"], "events/s"),
        row(BENCH, f"/ping events/s with the recorder ({label})", med["on"]["rate"], "events/s",
            baseline="without", ratio=ratio, target=">= 0.9x", ok=ratio >= 0.9),
        row(BENCH, "/ping server CPU per event without the recorder (baseline)", med["off"]["cpu_us"], "us"),
        row(BENCH, "/ping server CPU per event with the recorder", med["on"]["cpu_us"], "us", baseline="without",
            ratio=med["on"]["cpu_us"] / med["off"]["cpu_us"]),
        row(BENCH, "/ping latency p99 with the recorder", med["on"]["p99_ms"], "ms", baseline="without",
            ratio=med["on"]["p99_ms"] / med["off"]["p99_ms"]),
    ]


def run(quick: bool) -> list[dict[str, Any]]:
    """The bench/run.py entry point."""
    setup_django()
    return bench_inline(quick) + bench_connection(quick) + bench_ws(quick)


if __name__ == "__main__":
    from bench.run import main

    sys.exit(main(["--only", "history", *sys.argv[1:]]))
