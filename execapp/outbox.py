"""A connection's outbox: the frames one task writes to a client, bounded in frames and bytes.

A client that stops reading makes its socket's sends wait (uvicorn's flow control), so what is
queued for it piles up here: without a bound, a stalled session member grows its worker's
memory until the keepalive closes it. The policy (docs/protocol.md, "Limits and flow control"):

- ``push``: the client's own frames (replies, errors and the ``done`` of the events it sent).
  Never dropped (every accepted event ends in exactly one ``done``); while the outbox is over its
  limits the connection stops reading the client's frames (``wait_room``), so the client's own
  output is bounded by its events in flight.
- ``offer``: frames of other session members. Queued while the outbox is under its limits,
  otherwise dropped and counted per key (the session). Once the writer has caught up (the outbox
  is down to half its limits) one item made by ``lagged(missed)`` is queued, saying how many were
  missed (tokio's broadcast ``Lagged(n)``), and offers are queued again.

The outboxes of one owner's connections on a worker may also share an ``OutboxBudget``
(execapp.outbox_budget, EXECAPP['OWNER_OUTBOX_BYTES']): while the owner is over it, each of its
outboxes counts as over its limits too (``full``, ``wait_room``, ``offer``), and as caught up
only once the owner is down to half of it.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from . import conf
from .engine.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from .outbox_budget import OutboxBudget

log = logging.getLogger("execapp.connection")
#: Writes to a channel layer that is down fail for every frame of every connection: one line per
#: cause a minute for the whole process, not one per connection.
_rare = RateLimitedLog(log, 60.0)


class TerminalFrames:
    """This process's event-ending frames (an item pushed with ``after``: a `done`, a replay's last
    frame) queued and not yet written, and how many items all outboxes have written: a drain
    (execapp.drain) tells events still running from events whose `done` only waits for a client
    that reads nothing. Loop thread only; plain ints, read from the drain's thread."""

    pending = 0
    writes = 0


@dataclass(frozen=True)
class OutboxLimits:
    """How much one connection's outbox may hold before session frames are dropped (0: no limit)."""

    max_frames: int = conf.DEFAULTS["OUTBOX_MAX_FRAMES"]
    max_bytes: int = conf.DEFAULTS["OUTBOX_MAX_BYTES"]

    @classmethod
    def from_settings(cls) -> "OutboxLimits":
        """Limits from EXECAPP['OUTBOX_MAX_FRAMES'] and ['OUTBOX_MAX_BYTES']."""
        return cls(int(conf.get("OUTBOX_MAX_FRAMES")), int(conf.get("OUTBOX_MAX_BYTES")))


#: No bound at all (the group outbox of a connection without limits, tests).
UNBOUNDED = OutboxLimits(0, 0)


class SessionFrameTotals:
    """Session frames every outbox of this process dropped, and ``lagged`` frames it queued, since
    start: each outbox's own counts end with its connection, the dashboard and /metrics need the
    process's (updated on the event loop only)."""

    dropped = 0
    lagged = 0

    @classmethod
    def read(cls) -> dict[str, int]:
        """The totals now: {"dropped": ..., "lagged": ...}."""
        return {"dropped": cls.dropped, "lagged": cls.lagged}


