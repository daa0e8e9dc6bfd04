"""Django system checks for the EXECAPP settings dict."""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks

from . import conf

_POSITIVE_INTS = ("POOL_MAX_WORKERS", "POOL_QUEUE_SIZE", "PROFILE_WINDOW", "MAX_FRAME_BYTES",
                  "MAX_IN_FLIGHT_PER_CONNECTION", "MAX_FRAME_DEPTH")
_POSITIVE_NUMBERS = ("SLOW_THRESHOLD_SECONDS", "OVERFLOW_WAIT_SECONDS", "PROFILE_FLUSH_SECONDS",
                     "SNAPSHOT_SECONDS", "WORKER_STALE_SECONDS", "WORKER_DROP_SECONDS",
                     "REGISTRY_POLL_SECONDS", "DRAIN_TIMEOUT_SECONDS", "SHUTDOWN_GRACE_SECONDS",
                     "DASHBOARD_HISTORY_SECONDS")


@checks.register()
def check_execapp_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Validate settings.EXECAPP: known keys, positive numbers, a known overflow policy."""
    errors: list[checks.CheckMessage] = []
    user = getattr(settings, "EXECAPP", {})
    if not isinstance(user, dict):
        return [checks.Error("settings.EXECAPP must be a dict", hint="Set EXECAPP = {...} in settings.",
                             id="execapp.E001")]
    for key in user:
        if key not in conf.DEFAULTS:
            errors.append(checks.Error(
                f"unknown EXECAPP setting {key!r}",
                hint=f"Remove it or use one of: {', '.join(sorted(conf.DEFAULTS))}.", id="execapp.E002"))
    for key in _POSITIVE_INTS:
        value = conf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            errors.append(checks.Error(f"EXECAPP[{key!r}] is {value!r}, it must be a positive integer",
                                       hint=f"Set it to a whole number above 0 (default {conf.DEFAULTS[key]}).",
                                       id="execapp.E003"))
    for key in _POSITIVE_NUMBERS:
        value = conf.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            errors.append(checks.Error(f"EXECAPP[{key!r}] is {value!r}, it must be a positive number of seconds",
                                       hint=f"Set it to a number above 0 (default {conf.DEFAULTS[key]}).",
                                       id="execapp.E004"))
    policy = conf.get("OVERFLOW_POLICY")
    if policy not in conf.OVERFLOW_POLICIES:
        errors.append(checks.Error(f"EXECAPP['OVERFLOW_POLICY'] is {policy!r}",
                                   hint=f"Use one of {', '.join(conf.OVERFLOW_POLICIES)}.", id="execapp.E005"))
    if conf.get("WORKER_DROP_SECONDS") < conf.get("WORKER_STALE_SECONDS"):
        errors.append(checks.Warning("WORKER_DROP_SECONDS is below WORKER_STALE_SECONDS: workers are dropped before "
                                     "they are ever shown as stale", hint="Make WORKER_DROP_SECONDS the larger.",
                                     id="execapp.W001"))
    errors += _inline_timeout_checks()
    errors += _watchdog_checks()
    errors += _frame_depth_checks()
    return errors


#: Python's JSON decoder and copy.deepcopy recurse once per level; past a few hundred a frame can
#: exhaust the interpreter's recursion limit (1000) on its way to a handler.
_SAFE_FRAME_DEPTH = 200


def _frame_depth_checks() -> list[checks.CheckMessage]:
    """MAX_FRAME_DEPTH far below the interpreter's recursion limit (docs/protocol.md)."""
    depth = conf.get("MAX_FRAME_DEPTH")
    if isinstance(depth, int) and not isinstance(depth, bool) and depth > _SAFE_FRAME_DEPTH:
        return [checks.Warning(
            f"EXECAPP['MAX_FRAME_DEPTH'] is {depth}: frames that deep can exhaust Python's recursion limit in the "
            "JSON decoder or in the copy handed to a pooled handler", hint=f"Keep it at most {_SAFE_FRAME_DEPTH} "
            f"(default {conf.DEFAULTS['MAX_FRAME_DEPTH']}).", id="execapp.W070")]
    return []


#: The containment target the inline budget serves: no /ping waits longer behind a handler.
_PING_TARGET_SECONDS = 0.25


def _inline_timeout_checks() -> list[checks.CheckMessage]:
    """INLINE_TIMEOUT_SECONDS: positive, within the /ping target, not below the slow threshold."""
    value = conf.get("INLINE_TIMEOUT_SECONDS")
    default = conf.DEFAULTS["INLINE_TIMEOUT_SECONDS"]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        return [checks.Error(f"EXECAPP['INLINE_TIMEOUT_SECONDS'] is {value!r}, it must be a positive number of "
                             "seconds", hint=f"Set it to a number above 0 (default {default}).", id="execapp.E050")]
    out: list[checks.CheckMessage] = []
    if value > _PING_TARGET_SECONDS:
        out.append(checks.Warning(
            f"EXECAPP['INLINE_TIMEOUT_SECONDS'] is {value!r}: one misbehaving inline handler may hold every other "
            f"connection of its worker that long (the target is {_PING_TARGET_SECONDS:g} s)",
            hint=f"Keep it at most {_PING_TARGET_SECONDS:g} s (default {default}).", id="execapp.W050"))
    slow = conf.get("SLOW_THRESHOLD_SECONDS")
    if isinstance(slow, (int, float)) and not isinstance(slow, bool) and value < slow:
        out.append(checks.Warning(
            f"EXECAPP['INLINE_TIMEOUT_SECONDS'] ({value!r}) is below SLOW_THRESHOLD_SECONDS ({slow!r}): handlers "
            "the profiles still judge fast get stopped with 'timeout' while inline",
            hint="Make INLINE_TIMEOUT_SECONDS at least SLOW_THRESHOLD_SECONDS (default 2x: the promote-at-once "
            "bound).", id="execapp.W051"))
    return out


