"""Shared helpers of the engine tests: forcing a profile's class, collecting outcomes."""
from __future__ import annotations

import threading
from typing import Any

from execapp.engine import Completion, Engine, ExecPool, Failure, Matcher, Reply
from tests.conftest import LIVENESS, wait_until, wait_until_async  # noqa: F401  (re-exported for the engine tests)


def add_cmd(engine: Engine, handler: Any, *, name: str, priority: int = 0, block: bool = False,
            pattern: str = "cmd") -> Matcher:
    """Register a command matcher under an explicit name (hence profile), as plugins do."""
    return engine.add(engine.make_matcher("command", pattern, handler, name=name, priority=priority, block=block))


def promote(m: Matcher) -> Matcher:
    """Make ``m`` known slow: it goes to the pool (a fresh post-promotion window)."""
    m.profile.restore("promoted", [])
    return m


def demote(m: Matcher) -> Matcher:
    """Make ``m`` known fast: it runs inline."""
    m.profile.restore("demoted", [0.0001] * m.profile.window)
    return m


def parked(engine: Engine) -> int:
    """How many dispatches wait in line for a pool slot (policy "wait"), read where they queue."""
    return engine.waiting


class Outcomes:
    """An ``on_outcome`` callback that keeps everything it is given (from any thread)."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._lock = threading.Lock()

    def __call__(self, outcome: Any) -> None:
        with self._lock:
            self.items.append(outcome)

    @property
    def replies(self) -> list[Reply]:
        return [o for o in self.items if isinstance(o, Reply)]

    @property
    def failures(self) -> list[Failure]:
        return [o for o in self.items if isinstance(o, Failure)]

    @property
    def completions(self) -> list[Completion]:
        return [o for o in self.items if isinstance(o, Completion)]


class Gate:
    """Occupies pool slots until opened: ``fill(pool)`` makes every token and queue slot busy."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.entered = 0
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self.entered += 1
        self.event.wait(LIVENESS * 3)

    def fill(self, pool: ExecPool) -> int:
        n = 0
        while pool.try_submit(self.hold):
            n += 1
        # The refused probe above counts as a rejection; callers compare against this baseline.
        wait_until(lambda: self.entered >= min(n, pool.max_workers))
        return n

    def open(self) -> None:
        self.event.set()


class ManualClock:
    """A monotonic clock a test moves by hand (patched in for ``time.monotonic``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
