"""The Content-Security-Policy: on every page, scripts only from this site's files, and every
template of the project keeps to it (no inline script, no event handler attribute)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User

from execapp.security_headers import POLICY

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"


def _directives(header: str) -> dict[str, list[str]]:
    return {parts[0]: parts[1:] for parts in (d.split() for d in header.split(";")) if parts}


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["/admin/login/", "/admin/execapp/dashboard/", "/admin/execapp/eventtrace/",
                                 "/admin/plugins/plugin/", "/admin/", "/no-such-page"])
def test_every_page_carries_the_policy(client: Any, url: str) -> None:
    client.force_login(User.objects.create_superuser("root", "root@example.com", None))
    response = client.get(url)
    header = response.headers.get("Content-Security-Policy")
    assert header == POLICY, (url, response.status_code, header)
    policy = _directives(header)
    assert policy["script-src"] == ["'self'"]  # no 'unsafe-inline', no 'unsafe-eval', no other host
    assert policy["frame-ancestors"] == ["'none'"] and policy["object-src"] == ["'none'"]
    assert policy["form-action"] == ["'self'"] and policy["base-uri"] == ["'self'"]


def test_no_template_needs_an_inline_script() -> None:
    """Under script-src 'self' an inline script or an on...= attribute would not run: the page
    would break silently. Scripts are files (execapp/static/execapp/)."""
    found = []
    for path in TEMPLATES.rglob("*.html"):
        text = path.read_text()
        found += [f"{path.name}: {m.group(0)}" for m in re.finditer(r"<script(?![^>]*\bsrc=)[^>]*>", text)]
        found += [f"{path.name}: {m.group(0)}" for m in re.finditer(r"\son[a-z]+\s*=", text)]
        found += [f"{path.name}: javascript:" for _ in re.finditer(r"javascript:", text)]
    assert not found
    assert (TEMPLATES / "execapp" / "dashboard.html").read_text().count("{% static 'execapp/dashboard.js' %}") == 1
