"""A request body from a client that may change nothing: at most READ_ONLY_BODY_BYTES.

Django parses a form body whole the first time anything reads ``request.POST``, and the CSRF
check does that on every POST that carries a CSRF cookie, before it judges the token: a cookie
the client makes up will do. Percent-decoding runs a Python loop per ``%`` escape, so a 5 MB form
of ``%41`` (what DATA_UPLOAD_MAX_MEMORY_SIZE allows, for the admin's plugin uploads) cost the
worker ~1 s of CPU and ~200 MB of short-lived objects, with the GIL the event loop needs: from
one client network, no login, within its HTTP share, another tenant's ``/ping`` went from p99
2.3 ms to 726 ms and the worker's RSS from 449 to 668 MB in 10 s. A staff member holding only
view permissions did the same to any admin URL (~1 s of worker CPU a POST). A client that may
change nothing (not signed in, not active staff, or staff with view permissions only) needs no
more than the login form: past the limit its body is answered 413 before any middleware or view
reads it. Superusers, and staff who may add or change something, keep Django's limits.
"""
from __future__ import annotations

from typing import Any, Callable

from django.http import HttpRequest, HttpResponse

from . import conf


def may_change(user: Any) -> bool:
    """Whether ``user`` may change anything in the admin: an active superuser, or active staff holding
    a permission other than a ``view_`` one (its permissions are read only for a body past the limit)."""
    if user is None or not (user.is_authenticated and user.is_active and user.is_staff):
        return False
    return bool(user.is_superuser or any(not perm.partition(".")[2].startswith("view_")
                                         for perm in user.get_all_permissions()))


class ReadOnlyBodyLimit:
    """413 for a body over EXECAPP['READ_ONLY_BODY_BYTES'] from a client that may change nothing.

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
        limit = int(conf.get("READ_ONLY_BODY_BYTES"))
        if length > limit and not may_change(getattr(request, "user", None)):
            return HttpResponse(f"a request body of {length} bytes from a client that may change nothing here "
                                f"(not signed in, or with view permissions only) is over the limit of {limit} "
                                "bytes (EXECAPP['READ_ONLY_BODY_BYTES']); sign in as staff who may make the change",
                                status=413, content_type="text/plain; charset=utf-8")
        return self.get_response(request)
