"""ExecProfile: one matcher's recent handler durations and the pool/inline decision drawn from them."""
from __future__ import annotations

import collections
import enum
import itertools
import threading
import time
from typing import Any

from .errors import ConfigError


class ExecClass(str, enum.Enum):
    """Where a handler runs: inline on the dispatching thread (SYNC) or in the pool (POOL)."""

    SYNC = "sync"
    POOL = "pool"


class ProfileState(str, enum.Enum):
    """Learning (not yet judged), promoted (known slow: pool) or demoted (known fast: inline)."""

    LEARNING = "learning"
    PROMOTED = "promoted"
    DEMOTED = "demoted"


_now = time.time
_PROMOTED = ProfileState.PROMOTED
_DEMOTED = ProfileState.DEMOTED
_POOL = ExecClass.POOL
_SYNC = ExecClass.SYNC


def _count_value(counter: itertools.count) -> int:
    # repr(count(5)) == "count(5)": the only way to read an itertools.count without bumping it.
    return int(repr(counter)[6:-1])

#: Inline is earned per input size (docs/architecture.md, "Design rules": containment): a demoted handler runs inline
#: only events up to SIZE_FACTOR x the largest size it was proven fast on, and never less than
#: SIZE_FLOOR characters. Why 4x: a handler whose cost grows linearly, proven under the fast
#: threshold (25 ms by default), stays within 4x that (100 ms, the default inline budget) on
#: the largest event it may take inline; a superlinear one is stopped by the inline budget and
#: moved to the pool. Why 1 KiB: a new handler is proven on whatever traffic it gets first,
#: usually short chat lines; anything up to 1 KiB costs microseconds in every bundled plugin
#: (a quadratic Lua pattern on 1 KiB of spaces: ~4 ms), while the 60 KB frame that stalled a
#: worker for 15 s is 60x the floor. A larger event goes to the pool before it runs; a fast
#: pooled run on it extends what is proven.
SIZE_FACTOR = 4
SIZE_FLOOR = 1024
#: ExecProfile's defaults, and EXECAPP['PROFILE_WINDOW'] and ['SLOW_THRESHOLD_SECONDS']
#: (execapp/conf.py reads them from here).
WINDOW = 32
SLOW_THRESHOLD = 0.050
#: Earning inline back costs twice as many fresh fast runs each time it was earned before (a
#: window, then 2, 4, ... windows), at most 2**RECOVERY_DOUBLINGS windows: a demoted handler that
#: is promoted again broke the trust it was given. Without it a handler fast on 32 events and
#: slow on the 33rd (a crafted one) held the loop its whole inline budget every 33 events, for
#: as long as its author liked.
RECOVERY_DOUBLINGS = 10
#: The profile's monotonic counters (keys of ``snapshot``): persisted per matcher and summed
#: over workers by execapp.persistence and the dashboard.
COUNTERS = ("runs", "errors", "timeouts", "promotions", "demotions")


