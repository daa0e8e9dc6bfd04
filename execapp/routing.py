"""WebSocket routes; the consumer arrives with the ingestion issue."""
from channels.routing import URLRouter

websocket_urlpatterns: list = []

websocket_application = URLRouter(websocket_urlpatterns)
