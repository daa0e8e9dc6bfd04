"""One WebSocket client's protocol state: admission, events in flight, ordered delivery of outcomes,
bounded outboxes (execapp.outbox) and the resend path (execapp.resend).

Channels-free on purpose: ``execapp.consumers`` adapts ``Connection`` to a Channels consumer,
and the tests drive it directly. Frames are parsed and written by ``execapp.protocol``.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from time import monotonic
from typing import Any, Awaitable, Callable, Coroutine, Protocol

from . import extensions, history, metrics, resend
from .engine import Completion, Event
from .engine.event import EventRun, Outcome, OutcomeCallback
from .engine.ratelog import RateLimitedLog
from .loop_share import TURN_SECONDS, LoopShare
from .loop_turn import WORKER_TURN_SECONDS, loop_turn
from .outbox import Outbox, OutboxLimits, text_size
from .outbox_budget import OutboxBudget
from .pool_share import PoolShare
from .protocol import (
    MAX_SESSIONS_PER_CONNECTION,
    Limits,
    ProtocolError,
    error_frame,
    group_name,
    lagged_frame,
    outcome_frame,
    parse_request,
    tenant_id,
    with_fields,
)

log = logging.getLogger("execapp.connection")
#: Failures a client can cause on every frame are logged once per cause per minute, with a count.
_rare = RateLimitedLog(log, 60.0)
#: events_total's ok and error counts of a done (execapp.metrics.flush_done copies them over).
_DONE_TALLY = metrics.DONE_TALLY


class Dispatcher(Protocol):
    """What a Connection needs of its engine (execapp.engine.Engine)."""

    def start_event(self, event: Event, on_outcome: OutcomeCallback | None = None,
                    ahead: Callable[[], bool] | None = None
                    ) -> tuple[EventRun, Coroutine[Any, Any, EventRun] | None]: ...


class Admission(Protocol):
    """What a Connection needs of its worker (execapp.worker.Worker): admit an event, end it."""

    def begin_event(self) -> bool: ...

    def end_event(self) -> None: ...


class Connection:
    """One client's protocol state: admission, in-flight events, and ordered delivery of outcomes.

    ``send(text)`` writes one frame to this client; ``publish(group, text)`` hands a frame to a
    session's channel-layer group (None: sessions are served to the sender only); ``join(group)``
    adds this connection to one. Group names come from ``group_name(owner, session)`` here and
    nowhere else, so a connection can only ever join or publish to its own owner's sessions.
    Outcomes arrive on any thread and reach the client in arrival order: per event that is every
    reply/error, then its one done. One produced on the loop (an inline handler's) goes to the
    outbox at once, unless outcomes from pool threads are still queued for the loop: then it waits
    behind them. The outboxes are bounded by ``outbox_limits`` (default: the settings): other members'
    session frames past them are dropped and counted (then one ``lagged`` frame), and the
    client's own frames make the connection stop reading until its outbox drained
    (docs/protocol.md, "Limits and flow control").
    """

    def __init__(self, engine: Dispatcher, worker: Admission, limits: Limits, send: Callable[[str], Awaitable[None]],
                 publish: Callable[[str, str], Awaitable[None]] | None = None,
                 join: Callable[[str], Awaitable[None]] | None = None, owner: str | None = None,
                 outbox_limits: OutboxLimits | None = None, decode_share: LoopShare | None = None,
                 pool_share: PoolShare | None = None, outbox_budget: OutboxBudget | None = None,
                 send_now: Callable[[str], bool] | None = None) -> None:
        if (publish is not None or join is not None) and not owner:
            raise ValueError("a Connection with session groups needs its owner (e.g. 'tenant:acme'): group names "
                             "are namespaced by owner")
        self.engine = engine
        self.worker = worker
        self.limits = limits
        #: Awaits a dispatch that waits for pool slots instead of ``receive`` awaiting it itself (the
        #: consumer's, which abandons it when the client leaves meanwhile); None: awaited here.
        self.watch_parked: Callable[[Coroutine[Any, Any, Any]], Awaitable[None]] | None = None
        self.owner = owner or ""
        # group_name(owner, session) == this prefix + session: the digest is computed once.
        self._group_prefix = group_name(self.owner, "")
        self._tenant = tenant_id(self.owner)  # what handlers see as event.tenant
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        bounds = outbox_limits if outbox_limits is not None else OutboxLimits.from_settings()
        # Both outboxes also count in the owner's budget on this worker (execapp.outbox_budget;
        # shared by the owner's connections): one tenant's many connections together are bounded.
        # ``send_now(text)``: the same write without a coroutine, False when ``send`` must do it (Outbox).
        self.outbox = Outbox(send, "execapp-ws-writer", limits=bounds, lagged=_lagged, budget=outbox_budget,
                             eager=True, write_now=send_now)
        self._publish = publish
        # Frames waiting for the channel layer are this client's own output too: bounded the same
        # way, by backpressure (a layer slower than the sender slows the sender; a layer that is
        # down fails each publish at once, so nothing piles up then).
        self.group_outbox = (Outbox(self._publish_one, "execapp-ws-group", warn=True, limits=bounds,
                                    budget=outbox_budget) if publish is not None else None)
        self._join = join
        #: The loop time this connection's owner may spend on its frames (decoding, dispatch) while
        #: other owners are active (execapp.loop_share; shared by the owner's connections on this
        #: worker); None: not limited.
        self._decode_share = decode_share
        #: The frame work of every connection on this loop in one turn (execapp.loop_turn; charged
        #: through the share), and whose turn this connection's frames take: its owner's.
        self._loop_turn = loop_turn(self.loop)
        self._turn_key: object = decode_share.key if decode_share is not None else (owner or self)
        if decode_share is not None:
            decode_share.loop_turn = self._loop_turn
        #: How many of this owner's events may hold pooled work while other owners' do too
        #: (execapp.pool_share; shared by the owner's connections on this worker); None: not limited.
        self._pool_share = pool_share
        self._ahead = pool_share.ahead if pool_share is not None else None
        #: ids of this connection's events counted in ``_pool_share`` (given back with their done).
        self._pooled: dict[str, int] = {}
        self.sessions: set[str] = set()
        #: event id -> its session (None without one), from acceptance until its done is queued.
        self.in_flight: dict[str, str | None] = {}
        #: event id -> why it matched no handler (execapp.extensions.unmatched_hint), until its done.
        self._hints: dict[str, str] = {}
        #: ids of this connection's running ``"resend": true`` events (their done waits for the record).
        self._resends: set[str] = set()
        self._recording: set[asyncio.Task] = set()
        #: Outcomes from pool threads waiting for the loop (``_drain``), in arrival order.
        self._from_threads: deque[Outcome] = deque()
        #: The event the engine is dispatching on the loop now (its done may come before start_event returns).
        self._dispatching: Event | None = None
        self.closed = False

    async def receive(self, text: str | None = None, data: bytes | None = None) -> None:
        """Handle one incoming frame: refuse it with an error frame, or hand it to the engine and
        return as soon as its handlers are started (never wait for them: Channels would hold back
        this connection's next frames). Never raises: a failure of the server's own is an
        ``internal_error`` frame (logged once per cause per minute) and the connection stays."""
        try:  # one coroutine per frame: the whole path is written out here, not in helpers
            # Backpressure: this client does not read (or the channel layer is slower than its
            # session's frames), or its owner's clients together hold the owner's outbox budget:
            # stop reading its frames until its outboxes (and the owner) have room again.
            if self.outbox.full:
                await self.outbox.wait_room()
            if self.group_outbox is not None and self.group_outbox.full:
                await self.group_outbox.wait_room()
            # The owner holds its share of the pool while others use it: stop reading until one of
            # its pooled events is done (one comparison while it holds less).
            pool = self._pool_share
            if pool is not None and pool.held >= pool.limit and pool.over:
                metrics.POOL_SHARE_WAITS.inc()
                await pool.wait()
            # The owner spent its share of the loop while others wanted it: stop reading until it
            # refilled. Or it ran its part of this turn of the loop: wait until everything else that
            # was ready ran. (An owner alone owes nothing, and its part of a turn is larger:
            # loop_share.ALONE_TURN_SECONDS; ``turn_spent`` first: one comparison while it is short.)
            share = self._decode_share
            if share is not None and (share.turn_spent >= TURN_SECONDS or share.level < 0) and (
                    share.turn_over or (share.level < 0 and share.enforced)):
                if share.enforced and share.owed:
                    metrics.LOOP_SHARE_WAITS.inc()
                    await share.wait()
                if share.turn_over:
                    await share.next_turn()
            # The loop's turn spent its frame budget, or owners wait for one: this owner's frame waits
            # for its turn (owners served least recently go first). Two attribute reads otherwise.
            turn = self._loop_turn
            if (turn.spent >= WORKER_TURN_SECONDS or turn.queued) and not turn.admits(self._turn_key):
                await turn.next_turn(self._turn_key)
                while not turn.admits(self._turn_key):
                    await turn.next_turn(self._turn_key)
            # This frame's loop time, charged to the owner's share once: its decoding, the checks and
            # the dispatch (regex matching, inline handlers, their frames); an await on the way (a
            # session's join, a resend's claim) is charged up to it, and counted again after it.
            started = monotonic()
            try:
                event, resend_ = parse_request(text, data, self.limits, self._tenant)
                if len(self.in_flight) >= self.limits.max_in_flight:
                    raise ProtocolError("rate_limited", f"this connection has {len(self.in_flight)} events in flight, "
                                                        f"the limit is {self.limits.max_in_flight} (EXECAPP["
                                                        "'MAX_IN_FLIGHT_PER_CONNECTION']); wait for a done first",
                                        event.id)
                if event.id in self.in_flight:
                    raise ProtocolError("bad_event", f"id {event.id!r} is already in flight on this connection; use "
                                                     "a new id for each event", event.id)
                if event.session is not None:
                    if share is not None:
                        share.spend_since(started)
                    try:
                        await self.join_session(event.session, event.id)
                    finally:
                        started = monotonic()
                # Last check: from here on the event counts as accepted for a drain (atomically
                # with the drain's flag), and end_event runs once its done is written.
                if not self.worker.begin_event():
                    raise ProtocolError("draining", "this worker is draining for a restart and takes no new events;"
                                                    " reconnect (the load balancer sends you to a live worker)",
                                        event.id)
            except ProtocolError as exc:
                if share is not None:  # a refused frame cost its decoding too
                    share.spend_since(started)
                metrics.count_event(exc.code)
                history.refused(self, exc.code, exc.message, exc.event_id)
                self.outbox.push(error_frame(exc.code, exc.message, exc.event_id))
                return
            except BaseException:
                if share is not None:
                    share.spend_since(started)
                raise
            if resend_:
                if share is not None:
                    share.spend_since(started)
                if not await self._claim(event):
                    return
                started = monotonic()
            eid = event.id
            self.in_flight[eid] = event.session
            history.accepted(self, event)  # one list made; traces are built by the housekeeper
            self._dispatching = event
            try:
                # Inline handlers run right here on the loop (their frames are written as they are
                # queued while the outbox's writer is idle, else a loop turn later by that task:
                # Outbox._write_now); pooled ones start in threads. With the "wait" overflow policy
                # ``rest`` awaits a pool slot: backpressure on this client only.
                try:
                    run, rest = self.engine.start_event(event, self._on_outcome, self._ahead)
                finally:
                    if share is not None:
                        share.spend_since(started)
                # Pooled work left running or parked: counted in the owner's pool share until its done.
                # Counted by its pooled handlers (a frame matching 100 handlers holds 100 pool
                # tasks, not one), as it stands now: handlers a parked dispatch submits later
                # are covered by the one hold it still counts.
                if pool is not None and (rest is not None or not run.done):
                    held = self._pooled[eid] = max(1, run.outstanding)
                    pool.take(held)
                if rest is not None:
                    self._dispatching = None
                    await (rest if self.watch_parked is None else self.watch_parked(rest))
                elif not run.matched and eid in self.in_flight:  # rare: its done waits behind pooled outcomes
                    hint = extensions.unmatched_hint(event.type, event.text)
                    if hint:  # _deliver adds it
                        self._hints[eid] = hint
            except Exception as exc:  # an engine bug; its run still completes (dispatch releases in `finally`)
                _rare.exception(("dispatch", type(exc).__name__), "dispatch of event %s failed", eid)
            finally:
                self._dispatching = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _rare.exception(("receive", type(exc).__name__), "a frame failed inside the server: %r", exc)
            metrics.count_event("internal_error")
            self.outbox.push(error_frame("internal_error", f"the server failed on this frame ({type(exc).__name__}); "
                                                           "it is logged; the connection stays open"))

    async def join_session(self, session: str, event_id: str | None = None) -> None:
        """Join a session's group (once per connection), within MAX_SESSIONS_PER_CONNECTION."""
        if session in self.sessions or self._join is None:
            return
        if len(self.sessions) >= MAX_SESSIONS_PER_CONNECTION:
            raise ProtocolError("bad_event", f"session: this connection already joined {MAX_SESSIONS_PER_CONNECTION} "
                                             f"sessions; open another connection for {session!r}", event_id)
        self.sessions.add(session)
        try:
            await self._join(self._group_prefix + session)
        except Exception:  # the channel layer is down: the sender still gets its own frames
            self.sessions.discard(session)
            log.warning("joining session %r failed; its group frames are not delivered", session, exc_info=True)

    def _on_outcome(self, outcome: Outcome) -> None:
        # Called from the loop (inline handlers) or from pool threads. A pool thread's outcome
        # joins ``_from_threads`` before its run's release, and a loop outcome is delivered at
        # once only while that queue is empty (else it joins it too): so a pooled reply is
        # always delivered before the done that its run's last release produces, on any thread.
        if threading.get_ident() == self._loop_thread:
            if not self._from_threads:
                self._deliver(outcome)
            else:  # a _drain is scheduled for what is queued: this one waits its turn
                self._from_threads.append(outcome)
            return
        self._from_threads.append(outcome)
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: the server is shutting down, the client is gone
            pass

    def _drain(self) -> None:
        """Deliver the outcomes queued by pool threads (and loop outcomes behind them), in order."""
        queued = self._from_threads
        while queued:
            outcome = queued.popleft()
            try:
                self._deliver(outcome)
            except Exception as exc:  # one frame's failure must not hold back the others
                _rare.exception(("deliver", type(exc).__name__), "delivering an outcome of event %s failed: %r",
                                outcome.event_id, exc)

    def _deliver(self, outcome: Outcome) -> None:
        """Queue one outcome's frame for the client (and the session's group) on the loop."""
        eid = outcome.event_id
        if outcome.__class__ is not Completion:  # a reply or an error: its frame's size tells the history
            session = self.in_flight.get(eid)
            frame = outcome_frame(outcome, session)
            size = text_size(frame)
            history.delivered(self, outcome, size)
            if not self.closed:
                self._queue(frame, session, None, size)
            return
        history.delivered(self, outcome)
        pooled = self._pooled
        if pooled and eid in pooled:  # its pooled work is over (the client may have left: counted until now)
            self._pool_share.give(pooled.pop(eid))  # type: ignore[union-attr]
        hint = None
        session = self.in_flight.pop(eid, None)
        if not outcome.matched:
            hint = self._hint(eid)
        _DONE_TALLY[1 if outcome.errors else 0] += 1
        if self._resends and eid in self._resends:  # its done waits for the durable record
            self._resends.discard(eid)
            # Still in flight until that done is queued: a client sending resend events
            # faster than records are written is held by its in-flight limit, not piling up
            # record tasks (and executor threads, and admissions) without bound.
            self.in_flight[eid] = session
            task = self.loop.create_task(self._record_then_done(outcome, session, hint))
            self._recording.add(task)
            task.add_done_callback(self._recording.discard)
            return
        if self.closed:
            self.worker.end_event()
            return
        self._queue(outcome_frame(outcome, session, hint), session, self.worker.end_event)

    def _hint(self, eid: str) -> str | None:
        """Why event ``eid`` matched no handler, if anyone knows (execapp.extensions.unmatched_hint)."""
        if self._hints:
            hint = self._hints.pop(eid, None)
            if hint is not None:
                return hint
        event = self._dispatching
        if event is not None and event.id == eid:  # done during its own dispatch: the common case
            return extensions.unmatched_hint(event.type, event.text)
        return None

    def _queue(self, frame: str, session: str | None, after: Callable[[], None] | None = None,
               size: int = -1) -> None:
        """One frame of this client's event: to the client (never dropped), and to its session."""
        if size < 0:
            size = text_size(frame)
        self.outbox.push(frame, after, size)
        if session is not None and self.group_outbox is not None:
            self.group_outbox.push((self._group_prefix + session, frame), None, size)

    def session_frame(self, frame: str, session: str) -> None:
        """A frame of another member of one of this client's sessions: queued unless the outbox is
        over its limits (then dropped, counted per session; one ``lagged`` frame once it caught up).
        Its delivery is loop time of the owner's (all members are the publisher's owner's): one
        event in a session of a thousand members is a thousand frames written."""
        if self.closed:
            return
        started = monotonic()
        self.outbox.offer(frame, session, text_size(frame))  # (never raises: past its limits it drops)
        if self._decode_share is not None:
            self._decode_share.spend_since(started)

    def groups(self) -> list[str]:
        """The channel-layer groups this connection joined (one per session)."""
        return [self._group_prefix + session for session in self.sessions]

    # -- safe resend (execapp.resend) -------------------------------------------------------------

    async def _claim(self, event: Event) -> bool:
        """Claim a ``"resend": true`` event (admitted already): True to run it; otherwise it was
        answered here (its recorded frames again, or a resend error) and its admission ended."""
        eid = event.id
        self.in_flight[eid] = event.session  # reserved while the claim is out: the same id again is refused
        try:
            claim, frames = await self.loop.run_in_executor(None, resend.claim, self.owner, eid, self._worker_id())
        except Exception as exc:  # ResendError, or the ledger's own failure
            self.in_flight.pop(eid, None)
            self.worker.end_event()
            code = exc.code if isinstance(exc, resend.ResendError) else "resend_unavailable"
            message = exc.message if isinstance(exc, resend.ResendError) else f"resend failed ({type(exc).__name__})"
            extra = exc.extra if isinstance(exc, resend.ResendError) else {}
            if not isinstance(exc, resend.ResendError):
                _rare.exception(("claim", type(exc).__name__), "claiming resend event %s failed", eid)
            metrics.count_event(code)
            history.refused(self, code, message, eid)
            self.outbox.push(error_frame(code, message, eid, **extra))
            return False
        if claim.state != resend.NEW:  # completed before: its record again, nothing runs
            self.in_flight.pop(eid, None)
            for i, frame in enumerate(frames):
                self.outbox.push(frame, self.worker.end_event if i == len(frames) - 1 else None, text_size(frame))
            if not frames:
                self.worker.end_event()
            return False
        self._resends.add(eid)
        return True

    async def _record_then_done(self, outcome: Outcome, session: str | None, hint: str | None) -> None:
        """Make a resend event's record durable, then queue its done (``recorded`` says whether it is)."""
        try:
            await self.loop.run_in_executor(None, resend.complete, self.owner, outcome.event_id, self._worker_id(),
                                            outcome.elapsed)
            fields: dict[str, Any] = {"recorded": True}
        except Exception as exc:
            message = exc.message if isinstance(exc, resend.ResendError) else f"{type(exc).__name__}: {exc}"
            _rare.warning(("record", type(exc).__name__), "the record of resend event %s was not written: %s",
                          outcome.event_id, message)
            fields = {"recorded": False, "record_error": message}
        self.in_flight.pop(outcome.event_id, None)
        if self.closed:
            self.worker.end_event()
            return
        self._queue(with_fields(outcome_frame(outcome, session, hint), **fields), session, self.worker.end_event)

    def _worker_id(self) -> str:
        return str(getattr(self.worker, "id", "") or "")

    async def _publish_one(self, item: tuple[str, str]) -> None:
        await self._publish(item[0], item[1])  # type: ignore[misc]

    def error(self, code: str, message: str, event_id: str | None = None) -> None:
        """Queue an error frame outside of an event (e.g. a bad ?session= on connect)."""
        self.outbox.push(error_frame(code, message, event_id))

    async def flush(self) -> None:
        """Wait until queued frames are written."""
        await self.outbox.flush()
        if self.group_outbox is not None:
            await self.group_outbox.flush()

    def close(self) -> None:
        """The client left: stop writing. Its running handlers finish; their outcomes are dropped."""
        self.closed = True
        self.outbox.close()
        if self.group_outbox is not None:
            self.group_outbox.close()


def _lagged(missed: dict[str, int]) -> tuple[str, int]:
    """The outbox's ``lagged`` item for a member that missed ``missed`` session frames."""
    frame = lagged_frame(missed)
    return frame, text_size(frame)
