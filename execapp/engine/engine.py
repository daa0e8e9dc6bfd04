"""Engine: matches events against matchers and runs each handler inline or in the pool."""
from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import threading
from functools import partial
from time import monotonic
from types import FrameType
from typing import Any, Callable, Coroutine, Iterable, Mapping, NamedTuple

from .backpressure import SlotWaiters
from .errors import (
    BadEvent,
    ConfigError,
    ExecAppError,
    HandlerError,
    HandlerTimeout,
    NotStarted,
    Overloaded,
    PoolClosed,
    describe,
)
from .event import Completion, Context, Event, EventRun, Failure, OutcomeCallback, new_run
from .matcher import MARK_SIZE, Handler, Matcher, MatcherKind, Routes
from .pool import MAX_WORKERS, QUEUE_SIZE, ExecPool, Watch, count_value
from .profile import ExecClass, ExecProfile
from .ratelog import RateLimitedLog

log = logging.getLogger("execapp.engine")
#: Handler failures and failures on the way to a handler: one traceback per cause per interval.
_rlog = RateLimitedLog(log)

#: The default inline budget (seconds), EXECAPP['INLINE_TIMEOUT_SECONDS']: chosen by the target
#: "no /ping on another connection waits more than 250 ms behind a misbehaving handler". A
#: sandboxed guest is stopped at its deadline plus a margin of a few ms to a few tens of ms
#: under load, and the overrun moves the matcher to the pool at once, so one misbehaving event
#: holds the loop ~0.1 s: 150 ms of headroom for the margin and a busy machine. It equals the
#: default promote-at-once bound (2 x SLOW_THRESHOLD_SECONDS): a run it stops would have been
#: promoted anyway.
INLINE_TIMEOUT = 0.1
#: How far past its inline budget an inline run may end before its matcher is quarantined (pool
#: only for good, as the watchdog's stall quarantine): a sandbox stops a guest within a few ms to
#: a few tens of ms of the deadline, so a run this late did something no deadline reaches (a
#: QuickJS BigInt turned into text held a real worker's loop 3.4 s, and 46 fast runs later the
#: handler was inline again, to do it again). Also the target: no /ping waits longer than this.
INLINE_ESCAPE_SECONDS = 0.25
#: The default longest wait for a pool slot under the ``wait`` overflow policy (seconds),
#: EXECAPP['OVERFLOW_WAIT_SECONDS']: it bounds how long a client can wait before `overloaded`.
OVERFLOW_WAIT = 1.0

# One clock for deadlines and durations: on Linux time.monotonic is CLOCK_MONOTONIC with ns
# resolution (as perf_counter), and one call per run serves both.
_clock = monotonic

#: Observer of every finished handler run: (matcher, exec class, elapsed seconds, outcome code,
#: the event it ran for).
RunObserver = Callable[[Matcher, ExecClass, float, str, Event], None]

#: What ``process_event_async`` does when the pool is full (see Engine), the default first.
OVERFLOW_POLICIES = ("wait", "reject", "inline")
#: The engine's counters (``Engine.counts``; the dashboard and /metrics read them by these names).
COUNTERS = ("events", "inline", "pooled", "fallbacks", "overloaded", "errors")
#: Profiles of matchers no longer registered that an engine keeps, the most recently retired:
#: a plugin disabled and enabled again (or a binding changed back) finds what was learned. Kept
#: without a bound, every matcher name ever registered stayed (~3 KB each, more with samples), and
#: a plugin with 100 bindings of one handler re-saved with new patterns added 100 a save, in every
#: worker, each walked by the metrics, persistence and watchdog passes.
RETIRED_PROFILES = 1024

_POOL = ExecClass.POOL
_SYNC = ExecClass.SYNC
_COMMAND = MatcherKind.COMMAND
_REGEX = MatcherKind.REGEX
_new_context = object.__new__


class _Parked(NamedTuple):
    """A dispatch suspended on a full pool (asyncio path, policy ``wait``): where to resume."""

    plan: tuple[Matcher, ...]
    at: int  # the plan's index of the parked matcher (``index`` would shadow tuple.index)
    task: Callable[[], None]
    matcher: Matcher
    blocking: bool
    cmd_args: str


