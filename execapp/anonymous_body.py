"""A request body from a client not signed in as active staff: at most ANONYMOUS_BODY_BYTES.

Django parses a form body whole the first time anything reads ``request.POST``, and the CSRF
check does that on every POST that carries a CSRF cookie, before it judges the token: a cookie
the client makes up will do. Percent-decoding runs a Python loop per ``%`` escape, so a 5 MB form
of ``%41`` (what DATA_UPLOAD_MAX_MEMORY_SIZE allows, for the admin's plugin uploads) cost the
worker ~1 s of CPU and ~200 MB of short-lived objects, with the GIL the event loop needs: from
one client network, no login, within its HTTP share, another tenant's ``/ping`` went from p99
2.3 ms to 726 ms and the worker's RSS from 449 to 668 MB in 10 s. Nothing a client that is not
signed in may send needs more than the login form: past the limit its body is answered 413
before any middleware or view reads it. Staff (uploading plugins) keep Django's limits.
"""
from __future__ import annotations

from typing import Any, Callable

from django.http import HttpRequest, HttpResponse

from . import conf


def _staff(user: Any) -> bool:
    return bool(user is not None and user.is_authenticated and user.is_active and user.is_staff)


class AnonymousBodyLimit:
    """413 for a body over EXECAPP['ANONYMOUS_BODY_BYTES'] from a client not signed in as active staff.

    After AuthenticationMiddleware (it reads ``request.user``: the session's user, looked up once,
    as the CSRF check would), and before anything reads ``request.POST``: the CSRF check reads it
    in ``process_view``, which runs after every middleware's ``__call__``."""

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> Any:
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0  # Django reads no body without a valid length
        limit = int(conf.get("ANONYMOUS_BODY_BYTES"))
        if length > limit and not _staff(getattr(request, "user", None)):
            return HttpResponse(f"a request body of {length} bytes from a client not signed in as staff is over the "
                                f"limit of {limit} bytes (EXECAPP['ANONYMOUS_BODY_BYTES']); sign in first",
                                status=413, content_type="text/plain; charset=utf-8")
        return self.get_response(request)
