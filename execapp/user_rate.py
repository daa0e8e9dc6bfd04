"""Requests per user over time in one worker process: a token bucket per user, for the admin's
costly views (the dashboard's data, the Events page's searches), which one browser tab stuck in a
reload loop would otherwise ask for as fast as the worker answers."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

#: Users remembered per worker process (the least recently seen forgotten first).
MAX_USERS = 10_000


class UserRate:
    """Token buckets of requests, one per user (request threads: under a lock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_users: int = MAX_USERS) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.max_users = max_users
        #: user key -> [requests it may still make, when that was computed]
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()

    def take(self, user: str, per_second: float, burst: float | None = None) -> float:
        """Count a request of ``user``: 0 if it may run, else the seconds until it may. The bucket
        holds ``burst`` requests (default: two seconds' worth, at least one)."""
        burst = max(1.0, 2.0 * per_second if burst is None else burst)
        with self._lock:
            now = self._clock()
            bucket = self._buckets.get(user)
            if bucket is None:
                bucket = self._buckets[user] = [burst, now]
                if len(self._buckets) > self.max_users:
                    self._buckets.popitem(last=False)
            else:
                bucket[0] = min(burst, bucket[0] + (now - bucket[1]) * per_second)
                bucket[1] = now
                self._buckets.move_to_end(user)
            if bucket[0] >= 1.0:
                bucket[0] -= 1.0
                return 0.0
            return (1.0 - bucket[0]) / per_second