class ExecProfile:
    """A ring window of recent durations deciding, per matcher, between the pool and inline.

    Rules (docs/architecture.md, "Design rules": the adaptive engine), all thresholds constructor arguments:

    - promoted -> POOL; demoted -> SYNC (``should_pool`` reads one attribute: no statistics);
    - too few samples -> POOL (every handler is suspected slow until proven fast);
    - p50 >= slow threshold -> promote, POOL;
    - full window, p50 < threshold/2 and each of the last ``recent`` runs < threshold/2 -> demote;
    - one run over ``promote_after`` (2x threshold) promotes at once and clears demotion;
    - a timeout, or an inline run past the engine's inline budget (``overrun``), promotes at
      once too (and restarts a promoted handler's recovery window);
    - each demotion doubles the fresh runs the next one needs (``recovery_needed``: a window,
      then 2, 4, ... windows, at most 2**RECOVERY_DOUBLINGS), so a handler fast on most events
      and slow on a crafted one cannot keep coming back inline;
    - a demoted handler takes inline only events up to ``inline_max_size`` (SIZE_FACTOR x the
      largest size of a fast, successful run since the last promotion, at least SIZE_FLOOR);
    - a quarantined profile (``quarantine``) is pinned to the pool and never demoted until
      ``release_quarantine``.

    Improvements over the seed: promotion starts a fresh window, so a promoted handler is
    demoted again only by the same strict rule judged on samples taken after its promotion;
    and a demoted handler still promotes on a steady drift (p50 >= threshold), not only on a
    single outlier. Every rule is kept O(1) per ``record``: p50 >= x holds exactly when at
    least half of the window (``n - n // 2`` samples, the upper median) is >= x, so two
    running counts replace sorting. Percentiles are only computed for ``snapshot``.

    The fast lane: a fast, successful run of a demoted handler on an input no larger than one
    already proven changes no decision (it cannot promote, and demotion is done), so ``record``
    takes it without the lock: the sample goes onto a bounded deque and the run into an
    itertools.count (each one atomic C call, from any thread); every locked reader and writer
    first folds the lane into the window, in arrival order. ``runs``, ``version`` and
    ``updated_at`` include lane runs at once.
    """

    def __init__(
        self,
        window: int = WINDOW,
        slow_threshold: float = SLOW_THRESHOLD,
        promote_after: float | None = None,
        fast_threshold: float | None = None,
        recent: int = 10,
        min_samples: int = 10,
    ) -> None:
        if window < 1 or recent < 1 or min_samples < 1:
            raise ConfigError(f"window={window}, recent={recent}, min_samples={min_samples}: each must be >= 1")
        if recent > window or min_samples > window:
            raise ConfigError(f"recent={recent} and min_samples={min_samples} must not exceed window={window}")
        if slow_threshold <= 0:
            raise ConfigError(f"slow_threshold={slow_threshold!r} must be > 0 seconds")
        self.window = window
        self.slow_threshold = slow_threshold
        self.promote_after = 2 * slow_threshold if promote_after is None else promote_after
        self.fast_threshold = slow_threshold / 2 if fast_threshold is None else fast_threshold
        if not 0 < self.fast_threshold <= slow_threshold <= self.promote_after:
            raise ConfigError(f"fast_threshold={self.fast_threshold!r}, slow_threshold={slow_threshold!r}, "
                              f"promote_after={self.promote_after!r}: need 0 < fast <= slow <= promote_after")
        self.recent = recent
        self.min_samples = min_samples
        # Pool threads record concurrently; every mutation of the window happens under this lock.
        self._lock = threading.Lock()
        self._ring: list[float] = [0.0] * window
        self._next = 0
        self._count = 0  # samples in the window (<= window)
        self._n_slow = 0  # samples in the window >= slow_threshold
        self._n_not_fast = 0  # samples in the window >= fast_threshold
        self._fast_streak = 0  # consecutive latest samples < fast_threshold
        # Samples since the promotion, or since the last outlier while promoted: recovery needs
        # a whole window of them (the window itself keeps the triggering run, for reporting).
        self._fresh = 0
        self.state = ProfileState.LEARNING
        self._class = ExecClass.POOL  # what should_pool() returns; written only under the lock
        self._runs = 0  # runs recorded under the lock (``runs`` adds the lane's)
        self.errors = 0
        self.timeouts = 0
        self.promotions = 0
        self.demotions = 0
        self.promoted_at: float | None = None
        self.demoted_at: float | None = None
        self.last_error = ""
        self._updated_at = 0.0
        self._version = 0  # ``version`` adds the lane's runs
        # The fast lane (see the class docstring): only the last `window` samples can matter.
        self._lane: collections.deque[float] = collections.deque(maxlen=window)
        self._lane_runs = itertools.count()
        self._lane_seen = 0  # lane runs already reflected in updated_at (see updated_at)
        #: The largest event size (characters) of a fast, successful run since the last promotion.
        self.proven_size = 0
        #: Events larger than this go to the pool even when demoted (read without the lock).
        self.inline_max_size = SIZE_FLOOR
        #: The decision in one attribute, for the engine's hot path: events up to this size run
        #: inline now; -1 while the class is POOL. Kept equal to ``inline_max_size if demoted
        #: else -1`` by every change of either (``_relimit``), and read without the lock.
        self.inline_limit = -1
        #: Why this matcher is pinned to the pool (None: not quarantined).
        self.quarantined: str | None = None
        #: Why this matcher may never run inline, whatever it proves (``pin_to_pool``; None: it may).
        #: Not persisted: its owner (a plugin's configuration) sets it again at each registration.
        self.pool_only: str | None = None

    # -- the decision -------------------------------------------------------------------------

    def should_pool(self, size: int = 0) -> ExecClass:
        """Where the next run of an event of ``size`` characters goes: one attribute read and a
        comparison (``inline_limit``), safe without the lock, O(1), never changing the profile."""
        return _SYNC if size <= self.inline_limit else _POOL

    def _relimit(self) -> None:
        """Recompute ``inline_limit`` after ``_class`` or ``inline_max_size`` changed (under the lock)."""
        self.inline_limit = self.inline_max_size if self._class is _SYNC and self.pool_only is None else -1

    # No keyword-only parameters: CPython 3.11 does not specialise a call of a function that has
    # any, and every inline run calls this (an unspecialised call is a C-level eval frame).
    def record(self, elapsed: float, size: int = 0, error: str | None = None, timeout: bool = False,
               overrun: bool = False) -> None:
        """Add one run's duration (seconds) and apply the promotion/demotion rules.

        ``size``: the event's size (characters), proven when the run is fast and succeeded.
        ``timeout`` (the run timed out) and ``overrun`` (an inline run went past the engine's
        inline budget) promote at once, whatever ``elapsed`` says: such a run proved nothing.

        Every inline run pays for this, so it is written flat: the window update is inlined and
        each rule is only tested when the new sample can change its outcome (p50 >= threshold
        can only start to hold when a slow sample arrives, demotion only when a fast one does).
        """
        if (elapsed < self.fast_threshold and size <= self.proven_size and self.inline_limit >= 0
                and error is None and not timeout and not overrun):
            # The fast lane: no decision can change (see the class docstring).
            self._lane.append(elapsed)
            next(self._lane_runs)
            return
        with self._lock:
            if self._lane:
                self._fold()
            self._runs += 1
            self._version += 1
            if error is not None:
                self.errors += 1
                self.last_error = error[:500]
            if timeout or overrun:
                self.timeouts += timeout
                self._outlier(elapsed)
                return
            self._updated_at = _now()
            # -- push into the ring, keeping the running counts (same as _push) --
            i = self._next
            if self._count == self.window:
                old = self._ring[i]
                if old >= self.fast_threshold:
                    self._n_not_fast -= 1
                    if old >= self.slow_threshold:
                        self._n_slow -= 1
            else:
                self._count += 1
            self._ring[i] = elapsed
            self._fresh += 1
            i += 1
            self._next = 0 if i == self.window else i
            if elapsed < self.fast_threshold:
                self._fast_streak += 1
                if size > self.proven_size and error is None:
                    # A failed run proves nothing about its input (it may have stopped early).
                    self.proven_size = size
                    self.inline_max_size = max(SIZE_FLOOR, SIZE_FACTOR * size)
                    self._relimit()
                # A fast run can only demote (never promote): learning -> demoted, or a promoted
                # handler recovering on its post-promotion window.
                if (self.state is not _DEMOTED and self._may_demote() and self.quarantined is None
                        and self.pool_only is None):
                    self._demote()
                return
            self._n_not_fast += 1
            self._fast_streak = 0
            if elapsed >= self.slow_threshold:
                self._n_slow += 1
            if self.state is _PROMOTED:
                if elapsed > self.promote_after:
                    self._fresh = 0  # another outlier: recovery starts counting again
                return
            if elapsed > self.promote_after:
                self._promote(elapsed)  # one very slow run: at once, from learning or demoted
            elif (elapsed >= self.slow_threshold and self._count >= self.min_samples
                  and self._n_slow >= self._count - self._count // 2):
                self._promote(elapsed)  # learning, or demoted with a steady drift: p50 >= threshold

    def note_error(self, error: str) -> None:
        """Count a failure of a handler that never ran (its event could not be copied or
        submitted): an error and ``last_error``, but no duration sample and no rule applied."""
        with self._lock:
            self.errors += 1
            self.last_error = error[:500]
            self._version += 1
            self._updated_at = _now()

    def _fold(self) -> None:
        """Move the fast lane's samples into the window, oldest first (under the lock)."""
        lane, push = self._lane, self._push
        while True:
            try:
                elapsed = lane.popleft()
            except IndexError:
                return
            push(elapsed)

    # -- counters that include the fast lane ------------------------------------------------------

    @property
    def runs(self) -> int:
        """Runs recorded so far (restored ones included)."""
        return self._runs + _count_value(self._lane_runs)

    @runs.setter
    def runs(self, value: int) -> None:
        self._runs = int(value) - _count_value(self._lane_runs)

    @property
    def version(self) -> int:
        """Bumped on every change: the persistence layer flushes the profiles whose version moved."""
        return self._version + _count_value(self._lane_runs)

    @property
    def updated_at(self) -> float:
        """time.time() of the latest change. Lane runs carry no timestamp (a clock read per run
        saved): new ones since the last read count as a change at the time of this read."""
        seen = _count_value(self._lane_runs)
        if seen != self._lane_seen:
            self._lane_seen = seen
            self._updated_at = _now()
        return self._updated_at

    @updated_at.setter
    def updated_at(self, value: float) -> None:
        self._updated_at = value

    def _outlier(self, elapsed: float) -> None:
        """A timeout or an inline overrun (under the lock): promote now, or restart recovery."""
        self._updated_at = _now()
        if self.state is _PROMOTED:
            self._push(elapsed)
            self._fresh = 0
        else:
            self._promote(elapsed)

    def _push(self, elapsed: float) -> None:
        if self._count == self.window:
            old = self._ring[self._next]
            self._n_slow -= old >= self.slow_threshold
            self._n_not_fast -= old >= self.fast_threshold
        else:
            self._count += 1
        self._ring[self._next] = elapsed
        self._fresh += 1
        self._next = (self._next + 1) % self.window
        self._n_slow += elapsed >= self.slow_threshold
        if elapsed >= self.fast_threshold:
            self._n_not_fast += 1
            self._fast_streak = 0
        else:
            self._fast_streak += 1

    def _half_at_least(self, n_at_least: int) -> bool:
        """True when the window's p50 (upper median) is >= the threshold counted by n_at_least."""
        return n_at_least >= self._count - self._count // 2

    @property
    def recovery_needed(self) -> int:
        """Fresh fast runs a promoted handler needs before it may be demoted: a window, doubled for
        each earlier demotion (RECOVERY_DOUBLINGS at most)."""
        return self.window << min(self.demotions, RECOVERY_DOUBLINGS)

    def _may_demote(self) -> bool:
        return (self._count == self.window
                and self._fresh >= self.window << min(self.demotions, RECOVERY_DOUBLINGS)
                and not self._half_at_least(self._n_not_fast)
                and self._fast_streak >= self.recent)

    def _promote(self, elapsed: float) -> None:
        """Learning or demoted -> promoted, by the run that took ``elapsed`` seconds."""
        self._class = ExecClass.POOL
        self.inline_limit = -1  # first: no event goes inline from here on
        self.promotions += 1
        self.promoted_at = time.time()
        self.state = ProfileState.PROMOTED
        # Recovery is judged only on samples taken from the promotion on: a fresh window that
        # starts with the run that caused it (a promoted handler is not reset again by later
        # slow runs, so an always-slow handler keeps a full window to report).
        self._ring = [0.0] * self.window
        self._next = self._count = self._n_slow = self._n_not_fast = self._fast_streak = 0
        self._push(elapsed)
        self._fresh = 0
        self.proven_size = 0  # sizes are proven afresh too, on post-promotion runs
        self.inline_max_size = SIZE_FLOOR

    def _demote(self) -> None:
        self.state = ProfileState.DEMOTED
        self._class = ExecClass.SYNC
        self.demotions += 1
        self.demoted_at = time.time()
        self._relimit()

    # -- quarantine -------------------------------------------------------------------------------

    def quarantine(self, reason: str) -> None:
        """Pin this matcher to the pool for good (never demoted) until ``release_quarantine``.

        Used when a handler stalled a worker's event loop (the supervisor's watchdog) or by an
        operator. A demoted profile is promoted now, with a fresh window, so that after a
        release it must prove itself fast again on new runs before it runs inline.
        """
        with self._lock:
            self.quarantined = str(reason)[:500] or "quarantined"
            self._pin()

    def pin_to_pool(self, reason: str | None) -> None:
        """Never run inline while ``reason`` is set (None: the usual rules again, from a fresh
        window if it was pinned). Used for a matcher whose worst single step is too long for the
        loop whatever its history shows (a plugin with a large memory cap: plugins.sync)."""
        with self._lock:
            if reason is None:
                if self.pool_only is not None:
                    self.pool_only = None
                    self._version += 1
                    self._relimit()
                return
            self.pool_only = str(reason)[:500]
            self._pin()

    def _pin(self) -> None:
        """Pinned to the pool (under the lock): a demoted or learning profile is promoted now, with
        a fresh window, so that once unpinned it must prove itself fast again on new runs."""
        if self._lane:
            self._fold()
        self._version += 1
        self._updated_at = _now()
        self.inline_limit = -1  # first: no event goes inline from here on
        if self.state is not _PROMOTED:
            self._class = ExecClass.POOL
            self.promotions += 1
            self.promoted_at = time.time()
            self.state = ProfileState.PROMOTED
            self._ring = [0.0] * self.window
            self._next = self._count = self._n_slow = self._n_not_fast = self._fast_streak = 0
            self._fresh = 0
            self.proven_size = 0
            self.inline_max_size = SIZE_FLOOR

    def release_quarantine(self) -> None:
        """Lift ``quarantine``: the usual recovery rule applies again (a full window of fresh fast runs)."""
        with self._lock:
            if self.quarantined is None:
                return
            self.quarantined = None
            self._version += 1
            self._updated_at = _now()
            self._fresh = 0

    # -- reporting and persistence ---------------------------------------------------------------

    def samples(self) -> list[float]:
        """The window's samples, oldest first."""
        with self._lock:
            return self._samples_locked()

    def _samples_locked(self) -> list[float]:
        if self._lane:
            self._fold()
        if self._count < self.window:
            return self._ring[: self._count]
        return self._ring[self._next:] + self._ring[: self._next]

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able view: state, class, window, p50/p99 and counters."""
        with self._lock:
            window = self._samples_locked()
            ordered = sorted(window)
            return {
                "state": self.state.value,
                "exec_class": self._class.value,
                "window": window,
                "p50": _pct(ordered, 0.50),
                "p99": _pct(ordered, 0.99),
                "runs": self.runs,
                "errors": self.errors,
                "timeouts": self.timeouts,
                "promotions": self.promotions,
                "demotions": self.demotions,
                "promoted_at": self.promoted_at,
                "demoted_at": self.demoted_at,
                "last_error": self.last_error,
                "updated_at": self.updated_at,
                "recovery_samples": self._fresh,
                "recovery_needed": self.recovery_needed,
                "proven_size": self.proven_size,
                "inline_max_size": self.inline_max_size,
                "quarantined": self.quarantined,
                "pool_only": self.pool_only,
            }

    def restore(self, state: str, window: list[float], **counters: Any) -> None:
        """Load a persisted profile (warm start): its state, its window and its counters."""
        with self._lock:
            self._lane.clear()  # runs from before the restore: the persisted window replaces them
            self._ring = [0.0] * self.window
            self._next = self._count = self._n_slow = self._n_not_fast = self._fast_streak = self._fresh = 0
            for elapsed in list(window)[-self.window:]:
                self._push(float(elapsed))
            self.state = ProfileState(state)
            self._class = ExecClass.SYNC if self.state is ProfileState.DEMOTED else ExecClass.POOL
            if counters.get("recovery_samples") is not None:
                self._fresh = int(counters["recovery_samples"])
            for name in (*COUNTERS, "promoted_at", "demoted_at", "last_error", "updated_at"):
                if name in counters and counters[name] is not None:
                    setattr(self, name, counters[name])
            size = int(counters.get("proven_size") or 0)
            self.proven_size = size
            self.inline_max_size = max(SIZE_FLOOR, SIZE_FACTOR * size)
            self.quarantined = counters.get("quarantined") or None
            if (self.quarantined is not None or self.pool_only is not None) and self.state is not _PROMOTED:
                # Pinned: a restored quarantine is never inline (the window says how it ran).
                self.state = ProfileState.PROMOTED
                self._class = ExecClass.POOL
            self._relimit()


def _pct(ordered: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (None when empty)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
