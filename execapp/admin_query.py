"""An admin list's query string, bounded: its search box in words and characters, its filters to
what the sidebar offers.

- **Search.** Django's admin turns each word of a search into one ``ILIKE '%word%'`` per search
  field, all ANDed, with no limit: the request line holds ~1,900 words (8 KiB), and one search
  of the key-value entries (20,000 rows, PostgreSQL) by a staff member with only the view
  permission ran 11 s for 400 words and was cut at the request's database deadline (30 s, 503)
  for 1,900, each of up to 4 at once holding a PostgreSQL backend busy (every tenant's token
  lookups share that database); on SQLite 1,000 words failed with HTTP 500 ("Expression tree is
  too large"). A search keeps its first ``MAX_SEARCH_WORDS`` words and ``MAX_SEARCH_CHARS``
  characters, and the page says what was left out.
- **Filters.** Django lets any query parameter filter a list by any lookup on any of the model's
  own fields (``ModelAdmin.lookup_allowed``), whatever the list shows: ``?source__regex=(.|.)*Z``
  on the plugins list ran Python's ``re`` inside SQLite's REGEXP on a request thread with the
  GIL held, backtracking for ever, and the watchdog killed the worker after 5 s (every
  WebSocket dropped), from a view-only staff member; and ``?last_error__startswith=...`` read a
  profile's last error (a tenant's text) letter by letter without the Events permission that
  shows it. A list here filters only on the fields its sidebar filters (``list_filter``,
  ``date_hierarchy``), never by ``regex``/``iregex``; anything else is 400
  (``DisallowedModelAdminLookup``).
"""
from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.filters import SimpleListFilter
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


#: Lookups no list filters by: a pattern the database (or Python's re, in SQLite) backtracks on.
UNSAFE_LOOKUPS = frozenset(("regex", "iregex"))


class BoundedQueryAdmin(admin.ModelAdmin):
    """A ModelAdmin whose list's search and filters are bounded (see the module docstring): the
    base of every registered admin (tests/execapp/test_admin_query.py walks the site to check)."""

    def lookup_allowed(self, lookup: str, value: Any, request: HttpRequest | None = None) -> bool:
        """Django's rule, and: the lookup's field is one the sidebar filters on, and not by a pattern."""
        parts = lookup.split("__")
        if parts[-1] in UNSAFE_LOOKUPS or parts[0] not in self._filtered_fields(request):
            return False
        return bool(super().lookup_allowed(lookup, value, request))

    def _filtered_fields(self, request: HttpRequest | None) -> set[str]:
        """The first part of each lookup the sidebar's filters (and the date hierarchy) make."""
        fields = {self.date_hierarchy.split("__")[0]} if self.date_hierarchy else set()
        for item in self.get_list_filter(request) if request is not None else self.list_filter:
            if isinstance(item, type) and issubclass(item, SimpleListFilter):
                simple: Any = item
                fields.add(str(simple.parameter_name))
            else:
                fields.add(str(item[0] if isinstance(item, (list, tuple)) else item).split("__")[0])
        return fields

    def get_search_results(self, request: HttpRequest, queryset: QuerySet, search_term: str) -> tuple[QuerySet, bool]:
        search_term, note = bounded_search_term(search_term)
        if note is not None:
            messages.warning(request, note)
        return super().get_search_results(request, queryset, search_term)


def bounded(admin_class: Any) -> Any:
    """``admin_class`` (a ModelAdmin another app defines, e.g. Django's UserAdmin) with a bounded search."""
    return type(admin_class.__name__, (BoundedQueryAdmin, admin_class), {"__module__": __name__})
