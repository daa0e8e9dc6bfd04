"""The log lines one plugin's calls may write in one process, across its calls: a token bucket per plugin.

The per-call log quota (``Quotas.log_lines``/``log_bytes``) bounds one call only: a plugin called
in a loop wrote its quota once per call (measured: one caller thread, every call within its
quota, 13,000 lines and 8.5 MB of server log a second). Every line a plugin's calls cause goes
through its bucket (plugins.runtimes.host: its ``log`` lines, the per-call summary of dropped
lines, its first denied host call per call): past the rate the line is dropped and counted, and
at most one line per SUMMARY_SECONDS per plugin says how many were. No Django: the plugins app
installs the reader of the rates (EXECAPP['PLUGIN_LOG_LINES_PER_SECOND'] and
['PLUGIN_LOG_BYTES_PER_SECOND']); without one there is no limit.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

#: A bucket holds this many seconds of its rate: a burst after a quiet spell is written whole.
BURST_SECONDS = 10.0
#: At most one "lines dropped over the log rate" line per plugin per this many seconds.
SUMMARY_SECONDS = 10.0


class _Bucket:
    __slots__ = ("lines", "bytes", "at", "dropped", "dropped_since")

    def __init__(self, lines: float, size: float, now: float) -> None:
        self.lines, self.bytes, self.at = lines, size, now
        self.dropped = 0
        self.dropped_since = now


class LogRate:
    """Per-plugin buckets of log lines and bytes, refilled at the rates ``limits()`` returns
    (``(lines, bytes)`` a second; 0 for either: that one unlimited). Thread-safe: every guest
    call thread of the process shares one."""

    def __init__(self, limits: Callable[[], tuple[float, float]]) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}

    def allow(self, plugin: str, size: int) -> bool:
        """Take one line of ``size`` bytes from ``plugin``'s bucket; False (counted) when it is empty."""
        lines_rate, bytes_rate = self.limits()
        if lines_rate <= 0 and bytes_rate <= 0:
            return True
        now = time.monotonic()
        with self._lock:  # guest calls of one plugin run on many threads at once
            bucket = self._buckets.get(plugin)
            if bucket is None:
                bucket = self._buckets[plugin] = _Bucket(lines_rate * BURST_SECONDS, bytes_rate * BURST_SECONDS, now)
            elapsed, bucket.at = now - bucket.at, now
            bucket.lines = min(lines_rate * BURST_SECONDS, bucket.lines + elapsed * lines_rate)
            bucket.bytes = min(bytes_rate * BURST_SECONDS, bucket.bytes + elapsed * bytes_rate)
            if (lines_rate > 0 and bucket.lines < 1) or (bytes_rate > 0 and bucket.bytes < size):
                if not bucket.dropped:
                    bucket.dropped_since = now
                bucket.dropped += 1
                return False
            bucket.lines -= 1
            bucket.bytes -= size
            return True

    def due_summary(self, plugin: str) -> tuple[int, float] | None:
        """``(lines dropped, over how many seconds)`` for ``plugin`` once SUMMARY_SECONDS have passed
        since its first drop not yet reported, then reset; None before that or with none dropped."""
        now = time.monotonic()
        with self._lock:
            bucket = self._buckets.get(plugin)
            if bucket is None or not bucket.dropped or now - bucket.dropped_since < SUMMARY_SECONDS:
                return None
            dropped, bucket.dropped = bucket.dropped, 0
            return dropped, now - bucket.dropped_since

    def clear(self) -> None:
        """Forget every plugin's bucket (tests)."""
        with self._lock:
            self._buckets.clear()
