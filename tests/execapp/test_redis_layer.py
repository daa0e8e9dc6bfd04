"""Production's channel layer (execapp/redis_layer.py): channels_redis whose per-channel buffers end
with their channel, so session members that come and go cost their worker nothing once gone."""
from __future__ import annotations

import asyncio
import weakref
from typing import Any

import pytest
from channels.layers import get_channel_layer

from execapp import consumers, redis_fair
from execapp.protocol import group_name
from execapp.redis_layer import ChannelReleased, RedisChannelLayer
from tests.conftest import REDIS_TEST_URL, redis_test_prefix, require_service

from .ws_fixtures import Client, channel_layer, wait_for, ws_worker  # noqa: F401

pytestmark = pytest.mark.redis


def _layer(capacity: int = 1500) -> RedisChannelLayer:
    url = require_service("Redis", REDIS_TEST_URL)
    return RedisChannelLayer(hosts=[{"address": url, "socket_timeout": 15}], capacity=capacity, expiry=30,
                             prefix=redis_test_prefix("layer"))


async def test_frames_that_reach_a_worker_after_their_member_left_are_not_kept() -> None:
    # A member leaves its session while frames sent to it are still on their way to its worker (a
    # busy session): channels_redis made each such member a buffer of up to 1500 frames that nobody
    # read again, for the life of the process (+72 MB after 4,200 members came and went).
    layer = _layer()
    live = await layer.new_channel()
    await layer.group_add("room", live)
    got = 0

    async def read_live() -> None:
        nonlocal got
        while True:
            await layer.receive(live)
            got += 1

    reader = asyncio.get_running_loop().create_task(read_live())
    try:
        for _ in range(100):
            gone = await layer.new_channel()
            await layer.group_add("room", gone)
            await layer.group_send("room", {"type": "session.frame", "frame": "x" * 1000})
            await layer.group_discard("room", gone)
            layer.release(gone)  # what the consumer does once its reader stopped
        await wait_for(lambda: got == 100)
        assert layer.stats()["buffers"] <= 1 and layer.stats()["live_channels"] == 1, layer.stats()
        assert layer.dropped == 100  # one frame each for the members that had left
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await layer.flush()
        await layer.close_pools()


async def test_a_receive_still_running_for_a_released_channel_ends() -> None:
    # A reader whose cancellation was lost (asyncio.wait_for of Python 3.11 inside redis-py) stayed
    # in its receive for the life of the process, pumping everyone's messages: 1 reader in 200 in a
    # scratch run, 9 in 30 s of session members coming and going on a real worker.
    layer = _layer()
    stuck, other = await layer.new_channel(), await layer.new_channel()
    receive = asyncio.get_running_loop().create_task(layer.receive(stuck))
    try:
        await asyncio.sleep(0.05)  # an absence: the receive is waiting in Redis' blocking pop
        assert not receive.done()
        layer.release(stuck)
        await layer.send(other, {"type": "wake"})  # any message to the worker wakes the blocking pop
        with pytest.raises(ChannelReleased, match="was released"):
            await asyncio.wait_for(receive, 3)
        assert (await asyncio.wait_for(layer.receive(other), 3))["type"] == "wake"
    finally:
        receive.cancel()
        await asyncio.gather(receive, return_exceptions=True)
        await layer.flush()
        await layer.close_pools()


async def test_one_owner_filling_a_workers_queue_does_not_drop_or_delay_another_owners_frames() -> None:
    # channels_redis queued every session frame for a worker in one sorted set of `capacity`
    # messages: one tenant publishing faster than the worker read kept it full, and another
    # tenant's members on that worker heard 2-3 of 855 frames in 10 s (no `lagged` frame).
    layer = _layer(capacity=50)
    flooder, other = group_name("tenant:flood", "room"), group_name("tenant:quiet", "room")
    flood_member, other_member = await layer.new_channel(), await layer.new_channel()
    await layer.group_add(flooder, flood_member)
    await layer.group_add(other, other_member)
    try:
        for n in range(200):  # four times what the worker's queue takes
            await layer.group_send(flooder, {"type": "session.frame", "n": n})
        await layer.group_send(other, {"type": "session.frame", "n": "quiet"})
        got = await asyncio.wait_for(layer.receive(other_member), 3)
        assert got["n"] == "quiet"
        # Round robin between the owners waiting: at most the flooder's first frame came before it.
        assert layer.receive_buffer[flood_member].qsize() <= 1
        # The flood is bounded by its own owner's queue (its first 50 frames), in order.
        flood = [(await asyncio.wait_for(layer.receive(flood_member), 3))["n"] for _ in range(50)]
        assert flood == list(range(50))
    finally:
        await layer.flush()
        await layer.close_pools()


