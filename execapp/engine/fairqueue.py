"""FairQueue: the pool's task queue, one line per owner, served in turn (round robin)."""
from __future__ import annotations

import collections
import threading
from typing import Callable, Generic, Hashable, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Items queued by key (the event's tenant), taken one key at a time, in turn.

    Why: the pool's queue served every owner of a worker in arrival order, so an owner whose
    events fanned out to many pooled handlers queued them all, and another owner's task arriving
    next waited behind the whole backlog (8 threads, one owner's 128 tasks of 20 ms queued: the
    other owner's one task started after 325 ms; now after 20 ms). Each key now has its own
    line, and ``popleft`` takes from the key whose turn it is, then puts that key last if it has
    more: a newly arrived key waits for about one item per other key queued, not for their
    backlogs. Within a key, arrival order. A single key is plain FIFO.

    O(1) per ``append`` and ``popleft`` (a dict lookup and deque ends), under one leaf lock held
    for those few operations only: the compound update (a key's line emptied and removed while
    another thread appends to it) is not atomic as one deque's ends were. Only the queued path
    pays it; an idle worker's hand-off and a token's start never touch the queue. A key's line
    is dropped once empty, so the queue holds at most one line per queued item.
    """

    __slots__ = ("_lock", "_lines", "_turns", "_len")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: dict[Hashable, collections.deque[T]] = {}
        self._turns: collections.deque[Hashable] = collections.deque()  # keys with items, next first
        self._len = 0  # written under the lock, read without (one attribute read)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def append(self, item: T, key: Hashable = "") -> None:
        """Queue ``item`` last in ``key``'s line (a key new to the queue gets its turn last)."""
        lock = self._lock
        lock.acquire()  # acquire/release, not `with`: ~25% less per item, and this is per task
        try:
            line = self._lines.get(key)
            if line is None:
                self._lines[key] = line = collections.deque()
                self._turns.append(key)
            line.append(item)
            self._len += 1
        finally:
            lock.release()

    def popleft(self) -> T:
        """The first item of the key whose turn it is; IndexError when empty."""
        lock = self._lock
        lock.acquire()
        try:
            return self._take(self._turns.popleft())  # IndexError when empty
        finally:
            lock.release()

    def _take(self, key: Hashable) -> T:
        """The first item of ``key``'s line, just taken off the turns (under the lock): the key goes
        last in turn if it has more."""
        line = self._lines[key]
        item = line.popleft()
        if line:
            self._turns.append(key)
        else:
            del self._lines[key]
        self._len -= 1
        return item

    def popleft_where(self, accept: Callable[[Hashable], bool]) -> T:
        """Like ``popleft``, from the first key in turn that ``accept`` takes (the ones passed over
        keep their place); IndexError when no key with items is accepted. O(keys queued)."""
        lock = self._lock
        lock.acquire()
        try:
            turns = self._turns
            for key in turns:
                if accept(key):
                    break
            else:
                raise IndexError("no queued key is accepted")
            turns.remove(key)  # (each key is in turns once)
            return self._take(key)
        finally:
            lock.release()

    def any_key(self, accept: Callable[[Hashable], bool]) -> bool:
        """True when some key with items queued is accepted (read without the lock: a hint)."""
        return any(accept(key) for key in list(self._turns))

    def keys(self) -> int:
        """How many keys have items queued."""
        return len(self._turns)
