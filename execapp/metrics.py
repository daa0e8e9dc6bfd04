"""The app's Prometheus metrics: their definitions, and counting each event's outcome.

Who feeds them: ``execapp.metrics_updater`` (a worker service copying the engine's, pool's,
profiles' and plugin pools' counters, and the buffered run observations), the connection
(``count_event`` for a refusal, ``DONE_TALLY`` for a ``done``), the handshake (``unauthorized``) and the HTTP protocol's
header deadline (``execapp.handshake``). Who serves them:
``execapp.metrics_view`` (with ``execapp.metrics_access``); several processes add up through
``execapp.metrics_multiprocess``. See docs/observability.md.
"""
from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram

from . import conf
from .codes import ERROR, EVENT_OUTCOMES, OK, OTHER

#: Handler durations: EXECAPP['DURATION_BUCKETS'] (read once, when this module is imported: a
#: histogram's buckets are fixed), from 100 us (a Lua call) past MAX_HANDLER_TIMEOUT_SECONDS.
DURATION_BUCKETS = tuple(float(b) for b in conf.get("DURATION_BUCKETS"))
#: Scheduling delay (submit -> start): 10 us (idle hand-off) .. 10 s (a long queue).
DELAY_BUCKETS = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Per-worker gauges carry ``worker``: the worker's slot number (0, 1, ...; execapp.metrics_updater
# .worker_label), not its host-pid id, so a replaced worker continues its predecessor's series.
# Summed over live processes ("livesum"): a dead worker's pool leaves the total.
_W = ["worker"]
POOL_IN_FLIGHT = Gauge("execapp_pool_in_flight", "Handlers running in pool threads now.", _W,
                       multiprocess_mode="livesum")
POOL_QUEUED = Gauge("execapp_pool_queued", "Handlers waiting in pool queues now.", _W, multiprocess_mode="livesum")
POOL_CAPACITY = Gauge("execapp_pool_capacity", "Pool concurrency tokens (threads) of the worker.", _W,
                      multiprocess_mode="livesum")
POOL_QUEUE_CAPACITY = Gauge("execapp_pool_queue_capacity", "Pool queue slots of the worker.", _W,
                            multiprocess_mode="livesum")
POOL_THREADS = Gauge("execapp_pool_threads", "Live pool threads (running or lingering idle).", _W,
                     multiprocess_mode="livesum")
POOL_STUCK = Gauge("execapp_pool_stuck_threads", "Pool threads running a handler past its deadline now (the "
                   "handler ignored it; past EXECAPP['STUCK_THREADS_LIMIT'] the worker is recycled).", _W,
                   multiprocess_mode="livesum")
WORKER_DRAINING = Gauge("execapp_worker_draining", "1 while the worker drains (refuses new events with "
                        "`draining`), else 0.", _W, multiprocess_mode="livesum")
POOL_STUCK_TOTAL = Counter("execapp_pool_stuck_total", "Pooled handler runs that overran their deadline and "
                           "held their thread after it (each was answered with `timeout`).")
POOL_SUBMITTED = Counter("execapp_pool_submitted_total", "Handlers accepted by a pool.")
POOL_COMPLETED = Counter("execapp_pool_completed_total", "Pooled handlers finished without a pool-level failure.")
POOL_FAILED = Counter("execapp_pool_failed_total", "Pool tasks that raised (a bug: handlers report their errors).")
POOL_REJECTED = Counter("execapp_pool_rejected_total", "Submissions refused by a full or closed pool.")
POOL_FALLBACKS = Counter("execapp_pool_fallbacks_total", "Handlers run inline because the pool was full.")
POOL_OVERLOADED = Counter("execapp_pool_overloaded_total",
                          "Handlers refused with 'overloaded' after the overflow wait.")
SCHEDULING_DELAY = Histogram("execapp_pool_scheduling_delay_seconds", "Pool submit-to-start delay.",
                             buckets=DELAY_BUCKETS)
HANDLER_DURATION = Histogram("execapp_handler_duration_seconds", "Handler run time by matcher and exec class.",
                             ["matcher", "plugin", "exec_class"], buckets=DURATION_BUCKETS)
HANDLER_RUNS = Counter("execapp_handler_runs_total", "Handler runs by outcome (ok, handler_error, timeout, "
                       "overloaded).", ["outcome"])
EVENTS = Counter("execapp_events_total", "Events by the terminal outcome their client was told.", ["outcome"])
LOOP_SHARE_WAITS = Counter("execapp_loop_share_waits_total", "Times a connection stopped reading its frames because "
                           "its owner had spent its share of the event loop (decoding, dispatch) while other "
                           "owners were active (EXECAPP['DECODE_SHARE_PER_OWNER']).")
POOL_SHARE_WAITS = Counter("execapp_pool_share_waits_total", "Times a connection stopped reading its frames because "
                           "its owner's events held its share of the thread pool while other owners' events used "
                           "the pool too (EXECAPP['POOL_SHARE_PER_OWNER']).")
OWNER_OUTBOX_WAITS = Counter("execapp_owner_outbox_waits_total", "Times a connection stopped reading its frames "
                             "because its owner's connections on its worker together held their outbox budget "
                             "(frames queued for clients that read slower than they come; "
                             "EXECAPP['OWNER_OUTBOX_BYTES']).")
