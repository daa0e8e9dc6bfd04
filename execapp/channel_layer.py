"""The embedded default's channel layer: Channels' in-memory layer, with fan-out that costs O(members).

Channels' ``InMemoryChannelLayer`` walks every channel and every group's members (its expiry
sweep, ``_clean_expired``) on every ``receive`` and ``group_send``, and makes an asyncio task
per member for each ``group_send``. A session is a group, and every frame of a session's event
is one ``group_send`` whose members each ``receive`` it: with 300 members one frame swept the
layer 300 times, O(members^2). Here the sweep runs at most once every ``SWEEP_SECONDS``
(messages expire after 60 s, memberships after a day: a second later is no different), and
``group_send`` puts each member's message in place, a shallow copy each, with no task, and
``DELIVERIES_PER_TURN`` members per loop turn, so other clients' frames are read in between.
What the deliveries cost is charged to their owner's share of the loop (execapp.connection).

Measured with a scratch script (one worker; one owner's 300 connections in one session, a
publisher sending /ping events into it 10 at a time; another owner's /ping from a separate
process, one every 10 ms), the other owner's /ping p50 / p99: 1.2 / 3 ms alone; 55 / 113 ms with
Channels' layer (the sweeps 41% of the worker's loop, the members got 3,500 frames/s); with
this one, 2.4-2.6 / 25-29 ms at 8 members per turn (5.9 / 35-81 ms at 32, 3.3-4.2 / 20-28 ms at
16), the members getting 7,000-11,000 frames/s at each. The two clients share the machine's two
cores with the server.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from channels.layers import InMemoryChannelLayer as ChannelsInMemoryChannelLayer

#: Seconds between two sweeps of expired messages and memberships.
SWEEP_SECONDS = 1.0
#: Members a group send hands its message to per loop turn.
DELIVERIES_PER_TURN = 8


class InMemoryChannelLayer(ChannelsInMemoryChannelLayer):
    """Channels' in-memory layer (one process) whose sweeps and group sends do not grow with its size."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._swept = 0.0

    def _clean_expired(self) -> None:
        now = time.monotonic()
        if now - self._swept >= SWEEP_SECONDS:
            self._swept = now
            super()._clean_expired()

    async def group_send(self, group: str, message: dict[str, Any]) -> None:
        """``message`` to every member of ``group``; a member whose channel is full misses it (as in Channels)."""
        assert isinstance(message, dict), "Message is not a dict"
        self.require_valid_group_name(group)
        self._clean_expired()
        members = self.groups.get(group)
        if not members:
            return
        expires = time.time() + self.expiry
        channels = self.channels
        for n, channel in enumerate(list(members)):
            if n and n % DELIVERIES_PER_TURN == 0:
                # A loop turn between slices: each member's reader runs its delivery in the turn
                # after its put, so one frame to 300 members was 300 deliveries in one turn, and
                # every other client's frame waited behind them (~20-40 ms a publish). A turn
                # costs a few microseconds; a slice of 8 deliveries a few hundred.
                await asyncio.sleep(0)
            queue = channels.get(channel)
            if queue is None:
                queue = channels[channel] = asyncio.Queue(maxsize=self.get_capacity(channel))
            try:
                # A shallow copy each: members never see each other's changes to the message itself
                # (the frames it carries are strings). Channels deep-copies it for every member.
                queue.put_nowait((expires, dict(message)))
            except asyncio.QueueFull:
                pass  # the member's channel is full: Channels' group_send ignores that too
        # And one after the last slice: the sender's next publish comes after these deliveries.
        await asyncio.sleep(0)
