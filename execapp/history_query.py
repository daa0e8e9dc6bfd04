"""Reading the event history: one trace by (owner, id) or by uid, a filtered search, pruning.

The recent store (execapp.history_store) first, then the database's failures (``EventTrace``,
kept HISTORY_FAILURE_DAYS). Readers are the admin's Events page (execapp.history_admin) and
whoever answers a resend from the record (``get``).
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import re
import time
from typing import Any, Callable, TypeVar

from django.db import OperationalError
from django.utils import timezone

from . import conf
from .dbtext import clean_text
from .engine.ratelog import RateLimitedLog
from .history_record import pair_key
from .history_store import Filters, Summary, store

log = logging.getLogger("execapp.history")
_rare = RateLimitedLog(log, 60.0)



#: Waits before a database read is tried again when SQLite says a table is locked (its shared cache
#: answers that at once, without the busy timeout, while the housekeeper writes failure traces).
DB_LOCKED_RETRY_SECONDS = (0.05, 0.2, 0.5)
_T = TypeVar("_T")


def when_unlocked(query: Callable[[], _T]) -> _T:
    """``query()``, run again after DB_LOCKED_RETRY_SECONDS while a table is locked (off the loop only)."""
    for retry in (*DB_LOCKED_RETRY_SECONDS, None):
        try:
            return query()
        except OperationalError as exc:
            if retry is None or "locked" not in str(exc):
                raise
            time.sleep(retry)
    raise AssertionError("unreachable")


def get(owner: str, event_id: str) -> dict[str, Any] | None:
    """The newest trace of ``event_id`` sent by ``owner`` (recent store first, then the database's
    failures), or None. Its ``outcome``, ``handlers[*].replies`` (``[text, data]`` pairs, within
    HISTORY_REPLY_BYTES; ``replies_truncated`` says when some were left out), ``matched``,
    ``replies``, ``errors`` and ``blocked_by`` are what the client was told."""
    try:
        body = store().get(owner, event_id)
    except Exception as exc:
        _rare.warning(("get", type(exc).__name__), "event history store unavailable: %r", exc)
        body = None
    if body is not None:
        return json.loads(body)
    from .models import EventTrace

    # Stored cleaned (execapp.dbtext), so looked up cleaned: a NUL would fail the query on PostgreSQL.
    row = when_unlocked(EventTrace.objects.filter(owner=clean_text(owner), event_id=clean_text(event_id)).order_by(
        "-created_at").first)
    return None if row is None else dict(row.trace)


def detail(uid: str) -> dict[str, Any] | None:
    """The trace with this uid (recent store first, then the database), or None."""
    try:
        body = store().body(uid)
    except Exception as exc:
        _rare.warning(("detail", type(exc).__name__), "event history store unavailable: %r", exc)
        body = None
    if body is not None:
        return json.loads(body)
    from .models import EventTrace

    row = EventTrace.objects.filter(uid=clean_text(uid)).first()
    return None if row is None else dict(row.trace)


def search(filters: Filters, limit: int = 50, scan_limit: int | None = None) -> list[Summary]:
    """The newest ``limit`` traces matching ``filters``, newest first: the recent store's and the
    database's failures merged (one row per trace). ``scan_limit`` bounds how many recent summaries
    are read (default: the whole store)."""
    found: dict[str, Summary] = {}
    try:
        for n, item in enumerate(store().scan()):
            if scan_limit is not None and n >= scan_limit:
                break
            if filters.match(item):
                found[item.uid] = Summary.of(item)
                if len(found) >= limit:
                    break
    except Exception as exc:
        _rare.warning(("search", type(exc).__name__), "event history store unavailable: %r", exc)
    if filters.outcome != "ok":
        for summary in _db_search(filters, limit):
            found.setdefault(summary.uid, summary)
    return sorted(found.values(), key=lambda s: (s.ts, s.uid), reverse=True)[:limit]


def _db_search(filters: Filters, limit: int) -> list[Summary]:
    from django.db.models import Q

    from .models import EventTrace

    qs = EventTrace.objects.all()
    for field, value in (("event_id", filters.id), ("owner", filters.owner), ("session", filters.session)):
        if value:
            qs = qs.filter(**{field: clean_text(value)})
    if filters.plugin:
        qs = qs.filter(plugins__contains=clean_text("," + filters.plugin.replace(",", " ") + ","))
    if filters.matcher:
        qs = qs.filter(matchers__contains=clean_text("," + filters.matcher.replace(",", " ") + ","))
    if filters.outcome and filters.outcome != "failed":
        outcome = clean_text(filters.outcome)
        qs = qs.filter(Q(outcome=outcome) | Q(codes__regex=rf"(^|,){_re_escape(outcome)}(,|$)"))
    for op, when in (("gte", filters.since), ("lt", filters.until)):
        if when is not None:
            qs = qs.filter(**{f"created_at__{op}": dt.datetime.fromtimestamp(when, dt.timezone.utc)})
    if filters.before is not None:  # the paging cursor: after the last row shown in (ts, uid) order
        before = dt.datetime.fromtimestamp(filters.before, dt.timezone.utc)
        older = Q(created_at__lt=before)
        if filters.before_uid:
            older |= Q(created_at=before, uid__lt=clean_text(filters.before_uid))
        qs = qs.filter(older)
    out = []
    for row in qs.order_by("-created_at", "-uid")[:limit]:
        out.append(Summary(
            uid=row.uid, key=pair_key(row.owner, row.event_id), ts=row.created_at.timestamp(), id=row.event_id,
            owner=row.owner, session=row.session, type=row.event_type, outcome=row.outcome,
            codes=tuple(c for c in row.codes.split(",") if c), matchers=tuple(m for m in row.matchers.split(",") if m),
            plugins=tuple(p for p in row.plugins.split(",") if p), worker=row.worker, duration=row.duration_seconds))
    return out


def _re_escape(value: str) -> str:
    return re.escape(value)


def prune(days: float | None = None) -> int:
    """Delete database traces older than ``days`` (default HISTORY_FAILURE_DAYS); how many."""
    from .models import EventTrace

    days = float(conf.get("HISTORY_FAILURE_DAYS")) if days is None else days
    deleted, _ = EventTrace.objects.filter(created_at__lt=cutoff(days)).delete()
    return deleted


def cutoff(days: float) -> dt.datetime:
    """The time ``days`` ago: older traces are pruned. A retention longer than the calendar
    (``--days 1e6`` or ``inf``, "keep everything") is its first day, not an OverflowError."""
    now = timezone.now()
    oldest = dt.datetime.min.replace(tzinfo=dt.timezone.utc)
    if not days < (now - oldest).days:  # (also inf; a NaN is refused by the callers)
        return oldest
    return now - dt.timedelta(days=days)


def prune_owners(keep: int | None = None) -> int:
    """Delete each owner's database traces past its newest ``keep`` (default HISTORY_FAILURES_PER_OWNER);
    how many. One grouped count over the owner index, then a delete per owner over the cap."""
    from django.db.models import Count

    from .models import EventTrace

    keep = int(conf.get("HISTORY_FAILURES_PER_OWNER")) if keep is None else keep
    deleted = 0
    over = EventTrace.objects.order_by().values("owner").annotate(n=Count("id")).filter(n__gt=keep)
    for row in over:
        rows = EventTrace.objects.filter(owner=row["owner"])
        # Ids grow with insertion: the (keep+1)-th newest id and every older one go.
        oldest_kept = rows.order_by("-id").values_list("id", flat=True)[keep - 1]
        removed, _ = rows.filter(id__lt=oldest_kept).delete()
        deleted += removed
    return deleted
