"""SlotWaiters: the FIFO of dispatches waiting on the event loop for a pool slot (policy "wait")."""
from __future__ import annotations

import asyncio
import collections
from typing import Any


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(False)


class SlotWaiters:
    """Coroutines waiting for a free pool slot, woken in arrival order as pooled tasks finish.

    Why not poll: at saturation thousands of events may be waiting (slow arrivals beyond the
    pool's capacity), and each polling every few milliseconds would eat the event loop that
    the fast handlers need. Instead the pool reports each freed slot (``on_capacity``, called
    from the pool thread that freed it: a worker going idle, taking a queued task or exiting)
    and the oldest waiter is woken, so the loop does O(1) work per freed slot. A single
    re-check timer per loop (``recheck`` seconds) wakes the head of the line anyway, as a
    safety net.

    Two lanes: a waiter ``ahead`` is woken before every other (the app's choice, e.g. a dispatch of
    a tenant within its share of the pool while another holds more: execapp.pool_share); within a
    lane, arrival order.
    """

    def __init__(self, recheck: float = 0.02) -> None:
        # deque.append/appendleft/popleft/remove are atomic under the GIL: pool threads pop the
        # head while the loop thread appends, without a lock.
        self._queue: collections.deque[asyncio.Future] = collections.deque()
        self._ahead: collections.deque[asyncio.Future] = collections.deque()
        self._recheck = recheck
        self._timers: dict[asyncio.AbstractEventLoop, Any] = {}

    def __len__(self) -> int:
        return len(self._queue) + len(self._ahead)

    def __bool__(self) -> bool:
        return bool(self._queue) or bool(self._ahead)

    async def wait(self, timeout: float, *, first: bool = False, ahead: bool = False) -> bool:
        """Wait in line (at the head of its lane if ``first``; in the lane woken first if ``ahead``):
        True when woken to try for a slot, False on timeout."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        lane = self._ahead if ahead else self._queue
        if first:
            lane.appendleft(fut)
        else:
            lane.append(fut)
        if loop not in self._timers:
            self._timers[loop] = loop.call_later(self._recheck, self._on_recheck, loop)
        timer = loop.call_later(max(0.0, timeout), _expire, fut)
        woken = False
        try:
            woken = await fut
            return woken
        finally:
            timer.cancel()
            if not woken:  # timed out or cancelled: still in line, unless a waker just popped it
                try:
                    lane.remove(fut)
                except ValueError:
                    pass  # popped: _wake finds it done and passes the turn on

    def on_capacity(self) -> None:
        """The pool freed a slot (any thread): wake the oldest waiter, if anyone waits."""
        if self._queue or self._ahead:
            self.notify()

    def notify(self) -> None:
        """A slot may have freed: wake the oldest waiter. Safe from any thread."""
        try:
            fut = self._ahead.popleft()
        except IndexError:
            try:
                fut = self._queue.popleft()
            except IndexError:
                return
        fut.get_loop().call_soon_threadsafe(self._wake, fut)

    def _wake(self, fut: asyncio.Future) -> None:
        # On the waiter's loop. A waiter that timed out or was cancelled meanwhile passes its
        # turn on, so a freed slot is never left unclaimed while others wait.
        if fut.done():
            self.notify()
        else:
            fut.set_result(True)

    def _on_recheck(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timers.pop(loop, None)
        if self._queue or self._ahead:
            self.notify()
            self._timers[loop] = loop.call_later(self._recheck, self._on_recheck, loop)
