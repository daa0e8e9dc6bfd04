"""Bounds on the dashboard's data requests in one worker process: how many run at once, and how
often one user may ask.

Each data request merges every worker's snapshot (~9 ms of CPU on a request thread, which shares
the GIL with the event loop). The page polls every 0.5-2 s, but a browser tab stuck in a loop
(a script retrying at once, many tabs) asked as fast as the worker answered and took that share
of the loop for as long as it ran. Past ``DASHBOARD_MAX_REQUESTS`` running at once a request is
answered 503 at once; past ``DASHBOARD_REQUESTS_PER_SECOND`` for one user (a bucket of twice
that) 429; both with ``Retry-After``, which the page's script honours.
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from typing import Callable

from . import conf
from .running_cap import RunningCap

#: Users remembered per worker process (the least recently seen forgotten first).
MAX_USERS = 10_000

#: Data requests running in this process now.
running = RunningCap()


class UserRate:
    """Token buckets of requests, one per user (request threads: under a lock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_users: int = MAX_USERS) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.max_users = max_users
        #: user key -> [requests it may still make, when that was computed]
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()

    def take(self, user: str, per_second: float) -> float:
        """Count a request of ``user``: 0 if it may run, else the seconds until it may."""
        burst = 2.0 * per_second
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


user_rate = UserRate()


def refusal(user: str) -> tuple[int, str, int] | None:
    """None when ``user``'s data request may run now (then ``running`` counts it: call
    ``running.release()`` after); else (status, message, Retry-After seconds)."""
    per_second = float(conf.get("DASHBOARD_REQUESTS_PER_SECOND"))
    wait = user_rate.take(user, per_second)
    if wait > 0:
        return (429, f"too many dashboard data requests from this user (more than {per_second:g} a second: "
                     "EXECAPP['DASHBOARD_REQUESTS_PER_SECOND']); close the extra tabs, or wait",
                max(1, math.ceil(wait)))
    limit = int(conf.get("DASHBOARD_MAX_REQUESTS"))
    if not running.acquire(limit):
        return (503, f"this worker answers {limit} dashboard data requests at once already "
                     "(EXECAPP['DASHBOARD_MAX_REQUESTS']); try again in a moment", 1)
    return None
