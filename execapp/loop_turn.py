"""The loop time one turn of a worker's event loop spends on frames, whatever the number of owners.

Why: each owner's connections were bounded per turn (execapp.loop_share: TURN_SECONDS of dispatch
while another owner is active; execapp.ws_flow: each owner's first read of a turn parsed at once),
so a turn grew with the number of busy owners: 100 tenants with 10 flooding connections each made
loop gaps of 1.79 s and another tenant's /ping waited up to 1.83 s; at about 300 busy tenants a
turn would pass the supervisor's stall limit (5 s) and the worker be killed, dropping every tenant.

``LoopTurn`` (one per event loop, ``loop_turn``) is charged for the frame work of every connection
on the loop: the parsing of their reads (execapp.ws_flow) and the dispatch of their frames
(execapp.connection, through the owner's ``LoopShare``). Past ``WORKER_TURN_SECONDS`` in a turn no
owner's frame runs until the next turn (``admits`` is False: the connection waits in ``wait``).
The turn then ends (a callback at the end of the loop's ready queue), and the owners that waited
are called in order: the owner served least recently first, so the owners not served in a turn
go first in the next, and a quiet owner's frame (not served for a while) goes ahead of the busy
ones that were. While owners wait, a frame of an owner not called for this turn waits too (it
would take the turn from those called), and an owner served in this turn runs another frame only
once every owner called for it ran one (one frame each in turn: the first owners called, each
running its part of a turn, 5 ms, left 150 owners called at once to ~10 a turn, and an owner that
came later waited 46 turns, 2.6 s, behind them). A turn therefore
runs at most the budget plus one frame or read, and every owner that waits is served within a
bounded number of turns (about busy owners' turns / owners served in a turn, and one turn for an
owner that was quiet).

Hot path: one owner alone, or owners that do not fill a turn, pay two attribute reads per frame
(``spent`` and ``queued``) and the charge (``spend``); the turn's end callback is armed once per
turn in which something was charged (the parse of a read already armed one per turn).

Used on the event loop only, so no lock.
"""
from __future__ import annotations

import asyncio
import weakref
from typing import Callable

#: Loop seconds the frames of every connection of a worker (their reads' parsing, their dispatch)
#: may take in one turn of the event loop: past it they wait for the next turn (owners in turn).
#: A turn ends with a callback at the end of the loop's ready queue, so one loop iteration may hold
#: the end of one turn and the start of the next: at most twice this, 50 ms (an owner alone was
#: held to loop_share.ALONE_TURN_SECONDS, the same). The supervisor's stall limit is 5 s; a turn
#: back to an idle loop costs microseconds.
WORKER_TURN_SECONDS = 0.025
#: A new turn wakes about this many times as many waiting connections as it can run at the last
#: turn's cost per charge (the rest stay first in line): a waiter woken for nothing costs a task step.
WAKE_MARGIN = 1.5


