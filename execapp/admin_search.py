"""The admin's search box, bounded in words and characters.

Django's admin turns each word of a search into one ``ILIKE '%word%'`` per search field, all
ANDed, with no limit: the request line holds ~1,900 words (8 KiB), and one search of the
key-value entries (20,000 rows, PostgreSQL) by a staff member with only the view permission ran
11 s for 400 words and was cut at the request's database deadline (30 s, 503) for 1,900, each
of up to 4 at once holding a PostgreSQL backend busy (every tenant's token lookups share that
database); on SQLite 1,000 words failed with HTTP 500 ("Expression tree is too large"). A search
here keeps its first ``MAX_SEARCH_WORDS`` words, and at most ``MAX_SEARCH_CHARS`` characters, and
the page says what was left out.
"""
from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.text import smart_split

#: Words of one admin search (each one LIKE per search field).
MAX_SEARCH_WORDS = 10
#: Characters of one admin search (a LIKE's pattern is matched against every row's text).
MAX_SEARCH_CHARS = 200


def bounded_search_term(search_term: str) -> tuple[str, str | None]:
    """``search_term`` cut to its first MAX_SEARCH_WORDS words and MAX_SEARCH_CHARS characters,
    and what to tell the user about the cut (None: nothing was cut)."""
    words = list(smart_split(search_term))
    if len(words) <= MAX_SEARCH_WORDS and len(search_term) <= MAX_SEARCH_CHARS:
        return search_term, None
    kept = " ".join(words[:MAX_SEARCH_WORDS])[:MAX_SEARCH_CHARS]  # (a quote cut open is read as a plain word)
    return kept, (f"searched for the first {MAX_SEARCH_WORDS} words and {MAX_SEARCH_CHARS} characters only, of "
                  f"{len(words)} words: an admin search is one database match per word and field; search for fewer")


class BoundedSearchAdmin(admin.ModelAdmin):
    """A ModelAdmin whose search is bounded (see the module docstring): the base of every admin
    with ``search_fields`` (tests/execapp/test_admin_search.py walks the site to check)."""

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        search_term, note = bounded_search_term(search_term)
        if note is not None:
            messages.warning(request, note)
        return super().get_search_results(request, queryset, search_term)


def bounded(admin_class: Any) -> Any:
    """``admin_class`` (a ModelAdmin another app defines, e.g. Django's UserAdmin) with a bounded search."""
    return type(admin_class.__name__, (BoundedSearchAdmin, admin_class), {"__module__": __name__})
