"""A client-side deadline on each HTTP request's database statements (the admin's pages).

The handshakes' lookups, the KV calls and the history's writes have deadlines of their own
(execapp/db_deadline.py, execapp/db_cutoff.py); a Django request (an admin page, its session and
user lookups) had none: on a PostgreSQL that does not answer at all (a stalled host, a partition,
pgbouncer's queue) it held its request thread for as long as the stall lasted. This middleware
runs every HTTP request inside ``db_cutoff.cut_off_after(REQUEST_DB_DEADLINE_SECONDS)``: past it
the thread's connection is shut down on this side, the statement fails, and the request answers
``503`` ``database_unavailable`` instead of whatever page the failure made. One heap entry a
request, no statement and no transaction added (PostgreSQL only; SQLite is a local file). The
WebSocket path never goes through Django's middleware.
"""
from __future__ import annotations

from typing import Callable

from django.db import DEFAULT_DB_ALIAS, connections
from django.http import HttpRequest, HttpResponse

from . import conf
from .db_cutoff import DatabaseDeadline, cut_off_after


class RequestDatabaseDeadlineMiddleware:
    """Each request's database calls end within REQUEST_DB_DEADLINE_SECONDS of its start (503 past it)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if connections[DEFAULT_DB_ALIAS].vendor != "postgresql":
            return self.get_response(request)
        try:
            # A view's own failure is turned into a 500 page inside get_response: a cut connection
            # raises DatabaseDeadline here all the same (cut_off_after checks whether it fired).
            with cut_off_after(float(conf.get("REQUEST_DB_DEADLINE_SECONDS"))):
                return self.get_response(request)
        except DatabaseDeadline as exc:
            return HttpResponse(f"{exc.code}: {exc} (this request's EXECAPP['REQUEST_DB_DEADLINE_SECONDS'])",
                                status=503, content_type="text/plain; charset=utf-8", headers={"Retry-After": "5"})
