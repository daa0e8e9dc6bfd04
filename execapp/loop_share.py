"""A share of the event loop's time: a token bucket of seconds, charged for work done on the loop.

Why: one frame of at most ``MAX_FRAME_BYTES`` costs up to ~10 ms of decoding on the loop (a
64 KB frame of nested arrays; tests/execapp/test_hostile_clients.py), and size and depth limits
bound one frame, not how many arrive. A client sending such frames back to back held the loop
that every other connection of the worker shares. Each owner's connections on a worker now
share one ``LoopShare`` (execapp.worker): past its share the connections stop reading their
frames until it refilled, which is TCP backpressure on that client and nobody else.

Used on the event loop only (``spend_since`` and ``wait`` run in ``Connection.receive``), so no lock.
"""
from __future__ import annotations

import asyncio
import time


class LoopShare:
    """``share`` seconds of loop time per second (at most ``share`` seconds banked), spent by ``spend_since``."""

    __slots__ = ("share", "capacity", "level", "_at", "throttled")

    def __init__(self, share: float, burst_seconds: float = 1.0) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a loop share is a fraction of one event loop in (0, 1], got {share!r}")
        self.share = share
        self.capacity = share * burst_seconds
        self.level = self.capacity
        self._at = time.monotonic()
        #: Times a connection waited for this share to refill (execapp_loop_share_waits_total).
        self.throttled = 0

    def spend_since(self, started: float) -> None:
        """Spend the loop time since ``started`` (a ``time.monotonic()`` reading); the level may go
        below zero: the next ``wait`` repays it. (One clock reading serves the cost and the refill.)"""
        now = time.monotonic()
        level = self.level + (now - self._at) * self.share
        self.level = (level if level < self.capacity else self.capacity) - (now - started)
        self._at = now

    def spend(self, seconds: float) -> None:
        """Spend ``seconds`` of loop time measured elsewhere (a dispatch's regex matching)."""
        self.level -= seconds

    @property
    def owed(self) -> bool:
        """True while more was spent than the share allows: the next frame waits (``wait``)."""
        return self.level < 0 and self.level + (time.monotonic() - self._at) * self.share < 0

    async def wait(self) -> None:
        """Sleep until the share is back to zero (what the owner overspent, at the share's rate)."""
        self.throttled += 1
        while self.owed:
            deficit = -(self.level + (time.monotonic() - self._at) * self.share)
            await asyncio.sleep(deficit / self.share)
