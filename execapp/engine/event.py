"""Events, the per-handler context, and the outcomes (reply, failure, completion) of one event."""
from __future__ import annotations

import asyncio
import copy
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Union

from .profile import ExecClass


@dataclass(frozen=True)
class Event:
    """One incoming event: a ``message`` with ``text`` or any other ``type`` with ``data``."""

    type: str = "message"
    text: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    session: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form handed to plugin handlers."""
        return {"id": self.id, "type": self.type, "text": self.text, "data": self.data, "session": self.session}


@dataclass(frozen=True)
class Reply:
    """One reply of one handler, with where (exec class) and how long (elapsed seconds) it ran."""

    event_id: str
    matcher: str
    plugin: str | None
    text: str | None
    data: Any
    exec_class: ExecClass
    elapsed: float


@dataclass(frozen=True)
class Failure:
    """A handler that failed (``handler_error``), ran out of time (``timeout``) or was refused."""

    event_id: str
    matcher: str
    plugin: str | None
    code: str
    message: str
    exec_class: ExecClass | None
    elapsed: float


@dataclass(frozen=True)
class Completion:
    """The one terminal record of an event, emitted after every handler of it has finished."""

    event_id: str
    matched: int
    replies: int
    errors: tuple[Failure, ...]
    blocked_by: str | None
    elapsed: float


Outcome = Union[Reply, Failure, Completion]
OutcomeCallback = Callable[[Outcome], None]


class Context:
    """What a handler receives: the event, its command arguments, ``reply()`` and ``set_block()``."""

    __slots__ = ("event", "args", "matcher", "exec_class", "_replies", "blocked")

    def __init__(self, event: Event, args: str, matcher: Any, exec_class: ExecClass) -> None:
        self.event = event
        self.args = args
        self.matcher = matcher
        self.exec_class = exec_class
        self._replies: list[tuple[str | None, Any]] = []
        self.blocked = False

    def reply(self, text: str | None = None, data: Any = None) -> None:
        """Queue a reply; it is sent when the handler returns, with the handler's elapsed time."""
        self._replies.append((None if text is None else str(text), data))

    def set_block(self, block: bool = True) -> None:
        """Stop lower-priority matchers (honoured for handlers run inline; see docs)."""
        self.blocked = block

    def clone_for_pool(self) -> "Context":
        """A private copy for a pool thread: the event's data is deep-copied so no handler can
        see or tear another's (design.md §2: clone before submission)."""
        ev = self.event
        private = Event(type=ev.type, text=ev.text, data=copy.deepcopy(ev.data), id=ev.id, session=ev.session)
        return Context(private, self.args, self.matcher, ExecClass.POOL)


class EventRun:
    """Tracks one event from dispatch until its last handler (inline or pooled) has finished."""

    def __init__(self, event: Event, on_outcome: OutcomeCallback | None) -> None:
        self.event = event
        self._on_outcome = on_outcome
        self._lock = threading.Lock()
        self._pending = 1  # the dispatcher's own hold, released when dispatch ends
        self._started = time.perf_counter()
        self.matched = 0
        self.replies = 0
        self.errors: list[Failure] = []
        self.blocked_by: str | None = None
        self.completion: Completion | None = None
        self._done = threading.Event()
        self._callbacks: list[Callable[[Completion], None]] = []

    def hold(self) -> None:
        """One more handler of this event is outstanding (called before a pool submission)."""
        with self._lock:
            self._pending += 1

    def release(self) -> None:
        """One outstanding handler finished; the last release completes the event."""
        with self._lock:
            self._pending -= 1
            if self._pending:
                return
            self.completion = Completion(self.event.id, self.matched, self.replies, tuple(self.errors),
                                         self.blocked_by, time.perf_counter() - self._started)
            callbacks, self._callbacks = self._callbacks, []
        if self._on_outcome is not None:
            self._on_outcome(self.completion)
        self._done.set()
        for cb in callbacks:
            cb(self.completion)

    def emit(self, outcome: Reply | Failure) -> None:
        """Count and pass on a reply or a failure, from whichever thread ran the handler."""
        with self._lock:
            if isinstance(outcome, Reply):
                self.replies += 1
            else:
                self.errors.append(outcome)
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    def add_done_callback(self, fn: Callable[[Completion], None]) -> None:
        """Call ``fn(completion)`` when the event completes (at once if it already has)."""
        with self._lock:
            if self.completion is None:
                self._callbacks.append(fn)
                return
        fn(self.completion)

    def wait(self, timeout: float | None = None) -> Completion | None:
        """Block until every handler finished; the completion, or None on timeout."""
        self._done.wait(timeout)
        return self.completion

    async def wait_async(self) -> Completion:
        """Await completion from asyncio; pool threads hand the result to the loop safely."""
        if self.completion is not None:
            return self.completion
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Completion] = loop.create_future()

        def _resolve(c: Completion) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(c))

        self.add_done_callback(_resolve)
        return await fut

    def __await__(self):  # type: ignore[no-untyped-def]
        return self.wait_async().__await__()
