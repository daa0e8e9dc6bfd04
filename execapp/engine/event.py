"""Events, the per-handler context, and the outcomes (reply, failure, completion) of one event."""
from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import os
import pickle
import threading
from dataclasses import dataclass, field
from time import monotonic
from typing import Any, Callable, Generator, Union

from .errors import BadEvent
from .profile import ExecClass
from .ratelog import RateLimitedLog

log = logging.getLogger("execapp.engine")
_rlog = RateLimitedLog(log)


# Event ids: 16 hex digits counting up from a random per-process start. os.urandom per event
# was a getrandom() system call (~1 us, half the cost of an Event); next() on an itertools.count
# is one C call, safe from any thread. The start is below 2^62, so the count stays a machine
# integer (itertools.count's fast mode ends at 2^63) for 2^62 ids. Unique within the process;
# across processes two starts overlap with odds ~ (ids per process) / 2^62. Ids are labels, not
# secrets: a client may choose its own (protocol "id").
def _id_counter() -> Any:
    return itertools.count(int.from_bytes(os.urandom(8), "big") >> 2)


_ids = _id_counter()


def _reseed_ids() -> None:
    """A forked child counts from its own random start (it must not repeat its parent's ids)."""
    global _ids
    _ids = _id_counter()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed_ids)


def _new_id() -> str:
    return "%016x" % next(_ids)


