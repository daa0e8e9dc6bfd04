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

from . import conf
from .running_cap import RunningCap
from .user_rate import UserRate

#: Data requests running in this process now.
running = RunningCap()
#: Data requests each user made lately (DASHBOARD_REQUESTS_PER_SECOND).
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
