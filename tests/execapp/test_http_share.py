"""Each client network's HTTP requests run a few at once and within a share of the worker (execapp/http_share.py).

Measured before: 50 keep-alive connections from one address asking for /admin/login/ took a
bystander WebSocket tenant's /ping from p50 0.6 ms / p99 4.3 ms to p50 14 ms / p99 589 ms.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from execapp import http_share
from execapp.loop_share import LoopShare


def _scope(address: str = "198.51.100.7", path: str = "/admin/login/") -> dict[str, Any]:
    return {"type": "http", "path": path, "headers": [], "client": (address, 50000)}


async def _request(app: Any, scope: dict[str, Any]) -> tuple[int, dict[bytes, bytes], bytes]:
    """(status, headers, body) of one request without a body through ``app``."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


def _counting_app(running: list[int], seen: list[int], hold: float) -> Any:
    """A view that takes ``hold`` seconds (off the loop, as Django's sync thread), counting those running."""

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        running[0] += 1
        seen.append(running[0])
        await asyncio.sleep(hold)
        running[0] -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    return app


async def test_a_network_s_requests_run_a_few_at_once_the_rest_wait_their_turn_or_get_429(settings: Any) -> None:
    settings.EXECAPP = {"HTTP_REQUESTS_PER_NETWORK": 2}
    running, seen = [0], []
    app = http_share.HttpShare(_counting_app(running, seen, 0.01))
    waiting_room = 2 + http_share.QUEUE_FACTOR * 2
    answers = await asyncio.wait_for(asyncio.gather(*(_request(app, _scope()) for _ in range(waiting_room + 3))), 30)
    statuses = [a[0] for a in answers]
    # Two at a time; those that fit in the waiting room ran in turn; the last three were refused at once.
    assert max(seen) == 2, seen
    assert statuses.count(200) == waiting_room and statuses.count(429) == 3, statuses
    refused = next(a for a in answers if a[0] == 429)
    assert refused[1][b"retry-after"] == b"1" and b"HTTP_REQUESTS_PER_NETWORK" in refused[2], refused
    # Closed after it: a client asking again at once on its keep-alive connection made thousands of 429s a second.
    assert refused[1][b"connection"] == b"close"
    # Another network is not held by the first one's queue.
    other = _request(app, _scope("203.0.113.9"))
    assert (await asyncio.wait_for(other, 5))[0] == 200


def _blocking_app(hold: float) -> Any:
    """A view that holds the worker ``hold`` seconds (time.sleep: the GIL, as a sync view's work)."""

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await receive()
        time.sleep(hold)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    return app


@pytest.mark.parametrize("another_owner_active", [False, True])
async def test_past_its_share_a_network_waits_while_another_owner_is_active(
        settings: Any, monkeypatch: pytest.MonkeyPatch, another_owner_active: bool) -> None:
    settings.EXECAPP = {"HTTP_SHARE_PER_NETWORK": 0.25}
    monkeypatch.setattr(http_share, "MAX_WAIT_SECONDS", 0.0)  # any wait is refused: no timing in the test
    app = http_share.HttpShare(_blocking_app(0.4))  # more than the network's bank (0.25 s)
    if another_owner_active:  # a WebSocket tenant's frames on the same worker
        tenant = LoopShare(0.25, group=app._own_group, owner="tenant")
        tenant.spend_since(time.monotonic())
    assert (await _request(app, _scope()))[0] == 200
    if another_owner_active:
        tenant.spend_since(time.monotonic())
    status, headers, body = await _request(app, _scope())
    if another_owner_active:
        assert status == 429 and b"HTTP_SHARE_PER_NETWORK" in body, (status, body)
        assert int(headers[b"retry-after"]) >= 1
        # The probe is charged, never held: a load balancer behind the same address still sees the worker.
        assert (await _request(app, _scope(path="/healthz")))[0] == 200
    else:  # alone on the worker: held by nothing (an admin's heavy page, a single-tenant deployment)
        assert status == 200


def test_the_http_app_is_wrapped_and_the_checks_refuse_bad_values(settings: Any) -> None:
    from config.asgi import application
    from execapp.checks import check_execapp_settings

    assert isinstance(application.application_mapping["http"].app, http_share.HttpShare)
    settings.EXECAPP = {"HTTP_SHARE_PER_NETWORK": 0, "HTTP_REQUESTS_PER_NETWORK": -1}
    ids = {e.id for e in check_execapp_settings() if "PER_NETWORK" in e.msg}
    assert ids == {"execapp.E140", "execapp.E141"}, ids


async def test_every_network_together_is_held_to_the_worker_s_http_share(settings: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # One client with many addresses is many networks, each within its own share: together they took
    # a bystander's /ping p99 to 70 ms (50 addresses on loopback). All of HTTP has a share too.
    settings.EXECAPP = {"HTTP_SHARE_PER_NETWORK": 1.0, "HTTP_SHARE_PER_WORKER": 0.25}
    monkeypatch.setattr(http_share, "MAX_WAIT_SECONDS", 0.0)
    app = http_share.HttpShare(_blocking_app(0.4))
    tenant = LoopShare(0.25, group=app._own_group, owner="tenant")
    tenant.spend_since(time.monotonic())
    assert (await _request(app, _scope("198.51.100.1")))[0] == 200
    tenant.spend_since(time.monotonic())
    status, _, body = await _request(app, _scope("198.51.100.2"))  # another network, its own share untouched
    assert status == 429 and b"HTTP_SHARE_PER_WORKER" in body, (status, body)