@dataclass(frozen=True, init=False)
class Event:
    """One incoming event: a ``message`` with ``text`` or any other ``type`` with ``data``.

    ``tenant``: who sent it, as an opaque id: the same for every event of one owner (a tenant of
    API tokens, or a staff user), "" when nobody is known. Handlers key per-sender state by it (two
    tenants may both name a session "room-1"); the engine itself never reads it.
    ``size``: how big the event is, in characters, computed once by whoever made it (the
    protocol passes the frame's length; the default is ``len(text)``). The engine runs a
    handler inline only on events not much larger than those it was proven fast on
    (ExecProfile.inline_max_size). ``dataclasses.replace`` keeps the old size: pass a new one.
    """

    type: str = "message"
    text: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=_new_id)
    session: str | None = None
    size: int = 0
    tenant: str = ""

    def __init__(self, type: str = "message", text: str = "", data: dict[str, Any] | None = None,
                 id: str | None = None, session: str | None = None, size: int | None = None,
                 tenant: str = "") -> None:
        # Written into the instance dict directly (one event per frame: see Reply below).
        d = self.__dict__
        d["type"] = type
        d["text"] = text
        d["data"] = {} if data is None else data
        d["id"] = "%016x" % next(_ids) if id is None else id  # _new_id(), inlined
        d["session"] = session
        d["size"] = len(text) if size is None else size
        d["tenant"] = tenant

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form handed to plugin handlers."""
        return {"id": self.id, "type": self.type, "text": self.text, "data": self.data, "session": self.session,
                "tenant": self.tenant}


# Reply, Failure and Completion are made on the hot path (one Completion per event). A frozen
# dataclass's generated __init__ pays an object.__setattr__ call per field (~0.55 us for six);
# these __init__s write the instance dict directly (~0.2 us). Equality, repr, hash, fields()
# and replace() still come from @dataclass.

@dataclass(frozen=True, init=False)
class Reply:
    """One reply of one handler, with where (exec class) and how long (elapsed seconds) it ran."""

    event_id: str
    matcher: str
    plugin: str | None
    text: str | None
    data: Any
    exec_class: ExecClass
    elapsed: float

    def __init__(self, event_id: str, matcher: str, plugin: str | None, text: str | None, data: Any,
                 exec_class: ExecClass, elapsed: float) -> None:
        d = self.__dict__
        d["event_id"] = event_id
        d["matcher"] = matcher
        d["plugin"] = plugin
        d["text"] = text
        d["data"] = data
        d["exec_class"] = exec_class
        d["elapsed"] = elapsed


@dataclass(frozen=True, init=False)
class Failure:
    """A handler that failed (``handler_error``), ran out of time (``timeout``) or was refused."""

    event_id: str
    matcher: str
    plugin: str | None
    code: str
    message: str
    exec_class: ExecClass | None
    elapsed: float

    def __init__(self, event_id: str, matcher: str, plugin: str | None, code: str, message: str,
                 exec_class: ExecClass | None, elapsed: float) -> None:
        d = self.__dict__
        d["event_id"] = event_id
        d["matcher"] = matcher
        d["plugin"] = plugin
        d["code"] = code
        d["message"] = message
        d["exec_class"] = exec_class
        d["elapsed"] = elapsed


@dataclass(frozen=True, init=False)
class Completion:
    """The one terminal record of an event, emitted after every handler of it has finished."""

    event_id: str
    matched: int
    replies: int
    errors: tuple[Failure, ...]
    blocked_by: str | None
    elapsed: float

    def __init__(self, event_id: str, matched: int, replies: int, errors: tuple[Failure, ...],
                 blocked_by: str | None, elapsed: float) -> None:
        d = self.__dict__
        d["event_id"] = event_id
        d["matched"] = matched
        d["replies"] = replies
        d["errors"] = errors
        d["blocked_by"] = blocked_by
        d["elapsed"] = elapsed


Outcome = Union[Reply, Failure, Completion]
OutcomeCallback = Callable[[Outcome], None]


def _private_copy(data: Any) -> Any:
    """A deep copy of ``data``, made on the dispatching thread (the event loop, for the protocol's events).

    copy.deepcopy walks the data in Python: a 60 KB event of 15,000 empty lists took ~30 ms of the
    loop per pooled handler it matched (measured: another tenant's /ping p99 48 ms against 26 ms
    for the same frames matching nothing). A pickle round trip is the same deep copy (shared and
    cyclic references kept) in C, ~5 ms for that event. Data pickle cannot take (a lock, a
    function, a local class) is deep-copied as before, with the same errors.
    """
    try:
        return _loads(_dumps(data, _PICKLE_PROTOCOL))
    except RecursionError:
        raise
    except Exception:  # not picklable: deepcopy copies what it can and refuses the rest
        return copy.deepcopy(data)


_dumps, _loads, _PICKLE_PROTOCOL = pickle.dumps, pickle.loads, pickle.HIGHEST_PROTOCOL


class Context:
    """What a handler receives: the event, its command arguments, ``reply()`` and ``deadline``.

    ``deadline``: the time.monotonic() value by which the run should end, or None. Inline it
    is the engine's inline budget (the handler runs on the event loop); pooled it is the start
    plus the matcher's timeout (None without one). Sandboxed plugins are stopped at it; a
    Python handler should check it. Blocking lower matchers is the matcher's ``block`` flag
    alone, decided before the pool decision: a handler cannot block at run time.
    """

    __slots__ = ("event", "args", "matcher", "exec_class", "_replies", "deadline")

    def __init__(self, event: Event, args: str, matcher: Any, exec_class: ExecClass,
                 deadline: float | None = None) -> None:
        self.event = event
        self.args = args
        self.matcher = matcher
        self.exec_class = exec_class
        self._replies: list[tuple[str | None, Any]] | None = None  # made by the first reply()
        self.deadline = deadline

    def reply(self, text: str | None = None, data: Any = None) -> None:
        """Queue a reply; it is sent when the handler returns, with the handler's elapsed time."""
        item = (None if text is None else str(text), data)
        if self._replies is None:
            self._replies = [item]
        else:
            self._replies.append(item)

    @staticmethod
    def for_pool(event: Event, args: str, matcher: Any) -> "Context":
        """A pool thread's own context: the event's data is deep-copied (``_private_copy``), so no handler can see or
        tear another's, and the caller may reuse its event once dispatch returns.

        Raises BadEvent when the data cannot be copied (nested too deep for the copy, or a
        value that is not plain data): the engine reports it as that handler's failure."""
        data = event.data
        try:
            # An empty dict (every message from the protocol) needs no copy machinery (~1.5 us).
            data = {} if not data and type(data) is dict else _private_copy(data)
        except RecursionError:
            raise BadEvent(f"event {event.id}: its data is nested too deeply to be copied for a pooled handler "
                           f"({getattr(matcher, 'name', matcher)!r}); send data nested a few dozen levels at most "
                           "(the WebSocket protocol refuses deeper frames)") from None
        except Exception as exc:
            raise BadEvent(f"event {event.id}: its data cannot be copied for a pooled handler "
                           f"({getattr(matcher, 'name', matcher)!r}): {type(exc).__name__}: {exc}; send plain JSON "
                           "values (dict, list, str, number, bool, null)") from None
        private = Event(event.type, event.text, data, event.id, event.session, event.size, event.tenant)
        return Context(private, args, matcher, ExecClass.POOL)


class EventRun:
    """Tracks one event from dispatch until its last handler (inline or pooled) has finished.

    Until the dispatcher submits the first pooled handler, the run is touched by the
    dispatching thread alone (the entry points hand it out only once dispatch has returned),
    so the lock is created lazily by that first ``hold()``: an event whose handlers all run
    inline pays for no lock. The threading.Event (~1.5 us to make) is made only by a ``wait``
    that has to block; ``errors`` starts as an empty tuple (a list from the first failure on)
    and the done-callback list is made by the first ``add_done_callback`` that has to wait.
    An event that completes on the dispatching thread with no ``on_outcome`` to tell keeps
    its counts: its Completion is made when ``completion`` is first read.

    The run's clock is its handlers' (each clock read costs ~0.1 us on this path): it starts
    when the first handler starts (the engine's inline run sets ``_started`` to its own start
    time; a first pooled submission reads the clock in ``hold``) and an all-inline run
    ends when its last handler ended (``_ended``, set by the engine); a run that pooled
    anything ends at its last release. A run in which no handler ran took 0 s.
    """

    __slots__ = ("event", "_on_outcome", "_lock", "_pending", "_started", "_ended", "matched", "replies",
                 "errors", "blocked_by", "_completion", "_done", "_callbacks")

    event: Event
    _on_outcome: OutcomeCallback | None
    _lock: threading.Lock | None
    _pending: int  # the dispatcher's own hold (1 at first), released when dispatch ends; 0: done
    _started: float | None  # the first handler's start (see above)
    _ended: float  # the last inline handler's end (see above)
    matched: int
    replies: int
    errors: list[Failure] | tuple[()]
    blocked_by: str | None
    _completion: Completion | None
    _done: threading.Event | None
    _callbacks: list[Callable[[Completion], None]] | None

    def __new__(cls, event: Event, on_outcome: OutcomeCallback | None) -> EventRun:
        """The run of ``event``; ``on_outcome`` is told each Reply, Failure and the Completion."""
        return new_run(event, on_outcome)

    def hold(self) -> None:
        """One more handler of this event is outstanding (called before a pool submission)."""
        if self._lock is None:  # still on the dispatching thread alone: go multi-threaded now
            self._lock = threading.Lock()
            if self._started is None:
                self._started = monotonic()
        with self._lock:
            self._pending += 1

    def release(self) -> None:
        """One outstanding handler finished; the last release completes the event."""
        lock = self._lock
        if lock is None:  # nothing was ever pooled: no other thread can see this run
            self._pending -= 1
            # No other thread could have added a callback or be waiting; with nobody listening
            # the Completion is made when first read.
            if not self._pending and self._on_outcome is not None:
                self._deliver(self.completion)  # type: ignore[arg-type]
            return
        with lock:
            pending = self._pending - 1
            if pending:
                self._pending = pending
                return
            self._completion = completion = Completion(self.event.id, self.matched, self.replies,
                                                       tuple(self.errors), self.blocked_by,
                                                       monotonic() - self._started)  # type: ignore[operator]
            # Only now: ``done`` (read without the lock) must not be true before ``completion`` is set.
            self._pending = 0
            callbacks, self._callbacks = self._callbacks, None
            done = self._done
        if self._on_outcome is not None:
            self._deliver(completion)
        if done is not None:
            done.set()
        for cb in callbacks or ():
            try:
                cb(completion)
            except Exception as exc:
                _rlog.exception(("completion", type(exc).__name__), "completion callback %r failed", cb)

    @property
    def completion(self) -> Completion | None:
        """The event's one terminal record, or None while a handler is outstanding."""
        completion = self._completion
        if completion is None and not self._pending:  # completed inline: made when first read
            started = self._started
            completion = self._completion = Completion(self.event.id, self.matched, self.replies,
                                                       tuple(self.errors), self.blocked_by,
                                                       0.0 if started is None else self._ended - started)
        return completion

    @property
    def done(self) -> bool:
        """True once every handler has finished (``completion`` is then set)."""
        return not self._pending

    @property
    def outstanding(self) -> int:
        """Holds not yet released: the pooled handlers not finished, plus the dispatch itself
        while it runs or waits for a pool slot (0 once done)."""
        return self._pending

    def reply(self, matcher: str, plugin: str | None, text: str | None, data: Any, exec_class: ExecClass,
              elapsed: float) -> None:
        """Count one reply of a handler and pass it on, from whichever thread ran the handler;
        the Reply record is made only when an ``on_outcome`` listens."""
        lock = self._lock
        if lock is None:
            self.replies += 1
        else:
            with lock:
                self.replies += 1
        if self._on_outcome is not None:
            self._deliver(Reply(self.event.id, matcher, plugin, text, data, exec_class, elapsed))

    def emit(self, outcome: Reply | Failure) -> None:
        """Count and pass on a reply or a failure, from whichever thread ran the handler."""
        lock = self._lock
        if lock is None:
            if type(outcome) is Reply:
                self.replies += 1
            else:
                self.errors = [*self.errors, outcome]  # type: ignore[list-item]
        else:
            with lock:
                if type(outcome) is Reply:
                    self.replies += 1
                else:
                    self.errors = [*self.errors, outcome]  # type: ignore[list-item]
        if self._on_outcome is not None:
            self._deliver(outcome)

    def _deliver(self, outcome: Outcome) -> None:
        # The callback sends to a client that may be gone: its failure must neither stop the other
        # handlers of the event nor lose the completion (every accepted event ends in one).
        try:
            self._on_outcome(outcome)  # type: ignore[misc]
        except Exception as exc:
            # One cause, one traceback per interval: a client that breaks every send must not
            # flood the log (or cost the loop a traceback per event).
            _rlog.exception(("outcome", type(exc).__name__), "outcome callback failed for event %s",
                            self.event.id)

    def add_done_callback(self, fn: Callable[[Completion], None]) -> None:
        """Call ``fn(completion)`` when the event completes (at once if it already has)."""
        lock = self._lock
        if lock is not None:
            with lock:
                if self.completion is None:
                    if self._callbacks is None:
                        self._callbacks = [fn]
                    else:
                        self._callbacks.append(fn)
                    return
        elif self.completion is None:
            raise RuntimeError("EventRun used before its dispatch returned")
        fn(self.completion)

    def wait(self, timeout: float | None = None) -> Completion | None:
        """Block until every handler finished; the completion, or None on timeout."""
        lock = self._lock
        if self.completion is not None or lock is None:
            return self.completion  # done, or never pooled (complete once dispatch returned)
        with lock:  # made under the lock that release() completes under: no wake-up is missed
            if self.completion is not None:
                return self.completion
            if self._done is None:
                self._done = threading.Event()
            done = self._done
        done.wait(timeout)
        return self.completion

    async def wait_async(self) -> Completion:
        """Await completion from asyncio; pool threads hand the result to the loop safely."""
        if self.completion is not None:
            return self.completion
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Completion] = loop.create_future()

        def _set(c: Completion) -> None:
            if not fut.done():
                fut.set_result(c)

        def _resolve(c: Completion) -> None:
            loop.call_soon_threadsafe(_set, c)

        self.add_done_callback(_resolve)
        return await fut

    def __await__(self) -> Generator[Any, None, Completion]:
        return self.wait_async().__await__()


_new = object.__new__


def new_run(event: Event, on_outcome: OutcomeCallback | None) -> EventRun:
    """``EventRun(event, on_outcome)``, as the engine's entry points make one per event: a class
    call runs its ``__init__``/``__new__`` in a C-level interpreter frame of its own (CPython
    3.11), a function called from Python code runs in its caller's (~0.05 us less)."""
    run = _new(EventRun)
    run.event = event
    run._on_outcome = on_outcome
    run._lock = None
    run._pending = 1
    run._started = None
    run._ended = 0.0
    run.matched = 0
    run.replies = 0
    run.errors = ()
    run.blocked_by = None
    run._completion = None
    run._done = None
    run._callbacks = None
    return run
