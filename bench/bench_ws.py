"""WebSocket ingestion through the real server (issue 4, item 6).

One server process (``python -m execapp.serve``: uvicorn with httptools, websockets-sansio,
uvloop, permessage-deflate off; the in-memory channel layer) with the bundled plugins loaded,
serving ``bench.bench_app:application`` (config.asgi plus the bench-only bare routes). Load
comes from a separate client process (``websockets`` on uvloop) over loopback, N connections.

(a) closed loop, 10 connections, each sending ``/ping`` and waiting for its ``done``: events/s
    and latency p50/p99 of the engine path (``/ws/events/``, the bundled Lua ``ping`` plugin,
    demoted to inline after warm-up) against a bare Channels consumer in the same server that
    answers every frame with the same two frames without the engine (``/ws/bench/bare/``).
    Runs alternate bare/direct/engine; medians. Targets: engine >= 0.75x the bare throughput
    (issue 4) and >= 0.8x the "direct" bare consumer, which has EventConsumer's routing shortcut
    (issue 14). Also the server CPU per event (from /proc), which does not depend on the client
    keeping up.
(b) mixed open loop: a steady rate of events over 10 connections, every 10th ``/slow 200``
    (the bundled Lua ``slow`` plugin, pooled), the rest ``/ping``: ``/ping`` latency p50/p99.
    Target: p99 <= 5 ms.
(c) full runs only: (a) again with daphne serving the same application, to justify uvicorn.

Run alone: ``python bench/run.py --only ws`` (``--quick`` for a short run).
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench.common import row  # noqa: E402

BENCH = "websocket"
CONNECTIONS = 10
#: The served application: config.asgi with the baselines in front (bench/bench_app.py).
APP = "bench.bench_app:application"


# -- the server -----------------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _manage(env: dict[str, str], *args: str) -> str:
    result = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=180)
    if result.returncode:
        raise RuntimeError(f"manage.py {' '.join(args)} failed: {result.stderr[-2000:]}")
    return result.stdout


class Server:
    """A server subprocess serving APP: config.asgi with the bench routes."""

    def __init__(self, kind: str, env: dict[str, str]) -> None:
        self.kind = kind
        self.port = _free_port()
        self.log = open(Path(env["BENCH_DIR"]) / f"{kind}.log", "wb")
        if kind == "uvicorn":
            cmd = [sys.executable, "-m", "execapp.serve", "--app", APP, "--host", "127.0.0.1", "--port",
                   str(self.port), "--workers", "1", "--log-level", "warning", "--no-access-log"]
        else:
            cmd = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "-v", "0", APP]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        import socket

        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} exited: see {self.log.name}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{kind} did not listen in 60 s") from None
                time.sleep(0.1)

    def url(self, path: str) -> str:
        return f"ws://127.0.0.1:{self.port}{path}"

    def cpu_seconds(self) -> float:
        """User + system CPU of the server process and its children so far."""
        tick = os.sysconf("SC_CLK_TCK")
        pids = {self.proc.pid}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) in pids:
                pids.add(int(stat.parent.name))
        total = 0.0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick
        return total

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(40)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# -- the load client (a separate process) ---------------------------------------------------------

def _client(spec: dict[str, Any]) -> None:
    """Entry point of the client process: runs one load and prints its result as JSON."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(_closed(spec) if spec["mode"] == "closed" else _mixed(spec))
    print(json.dumps(result))


async def _connect(spec: dict[str, Any]) -> Any:
    from websockets.asyncio.client import connect

    return await connect(spec["url"], additional_headers={"Authorization": f"Bearer {spec['token']}"},
                         compression=None, max_size=2 ** 20)


async def _closed(spec: dict[str, Any]) -> dict[str, Any]:
    conns = [await _connect(spec) for _ in range(spec["connections"])]
    frame_text = spec["text"]
    latencies: list[float] = []
    stop_at = 0.0

    async def one(ws: Any, n: int) -> int:
        count = 0
        while time.perf_counter() < stop_at:
            eid = f"{n}-{count}"
            started = time.perf_counter()
            await ws.send(f'{{"id":"{eid}","type":"message","text":"{frame_text}"}}')
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "done":
                    break
            latencies.append(time.perf_counter() - started)
            count += 1
        return count

    started = time.perf_counter()
    stop_at = started + spec["seconds"]
    counts = await asyncio.gather(*(one(ws, n) for n, ws in enumerate(conns)))
    elapsed = time.perf_counter() - started
    for ws in conns:
        await ws.close()
    latencies.sort()
    return {"events": sum(counts), "seconds": elapsed, "p50_ms": _pct(latencies, 0.5) * 1000,
            "p99_ms": _pct(latencies, 0.99) * 1000}


