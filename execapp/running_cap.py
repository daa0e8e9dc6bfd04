"""A count of something running at once across threads, with a cap: taken before, given back after."""
from __future__ import annotations

import threading


class RunningCap:
    """How many of a costly thing run now in this process (Django runs each request's view on a
    thread of its own); ``acquire`` refuses past a limit, read when asked (settings change)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0

    def acquire(self, limit: int) -> bool:
        """Count one more in (True), or refuse (False) while ``limit`` run already."""
        with self._lock:
            if self.now >= limit:
                return False
            self.now += 1
            return True

    def release(self) -> None:
        """One that ``acquire`` counted in is over."""
        with self._lock:
            self.now -= 1
