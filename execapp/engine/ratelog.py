"""RateLimitedLog: one log record per cause per interval, with a count of the ones held back.

A hostile client or plugin can make the same failure happen thousands of times a second; a
log line (and a traceback) per occurrence floods the log and costs the worker its time. Each
cause (a short key chosen by the caller, e.g. ``("deepcopy", matcher)``) is logged on its first
occurrence, then at most once per ``interval`` seconds, saying how many were suppressed.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Hashable

#: Distinct causes remembered at most (oldest forgotten first): a bound on memory, not on logging.
MAX_KEYS = 1024


class RateLimitedLog:
    """Wraps a logger; ``warning``/``error``/``exception`` take a cause key before the message."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0) -> None:
        self.logger = logger
        self.interval = interval
        # Called from the loop and from pool threads: the table is guarded by a lock, and the
        # logging call happens outside it.
        self._lock = threading.Lock()
        self._seen: dict[Hashable, list[float | int]] = {}  # key -> [last logged at, suppressed since]

    def _admit(self, key: Hashable) -> int | None:
        """None to suppress this occurrence; otherwise how many were suppressed before it."""
        now = time.monotonic()
        with self._lock:
            entry = self._seen.get(key)
            if entry is None:
                if len(self._seen) >= MAX_KEYS:
                    self._seen.pop(next(iter(self._seen)))
                self._seen[key] = [now, 0]
                return 0
            if now - entry[0] < self.interval:
                entry[1] += 1
                return None
            suppressed = int(entry[1])
            entry[0], entry[1] = now, 0
            return suppressed

    def log(self, level: int, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` was logged within the interval; True if logged."""
        suppressed = self._admit(key)
        if suppressed is None:
            return False
        if suppressed:
            msg = f"{msg} (and {suppressed} more like it in the last {self.interval:g} s, not logged)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        """``log`` at WARNING."""
        return self.log(logging.WARNING, key, msg, *args, exc_info=exc_info)

    def error(self, key: Hashable, msg: str, *args: Any, exc_info: Any = None) -> bool:
        """``log`` at ERROR."""
        return self.log(logging.ERROR, key, msg, *args, exc_info=exc_info)

    def exception(self, key: Hashable, msg: str, *args: Any) -> bool:
        """``log`` at ERROR with the current exception's traceback (first of each interval only)."""
        return self.log(logging.ERROR, key, msg, *args, exc_info=True)
