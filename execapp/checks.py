"""Django system checks for the EXECAPP settings dict."""
from __future__ import annotations

import math
from typing import Any

from django.conf import settings
from django.core import checks

from . import conf
from .engine.engine import OVERFLOW_POLICIES

_POSITIVE_INTS = ("POOL_MAX_WORKERS", "POOL_QUEUE_SIZE", "PROFILE_WINDOW", "MAX_FRAME_BYTES",
                  "MAX_IN_FLIGHT_PER_CONNECTION", "MAX_FRAME_DEPTH", "MAX_CONNECTIONS_PER_OWNER",
                  "MAX_REQUEST_BODY_BYTES", "MAX_PENDING_BODY_BYTES", "READ_ONLY_BODY_BYTES",
                  "HISTORY_FAILURES_PER_OWNER",
                  "INLINE_MAX_MEMORY_MB", "MAX_TOKEN_LOOKUPS", "MAX_PASSWORD_CHECKS", "MAX_BINDINGS_PER_PLUGIN",
                  "MAX_REGEX_BINDINGS_PER_PLUGIN", "MAX_PLUGINS", "MAX_REGEX_BINDINGS", "MAX_TOTAL_CODE_BYTES",
                  "MAX_BINDINGS_PER_PATTERN", "HISTORY_MAX_SEARCHES", "DASHBOARD_MAX_REQUESTS", "LAYER_MAX_CONNECTIONS",
                  "SESSION_PUBLISHES_PER_OWNER", "SESSION_QUEUE_BYTES")
_POSITIVE_NUMBERS = ("SLOW_THRESHOLD_SECONDS", "OVERFLOW_WAIT_SECONDS", "PROFILE_FLUSH_SECONDS",
                     "SNAPSHOT_SECONDS", "WORKER_STALE_SECONDS", "WORKER_DROP_SECONDS",
                     "REGISTRY_POLL_SECONDS", "DRAIN_TIMEOUT_SECONDS", "SHUTDOWN_GRACE_SECONDS",
                     "DASHBOARD_HISTORY_SECONDS", "REQUEST_BODY_TIMEOUT_SECONDS",
                     "WS_MESSAGE_TIMEOUT_SECONDS", "REDIS_REQUEST_DEADLINE_SECONDS",
                     "REQUEST_DB_DEADLINE_SECONDS", "SNAPSHOT_PUBLISH_DEADLINE_SECONDS",
                     "HISTORY_FLUSH_DEADLINE_SECONDS",
                     "RESEND_DEADLINE_SECONDS")


