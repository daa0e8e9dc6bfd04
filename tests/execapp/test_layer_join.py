"""A session join waits at most JOIN_TIMEOUT_SECONDS for a Redis that hangs (execapp/layer_watch.py):
the connection reads none of its frames meanwhile."""
from __future__ import annotations

import asyncio
import time

import pytest

from execapp.layer_watch import JOIN_TIMEOUT_SECONDS, LayerWatch
from execapp.redis_layer import RedisChannelLayer
from tests.conftest import wait_until_async

from .test_resilience import WAIT, RedisServer, redis_layer_settings, redis_server  # noqa: F401

pytestmark = pytest.mark.redis

PAUSE_MS = 5000


async def test_a_join_on_a_hung_redis_gives_up_at_its_deadline_and_is_made_once_it_answers(
        redis_server: RedisServer) -> None:  # noqa: F811
    # Measured on a 3-worker server whose Redis was paused (CLIENT PAUSE, as a partition): a
    # connection opened with ?session=, and one whose event named a new session, waited 15 s (the
    # socket timeout) before any of their events, those without a session included, was answered.
    layer = RedisChannelLayer(**redis_layer_settings(redis_server.url, "join")["default"]["CONFIG"])
    watch = LayerWatch(layer, "test", interval=0.1)
    first, second, third = [await layer.new_channel() for _ in range(3)]
    try:
        await watch.add("before", first)
        assert await wait_until_async(lambda: watch.marked, WAIT)
        redis_server.client().execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL")  # our own redis-server
        paused = time.monotonic()
        started = time.monotonic()
        await watch.add("during", second)
        assert time.monotonic() - started < JOIN_TIMEOUT_SECONDS + 1.0, "the join waited out the hung Redis"
        assert not watch.up and "during" in watch.last_error
        started = time.monotonic()
        await watch.add("later", third)  # the layer is known down: remembered, no wait
        assert time.monotonic() - started < 0.5
        assert time.monotonic() - paused < PAUSE_MS / 1000, "the pause ended before the joins were made"
        started = time.monotonic()
        await watch.discard("before", first)  # a closing connection leaves without waiting either
        assert time.monotonic() - started < 0.5
        # Once Redis answers, the checker's re-add makes both memberships.
        assert await wait_until_async(lambda: watch.up and watch.restores >= 1, WAIT), watch.stats()
        for group, channel in (("during", second), ("later", third)):
            await layer.group_send(group, {"type": "x", "group": group})
            assert (await asyncio.wait_for(layer.receive(channel), 3))["group"] == group
    finally:
        await watch.stop()
        await layer.close_pools()


async def test_a_leave_on_a_hung_redis_gives_up_at_its_deadline(redis_server: RedisServer) -> None:  # noqa: F811
    # A closing connection leaves its sessions one by one: up to 32 x 15 s (the socket timeout).
    layer = RedisChannelLayer(**redis_layer_settings(redis_server.url, "leave")["default"]["CONFIG"])
    watch = LayerWatch(layer, "test", interval=0.1)
    channel = await layer.new_channel()
    try:
        for n in range(3):
            await watch.add(f"room-{n}", channel)
        redis_server.client().execute_command("CLIENT", "PAUSE", PAUSE_MS, "ALL")  # our own redis-server
        started = time.monotonic()
        for n in range(3):
            await watch.discard(f"room-{n}", channel)
        assert time.monotonic() - started < JOIN_TIMEOUT_SECONDS + 1.0, "the leaves waited out the hung Redis"
        assert watch.memberships() == 0 and not watch.up
    finally:
        await watch.stop()
        await layer.close_pools()
