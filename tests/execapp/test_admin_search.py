"""The admin's search box is bounded: a staff member with a view permission cannot make one search
thousands of database matches (execapp/admin_search.py)."""
from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from execapp.admin_search import MAX_SEARCH_CHARS, MAX_SEARCH_WORDS, BoundedSearchAdmin, bounded_search_term
from plugins.models import KVEntry

pytestmark = pytest.mark.django_db

#: As many words as the request line (8 KiB) holds.
WORDS = " ".join(["e"] * 1900)


def viewer(*codenames: str) -> Client:
    user = User.objects.create_user("viewer", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def test_every_admin_with_a_search_box_bounds_it() -> None:
    searchable = {model._meta.label: model_admin for model, model_admin in admin.site._registry.items()
                  if model_admin.search_fields}
    assert {"execapp.ApiToken", "plugins.KVEntry", "auth.User", "auth.Group"} <= set(searchable)
    unbounded = [label for label, model_admin in searchable.items() if not isinstance(model_admin, BoundedSearchAdmin)]
    assert not unbounded, f"admins whose search is not bounded (base them on BoundedSearchAdmin): {unbounded}"


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
