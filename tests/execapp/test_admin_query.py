"""The admin's search box is bounded: a staff member with a view permission cannot make one search
thousands of database matches (execapp/admin_query.py)."""
from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from execapp.admin_query import MAX_SEARCH_CHARS, MAX_SEARCH_WORDS, BoundedQueryAdmin, bounded_search_term
from execapp.models import ExecProfileRecord
from plugins.models import KVEntry, Plugin

pytestmark = pytest.mark.django_db

#: As many words as the request line (8 KiB) holds.
WORDS = " ".join(["e"] * 1900)


def viewer(*codenames: str) -> Client:
    user = User.objects.create_user("viewer", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def test_every_admin_list_bounds_its_query() -> None:
    # (The dashboard and the Events page serve their own lists: no Django ChangeList reads their query.)
    lists = {model._meta.label: model_admin for model, model_admin in admin.site._registry.items()
             if type(model_admin).changelist_view is admin.ModelAdmin.changelist_view}
    assert {"execapp.ApiToken", "execapp.ExecProfileRecord", "plugins.Plugin", "plugins.KVEntry", "auth.User",
            "auth.Group"} <= set(lists)
    unbounded = [label for label, model_admin in lists.items() if not isinstance(model_admin, BoundedQueryAdmin)]
    assert not unbounded, f"admin lists whose query is not bounded (base them on BoundedQueryAdmin): {unbounded}"


@pytest.mark.parametrize("url", ["/admin/plugins/kventry/", "/admin/auth/user/"])
def test_a_search_of_thousands_of_words_searches_the_first_few_and_says_so(url: str) -> None:
    KVEntry.objects.create(plugin="p", key="key-1", value="v")
    client = viewer("view_kventry", "view_user")
    with CaptureQueriesContext(connection) as queries:
        # Unbounded: 1,900 LIKEs per field ANDed; SQLite refused it ("Expression tree is too large", HTTP
        # 500); PostgreSQL ran 11 s for 400 words on 20,000 rows and hit the 30 s deadline for 1,900.
        response = client.get(url, {"q": WORDS})
    assert response.status_code == 200
    likes = max(str(q["sql"]).upper().count(" LIKE ") for q in queries.captured_queries)
    assert 0 < likes <= MAX_SEARCH_WORDS * 4, likes
    assert f"first {MAX_SEARCH_WORDS} words" in response.content.decode()


def test_the_cut_keeps_ordinary_searches_whole() -> None:
    assert bounded_search_term('tenant-a "two words"') == ('tenant-a "two words"', None)
    kept, note = bounded_search_term(" ".join(f"w{i}" for i in range(50)))
    assert kept == " ".join(f"w{i}" for i in range(MAX_SEARCH_WORDS)) and note and "50 words" in note
    kept, note = bounded_search_term("x" * 5000)
    assert kept == "x" * MAX_SEARCH_CHARS and note


@pytest.mark.parametrize(("url", "query"), [
    # a pattern: Python's re inside SQLite's REGEXP, on a request thread holding the GIL ((.|.)*Z froze the
    # worker's event loop until the watchdog killed it, 5 s); a harmless one shows the lookup ran
    ("/admin/plugins/plugin/", {"source__regex": "^function"}),
    ("/admin/plugins/plugin/", {"name__iregex": "."}),
    ("/admin/plugins/kventry/", {"plugin__regex": "."}),  # a filtered field, but not by a pattern
    # a field the list does not filter on (a token's hash, a plugin's source)
    ("/admin/execapp/apitoken/", {"token_hash__startswith": "a"}),
    ("/admin/plugins/plugin/", {"source__contains": "function"}),
])
def test_a_list_filters_only_as_its_sidebar_does(url: str, query: dict[str, str]) -> None:
    Plugin.objects.create(name="p", runtime="lua", source="function ping(ev) return 'pong' end")
    KVEntry.objects.create(plugin="p", key="k", value="v")
    client = viewer("view_plugin", "view_kventry", "view_apitoken")
    assert client.get(url, query).status_code == 400  # DisallowedModelAdminLookup (Django let each one filter: 200)


def test_the_sidebar_s_own_filters_still_filter() -> None:
    Plugin.objects.create(name="p", runtime="lua", source="function ping(ev) return 'pong' end")
    KVEntry.objects.create(plugin="p", key="k1", value="v")
    KVEntry.objects.create(plugin="q", key="k2", value="v")
    client = viewer("view_plugin", "view_kventry", "view_apitoken", "view_user")
    page = client.get("/admin/plugins/kventry/", {"plugin__exact": "q"})
    assert page.status_code == 200 and "k2" in page.content.decode() and "k1" not in page.content.decode()
    for url, query in [
            ("/admin/plugins/plugin/", {"enabled__exact": "1", "runtime": "lua", "strategy__exact": "pooled"}),
            ("/admin/execapp/apitoken/", {"revoked_at__isempty": "1", "tenant__exact": "t"}),
            ("/admin/auth/user/", {"is_staff__exact": "1", "groups__id__exact": "1"})]:
        assert client.get(url, query).status_code == 200, (url, query)


def test_a_profile_s_last_error_is_not_read_through_a_filter_without_the_events_permission() -> None:
    ExecProfileRecord.objects.create(matcher="m", plugin="p", last_error="card 4111 of tenant acme")
    client = viewer("view_execprofilerecord")
    # Each answer said whether the hidden text starts so: read letter by letter (Django let it filter, 200).
    assert client.get("/admin/execapp/execprofilerecord/", {"last_error__startswith": "card 4"}).status_code == 400