async def test_one_owners_queue_for_a_worker_is_bounded_in_bytes(settings: Any) -> None:
    # 1500 frames of 64 KiB a queue: one tenant's flood of large session frames held ~100 MB of the
    # shared Redis per worker, and filled a Redis of 120 MB to its maxmemory (every tenant's
    # sessions, control and history writes failed with OOM for 21 s).
    settings.EXECAPP = {**settings.EXECAPP, "SESSION_QUEUE_BYTES": 64 * 1024}
    layer = _layer()
    flooder, other = group_name("tenant:flood", "room"), group_name("tenant:quiet", "room")
    flood_member, other_member = await layer.new_channel(), await layer.new_channel()
    await layer.group_add(flooder, flood_member)
    await layer.group_add(other, other_member)
    queue = layer.prefix + layer.non_local_name(flood_member) + redis_fair.SEP + redis_fair.owner_part(flooder)
    redis = layer.connection(0)
    try:
        for n in range(100):  # 100 x 8 KB: 800 KB for a queue of 64 KiB
            await layer.group_send(flooder, {"type": "session.frame", "n": n, "frame": "x" * 8000})
        assert await redis.memory_usage(queue) < 100 * 1024
        held = await redis.zcard(queue)
        assert 5 <= held <= 8, held
        assert int(await redis.get(queue + redis_fair.BYTES)) <= 64 * 1024
        # Another owner's queue on the same worker is its own: its frame is kept and delivered.
        await layer.group_send(other, {"type": "session.frame", "n": "quiet", "frame": "y" * 8000})
        assert (await asyncio.wait_for(layer.receive(other_member), 3))["n"] == "quiet"
        # What is taken frees its bytes: the flooder's queue takes frames again once read.
        assert [(await asyncio.wait_for(layer.receive(flood_member), 3))["n"] for _ in range(held)] == list(range(held))
        assert await redis.exists(queue + redis_fair.BYTES) == 0
        await layer.group_send(flooder, {"type": "session.frame", "n": "again"})
        assert (await asyncio.wait_for(layer.receive(flood_member), 3))["n"] == "again"
        # One frame larger than the bound still goes to an empty queue (it is never undeliverable).
        await layer.group_send(flooder, {"type": "session.frame", "n": "big", "frame": "z" * 100_000})
        assert (await asyncio.wait_for(layer.receive(flood_member), 3))["n"] == "big"
    finally:
        await layer.flush()
        await layer.close_pools()


async def test_a_worker_that_stopped_reading_gets_no_more_session_frames_queued() -> None:
    # A killed worker's memberships stay in their groups for a day (channels_redis' group expiry):
    # every owner sending to them filled a queue of frames nobody reads, kept full in Redis.
    alive, dead = _layer(), _layer()
    group = group_name("tenant:t", "room")
    live_member, dead_member = await alive.new_channel(), await dead.new_channel()
    dead.prefix = alive.prefix  # two workers of one deployment
    for layer, member in ((alive, live_member), (dead, dead_member)):
        await layer.group_add(group, member)  # a join marks its worker as reading
    dead_key = alive.prefix + dead.non_local_name(dead_member)
    redis = alive.connection(0)
    try:
        await alive.group_send(group, {"type": "session.frame", "n": 1})
        assert await redis.zcard(dead_key + redis_fair.SEP + redis_fair.owner_part(group)) == 1
        # The dead worker never takes again, so its mark lapses (ALIVE_SECONDS; deleted here).
        await redis.delete(dead_key + redis_fair.ALIVE)
        await alive.group_send(group, {"type": "session.frame", "n": 2})
        assert await redis.zcard(dead_key + redis_fair.SEP + redis_fair.owner_part(group)) == 1
        # The live worker marks itself at every take: it gets both.
        assert [(await asyncio.wait_for(alive.receive(live_member), 3))["n"] for _ in range(2)] == [1, 2]
        assert await redis.ttl(alive.prefix + alive.non_local_name(live_member) + redis_fair.ALIVE) > 0
    finally:
        await alive.flush()
        await alive.close_pools()
        await dead.close_pools()


async def test_a_taken_messages_backup_expires_when_its_worker_is_gone() -> None:
    # channels_redis keeps the message a receive took in a backup queue ("$inflight") until a
    # cleaner task removes it, with no expiry: a worker stopped between the two (every deploy may)
    # left a key in Redis for ever (two seen after a few restarts of a 3-worker server).
    layer = _layer()
    member = await layer.new_channel()
    process = layer.prefix + layer.non_local_name(member)
    backup = layer._backup_channel_name(process)
    redis = layer.connection(0)
    try:
        await layer.send(member, {"type": "waiting"})  # taken by the one-round-trip script
        assert await redis_fair.take(redis, process, backup, 1) is not None
        assert 0 < await redis.ttl(backup) <= redis_fair.BACKUP_SECONDS
        await redis.delete(backup)

        async def later() -> None:  # arrives while the take blocks: taken by the blocking pop
            await asyncio.sleep(0.2)
            await layer.send(member, {"type": "arriving"})

        sender = asyncio.get_running_loop().create_task(later())
        assert await redis_fair.take(redis, process, backup, 3) is not None
        await sender
        assert 0 < await redis.ttl(backup) <= redis_fair.BACKUP_SECONDS
    finally:
        await layer.flush()
        await layer.close_pools()


