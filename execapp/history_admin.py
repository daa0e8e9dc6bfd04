"""The admin's *Events* page: recent traces and stored failures, filtered and searched; one trace as a timeline.

It is the admin entry of ``EventTrace`` (the database's failures), so it lives at
``/admin/execapp/eventtrace/`` and needs the ``execapp.view_eventtrace`` permission (superusers
have it); its list and detail read ``execapp.history`` (the recent store and the database).
Untrusted strings (event text, replies, messages) are only ever rendered autoescaped.
"""
from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.http import Http404, HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse

from . import codes, conf, history
from .history_store import Filters
from .redis_deadline import RedisDeadline, redis_deadline
from .running_cap import RunningCap
from .user_rate import UserRate

#: Rows per page of the Events list.
PAGE_SIZE = 50
MAX_UID_CHARS = 64  # EventTrace.uid's max_length: a longer paging cursor is cut, not looked up
#: The outcome filter's choices: every outcome an event or a handler can have.
OUTCOMES = ("ok", "failed", "error", history.INCOMPLETE, *sorted(codes.ERROR_CODES))
_FILTER_FIELDS = ("id", "plugin", "matcher", "outcome", "session", "owner", "since", "until")


def events_url(**params: str) -> str:
    """The Events page filtered by ``params`` (e.g. matcher=..., outcome="failed")."""
    url = reverse("admin:execapp_eventtrace_changelist")
    query = urlencode({k: v for k, v in params.items() if v})
    return f"{url}?{query}" if query else url


#: The last second a datetime can hold (9999-12-31T23:59:59 UTC): a later filter time is refused.
LATEST_TIME = 253402300799.0


def parse_time(value: str) -> float | None:
    """A filter's time: epoch seconds, or an ISO date/time (UTC unless it names its offset)."""
    value = (value or "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = dt.datetime.fromisoformat(value)
        except ValueError:
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.timezone.utc)
        seconds = when.timestamp()
    # "nan", "inf" or 1e20 read as floats, and no datetime holds them (a query would fail with 500).
    return seconds if 0.0 <= seconds <= LATEST_TIME else None


def filters_from(request: HttpRequest) -> tuple[Filters, dict[str, str], list[str]]:
    """The Filters a request asks for, the raw values (for the form) and what could not be read."""
    raw = {k: request.GET.get(k, "").strip() for k in _FILTER_FIELDS}
    raw["q"] = request.GET.get("q", "").strip()
    problems = []
    times = {}
    for key in ("since", "until"):
        times[key] = parse_time(raw[key])
        if raw[key] and times[key] is None:
            problems.append(f"{key} {raw[key]!r} is not a time: use 2025-01-31T14:02 (UTC) or epoch seconds")
    before = parse_time(request.GET.get("before", ""))
    event_id = raw["id"] or raw["q"]
    return (Filters(plugin=raw["plugin"], matcher=raw["matcher"], outcome=raw["outcome"], session=raw["session"],
                    owner=raw["owner"], id=event_id, since=times["since"], until=times["until"], before=before,
                    before_uid=request.GET.get("before_uid", "")[:MAX_UID_CHARS] if before is not None else ""),
            raw, problems)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f}"


#: Searches of the events running in this process: each reads up to the whole recent store
#: (~0.5 s of CPU for 100,000 traces) on a request thread, holding the GIL the event loop needs.
_searches = RunningCap()
#: Searches each user started lately (HISTORY_SEARCHES_PER_MINUTE, a burst of SEARCH_BURST).
_search_rate = UserRate()
SEARCH_BURST = 20.0


