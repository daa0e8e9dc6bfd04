"""Production's channel layer: channels_redis, with buffers only for channels that still have a reader.

channels_redis hands a worker process's messages to its channels through one buffer per channel
(``receive_buffer``, a defaultdict of queues of up to ``capacity`` messages each): the receive loop
puts every message it pops into the buffer of each channel the message names, creating the buffer
if there is none, and only a ``receive`` of that channel ever deletes it. A session member that
disconnects leaves its groups, but the frames already on their way to its worker (sent to the
group before the leave, popped after it) still name its channel: each made a buffer nobody reads
again, holding up to ``capacity`` frames of up to 64 KiB, for the life of the process. Measured
(one worker, a publisher sending 8 KB /echo events into a session, 8 clients joining it and
closing at once, over and over): the worker grew ~2.4 MB/s, +72 MB after 4,200 closed members,
and kept it; with this layer it stays flat.

Here a buffer exists only for a *live* channel: one made by ``new_channel`` (every process-local
channel is) and not yet ``release``d. The consumer releases its channel once its reader has stopped and its groups
are left (execapp.consumers); a message for a released channel is dropped and counted
(``dropped``), as channels_redis drops one for a channel whose buffer is full.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from channels_redis.core import BoundedQueue
from channels_redis.core import RedisChannelLayer as ChannelsRedisChannelLayer
from redis.asyncio import BlockingConnectionPool

from . import conf, redis_fair

#: How long a command waits for a free connection of the layer's pool (EXECAPP['LAYER_MAX_CONNECTIONS'])
#: before it fails with ConnectionError (the layer's retry then tries once more).
POOL_WAIT_SECONDS = 5.0


class _LiveBuffers(dict):
    """channel -> its queue, made on first use for a live channel only; any other gets a throwaway
    queue (what is put in it is dropped and counted)."""

    def __init__(self, layer: "RedisChannelLayer") -> None:
        super().__init__()
        self._layer = layer

    def __missing__(self, channel: str) -> asyncio.Queue:
        layer = self._layer
        if channel in layer.live:
            queue = self[channel] = BoundedQueue(layer.capacity)
            return queue
        return _Discard(layer, channel)

    def __delitem__(self, channel: str) -> None:
        # channels_redis deletes a channel's buffer when its receive ends (or is cancelled); one
        # released meanwhile has none.
        self.pop(channel, None)


class ChannelReleased(RuntimeError):
    """A receive on a channel that was released (its reader is gone)."""

    code = "channel_released"


class _Discard(asyncio.Queue):
    """A released channel's queue: keeps nothing, and is never empty to a receive, whose read of it
    raises ChannelReleased. So a receive still running for the channel (a reader whose cancellation
    was lost: asyncio.wait_for in Python 3.11 returns a result that came with the cancellation, and
    redis-py awaits every socket write in one) ends at its next wake-up instead of pumping the
    process's messages for the life of the process."""

    def __init__(self, layer: "RedisChannelLayer", channel: str) -> None:
        super().__init__()
        self._layer = layer
        self._channel = channel

    def put_nowait(self, item: Any) -> None:
        self._layer.dropped += 1

    def empty(self) -> bool:
        return False

    def get_nowait(self) -> Any:
        raise ChannelReleased(f"channel {self._channel} was released: it has no reader any more; receive on a "
                              "channel from new_channel() that was not released")


class RedisChannelLayer(ChannelsRedisChannelLayer):
    """channels_redis' layer whose per-channel buffers end with their channel (see module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The process-local channels that may still be read: a buffer is kept for these only.
        self.live: set[str] = set()
        #: Messages that arrived for a channel already released (dropped).
        self.dropped = 0
        self.receive_buffer = _LiveBuffers(self)

    async def new_channel(self, prefix: str = "specific") -> str:
        channel = await super().new_channel(prefix)
        self.live.add(channel)
        return channel

    def create_pool(self, index: int) -> Any:
        """A pool that waits for a free connection (up to POOL_WAIT_SECONDS) rather than raising at
        its limit: redis-py's raised MaxConnectionsError at once, and a receive that failed made the
        worker judge its whole layer down (execapp/layer_watch.py)."""
        host = dict(self.hosts[index])
        if "address" not in host:  # a Sentinel set-up: channels_redis' own pool
            return super().create_pool(index)
        address = host.pop("address")
        host.setdefault("max_connections", conf.get("LAYER_MAX_CONNECTIONS"))
        host.setdefault("timeout", POOL_WAIT_SECONDS)
        return BlockingConnectionPool.from_url(address, **host)

    async def group_add(self, group: str, channel: str) -> None:
        await super().group_add(group, channel)
        if "!" in channel:  # this worker takes the group's frames from now on (before its first take)
            process = self.non_local_name(channel)
            await self.connection(self.consistent_hash(process)).set(
                self.prefix + process + redis_fair.ALIVE, "1", ex=redis_fair.ALIVE_SECONDS)

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        """channels_redis' group send, a session's message queued per owner (execapp/redis_fair.py),
        each owner's queue on a worker bounded by ``capacity`` messages and SESSION_QUEUE_BYTES."""
        part = redis_fair.owner_part(group)
        if not part:
            return await super().group_send(group, message)
        assert self.require_valid_group_name(group), "Group name not valid"
        key = self._group_key(group)
        connection = self.connection(self.consistent_hash(group))
        # One round trip for the members (channels_redis takes two), one for the send: a
        # connection's session frames go out one at a time, each as slow as its round trips.
        pipe = connection.pipeline(transaction=False)
        pipe.zremrangebyscore(key, min=0, max=int(time.time()) - self.group_expiry)
        pipe.zrange(key, 0, -1)
        names = [x.decode("utf8") for x in (await pipe.execute())[1]]
        max_bytes = int(conf.get("SESSION_QUEUE_BYTES"))
        by_connection, messages, capacities = self._map_channel_keys_to_connection(names, message)
        for index, keys in by_connection.items():
            args = [messages[k] for k in keys] + [capacities[k] for k in keys] + [time.time(), self.expiry, part,
                                                                              max_bytes]
            await self.connection(index).eval(redis_fair.SEND, len(keys), *keys, *args)

    async def _brpop_with_clean(self, index: int, channel: str, timeout: float) -> Any:
        if not channel.endswith("!"):  # a general channel: channels_redis' own
            return await super()._brpop_with_clean(index, channel, timeout)
        return await redis_fair.take(self.connection(index), channel, self._backup_channel_name(channel), timeout)

    def release(self, channel: str) -> None:
        """``channel`` has no reader any more: drop its buffer and whatever still arrives for it."""
        self.live.discard(channel)
        queue = self.receive_buffer.pop(channel, None)
        if queue is not None:
            self.dropped += queue.qsize()

    def stats(self) -> dict[str, int]:
        """Channels with a reader, buffers held (at most one per live channel), messages dropped."""
        return {"live_channels": len(self.live), "buffers": len(self.receive_buffer), "dropped": self.dropped}


def layer_stats() -> dict[str, int]:
    """The process's default channel layer's ``stats()`` once it was made (and is this layer), else {}."""
    from channels import DEFAULT_CHANNEL_LAYER
    from channels.layers import channel_layers

    layer = channel_layers.backends.get(DEFAULT_CHANNEL_LAYER)
    return layer.stats() if isinstance(layer, RedisChannelLayer) else {}