#: The longest number of seconds a setting may have (~31 years): "never" in practice, and below
#: threading.TIMEOUT_MAX, past which a thread's wait raises.
_LONGEST_SECONDS = 1e9


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
    # One rule for every numeric setting, whatever its own check: nan passes every comparison as
    # false (nan <= 0 too), so a check of its range let it through and the setting silently never
    # fired; inf made waits endless. EXECAPP_<KEY>=nan or inf in the environment reads as a float.
    # A number of seconds past threading.TIMEOUT_MAX (~9.2e9) made a thread's wait raise OverflowError.
    for key, default in conf.DEFAULTS.items():
        value = conf.get(key)
        if not _number(default) or not _number(value):
            continue
        if not math.isfinite(value) or (key.endswith("_SECONDS") and value > _LONGEST_SECONDS):
            errors.append(checks.Error(
                f"EXECAPP[{key!r}] is {value!r}{_from(key)}, it must be a finite number"
                + (f" of at most {_LONGEST_SECONDS:g} seconds" if key.endswith("_SECONDS") else ""),
                hint=f"Set a finite value (default {default!r}; docs/operations.md, \"Settings\", says what 0 does "
                     "where 0 is allowed).", id="execapp.E122"))
    idle = conf.get("POOL_IDLE_SECONDS")
    # ExecPool refused it at every worker start: the server restarted workers for ever (nan: E122 above).
    if not _seconds(idle) and not (isinstance(idle, float) and math.isnan(idle)):
        errors.append(_seconds_error("POOL_IDLE_SECONDS", idle, "a pool thread exits as soon as it is idle",
                                     "or more", "execapp.E123"))
    for key in _POSITIVE_INTS:
        value = conf.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            errors.append(checks.Error(f"EXECAPP[{key!r}] is {value!r}{_from(key)}, it must be a positive integer",
                                       hint=f"Set it to a whole number above 0 (default {conf.DEFAULTS[key]}).",
                                       id="execapp.E003"))
    for key in _POSITIVE_NUMBERS:
        value = conf.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            errors.append(checks.Error(f"EXECAPP[{key!r}] is {value!r}{_from(key)}, it must be a positive number "
                                       "of seconds", hint=f"Set it to a number above 0 (default "
                                       f"{conf.DEFAULTS[key]}).", id="execapp.E004"))
    rate = conf.get("DASHBOARD_REQUESTS_PER_SECOND")
    if not _number(rate) or not 0 < rate < float("inf"):
        errors.append(checks.Error(
            f"EXECAPP['DASHBOARD_REQUESTS_PER_SECOND'] is {rate!r}{_from('DASHBOARD_REQUESTS_PER_SECOND')}, it must "
            "be a number of requests a second above 0", hint="The dashboard polls every 0.5-2 s: keep it at least 2 "
            f"per open tab (default {conf.DEFAULTS['DASHBOARD_REQUESTS_PER_SECOND']}).", id="execapp.E047"))
    elif rate < 1:
        errors.append(checks.Warning(
            f"EXECAPP['DASHBOARD_REQUESTS_PER_SECOND'] is {rate!r}{_from('DASHBOARD_REQUESTS_PER_SECOND')}: the "
            "dashboard polls every 0.5-2 s, so an open tab is refused (429) part of the time",
            hint=f"Keep it at least 2 per open tab (default {conf.DEFAULTS['DASHBOARD_REQUESTS_PER_SECOND']}).",
            id="execapp.W047"))
    searches = conf.get("HISTORY_SEARCHES_PER_MINUTE")
    if not _number(searches) or not 0 < searches < float("inf"):
        errors.append(checks.Error(
            f"EXECAPP['HISTORY_SEARCHES_PER_MINUTE'] is {searches!r}{_from('HISTORY_SEARCHES_PER_MINUTE')}, it must "
            "be a number of searches a minute above 0", hint="Each search of the Events page reads the recent store "
            f"(~0.5 s of CPU at 100,000 traces); default {conf.DEFAULTS['HISTORY_SEARCHES_PER_MINUTE']}.",
            id="execapp.E048"))
    policy = conf.get("OVERFLOW_POLICY")
    if policy not in OVERFLOW_POLICIES:
        errors.append(checks.Error(f"EXECAPP['OVERFLOW_POLICY'] is {policy!r}",
                                   hint=f"Use one of {', '.join(OVERFLOW_POLICIES)}.", id="execapp.E005"))
    drop, stale = conf.get("WORKER_DROP_SECONDS"), conf.get("WORKER_STALE_SECONDS")
    if _number(drop) and _number(stale) and drop < stale:  # another type: E004 names it (this compare raised)
        errors.append(checks.Warning("WORKER_DROP_SECONDS is below WORKER_STALE_SECONDS: workers are dropped before "
                                     "they are ever shown as stale", hint="Make WORKER_DROP_SECONDS the larger.",
                                     id="execapp.W001"))
    period = conf.get("SNAPSHOT_SECONDS")
    if _number(period) and _number(stale) and period > 0 and stale > 0 and period * 2 > stale:
        forgotten = ", and forgotten by the others (WORKER_DROP_SECONDS)" if _number(drop) and period >= drop else ""
        errors.append(checks.Warning(
            f"EXECAPP['SNAPSHOT_SECONDS'] is {period!r}{_from('SNAPSHOT_SECONDS')}, more than half of "
            f"WORKER_STALE_SECONDS ({stale!r}): a live worker is shown stale (out of the totals) between two of its "
            f"snapshots{forgotten}",
            hint="Keep SNAPSHOT_SECONDS at most half WORKER_STALE_SECONDS (defaults 1 and 10).", id="execapp.W002"))
    publishes, pool = conf.get("SESSION_PUBLISHES_PER_OWNER"), conf.get("LAYER_MAX_CONNECTIONS")
    if isinstance(publishes, int) and isinstance(pool, int) and 0 < pool <= 2 * publishes:
        errors.append(checks.Warning(
            f"EXECAPP['SESSION_PUBLISHES_PER_OWNER'] is {publishes}{_from('SESSION_PUBLISHES_PER_OWNER')} and "
            f"EXECAPP['LAYER_MAX_CONNECTIONS'] {pool}{_from('LAYER_MAX_CONNECTIONS')}: two owners publishing "
            "at once can take every Redis connection of a worker, and the others' session frames wait for them",
            hint="Keep SESSION_PUBLISHES_PER_OWNER well below LAYER_MAX_CONNECTIONS (defaults 8 and 100).",
            id="execapp.W110"))
    errors += _inline_timeout_checks()
    errors += _watchdog_checks()
    errors += _frame_depth_checks()
    errors += _decode_share_checks()
    errors += _http_share_checks()
    errors += _pool_share_checks()
    errors += _pool_reserve_checks()
    errors += _owner_outbox_checks()
    errors += _env_checks()
    errors += _history_checks()
    errors += _duration_bucket_checks()
    errors += _resilience_checks()
    errors += _handshake_checks()
    errors += _auth_throttle_checks()
    errors += _pending_body_checks()
    errors += _password_check_checks()
    errors += _login_throttle_checks()
    return errors