async def test_messages_outside_sessions_keep_the_process_queue() -> None:
    layer = _layer()
    channel = await layer.new_channel()
    await layer.group_add("execapp.control", channel)
    try:
        await layer.group_send("execapp.control", {"type": "control"})
        await layer.send(channel, {"type": "direct"})
        assert [(await asyncio.wait_for(layer.receive(channel), 3))["type"] for _ in range(2)] == ["control", "direct"]
    finally:
        await layer.flush()
        await layer.close_pools()


@pytest.mark.parametrize("channel_layer", ["redis"], indirect=True)
@pytest.mark.usefixtures("channel_layer", "ws_worker")
async def test_a_member_that_disconnects_releases_its_channel(settings: Any) -> None:
    layer = get_channel_layer()
    assert isinstance(layer, RedisChannelLayer)
    gone: set[str] = set()
    async with Client() as sender:
        for n in range(5):
            async with Client("/ws/events/?session=room") as member:
                await sender.send({"type": "message", "text": "/ping", "id": f"p{n}", "session": "room"})
                await member.until_done(f"p{n}")
                assert len(layer.live) == 2  # the sender joined by sending in the session
                gone |= layer.live
            await wait_for(lambda: len(layer.live) == 1)
        gone -= layer.live
        assert len(gone) == 5
        # Frames the gone members would have had: no buffer for any of them.
        await sender.send({"type": "message", "text": "/ping", "id": "last", "session": "room"})
        await sender.until_done("last")
        assert not gone & set(layer.receive_buffer), layer.stats()
    await wait_for(lambda: not layer.live and not layer.receive_buffer)


async def test_a_full_connection_pool_makes_a_command_wait_not_fail() -> None:
    # redis-py's pool raised MaxConnectionsError at its limit (100): 250 connections of one tenant
    # publishing at once on one worker made it judge its whole layer down for 7-17 s.
    url = require_service("Redis", REDIS_TEST_URL)
    layer = RedisChannelLayer(hosts=[{"address": url, "socket_timeout": 15, "max_connections": 2}],
                              prefix=redis_test_prefix("layer"))
    member = await layer.new_channel()
    group = group_name("tenant:busy", "room")
    await layer.group_add(group, member)
    try:
        await asyncio.gather(*(layer.group_send(group, {"type": "session.frame", "n": n}) for n in range(40)))
        got = sorted([(await asyncio.wait_for(layer.receive(member), 3))["n"] for _ in range(40)])
        assert got == list(range(40))
    finally:
        await layer.flush()
        await layer.close_pools()


@pytest.mark.parametrize("channel_layer", ["memory"], indirect=True)
@pytest.mark.usefixtures("channel_layer", "ws_worker")
async def test_one_owners_session_publishes_in_flight_are_capped(settings: Any, monkeypatch: Any) -> None:
    settings.EXECAPP = {**settings.EXECAPP, "SESSION_PUBLISHES_PER_OWNER": 2}
    monkeypatch.setattr(consumers, "_publish_slots", weakref.WeakValueDictionary())  # made with the setting
    layer = get_channel_layer()
    sending = peak = sent = 0
    original = layer.group_send

    async def slow_group_send(group: str, message: dict) -> None:
        nonlocal sending, peak, sent
        sending += 1
        peak = max(peak, sending)
        try:
            await asyncio.sleep(0.02)  # the point: a slow layer, so publishes overlap
            await original(group, message)
        finally:
            sending -= 1
            sent += 1

    monkeypatch.setattr(layer, "group_send", slow_group_send)
    clients = [Client() for _ in range(6)]
    for client in clients:
        await client.__aenter__()
    try:
        for n, client in enumerate(clients):
            await client.send({"type": "message", "text": "/ping", "id": f"p{n}", "session": f"room-{n}"})
        for n, client in enumerate(clients):
            await client.until_done(f"p{n}")
        await wait_for(lambda: sent == 12)
        assert peak == 2  # six connections, each publishing a reply and a done: two at a time
    finally:
        for client in clients:
            await client.__aexit__(None, None, None)


def test_the_checks_name_a_publish_cap_that_could_take_the_pool(settings: Any) -> None:
    from execapp.checks import check_execapp_settings

    assert "execapp.W110" not in {m.id for m in check_execapp_settings()}
    settings.EXECAPP = {"SESSION_PUBLISHES_PER_OWNER": 60}
    found = {m.id: m for m in check_execapp_settings()}
    assert "SESSION_PUBLISHES_PER_OWNER'] is 60" in found["execapp.W110"].msg
    assert "LAYER_MAX_CONNECTIONS" in found["execapp.W110"].hint
    settings.EXECAPP = {"SESSION_PUBLISHES_PER_OWNER": 0}
    assert "SESSION_PUBLISHES_PER_OWNER" in {m.id: m for m in check_execapp_settings()}["execapp.E003"].msg
