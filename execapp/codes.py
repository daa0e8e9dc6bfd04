"""Every code a client can be told, and the event outcomes /metrics counts: one list for both.

An ``error`` frame carries one of ``ERROR_CODES`` (docs/protocol.md lists them, with a test
keeping that table and this dict in step). ``execapp_events_total{outcome}`` counts each event
once by what its client was told: its ``done`` (``ok``, or ``error`` when a handler failed), the
code that refused it, or ``unauthorized`` for a refused handshake; so ``EVENT_OUTCOMES`` is
derived from ``ERROR_CODES`` and a new code is counted under its own name, never as ``other``.
"""
from __future__ import annotations

#: Every code an ``error`` frame can carry, with what it means. Handler codes come from the
#: engine and the plugin runtimes (``Failure.code``); any other ExecAppError code passes through.
ERROR_CODES: dict[str, str] = {
    "bad_json": "the text frame is not valid JSON",
    "bad_event": "the frame is JSON but not an event (the message names the field), a binary frame, or text "
                 "that is not valid Unicode (a lone surrogate such as \\ud800)",
    "too_large": "the frame is over EXECAPP['MAX_FRAME_BYTES'] bytes",
    "too_deep": "the frame nests arrays/objects deeper than EXECAPP['MAX_FRAME_DEPTH'] levels",
    "internal_error": "the server failed on this frame (a bug, logged); the connection stays open",
    "rate_limited": "the connection already has EXECAPP['MAX_IN_FLIGHT_PER_CONNECTION'] events in flight",
    "draining": "this worker takes no new events (a deploy is draining it); reconnect",
    # Safe resend (execapp/resend.py): a "resend": true event that is neither run nor replayed.
    "resend_in_progress": "a copy of this resend event still runs (its lease is renewed); resend after retry_after_ms",
    "resend_expired": "this resend event completed but its record is no longer kept; it is not run again",
    "resend_unavailable": "the resend record cannot be read or written now (Redis down, history off); retry later",
    "handler_error": "a handler raised; the event still gets its done",
    "timeout": "a handler ran out of time; the event still gets its done",
    "overloaded": "the worker pool stayed full; the handler was refused, not run",
    # Handler codes of the plugin runtimes (plugins/errors.py), passed through the same way:
    "plugin_busy": "the plugin is at its own concurrency limit; the handler was refused, not run",
    "plugin_unavailable": "the plugin version the event was matched to was replaced, disabled or deleted before "
                          "its call started; the handler was refused, not run (send the event again)",
    "memory_limit": "a handler ran into its plugin's memory cap",
    "permission_denied": "a handler called a host function its plugin has no permission for",
    # Host quotas (plugins.errors.QUOTA_CODES): the call was ended, the event still gets its done.
    "quota_kv": "a handler's kv_set or kv_incr would take its plugin's stored KV keys or bytes past their quota",
    "quota_kv_writes": "a handler made more kv_set and kv_incr calls in one call than its plugin's quota",
    "quota_kv_reads": "a handler made more kv_get calls, or read more value bytes, in one call than its plugin's "
                      "quota",
    "quota_http": "a handler made more http_get requests or received more response bytes in one call than its "
                  "plugin's quota",
}

#: The outcome of an event whose ``done`` reports no failed handler, and of one that reports some.
OK = "ok"
ERROR = "error"
#: The outcome of a WebSocket handshake refused by authentication (no valid token or staff
#: session, or a session from another site): HTTP 403 before any frame (execapp.auth).
UNAUTHORIZED = "unauthorized"
#: The outcome of a WebSocket handshake refused because its owner already holds
#: EXECAPP['MAX_CONNECTIONS_PER_OWNER'] connections to the worker (closed with 1008).
TOO_MANY_CONNECTIONS = "too_many_connections"
#: The outcome of a WebSocket handshake closed unjudged (1013) because its client network failed
#: to authenticate too often (execapp.auth_throttle).
AUTH_THROTTLED = "auth_throttled"
#: What an outcome outside ``EVENT_OUTCOMES`` is counted as (a code added without updating this module).
OTHER = "other"

#: Every label of ``execapp_events_total``: the done outcomes, every error code, the refused handshakes.
EVENT_OUTCOMES: frozenset[str] = frozenset((OK, ERROR, *ERROR_CODES, UNAUTHORIZED, TOO_MANY_CONNECTIONS,
                                            AUTH_THROTTLED))

#: The refusals that come before any matching: the whole event was refused (the connection's
#: in-flight cap, a resend that is neither run nor replayed), so they are counted per worker only.
EVENT_REFUSAL_CODES: frozenset[str] = frozenset(("rate_limited", "resend_in_progress", "resend_expired",
                                                 "resend_unavailable"))
#: The refusals a matched handler can get (``draining`` also refuses whole events): counted per
#: matcher and plugin in execapp_handler_failures_total; docs/prometheus/ lists these in its rules.
HANDLER_REFUSAL_CODES: frozenset[str] = frozenset(("plugin_busy", "plugin_unavailable", "overloaded", "draining",
                                                   "quota_kv", "quota_kv_writes", "quota_kv_reads",
                                                   "quota_http"))
#: The codes that say a handler or an event was refused (not run, or its call ended by a host
#: quota) rather than failed on its own: the dashboard's "refused" columns and the alert rules
#: (docs/prometheus/) count these.
REFUSAL_CODES: frozenset[str] = EVENT_REFUSAL_CODES | HANDLER_REFUSAL_CODES