#: The backend that caps concurrent password checks, and the one it replaces.
_LIMITED_BACKEND = "execapp.login_limit.LimitedModelBackend"
_PLAIN_BACKEND = "django.contrib.auth.backends.ModelBackend"


def _password_check_checks() -> list[checks.CheckMessage]:
    """Sign-ins go through the backend that caps concurrent password checks (execapp/login_limit.py)."""
    backends = list(getattr(settings, "AUTHENTICATION_BACKENDS", [_PLAIN_BACKEND]))
    if _PLAIN_BACKEND in backends:
        return [checks.Warning(
            f"AUTHENTICATION_BACKENDS uses {_PLAIN_BACKEND}: every sign-in attempt (the admin's login, no "
            "credentials needed) hashes a password (~0.5 s of CPU) with no limit on how many run at once",
            hint=f"Use {_LIMITED_BACKEND!r} in its place (at most EXECAPP['MAX_PASSWORD_CHECKS'] at once per "
                 "worker).", id="execapp.W096")]
    return []


def _failures_checks(prefix: str, burst_hint: str, rate_hint: str, ids: tuple[str, str]
                     ) -> list[checks.CheckMessage]:
    """EXECAPP[prefix + '_BURST'] (a whole number >= 0) and [prefix + '_PER_MINUTE'] (finite, > 0) of a
    failures throttle (execapp/auth_throttle.py, execapp/login_throttle.py)."""
    out: list[checks.CheckMessage] = []
    burst = conf.get(f"{prefix}_BURST")
    if not _number(burst, True) or burst < 0:
        out.append(checks.Error(
            f"EXECAPP['{prefix}_BURST'] is {burst!r}{_from(f'{prefix}_BURST')}, it must be a whole number of at "
            "least 0", hint=burst_hint, id=ids[0]))
    rate = conf.get(f"{prefix}_PER_MINUTE")
    if not _number(rate) or not 0 < rate < float("inf"):
        out.append(checks.Error(
            f"EXECAPP['{prefix}_PER_MINUTE'] is {rate!r}{_from(f'{prefix}_PER_MINUTE')}, it must be a finite "
            "positive number", hint=rate_hint, id=ids[1]))
    return out


def _login_throttle_checks() -> list[checks.CheckMessage]:
    """Failed sign-ins per client network and username (execapp/login_throttle.py)."""
    return _failures_checks(
        "LOGIN_FAILURES", "Default 10: failed sign-ins per client network (and per username) before its attempts "
        "are refused unhashed (0 turns that off, and a flood of wrong passwords refuses everyone).",
        "Default 6.0: how many failed sign-ins a minute a throttled network or username earns back.",
        ("execapp.E120", "execapp.E121"))


def _pending_body_checks() -> list[checks.CheckMessage]:
    """The bytes of request bodies arriving at once (execapp/http_limits.py) hold the largest one."""
    pending, largest = conf.get("MAX_PENDING_BODY_BYTES"), conf.get("MAX_REQUEST_BODY_BYTES")
    if _number(pending, True) and _number(largest, True) and 0 < pending < largest:
        return [checks.Warning(
            f"EXECAPP['MAX_PENDING_BODY_BYTES'] is {pending!r}{_from('MAX_PENDING_BODY_BYTES')}, below "
            f"MAX_REQUEST_BODY_BYTES ({largest!r}): a body larger than it is refused (503) even when it arrives alone",
            hint="Keep it at least MAX_REQUEST_BODY_BYTES (default 64 MiB, eight 8 MiB bodies).", id="execapp.W095")]
    return []