def _watchdog_checks() -> list[checks.CheckMessage]:
    """The supervisor's watchdog settings: LOOP_STALL_SECONDS and STUCK_THREADS_LIMIT (docs/operations.md)."""
    errors: list[checks.CheckMessage] = []
    stall = conf.get("LOOP_STALL_SECONDS")
    if not isinstance(stall, (int, float)) or isinstance(stall, bool) or stall <= 0:
        errors.append(checks.Error(f"EXECAPP['LOOP_STALL_SECONDS'] is {stall!r}, it must be a positive number of "
                                   "seconds", hint=f"Set it to a number above 0 (default "
                                   f"{conf.DEFAULTS['LOOP_STALL_SECONDS']}).", id="execapp.E040"))
    elif stall < 1.0:
        errors.append(checks.Warning(
            f"EXECAPP['LOOP_STALL_SECONDS'] is {stall!r}: a pause that short (a busy machine, a large garbage "
            "collection) gets a healthy worker killed, with every connection on it", hint="Use 1 s or more "
            f"(default {conf.DEFAULTS['LOOP_STALL_SECONDS']}); inline handlers are stopped long before by their "
            "own budget.", id="execapp.W040"))
    inline = conf.get("INLINE_TIMEOUT_SECONDS") if "INLINE_TIMEOUT_SECONDS" in conf.DEFAULTS else None
    if (isinstance(stall, (int, float)) and isinstance(inline, (int, float)) and not isinstance(inline, bool)
            and 0 < stall <= 2 * inline):
        errors.append(checks.Warning(
            f"EXECAPP['LOOP_STALL_SECONDS'] ({stall!r}) is not above twice INLINE_TIMEOUT_SECONDS ({inline!r}): "
            "an inline handler within its budget can get its worker killed", hint="Make LOOP_STALL_SECONDS "
            "several times INLINE_TIMEOUT_SECONDS.", id="execapp.W041"))
    limit = conf.get("STUCK_THREADS_LIMIT")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        errors.append(checks.Error(f"EXECAPP['STUCK_THREADS_LIMIT'] is {limit!r}, it must be a positive integer",
                                   hint=f"Set it to a whole number above 0 (default "
                                   f"{conf.DEFAULTS['STUCK_THREADS_LIMIT']}).", id="execapp.E041"))
    elif isinstance(conf.get("POOL_MAX_WORKERS"), int) and limit > conf.get("POOL_MAX_WORKERS"):
        errors.append(checks.Warning(
            f"EXECAPP['STUCK_THREADS_LIMIT'] ({limit}) is above POOL_MAX_WORKERS ({conf.get('POOL_MAX_WORKERS')}): "
            "the pool fills with stuck threads before the worker is ever recycled", hint="Make it at most "
            "POOL_MAX_WORKERS (a quarter of it or less keeps the pool useful).", id="execapp.W042"))
    return errors


@checks.register()
def check_health_and_metrics_access(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Validate the /healthz check timings and the /metrics access settings (networks, token)."""
    from .metrics_access import MetricsAccessConfigError, allowed_networks, metrics_token

    errors: list[checks.CheckMessage] = []
    for key in ("HEALTH_CHECK_TIMEOUT_SECONDS", "HEALTH_CHECK_CACHE_SECONDS"):
        value = conf.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            errors.append(checks.Error(f"EXECAPP[{key!r}] is {value!r}, it must be a positive number of seconds",
                                       hint=f"Set it to a number above 0 (default {conf.DEFAULTS[key]}).",
                                       id="execapp.E060"))
    try:
        networks = allowed_networks()
    except MetricsAccessConfigError as exc:
        errors.append(checks.Error(str(exc), hint="Until fixed, /metrics refuses every scrape.", id="execapp.E061"))
        networks = ()
    try:
        token = metrics_token()
    except MetricsAccessConfigError as exc:
        errors.append(checks.Error(str(exc), hint="Until fixed, /metrics refuses every scrape.", id="execapp.E062"))
        token = "?"
    # Wider than an IPv4 /8 or an IPv6 /32: "anyone", in practice.
    wide = [str(n) for n in networks if n.prefixlen < (8 if n.version == 4 else 32)]
    if not token and wide:
        errors.append(checks.Warning(
            f"/metrics is open without a token to a wide network: {', '.join(wide)}",
            hint="Set EXECAPP['METRICS_TOKEN'] (or env METRICS_TOKEN) and configure Prometheus to send it.",
            id="execapp.W060"))
    if token and token != "?" and len(token) < 16:
        errors.append(checks.Warning(f"EXECAPP['METRICS_TOKEN'] has only {len(token)} characters",
                                     hint="Use a long random value, e.g. python -c 'import secrets; "
                                          "print(secrets.token_urlsafe(32))'.", id="execapp.W061"))
    return errors
