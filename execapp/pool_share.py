"""A share of the worker's thread pool: how many of one owner's events may hold pooled work at once.

Why: one worker's ExecPool (POOL_MAX_WORKERS threads and a queue) serves every owner on it (its
queue takes owners in turn, execapp/engine/fairqueue.py, but its threads go to whoever comes).
One owner with many connections, each with events in flight whose handlers are slow and pooled,
took every thread and queue slot, and other owners' pooled events waited behind its own until they
were refused ``overloaded``. Each owner's connections on a worker now share
one ``PoolShare`` (execapp.worker): the count of the pool tasks (pooled handlers) of the owner's
events that left pooled work running, queued or parked for a slot (``take`` when
``Connection.receive`` dispatched one, ``give`` when its done is delivered; one frame matching 100
handlers counts 100: counted as one event it let one frame hold the whole pool while counting 1).
Past ``limit`` (EXECAPP['POOL_SHARE_PER_OWNER'] of POOL_MAX_WORKERS) the owner's connections stop
reading frames until one of its events finished: TCP backpressure on
that owner only, no frame refused. A parked dispatch of an owner within its share waits for a
slot ahead of the others' (``ahead``: the engine's priority lane), so the first event of an owner
arriving at a pool another one filled is not refused behind that owner's parked dispatches.

Only while it takes from someone (the pool's analog of execapp.loop_share): the shares of one
worker form a ``PoolShareGroup``, which knows whether more than one owner held pooled work within
the last ``window`` seconds. An owner alone on a worker keeps the whole pool; an owner whose
events run inline only is no contender (work-conserving).

Used on the event loop only (``Connection.receive`` and ``Connection._deliver`` run there), so no lock.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from .loop_share import ActiveOwners
from .waitline import WaitLine


class PoolShareGroup(ActiveOwners):
    """The pool shares of one worker's owners: which held pooled work within ``window`` seconds
    (an owner still holding some is never forgotten)."""

    __slots__ = ("_timer",)

    def __init__(self, window: float = 1.0) -> None:
        super().__init__(window)
        self._timer: asyncio.TimerHandle | None = None

    def _may_forget(self, share: Any) -> bool:
        return not share.held

    def _update(self) -> None:
        was = self.contended
        super()._update()
        if was and not self.contended:
            for share, _ in list(self._active.values()):  # alone again: its waiting connections read on
                share.wake()

    def recheck_later(self, loop: asyncio.AbstractEventLoop) -> None:
        """While a connection waits, relax the shares a window after the last contender went quiet,
        even if no count changes meanwhile (one timer per group, not one per waiter)."""
        if self._timer is None:
            self._timer = loop.call_later(self.window, self._recheck, loop)

    def _recheck(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self.prune(time.monotonic())
        if self.contended and any(share._waiters for share, _ in self._active.values()):
            self.recheck_later(loop)


class PoolShare:
    """At most ``limit`` pool tasks of one owner's events at once, while another owner has some."""

    __slots__ = ("limit", "held", "group", "waits", "_waiters", "key")

    def __init__(self, limit: int, group: PoolShareGroup | None = None, owner: str | None = None) -> None:
        if limit < 1:
            raise ValueError(f"a pool share is at least one event, got {limit!r}")
        self.limit = limit
        #: The pool tasks of the owner's events that run, are queued or wait for a slot (take/give).
        self.held = 0
        #: The worker's shares; None: this one alone, always enforced.
        self.group = group
        #: Who this share is in its group: its owner, else the share itself.
        self.key: object = owner if owner is not None else self
        #: Times a connection waited for this share (execapp_pool_share_waits_total).
        self.waits = 0
        self._waiters = WaitLine()

    @property
    def over(self) -> bool:
        """True while the owner holds its share and another owner uses the pool: its next frame waits."""
        return self.held >= self.limit and (self.group is None or self.group.contended)

    def ahead(self) -> bool:
        """True while the owner is within its share and another owner uses the pool: its dispatch
        that finds the pool full waits for a slot ahead of those past their share. Asked when the
        dispatch parks, before its ``take``: an owner's first event at a pool that another owner
        filled is ahead too (the group is not contended yet: this owner was not active)."""
        group = self.group
        return self.held < self.limit and group is not None and group.others_than(self.key)

    def take(self, n: int = 1) -> None:
        """One more of the owner's events holds pooled work: ``n`` pool tasks (its pooled handlers)."""
        self.held += n
        group = self.group
        if group is not None:
            group.saw(self, time.monotonic())

    def give(self, n: int = 1) -> None:
        """One of the owner's events with pooled work is done (the ``n`` it took): a waiting
        connection may read on."""
        self.held -= n
        group = self.group
        if group is not None:
            group.saw(self, time.monotonic())
        if self._waiters and not self.over:
            self.wake()

    def wake(self) -> None:
        """Let the first waiting connection read its frame (it wakes the next while there is room)."""
        self._waiters.wake()

    async def wait(self) -> None:
        """Wait until the owner is back within its share, or alone on the pool (woken, no polling)."""
        self.waits += 1
        loop = asyncio.get_running_loop()
        first = False
        while self.over:
            # first: woken, and another connection of the owner took the room first: keep the turn
            fut = self._waiters.join(first)
            if self.group is not None:
                self.group.recheck_later(loop)
            try:
                await fut
            except asyncio.CancelledError:  # the client left
                if fut.cancelled():
                    self._waiters.leave(fut)
                elif not self.over:  # woken just before: pass the turn on
                    self.wake()
                raise
            first = True
        if self._waiters:  # room for more: the next connection re-checks a loop turn later
            self.wake()