EVENTS_DISPATCHED = Counter("execapp_events_dispatched_total", "Events handed to an engine.")
PROMOTIONS = Counter("execapp_profile_promotions_total", "Matchers promoted to the pool.", ["matcher"])
DEMOTIONS = Counter("execapp_profile_demotions_total", "Matchers demoted to inline.", ["matcher"])
PLUGIN_TIMEOUTS = Counter("execapp_plugin_timeouts_total", "Plugin calls stopped by their time budget.", ["plugin"])
PLUGIN_ERRORS = Counter("execapp_plugin_errors_total", "Plugin calls that failed.", ["plugin"])
PLUGIN_WAITS = Counter("execapp_plugin_instance_waits_total", "Plugin calls that waited for an instance.",
                       ["plugin"])
PLUGIN_BUSY = Gauge("execapp_plugin_instances_busy", "Plugin instances in use.", ["plugin"],
                    multiprocess_mode="livesum")
PLUGIN_IDLE = Gauge("execapp_plugin_instances_idle", "Plugin instances idle.", ["plugin"],
                    multiprocess_mode="livesum")
PLUGIN_WAITING = Gauge("execapp_plugin_instances_waiting", "Plugin calls waiting for an instance now.", ["plugin"],
                       multiprocess_mode="livesum")
# From the event history's recorder (execapp.history): every handler that failed or was refused,
# whatever refused it (the engine, a plugin's own limit, a quota), by matcher, plugin and code.
HANDLER_FAILURES = Counter("execapp_handler_failures_total", "Handlers that failed or were refused, by matcher, "
                           "plugin and code (plugin_busy, overloaded, draining and quota_* are refusals; "
                           "handler_error, timeout... failures).", ["matcher", "plugin", "code"])
# Refusals before any matching (the connection's in-flight cap, draining, resend_*): no matcher or
# plugin to name, so by worker slot and code (execapp.codes.EVENT_REFUSAL_CODES, and draining).
EVENT_REFUSALS = Counter("execapp_event_refusals_total", "Events refused before any handler was matched, by "
                         "worker slot and code (rate_limited, draining, resend_*).", ["worker", "code"])
SESSION_FRAMES_DROPPED = Counter("execapp_session_frames_dropped_total", "Frames of other session members dropped "
                                 "for a member that fell behind (it then gets one `lagged` frame), by worker slot.",
                                 ["worker"])
# From execapp.handshake (before a request's headers are all in), execapp.http_limits and
# execapp.chunked_framing (bodies) and execapp.ws_flow (after a WebSocket handshake).
CONNECTIONS_CLOSED = Counter("execapp_connections_closed_total", "Connections the server closed for a protocol "
                             "limit, by reason: handshake_timeout (request line and headers not in "
                             "EXECAPP['HANDSHAKE_TIMEOUT_SECONDS']), pending_cap (the oldest waiting past "
                             "EXECAPP['MAX_PENDING_CONNECTIONS']), header_too_large (request line and headers "
                             "over 64 KiB), bad_request (refused by the HTTP parser), body_too_large, body_timeout, "
                             "body_pending_cap (execapp.http_limits), body_framing (execapp.chunked_framing), "
                             "too_many_control_frames, too_many_fragments, handshake_refused, invalid_utf8 "
                             "(execapp.ws_flow).",
                             ["reason"])
PASSWORD_CHECKS_REFUSED = Counter("execapp_password_checks_refused_total", "Sign-in attempts refused before "
                                  "any password hashing, by reason: busy (the worker already ran "
                                  "EXECAPP['MAX_PASSWORD_CHECKS'] checks, or its last slot is kept for another "
                                  "network), network, username or device (too many failed sign-ins from it, "
                                  "EXECAPP['LOGIN_FAILURES_BURST']) (execapp.login_limit).", ["reason"])
for _reason in ("busy", "network", "username", "device"):  # a fixed set, present at 0 from the start
    PASSWORD_CHECKS_REFUSED.labels(_reason)
HISTORY_TRACES = Counter("execapp_history_traces_total", "Event traces recorded (docs/observability.md).")
HISTORY_DROPPED = Counter("execapp_history_dropped_total", "Trace items dropped because the recorder's buffer was "
                          "full (its housekeeper fell behind).")

#: Gauges of one worker, zeroed when its updater closes (it no longer counts among the live).
WORKER_GAUGES = (POOL_IN_FLIGHT, POOL_QUEUED, POOL_CAPACITY, POOL_QUEUE_CAPACITY, POOL_THREADS, POOL_STUCK,
                 WORKER_DRAINING)


def count_event(outcome: str) -> None:
    """Count one event by the refusal its client got (its code; execapp.codes.EVENT_OUTCOMES,
    else ``other``). A ``done`` is counted in ``DONE_TALLY`` instead."""
    EVENTS.labels(outcome if outcome in EVENT_OUTCOMES else OTHER).inc()


#: ``done`` frames queued since this process started, [ok, error]: the connection counts one
#: per event on the event loop with a list add, not a Prometheus increment (a lock and, in
#: multiprocess mode, a write to the worker's mmap file: ~1.3 us on every event). ``flush_done``
#: copies them into execapp_events_total: each metrics updater tick, and before every scrape.
#: (Only event loops write it; one per worker process.)
DONE_TALLY = [0, 0]
_done_flushed = [0, 0]
_done_lock = threading.Lock()  # flushes run on the housekeeper and on scrapes


def flush_done() -> None:
    """Add what ``DONE_TALLY`` counted since the last flush to execapp_events_total."""
    with _done_lock:
        for i, outcome in enumerate((OK, ERROR)):
            now = DONE_TALLY[i]
            if now != _done_flushed[i]:
                EVENTS.labels(outcome).inc(now - _done_flushed[i])
                _done_flushed[i] = now