def _auth_throttle_checks() -> list[checks.CheckMessage]:
    """Failed authentications per client network (execapp/auth_throttle.py)."""
    out = _failures_checks(
        "AUTH_FAILURES", "Default 20: failed WebSocket authentications per client network before its handshakes "
        "are closed unjudged (0 turns that off).",
        "Default 30.0: how many failures a minute a throttled client network earns back.",
        ("execapp.E093", "execapp.E094"))
    recheck = conf.get("AUTH_RECHECK_SECONDS")
    if not _number(recheck) or not recheck >= 0:
        out.append(checks.Error(
            f"EXECAPP['AUTH_RECHECK_SECONDS'] is {recheck!r}{_from('AUTH_RECHECK_SECONDS')}, it must be a number "
            "of seconds of at least 0", hint="Default 10.0: how often each worker closes the connections whose API "
            "token was revoked, deleted or moved, or whose staff user was deactivated, since they connected (0 "
            "turns that off: their open connections then run until they end).", id="execapp.E098"))
    return out


#: A client's first packet lost costs it TCP's initial retransmission timeout (1 s) and more: a
#: header deadline shorter than that closes clients on a lossy link that are doing nothing wrong.
_MIN_SAFE_HANDSHAKE_SECONDS = 1.0


def _open_files_limit() -> int | None:
    """This process's soft limit on open file descriptors (``ulimit -n``), or None if unknown or unlimited."""
    try:
        import resource
    except ImportError:  # not on Unix
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _handshake_checks() -> list[checks.CheckMessage]:
    """The deadline on a request's headers and the cap on connections waiting for them (execapp/handshake.py)."""
    out: list[checks.CheckMessage] = []
    timeout = conf.get("HANDSHAKE_TIMEOUT_SECONDS")
    if not _number(timeout) or not timeout > 0:
        out.append(checks.Error(
            f"EXECAPP['HANDSHAKE_TIMEOUT_SECONDS'] is {timeout!r}{_from('HANDSHAKE_TIMEOUT_SECONDS')}, it must be a "
            "positive number of seconds", hint="Default 10.0: a connection whose request line and headers are not "
            "all in that long after it was accepted is closed (docs/operations.md).", id="execapp.E065"))
    elif timeout < _MIN_SAFE_HANDSHAKE_SECONDS:
        out.append(checks.Warning(
            f"EXECAPP['HANDSHAKE_TIMEOUT_SECONDS'] is {timeout!r}: a client whose first packet is lost waits "
            f"{_MIN_SAFE_HANDSHAKE_SECONDS:g} s for TCP to send it again, and is closed first",
            hint=f"Keep it at least {_MIN_SAFE_HANDSHAKE_SECONDS:g} s (default 10.0).", id="execapp.W065"))
    cap = conf.get("MAX_PENDING_CONNECTIONS")
    if not _number(cap, True) or cap < 1:
        out.append(checks.Error(
            f"EXECAPP['MAX_PENDING_CONNECTIONS'] is {cap!r}{_from('MAX_PENDING_CONNECTIONS')}, it must be a whole "
            "number of at least 1", hint="Default 256: connections one worker process lets wait for their request "
            "headers at once; past it the one waiting longest is closed.", id="execapp.E066"))
        return out
    files = _open_files_limit()
    if files is not None and cap > files // 2:
        out.append(checks.Warning(
            f"EXECAPP['MAX_PENDING_CONNECTIONS'] ({cap}) is over half this process's open-file limit ({files}, "
            "ulimit -n): silent connections can still take the file descriptors every other client needs",
            hint="Lower it, or raise the limit (LimitNOFILE= in systemd, --ulimit nofile= in Docker).",
            id="execapp.W066"))
    return out


def _resilience_checks() -> list[checks.CheckMessage]:
    """Outbox limits, the channel-layer check interval, the resend lease and retention."""
    errors: list[checks.CheckMessage] = []
    for key in ("OUTBOX_MAX_FRAMES", "OUTBOX_MAX_BYTES"):
        value = conf.get(key)
        if not _number(value, True) or value < 0:
            errors.append(checks.Error(
                f"EXECAPP[{key!r}] is {value!r}{_from(key)}, it must be a whole number >= 0 (0: no limit)",
                hint=f"Default {conf.DEFAULTS[key]!r}: a client that stops reading then costs its worker at most "
                     "that much.", id="execapp.E100"))
        elif value == 0:
            errors.append(checks.Warning(
                f"EXECAPP[{key!r}] is 0{_from(key)}: a session member that stops reading grows its worker's memory "
                "until the keepalive closes it", hint=f"Keep a limit (default {conf.DEFAULTS[key]!r}).",
                id="execapp.W100"))
    for key, low, high in (("LAYER_CHECK_SECONDS", 0.05, 60.0), ("RESEND_LEASE_SECONDS", 0.5, 3600.0),
                           ("RESEND_RETENTION_SECONDS", 1.0, 30 * 86400.0)):
        value = conf.get(key)
        if not _number(value) or not low <= value <= high:
            errors.append(checks.Error(
                f"EXECAPP[{key!r}] is {value!r}{_from(key)}, it must be a number of seconds from {low:g} to {high:g}",
                hint=f"Default {conf.DEFAULTS[key]!r} (docs/operations.md, \"Settings\").", id="execapp.E101"))
    return errors