async def _mixed(spec: dict[str, Any]) -> dict[str, Any]:
    conns = [await _connect(spec) for _ in range(spec["connections"])]
    per_conn_interval = spec["connections"] / spec["rate"]
    fast: list[float] = []
    slow: list[float] = []
    errors: list[str] = []
    sent_total = 0

    async def one(ws: Any, n: int, start: float) -> None:
        nonlocal sent_total
        sent: dict[str, tuple[float, bool]] = {}
        count = int(spec["seconds"] / per_conn_interval)

        async def reader() -> None:
            received = 0
            while received < count:
                frame = json.loads(await ws.recv())
                if frame["type"] == "error":
                    errors.append(frame["code"])
                elif frame["type"] == "done":
                    received += 1
                    at, is_slow = sent.pop(frame["id"])
                    (slow if is_slow else fast).append(time.perf_counter() - at)

        task = asyncio.ensure_future(reader())
        # Connections are offset so the aggregate rate is steady; every slow_every-th event is slow.
        for k in range(count):
            due = start + (k + n / spec["connections"]) * per_conn_interval
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            is_slow = spec["slow_every"] > 0 and (k + n) % spec["slow_every"] == 0
            eid = f"{n}-{k}"
            sent[eid] = (time.perf_counter(), is_slow)
            await ws.send(f'{{"id":"{eid}","type":"message","text":"{"/slow 200" if is_slow else "/ping"}"}}')
            sent_total += 1
        await asyncio.wait_for(task, 30)

    start = time.perf_counter() + 0.05
    await asyncio.gather(*(one(ws, n, start) for n, ws in enumerate(conns)))
    elapsed = time.perf_counter() - start
    for ws in conns:
        await ws.close()
    fast.sort()
    slow.sort()
    return {"events": sent_total, "seconds": elapsed, "ping_p50_ms": _pct(fast, 0.5) * 1000,
            "ping_p99_ms": _pct(fast, 0.99) * 1000, "slow_p50_ms": _pct(slow, 0.5) * 1000,
            "pings": len(fast), "slows": len(slow), "errors": len(errors),
            "error_codes": sorted(set(errors))}


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _load(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--client", json.dumps(spec)], cwd=ROOT, capture_output=True,
                         text=True, timeout=spec["seconds"] + 60)
    if out.returncode:
        raise RuntimeError(f"load client failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the runs -------------------------------------------------------------------------------------

async def _warm(url: str, token: str) -> None:
    """Wait until /ping is answered by the plugin and runs inline (demoted), and /slow is pooled."""
    from websockets.asyncio.client import connect

    async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, compression=None) as ws:
        deadline = time.monotonic() + 60
        n = 0
        while time.monotonic() < deadline:
            n += 1
            await ws.send(json.dumps({"id": f"w{n}", "type": "message", "text": "/ping"}))
            frames = []
            while not frames or frames[-1]["type"] != "done":
                frames.append(json.loads(await ws.recv()))
            if frames[0].get("exec") == "sync" and n > 50:
                break
        else:
            raise RuntimeError(f"/ping never became an inline reply: {frames}")
        for n in range(3):  # /slow learns it is slow at once (one run over 2x the threshold)
            await ws.send(json.dumps({"id": f"s{n}", "type": "message", "text": "/slow 200"}))
            while json.loads(await ws.recv())["type"] != "done":
                pass


def _throughput(server: Server, token: str, seconds: float, reps: int) -> dict[str, dict[str, float]]:
    """Closed-loop /ping over the bare route and the engine route, alternating; medians."""
    paths = {"bare": "/ws/bench/bare/", "direct": "/ws/bench/direct/", "engine": "/ws/events/"}
    runs: dict[str, list[dict[str, float]]] = {case: [] for case in paths}
    for _ in range(reps):
        for case, path in paths.items():
            cpu0 = server.cpu_seconds()
            r = _load({"mode": "closed", "url": server.url(path), "token": token, "text": "/ping",
                       "connections": CONNECTIONS, "seconds": seconds})
            r["cpu_us"] = (server.cpu_seconds() - cpu0) / r["events"] * 1e6
            r["rate"] = r["events"] / r["seconds"]
            runs[case].append(r)
            print(f"    {server.kind} {case}: {r['rate']:.0f} events/s p50 {r['p50_ms']:.2f} ms "
                  f"p99 {r['p99_ms']:.2f} ms cpu {r['cpu_us']:.0f} us/event", file=sys.stderr, flush=True)
    return {case: {k: statistics.median(r[k] for r in rs) for k in ("rate", "p50_ms", "p99_ms", "cpu_us")}
            for case, rs in runs.items()}


