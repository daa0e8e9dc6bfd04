"""How soon the supervisor starts another worker after one died before it served: a crash loop backs off.

A worker process that dies at every start (a plugin whose top level crashes or hangs its process at
each load, a database that refuses every new process, new code on disk that fails at import) was
started again at once, forever: a restart storm spending a core on imports and Django start-ups and
flooding the log. Each death of a worker that never served ``STABLE_SECONDS`` is a failed start;
consecutive failed starts wait ``FIRST_SECONDS``, then twice as long each time, up to
EXECAPP['RESTART_BACKOFF_MAX_SECONDS'] (0: no wait). A worker started after the last failure that
serves ``STABLE_SECONDS`` ends the streak. Nothing here imports Django (execapp.serve's supervisor).
"""
from __future__ import annotations

#: The wait after the first failed start.
FIRST_SECONDS = 0.5
#: How long a worker must have been listening for its start to count as a success.
STABLE_SECONDS = 10.0


class RestartBackoff:
    """Consecutive failed starts and the earliest moment (``time.monotonic()``) of the next start."""

    def __init__(self, cap: float) -> None:
        self.cap = max(0.0, cap)
        self.failures = 0
        self.not_before = 0.0
        self.last_failure = float("-inf")

    def failed(self, now: float) -> float:
        """A worker died before it served ``STABLE_SECONDS``: the wait before the next start (seconds)."""
        self.failures += 1
        self.last_failure = now
        delay = min(self.cap, FIRST_SECONDS * 2 ** min(self.failures - 1, 30))
        self.not_before = now + delay
        return delay

    def may_start(self, now: float) -> bool:
        """True once the wait after the last failed start is over."""
        return now >= self.not_before

    def served(self, started_at: float, ready_at: float | None, now: float) -> bool:
        """Whether a worker started at ``started_at`` and listening since ``ready_at`` counts as a success
        (it ends the streak if it was started after the last failure); True if it did."""
        if ready_at is None or now - ready_at < STABLE_SECONDS:
            return False
        if self.failures and started_at >= self.last_failure:
            self.failures = 0
            self.not_before = 0.0
        return True