class LoopTurn:
    """The frame work of one event loop's turn, and the owners waiting for the next (see the module)."""

    __slots__ = ("loop", "spent", "charges", "queued", "number", "armed", "_served", "_waiting", "_called",
                 "_cost", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        #: Loop seconds charged in this turn.
        self.spent = 0.0
        #: Charges in this turn (about one a frame or read), and the loop seconds a charge cost in
        #: the last turn that had one (0: not known): how many waiters a turn wakes.
        self.charges = 0
        self._cost = 0.0
        #: Owners wait for a turn or were called for this one: a frame goes through ``admits``.
        self.queued = False
        #: This turn's number (the first is 0).
        self.number = 0
        #: The turn's end is scheduled (``arm``, at the first charge of a turn).
        self.armed = False
        #: Owners that ran a frame in this turn (recorded while ``queued`` or past the budget).
        self._served: set[object] = set()
        #: Owner -> (the last turn it was served in, -1 if not known; what to call at the next turn).
        self._waiting: dict[object, tuple[int, list[Callable[[], None]]]] = {}
        #: Owners called for this turn, not yet served -> the last turn they were served in.
        self._called: dict[object, int] = {}

    def spend(self, seconds: float) -> None:
        """Charge ``seconds`` of frame work to this turn (its end is armed at the first charge)."""
        self.spent += seconds
        self.charges += 1
        if not self.armed:
            self.arm()

    def arm(self) -> None:
        """Schedule this turn's end (once a turn: callers check ``armed``)."""
        self.armed = True
        # call_soon: after everything ready now; the loop polls its sockets before the next turn.
        self.loop.call_soon(self._new_turn)

    def admits(self, key: object) -> bool:
        """May owner ``key`` run a frame (or parse a read) now? Callers check ``spent`` and
        ``queued`` first: with the budget left and nobody waiting, yes without a call."""
        if self.spent >= WORKER_TURN_SECONDS:
            return False
        served = self._served
        called = self._called
        if key in served:  # again: once every owner called for this turn had its frame
            return not called
        if called:
            if called.pop(key, None) is None:
                return False
            if not called and not self._waiting:
                self.queued = False
        elif self._waiting:
            return False
        served.add(key)
        entry = self._waiting.get(key)
        if entry is not None:  # more of its waiters than this turn woke: behind the others next turn
            self._waiting[key] = (self.number, entry[1])
        return True

    def wait(self, key: object, wake: Callable[[], None]) -> None:
        """Owner ``key`` was not admitted: call ``wake`` at the turn it is called for (owners that
        were served least recently are called first)."""
        entry = self._waiting.get(key)
        if entry is None:
            last = self._called.pop(key, None)  # called but the turn ran out first: keeps its place
            if last is None:
                last = self.number if key in self._served else -1
            entry = self._waiting[key] = (last, [])
        entry[1].append(wake)
        self.queued = True
        if not self.armed:
            self.arm()

    async def next_turn(self, key: object) -> None:
        """Wait (a task) until owner ``key`` is called for a turn; the caller checks ``admits`` again."""
        future = self.loop.create_future()
        self.wait(key, lambda: _resolve(future))
        await future

    def _new_turn(self) -> None:
        """The turn ended: a new budget, and the waiting owners called, least recently served first."""
        if self.charges:
            self._cost = self.spent / self.charges
        self.armed = False
        self.spent = 0.0
        self.charges = 0
        self.number += 1
        self._served.clear()
        # Owners called for the turn that ended and not served (their connections left, or found
        # nothing to do) are not called again: each connection that waits again is in ``waiting``.
        order = sorted(self._waiting.items(), key=lambda item: item[1][0])  # stable: in the order they came
        # Their waiters in turn: every owner's first, then every owner's second... and only about as
        # many as the turn can run (at the last turn's cost per charge): each one woken costs a task
        # step, and 1,000 connections woken to find the budget spent were ~40% of a turn.
        limit = int(WAKE_MARGIN * WORKER_TURN_SECONDS / self._cost) + 1 if self._cost > 0 else 1 << 30
        woken: list[Callable[[], None]] = []
        called: dict[object, int] = {}
        taken: dict[object, int] = {}
        rank = 0
        while len(woken) < limit:
            more = False
            for key, (last, wakes) in order:
                if rank < len(wakes):
                    more = True
                    woken.append(wakes[rank])
                    taken[key] = rank + 1
                    called[key] = last
                    if len(woken) >= limit:
                        break
            if not more:
                break
            rank += 1
        # The rest wait for the next turn, in their place (not served: still ahead).
        self._waiting = {key: (last, wakes[taken.get(key, 0):]) for key, (last, wakes) in order
                         if len(wakes) > taken.get(key, 0)}
        self._called = called
        self.queued = bool(called or self._waiting)
        for wake in woken:
            wake()
        if self._waiting and not self.armed:  # their turn comes even if those woken run nothing
            self.arm()  # (after the wake-ups: those woken run before the turn ends)

def _resolve(future: "asyncio.Future[None]") -> None:
    if not future.done():  # its task was cancelled meanwhile
        future.set_result(None)


_turns: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopTurn]" = weakref.WeakKeyDictionary()


def loop_turn(loop: asyncio.AbstractEventLoop) -> LoopTurn:
    """The LoopTurn of ``loop`` (one per event loop, shared by every connection on it)."""
    turn = _turns.get(loop)
    if turn is None:
        turn = _turns[loop] = LoopTurn(loop)
    return turn