class Engine:
    """The adaptive dispatcher (docs/architecture.md, "Design rules": the adaptive engine).

    ``pool``: a shared ExecPool owned by the caller (``shutdown`` leaves it running);
    otherwise the engine makes and owns one (``shutdown`` drains it). ``pool_enabled=False``
    runs every handler inline.

    ``overflow`` is what ``process_event_async`` does when a pooled handler finds the pool
    full (the asyncio path must never block its loop):

    - ``wait``: the dispatch waits in line, first come first served, woken as the pool frees
      room (no polling; a safety re-check every ``overflow_recheck`` seconds), for up to
      ``overflow_wait`` seconds; the loop keeps serving everyone
      else meanwhile (backpressure on that client only). Past the wait the handler is refused
      with code ``overloaded``. Once anyone waits, later pooled handlers queue behind them.
    - ``reject``: refuse the handler at once with code ``overloaded``.
    - ``inline``: the seed's fallback, run it on the loop (stalls every connection for as
      long as the handler runs; measured in bench/bench_engine.py).

    A draining pool refuses with code ``draining`` under ``wait`` and ``reject``. A refused
    handler is reported as a Failure, the rest of the event still runs (unless the refused
    matcher has ``block=True``: blocking does not depend on where, or whether, it ran) and the
    event completes. The synchronous ``process_event`` always falls back inline: its caller
    is a thread, not a loop, and the event must not be dropped.

    Containment (docs/architecture.md, "Design rules"): an inline run gets
    ``ctx.deadline = start + inline_timeout`` (a sandboxed plugin is stopped there; None
    disables the budget); a run that times out or
    overruns it while inline promotes its matcher at once. A pooled run of a matcher with a
    ``timeout`` is watched by the pool's watcher: past it the handler is reported ``timeout``,
    the event completes, the thread is counted stuck and its late result is discarded. A
    handler raising anything (BaseException included) is a Failure recorded in its profile;
    so is a handler that never ran because its event could not be copied (``bad_event``) or
    submitted. ``set_inline_slot`` names the inline run in a shared buffer for a watchdog.
    """

    def __init__(
        self,
        *,
        pool: ExecPool | None = None,
        pool_enabled: bool = True,
        max_workers: int = MAX_WORKERS,
        queue_size: int = QUEUE_SIZE,
        profile_factory: Callable[[], ExecProfile] = ExecProfile,
        overflow: str = OVERFLOW_POLICIES[0],
        overflow_wait: float = OVERFLOW_WAIT,
        inline_timeout: float | None = INLINE_TIMEOUT,
        overflow_recheck: float = 0.02,
    ) -> None:
        if overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"overflow={overflow!r}; use one of {', '.join(OVERFLOW_POLICIES)}")
        if inline_timeout is not None and (isinstance(inline_timeout, bool)
                                           or not isinstance(inline_timeout, (int, float)) or not inline_timeout > 0):
            raise ConfigError(f"inline_timeout={inline_timeout!r}; use a number of seconds > 0 (default "
                              f"{INLINE_TIMEOUT}), or None for no inline budget")
        self.inline_timeout = inline_timeout
        # The watchdog's view of the loop (set_inline_slot): None, or a writable 64-byte buffer.
        self._slot: memoryview | None = None
        self._slot_mark = b""  # the mark the slot holds past its first byte (see _run_inline)
        self.owns_pool = pool is None and pool_enabled
        self.pool: ExecPool | None = pool if pool is not None else (
            ExecPool(max_workers, queue_size) if pool_enabled else None)
        self.pool_enabled = pool_enabled
        self.overflow = overflow
        self.overflow_wait = overflow_wait
        self._profile_factory = profile_factory
        self.profiles: dict[str, ExecProfile] = {}
        self._profiles_lock = threading.Lock()
        # Names in ``profiles`` no registered matcher has, oldest retired first (set_matchers).
        self._retired: dict[str, None] = {}
        # Copy-on-write: dispatch reads one Routes (the matchers and their per-event-shape
        # candidates) that registration replaces, never mutates.
        self._routes = Routes()
        self._register_lock = threading.Lock()
        self._naming_lock = threading.Lock()
        self._seq = itertools.count()
        self._observers: list[RunObserver] = []
        # Counters bumped from the loop and from pool threads without a lock: next() on an
        # itertools.count is one C call, so no increment is lost between threads, and it costs
        # ~0.04 us where a lock round trip costs ~0.15 us on every event.
        self._tally = {key: itertools.count() for key in COUNTERS}
        self._n_events = self._tally["events"]
        self._n_inline = self._tally["inline"]
        self._n_pooled = self._tally["pooled"]
        self._waiters = SlotWaiters(overflow_recheck)  # dispatches awaiting a pool slot (asyncio path, policy "wait")
        if self.pool is not None:
            # Freed room in the pool wakes the oldest waiter; the listener holds the waiters, not
            # the engine, so a shared pool keeps nothing big alive.
            self.pool.add_capacity_listener(self._waiters.on_capacity)

    # -- registration ---------------------------------------------------------------------------

    def profile_for(self, name: str) -> ExecProfile:
        """The profile of the matcher called ``name``, created on first use and kept across
        re-registration (so a refreshed plugin keeps what was learned about it)."""
        with self._profiles_lock:
            profile = self.profiles.get(name)
            if profile is None:
                profile = self.profiles[name] = self._profile_factory()
            return profile

    def make_matcher(self, kind: MatcherKind | str, pattern: str, handler: Handler, *, priority: int = 0,
                     block: bool = False, name: str | None = None, plugin: str | None = None,
                     timeout: float | None = None) -> Matcher:
        """Build a matcher with its profile (not yet registered; see ``add`` and ``set_matchers``).

        ``name`` keys the profile (and its persisted record); the default is ``kind:pattern``,
        so rebuilding the same registration (a refresh) finds the profile it learned.
        ``timeout`` (seconds) defaults to the handler's own ``timeout`` attribute, if any (a
        plugin's engine_handler carries its plugin's timeout plus a grace).
        """
        kind = MatcherKind(kind)
        name = name or f"{kind.value}:{pattern}"
        if timeout is None:
            timeout = getattr(handler, "timeout", None)
        return Matcher(kind=kind, pattern=pattern, handler=handler, profile=self.profile_for(name), name=name,
                       priority=priority, block=block, plugin=plugin, seq=next(self._seq), timeout=timeout)

    def add(self, matcher: Matcher) -> Matcher:
        """Register one matcher."""
        with self._register_lock:
            self._routes = Routes(tuple(sorted(self._routes.matchers + (matcher,), key=Matcher.sort_key)))
        return matcher

    def set_matchers(self, matchers: Iterable[Matcher]) -> None:
        """Replace every matcher at once (a plugin refresh); events in flight keep the old set."""
        with self._register_lock:
            self._routes = Routes(tuple(sorted(matchers, key=Matcher.sort_key)))
            self._retire_profiles({m.name for m in self._routes.matchers})

    def _retire_profiles(self, live: set[str]) -> None:
        """Keep the profiles of ``live`` matchers and of the RETIRED_PROFILES most recently retired."""
        with self._profiles_lock:
            retired = {name: None for name in self._retired if name not in live}
            retired.update((name, None) for name in self.profiles if name not in live and name not in retired)
            for name in list(retired)[:max(0, len(retired) - RETIRED_PROFILES)]:
                del retired[name]
                self.profiles.pop(name, None)
            self._retired = retired

    @property
    def matchers(self) -> tuple[Matcher, ...]:
        """Registered matchers in dispatch order."""
        return self._routes.matchers

    def on_command(self, name: str, handler: Handler, *, priority: int = 0, block: bool = False,
                   matcher_name: str | None = None, plugin: str | None = None,
                   timeout: float | None = None) -> Matcher:
        """Run ``handler`` for ``/name ...`` messages; ``ctx.args`` is the text after the name."""
        return self._register(MatcherKind.COMMAND, name, handler, priority, block, matcher_name, plugin, timeout)

    def on_regex(self, pattern: str, handler: Handler, *, priority: int = 0, block: bool = False,
                 matcher_name: str | None = None, plugin: str | None = None,
                 timeout: float | None = None) -> Matcher:
        """Run ``handler`` for messages whose text matches ``pattern`` anywhere (RE2: linear_regex)."""
        return self._register(MatcherKind.REGEX, pattern, handler, priority, block, matcher_name, plugin, timeout)

    def on_event(self, event_type: str, handler: Handler, *, priority: int = 0, block: bool = False,
                 matcher_name: str | None = None, plugin: str | None = None,
                 timeout: float | None = None) -> Matcher:
        """Run ``handler`` for every event of ``event_type``."""
        return self._register(MatcherKind.EVENT, event_type, handler, priority, block, matcher_name, plugin, timeout)

    def _register(self, kind: MatcherKind, pattern: str, handler: Handler, priority: int, block: bool,
                  name: str | None, plugin: str | None, timeout: float | None) -> Matcher:
        # A second on_* handler of the same pattern gets its own default name (``#2``, ...): two
        # handlers must not share a profile, or one slow handler would pool the other. Naming
        # and adding share a lock so two registrations cannot pick the same name.
        with self._naming_lock:
            if name is None:
                base = f"{kind.value}:{pattern}"
                taken = {m.name for m in self._routes.matchers}
                name = base if base not in taken else next(
                    f"{base}#{n}" for n in itertools.count(2) if f"{base}#{n}" not in taken)
            return self.add(self.make_matcher(kind, pattern, handler, priority=priority, block=block, name=name,
                                              plugin=plugin, timeout=timeout))

    def add_observer(self, fn: RunObserver) -> None:
        """Call ``fn`` after every handler run (metrics); it must be cheap and must not raise."""
        self._observers.append(fn)

    # -- containment hooks (execapp.watchdog) ---------------------------------------------------

    def set_inline_slot(self, buf: Any) -> None:
        """Name every inline run in ``buf`` (a writable buffer of >= 64 bytes, e.g. a memoryview of
        shared memory; None stops): before the run buf[0:64] = the matcher's mark (its name,
        UTF-8, NUL-padded), after it buf[0] = 0. A supervisor that finds the loop stalled reads
        which handler holds it, even after the worker is killed. Costs ~0.1-0.3 us per run."""
        if buf is None:
            self._slot = None
            return
        view = memoryview(buf).cast("B")
        if view.readonly or len(view) < MARK_SIZE:
            raise ConfigError(f"inline slot of {len(view)} bytes (readonly={view.readonly}); pass a writable "
                              f"buffer of at least {MARK_SIZE} bytes")
        view = view[:MARK_SIZE]
        view[0] = 0
        self._slot_mark = b""
        self._slot = view

    def quarantine(self, name: str, reason: str = "quarantined") -> ExecProfile:
        """Pin the matcher called ``name`` to the pool for good (its profile persists it), e.g.
        after it stalled a worker's loop; ``release_quarantine`` lifts it. Works before the
        matcher is registered (a new worker applies the quarantine list before it serves)."""
        profile = self.profile_for(name)
        profile.quarantine(reason)
        return profile

    def release_quarantine(self, name: str) -> ExecProfile:
        """Let the matcher called ``name`` earn inline again (a full window of fresh fast runs)."""
        profile = self.profile_for(name)
        profile.release_quarantine()
        return profile

    # -- dispatch -------------------------------------------------------------------------------

    def process_event(self, event: Event | Mapping[str, Any], on_outcome: OutcomeCallback | None = None) -> EventRun:
        """Dispatch adaptively; a full pool falls back inline. Wait on or await the returned run."""
        run = new_run(event if type(event) is Event else _as_event(event), on_outcome)
        self._dispatch(run, self.pool_enabled, False)
        return run

    def process_event_sync(self, event: Event | Mapping[str, Any],
                           on_outcome: OutcomeCallback | None = None) -> Completion:
        """Run every matched handler inline, in order, and return the completion (deterministic)."""
        run = new_run(event if type(event) is Event else _as_event(event), on_outcome)
        self._dispatch(run, False, False)
        return run.completion  # type: ignore[return-value]

    async def process_event_async(self, event: Event | Mapping[str, Any],
                                  on_outcome: OutcomeCallback | None = None) -> EventRun:
        """Dispatch from an event loop: inline handlers run here, pooled ones in threads, and a
        full pool applies the overflow policy instead of blocking the loop. Returns once every
        handler is running or done; await the run for completion (``run.completion`` is already
        set when every handler ran inline). Awaits nothing unless a handler waits for a slot."""
        run = new_run(event if type(event) is Event else _as_event(event), on_outcome)
        parked = self._dispatch(run, self.pool_enabled, True)
        if parked is not None:
            await self._finish_parked(run, parked)
        return run

    def start_event(self, event: Event | Mapping[str, Any], on_outcome: OutcomeCallback | None = None,
                    ahead: Callable[[], bool] | None = None
                    ) -> tuple[EventRun, Coroutine[Any, Any, EventRun] | None]:
        """``process_event_async`` without a coroutine of its own, for a caller on the event loop
        (the protocol): dispatch now and return (run, rest). ``rest`` is None when dispatch is
        over (inline handlers done, pooled ones running): nothing was allocated for the loop. It
        is a coroutine when a pooled handler waits for a slot (policy ``wait``); the caller must
        await it (it returns the run), or the event never completes. ``ahead`` is asked only
        then: True puts this dispatch in the lane of waiters woken first (SlotWaiters)."""
        run = new_run(event if type(event) is Event else _as_event(event), on_outcome)
        parked = self._dispatch(run, self.pool_enabled, True)
        if parked is None:
            return run, None
        return run, self._finish_parked(run, parked, ahead is not None and ahead())

    async def _finish_parked(self, run: EventRun, parked: _Parked | None, ahead: bool = False) -> EventRun:
        """The rest of a dispatch that found the pool full: wait for slots, resume, repeat."""
        while parked is not None:
            try:
                submitted = await self._await_slot(parked.task, ahead, run.event.tenant)
            except BaseException:
                # Cancelled while waiting (the client went away): the parked handler never runs,
                # the rest of the dispatch is abandoned, and the event still completes once.
                run.release()
                next(self._n_events)
                run.release()
                raise
            parked = self._resume(run, parked, submitted)
        return run

    async def _await_slot(self, task: Callable[[], None], ahead: bool = False, owner: str = "") -> bool:
        """Backpressure for one client: wait in line for a pool slot, up to ``overflow_wait``."""
        pool = self.pool
        assert pool is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.overflow_wait
        first = False
        while not pool.closed:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await self._waiters.wait(remaining, first=first, ahead=ahead):
                return False
            if self._try_submit(pool, task, owner):
                return True
            # Woken by a task that has returned but whose worker may not have stepped on to
            # free its slot yet: let it (one loop turn), then keep our place at the head.
            await asyncio.sleep(0)
            if self._try_submit(pool, task, owner):
                return True
            first = True
        self._waiters.notify()  # draining: let the next in line find out too
        return False

    @staticmethod
    def _try_submit(pool: ExecPool, task: Callable[[], None], owner: str = "") -> bool:
        """A retry of a parked dispatch; a pool that cannot start a thread counts as full."""
        try:
            return pool.try_submit(task, count_rejection=False, owner=owner)
        except Exception as exc:
            _rlog.exception(("submit", type(exc).__name__), "pool submission failed: %r", exc)
            return False

    def _dispatch(self, run: EventRun, allow_pool: bool, on_loop: bool, plan: tuple[Matcher, ...] | None = None,
                  start: int = 0, cmd_args: str = "") -> _Parked | None:
        """The dispatch loop of docs/architecture.md ("Design rules"), shared by every entry point.

        Runs the event's candidate matchers (``Routes.plan``: a snapshot, registration replaces
        it), or, resuming, ``plan[start:]``. Returns None once dispatch is over (its hold on the
        run released), or a ``_Parked`` when, on the event loop (``on_loop``) with policy
        ``wait``, a pooled handler found the pool full: the caller awaits a slot and resumes
        with ``_resume``. Every inline event pays for this loop, so it is written flat.
        """
        event = run.event
        text = event.text
        if plan is None:  # Routes.plan, inlined: this runs for every event
            routes = self._routes
            etype = event.type
            if etype != "message":
                plan = routes.types.get(etype, ())
            else:
                plan = routes.message
                if text[:1] == "/":
                    head, _, rest = text.partition(" ")
                    commands = routes.heads.get(head)
                    if commands is not None:
                        plan, cmd_args = commands, rest.strip()
        size = event.size
        budget = self.inline_timeout
        # The end of this dispatch's inline budget, from its first inline run's start (None: none
        # ran yet, or no budget): a handler starts inline only before it, so one frame matching
        # many proven-fast handlers holds the loop for at most about twice the budget (the last
        # one started may use its whole own budget); the rest go to the pool.
        cutoff: float | None = None
        done = False
        try:
            # Most events start at 0: iterate the tuple itself (its position is only needed to park).
            for m in (plan if not start else plan[start:]):
                kind = m.kind
                if kind is _COMMAND:  # a candidate command always matches: Routes keyed it by name
                    args = cmd_args
                elif kind is _REGEX and m._regex.search(text) is None:  # type: ignore[union-attr]
                    continue
                else:
                    args = text
                run.matched += 1
                blocking = m.block  # 1. computed before any pool decision
                # The class, and the size this handler has earned inline (a much larger event goes
                # to the pool before it runs; the profile is not changed by this decision): what
                # m.profile.should_pool(size) says, read as one attribute (-1 while pooled).
                if allow_pool and size <= m.profile.inline_limit and (cutoff is None or run._ended < cutoff):
                    # 4. proven fast: inline, with the inline budget (a privilege) ...
                    started = self._run_inline(run, m, args, budget, size, True)
                    if started:
                        if cutoff is None and budget is not None:
                            cutoff = started + budget
                        next(self._n_inline)
                        if blocking:
                            run.blocked_by = m.name
                            break
                        continue
                    # ... unless it could not start there (NotStarted: its plugin's slots were all
                    # taken, and the loop must not wait for one): the pool, where it may wait. So
                    # does a proven-fast handler once this dispatch's inline budget is spent.
                if allow_pool:
                    pool = self.pool
                    if pool is not None:
                        # 2. clone first: the pool thread gets a private context and event data.
                        try:
                            task = partial(self._run_pooled, run, Context.for_pool(event, args, m))
                        except BadEvent as exc:
                            self._not_run(run, m, exc.code, str(exc), None)
                            if blocking:
                                break
                            continue
                        run.hold()
                        # On the loop with policy "wait", a dispatch that finds others already in
                        # line for a slot queues behind them (first come, first served).
                        try:
                            submitted = (not (on_loop and self._waiters and self.overflow == "wait")
                                         and pool.try_submit(task, owner=event.tenant))
                        except Exception as exc:  # e.g. no thread could be started
                            run.release()
                            self._not_run(run, m, HandlerError.code,
                                          f"handler {m.name!r} could not be submitted to the pool: {exc!r}; "
                                          "lower EXECAPP['POOL_MAX_WORKERS'] or raise the process's thread limit",
                                          exc)
                            if blocking:
                                break
                            continue
                        if submitted:
                            next(self._n_pooled)
                            if blocking:
                                run.blocked_by = m.name
                                break
                            continue
                        if on_loop and self.overflow != "inline":  # the loop must never block
                            if self.overflow == "wait" and not pool.closed:
                                done = True  # the dispatch hold passes to the parked state
                                # A matcher appears once in a plan (Matcher compares by identity).
                                return _Parked(plan, plan.index(m, start), task, m, blocking, cmd_args)
                            run.release()
                            self._refuse(run, m, pool)
                            if blocking:
                                break
                            continue
                        run.release()
                        self._count("fallbacks")  # 3. pool full: run inline, drop nothing
                    # Not proven fast, inline only by necessity: the handler's own deadline.
                    self._run_inline(run, m, args, m.timeout, size, False)
                else:
                    self._run_inline(run, m, args, m.timeout, size, False)  # no pool to move to (sync, or disabled)
                next(self._n_inline)
                if blocking:
                    run.blocked_by = m.name
                    break
        finally:
            if not done:  # the dispatcher's hold on the run ends with its loop
                next(self._n_events)
                run.release()
        return None

    def _resume(self, run: EventRun, parked: _Parked, submitted: bool) -> _Parked | None:
        """Continue a dispatch parked on a full pool, once a slot was found (or not)."""
        m = parked.matcher
        if submitted:
            self._count("pooled")
        else:
            run.release()
            self._refuse(run, m, self.pool)
        if parked.blocking:
            if submitted:
                run.blocked_by = m.name
            next(self._n_events)
            run.release()
            return None
        return self._dispatch(run, True, True, parked.plan, parked.at + 1, parked.cmd_args)

    def _refuse(self, run: EventRun, m: Matcher, pool: ExecPool | None) -> None:
        """The asyncio path found the pool full (or draining) and will not block the loop."""
        if pool is not None and pool.closed:
            code, message = PoolClosed.code, (f"pool draining: handler {m.name!r} refused; "
                                              "retry on another worker")
        else:
            code = Overloaded.code
            message = (f"pool full: handler {m.name!r} refused (overflow policy {self.overflow!r}); retry later "
                       "or raise EXECAPP['POOL_MAX_WORKERS']")
        self._count("overloaded")
        if m.block:
            run.blocked_by = m.name
        run.emit(Failure(run.event.id, m.name, m.plugin, code, message, None, 0.0))

    def _not_run(self, run: EventRun, m: Matcher, code: str, message: str, exc: BaseException | None) -> None:
        """A handler that could not be started (its event could not be copied, or submitted):
        one Failure for it and an error in its profile (no duration sample: it did not run)."""
        self._count("errors")
        m.profile.note_error(message)
        if exc is None:
            _rlog.warning((code, m.name), "handler %s not run: %s", m.name, message)
        else:
            _rlog.log(logging.ERROR, (code, m.name, type(exc).__name__), "handler %s not run: %s", m.name, message,
                      exc_info=exc)
        if m.block:
            run.blocked_by = m.name
        run.emit(Failure(run.event.id, m.name, m.plugin, code, message, None, 0.0))

    def _run_pooled(self, run: EventRun, ctx: Context) -> None:
        """The pool task of one handler: run it (watched when its matcher has a timeout), then
        release its hold on the event, unless the watcher already reported it late."""
        in_time = True
        pool = self.pool
        assert pool is not None  # for the type checker: only the pool runs this task
        try:
            in_time = self._invoke(run, ctx, ctx.matcher.timeout, pool)
        finally:
            if in_time:
                run.release()

    def _run_inline(self, run: EventRun, m: Matcher, args: str, budget: float | None, size: int,
                    may_defer: bool) -> float:
        """Run one handler on the calling thread (the event loop, on the asyncio path), record its
        duration in its profile and emit its outcome: the hot path of every inline event. 0.0,
        with nothing recorded or emitted, when ``may_defer`` and the handler raised NotStarted
        (the caller runs it in the pool instead); otherwise the run's start (clock seconds, > 0).

        ``budget``: seconds from the start to ``ctx.deadline`` (None: no deadline); a run that
        times out or outlasts it promotes its matcher at once. ``size``: the event's, as the
        dispatch read it (an Event's fields sit in its instance dict, which CPython 3.11 reads
        through the generic attribute lookup: read once). The handler is named in the
        watchdog's slot while it runs. (``running_handlers`` finds it by this frame's ``m``.)
        """
        slot = self._slot
        if slot is not None:
            # While one matcher keeps running inline, clearing the slot zeroed only its first
            # byte and the rest still holds that matcher's mark: restoring one byte names it
            # again. Another matcher's mark is copied whole (64 bytes).
            mark = m.mark
            if mark is self._slot_mark:
                slot[0] = mark[0]
            else:
                slot[:] = mark
                self._slot_mark = mark
        started = _clock()
        if run._started is None:  # the run's clock is its handlers' (EventRun): no read of its own
            run._started = started
        # Context(run.event, args, m, _SYNC, deadline) without the __init__ frame (~0.06 us of ~1 us
        # per event): the same slots, set here.
        ctx = _new_context(Context)
        ctx.event = run.event
        ctx.args = args
        ctx.matcher = m
        ctx.exec_class = _SYNC
        ctx._replies = None
        ctx.deadline = None if budget is None else started + budget
        handler = m.handler  # m.handler(ctx) would look "handler" up as a method first, then in m
        try:
            result = handler(ctx)
        except BaseException as exc:  # a handler error is reported, never propagated (SystemExit too)
            run._ended = ended = _clock()
            elapsed = ended - started
            if slot is not None:
                slot[0] = 0
            if may_defer and isinstance(exc, NotStarted):
                return 0.0
            if budget is not None and elapsed > budget + INLINE_ESCAPE_SECONDS:
                self._escaped(m, elapsed, budget)
            self._failed(run, m, exc, _SYNC, elapsed, budget is not None and elapsed > budget)
            return started
        run._ended = ended = _clock()
        elapsed = ended - started
        if slot is not None:
            slot[0] = 0
        if budget is not None and elapsed > budget:
            # An inline run past its budget (a Python handler cannot be stopped) moves to the
            # pool at once; its result still counts: it ran to the end.
            if elapsed > budget + INLINE_ESCAPE_SECONDS:
                self._escaped(m, elapsed, budget)
            m.profile.record(elapsed, overrun=True)
        else:
            m.profile.record(elapsed, size)
        if result is not None or ctx._replies is not None:
            self._emit_replies(run, m, ctx, result, elapsed)
        if self._observers:  # the loop is written out here: a method call per run shows inline
            for observe in self._observers:
                try:
                    observe(m, _SYNC, elapsed, "ok", run.event)
                except Exception:  # metrics must never break dispatch
                    _rlog.exception(("observer", id(observe)), "run observer %r failed", observe)
        return started

    @staticmethod
    def _escaped(m: Matcher, elapsed: float, budget: float) -> None:
        """``m`` ran inline ``elapsed`` s, past its ``budget`` by more than INLINE_ESCAPE_SECONDS:
        quarantine it (never inline again until an operator releases it), and say so once."""
        if m.profile.quarantined is not None:
            return
        reason = (f"held the event loop {elapsed:.2f} s running inline, past the inline budget of {budget:g} s by "
                  f"more than {INLINE_ESCAPE_SECONDS:g} s: something in it is out of reach of its deadline")
        m.profile.quarantine(reason)
        _rlog.log(logging.ERROR, ("escaped", m.name), "matcher %s %s; quarantined: it runs in the pool only from "
                  "now on (docs/operations.md, \"Releasing a quarantine\")", m.name, reason)

    def _invoke(self, run: EventRun, ctx: Context, budget: float | None, pool: ExecPool) -> bool:
        """Run one pooled handler, record its duration in its profile and emit its outcome.

        ``budget``: seconds from now to ``ctx.deadline`` (None: no deadline); the run is then
        watched: if the watcher reports it late first, this returns False and the late outcome
        is dropped (never emitted twice).
        (``running_handlers`` below finds running handlers by this frame and its ``ctx`` argument.)
        """
        m: Matcher = ctx.matcher
        started = _clock()
        watch: Watch | None = None
        if budget is not None:
            ctx.deadline = started + budget
            try:
                watch = pool.watch(ctx.deadline, partial(self._overrun, run, ctx, started))
            except Exception as exc:  # no watcher thread: run unwatched rather than not at all
                _rlog.exception(("watch", type(exc).__name__), "handler %s runs unwatched: %r", m.name, exc)
        try:
            result = m.handler(ctx)
        except BaseException as exc:  # a handler error is reported, never propagated (SystemExit too)
            elapsed = _clock() - started
            if watch is not None and not pool.finish(watch):
                return False
            self._failed(run, m, exc, ctx.exec_class, elapsed, False)
            return True
        elapsed = _clock() - started
        if watch is not None and not pool.finish(watch):
            return False
        m.profile.record(elapsed, ctx.event.size)
        if result is not None or ctx._replies is not None:
            self._emit_replies(run, m, ctx, result, elapsed)
        if self._observers:
            self._observe(m, ctx.exec_class, elapsed, "ok", run.event)
        return True

    def _failed(self, run: EventRun, m: Matcher, exc: BaseException, exec_class: ExecClass, elapsed: float,
                overrun: bool) -> None:
        """A handler raised: one Failure, an error (a timeout or an inline ``overrun`` promotes at
        once) in its profile, counted and observed."""
        if isinstance(exc, ExecAppError):
            code, message = exc.code, describe(exc) or type(exc).__name__
        else:
            code = HandlerError.code
            message = describe(exc) or type(exc).__name__
            if not isinstance(exc, Exception):
                message = (f"handler {m.name!r} raised {type(exc).__name__}({message}); a handler must return "
                           "or raise an Exception, never stop the server")
            _rlog.warning(("handler", m.name, type(exc).__name__), "handler %s failed: %s: %s", m.name,
                          type(exc).__name__, message)
        m.profile.record(elapsed, error=message, timeout=code == HandlerTimeout.code, overrun=overrun)
        self._count("errors")
        run.emit(Failure(run.event.id, m.name, m.plugin, code, message, exec_class, elapsed))
        if self._observers:
            self._observe(m, exec_class, elapsed, code, run.event)

    @staticmethod
    def _emit_replies(run: EventRun, m: Matcher, ctx: Context, result: Any, elapsed: float) -> None:
        """A handler's replies: its ``ctx.reply()`` calls in order, then its return value."""
        if ctx._replies is None:  # the common case: the return value alone
            if isinstance(result, str):
                run.reply(m.name, m.plugin, result if result.__class__ is str else str(result), None,
                          ctx.exec_class, elapsed)
            else:
                run.reply(m.name, m.plugin, None, result, ctx.exec_class, elapsed)
            return
        if result is not None:
            ctx.reply(*((result, None) if isinstance(result, str) else (None, result)))
        for text, data in ctx._replies:
            run.reply(m.name, m.plugin, text, data, ctx.exec_class, elapsed)

    def _overrun(self, run: EventRun, ctx: Context, started: float) -> None:
        """The pool's watcher found a pooled run past its deadline: report ``timeout`` now and
        complete the event (the thread runs on, counted stuck; its result will be dropped)."""
        m: Matcher = ctx.matcher
        elapsed = _clock() - started
        if m.plugin is not None:
            message = (f"handler {m.name!r} of plugin {m.plugin!r} did not stop within its backstop "
                       f"({m.timeout:g} s: a wait for a slot and a run, each up to its timeout, plus a grace) "
                       "though its sandbox should have stopped it; its thread is stuck and its late result will be "
                       "discarded")
        else:
            message = (f"handler {m.name!r} ran past its timeout of {m.timeout:g} s; it keeps running in its pool "
                       "thread (counted as stuck) and its late result will be discarded; make it return sooner "
                       "(check ctx.deadline) or raise its timeout")
        _rlog.warning(("overrun", m.name), "%s", message)
        m.profile.record(elapsed, error=message, timeout=True)
        self._count("errors")
        try:
            run.emit(Failure(run.event.id, m.name, m.plugin, HandlerTimeout.code, message, ExecClass.POOL, elapsed))
            if self._observers:
                self._observe(m, ExecClass.POOL, elapsed, HandlerTimeout.code, run.event)
        finally:
            run.release()

    def _observe(self, m: Matcher, exec_class: ExecClass, elapsed: float, code: str, event: Event) -> None:
        for observe in self._observers:
            try:
                observe(m, exec_class, elapsed, code, event)
            except Exception:  # metrics must never break dispatch
                _rlog.exception(("observer", id(observe)), "run observer %r failed", observe)

    def _count(self, key: str) -> None:
        next(self._tally[key])

    @property
    def counts(self) -> dict[str, int]:
        """Engine counters: events, inline and pooled runs, fallbacks, overloaded refusals, errors."""
        return {key: count_value(c) for key, c in self._tally.items()}

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """How many dispatches wait in line for a pool slot now (asyncio path, policy "wait")."""
        return len(self._waiters)

    def stats(self) -> dict[str, Any]:
        """Engine counters plus the pool's stats (None without a pool)."""
        return {**self.counts, "pool": self.pool.stats() if self.pool else None}

    def shutdown(self, timeout: float | None = None) -> bool:
        """Drain the pool if this engine owns it; a shared pool is the caller's and keeps running."""
        if self.owns_pool and self.pool is not None:
            return self.pool.drain(timeout)
        return True


