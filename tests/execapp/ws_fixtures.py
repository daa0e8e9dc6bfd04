"""Fixtures and helpers shared by the WebSocket tests (imported by name into each test module)."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Iterator

import pytest
from channels.testing import WebsocketCommunicator

from execapp import worker as worker_module
from execapp.consumers import EventConsumer
from tests.conftest import REDIS_TEST_URL, redis_test_prefix, require_service, wait_until_async

from . import ws_handlers

TIMEOUT = 5.0


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def channel_layer(request: pytest.FixtureRequest, settings: Any) -> str:
    """Run the test once over the in-memory channel layer and once over channels_redis (production's
    subclass, execapp/redis_layer.py)."""
    if request.param == "redis":
        url = require_service("Redis", REDIS_TEST_URL)
        # A prefix of this test alone (inside the run's): empty channels and groups, no flushdb.
        settings.CHANNEL_LAYERS = {"default": {"BACKEND": "execapp.redis_layer.RedisChannelLayer",
                                               "CONFIG": {"hosts": [{"address": url, "socket_timeout": 15}],
                                                          "capacity": 1500, "expiry": 30,
                                                          "prefix": redis_test_prefix("ws")}}}
    else:
        settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    return request.param


@pytest.fixture
def ws_worker(request: pytest.FixtureRequest, settings: Any, install_worker: Any) -> Iterator[worker_module.Worker]:
    """A fresh Worker (new pool, engine and profiles) with the test commands, as the process's worker;
    indirect parametrization passes extra EXECAPP settings."""
    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "POOL_IDLE_SECONDS": 0.5, **getattr(request, "param", {})}
    worker = install_worker(worker_module.Worker("test-worker"))
    ws_handlers.register(worker.engine)
    yield worker
    ws_handlers.slow_release.set()
    worker.pool.drain(10)
    ws_handlers.slow_release.clear()


def authed(scope_extra: dict | None = None) -> Any:
    """EventConsumer as if the auth middleware had let a token client through (auth is tested apart)."""
    app = EventConsumer.as_asgi()

    async def wrapped(scope: dict, receive: Any, send: Any) -> None:
        return await app({**scope, "execapp_auth": {"kind": "token", "name": "test"}, **(scope_extra or {})},
                         receive, send)

    return wrapped


class Client:
    """A WebsocketCommunicator with frame helpers."""

    def __init__(self, path: str = "/ws/events/", app: Any = None, headers: list | None = None) -> None:
        self.comm = WebsocketCommunicator(app or authed(), path, headers=headers)

    async def __aenter__(self) -> "Client":
        connected, code = await self.comm.connect(timeout=TIMEOUT)
        assert connected, f"refused with close code {code}"
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.comm.disconnect(timeout=TIMEOUT)

    async def send(self, frame: Any) -> None:
        if isinstance(frame, bytes):
            await self.comm.send_to(bytes_data=frame)
        else:
            await self.comm.send_to(text_data=frame if isinstance(frame, str) else json.dumps(frame))

    async def recv(self, timeout: float = TIMEOUT) -> dict:
        return json.loads(await self.comm.receive_from(timeout))

    async def until_done(self, event_id: str, timeout: float = TIMEOUT) -> list[dict]:
        """Frames up to and including the done of ``event_id``."""
        frames = []
        while True:
            frame = await self.recv(timeout)
            frames.append(frame)
            if frame["type"] == "done" and frame["id"] == event_id:
                return frames

    async def nothing(self, wait: float = 0.2) -> bool:
        return await self.comm.receive_nothing(wait)


async def wait_for(predicate: Any, timeout: float = TIMEOUT) -> None:
    """Poll ``predicate()`` on the loop until it is true (never a timing assertion: a guard)."""
    assert await wait_until_async(predicate, timeout, interval=0.005), "condition not reached in time"


def demote(worker: worker_module.Worker, matcher: str) -> None:
    """Make ``matcher`` proven-fast, so it runs inline on the loop."""
    worker.engine.profile_for(matcher).restore("demoted", [0.0001] * 32)


async def aiter_frames(client: Client, n: int) -> AsyncIterator[dict]:
    for _ in range(n):
        yield await client.recv()


class Admission:
    """A Worker's admission (begin_event/end_event) for a Connection built without a Worker: it
    counts what it admitted and ended, refuses while ``draining``, and has an ``id`` like a Worker."""

    id = "test-worker"

    def __init__(self) -> None:
        self.draining = False
        self.begun = self.ended = 0

    def begin_event(self) -> bool:
        if self.draining:
            return False
        self.begun += 1
        return True

    def end_event(self) -> None:
        self.ended += 1


def held_token_lookups(settings: Any, monkeypatch: pytest.MonkeyPatch,
                       max_lookups: int = 2) -> tuple[asyncio.Event, list[str]]:
    """MAX_TOKEN_LOOKUPS set to ``max_lookups`` and a database that answers a token lookup only once
    the returned event is set: ``(answer, raw tokens looked up so far)``."""
    from execapp import auth

    settings.EXECAPP = {**getattr(settings, "EXECAPP", {}), "MAX_TOKEN_LOOKUPS": max_lookups}
    answer = asyncio.Event()
    lookups: list[str] = []
    real = auth._authenticate

    async def held(raw: str) -> Any:
        lookups.append(raw)
        await answer.wait()
        return await real(raw)

    monkeypatch.setattr(auth, "_authenticate", held)
    return answer, lookups