def _from(key: str) -> str:
    """" (from the environment variable EXECAPP_X)" when that is where the value came from."""
    where = conf.source(key)
    return f" (from the {where})" if where.startswith("environment") else ""


def _env_checks() -> list[checks.CheckMessage]:
    """EXECAPP_<NAME> environment overrides whose values do not read as their settings' types."""
    return [checks.Error(str(exc), hint="Numbers as 64 or 0.5, booleans as true/false, lists as 0.1,1,10.",
                         id="execapp.E007") for exc in conf.env_errors()]


def _number(value: Any, integer: bool = False) -> bool:
    kinds = (int,) if integer else (int, float)
    return isinstance(value, kinds) and not isinstance(value, bool)


def _seconds(value: Any) -> bool:
    """A finite number of seconds >= 0 (0: the setting's "off")."""
    return _number(value) and 0 <= value < float("inf")


def _seconds_error(key: str, value: Any, zero: str, more: str, check_id: str) -> checks.Error:
    """The error of a setting that is not ``_seconds``; ``zero`` says what 0 does."""
    return checks.Error(f"EXECAPP['{key}'] is {value!r}, it must be a finite number of seconds >= 0",
                        hint=f"Set it to 0 ({zero}) {more} (default {conf.DEFAULTS[key]}).", id=check_id)


#: Below this HISTORY_REDIS_MAX_BYTES keeps a few dozen large traces at most (execapp.W082).
MIN_HISTORY_BYTES = 1024 * 1024


def _history_checks() -> list[checks.CheckMessage]:
    """The event history's settings (execapp/history.py): sizes and retention."""
    errors: list[checks.CheckMessage] = []
    for key, integer, low in (("HISTORY_MAX_EVENTS", True, 0), ("HISTORY_LOCAL_MAX_BYTES", True, 0),
                              ("HISTORY_REDIS_MAX_BYTES", True, 0),
                              ("HISTORY_FAILURE_DAYS", False, 0),
                              ("HISTORY_TEXT_CHARS", True, 0), ("HISTORY_REPLY_BYTES", True, 0)):
        value = conf.get(key)
        if not _number(value, integer) or value < low:
            errors.append(checks.Error(
                f"EXECAPP[{key!r}] is {value!r}{_from(key)}, it must be {'a whole number' if integer else 'a number'}"
                f" >= {low}", hint=f"Set it to {conf.DEFAULTS[key]!r} (the default) or another value >= {low}.",
                id="execapp.E080"))
    redis_bytes = conf.get("HISTORY_REDIS_MAX_BYTES")
    if _number(redis_bytes, True) and 0 <= redis_bytes < MIN_HISTORY_BYTES and conf.get("HISTORY_MAX_EVENTS"):
        errors.append(checks.Warning(
            f"EXECAPP['HISTORY_REDIS_MAX_BYTES'] is {redis_bytes!r}{_from('HISTORY_REDIS_MAX_BYTES')}: the recent "
            "store in Redis evicts a trace as soon as the ones it holds pass it (a trace with large replies "
            "is ~13 KB), so the Events page and resends find almost nothing",
            hint=f"Set it to at least {MIN_HISTORY_BYTES} (1 MiB; default {conf.DEFAULTS['HISTORY_REDIS_MAX_BYTES']}), "
                 "or HISTORY_MAX_EVENTS to 0 to keep no traces.", id="execapp.W082"))
    flush = conf.get("HISTORY_FLUSH_SECONDS")
    if not _number(flush) or not 0 < flush <= 60:
        errors.append(checks.Error(f"EXECAPP['HISTORY_FLUSH_SECONDS'] is {flush!r}{_from('HISTORY_FLUSH_SECONDS')}"
                                   ", it must be a number of seconds above 0 and at most 60",
                                   hint="The buffer between flushes is bounded: keep it short (default 0.5).",
                                   id="execapp.E081"))
    return errors


