"""Handshakes presenting a token already being looked up share that lookup (execapp.auth): one tenant's
burst of reconnects no longer takes every one of the worker's MAX_TOKEN_LOOKUPS, which got other
tenants' handshakes closed 1013 "checking too many credentials" unjudged."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from channels.testing import WebsocketCommunicator

from execapp.routing import websocket_application

from .ws_fixtures import channel_layer, held_token_lookups, wait_for, ws_worker  # noqa: F401

pytestmark = pytest.mark.usefixtures("channel_layer", "ws_worker")


@pytest.fixture
def tokens(transactional_db: Any) -> tuple[str, str]:
    from execapp.models import ApiToken

    return ApiToken.issue("flooder")[1], ApiToken.issue("victim")[1]


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_one_tenant_s_burst_of_handshakes_is_one_lookup_and_another_tenant_is_still_judged(
        tokens: tuple[str, str], settings: Any, monkeypatch: Any) -> None:
    from execapp import auth

    flooder, victim = tokens
    slow_db, lookups = held_token_lookups(settings, monkeypatch)  # a database that answers when told
    burst = [WebsocketCommunicator(websocket_application, f"/ws/events/?token={flooder}") for _ in range(6)]
    for comm in burst:
        await comm.send_input({"type": "websocket.connect"})
    await wait_for(lambda: len(lookups) == 1)
    await asyncio.sleep(0.05)
    assert lookups == [flooder]  # six handshakes, one lookup
    other = WebsocketCommunicator(websocket_application, "/ws/events/",
                                  headers=[(b"authorization", f"Bearer {victim}".encode())])
    await other.send_input({"type": "websocket.connect"})
    await wait_for(lambda: len(lookups) == 2)  # judged, not closed 1013 unjudged
    # The first handshake of the burst goes away: the others still get the lookup's answer.
    await burst[0].disconnect()
    slow_db.set()
    for comm in [*burst[1:], other]:
        assert (await comm.receive_output(5))["type"] == "websocket.accept"
        await comm.disconnect()
    assert auth._lookups[0] == 0 and auth._token_lookups == {}


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
async def test_a_shared_lookup_that_fails_refuses_each_of_its_handshakes_try_again_later(
        tokens: tuple[str, str], monkeypatch: Any) -> None:
    from django.db import OperationalError

    from execapp import auth

    flooder, _ = tokens
    gate = asyncio.Event()

    async def down(raw: str) -> Any:
        await gate.wait()
        raise OperationalError("connection refused")

    monkeypatch.setattr(auth, "_authenticate", down)
    comms = [WebsocketCommunicator(websocket_application, f"/ws/events/?token={flooder}") for _ in range(3)]
    for comm in comms:
        await comm.send_input({"type": "websocket.connect"})
    await wait_for(lambda: len(auth._token_lookups) == 1)
    gate.set()
    for comm in comms:
        assert (await comm.receive_output(5))["type"] == "websocket.accept"
        closed = await comm.receive_output(5)
        assert closed["code"] == 1013 and "database unavailable" in closed["reason"], closed
    assert auth._lookups[0] == 0 and auth._token_lookups == {}