def running_handlers() -> list[str]:
    """Names of the matchers whose handlers are executing right now, on any thread of the process.

    Read from the threads' stacks (frames inside ``Engine._invoke``, whose Context argument names
    the matcher) rather than tracked per call: it costs nothing on the event path, sees inline
    and pooled runs alike, and is only needed when a drain times out. Sorted, one entry per call.
    """
    # The frames of a handler run: a pooled run's _invoke (its Context argument names the
    # matcher) and an inline run's _run_inline (its Matcher argument). Found by type among the
    # arguments (set before the frame's first line runs), so renaming a local or a parameter
    # cannot blind this.
    runners = {code: code.co_varnames[:code.co_argcount]
               for code in (Engine._invoke.__code__, Engine._run_inline.__code__)}
    names: list[str] = []
    for frame in sys._current_frames().values():
        f: FrameType | None = frame
        while f is not None:
            params = runners.get(f.f_code)
            if params is not None:
                f_locals = f.f_locals
                found = next((v for v in (f_locals.get(p) for p in params) if isinstance(v, (Context, Matcher))),
                             None)
                matcher = found.matcher if isinstance(found, Context) else found
                names.append(str(getattr(matcher, "name", "?")))
                break
            f = f.f_back
    return sorted(names)


def _as_event(event: Event | Mapping[str, Any]) -> Event:
    if isinstance(event, Event):
        return event
    fields = {k: event[k] for k in ("type", "text", "data", "id", "session", "size") if event.get(k) is not None}
    return Event(**fields)
