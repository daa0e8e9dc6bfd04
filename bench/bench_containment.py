"""Containment under attack: /ping latency on other connections while runaway plugins are hit (issue 9).

One supervised worker (``python -m execapp.serve --workers 1``, SQLite, in-memory layer) serves
the bundled plugins and the hostile ones of tests/hostile_plugins/ (each with a 1 s budget).
Five "victim" connections each send ``/ping`` (the bundled Lua plugin, inline once proven fast),
wait for its ``done``, pause 20 ms, and record the wait. Two runs, alternated, medians over reps:

- baseline: the victims alone;
- attack: the victims plus two attacker connections that cycle through every runaway (Lua C
  calls that escape the count hook, JS job queues that never empty, host-call, KV and log
  floods, a WASM busy loop, and a benign Lua trim proven fast on small input and then sent
  60 KB of spaces), each attacker awaiting each runaway's ``done``.

Rows: victim /ping p50, p99 and max wait in each run, and the attack/baseline p99 ratio. Target:
no /ping waits more than 250 ms behind a misbehaving handler (the max of the attack run).

Run alone: ``python bench/run.py --only containment`` (``--quick`` for a short run).
"""
from __future__ import annotations

import asyncio
import json
import os
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

from bench.bench_ws import Server, _manage  # noqa: E402
from bench.common import median, percentile, row  # noqa: E402

BENCH = "containment"
VICTIMS = 5
ATTACKERS = 2
HOSTILE_DIR = ROOT / "tests" / "hostile_plugins"
#: Every runaway an attacker cycles through (the trim attack is added after its warm-up).
RUNAWAYS = ["/lrep", "/lpat", "/kvflood", "/logflood", "/denied", "/jsasync", "/jsloop", "/jshost", "/wloop"]
TRIM_ATTACK = "/trim " + " " * 60_000 + "x"
TARGET_MS = 250.0


async def _event(ws: Any, text: str, event_id: str) -> tuple[list[dict], float]:
    started = time.perf_counter()
    await ws.send(json.dumps({"id": event_id, "text": text}))
    frames = []
    while True:
        frame = json.loads(await ws.recv())
        if frame.get("id") != event_id:
            continue
        frames.append(frame)
        if frame["type"] == "done":
            return frames, time.perf_counter() - started


async def _victim(url: str, token: str, stop_at: float, waits: list[float], n: int) -> None:
    from websockets.asyncio.client import connect

    async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, compression=None) as ws:
        i = 0
        while time.perf_counter() < stop_at:
            i += 1
            _, took = await _event(ws, "/ping", f"v{n}-{i}")
            waits.append(took)
            await asyncio.sleep(0.02)


async def _attacker(url: str, token: str, stop_at: float, n: int, counts: dict[str, int]) -> None:
    from websockets.asyncio.client import connect

    async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, compression=None,
                       max_size=2 ** 22) as ws:
        i = 0
        while time.perf_counter() < stop_at:
            for text in RUNAWAYS + [TRIM_ATTACK]:
                if time.perf_counter() >= stop_at:
                    break
                i += 1
                frames, _ = await _event(ws, text, f"a{n}-{i}")
                for f in frames:
                    if f["type"] == "error":
                        counts[f["code"]] = counts.get(f["code"], 0) + 1


async def _warm(url: str, token: str) -> None:
    """Prove /ping and the trim handler fast on small inputs (they run inline afterwards)."""
    from websockets.asyncio.client import connect

    async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}, compression=None) as ws:
        for i in range(60):
            await _event(ws, "/ping", f"w-ping-{i}")
            await _event(ws, "/trim  hello ", f"w-trim-{i}")


async def _run(url: str, token: str, seconds: float, attack: bool) -> dict[str, Any]:
    await _warm(url, token)
    waits: list[float] = []
    counts: dict[str, int] = {}
    stop_at = time.perf_counter() + seconds
    tasks = [_victim(url, token, stop_at, waits, n) for n in range(VICTIMS)]
    if attack:
        tasks += [_attacker(url, token, stop_at, n, counts) for n in range(ATTACKERS)]
    await asyncio.gather(*tasks)
    return {"p50": percentile(waits, 0.5) * 1000, "p99": percentile(waits, 0.99) * 1000,
            "max": max(waits) * 1000, "n": len(waits), "errors": counts}


def run(quick: bool) -> list[dict[str, Any]]:
    """Start the server, run baseline and attack alternately, return the rows."""
    bench_dir = tempfile.mkdtemp(prefix="execapp-bench-containment-")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "BENCH_DIR": bench_dir,
           "DATABASE_URL": f"sqlite:///{bench_dir}/db.sqlite3", "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)
    _manage(env, "migrate", "--noinput")
    _manage(env, "loadplugins")
    _manage(env, "loadplugins", "--dir", str(HOSTILE_DIR))
    token = _manage(env, "create_token", "bench").strip().splitlines()[-1]
    server = Server("uvicorn", env)
    url = server.url("/ws/events/")
    seconds, reps = (4.0, 1) if quick else (10.0, 3)
    base: list[dict[str, Any]] = []
    hit: list[dict[str, Any]] = []
    try:
        for _ in range(reps):
            base.append(asyncio.run(_run(url, token, seconds, attack=False)))
            hit.append(asyncio.run(_run(url, token, seconds, attack=True)))
    finally:
        server.stop()
    errors: dict[str, int] = {}
    for r in hit:
        for code, n in r["errors"].items():
            errors[code] = errors.get(code, 0) + n
    print(f"  containment: runaway outcomes {errors}; server log {bench_dir}/uvicorn.log", file=sys.stderr)
    b50, b99, bmax = (median(r[k] for r in base) for k in ("p50", "p99", "max"))
    a50, a99, amax = (median(r[k] for r in hit) for k in ("p50", "p99", "max"))
    worst = max(r["max"] for r in hit)
    return [
        row(BENCH, "victim /ping p50, no runaways", b50, "ms"),
        row(BENCH, "victim /ping p99, no runaways", b99, "ms"),
        row(BENCH, "victim /ping max, no runaways", bmax, "ms"),
        row(BENCH, "victim /ping p50, runaways hit", a50, "ms", baseline="p50 no runaways", ratio=a50 / b50),
        row(BENCH, "victim /ping p99, runaways hit", a99, "ms", baseline="p99 no runaways", ratio=a99 / b99),
        row(BENCH, "victim /ping max (worst rep), runaways hit", worst, "ms", baseline="max no runaways",
            ratio=worst / bmax, target=f"<= {TARGET_MS:g} ms", ok=worst <= TARGET_MS),
        row(BENCH, "runaways ended (all reps)", float(sum(errors.values())), "errors",
            baseline=", ".join(f"{k} {v}" for k, v in sorted(errors.items()))[:80]),
    ]


if __name__ == "__main__":
    for r in run("--quick" in sys.argv):
        print(r)
