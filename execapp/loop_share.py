"""A share of the event loop's time: a token bucket of seconds, charged for work done on the loop.

Why: one worker's event loop serves every connection of every owner on it, and size and depth
limits bound one frame, not how many arrive. A client sending 64 KB frames of nested arrays
back to back (~5-10 ms of decoding each), or cheap frames over many connections whose handlers
run inline, held the loop that every other owner's connections share. Each owner's connections
on a worker now share one ``LoopShare`` (execapp.worker), charged for the loop time each frame
costs: its decoding, and its dispatch (regex matching, inline handlers, outcome frames). Past
its share the owner's connections stop reading until it refilled, which is TCP backpressure on
that client and nobody else.

Only while it takes from someone: the shares of one worker form a ``ShareGroup``, which knows
whether more than one owner sent a frame within the last ``window``. An owner alone on a worker
(a single-tenant deployment, a benchmark) is never throttled; once another owner is active,
each gets at least its share, and the whole loop split evenly when fewer than ``1 / share``
owners are busy (work-conserving between heavy owners).

A share bounds an owner's loop time over a second, not how long the others wait for their turn:
each owner may spend its bank (a quarter of a second at the default share) before any of its
connections waits, and past ``1 / share`` busy owners the shares add up to more than the loop, so
nobody waits at all. Their connections' tasks each hand the loop back after a slice
(execapp.ws_flow), but the loop runs every ready task once per turn: six tenants with 15 connections
each, each sent 64 KB of ``/ping`` frames, made turns of 450 ms (90 slices of 5 ms), and another
tenant's /ping waited a turn or two (measured). So an owner's connections together also run at
most ``TURN_SECONDS`` per turn of the loop (``turn_over``): past it they wait (``next_turn``) until
the loop has run everything that was ready and read its sockets again. A turn then lasts about
``TURN_SECONDS`` per busy owner, whatever their connections. Only while another owner is active,
like the share. An owner alone is held only per turn, at ``ALONE_TURN_SECONDS`` (its many
connections' slices made one turn last seconds, the supervisor's stall), and keeps its throughput.

Used on the event loop only (``spend_since`` and ``wait`` run in ``Connection.receive``), so no lock.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .loop_turn import LoopTurn


class ActiveOwners:
    """Which owners of one worker did something within ``window`` seconds, and so whether their
    shares are enforced (``contended``: more than one). Kept by owner (a share's ``key``): a
    reconnecting owner's new share is the same owner, not a second one. The loop's and the
    pool's groups (``ShareGroup``, execapp.pool_share.PoolShareGroup) extend it."""

    __slots__ = ("window", "contended", "_active", "_pruned")

    def __init__(self, window: float = 1.0) -> None:
        self.window = window
        #: More than one owner was active within the window: shares are enforced.
        self.contended = False
        self._active: dict[object, tuple[Any, float]] = {}  # owner -> (its share, when last seen)
        self._pruned = time.monotonic()

    def saw(self, share: Any, now: float) -> None:
        """``share``'s owner was active at ``now``: O(1), and once a window O(active owners)."""
        active = self._active
        key = share.key
        new = key not in active
        active[key] = (share, now)
        if now - self._pruned >= self.window:
            self.prune(now)
        elif new:  # a second owner shows up: enforced at once; relaxed within a window of quiet
            self._update()

    def prune(self, now: float) -> None:
        """Forget the owners quiet for a window (and that ``_may_forget`` lets go)."""
        self._pruned = now
        limit = now - self.window
        active = self._active
        for stale in [k for k, (s, at) in active.items() if at < limit and self._may_forget(s)]:
            del active[stale]
        self._update()

    def others_than(self, key: object) -> bool:
        """True if an owner other than ``key`` was active within the window (``key``'s own next
        step would make the shares contended, if they are not already)."""
        active = self._active
        return len(active) > 1 or (len(active) == 1 and key not in active)

    def _may_forget(self, share: Any) -> bool:
        return True

    def _update(self) -> None:
        self.contended = len(self._active) > 1


class ShareGroup(ActiveOwners):
    """The loop shares of one worker's owners: which sent frames within ``window`` seconds."""

    __slots__ = ("fair",)

    def __init__(self, window: float = 1.0) -> None:
        super().__init__(window)
        #: The loop split evenly between the active owners (each share is at least this).
        self.fair = 1.0

    def _update(self) -> None:
        super()._update()
        self.fair = 1.0 / len(self._active)


#: Loop seconds one owner's connections may run in one turn of the loop while another owner is active.
TURN_SECONDS = 0.005
#: ... and while it is alone on the worker. Its connections each hand the loop back after a slice
#: (execapp.ws_flow), but the loop runs every ready one once per turn: one owner's 300 connections,
#: each sent /ping frames as fast as it could, made turns of over 5 s, and the supervisor killed
#: the worker as stalled (every tenant's connection on it dropped). Large enough that an owner
#: alone loses nothing to it (a turn back to an idle loop costs microseconds).
ALONE_TURN_SECONDS = 0.05


class LoopShare:
    """``share`` seconds of loop time per second (at most ``share`` seconds banked), spent by
    ``spend_since``; at most ``TURN_SECONDS`` of them per turn of the loop (``next_turn``)."""

    __slots__ = ("share", "capacity", "level", "_at", "throttled", "group", "key", "turn_spent", "_turn",
                 "loop_turn")

    def __init__(self, share: float, burst_seconds: float = 1.0, group: ShareGroup | None = None,
                 owner: str | None = None) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a loop share is a fraction of one event loop in (0, 1], got {share!r}")
        self.share = share
        self.capacity = share * burst_seconds
        self.level = self.capacity
        self._at = time.monotonic()
        #: Times a connection waited for this share to refill (execapp_loop_share_waits_total).
        self.throttled = 0
        #: The worker's shares; None: this one alone, always enforced.
        self.group = group
        #: Who this share is in its group: its owner, else the share itself.
        self.key: object = owner if owner is not None else self
        #: Loop seconds spent since this owner's turn began (``next_turn`` starts the next).
        self.turn_spent = 0.0
        #: Set once the loop has run what was ready when this owner's turn ran out (None: not over).
        self._turn: asyncio.Future[None] | None = None
        #: The loop's turn, charged too (execapp.loop_turn; set by the connections that spend this share).
        self.loop_turn: LoopTurn | None = None

    def spend_since(self, started: float) -> None:
        """Spend the loop time since ``started`` (a ``time.monotonic()`` reading); the level may go
        below zero while the share is enforced: the next ``wait`` repays it. (One clock reading
        serves the cost and the refill.)"""
        now = time.monotonic()
        level = self.level + (now - self._at) * self.rate
        level = (level if level < self.capacity else self.capacity) - (now - started)
        group = self.group
        if group is not None:
            group.saw(self, now)
            # Time spent while no other owner was active is no debt to repay once one is.
            if level < 0 and not group.contended:
                level = 0.0
        self.level = level
        self._at = now
        self.turn_spent += now - started
        turn = self.loop_turn
        if turn is not None:  # LoopTurn.spend, written out: this runs for every frame
            turn.spent += now - started
            turn.charges += 1
            if not turn.armed:
                turn.arm()

    @property
    def rate(self) -> float:
        """Loop seconds per second this share refills at: its share, or the even split if more."""
        group = self.group
        return self.share if group is None or group.fair < self.share else group.fair

    @property
    def enforced(self) -> bool:
        """True while this owner takes from others: another owner was active within the window."""
        return self.group is None or self.group.contended

    @property
    def owed(self) -> bool:
        """True while more was spent than the share allows: the next frame waits (``wait``)."""
        return self.level < 0 and self.level + (time.monotonic() - self._at) * self.rate < 0

    @property
    def turn_over(self) -> bool:
        """True once this owner ran its part of this turn of the loop: TURN_SECONDS while another owner
        is active, ALONE_TURN_SECONDS while it is alone. The next frame waits (``next_turn``)."""
        spent = self.turn_spent
        return spent >= TURN_SECONDS and (spent >= ALONE_TURN_SECONDS or self.enforced)

    async def next_turn(self) -> None:
        """Wait until the loop has run every callback that is ready now (other owners' connections,
        sockets read since), then start this owner's next turn. Every connection of the owner that
        waits here wakes together, after them."""
        turn = self._turn
        if turn is None:
            loop = asyncio.get_running_loop()
            turn = self._turn = loop.create_future()
            # call_soon: after everything ready now; the loop polls its sockets before the next turn.
            loop.call_soon(self._new_turn, turn)
        # Shielded: the future is every waiting connection's; one leaving (cancelled) must not end it.
        await asyncio.shield(turn)

    def _new_turn(self, turn: "asyncio.Future[None]") -> None:
        if self._turn is turn:
            self._turn = None
            self.turn_spent = 0.0
        if not turn.done():
            turn.set_result(None)

    async def wait(self) -> None:
        """Sleep until the share is back to zero (what the owner overspent, at the share's rate)."""
        self.throttled += 1
        while self.owed:
            deficit = -(self.level + (time.monotonic() - self._at) * self.rate)
            await asyncio.sleep(deficit / self.rate)
        self.turn_spent = 0.0  # it slept: the others had the loop
