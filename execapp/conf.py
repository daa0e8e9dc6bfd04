"""The app's settings: ``settings.EXECAPP`` over the defaults below, read lazily."""
from __future__ import annotations

import os
from typing import Any

from django.conf import settings

from .engine import engine, pool, profile

#: Every setting the app reads, with its default: listed with what each does in
#: docs/operations.md ("Settings"; a test keeps that list and this dict in step). The engine's
#: defaults are its own constants (execapp/engine/ imports no Django), read here.
DEFAULTS: dict[str, Any] = {
    # Worker pool (one per ASGI worker process).
    "POOL_MAX_WORKERS": pool.MAX_WORKERS,
    "POOL_QUEUE_SIZE": pool.QUEUE_SIZE,
    "POOL_IDLE_SECONDS": pool.IDLE_SECONDS,
    # The fraction of POOL_MAX_WORKERS no one owner's pooled handlers may run on at once, kept
    # for another owner's arrival (in [0, 1); execapp/engine/pool.py): an owner alone on a worker
    # takes the rest, and past it its tasks queue. 0.125 of 64 threads keeps 8. 0 turns it off
    # (a single-tenant deployment that wants every thread for its one owner).
    "POOL_RESERVE": pool.RESERVE,
    # Execution profiles.
    "PROFILE_WINDOW": profile.WINDOW,
    "SLOW_THRESHOLD_SECONDS": profile.SLOW_THRESHOLD,
    # The inline budget: how long a handler proven fast may hold the event loop before it is
    # stopped (sandboxed plugins) and moved to the pool at once (execapp/engine/engine.py
    # INLINE_TIMEOUT: chosen for "no /ping waits more than 250 ms behind a misbehaving handler").
    "INLINE_TIMEOUT_SECONDS": engine.INLINE_TIMEOUT,
    # The largest memory cap (MiB) of a plugin whose handlers may run inline (plugins/sync.py):
    # one native step of a guest (a string built near its cap, a typed-array fill, memory.fill)
    # cannot be interrupted and grows with the cap, ~1-7 ms per MiB (docs/plugins.md), so a
    # plugin allowed 1 GiB could hold the loop for seconds past its budget. 16 (the default cap)
    # keeps the worst such step near 0.1 s, within the inline budget's 250 ms promise; a plugin
    # with a larger cap runs in the pool only.
    "INLINE_MAX_MEMORY_MB": 16,
    # Bindings one plugin may have, and of them regex bindings (plugins/models.py refuses more at
    # save; plugins/sync.py loads no more). Every message is searched with every regex binding on
    # the event loop, disabled ones too for the unmatched hint: 5,000 regexes took 0.3 s of the
    # loop for each 64 KB message (and up to ~50 ms each for a pattern whose DFA explodes).
    "MAX_BINDINGS_PER_PLUGIN": 100,
    "MAX_REGEX_BINDINGS_PER_PLUGIN": 10,
    # Enabled plugins a worker loads, and regex bindings of all enabled plugins together (saves past
    # them are refused; a worker loads the first created). The per-plugin limits alone let 500
    # plugins add 5,000 regex searches to every message, and every enabled plugin is compiled and
    # holds its instances (up to pool_size x memory_mb) in every worker.
    "MAX_PLUGINS": 100,
    "MAX_REGEX_BINDINGS": 100,
    # Bytes of code (source characters plus module bytes) of all enabled plugins together: every
    # worker holds each plugin's code and what it compiles to (Lua: ~3 MB for each MB), and reads
    # it all at each registry change (20 plugins of 3.9 MB: 0.6 s and 82 MiB for every change).
    "MAX_TOTAL_CODE_BYTES": 32 << 20,
    # Bindings of all enabled plugins one command name or event type may have together: each runs
    # its handler for every such event (one plugin binding /x to 100 handlers: 100 replies per /x).
    "MAX_BINDINGS_PER_PATTERN": 10,
    # Asyncio overflow policy when the pool is full (engine.OVERFLOW_POLICIES): "wait" (per-client
    # backpressure for up to OVERFLOW_WAIT_SECONDS, then refuse with code "overloaded"), "reject"
    # (refuse at once) or "inline".
    "OVERFLOW_POLICY": engine.OVERFLOW_POLICIES[0],
    "OVERFLOW_WAIT_SECONDS": engine.OVERFLOW_WAIT,
    # Before a request (execapp/handshake.py, docs/operations.md "What clients and load balancers
    # see"): a connection whose request line and headers (HTTP, or a WebSocket handshake) are not
    # all in this long after it was accepted is closed, so a client sending a byte at a time, or
    # nothing, cannot hold a worker's file descriptors; 10 s is many round trips and a lost
    # packet's retransmissions even on a slow mobile link.
    "HANDSHAKE_TIMEOUT_SECONDS": 10.0,
    # After the handshake (execapp/ws_flow.py): a WebSocket message (its frames, or one frame) not
    # all in this long after its first byte closes the client (1008, "message_timeout"), so a client
    # sending a message in fragments, or a frame a byte at a time, cannot hold a partial message
    # (up to 128 KiB) on a worker for ever. 10 s lets the largest message come at ~13 KB/s.
    "WS_MESSAGE_TIMEOUT_SECONDS": 10.0,
    # Connections one worker process lets wait for their request headers at once; past it the one
    # waiting the longest is closed. A client sends its request as soon as it connected, so its
    # wait is about a round trip: 256 is 1,000 new connections a second at 250 ms each, and a
    # flood of silent sockets takes at most a quarter of a common 1,024 file-descriptor limit.
    "MAX_PENDING_CONNECTIONS": 256,
    # Failed WebSocket authentications (a bad token or session) per client network (an IPv4
    # address, an IPv6 /64) and worker process before its handshakes are closed unjudged, and how
    # fast it earns them back (execapp/auth_throttle.py): each failure is a database lookup on
    # the worker's one sync thread. 20 lets a misconfigured client see its mistake many times;
    # 30 a minute is a retry every two seconds. AUTH_FAILURES_BURST 0 turns it off.
    "AUTH_FAILURES_BURST": 20,
    "AUTH_FAILURES_PER_MINUTE": 30.0,
    # Credential lookups (a token's, a session cookie's and its user's) one worker process runs at
    # once, each a query on its one sync thread (~1-3 ms): past it a handshake is closed 1013
    # unjudged, so a flood of bad credentials from many networks (which the per-network throttle
    # does not see) queues nothing there for long.
    "MAX_TOKEN_LOOKUPS": 64,
    # How often each worker re-checks the credentials of its open connections (execapp/auth_watch.py):
    # a connection whose token was revoked, deleted or moved to another tenant, or whose staff user
    # was deactivated, since its handshake is closed with 1008 within about this long (a query per
    # kind per interval per worker, whatever the number of connections). 0 turns it off: a
    # withdrawn credential then refuses new connections only.
    "AUTH_RECHECK_SECONDS": 10.0,
    # Every HTTP request's body (execapp/http_limits.py): Django reads a whole body into a file that
    # rolls over to disk before it looks at the request, so without these a POST to any path wrote
    # as much to disk as its sender streamed. Past the size: 413; not all in after the time: 408.
    # 8 MiB holds the admin's largest upload (a 4 MiB plugin file) with the form around it; 60 s
    # lets that upload come at ~70 KB/s (a slow mobile link) and bounds how long a body holds a socket.
    "MAX_REQUEST_BODY_BYTES": 8 * 1_048_576,
    "REQUEST_BODY_TIMEOUT_SECONDS": 60.0,
    # A body from a client that may change nothing (not signed in, or staff with view permissions
    # only; execapp/read_only_body.py): the login form is a few hundred bytes, and Django's form
    # parser ran ~1 s of CPU on 5 MB of %-escapes that a made-up CSRF cookie got parsed. Past it: 413.
    "READ_ONLY_BODY_BYTES": 64 * 1024,
    # The bytes of request bodies still arriving that one worker process holds at once (Django's
    # spool: memory up to 2.5 MiB a body, then disk); past it the body arriving the longest is
    # answered 503 (execapp/http_limits.py), so stalled bodies on many connections cannot take the
    # worker's memory. 64 MiB is eight of the largest uploads arriving together.
    "MAX_PENDING_BODY_BYTES": 64 * 1_048_576,
    # Each client network's (an IPv4 address, an IPv6 /64) HTTP requests on one worker process
    # (execapp/http_share.py): at most this many in Django at once, the next waiting their turn
    # (past 64 times as many waiting: 429); and, while a WebSocket owner is active on the worker, a
    # share of its time (seconds a second, in (0, 1]) charged from the body being in to the
    # response's start: past it the next request waits (429 past 5 s). Without them 50 keep-alive
    # connections asking for /admin/login/ took a bystander tenant's /ping p99 from 4 ms to 589 ms.
    # HTTP_REQUESTS_PER_NETWORK 0 turns both off (behind a proxy that is not in
    # FORWARDED_ALLOW_IPS every client is the proxy's one network).
    "HTTP_REQUESTS_PER_NETWORK": 4,
    "HTTP_SHARE_PER_NETWORK": 0.25,
    # The same for every network's HTTP requests together (one client with many addresses): while
    # a WebSocket owner is active on the worker, HTTP takes at most this share of it (a quarter).
    "HTTP_SHARE_PER_WORKER": 0.25,
    # Password checks (a sign-in attempt: the admin's login) one worker process runs at once
    # (execapp/login_limit.py): each is ~0.5 s of CPU (PBKDF2), for an unknown user too, and needs
    # no credentials to ask for; past it the attempt is refused before hashing ("try again in a
    # moment"), so a flood of them holds at most this many threads of CPU.
    "MAX_PASSWORD_CHECKS": 2,
    # Failed sign-ins one client network, and one username from networks that never signed it in,
    # may have on a worker process before further attempts are refused unhashed, and how fast they
    # are earned back (execapp/login_throttle.py): so one client's flood of wrong passwords holds
    # none of the check slots the others sign in with. 10 covers a person's typos; 6 a minute is a
    # retry every 10 s. LOGIN_FAILURES_BURST 0 turns it off (then a flood refuses everyone).
    "LOGIN_FAILURES_BURST": 10,
    "LOGIN_FAILURES_PER_MINUTE": 6.0,
    # WebSocket protocol.
    "MAX_FRAME_BYTES": 64 * 1024,
    "MAX_IN_FLIGHT_PER_CONNECTION": 100,
    # Open WebSocket connections one owner (a token's tenant, a staff user) may hold on one worker
    # process: past it the handshake is closed with 1008 (docs/protocol.md). A quota, so that one
    # tenant's connection flood (each holds buffers, an outbox and its sessions' fan-out) cannot
    # take the worker's memory and file descriptors from the others.
    "MAX_CONNECTIONS_PER_OWNER": 1000,
    # The share of one worker's event loop one owner's frames may spend being decoded (a fraction
    # in (0, 1]; execapp/loop_share.py). A 64 KB frame of nested arrays takes ~10 ms to decode:
    # past its share an owner's connections stop reading until it refills (TCP backpressure on
    # that client), so one tenant's frames cannot hold the loop every connection shares. A
    # single-tenant deployment whose one owner sends heavy frames at high rates may raise it.
    "DECODE_SHARE_PER_OWNER": 0.25,
    # The share of one worker's thread pool (a fraction of POOL_MAX_WORKERS, in (0, 1];
    # execapp/pool_share.py) one owner's events may hold with pooled work running, queued or
    # waiting for a slot (counted in pooled handlers: a frame matching 10 of them holds 10),
    # while another owner's events use the pool too: past it the owner's connections stop reading
    # until one of its pooled events is done (TCP backpressure on that owner), so one tenant's
    # slow handlers cannot take every thread and queue slot from the others. Alone on a worker an
    # owner keeps the whole pool.
    "POOL_SHARE_PER_OWNER": 0.5,
    # Deepest nesting of arrays/objects in a frame (the event object is level 1), checked before
    # the JSON decoder runs: deeper frames get "too_deep" (docs/protocol.md).
    "MAX_FRAME_DEPTH": 32,
    # Each connection's outbox (execapp/outbox.py, docs/protocol.md "Limits and flow control"):
    # frames queued for a client that reads slower than they come. Past either limit, frames of
    # other session members are dropped (the member gets one `lagged` frame with the count once
    # it caught up) and the connection stops reading the client's own frames until it drains.
    "OUTBOX_MAX_FRAMES": 1000,
    "OUTBOX_MAX_BYTES": 1_048_576,
    # The bytes all of one owner's outboxes on one worker may hold together (execapp/outbox_budget.py;
    # 0: no owner budget). Past it the owner's connections stop reading their clients' frames and
    # other members' session frames to them are dropped (then `lagged`), as for one full outbox.
    # Without it one owner could make a worker hold MAX_CONNECTIONS_PER_OWNER x OUTBOX_MAX_BYTES
    # (~1 GiB); 16 MiB lets 16 of its connections back up to their full 1 MiB at once (a few
    # stalled session members, a slow dashboard) while a single tenant costs a worker 1/64 of that.
    "OWNER_OUTBOX_BYTES": 16 * 1_048_576,
    # Connections each worker process's Redis channel layer opens to Redis at most (its pool,
    # execapp/redis_layer.py): past it a command waits for one (up to the layer's POOL_WAIT_SECONDS)
    # instead of failing at once (redis-py's pool raised MaxConnectionsError at its 100th, and one
    # failed receive made the worker judge its whole layer down: every session's frames lost).
    "LAYER_MAX_CONNECTIONS": 100,
    # Group sends (a session frame each), joins and leaves one owner's connections may have in flight
    # to the channel layer at once, per worker process (execapp/consumers.py): past it that owner's next publish
    # waits, its connections' session outboxes fill and they stop being read (backpressure on that
    # owner only). Without it 250 connections of one tenant publishing took every Redis connection
    # of the worker: another tenant's members heard 0 of 159 frames. Keep it well below
    # LAYER_MAX_CONNECTIONS so several owners publishing at once still leave connections free.
    "SESSION_PUBLISHES_PER_OWNER": 8,
    # Bytes of session frames one owner's queue for one worker may hold in Redis (execapp/redis_fair.py;
    # past it, as past the layer's capacity of 1500 messages, that owner's frames for that worker are
    # dropped). Without it one tenant's 64 KiB frames held ~100 MB of the shared Redis per worker,
    # and a few such tenants filled it to maxmemory: every tenant's sessions, drains and resends failed.
    "SESSION_QUEUE_BYTES": 4 * 1_048_576,
    # The channel layer (execapp/layer_watch.py, docs/operations.md "When Redis goes away"): how
    # often each worker checks it and, once it answers again, re-adds its session and control
    # memberships. This sets the time from Redis' return to working sessions and control.
    "LAYER_CHECK_SECONDS": 1.0,
    # Safe resend (execapp/resend.py, docs/protocol.md "Resending after a lost connection"): a
    # running `"resend": true` event holds a lease its worker renews (a killed worker's lapses
    # after this long, then a resend runs it again); a completed one is answered from its record
    # for this long.
    "RESEND_LEASE_SECONDS": 3.0,
    "RESEND_RETENTION_SECONDS": 600.0,
    # All the Redis calls of one resend event's claim, and of its record at completion, together:
    # past it the claim is refused resend_unavailable, the done says "recorded": false (execapp/resend.py).
    "RESEND_DEADLINE_SECONDS": 2.0,
    # Background work of each worker.
    "PROFILE_FLUSH_SECONDS": 5.0,
    "SNAPSHOT_SECONDS": 1.0,
    "WORKER_STALE_SECONDS": 10.0,
    "WORKER_DROP_SECONDS": 60.0,
    "REGISTRY_POLL_SECONDS": 2.0,
    # Dashboard charts: how much history each worker keeps (one point per SNAPSHOT_SECONDS).
    "DASHBOARD_HISTORY_SECONDS": 300.0,
    # The dashboard's data requests (~9 ms of CPU each, on a request thread sharing the GIL with the
    # event loop), per worker process: at most this many at once (503 past it), and this many a
    # second per user (429 past a burst of twice it); the page polls every 0.5-2 s
    # (execapp/dashboard_limit.py).
    "DASHBOARD_MAX_REQUESTS": 4,
    # All the Redis calls of one dashboard data request or Events page together: past it they fail
    # at once (redis_unavailable) and the page answers with what it has (execapp/redis_deadline.py).
    "REDIS_REQUEST_DEADLINE_SECONDS": 2.0,
    # All the Redis calls of one dashboard snapshot publish (a worker's housekeeper, every
    # SNAPSHOT_SECONDS): past it they fail at once and the next tick tries again (execapp/snapshots.py).
    "SNAPSHOT_PUBLISH_DEADLINE_SECONDS": 0.5,
    # All the Redis calls of one event-history flush on the housekeeper (every tick) together:
    # past it they fail at once and that flush's traces are lost, as with Redis down (execapp/history.py).
    "HISTORY_FLUSH_DEADLINE_SECONDS": 2.0,
    # Every HTTP request's database calls (admin pages, their session and user lookups) end within
    # this of its start on PostgreSQL, or its connection is cut and it answers 503
    # database_unavailable (execapp/request_db_deadline.py).
    "REQUEST_DB_DEADLINE_SECONDS": 30.0,
    "DASHBOARD_REQUESTS_PER_SECOND": 4.0,
    # Draining and shutdown.
    "DRAIN_TIMEOUT_SECONDS": 25.0,
    "SHUTDOWN_GRACE_SECONDS": 25.0,
    # A drain stops waiting for `done` frames queued for clients that have read nothing for this
    # long, once every handler is over (execapp/drain.py, UnreadClients). 0: wait for every one.
    "DRAIN_UNREAD_CLIENT_SECONDS": 5.0,
    # The execapp.serve supervisor's watchdog (execapp/watchdog.py, docs/operations.md): a worker
    # whose event loop has not beaten for this long is killed and replaced, and the matcher it
    # was running inline is quarantined on every worker. Far above any legitimate loop pause.
    "LOOP_STALL_SECONDS": 5.0,
    # Pool threads stuck past their deadline at which a worker is drained and replaced.
    "STUCK_THREADS_LIMIT": 8,
    # A ready worker whose housekeeping thread (metrics, snapshots, history, the stuck-thread count
    # and quarantine list above) has not come round for this long, a service's tick stuck, is
    # recycled like one with stuck threads: its stacks logged, a replacement started, then it drains.
    # Its services' own deadlines are a few seconds at most. 0: never.
    "HOUSEKEEPER_STALL_SECONDS": 30.0,
    # The longest wait before the supervisor starts another worker after consecutive ones died
    # before serving (a crash loop, execapp/restart_backoff.py): 0.5 s, doubling, up to this. 0: none.
    "RESTART_BACKOFF_MAX_SECONDS": 30.0,
    # A worker process not listening this long after its start (hung in its imports or in building
    # its Worker) is killed and replaced; above execapp.server.STARTUP_READY_SECONDS (30 s), after
    # which a worker whose services are slow to tick listens anyway. 0: never.
    "WORKER_START_TIMEOUT_SECONDS": 90.0,
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
    # Non-public networks plugins' http_get may reach (a list of CIDRs, or comma-separated text);
    # None: public addresses only (plugins/runtimes/deadline_net.py).
    "PLUGIN_HTTP_ALLOWED_NETWORKS": None,
    # Log lines and bytes a second one plugin's calls may write in one worker process, across its
    # calls (plugins/runtimes/log_rate.py; a burst of 10 s of each after a quiet spell). The per-call
    # log quota bounds one call only: a plugin called in a loop wrote 8.5 MB of log a second from
    # one thread. Past it lines are dropped and counted (one line per 10 s says how many). 0: no limit.
    "PLUGIN_LOG_LINES_PER_SECOND": 200.0,
    "PLUGIN_LOG_BYTES_PER_SECOND": 131_072.0,
    # Event history (execapp/history.py, docs/observability.md "Event history"): every event's
    # trace in a bounded recent store (Redis with REDIS_URL, else this process), failures also in
    # the database for HISTORY_FAILURE_DAYS (`manage.py prune_history`). 0 events: store none
    # (failures are still counted for the dashboard and /metrics).
    "HISTORY_MAX_EVENTS": 100_000,
    # Without Redis, the recent store is this process's memory: it also keeps at most about this
    # many bytes of traces (oldest trimmed first), so traces of large replies and long plugin
    # error messages (up to ~13 KB each) cannot make 100,000 of them a gigabyte of the worker.
    "HISTORY_LOCAL_MAX_BYTES": 128 * 1024 * 1024,
    # With Redis, the recent store keeps at most this many bytes of traces (their JSON bodies and
    # ~400 bytes each besides), the oldest of the owner holding the most bytes evicted first: by
    # count alone, 100,000 traces of ~13 KB (large replies, long plugin errors) were 1.3 GB of the
    # Redis the channel layer needs too.
    "HISTORY_REDIS_MAX_BYTES": 256 * 1024 * 1024,
    "HISTORY_FAILURE_DAYS": 7.0,
    # The database keeps at most this many failure traces per owner (the newest; the hourly prune
    # and `manage.py prune_history` delete the rest). A quota: one tenant whose events all fail
    # writes 100 rows a second per worker (DB_ROWS_PER_OWNER_PER_SECOND), ~60 million a worker in
    # the 7 days kept; with the cap it keeps 100,000 plus what it writes between two prunes.
    "HISTORY_FAILURES_PER_OWNER": 100_000,
    # How much of an event a trace keeps: its text's first characters, its replies' bytes.
    "HISTORY_TEXT_CHARS": 200,
    "HISTORY_REPLY_BYTES": 4096,
    "HISTORY_FLUSH_SECONDS": 0.5,
    # Searches of the Events page one worker process runs at once: each reads up to every trace of
    # the recent store (100,000: ~0.5 s of CPU on a request thread, which shares the GIL with the
    # event loop); past it the page answers 503 "busy" at once (execapp/history_admin.py).
    "HISTORY_MAX_SEARCHES": 2,
    # ... and how many one staff user may start a minute on one worker process (a burst of 20):
    # a browser tab stuck reloading the page kept one search (~0.5 s of CPU each) always running.
    "HISTORY_SEARCHES_PER_MINUTE": 30.0,
    # The longest timeout a handler may have (a plugin's timeout_ms is refused above it), and the
    # fixed buckets of execapp_handler_duration_seconds: they reach past it (a run stopped at its
    # timeout plus the engine's grace still lands in a bucket) and no bucket from 1 s on is more
    # than 2.5x the one before, so a percentile read from them is within that bucket's width.
    "MAX_HANDLER_TIMEOUT_SECONDS": 60.0,
    "DURATION_BUCKETS": (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75,
                         1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.5, 10.0, 12.5, 15.0, 20.0, 25.0, 30.0,
                         40.0, 50.0, 60.0, 75.0),
}

