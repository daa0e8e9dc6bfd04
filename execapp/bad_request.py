"""The 400 page (``handler400``): Django's, saying which limit a too-large form hit."""
from __future__ import annotations

from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.utils.html import format_html
from django.views import defaults

#: Django's own refusals of a form it will not read, and the setting behind each.
_LIMITS = ((RequestDataTooBig, "DATA_UPLOAD_MAX_MEMORY_SIZE"), (TooManyFieldsSent, "DATA_UPLOAD_MAX_NUMBER_FIELDS"),
           (TooManyFilesSent, "DATA_UPLOAD_MAX_NUMBER_FILES"))


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    """A form over one of Django's limits says which (it was a bare "Bad Request (400)"); others as Django's."""
    from django.conf import settings

    for kind, setting in _LIMITS:
        if isinstance(exception, kind):
            return HttpResponseBadRequest(format_html(
                "<!doctype html><title>Bad Request (400)</title><h1>Bad Request (400)</h1><p>{} (settings.{} = {}). "
                "Send less, or upload large content as a file: a plugin's code may be uploaded as a file of up to "
                "4 MiB.</p>", str(exception), setting, getattr(settings, setting)))
    return defaults.bad_request(request, exception)
