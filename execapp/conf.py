"""The app's settings: ``settings.EXECAPP`` over the defaults below, read lazily."""
from __future__ import annotations

import os
from typing import Any

from django.conf import settings

#: Every setting the app reads, with its default. Documented in docs/architecture.md.
DEFAULTS: dict[str, Any] = {
    # Worker pool (one per ASGI worker process).
    "POOL_MAX_WORKERS": 64,
    "POOL_QUEUE_SIZE": 128,
    "POOL_IDLE_SECONDS": 2.0,
    # Execution profiles.
    "PROFILE_WINDOW": 32,
    "SLOW_THRESHOLD_SECONDS": 0.050,
    # The inline budget: how long a handler proven fast may hold the event loop before it is
    # stopped (sandboxed plugins) and moved to the pool at once (execapp/engine/engine.py
    # INLINE_TIMEOUT: chosen for "no /ping waits more than 250 ms behind a misbehaving handler").
    "INLINE_TIMEOUT_SECONDS": 0.1,
    # Asyncio overflow policy when the pool is full: "wait" (per-client backpressure,
    # then refuse with code "overloaded"), "reject" (refuse at once) or "inline".
    "OVERFLOW_POLICY": "wait",
    "OVERFLOW_WAIT_SECONDS": 1.0,
    # WebSocket protocol.
    "MAX_FRAME_BYTES": 64 * 1024,
    "MAX_IN_FLIGHT_PER_CONNECTION": 100,
    # Deepest nesting of arrays/objects in a frame (the event object is level 1), checked before
    # the JSON decoder runs: deeper frames get "too_deep" (docs/protocol.md).
    "MAX_FRAME_DEPTH": 32,
    # Background work of each worker.
    "PROFILE_FLUSH_SECONDS": 5.0,
    "SNAPSHOT_SECONDS": 1.0,
    "WORKER_STALE_SECONDS": 10.0,
    "WORKER_DROP_SECONDS": 60.0,
    "REGISTRY_POLL_SECONDS": 2.0,
    # Dashboard charts: how much history each worker keeps (one point per SNAPSHOT_SECONDS).
    "DASHBOARD_HISTORY_SECONDS": 300.0,
    # Draining and shutdown.
    "DRAIN_TIMEOUT_SECONDS": 25.0,
    "SHUTDOWN_GRACE_SECONDS": 25.0,
    # The execapp.serve supervisor's watchdog (execapp/watchdog.py, docs/operations.md): a worker
    # whose event loop has not beaten for this long is killed and replaced, and the matcher it
    # was running inline is quarantined on every worker. Far above any legitimate loop pause.
    "LOOP_STALL_SECONDS": 5.0,
    # Pool threads stuck past their deadline at which a worker is drained and replaced.
    "STUCK_THREADS_LIMIT": 8,
    # /healthz dependency checks (execapp/health.py): how long a probe waits for the database's
    # SELECT 1 (Redis PING), and how long one answer is reused (at most one check per interval).
    "HEALTH_CHECK_TIMEOUT_SECONDS": 1.0,
    "HEALTH_CHECK_CACHE_SECONDS": 1.0,
    # /metrics access (execapp/metrics_access.py). None: from the environment variable of the
    # same name (METRICS_TOKEN; METRICS_ALLOWED_NETWORKS, comma-separated), else no token and
    # loopback only. A scrape must come from an allowed network AND, when a token is set, send
    # "Authorization: Bearer <token>".
    "METRICS_TOKEN": None,
    "METRICS_ALLOWED_NETWORKS": None,
}

OVERFLOW_POLICIES = ("wait", "reject", "inline")


def get(name: str) -> Any:
    """Return the value of one EXECAPP setting (user value over default), read at call time."""
    if name not in DEFAULTS:
        raise KeyError(f"unknown EXECAPP setting {name!r}; known: {', '.join(sorted(DEFAULTS))}")
    user = getattr(settings, "EXECAPP", {}) or {}
    return user.get(name, DEFAULTS[name])


def redis_url() -> str:
    """The Redis URL shared between workers, or '' for the embedded single-process default."""
    return getattr(settings, "REDIS_URL", "") or ""


def redis_prefix() -> str:
    """The default channel layer's key prefix (REDIS_PREFIX; channels_redis' "asgi" by default)."""
    from channels import DEFAULT_CHANNEL_LAYER

    layer = (getattr(settings, "CHANNEL_LAYERS", {}) or {}).get(DEFAULT_CHANNEL_LAYER, {})
    return str((layer.get("CONFIG") or {}).get("prefix", "asgi"))


def redis_key(name: str) -> str:
    """A Redis key namespaced like the channel layer, so two deployments sharing one Redis never
    see each other's workers, snapshots or plugin data."""
    return f"{redis_prefix()}:{name}"


def require_services() -> bool:
    """True under CI: a test whose Redis or PostgreSQL is missing must fail, not skip."""
    return os.environ.get("EXECAPP_REQUIRE_SERVICES", "") in ("1", "true", "yes")
