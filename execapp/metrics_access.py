"""Who may scrape /metrics: client networks and an optional bearer token (docs/observability.md).

The client address is ``REMOTE_ADDR`` as the ASGI server gives it, never an ``X-Forwarded-For``
header read here: uvicorn replaces the address with the forwarded one only for the proxies its
``--forwarded-allow-ips`` trusts (127.0.0.1 by default). Behind a proxy on the same host every
client may therefore look local: set a token then.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from typing import Any

from django.http import HttpRequest

from . import conf
from .engine.ratelog import RateLimitedLog
from .networks import Network, parse_networks

log = RateLimitedLog(logging.getLogger("execapp.metrics"), interval=60.0)

#: Without any setting: only this host (a Prometheus on the same machine still scrapes).
LOOPBACK = ("127.0.0.0/8", "::1/128")


class MetricsAccessConfigError(ValueError):
    """EXECAPP['METRICS_ALLOWED_NETWORKS'] or ['METRICS_TOKEN'] cannot be used as given."""

    code = "metrics_access_config"


def metrics_token() -> str:
    """The bearer token a scrape must send, or '' when none is required."""
    value = conf.get("METRICS_TOKEN")
    if value is None:
        value = os.environ.get("METRICS_TOKEN", "")
    if not isinstance(value, str):
        raise MetricsAccessConfigError(f"EXECAPP['METRICS_TOKEN'] is {type(value).__name__} {value!r}: set it to "
                                       "a string (or None to read the METRICS_TOKEN environment variable)")
    return value.strip()


def allowed_networks() -> tuple[Network, ...]:
    """The client networks that may scrape: the setting, else env METRICS_ALLOWED_NETWORKS, else loopback."""
    value: Any = conf.get("METRICS_ALLOWED_NETWORKS")
    source = "EXECAPP['METRICS_ALLOWED_NETWORKS']"
    if value is None:
        value, source = os.environ.get("METRICS_ALLOWED_NETWORKS") or LOOPBACK, "METRICS_ALLOWED_NETWORKS"
    return parse_networks(value, source, MetricsAccessConfigError)


def _client_in(address: str, networks: tuple[Network, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # no address at all (a unix socket) or garbage: not in any network
        return False
    candidates = [ip] + ([ip.ipv4_mapped] if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else [])
    return any(c in net for c in candidates for net in networks if c.version == net.version)


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, credentials = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None


def refusal(request: HttpRequest) -> str | None:
    """None if this request may scrape /metrics, else the message of its 403 (saying what to set)."""
    address = request.META.get("REMOTE_ADDR") or ""
    try:
        networks, token = allowed_networks(), metrics_token()
    except MetricsAccessConfigError as exc:  # fail closed; `manage.py check` reports it too
        log.error(("metrics_config", str(exc)), "/metrics refused every scrape: %s", exc)
        return f"/metrics is refused to everyone: its access settings are invalid ({exc})."
    if not _client_in(address, networks):
        log.warning(("metrics_network",), "/metrics refused to %r: not in the allowed networks", address)
        return (f"/metrics refused: client address {address or '(none)'} is not in an allowed network. Scrape from "
                "this host, or add the scraper's network to EXECAPP['METRICS_ALLOWED_NETWORKS'] (env "
                "METRICS_ALLOWED_NETWORKS, comma-separated CIDRs) and set a METRICS_TOKEN. Behind a proxy, "
                "see docs/observability.md.\n")
    if token:
        given = _bearer(request)
        if given is None:
            log.warning(("metrics_token",), "/metrics refused to %r: no bearer token", address)
            return ("/metrics refused: a bearer token is required. Send 'Authorization: Bearer <token>' with the "
                    "value of EXECAPP['METRICS_TOKEN'] (env METRICS_TOKEN); in Prometheus, "
                    "'authorization: {credentials: <token>}'.\n")
        if not hmac.compare_digest(given.encode(), token.encode()):
            log.warning(("metrics_token",), "/metrics refused to %r: wrong bearer token", address)
            return ("/metrics refused: the bearer token is not the one in EXECAPP['METRICS_TOKEN'] "
                    "(env METRICS_TOKEN).\n")
    return None
