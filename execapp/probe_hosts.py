"""Probes and scrapes by address: ``/healthz`` (and ``/metrics`` when it needs a token) answer
whatever the request's Host.

Kubernetes' httpGet probes and Prometheus' pod discovery reach a worker by its IP address, so the
Host header is ``10.1.2.3:8000``, which no ALLOWED_HOSTS lists ahead of time: Django answered
400 (DisallowedHost) and the probe failed; every pod stayed unready. The Host check guards
against DNS rebinding, a browser tricked into reading a page of this server as another site's:
``/healthz`` holds nothing to read, and ``/metrics`` with a bearer token cannot be read by a
browser that does not have it; without a token it keeps the check.
"""
from __future__ import annotations

from typing import Callable

from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse

from .metrics_access import metrics_token

HEALTH_PATH = "/healthz"
METRICS_PATH = "/metrics"


def _any_allowed_host() -> str:
    """A host name ALLOWED_HOSTS accepts ('localhost' when it lists none, as under DEBUG)."""
    for pattern in settings.ALLOWED_HOSTS:
        if pattern != "*":
            return pattern.lstrip(".")
    return "localhost"


class ProbeHostMiddleware:
    """Before every other middleware: a probe's Host that ALLOWED_HOSTS refuses is replaced by one it
    accepts, for ``/healthz`` always and ``/metrics`` when a token is required (module docstring)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path == HEALTH_PATH or (request.path == METRICS_PATH and _token_required()):
            try:
                request.get_host()
            except DisallowedHost:
                request.META["HTTP_X_EXECAPP_PROBE_HOST"] = request.META.get("HTTP_HOST", "")
                request.META["HTTP_HOST"] = _any_allowed_host()
                request.META.pop("HTTP_X_FORWARDED_HOST", None)
        return self.get_response(request)


def _token_required() -> bool:
    try:
        return bool(metrics_token())
    except Exception:  # a token setting that cannot be used: /metrics refuses anyway (execapp.metrics_access)
        return False
