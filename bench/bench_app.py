"""The ASGI application bench/bench_ws.py serves: config.asgi plus two benchmark-only baselines.

``/ws/bench/bare/`` and ``/ws/bench/direct/`` answer every frame like ``/ping`` (a reply and a
done) without the engine, behind the same handshake authentication as ``/ws/events/``; every
other scope goes to config.asgi unchanged. Production code has no benchmark routes: only a
server started with ``--app bench.bench_app:application`` serves these. ``BENCH_NO_HISTORY=1``
leaves the event history's recorder out of the worker (bench/bench_history.py's baseline).
"""
from __future__ import annotations

import json
import os
from typing import Any

from config.asgi import application as project_application  # sets up Django first

# isort: split
from channels.generic.websocket import AsyncWebsocketConsumer  # noqa: E402  (after Django's setup)
from channels.routing import URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from execapp import worker as _worker  # noqa: E402
from execapp.auth import TokenAuthMiddleware  # noqa: E402

BENCH_PREFIX = "/ws/bench/"

# BENCH_NO_HISTORY=1 (bench/bench_history.py): the server runs without the event history's
# recorder, so its hooks return at once: the "before" of the recording-cost comparison.
if os.environ.get("BENCH_NO_HISTORY") == "1" and "execapp.history.recorder" in _worker.SERVICE_FACTORIES:
    _worker.SERVICE_FACTORIES.remove("execapp.history.recorder")


class BareBaselineConsumer(AsyncWebsocketConsumer):
    """Answers each frame with a reply and a done, without the engine, the way a plain Channels
    consumer would."""

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        frame = json.loads(text_data or "{}")
        eid = frame.get("id")
        await self.send(json.dumps({"type": "reply", "id": eid, "matcher": "command:ping", "plugin": None,
                                    "text": "pong", "data": None, "exec": "sync", "elapsed_ms": 0.0}))
        await self.send(json.dumps({"type": "done", "id": eid, "matched": 1, "replies": 1, "errors": 0,
                                    "blocked_by": None, "elapsed_ms": 0.0}))


class DirectBaselineConsumer(BareBaselineConsumer):
    """The bare consumer with execapp.consumers.EventConsumer's direct message routing (no
    per-frame close_old_connections hop), to isolate what the engine path itself costs."""

    async def dispatch(self, message: dict[str, Any]) -> None:
        if message["type"] == "websocket.receive":
            await self.receive(message.get("text"), message.get("bytes"))
        else:
            await super().dispatch(message)


_baselines = TokenAuthMiddleware(URLRouter([
    path("ws/bench/bare/", BareBaselineConsumer.as_asgi()),
    path("ws/bench/direct/", DirectBaselineConsumer.as_asgi()),
]))


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """config.asgi's application, with the baselines' WebSocket paths in front."""
    if scope["type"] == "websocket" and scope.get("path", "").startswith(BENCH_PREFIX):
        return await _baselines(scope, receive, send)
    return await project_application(scope, receive, send)