def _a_rows(kind: str, m: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    bare, direct, eng = m["bare"], m["direct"], m["engine"]
    label = f"{kind}, {CONNECTIONS} conns closed loop"
    ratio = eng["rate"] / bare["rate"]
    target = kind == "uvicorn"
    rows = [
        row(BENCH, f"(a) bare Channels consumer /ping events/s ({label})", bare["rate"], "events/s"),
        row(BENCH, f"(a) bare consumer, direct dispatch, events/s ({kind})", direct["rate"], "events/s",
            baseline="bare consumer", ratio=direct["rate"] / bare["rate"]),
        row(BENCH, f"(a) engine /ping events/s ({label})", eng["rate"], "events/s", baseline="bare consumer",
            ratio=ratio, target=">= 0.75x" if target else "", ok=(ratio >= 0.75) if target else None),
        row(BENCH, f"(a) engine /ping events/s vs direct-dispatch bare ({kind})", eng["rate"], "events/s",
            baseline="bare, direct dispatch", ratio=eng["rate"] / direct["rate"],
            target=">= 0.8x" if target else "", ok=(eng["rate"] / direct["rate"] >= 0.8) if target else None),
    ]
    for metric, unit, what in (("p50_ms", "ms", "latency p50"), ("p99_ms", "ms", "latency p99"),
                               ("cpu_us", "us", "server CPU per event")):
        rows.append(row(BENCH, f"(a) bare {what} ({kind})", bare[metric], unit))
        rows.append(row(BENCH, f"(a) bare, direct dispatch, {what} ({kind})", direct[metric], unit))
        rows.append(row(BENCH, f"(a) engine {what} ({kind})", eng[metric], unit, baseline="bare consumer",
                        ratio=eng[metric] / bare[metric]))
    return rows


def run(quick: bool) -> list[dict[str, Any]]:
    """The bench/run.py entry point."""
    seconds, reps = (2.0, 2) if quick else (4.0, 3)
    rates = [1000] if quick else [1000, 2000]
    workdir = tempfile.mkdtemp(prefix="bench-ws-")
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{workdir}/db.sqlite3", "REDIS_URL": "",
           "BENCH_DIR": workdir, "PYTHONUNBUFFERED": "1",
           "EXECAPP_LOG_LEVEL": "WARNING", "DJANGO_SETTINGS_MODULE": "config.settings"}
    _manage(env, "migrate", "--noinput")
    _manage(env, "loadplugins")
    token = _manage(env, "create_token", "bench").strip().splitlines()[-1]
    rows: list[dict[str, Any]] = []
    kinds = ["uvicorn"] if quick else ["uvicorn", "daphne"]
    for kind in kinds:
        server = Server(kind, env)
        try:
            asyncio.run(_warm(server.url("/ws/events/"), token))
            print(f"  {kind}: closed loop ...", file=sys.stderr, flush=True)
            rows += _a_rows(kind, _throughput(server, token, seconds, reps))
            if kind != "uvicorn":
                continue
            for rate in rates:
                print(f"  {kind}: mixed at {rate} events/s ...", file=sys.stderr, flush=True)
                results: dict[int, list[dict[str, Any]]] = {10: [], 0: []}
                for _ in range(reps):  # alternate with a /ping-only control at the same rate
                    for every in (10, 0):
                        r = _load({"mode": "mixed", "url": server.url("/ws/events/"), "token": token,
                                   "connections": CONNECTIONS, "seconds": seconds * 1.5, "rate": rate,
                                   "slow_every": every})
                        results[every].append(r)
                        print(f"    {rate}/s {'10% slow' if every else 'ping only'}: ping p50 "
                              f"{r['ping_p50_ms']:.2f} p99 {r['ping_p99_ms']:.2f} ms, "
                              f"slow p50 {r['slow_p50_ms']:.0f} ms, {r['events']} events, "
                              f"errors {r['error_codes']}", file=sys.stderr, flush=True)
                mixed, control = results[10], results[0]
                p99 = statistics.median(r["ping_p99_ms"] for r in mixed)
                p99_control = statistics.median(r["ping_p99_ms"] for r in control)
                case = f"(b) /ping p99 at {rate} events/s, 10% /slow 200 ({CONNECTIONS} conns, open loop)"
                rows.append(row(BENCH, case, p99, "ms", baseline="same rate, /ping only", ratio=p99 / p99_control,
                                target="<= 5 ms" if rate == 1000 else "", ok=(p99 <= 5.0) if rate == 1000 else None))
                rows.append(row(BENCH, f"(b) /ping p99 at {rate} events/s, /ping only (control)", p99_control, "ms"))
                rows.append(row(BENCH, f"(b) /ping p50 at {rate} events/s, 10% /slow 200",
                                statistics.median(r["ping_p50_ms"] for r in mixed), "ms"))
                rows.append(row(BENCH, f"(b) /slow 200 p50 at {rate} events/s",
                                statistics.median(r["slow_p50_ms"] for r in mixed), "ms"))
                rows.append(row(BENCH, f"(b) error frames at {rate} events/s (all runs)",
                                float(sum(r["errors"] for r in mixed)), "frames"))
        finally:
            server.stop()
    if "daphne" in kinds:
        uv = next(r for r in rows if r["case"].startswith("(a) engine /ping events/s (uvicorn"))
        da = next(r for r in rows if r["case"].startswith("(a) engine /ping events/s (daphne"))
        rows.append(row(BENCH, "(c) daphne engine /ping events/s vs uvicorn", da["value"], "events/s",
                        baseline="uvicorn engine", ratio=da["value"] / uv["value"]))
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--client":
        _client(json.loads(sys.argv[2]))
    else:
        from bench.common import fmt

        for r in run("--quick" in sys.argv):
            print(f"{r['case']}: {fmt(r['value'])} {r['unit']}"
                  + (f" ({fmt(r['ratio'])}x {r['baseline']})" if r["ratio"] is not None else "")
                  + (f" target {r['target']}: {'ok' if r['ok'] else 'MISSED'}" if r["target"] else ""))
