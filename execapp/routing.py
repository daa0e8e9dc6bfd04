"""WebSocket routes, behind handshake authentication (config/asgi.py serves ``websocket_application``)."""
from channels.routing import URLRouter
from django.urls import path, re_path

from .auth import Receive, Scope, Send, TokenAuthMiddleware, deny
from .consumers import EventConsumer


async def not_found(scope: Scope, receive: Receive, send: Send) -> None:
    """Any other WebSocket path: refused at the handshake with a pointer to the real one."""
    await deny(scope, receive, send, "not_found", f"no WebSocket endpoint at {scope.get('path')!r}; "
                                                       "connect to /ws/events/", outcome=None)


websocket_urlpatterns: list = [
    path("ws/events/", EventConsumer.as_asgi()),
]

websocket_application = TokenAuthMiddleware(URLRouter([*websocket_urlpatterns, re_path(r"", not_found)]))