def text_size(text: str) -> int:
    """The UTF-8 size of a frame's text (``isascii`` is O(1) on str: most frames cost one call)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


class Outbox:
    """A FIFO of items written by one task, so the loop never awaits a send inside a callback (an
    ``eager`` outbox writes an item pushed while that task is idle at once instead, as far as the
    write goes without waiting: see ``_write_now``).

    Each item may carry an ``after`` callback, run once the item is written, failed to write,
    or dropped because the outbox closed (the drain count of a ``done`` relies on it). See the
    module docstring for ``push`` (never dropped) versus ``offer`` (dropped past the limits).
    """

    def __init__(self, write: Callable[[Any], Awaitable[None]], name: str, warn: bool = False,
                 limits: OutboxLimits = UNBOUNDED, lagged: Callable[[dict[str, int]], tuple[Any, int]] | None = None,
                 budget: OutboxBudget | None = None, eager: bool = False,
                 write_now: Callable[[Any], bool] | None = None) -> None:
        self._write = write
        #: An eager outbox's write without a coroutine: True if it took the item whole, False if
        #: ``write`` must (see ``_write_now``); None: always ``write``.
        self._write_sync = write_now
        #: Write an item pushed while the writer is idle at once (``_write_now``), not a loop turn later.
        self._eager = eager
        #: The write ``_write_now`` began that waits (the client's socket is backed up): the writer
        #: task finishes it before anything queued behind it. (coroutine, what it waits on, item)
        self._begun: tuple[Any, Any, tuple[Any, Callable[[], None] | None, int]] | None = None
        self._stepping = False  # inside _write_now's first step: a push meanwhile is queued
        self._items: deque[tuple[Any, Callable[[], None] | None, int]] = deque()
        self._wake: asyncio.Future[None] | None = None
        self._room: asyncio.Future[None] | None = None
        self._held: asyncio.Future[None] | None = None  # waiting in the owner's budget (wait_room)
        self._closed = False
        self._warn = warn  # a client socket failing is routine (it left); a channel layer is not
        self._name = name
        self.limits = limits
        self._lagged = lagged
        #: The budget of the owner's outboxes together (execapp.outbox_budget); None: none.
        self.budget = budget
        #: Frames and bytes queued now (what the limits bound).
        self.frames = 0
        self.bytes = 0
        #: Offers dropped since the member last caught up, by key; and in total.
        self.missed: dict[str, int] = {}
        self.dropped_total = 0
        self.lagged_total = 0
        self._task = asyncio.get_running_loop().create_task(self._run(), name=name)

    # -- queueing (loop thread only) --------------------------------------------------------------

    def push(self, item: Any, after: Callable[[], None] | None = None, size: int = 0) -> None:
        """Queue one item that must not be dropped (``size``: its bytes, for the limits)."""
        if self._closed:
            if after is not None:
                after()
            return
        wake = self._wake
        # (A pending wake: the writer is parked, not between a wake and its next step.)
        idle = (wake is not None and self._eager and not self._items and self._begun is None and not self._stepping
                and not wake.done())
        failed: Exception | None = None
        if idle and self._write_sync is not None:
            # Written by a plain call before this returns (``write_now``): nothing is counted in and
            # out again (frames, bytes, the owner's budget: none of them changes), only the write.
            try:
                taken = self._write_sync(item)
            except Exception as exc:  # a dead socket: counted, then dropped as a failed write is
                taken, failed = True, exc
            if taken and failed is None:
                TerminalFrames.writes += 1
                if after is not None:
                    after()
                return
        self.frames += 1
        self.bytes += size
        if after is not None:
            TerminalFrames.pending += 1
        budget = self.budget
        if budget is not None:
            budget.bytes += size
        if failed is not None:
            self._written((item, after, size), failed)
            return
        if idle:
            self._write_now((item, after, size))
            return
        if wake is not None and not wake.done():
            wake.set_result(None)
        self._items.append((item, after, size))

    def offer(self, item: Any, key: str, size: int = 0) -> bool:
        """Queue one droppable item unless the outbox is over its limits or catching up after a
        lag (then count it as missed under ``key``); True if queued."""
        if self._closed:
            return False
        # While ``missed`` is not empty, either something is queued and the writer calls _resume
        # once it is down to half the limits, or (dropped for the owner's budget) the outbox is
        # empty and waits in the budget, which calls resume_lagged once the owner drained.
        if self.missed or self._over(size):
            self.missed[key] = self.missed.get(key, 0) + 1
            self.dropped_total += 1
            SessionFrameTotals.dropped += 1
            if self.frames == 0 and self.budget is not None:
                self.budget.lag(self)
            return False
        self.push(item, None, size)
        return True

    def _over(self, extra: int = 0) -> bool:
        """At or over a limit of this outbox or its owner's budget (with ``extra`` more bytes)."""
        budget = self.budget
        return (budget is not None and budget.over_with(extra)) or self._own_over(extra)

    def _own_over(self, extra: int = 0) -> bool:
        """At or over this outbox's own limits; an empty outbox is never over, so a single frame
        larger than the byte limit still goes out (and an owner with nothing queued is never
        over its budget: the same for a frame larger than the budget)."""
        if self.frames == 0:
            return False
        limits = self.limits
        return ((limits.max_frames > 0 and self.frames >= limits.max_frames)
                or (limits.max_bytes > 0 and self.bytes + extra > limits.max_bytes))

    def _low(self) -> bool:
        """Down to half the limits (and the owner to half its budget): the member caught up
        (hysteresis, so one frame does not flap it)."""
        limits = self.limits
        budget = self.budget
        return ((limits.max_frames <= 0 or self.frames <= limits.max_frames // 2)
                and (limits.max_bytes <= 0 or self.bytes <= limits.max_bytes // 2)
                and (budget is None or budget.low))

    @property
    def full(self) -> bool:
        """Over the limits: the connection should stop reading its client's frames."""
        # Read before every frame a client sends: the common answer (nothing queued here, the
        # owner within its budget) without a call. Otherwise as ``_over``.
        budget = self.budget
        if self.frames == 0 and (budget is None or budget.bytes <= budget.limit):
            return False
        return self._over()

    async def wait_room(self) -> None:
        """Return once the outbox is under its limits and its owner under its budget (at once when
        they are): the connection awaits this before reading its client's next frame, so a client
        (or an owner's clients) that does not read its replies stops being read (backpressure
        through TCP) instead of growing the worker."""
        first = False
        while not self._closed and not self._task.done():
            if self._own_over():  # this outbox's writer wakes it (_run)
                if self._room is None or self._room.done():
                    self._room = asyncio.get_running_loop().create_future()
                await self._room
                continue
            budget = self.budget
            if budget is None or not budget.over:
                break
            # The owner's other outboxes hold its budget: woken, in turn, as any of them drains.
            self._held = fut = budget.hold(first)
            try:
                await fut
            except asyncio.CancelledError:
                budget.passed(fut)
                raise
            finally:
                self._held = None
            first = True
        if first:
            budget = self.budget
            if budget is not None:
                budget.passed(None)

    def resume_lagged(self) -> None:
        """The owner's budget drained while this outbox had missed frames and nothing queued
        (execapp.outbox_budget): queue its ``lagged`` item now."""
        if not self._closed and self.missed:
            self._resume()

    def _resume(self) -> None:
        """The member caught up: queue one ``lagged`` item with what it missed, take offers again."""
        missed, self.missed = self.missed, {}
        if self._lagged is None or not missed:
            return
        self.lagged_total += 1
        SessionFrameTotals.lagged += 1
        item, size = self._lagged(missed)
        self.push(item, None, size)

    # -- the writer task --------------------------------------------------------------------------

    def _write_now(self, entry: tuple[Any, Callable[[], None] | None, int]) -> None:
        """Write ``entry`` on the caller's thread, the writer being idle: its write's first step runs
        here, which for a socket with room is the whole write (uvicorn's send suspends only while
        the transport is paused). An inline event's reply and done then go out without waking the
        writer task (a future, a loop turn and a task step each: ~3 us of the loop per event). A
        write that does wait is handed to the writer task, which finishes it before anything queued
        behind it: the caller never waits for a client's socket. (With ``write_now``, ``push`` wrote
        an item the socket had room for already, by a plain call: no coroutine made and stepped.)"""
        coro: Any = self._write(entry[0])  # (an eager outbox's write returns a coroutine)
        self._stepping = True
        try:
            waits_on = coro.send(None)
        except StopIteration:
            self._written(entry, None)
        except Exception as exc:  # a dead socket: as the writer task would, drop the item
            self._written(entry, exc)
        else:
            self._begun = (coro, waits_on, entry)
            wake = self._wake
            if wake is not None and not wake.done():
                wake.set_result(None)
        finally:
            self._stepping = False

    async def _finish(self, coro: Any, waits_on: Any, entry: tuple[Any, Callable[[], None] | None, int]) -> None:
        """Drive a write ``_write_now`` began to its end, as a task would have."""
        error: Exception | None = None
        try:
            while True:
                if waits_on is None:  # a bare yield (asyncio.sleep(0)): one loop turn
                    await asyncio.sleep(0)
                else:  # a future: resumed once it is done (the coroutine reads its result itself)
                    waits_on._asyncio_future_blocking = False
                    await asyncio.wait((waits_on,))
                waits_on = coro.send(None)
        except StopIteration:
            pass
        except asyncio.CancelledError:
            coro.close()
            raise
        except Exception as exc:
            error = exc
        finally:  # also when cancelled by close()
            self._written(entry, error)

    def _written(self, entry: tuple[Any, Callable[[], None] | None, int], error: Exception | None) -> None:
        """An item's write ended (``error``: it failed, the item is dropped): its accounting and
        ``after`` (even when cancelled mid-write), then room for the connection, a lag resumed."""
        _, after, size = entry
        if error is not None:  # a dead socket or layer: keep the loop alive, drop the item
            if self._warn:
                _rare.warning((self._name, type(error).__name__), "%s: write failed, item dropped: %r",
                              self._name, error)
            else:
                log.debug("%s: write failed, item dropped: %r", self._name, error)
        self.frames -= 1
        self.bytes -= size
        TerminalFrames.writes += 1
        budget = self.budget
        if budget is not None:
            budget.bytes -= size
            if budget.waiting:  # the owner's held connections, lagging members
                budget.drained()
        if after is not None:
            TerminalFrames.pending -= 1
            after()
        if self._closed:
            return
        if self._room is not None and not self._room.done() and not self._own_over():
            self._room.set_result(None)
        if self.missed and self._low():
            self._resume()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        items = self._items
        budget = self.budget
        while True:
            begun, self._begun = self._begun, None  # taken over: close() leaves it to this task
            if begun is not None:  # before anything queued behind it
                await self._finish(*begun)
            while items:
                entry = items.popleft()
                error: Exception | None = None
                try:
                    await self._write(entry[0])
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    error = exc
                finally:  # also when cancelled mid-write by close()
                    self._written(entry, error)
            if self.missed and budget is not None:  # caught up but the owner has not: the budget resumes it
                budget.lag(self)
                if items:  # the owner had drained meanwhile: its lagged item is queued
                    continue
            self._wake = loop.create_future()
            await self._wake
            self._wake = None

    def pending(self) -> int:
        """Items queued and not yet written."""
        return len(self._items)

    async def flush(self) -> None:
        """Wait until every queued item is written (tests, orderly close)."""
        while self._items and not self._task.done():
            await asyncio.sleep(0.001)

    def close(self) -> None:
        """Stop writing; queued items are dropped (the client is gone), their callbacks run."""
        self._closed = True
        self._task.cancel()
        dropped = 0
        begun, self._begun = self._begun, None
        if begun is not None:  # the writer had not taken it over yet (it never will: cancelled)
            coro, _, (_, after, size) = begun
            coro.close()
            self.frames -= 1
            self.bytes -= size
            dropped += size
            if after is not None:
                TerminalFrames.pending -= 1
                after()
        while self._items:
            _, after, size = self._items.popleft()
            self.frames -= 1
            self.bytes -= size
            dropped += size
            if after is not None:
                TerminalFrames.pending -= 1
                after()
        for fut in (self._room, self._held):
            if fut is not None and not fut.done():
                fut.set_result(None)
        budget = self.budget
        if budget is not None:
            budget.forget(self)
            budget.bytes -= dropped  # the frame being written is taken off by the writer, cancelled
            budget.drained()
