"""A worker's status for operators: what ``manage.py execstatus`` shows of each worker."""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from . import extensions
from .seams import WorkerLike

log = logging.getLogger("execapp.status")


def worker_status(worker: WorkerLike) -> dict[str, Any]:
    """The worker's status plus its plugins' instance pools, as JSON-safe data (for execstatus)."""
    status = dict(worker.status())
    status["instance_pools"] = instance_pools()
    status["uptime_seconds"] = round(time.time() - worker.started_at, 1)
    return json.loads(json.dumps(status, default=str))


def instance_pools() -> list[dict[str, Any]] | dict[str, str] | None:
    """The ``plugin_pools`` rows an app registered (execapp.extensions), None when none did, or
    ``{"error": ...}`` when its provider failed: the status answers whatever a plugin pool does."""
    try:
        return extensions.stats("plugin_pools")
    except Exception as exc:
        log.exception("the plugin_pools stats provider failed")
        return {"error": str(exc)}
