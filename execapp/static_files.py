"""The admin's static files, served by the app itself (the embedded default; config/asgi.py)."""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.exceptions import SuspiciousOperation
from django.core.handlers.exception import response_for_exception
from django.http import Http404, HttpRequest, HttpResponseBase


class StaticFiles(ASGIStaticFilesHandler):
    """Django's static file handler, with a path that leaves the static directories answered 404.

    Django's handler turns only Http404 into a response: ``/static/../config/settings.py``
    raised SuspiciousFileOperation out of it, so anyone, no login needed, got a 500 and wrote a
    60-line ERROR traceback into the server's log with each request."""

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        try:
            return await super().get_response_async(request)
        except SuspiciousOperation:
            missing = Http404(f"no static file {request.path!r}: the path leaves the static directories")
            return await sync_to_async(response_for_exception, thread_sensitive=False)(request, missing)