def _duration_bucket_checks() -> list[checks.CheckMessage]:
    """DURATION_BUCKETS: increasing positive seconds reaching MAX_HANDLER_TIMEOUT_SECONDS, no big jumps."""
    out: list[checks.CheckMessage] = []
    limit = conf.get("MAX_HANDLER_TIMEOUT_SECONDS")
    if not _number(limit) or limit <= 0:
        return [checks.Error(f"EXECAPP['MAX_HANDLER_TIMEOUT_SECONDS'] is {limit!r}"
                             f"{_from('MAX_HANDLER_TIMEOUT_SECONDS')}, it must be a positive number of seconds",
                             hint="Default 60.", id="execapp.E090")]
    buckets = conf.get("DURATION_BUCKETS")
    if (not isinstance(buckets, (list, tuple)) or not buckets or not all(_number(b) and b > 0 for b in buckets)
            or any(b >= c for b, c in zip(buckets, buckets[1:]))):
        return [checks.Error(f"EXECAPP['DURATION_BUCKETS'] is {buckets!r}{_from('DURATION_BUCKETS')}: it must be "
                             "increasing positive numbers of seconds", hint="Leave it out for the default.",
                             id="execapp.E091")]
    if buckets[-1] < limit:
        out.append(checks.Error(
            f"EXECAPP['DURATION_BUCKETS'] ends at {buckets[-1]!r} s, below MAX_HANDLER_TIMEOUT_SECONDS ({limit!r})",
            hint="Add buckets up to the longest timeout a handler may have (a longer run counts only in +Inf).",
            id="execapp.E092"))
    jumps = [(b, c) for b, c in zip(buckets, buckets[1:]) if b >= 1 and c / b > 2.5]
    if jumps:
        out.append(checks.Warning(
            f"EXECAPP['DURATION_BUCKETS'] jumps {', '.join(f'{b:g} -> {c:g} s' for b, c in jumps)}: a percentile "
            "inside such a bucket is read as anywhere in it", hint="Add buckets in between (at most 2.5x apart).",
            id="execapp.W090"))
    return out


#: Python's JSON decoder and copy.deepcopy recurse once per level; past a few hundred a frame can
#: exhaust the interpreter's recursion limit (1000) on its way to a handler.
_SAFE_FRAME_DEPTH = 200


def _fraction_check(key: str, of: str, example: float, one: str, check_id: str) -> list[checks.CheckMessage]:
    """A setting that is a fraction of ``of``, in (0, 1]; ``one`` says what 1 allows."""
    value = conf.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1:
        return []
    return [checks.Error(f"EXECAPP[{key!r}] is {value!r}{_from(key)}, it must be a fraction of {of} above 0 "
                         "and at most 1",
                         hint=f"Set it to a number like {example} (the default: {conf.DEFAULTS[key]}); 1 {one}.",
                         id=check_id)]


def _decode_share_checks() -> list[checks.CheckMessage]:
    """DECODE_SHARE_PER_OWNER: a fraction of one event loop, in (0, 1]."""
    return _fraction_check("DECODE_SHARE_PER_OWNER", "one event loop", 0.25,
                           "lets one owner's frames take the whole loop", "execapp.E045")


def _http_share_checks() -> list[checks.CheckMessage]:
    """HTTP_SHARE_PER_NETWORK: a fraction of a worker's time; HTTP_REQUESTS_PER_NETWORK: a whole number >= 0."""
    errors = _fraction_check("HTTP_SHARE_PER_NETWORK", "a worker's time (seconds a second)", 0.25,
                             "lets one client network's HTTP requests take the whole worker", "execapp.E140")
    errors += _fraction_check("HTTP_SHARE_PER_WORKER", "a worker's time (seconds a second)", 0.25,
                              "lets HTTP requests take the whole worker from WebSocket owners", "execapp.E142")
    key = "HTTP_REQUESTS_PER_NETWORK"
    value = conf.get(key)
    if not _number(value, True) or value < 0:
        errors.append(checks.Error(
            f"EXECAPP[{key!r}] is {value!r}{_from(key)}, it must be a whole number of requests >= 0 (0: off)",
            hint=f"Set it to {conf.DEFAULTS[key]} (the default): the HTTP requests one client network may have in "
                 "Django at once on a worker; 0 turns the per-network limits off (execapp/http_share.py).",
            id="execapp.E141"))
    return errors


def _pool_share_checks() -> list[checks.CheckMessage]:
    """POOL_SHARE_PER_OWNER: a fraction of the thread pool, in (0, 1]."""
    return _fraction_check("POOL_SHARE_PER_OWNER", "the thread pool (POOL_MAX_WORKERS)", 0.5,
                           "lets one owner's events hold every pool thread while others wait for one",
                           "execapp.E064")


