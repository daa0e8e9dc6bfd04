"""API tokens: the create_token/revoke_token commands and the admin, as an operator uses them."""
from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from execapp.models import ApiToken, hash_token

pytestmark = pytest.mark.django_db


def _create(name: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("create_token", name, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_create_token_prints_the_token_last_and_stores_only_its_hash() -> None:
    out, err = _create("me")
    raw = out.strip().splitlines()[-1]
    token = ApiToken.objects.get(name="me")
    assert token.token_hash == hash_token(raw) and raw not in (token.token_hash, token.prefix)
    assert ApiToken.authenticate(raw) == token
    assert "only its hash is stored" in out and err == ""  # information, not an error (issue 12)


def test_create_token_refuses_a_taken_name_and_names_the_fix() -> None:
    _create("me")
    with pytest.raises(CommandError, match="already exists.*revoke_token me"):
        _create("me")


def test_revoke_token_refuses_it_from_then_on() -> None:
    raw = _create("gone")[0].strip().splitlines()[-1]
    call_command("revoke_token", "gone", stdout=StringIO())
    assert ApiToken.authenticate(raw) is None
    with pytest.raises(CommandError, match="no token called 'nope'; known tokens: gone"):
        call_command("revoke_token", "nope", stdout=StringIO())


def test_the_admin_creates_a_token_and_shows_it_once(admin_client: Any) -> None:
    """The raw token is in the add's own response only, uncached: not in a message, whose storage
    (a cookie, else the session row) carried it to the next page."""
    response = admin_client.post("/admin/execapp/apitoken/add/", {"name": "from-admin"})
    assert response.status_code == 200
    token = ApiToken.objects.get(name="from-admin")
    raw = response.context["raw"]
    assert ApiToken.authenticate(raw) == token
    assert '<code id="raw-token"' in response.content.decode() and raw in response.content.decode()
    assert "no-store" in response["Cache-Control"]
    assert all(raw not in morsel.value for morsel in response.cookies.values())
    assert raw not in str(admin_client.session.items())
    later = admin_client.get("/admin/execapp/apitoken/")
    assert raw not in later.content.decode() and not [str(m) for m in later.context["messages"] if raw in str(m)]


def test_the_admin_revokes_selected_tokens(admin_client: Any) -> None:
    raw = _create("bulk")[0].strip().splitlines()[-1]
    token = ApiToken.objects.get(name="bulk")
    admin_client.post("/admin/execapp/apitoken/", {"action": "revoke_tokens", "_selected_action": [token.pk]})
    assert ApiToken.authenticate(raw) is None
    listing = admin_client.get("/admin/execapp/apitoken/")
    assert listing.status_code == 200 and b"bulk" in listing.content


def test_a_token_s_last_use_is_written_at_most_once_a_minute() -> None:
    # A client reconnecting as fast as it can made one UPDATE per handshake.
    import datetime as dt

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    _, raw = ApiToken.issue("busy")
    with CaptureQueriesContext(connection) as queries:
        for _ in range(20):
            assert ApiToken.authenticate(raw) is not None
    assert sum(q["sql"].lstrip().upper().startswith("UPDATE") for q in queries.captured_queries) == 1
    first = ApiToken.objects.get(name="busy").last_used_at
    ApiToken.objects.filter(name="busy").update(last_used_at=first - dt.timedelta(minutes=2))
    ApiToken.authenticate(raw)
    assert ApiToken.objects.get(name="busy").last_used_at >= first  # a minute on: written again


def test_a_new_token_named_after_a_tenant_does_not_silently_join_it(admin_client: Any) -> None:
    """A blank tenant is the token's name: a token named like another tenant would have shared its
    sessions without anyone choosing that (docs: 'a new token is its own tenant')."""
    ApiToken.issue("alice", tenant="acme")
    with pytest.raises(CommandError, match="token 'acme' would join tenant 'acme', the tenant of 'alice'.*"
                                           "--tenant acme"):
        _create("acme")
    response = admin_client.post("/admin/execapp/apitoken/add/", {"name": "acme", "tenant": ""})
    assert response.status_code == 200 and "would join tenant" in str(response.context["adminform"].form.errors)
    assert not ApiToken.objects.filter(name="acme").exists()
    # Meant: said explicitly, in the command or the admin.
    out = StringIO()
    call_command("create_token", "acme", "--tenant", "acme", stdout=out)
    admin_client.post("/admin/execapp/apitoken/add/", {"name": "acme-2", "tenant": "acme"})
    assert dict(ApiToken.objects.values_list("name", "tenant")) == {"alice": "acme", "acme": "acme", "acme-2": "acme"}
    # A token that is its own tenant already is not refused for its own name (an edit of it).
    solo = ApiToken.issue("solo")[0]
    response = admin_client.post(f"/admin/execapp/apitoken/{solo.pk}/change/", {"tenant": ""})
    assert response.status_code == 302 and ApiToken.objects.get(pk=solo.pk).tenant == "solo"


def test_the_tokens_page_lists_a_bounded_number_of_tenants_to_filter_by(admin_client: Any) -> None:
    """Django's value filter listed every tenant in the sidebar: 5,000 tenants made the page
    366 KB of links (and ?_facets=1 one COUNT per tenant). Now the first 50, then a hint; a tenant
    filtered on is listed (selected) wherever it sorts."""
    from execapp.admin_filters import MAX_CHOICES

    ApiToken.objects.bulk_create([ApiToken(name=f"t{i:04d}", tenant=f"tenant-{i:04d}", token_hash=hash_token(f"x{i}"),
                                           prefix=f"p{i}") for i in range(300)])
    page = admin_client.get("/admin/execapp/apitoken/")
    text = page.content.decode()
    assert page.status_code == 200
    assert text.count("?tenant=tenant-") == MAX_CHOICES, "one link per tenant listed"
    assert f"only the first {MAX_CHOICES} listed: search for the others" in text
    picked = admin_client.get("/admin/execapp/apitoken/?tenant=tenant-0299")
    assert picked.status_code == 200 and [t.name for t in picked.context["cl"].result_list] == ["t0299"]
    chosen = picked.context["cl"].filter_specs[1]
    assert [c["display"] for c in chosen.choices(picked.context["cl"]) if c["selected"]] == ["tenant-0299"]
    facets = admin_client.get("/admin/execapp/apitoken/?_facets=1")
    assert facets.status_code == 200 and facets.content.decode().count("?_facets=1&amp;tenant=tenant-") <= MAX_CHOICES