class EventTraceAdmin(admin.ModelAdmin):
    """Events: the newest traces first, with filters and search by id; a detail page per trace."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # `manage.py prune_history` deletes; the record of what happened is read-only

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """The Events list (GET filters: id or q, plugin, matcher, outcome, session, owner, since, until)."""
        if not self.has_view_permission(request):
            return HttpResponse("you need the 'Can view event' permission", status=403)
        per_minute = float(conf.get("HISTORY_SEARCHES_PER_MINUTE"))
        wait = _search_rate.take(f"user:{request.user.pk}", per_minute / 60.0, SEARCH_BURST)
        if wait > 0:  # a tab stuck reloading the page: refused before any search
            retry = max(1, math.ceil(wait))
            return HttpResponse(f"too many searches of the events from this user (more than {per_minute:g} a minute: "
                                f"EXECAPP['HISTORY_SEARCHES_PER_MINUTE']); try again in {retry} s", status=429,
                                content_type="text/plain; charset=utf-8", headers={"Retry-After": str(retry)})
        if not _searches.acquire(int(conf.get("HISTORY_MAX_SEARCHES"))):
            return HttpResponse(f"this worker runs {conf.get('HISTORY_MAX_SEARCHES')} searches of the events already "
                                "(EXECAPP['HISTORY_MAX_SEARCHES']); try again in a moment", status=503,
                                content_type="text/plain; charset=utf-8", headers={"Retry-After": "1"})
        try:
            with redis_deadline():  # all its Redis calls together (the usage, the search's scan)
                return self._changelist(request, extra_context)
        finally:
            _searches.release()

    def _changelist(self, request: HttpRequest, extra_context: dict[str, Any] | None) -> HttpResponse:
        filters, raw, problems = filters_from(request)
        store = history.store()
        usage = None
        try:  # Redis down (a restart): the page still answers with the database's failures, and says so
            usage = store.usage()
        except Exception as exc:
            problems.append(f"{RedisDeadline.code}: the recent store ({store.name}) cannot be read now "
                            f"({type(exc).__name__}): only the failures the database keeps are shown; events that "
                            "ended ok are back once it answers")
        rows = history.search(filters, limit=PAGE_SIZE + 1)
        more = len(rows) > PAGE_SIZE
        rows = rows[:PAGE_SIZE]
        shown = []
        for s in rows:
            shown.append({**s.as_dict(), "when": _when(s.ts), "duration_ms": _ms(s.duration),
                          "url": reverse("admin:execapp_eventtrace_change", args=[s.uid]),
                          "matchers_text": ", ".join(s.matchers), "plugins_text": ", ".join(s.plugins),
                          "codes_text": ", ".join(s.codes)})
        older = None
        if more and rows:
            older = "?" + urlencode({**{k: v for k, v in raw.items() if v}, "before": repr(rows[-1].ts),
                                     "before_uid": rows[-1].uid})
        recorder = history.current()
        context = {
            **self.admin_site.each_context(request),
            "title": "Events",
            "opts": self.model._meta,
            "rows": shown,
            "filters": raw,
            "outcomes": OUTCOMES,
            "problems": problems,
            "older_url": older,
            "newest_url": "?" + urlencode({k: v for k, v in raw.items() if v}) if request.GET.get("before") else None,
            "store": store.name,
            "usage": usage.as_dict() if usage is not None else None,
            "usage_mib": f"{usage.bytes / 1048576:.1f} of {usage.max_bytes / 1048576:.0f} MiB" if usage else "",
            "evicted_bytes_when": _when(usage.by_bytes_ts) if usage and usage.by_bytes_ts else "",
            "recorder": recorder.stats() if recorder is not None else None,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "execapp/events.html", context)

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """One trace (``object_id`` is its uid) as a timeline of its handlers."""
        if not self.has_view_permission(request):
            return HttpResponse("you need the 'Can view event' permission", status=403)
        with redis_deadline():  # the recent store first: a Redis that does not answer costs this, then the database
            trace = history.detail(object_id)
        if trace is None:
            raise Http404(f"no trace {object_id!r}: it is older than the recent store keeps "
                          "(EXECAPP['HISTORY_MAX_EVENTS'] traces, EXECAPP['HISTORY_REDIS_MAX_BYTES'] or "
                          "HISTORY_LOCAL_MAX_BYTES bytes: evicted) and did not fail, or its failure was pruned")
        context = {
            **self.admin_site.each_context(request),
            "title": f"Event {trace.get('id')}",
            "opts": self.model._meta,
            "trace": trace,
            "when": _when(trace.get("ts")),
            "duration_ms": _ms(trace.get("duration")),
            "timeline": timeline(trace),
            "raw": json.dumps(trace, indent=2, ensure_ascii=False, default=str),
            "list_url": reverse("admin:execapp_eventtrace_changelist"),
            "same_session_url": events_url(session=trace.get("session") or "", owner=trace.get("owner") or "")
            if trace.get("session") else None,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "execapp/event_detail.html", context)


def timeline(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Each handler as bars on the event's time axis: queue wait then run, as % of the whole."""
    handlers = trace.get("handlers") or []
    ends = [(h.get("start") or 0.0) + (h.get("duration") or 0.0) for h in handlers]
    total = max([trace.get("duration") or 0.0, *ends, 1e-9])
    out = []
    for h in handlers:
        start = h.get("start")
        wait = h.get("wait") or 0.0
        run_start = start if start is not None else 0.0
        out.append({
            **h,
            "wait_left": round(100 * max(0.0, run_start - wait) / total, 2),
            "wait_width": round(100 * wait / total, 2),
            "run_left": round(100 * run_start / total, 2),
            "run_width": max(0.4, round(100 * (h.get("duration") or 0.0) / total, 2)),
            "start_ms": _ms(start), "wait_ms": _ms(h.get("wait")), "duration_ms": _ms(h.get("duration")),
            "failed": h.get("code") not in (None, "ok"),
            "replies_shown": [{"text": r[0], "data": None if r[1] is None else json.dumps(r[1], default=str)}
                              for r in h.get("replies") or []],
            "events_url": events_url(matcher=h.get("matcher") or "", outcome="failed"),
        })
    return out