#: Every setting may also come from the environment: ``EXECAPP_<NAME>`` (e.g.
#: ``EXECAPP_MAX_IN_FLIGHT_PER_CONNECTION=200``) wins over settings.EXECAPP and the default.
#: The value is read as the default's type (numbers, ``true``/``false``, comma-separated lists;
#: text for settings whose default is None); ``manage.py check`` names a value that does not read.
ENV_PREFIX = "EXECAPP_"


class EnvValueError(ValueError):
    """An EXECAPP_<NAME> environment variable whose value is not of its setting's type."""

    code = "bad_setting"


def _from_env(name: str, raw: str) -> Any:
    """The value of the environment variable for setting ``name``, read as its default's type."""
    default = DEFAULTS[name]
    text = raw.strip()
    try:
        if isinstance(default, bool):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("not a boolean")
        if isinstance(default, int):
            return int(text.replace("_", ""))
        if isinstance(default, float):
            return float(text)
        if isinstance(default, (tuple, list)):
            return tuple(float(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        kind = {bool: "true or false", int: "a whole number", float: "a number"}.get(
            type(default), "comma-separated numbers")
        raise EnvValueError(f"environment variable {ENV_PREFIX}{name}={raw!r} is not {kind} (the type of "
                            f"EXECAPP[{name!r}], default {default!r}); fix or unset it") from None
    return text if text else None


def get(name: str) -> Any:
    """Return the value of one EXECAPP setting, read at call time: the environment variable
    EXECAPP_<name> if set, else settings.EXECAPP[name], else the default. An environment value
    that does not read as the setting's type is returned as its raw text (``manage.py check``
    reports it)."""
    if name not in DEFAULTS:
        raise KeyError(f"unknown EXECAPP setting {name!r}; known: {', '.join(sorted(DEFAULTS))}")
    raw = os.environ.get(ENV_PREFIX + name)
    if raw is not None:
        try:
            return _from_env(name, raw)
        except EnvValueError:
            return raw
    user = getattr(settings, "EXECAPP", {}) or {}
    return user.get(name, DEFAULTS[name])


def source(name: str) -> str:
    """Where the value of setting ``name`` comes from, for messages: the environment variable,
    settings.EXECAPP, or the default."""
    if ENV_PREFIX + name in os.environ:
        return f"environment variable {ENV_PREFIX}{name}"
    if name in (getattr(settings, "EXECAPP", {}) or {}):
        return "settings.EXECAPP"
    return "default"


def env_errors() -> list[EnvValueError]:
    """The EXECAPP_<NAME> environment variables whose values do not read as their settings' types."""
    errors = []
    for name in DEFAULTS:
        raw = os.environ.get(ENV_PREFIX + name)
        if raw is not None:
            try:
                _from_env(name, raw)
            except EnvValueError as exc:
                errors.append(exc)
    return errors


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
