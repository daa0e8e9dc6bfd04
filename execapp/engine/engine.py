"""Engine: matches events against matchers and runs each handler inline or in the pool."""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Any, Callable, Generator, Iterable, Mapping

from .errors import ConfigError, ExecAppError, Overloaded
from .event import Completion, Context, Event, EventRun, Failure, OutcomeCallback, Reply
from .matcher import Handler, Matcher, MatcherKind, parse_command
from .pool import ExecPool
from .profile import ExecClass, ExecProfile

log = logging.getLogger("execapp.engine")

#: Observer of every finished handler run: (matcher, exec class, elapsed seconds, outcome code).
RunObserver = Callable[[Matcher, ExecClass, float, str], None]

OVERFLOW_POLICIES = ("inline", "wait", "reject")


class Engine:
    """The adaptive dispatcher (design.md §2).

    ``pool``: a shared ExecPool owned by the caller (``shutdown`` leaves it running);
    otherwise the engine makes and owns one (``shutdown`` drains it). ``pool_enabled=False``
    runs every handler inline. ``overflow`` is what ``process_event_async`` does when the pool
    is full: ``wait`` (await a slot up to ``overflow_wait`` seconds, then refuse the handler
    with code ``overloaded``), ``reject`` (refuse at once) or ``inline`` (the seed's fallback,
    which blocks the event loop). The synchronous ``process_event`` always falls back inline.
    """

    def __init__(
        self,
        *,
        pool: ExecPool | None = None,
        pool_enabled: bool = True,
        max_workers: int = 64,
        queue_size: int = 128,
        profile_factory: Callable[[], ExecProfile] = ExecProfile,
        overflow: str = "wait",
        overflow_wait: float = 5.0,
    ) -> None:
        if overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"overflow={overflow!r}; use one of {', '.join(OVERFLOW_POLICIES)}")
        self.owns_pool = pool is None and pool_enabled
        self.pool: ExecPool | None = pool if pool is not None else (
            ExecPool(max_workers, queue_size) if pool_enabled else None)
        self.pool_enabled = pool_enabled
        self.overflow = overflow
        self.overflow_wait = overflow_wait
        self._profile_factory = profile_factory
        self.profiles: dict[str, ExecProfile] = {}
        self._profiles_lock = threading.Lock()
        # Copy-on-write: dispatch iterates a tuple that registration replaces, never mutates.
        self._matchers: tuple[Matcher, ...] = ()
        self._register_lock = threading.Lock()
        self._seq = itertools.count()
        self._observers: list[RunObserver] = []
        self._counts_lock = threading.Lock()
        self.counts = {"events": 0, "inline": 0, "pooled": 0, "fallbacks": 0, "overloaded": 0, "errors": 0}

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
                     block: bool = False, name: str | None = None, plugin: str | None = None) -> Matcher:
        """Build a matcher with its profile (not yet registered; see ``add`` and ``set_matchers``)."""
        kind = MatcherKind(kind)
        name = name or f"{kind.value}:{pattern}"
        return Matcher(kind=kind, pattern=pattern, handler=handler, profile=self.profile_for(name), name=name,
                       priority=priority, block=block, plugin=plugin, seq=next(self._seq))

    def add(self, matcher: Matcher) -> Matcher:
        """Register one matcher."""
        with self._register_lock:
            self._matchers = tuple(sorted(self._matchers + (matcher,), key=Matcher.sort_key))
        return matcher

    def set_matchers(self, matchers: Iterable[Matcher]) -> None:
        """Replace every matcher at once (a plugin refresh); events in flight keep the old set."""
        with self._register_lock:
            self._matchers = tuple(sorted(matchers, key=Matcher.sort_key))

    @property
    def matchers(self) -> tuple[Matcher, ...]:
        """Registered matchers in dispatch order."""
        return self._matchers

    def on_command(self, name: str, handler: Handler, *, priority: int = 0, block: bool = False,
                   **options: Any) -> Matcher:
        """Run ``handler`` for ``/name ...`` messages; ``ctx.args`` is the text after the name."""
        return self.add(self.make_matcher(MatcherKind.COMMAND, name, handler, priority=priority, block=block, **options))

    def on_regex(self, pattern: str, handler: Handler, *, priority: int = 0, block: bool = False,
                 **options: Any) -> Matcher:
        """Run ``handler`` for messages whose text matches ``pattern`` (re.search)."""
        return self.add(self.make_matcher(MatcherKind.REGEX, pattern, handler, priority=priority, block=block, **options))

    def on_event(self, event_type: str, handler: Handler, *, priority: int = 0, block: bool = False,
                 **options: Any) -> Matcher:
        """Run ``handler`` for every event of ``event_type``."""
        return self.add(self.make_matcher(MatcherKind.EVENT, event_type, handler, priority=priority, block=block,
                                          **options))

    def add_observer(self, fn: RunObserver) -> None:
        """Call ``fn`` after every handler run (metrics); it must be cheap and must not raise."""
        self._observers.append(fn)

    # -- dispatch -------------------------------------------------------------------------------

    def process_event(self, event: Event | Mapping[str, Any], on_outcome: OutcomeCallback | None = None) -> EventRun:
        """Dispatch adaptively; a full pool falls back inline. Wait on or await the returned run."""
        run = EventRun(_as_event(event), on_outcome)
        _drive_sync(self._dispatch(run, self.pool_enabled, "inline"))
        return run

    def process_event_sync(self, event: Event | Mapping[str, Any],
                           on_outcome: OutcomeCallback | None = None) -> Completion:
        """Run every matched handler inline, in order, and return the completion (deterministic)."""
        run = EventRun(_as_event(event), on_outcome)
        _drive_sync(self._dispatch(run, False, "inline"))
        return run.completion  # type: ignore[return-value]

    async def process_event_async(self, event: Event | Mapping[str, Any],
                                  on_outcome: OutcomeCallback | None = None) -> EventRun:
        """Dispatch from an event loop: inline handlers run here, pooled ones in threads, and a
        full pool applies the overflow policy instead of blocking the loop. Returns once every
        handler is running or done; await the run for completion."""
        run = EventRun(_as_event(event), on_outcome)
        steps = self._dispatch(run, self.pool_enabled, self.overflow)
        try:
            task = next(steps)
            while True:
                task = steps.send(await self._await_slot(task))
        except StopIteration:
            pass
        return run

    async def _await_slot(self, task: Callable[[], None]) -> bool:
        """Backpressure for one client: retry the submission until a slot frees or time runs out."""
        assert self.pool is not None
        deadline = time.monotonic() + self.overflow_wait
        pause = 0.0005
        while time.monotonic() < deadline and not self.pool.closed:
            await asyncio.sleep(pause)
            if self.pool.try_submit(task):
                return True
            pause = min(pause * 2, 0.01)
        return False

    def _dispatch(self, run: EventRun, allow_pool: bool, overflow: str) -> Generator[Callable[[], None], bool, None]:
        """The dispatch loop of design.md §2, shared by every entry point.

        Yields a pooled task only when the pool is full and the policy is ``wait``; the driver
        sends back whether it got a slot.
        """
        event = run.event
        command = parse_command(event.text) if event.type == "message" else None
        self._count("events")
        try:
            for m in self._matchers:
                args = m.match(event.type, event.text, command)
                if args is None:
                    continue
                run.matched += 1
                blocking = m.block  # 1. computed before any pool decision
                if allow_pool and m.profile.should_pool() is ExecClass.POOL:
                    pctx = Context(event, args, m, ExecClass.POOL).clone_for_pool()  # 2. clone first
                    task = self._pooled_task(run, pctx)
                    run.hold()
                    submitted = self.pool.try_submit(task)  # type: ignore[union-attr]
                    if not submitted and overflow == "wait":
                        submitted = yield task
                    if submitted:
                        self._count("pooled")
                        if blocking:
                            run.blocked_by = m.name
                            break
                        continue
                    run.release()
                    if overflow != "inline":  # the asyncio path never blocks the loop
                        self._count("overloaded")
                        run.emit(Failure(event.id, m.name, m.plugin, Overloaded.code,
                                         f"pool full: handler {m.name!r} refused after waiting; retry later or "
                                         "raise EXECAPP['POOL_MAX_WORKERS']", None, 0.0))
                        if blocking:
                            run.blocked_by = m.name
                            break
                        continue
                    self._count("fallbacks")  # 3. pool full: run inline, drop nothing
                ctx = Context(event, args, m, ExecClass.SYNC)  # 4. inline
                self._invoke(run, ctx)
                if blocking or ctx.blocked:
                    run.blocked_by = m.name
                    break
        finally:
            run.release()

    def _pooled_task(self, run: EventRun, ctx: Context) -> Callable[[], None]:
        def task() -> None:
            try:
                self._invoke(run, ctx)
            finally:
                run.release()
        return task

    def _invoke(self, run: EventRun, ctx: Context) -> None:
        """Run one handler, record its duration in its profile and emit its outcome."""
        m: Matcher = ctx.matcher
        code = "ok"
        started = time.perf_counter()
        try:
            result = m.handler(ctx)
        except Exception as exc:  # a handler error is reported, never propagated
            elapsed = time.perf_counter() - started
            code = exc.code if isinstance(exc, ExecAppError) else "handler_error"
            message = str(exc) or type(exc).__name__
            if not isinstance(exc, ExecAppError):
                log.warning("handler %s failed: %r", m.name, exc)
            m.profile.record(elapsed, error=message, timeout=code == "timeout")
            self._count("errors")
            run.emit(Failure(run.event.id, m.name, m.plugin, code, message, ctx.exec_class, elapsed))
        else:
            elapsed = time.perf_counter() - started
            m.profile.record(elapsed)
            if result is not None:
                ctx.reply(*((result, None) if isinstance(result, str) else (None, result)))
            for text, data in ctx._replies:
                run.emit(Reply(run.event.id, m.name, m.plugin, text, data, ctx.exec_class, elapsed))
        if ctx.exec_class is ExecClass.SYNC:
            self._count("inline")
        for observe in self._observers:
            observe(m, ctx.exec_class, elapsed, code)

    def _count(self, key: str) -> None:
        with self._counts_lock:
            self.counts[key] += 1

    # -- lifecycle ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Engine counters plus the pool's stats (None without a pool)."""
        with self._counts_lock:
            counts = dict(self.counts)
        return {**counts, "pool": self.pool.stats() if self.pool else None}

    def shutdown(self, timeout: float | None = None) -> bool:
        """Drain the pool if this engine owns it; a shared pool is the caller's and keeps running."""
        if self.owns_pool and self.pool is not None:
            return self.pool.drain(timeout)
        return True


def _drive_sync(steps: Generator[Callable[[], None], bool, None]) -> None:
    """Run the dispatch generator without an event loop (overflow is never 'wait' here)."""
    for _ in steps:
        raise RuntimeError("synchronous dispatch cannot wait for a pool slot")


def _as_event(event: Event | Mapping[str, Any]) -> Event:
    if isinstance(event, Event):
        return event
    fields = {k: event[k] for k in ("type", "text", "data", "id", "session") if event.get(k) is not None}
    return Event(**fields)
