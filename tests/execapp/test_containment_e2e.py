"""Containment end to end: hostile plugins on a real `python -m execapp.serve` worker (issue 9).

Every runaway of tests/hostile_plugins/ (C calls that escape the Lua count hook, a JS job queue
that never empties, host-call and KV/log floods, a trickling HTTP server, a WASM busy loop) must
end with one error frame and one `done` within twice its 1 s budget plus 0.5 s, while a client
on another connection of the same worker keeps getting `/ping` answered. The bounds here are
generous liveness bounds (the 250 ms target is measured by bench/bench_containment.py).
"""
from __future__ import annotations

import asyncio
import http.server
import json
import socketserver
import threading
import time
import urllib.request
from typing import Any, Iterator

import pytest
from websockets.asyncio.client import connect

from tests.conftest import ROOT, ServerProcess, manage, wait_until, wait_until_async

pytestmark = pytest.mark.e2e

HOSTILE_DIR = ROOT / "tests" / "hostile_plugins"
BUDGET = 1.0
BOUND = 2 * BUDGET + 0.5
#: A /ping on another connection must be answered within this while a runaway runs (liveness:
#: far above the 250 ms target, so a busy CI machine cannot flake it, far below a stalled loop).
PING_BOUND = 1.5


class Trickle(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """An allowlisted HTTP server that sends its body one byte every 100 ms (for 20 s)."""

    daemon_threads = True


class _TrickleHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", "200")
        self.end_headers()
        try:
            for _ in range(200):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)  # the point: a body that trickles
        except OSError:  # the plugin gave up: expected
            pass

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def trickle_url() -> Iterator[str]:
    server = Trickle(("127.0.0.1", 0), _TrickleHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/slow"
    server.shutdown()


class Hostile(ServerProcess):
    """One supervised worker serving the bundled and the hostile plugins."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(["execapp.serve", "--workers", "1", "--log-level", "warning", "--no-access-log"], env,
                         "hostile")
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws/events/"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hostile, str]]:
    env = {"DATABASE_URL": f"sqlite:///{tmp_path_factory.mktemp('hostile') / 'db.sqlite3'}"}
    for args in (("migrate", "--noinput"), ("loadplugins",), ("loadplugins", "--dir", str(HOSTILE_DIR))):
        result = manage(*args, env=env)
        assert result.returncode == 0, result.stderr + result.stdout
    result = manage("create_token", "attacker", env=env)
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip().splitlines()[-1]
    server = Hostile(env)
    try:
        assert wait_until(server.healthy, 60), server.log()
        yield server, token
    finally:
        server.stop()


async def _event(ws: Any, text: str, event_id: str) -> tuple[list[dict], float]:
    """Send one event; its frames up to its done, and how long that took."""
    started = time.monotonic()
    await ws.send(json.dumps({"id": event_id, "text": text}))
    frames = []
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), BOUND + 10))
        if frame.get("id") != event_id:
            continue
        frames.append(frame)
        if frame["type"] == "done":
            return frames, time.monotonic() - started


async def _pinger(server: Hostile, token: str, stop: asyncio.Event, waits: list[float]) -> None:
    """Another connection of the same worker: /ping every 50 ms, recording each answer's wait."""
    async with connect(server.ws_url, additional_headers={"Authorization": f"Bearer {token}"}) as ws:
        n = 0
        while not stop.is_set():
            n += 1
            _, took = await _event(ws, "/ping", f"ping-{n}")
            waits.append(took)
            await asyncio.sleep(0.05)  # the pinger's pace (the point: a steady probe of the loop)


async def _attack(server: Hostile, token: str, text: str, warmup: str | None = None) -> tuple[list[dict], float,
                                                                                               list[float]]:
    stop = asyncio.Event()
    waits: list[float] = []
    pinger = asyncio.create_task(_pinger(server, token, stop, waits))
    try:
        async with connect(server.ws_url, additional_headers={"Authorization": f"Bearer {token}"},
                           max_size=2 ** 22) as ws:
            if warmup is not None:
                # Prove the handler fast on small inputs until it runs inline on the loop.
                for i in range(200):
                    frames, _ = await _event(ws, warmup, f"warm-{i}")
                    if any(f.get("exec") == "sync" for f in frames):
                        break
                else:
                    pytest.fail(f"{warmup!r} never ran inline: {frames}")
            assert await wait_until_async(lambda: waits), "the pinger never got an answer"  # it is running
            frames, took = await _event(ws, text, "attack")
    finally:
        stop.set()
        await asyncio.wait_for(pinger, 30)
    return frames, took, waits


#: (command, codes its error frame may carry). Each runaway ends in exactly one error + one done;
#: an empty set: the guard bounds the work itself and the handler answers (string.rep of an empty
#: string is the empty string, computed without looping 1e12 times).
RUNAWAYS = [
    ("/lrep", set()),
    ("/lpat", {"timeout"}),
    ("/kvflood", {"quota_kv_writes", "timeout"}),  # the quota, unless a slow disk runs the budget out first
    ("/logflood", {"timeout"}),
    ("/denied", {"timeout"}),
    ("/jshost", {"timeout", "quota_kv_writes"}),
    ("/jsasync", {"timeout"}),
    ("/jsloop", {"timeout"}),
    ("/wloop", {"timeout"}),
]


@pytest.mark.parametrize("command, codes", RUNAWAYS, ids=[c for c, _ in RUNAWAYS])
async def test_runaway_ends_within_its_budget_and_the_loop_keeps_serving(hostile: tuple[Hostile, str], command: str,
                                                                         codes: set[str]) -> None:
    server, token = hostile
    frames, took, waits = await _attack(server, token, command)
    errors = [f for f in frames if f["type"] == "error"]
    assert [f["type"] for f in frames].count("done") == 1, frames
    if codes:
        assert len(errors) == 1 and errors[0]["code"] in codes, frames
    else:
        assert not errors and [f["type"] for f in frames] == ["reply", "done"], frames
    assert took <= BOUND, f"{command} took {took:.2f} s (bound {BOUND} s): {frames}"
    assert waits and max(waits) <= PING_BOUND, f"/ping waited up to {max(waits or [0]):.2f} s during {command}"


async def test_trickling_http_body_ends_within_the_budget(hostile: tuple[Hostile, str], trickle_url: str) -> None:
    server, token = hostile
    frames, took, waits = await _attack(server, token, f"/fetch {trickle_url}")
    assert [f["type"] for f in frames] == ["error", "done"] and frames[0]["code"] == "timeout", frames
    assert took <= BOUND, f"http_get took {took:.2f} s (bound {BOUND} s)"
    assert max(waits) <= PING_BOUND


async def test_a_large_input_never_reaches_the_loop(hostile: tuple[Hostile, str]) -> None:
    """The trim handler earns inline on short input; 60 KB of spaces goes to the pool before it runs."""
    server, token = hostile
    frames, took, waits = await _attack(server, token, "/trim " + " " * 60_000 + "x", warmup="/trim  hi ")
    assert [f["type"] for f in frames].count("done") == 1, frames
    assert all(f.get("exec") in (None, "pool") for f in frames if f["type"] != "done"), frames
    assert took <= BOUND, f"trim took {took:.2f} s (bound {BOUND} s): {frames}"
    assert max(waits) <= PING_BOUND, f"/ping waited up to {max(waits):.2f} s behind the trim"
