"""An owner's outbox budget: the bytes queued in all of one owner's outboxes on a worker, bounded.

Why: each connection's outbox is bounded (execapp.outbox: OUTBOX_MAX_BYTES, 1 MiB), but one
owner may hold MAX_CONNECTIONS_PER_OWNER (1000) connections on a worker, so a tenant whose
clients never read their replies could make one worker hold ~1 GiB of its frames. Each owner's
connections on a worker now share one ``OutboxBudget`` (execapp.worker), and every outbox of
theirs (the client's, and the one publishing to its sessions) adds what it queues to it. While
the owner is over ``limit`` (EXECAPP['OWNER_OUTBOX_BYTES']) its connections stop reading their
clients' frames (``Outbox.wait_room``: TCP backpressure on that owner only), and other session
members' frames offered to them are dropped and counted, then one ``lagged`` frame once the owner
is down to half the budget, as for one outbox over its own limits. Like an outbox, an owner with
nothing queued is never over: a single frame larger than the budget still goes out.

Used on the event loop only (the outboxes' ``push``, their writer tasks and ``wait_room``), so no lock.
The per-frame cost is an int add in ``push`` and a subtraction in the writer.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from . import metrics
from .waitline import WaitLine

if TYPE_CHECKING:
    from .outbox import Outbox


class OutboxBudget:
    """At most ``limit`` bytes queued in one owner's outboxes on a worker (past it: held, see the module)."""

    __slots__ = ("limit", "bytes", "holds", "waiting", "_waiters", "_lagging")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"an outbox budget is at least one byte, got {limit!r}")
        self.limit = limit
        #: Bytes queued now in the owner's outboxes (added by ``Outbox.push``, taken off once written or dropped).
        self.bytes = 0
        #: Times one of the owner's connections stopped reading because of this budget
        #: (execapp_owner_outbox_waits_total).
        self.holds = 0
        #: Someone waits for bytes to be taken off (held connections, lagging members): the
        #: outboxes' writers call ``drained`` only then (one attribute read per frame otherwise).
        self.waiting = False
        self._waiters = WaitLine()
        #: Outboxes that missed session frames and have nothing queued: no writer of theirs will
        #: send their ``lagged`` frame, so this budget does once the owner is down to half of it.
        self._lagging: dict[Outbox, None] = {}

    @property
    def over(self) -> bool:
        """True while the owner's outboxes hold more than the budget: its connections stop reading."""
        return self.bytes > self.limit

    def over_with(self, extra: int) -> bool:
        """True if ``extra`` more bytes would put the owner over (never while it has nothing queued)."""
        return self.bytes > 0 and self.bytes + extra > self.limit

    @property
    def low(self) -> bool:
        """Down to half the budget: the owner's members caught up (hysteresis, as in an outbox)."""
        return self.bytes <= self.limit // 2

    def drained(self) -> None:
        """Bytes were taken off and someone waits for them: wake the first held connection, send the
        ``lagged`` frames (called by the outboxes only while there are waiters or lagging members)."""
        if self._waiters and self.bytes <= self.limit:
            self.wake()
        if self._lagging and self.bytes <= self.limit // 2:
            lagging, self._lagging = self._lagging, {}
            for box in lagging:
                box.resume_lagged()
        self.waiting = bool(self._waiters or self._lagging)

    def lag(self, box: Outbox) -> None:
        """``box`` missed frames and has nothing queued: its ``lagged`` frame waits for the owner to drain."""
        if self.low:  # already drained (a frame bigger than the rest of the budget was the one dropped)
            box.resume_lagged()
        else:
            self._lagging[box] = None
            self.waiting = True

    def forget(self, box: Outbox) -> None:
        """``box`` closed: no ``lagged`` frame for it."""
        self._lagging.pop(box, None)

    def wake(self) -> None:
        """Let the first held connection read its frame (it wakes the next while the owner is under)."""
        self._waiters.wake()

    def hold(self, first: bool) -> asyncio.Future[None]:
        """A future a connection awaits until the owner is under its budget; ``first``: it was woken
        already and found the room taken, so it keeps its turn. Counted once per wait."""
        self.waiting = True
        if not first:
            self.holds += 1
            metrics.OWNER_OUTBOX_WAITS.inc()
        return self._waiters.join(first)

    def passed(self, fut: asyncio.Future[None] | None = None) -> None:
        """A held connection stopped waiting (it reads on; or it left, ``fut`` cancelled): pass the turn on."""
        if fut is not None and fut.cancelled():  # the client left while held: not in line any more
            self._waiters.leave(fut)
        if self._waiters and not self.over:
            self.wake()
