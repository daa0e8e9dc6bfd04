"""A worker's status for operators: what ``manage.py execstatus`` shows of each worker."""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from . import extensions
from .seams import WorkerLike
from .watchdog import FRESH_SECONDS

#: A housekeeper silent this long is shown as stuck: it comes round every 0.1 s, and the longest
#: tick on it waits HISTORY_FLUSH_DEADLINE_SECONDS (2 s) for Redis.
HOUSEKEEPER_QUIET_SECONDS = 5.0

log = logging.getLogger("execapp.status")


def worker_status(worker: WorkerLike) -> dict[str, Any]:
    """The worker's status plus its plugins' instance pools, as JSON-safe data (for execstatus)."""
    status = dict(worker.status())
    status["instance_pools"] = instance_pools()
    status["uptime_seconds"] = round(time.time() - worker.started_at, 1)
    status.update(liveness(worker))
    return json.loads(json.dumps(status, default=str))


def liveness(worker: WorkerLike) -> dict[str, Any]:
    """Under the execapp.serve supervisor, from the worker's watchdog slot: seconds since its event
    loop's heartbeat and since its housekeeper came round, and the matcher running inline now. The
    control listener answers on a thread of its own, so a worker whose loop is held (an inline
    handler blocked in C) still answered ``status``, looking healthy ({} without a supervisor)."""
    watch = getattr(worker, "watch", None)
    if watch is None:
        return {}
    slot, now = watch.slot, time.monotonic()
    beat, house = slot.heartbeat, slot.house_beat
    name, cut = slot.mark()
    return {"loop_silent_seconds": round(now - beat, 3) if beat else None,
            "housekeeper_silent_seconds": round(now - house, 3) if house else None,
            "running_inline": name + ("..." if cut else "")}


def liveness_lines(answer: dict[str, Any]) -> list[str]:
    """What ``execstatus`` adds under a worker whose loop or housekeeper is held now (else nothing)."""
    lines = []
    loop, house, inline = (answer.get("loop_silent_seconds"), answer.get("housekeeper_silent_seconds"),
                           answer.get("running_inline"))
    if isinstance(loop, (int, float)) and loop > FRESH_SECONDS:
        lines.append(f"  EVENT LOOP STALLED: no heartbeat for {loop:.1f} s, "
                     + (f"running {inline} inline" if inline else "outside any inline handler")
                     + ": none of its connections is served; the supervisor kills it at "
                       "EXECAPP['LOOP_STALL_SECONDS']")
    if isinstance(house, (int, float)) and house > HOUSEKEEPER_QUIET_SECONDS:
        lines.append(f"  HOUSEKEEPER STUCK: silent for {house:.1f} s (a service's tick): no metrics, snapshots, "
                     "history or stuck-thread count; the supervisor recycles it at "
                     "EXECAPP['HOUSEKEEPER_STALL_SECONDS']")
    return lines


def instance_pools() -> list[dict[str, Any]] | dict[str, str] | None:
    """The ``plugin_pools`` rows an app registered (execapp.extensions), None when none did, or
    ``{"error": ...}`` when its provider failed: the status answers whatever a plugin pool does."""
    try:
        return extensions.stats("plugin_pools")
    except Exception as exc:
        log.exception("the plugin_pools stats provider failed")
        return {"error": str(exc)}