def _pool_reserve_checks() -> list[checks.CheckMessage]:
    """POOL_RESERVE: a fraction of the thread pool, in [0, 1)."""
    value = conf.get("POOL_RESERVE")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1:
        return []
    return [checks.Error(f"EXECAPP['POOL_RESERVE'] is {value!r}{_from('POOL_RESERVE')}, it must be a fraction of "
                         "the thread pool (POOL_MAX_WORKERS) from 0 up to, not including, 1",
                         hint=f"Set it to a number like 0.125 (the default: {conf.DEFAULTS['POOL_RESERVE']}): the "
                              "threads kept free of any one owner for another's arrival; 0 lets one owner take "
                              "every thread.", id="execapp.E143")]


def _owner_outbox_checks() -> list[checks.CheckMessage]:
    """OWNER_OUTBOX_BYTES: a whole number of bytes >= 0, not below one outbox's OUTBOX_MAX_BYTES."""
    key = "OWNER_OUTBOX_BYTES"
    value = conf.get(key)
    default = conf.DEFAULTS[key]
    if not _number(value, True) or value < 0:
        return [checks.Error(
            f"EXECAPP[{key!r}] is {value!r}{_from(key)}, it must be a whole number of bytes >= 0 (0: no owner budget)",
            hint=f"Set it to {default} (the default, 16 MiB) or another size: the most one owner's connections on a "
                 "worker may hold in their outboxes together.", id="execapp.E067")]
    if value == 0:
        return [checks.Warning(
            f"EXECAPP[{key!r}] is 0{_from(key)}: one owner whose clients stop reading can make a worker hold "
            "MAX_CONNECTIONS_PER_OWNER x OUTBOX_MAX_BYTES of its frames", hint=f"Keep a budget (default {default}, "
            "16 MiB).", id="execapp.W067")]
    per_outbox = conf.get("OUTBOX_MAX_BYTES")
    if _number(per_outbox, True) and value < per_outbox:
        return [checks.Warning(
            f"EXECAPP[{key!r}] ({value}) is below OUTBOX_MAX_BYTES ({per_outbox}): one connection that stops reading "
            "holds its owner's whole budget before its own limit, and stops every other connection of that owner "
            "on its worker", hint="Make it several times OUTBOX_MAX_BYTES (default 16x).", id="execapp.W068")]
    return []


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
    """The lifecycle settings: LOOP_STALL_SECONDS, STUCK_THREADS_LIMIT, HOUSEKEEPER_STALL_SECONDS,
    RESTART_BACKOFF_MAX_SECONDS and DRAIN_UNREAD_CLIENT_SECONDS (docs/operations.md)."""
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
    house = conf.get("HOUSEKEEPER_STALL_SECONDS")
    if not _seconds(house):
        errors.append(_seconds_error("HOUSEKEEPER_STALL_SECONDS", house, "never recycle a worker whose housekeeper "
                                     "is stuck", "or well above 5", "execapp.E049"))
    elif 0 < house < 10:
        errors.append(checks.Warning(
            f"EXECAPP['HOUSEKEEPER_STALL_SECONDS'] is {house!r}: a housekeeper round may take a few seconds (a "
            "history flush waits up to HISTORY_FLUSH_DEADLINE_SECONDS on a slow Redis); a healthy worker would be "
            "recycled", hint="Use 10 or more (default "
            f"{conf.DEFAULTS['HOUSEKEEPER_STALL_SECONDS']}).", id="execapp.W049"))
    backoff = conf.get("RESTART_BACKOFF_MAX_SECONDS")
    if not _seconds(backoff):
        errors.append(_seconds_error("RESTART_BACKOFF_MAX_SECONDS", backoff, "restart a crashing worker at once",
                                     "or more", "execapp.E043"))
    elif backoff > 300:
        errors.append(checks.Warning(
            f"EXECAPP['RESTART_BACKOFF_MAX_SECONDS'] is {backoff!r}: once fixed, a worker that kept crashing at "
            "start may wait that long before it is tried again", hint="Use at most a few minutes (default "
            f"{conf.DEFAULTS['RESTART_BACKOFF_MAX_SECONDS']}).", id="execapp.W043"))
    start = conf.get("WORKER_START_TIMEOUT_SECONDS")
    if not _seconds(start):
        errors.append(_seconds_error("WORKER_START_TIMEOUT_SECONDS", start,
                                     "never kill a worker that is still starting",
                                     "or well above 30", "execapp.E046"))
    elif 0 < start < 40:
        errors.append(checks.Warning(
            f"EXECAPP['WORKER_START_TIMEOUT_SECONDS'] is {start!r}: a worker waits up to 30 s for its services' "
            "first round (plugins loading) before it listens, and its imports take seconds on a busy machine; "
            "a healthy worker slow to start would be killed", hint="Use 40 or more (default "
            f"{conf.DEFAULTS['WORKER_START_TIMEOUT_SECONDS']}).", id="execapp.W046"))
    unread = conf.get("DRAIN_UNREAD_CLIENT_SECONDS")
    grace = conf.get("SHUTDOWN_GRACE_SECONDS")
    if not _seconds(unread):
        errors.append(_seconds_error("DRAIN_UNREAD_CLIENT_SECONDS", unread,
                                     "a drain waits for every done to be written",
                                     "or more", "execapp.E044"))
    elif unread > 0 and isinstance(grace, (int, float)) and unread >= grace:
        errors.append(checks.Warning(
            f"EXECAPP['DRAIN_UNREAD_CLIENT_SECONDS'] ({unread!r}) is not below SHUTDOWN_GRACE_SECONDS ({grace!r}): "
            "one client that stops reading holds every SIGTERM drain of its worker for the whole grace",
            hint="Make it a few seconds (default "
                 f"{conf.DEFAULTS['DRAIN_UNREAD_CLIENT_SECONDS']}).", id="execapp.W044"))
    return errors


