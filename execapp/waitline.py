"""A line of connections waiting in turn for room (an owner's pool share, its outbox budget).

Each waiter is a future, woken one at a time, first come first served: a woken connection that
finds the room taken again joins at the head (it keeps its turn); one that leaves while waiting
(its client went away) is taken out of the line. Event loop only, so no lock.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Iterator


class WaitLine:
    """Futures of the connections waiting for room, woken one at a time in order."""

    __slots__ = ("_futures",)

    def __init__(self) -> None:
        self._futures: deque[asyncio.Future[None]] = deque()

    def __bool__(self) -> bool:
        return bool(self._futures)

    def __len__(self) -> int:
        return len(self._futures)

    def __iter__(self) -> Iterator[asyncio.Future[None]]:
        return iter(self._futures)

    def join(self, first: bool = False) -> asyncio.Future[None]:
        """A future to await until woken: at the end of the line, or at its head if ``first``
        (woken already, the room was taken: it keeps its turn)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if first:
            self._futures.appendleft(fut)
        else:
            self._futures.append(fut)
        return fut

    def leave(self, fut: asyncio.Future[None]) -> None:
        """``fut``'s connection stopped waiting before it was woken (cancelled): out of the line."""
        try:
            self._futures.remove(fut)
        except ValueError:
            pass

    def wake(self) -> None:
        """Let the first connection still waiting go on (it wakes the next while there is room)."""
        futures = self._futures
        while futures:
            fut = futures.popleft()
            if not fut.done():
                fut.set_result(None)
                return
