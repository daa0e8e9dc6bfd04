"""A Content-Security-Policy on every HTTP response: scripts only from this site's files.

Every string a client or plugin writes (event text, replies, errors, KV values) reaches the
admin's pages autoescaped, and the dashboard sets it through textContent; the policy is the
second wall should one ever slip through: no inline script, no ``javascript:`` URL, no event
handler attribute runs, nothing is framed, and no form posts or page fetches elsewhere.
"""
from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.utils.deprecation import MiddlewareMixin

#: Inline styles stay allowed: the admin's widgets and our timelines set style attributes, and a
#: style cannot run code. Scripts, connections, forms and frames: this site only.
POLICY = "; ".join([
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self' 'unsafe-inline'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "object-src 'none'",
    "base-uri 'self'",
    "form-action 'self'",
    "frame-ancestors 'none'",
])


class ContentSecurityPolicyMiddleware(MiddlewareMixin):
    """Adds ``Content-Security-Policy: POLICY`` to each response that does not carry one."""

    # MiddlewareMixin: sync and async, like Django's own, so the ASGI chain makes no thread hop for it.
    def process_response(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        response.headers.setdefault("Content-Security-Policy", POLICY)
        return response