@checks.register()
def check_plugin_log_rate(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The plugins' log rate (lines and bytes a second per plugin and worker) is a number of 0 or more."""
    errors: list[checks.CheckMessage] = []
    for key in ("PLUGIN_LOG_LINES_PER_SECOND", "PLUGIN_LOG_BYTES_PER_SECOND"):
        value = conf.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            errors.append(checks.Error(
                f"EXECAPP[{key!r}] is {value!r}, it must be a number of 0 or more (0: no limit)",
                hint=f"Set it to a number (default {conf.DEFAULTS[key]:g}); until fixed, plugins' log lines are "
                     "not limited across calls.", id="execapp.E068"))
    return errors


@checks.register()
def check_health_and_metrics_access(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Validate the /healthz check timings, the /metrics access settings (networks, token) and the
    networks plugins may reach."""
    from .metrics_access import MetricsAccessConfigError, allowed_networks, metrics_token
    from .networks import parse_networks

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
    value = conf.get("PLUGIN_HTTP_ALLOWED_NETWORKS")
    try:
        parse_networks(() if value is None else value, "EXECAPP['PLUGIN_HTTP_ALLOWED_NETWORKS']")
    except ValueError as exc:
        errors.append(checks.Error(str(exc), hint="Until fixed, every plugin's http_get is refused.",
                                   id="execapp.E063"))
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


#: config/settings.py's SECRET_KEY when the environment sets none: public (it is in the repository).
DEV_SECRET_KEY = "dev-only-insecure-key-change-me-in-production"
#: Host names only this machine reaches the site by (`make run`'s defaults and Django's test client).
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1", "testserver"})


@checks.register()
def check_secret_key(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The public development SECRET_KEY is refused once ALLOWED_HOSTS lets in any non-local host name."""
    if settings.SECRET_KEY != DEV_SECRET_KEY:
        return []
    public = [h for h in settings.ALLOWED_HOSTS if h not in LOCAL_HOSTS]
    if not public:
        return []  # the embedded default: reachable from this machine only
    return [checks.Error(
        f"SECRET_KEY is the public development default while ALLOWED_HOSTS serves {', '.join(map(repr, public))}: "
        "anyone can sign what Django signs with it (e.g. the admin's messages cookie, whose HTML a forged one "
        "puts in every admin page)",
        hint="Set the SECRET_KEY environment variable to a long random value, the same on every worker and "
             "across restarts: python -c 'import secrets; print(secrets.token_urlsafe(50))'.",
        id="execapp.E130")]


@checks.register()
def check_debug(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """DEBUG on while ALLOWED_HOSTS lets in a non-local host name: every client that meets an error
    gets the traceback, the code around it and the settings."""
    public = [h for h in settings.ALLOWED_HOSTS if h not in LOCAL_HOSTS]
    if not settings.DEBUG or not public:
        return []
    return [checks.Warning(
        f"DEBUG is on while ALLOWED_HOSTS serves {', '.join(map(repr, public))}: any client that meets an error "
        "(a 500, and a 404's list of URL patterns) gets the traceback, local variables and settings",
        hint="Unset the DEBUG environment variable (or set DEBUG=0) in production.", id="execapp.W131")]
