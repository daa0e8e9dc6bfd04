"""A client that may change nothing cannot make Django parse a large form (execapp/read_only_body.py)."""
from __future__ import annotations

import time
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.test import Client

pytestmark = pytest.mark.django_db

#: 5 MB of percent-escapes: one Python loop step each in Django's form parser.
ESCAPES = b"f=" + b"%41" * 1_700_000
CSRF_COOKIE = "A" * 32  # any value of the right form: the CSRF check parses the form before it compares


def post(client: Client, path: str, body: bytes) -> tuple[Any, float]:
    client.cookies["csrftoken"] = CSRF_COOKIE
    started = time.thread_time()
    response = client.post(path, data=body, content_type="application/x-www-form-urlencoded")
    return response, time.thread_time() - started


@pytest.mark.parametrize("path", ["/admin/login/", "/healthz", "/admin/plugins/plugin/add/"])
def test_a_large_form_from_a_client_not_signed_in_is_refused_unparsed(path: str) -> None:
    response, cpu = post(Client(enforce_csrf_checks=True), path, ESCAPES)
    # Unrefused, the CSRF check parsed the form first: ~0.7-1.1 s of CPU and ~200 MB, then 403.
    assert response.status_code == 413, response.status_code
    assert "READ_ONLY_BODY_BYTES" in response.content.decode()
    assert cpu < 0.25, cpu


def test_non_staff_and_view_only_staff_are_refused_and_who_may_change_keeps_django_s_limits() -> None:
    for user in (User.objects.create_user("someone"),  # signed in, not staff
                 User.objects.create_user("viewer", is_staff=True)):  # staff with view permissions only
        user.user_permissions.add(*Permission.objects.filter(codename__startswith="view_"))
        client = Client(enforce_csrf_checks=True)
        client.force_login(user)
        response, cpu = post(client, "/admin/plugins/plugin/", ESCAPES)
        assert response.status_code == 413 and cpu < 0.25, (user.username, response.status_code, cpu)
    editor = User.objects.create_user("editor", is_staff=True)
    editor.user_permissions.add(Permission.objects.get(codename="change_plugin"))
    for user in (editor, User.objects.create_superuser("root")):
        client = Client(enforce_csrf_checks=True)
        client.force_login(user)
        response, _ = post(client, "/admin/login/", b"f=" + b"x" * 200_000)
        assert response.status_code != 413, user.username  # (a plugin upload is up to DATA_UPLOAD_MAX_MEMORY_SIZE)


def test_the_login_form_fits_and_the_limit_runs_before_the_csrf_check() -> None:
    login_form = b"username=a&password=b&csrfmiddlewaretoken=" + b"x" * 64
    response, _ = post(Client(enforce_csrf_checks=True), "/admin/login/", login_form)
    assert response.status_code == 403  # the CSRF check judged it (the token is wrong): not refused for size
    order = list(settings.MIDDLEWARE)
    mine = order.index("execapp.read_only_body.ReadOnlyBodyLimit")
    assert order.index("django.contrib.auth.middleware.AuthenticationMiddleware") < mine
