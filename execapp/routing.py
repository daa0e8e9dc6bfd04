"""WebSocket routes, behind handshake authentication (config/asgi.py serves ``websocket_application``)."""
import os

from channels.routing import URLRouter
from django.urls import path, re_path

from .auth import TokenAuthMiddleware, deny
from .consumers import BareBaselineConsumer, DirectBaselineConsumer, EventConsumer


async def not_found(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    """Any other WebSocket path: refused at the handshake with a pointer to the real one."""
    await deny(scope, receive, send, "not_found", f"no WebSocket endpoint at {scope.get('path')!r}; "
                                                       "connect to /ws/events/")


websocket_urlpatterns: list = [
    path("ws/events/", EventConsumer.as_asgi()),
]

# Benchmark baselines only (bench/bench_ws.py sets this in the server it starts): bare Channels
# consumers answering like /ping without the engine. Never enabled by settings.
if os.environ.get("EXECAPP_BENCH_BASELINE") == "1":
    websocket_urlpatterns += [path("ws/bench/bare/", BareBaselineConsumer.as_asgi()),
                              path("ws/bench/direct/", DirectBaselineConsumer.as_asgi())]

websocket_application = TokenAuthMiddleware(URLRouter([*websocket_urlpatterns, re_path(r"", not_found)]))
