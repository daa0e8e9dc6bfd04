"""The control protocol: drain, undrain and status requests to every worker over the channel layer.

Every worker process runs a listener (``execapp.control_listener``) on a thread of its own
(``execapp.control_thread``), with its own event loop and its own channel-layer instance
(channels_redis allows one receiving loop per layer instance, and the ASGI loop's consumers
already receive on the shared one). The listener joins the group ``execapp.workers`` and, with
Redis, beats a heartbeat into a registry (``execapp.control_registry``) so a command knows
which workers to expect. A command (``execapp.control_client.request``) makes a reply channel,
group-sends one request and collects one answer per worker until all expected workers answered
or its deadline passed; a worker that stayed silent is named in ``ControlResult.missing``.

Messages (msgpack'd by channels_redis, so plain data only):
  request: {"type": "execapp.control", "op": "status"|"drain"|"undrain", "request": <id>,
            "reply_to": <channel>, "worker": <id or None: every worker>, "timeout": <seconds>}
  answer:  {"type": "execapp.control.reply", "request": <id>, "op": ..., "worker": <id>,
            "result": {...}}  (drain: execapp.drain.drain_worker's report)

This module holds what both sides share: the group, the message types, the operations, the
errors, and which channel layer can carry them.
"""
from __future__ import annotations

from typing import Any

from .engine.errors import ExecAppError

#: The channel-layer group every worker's listener joins.
CONTROL_GROUP = "execapp.workers"
#: The ``type`` of a request, and of an answer.
REQUEST = "execapp.control"
ANSWER = "execapp.control.reply"
#: The operations a request can ask for.
OPS = ("status", "drain", "undrain")


class ControlUnavailable(ExecAppError):
    """No request can reach the workers: the channel layer is in memory, or its Redis does not
    answer. ``reason``: the short cause (for ``--json``)."""

    code = "control_unavailable"

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class UnknownWorker(ExecAppError):
    """``--worker ID`` names no live worker."""

    code = "unknown_worker"


# -- which layer ------------------------------------------------------------------------------------

def layer_backend() -> str:
    """The dotted class path of the default channel layer ('' when none is configured)."""
    from channels import DEFAULT_CHANNEL_LAYER
    from django.conf import settings

    return (getattr(settings, "CHANNEL_LAYERS", {}) or {}).get(DEFAULT_CHANNEL_LAYER, {}).get("BACKEND", "")


def shared_layer_configured() -> bool:
    """True when the channel layer crosses processes (not in-memory): control can work."""
    backend = layer_backend()
    return bool(backend) and not backend.endswith("InMemoryChannelLayer")


def require_shared_layer() -> None:
    """Raise ControlUnavailable, saying what to do, unless the channel layer crosses processes."""
    if not shared_layer_configured():
        raise ControlUnavailable(
            f"the channel layer is {layer_backend() or 'not configured'}, which cannot reach the server from "
            "another process: set REDIS_URL (e.g. REDIS_URL=redis://127.0.0.1:6379/0) for the server and for this "
            "command. The embedded single-process server drains on its own when stopped: press Ctrl+C or send it "
            "SIGTERM (it waits up to EXECAPP['SHUTDOWN_GRACE_SECONDS'] for every accepted event's done); "
            "GET /healthz shows whether it is draining. See docs/operations.md.",
            reason=f"the channel layer is {layer_backend() or 'not configured'} (in one process)")


def new_layer() -> Any:
    """A private instance of the default channel layer (its own connections and receive loop)."""
    from channels import DEFAULT_CHANNEL_LAYER
    from channels.layers import channel_layers

    return channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)
