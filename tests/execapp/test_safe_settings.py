"""Error reports never show a password of a URL setting, and DEBUG on a public host is flagged."""
from __future__ import annotations

import sys
from typing import Any

from django.test import RequestFactory
from django.views.debug import technical_500_response

from execapp.checks import check_debug
from execapp.safe_settings import without_passwords

#: Made at run time: the error page shows the source lines around the raise, this module's included.
PASSWORD = "".join(reversed("wp2retnuh"))
URL = f"redis://:{PASSWORD}@10.0.0.7:6379/0"


def test_the_debug_error_page_hides_passwords_in_urls(settings: Any) -> None:
    # Django hides settings named like KEY or PASS only: REDIS_URL and the channel layer's hosts
    # (the Redis password) were on every DEBUG=1 error page.
    settings.REDIS_URL = URL
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "x", "CONFIG": {"hosts": [{"address": URL}]}}}
    settings.DEBUG = True
    request = RequestFactory().get("/admin/")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        page = technical_500_response(request, *sys.exc_info()).content.decode()
    assert PASSWORD not in page
    assert "redis://:********@10.0.0.7:6379/0" in page


def test_without_passwords_keeps_what_is_not_a_password() -> None:
    assert without_passwords("postgres://ops:s3cret@db:5432/x and https://host/a:b@c") == \
        "postgres://ops:********@db:5432/x and https://host/a:b@c"
    assert without_passwords("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_debug_on_a_public_host_is_a_warning(settings: Any) -> None:
    settings.DEBUG = True
    settings.ALLOWED_HOSTS = ["127.0.0.1", "exec.example.com"]
    [warning] = check_debug()
    assert warning.id == "execapp.W131" and "'exec.example.com'" in warning.msg
    settings.ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
    assert check_debug() == []
    settings.DEBUG = False
    settings.ALLOWED_HOSTS = ["exec.example.com"]
    assert check_debug() == []
