"""Django system checks for the EXECAPP settings dict."""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks

from . import conf

_POSITIVE_INTS = ("POOL_MAX_WORKERS", "POOL_QUEUE_SIZE", "PROFILE_WINDOW", "MAX_FRAME_BYTES",
                  "MAX_IN_FLIGHT_PER_CONNECTION")
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
    return errors
