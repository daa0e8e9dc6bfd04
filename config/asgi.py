"""ASGI entry point: HTTP through Django, WebSocket through Channels."""
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402

from execapp.http_limits import RequestBodyLimit  # noqa: E402
from execapp.http_share import HttpShare  # noqa: E402
from execapp.routing import websocket_application  # noqa: E402
from execapp.static_files import StaticFiles  # noqa: E402

application = ProtocolTypeRouter(
    {
        # The embedded default serves the admin's static files itself; put a CDN or a
        # static file server in front in production if the admin sees heavy use. Every request
        # body is bounded in size and time before Django reads it (execapp/http_limits.py); a
        # static path with ../ in it is a 404 (execapp/static_files.py).
        # Each client network's requests run a few at once and within a share of the worker while
        # others are served (execapp/http_share.py).
        "http": RequestBodyLimit(HttpShare(StaticFiles(django_asgi_app))),
        "websocket": websocket_application,
    }
)
