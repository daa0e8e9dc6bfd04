"""Event history (execapp/history.py): every event leaves a trace, found by id, filtered, kept bounded;
failures also in the database, pruned after the retention; the admin's Events page and its trace.

Events go through the real consumer (Channels' WebsocketCommunicator -> Connection -> Engine);
the recorder is the worker service the housekeeper ticks, flushed by the tests for determinism."""
from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any, Iterator

import pytest
from django.core.management import call_command
from django.utils import timezone

from execapp import history, history_store
from execapp import worker as worker_module
from execapp.engine import Engine, Event
from execapp.history_record import Handler, Record, owner_key, pair_key, to_json
from execapp.history_store import Filters, LocalStore, RedisStore, Summary
from execapp.models import EventTrace

from . import ws_handlers
from .ws_fixtures import Client, demote

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def recorded(settings: Any, install_worker: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[worker_module.Worker]:
    """The process's Worker with the test commands and only the history recorder as a service
    (its housekeeper ticks it; the tests also flush it themselves)."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.EXECAPP = {"POOL_IDLE_SECONDS": 0.5, "HISTORY_MAX_EVENTS": 1000, "HISTORY_REPLY_BYTES": 300,
                        "HISTORY_TEXT_CHARS": 40}
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", ["execapp.history.recorder"])
    history_store.reset_local()
    history._refusal_budgets.clear()  # another test's refusals must not use up this one's traces
    worker = install_worker(worker_module.Worker("history-worker"))
    ws_handlers.register(worker.engine)
    worker.engine.add(worker.engine.make_matcher("command", "quiet", lambda ctx: None, plugin="test"))
    worker.start()
    assert history.current() is not None
    yield worker
    ws_handlers.slow_release.set()
    worker.stop(timeout=10)
    ws_handlers.slow_release.clear()
    assert history.current() is None  # stopping the worker stops recording
    history_store.reset_local()


def recorder() -> history.Recorder:
    rec = history.current()
    assert rec is not None
    return rec


async def flush() -> None:
    from asgiref.sync import sync_to_async

    await sync_to_async(recorder().flush, thread_sensitive=False)()


async def send_all(frames: list[dict], owner: str = "tenant:acme") -> list[dict]:
    """Send each frame on one connection and read until each one's done (or error)."""
    out = []
    async with Client(app=_app(owner)) as c:
        for frame in frames:
            await c.send(frame)
            while True:
                got = await c.recv()
                out.append(got)
                if got["type"] == "done" or (got["type"] == "error" and "matcher" not in got):
                    break
    return out


def _app(owner: str) -> Any:
    from execapp.consumers import EventConsumer

    app = EventConsumer.as_asgi()

    async def wrapped(scope: dict, receive: Any, send: Any) -> None:
        tenant = owner.split(":", 1)[1]
        return await app({**scope, "execapp_auth": {"kind": "token", "name": tenant, "owner": owner}},
                         receive, send)

    return wrapped


async def trace_of(owner: str, event_id: str) -> dict:
    found = await aget(owner, event_id)
    assert found is not None, f"no trace of {event_id!r}"
    return found


async def aget(owner: str, event_id: str) -> dict | None:
    from asgiref.sync import sync_to_async

    return await sync_to_async(history.get, thread_sensitive=False)(owner, event_id)


async def asearch(filters: Filters, limit: int = 50) -> list[Summary]:
    from asgiref.sync import sync_to_async

    return await sync_to_async(history.search, thread_sensitive=False)(filters, limit)


# -- what a trace holds ----------------------------------------------------------------------------

async def test_every_handler_of_an_event_is_in_its_trace_with_timings_and_replies(recorded: Any) -> None:
    demote(recorded, "command:ping")  # inline on the loop
    frames = await send_all([
        {"type": "message", "id": "inline-1", "text": "/ping and some text after it", "session": "s-1"},
        {"type": "message", "id": "pooled-1", "text": "/slow 30"},
        {"type": "message", "id": "multi-1", "text": "/multi 3"},
        {"type": "message", "id": "quiet-1", "text": "/quiet"},
        {"type": "message", "id": "boom-1", "text": "/boom"},
    ])
    assert [f["type"] for f in frames if f["id"] == "boom-1"] == ["error", "done"]
    await flush()
    owner = history.current().worker.id and "tenant:acme"

    ping = await trace_of(owner, "inline-1")
    assert ping["outcome"] == "ok" and ping["session"] == "s-1" and ping["owner"] == "tenant:acme"
    assert ping["text"] == "/ping and some text after it"[:40] and ping["type"] == "message"
    assert ping["worker"] == "history-worker" and ping["matched"] == 1 and ping["replies"] == 1
    [h] = ping["handlers"]
    assert h["matcher"] == "command:ping" and h["plugin"] == "test" and h["exec"] == "sync" and h["code"] == "ok"
    assert h["wait"] is None and 0 <= h["duration"] < 1 and h["replies"] == [["pong", None]]

    slow = await trace_of(owner, "pooled-1")
    [h] = slow["handlers"]
    assert h["exec"] == "pool" and h["replies"] == [["slept 30", None]]
    assert h["duration"] >= 0.03 and h["wait"] is not None and h["wait"] >= 0
    assert slow["duration"] >= h["duration"]

    multi = await trace_of(owner, "multi-1")
    assert multi["handlers"][0]["replies"] == [[f"part {i}", {"i": i}] for i in range(3)]

    # A handler that returned nothing sent no frame: only the run observer saw it, and it is listed.
    quiet = await trace_of(owner, "quiet-1")
    assert [h["matcher"] for h in quiet["handlers"]] == ["command:quiet"] and quiet["replies"] == 0
    assert quiet["handlers"][0]["replies"] == [] and quiet["replies_truncated"] is False

    boom = await trace_of(owner, "boom-1")
    assert boom["outcome"] == "error" and boom["codes"] == ["handler_error"]
    [h] = boom["handlers"]
    assert h["code"] == "handler_error" and h["message"] == "boom: the handler failed on purpose"
    # ... and the failure is in the database too, with its trace.
    row = await _db_row("boom-1")
    assert row.outcome == "error" and row.codes == "handler_error" and row.matchers == ",command:boom,"
    assert row.trace["handlers"][0]["message"] == "boom: the handler failed on purpose"
    assert not await _db_exists("inline-1")  # successes stay in the recent store only


async def test_replies_are_kept_up_to_the_byte_cap(recorded: Any) -> None:
    await send_all([{"type": "message", "id": "big", "text": "/echo " + "x" * 500},
                    {"type": "message", "id": "many", "text": "/multi 40"}])
    await flush()
    big = await trace_of("tenant:acme", "big")
    assert big["handlers"][0]["replies"] == [] and big["replies_truncated"] is True and big["replies"] == 1
    many = await trace_of("tenant:acme", "many")
    kept = many["handlers"][0]["replies"]
    assert 0 < len(kept) < 40 and many["replies_truncated"] is True
    assert kept == [[f"part {i}", {"i": i}] for i in range(len(kept))]  # the first ones, in order


async def test_refusals_leave_a_trace_and_are_counted(recorded: Any, settings: Any) -> None:
    recorded.set_draining(True)
    try:
        frames = await send_all([{"type": "message", "id": "refused-1", "text": "/ping"}])
    finally:
        recorded.set_draining(False)
    assert frames[0]["code"] == "draining"
    await flush()
    refused = await trace_of("tenant:acme", "refused-1")
    assert refused["outcome"] == "draining" and refused["handlers"] == [] and "draining" in refused["message"]
    assert recorder().event_refusals["draining"] == 1
    assert (await _db_row("refused-1")).outcome == "draining"


async def test_a_flood_of_refused_frames_is_counted_but_traces_only_a_few(
        recorded: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # One client's bad frames, on two connections, must not push every tenant's events out of the
    # bounded store: the budget is its owner's, not each connection's.
    monkeypatch.setattr(history, "_mono", lambda: 1000.0)  # one window, however slow the machine
    n = history.REFUSAL_TRACES_PER_SECOND * 2
    ids = [f"flood-{i}" for i in range(2 * n)]
    frames = [*await send_all([{"type": "message", "id": i, "text": "/ping", "bogus": 1} for i in ids[:n]]),
              *await send_all([{"type": "message", "id": i, "text": "/ping", "bogus": 1} for i in ids[n:]])]
    assert [f["code"] for f in frames] == ["bad_event"] * 2 * n
    await flush()
    assert recorder().event_refusals["bad_event"] == 2 * n  # every one counted
    traced = [i for i in ids if await aget("tenant:acme", i) is not None]
    assert len(traced) == history.REFUSAL_TRACES_PER_SECOND  # the owner's, over both connections


async def test_handler_failures_are_counted_by_matcher_plugin_and_code(recorded: Any) -> None:
    await send_all([{"type": "message", "id": f"b{i}", "text": "/boom"} for i in range(3)]
                   + [{"type": "message", "id": "late", "text": "/late"}])
    await flush()
    rec = recorder()
    assert rec.handler_failures[("command:boom", "test", "handler_error")] == 3
    assert rec.handler_failures[("command:late", "test", "timeout")] == 1
    last = rec.last_failure["command:late"]
    assert last["code"] == "timeout" and last["event_id"] == "late" and "10 ms budget" in last["message"]
    assert (await trace_of("tenant:acme", "late"))["uid"] == last["uid"]


async def test_owners_never_read_each_others_traces(recorded: Any) -> None:
    await send_all([{"type": "message", "id": "same-id", "text": "/echo acme"}], owner="tenant:acme")
    await send_all([{"type": "message", "id": "same-id", "text": "/echo other"}], owner="tenant:other")
    await flush()
    assert (await trace_of("tenant:acme", "same-id"))["handlers"][0]["replies"] == [["acme", None]]
    assert (await trace_of("tenant:other", "same-id"))["handlers"][0]["replies"] == [["other", None]]
    assert await aget("tenant:nobody", "same-id") is None


async def test_an_id_used_again_finds_the_newest_trace(recorded: Any) -> None:
    await send_all([{"type": "message", "id": "again", "text": "/echo first"},
                    {"type": "message", "id": "again", "text": "/echo second"}])
    await flush()
    assert (await trace_of("tenant:acme", "again"))["handlers"][0]["replies"] == [["second", None]]
    assert [s.id for s in (await asearch(Filters(id="again")))] == ["again", "again"]


# -- the recent store: bounded, filtered, newest first -----------------------------------------------

def _summary(n: int, **over: Any) -> Summary:
    base = dict(uid=f"u{n}", key=pair_key("tenant:a", f"e{n}"), ts=1000.0 + n, id=f"e{n}", owner="tenant:a",
                session="", type="message", outcome="ok", codes=(), matchers=("ping.ping",), plugins=("ping",),
                worker="w", duration=0.001)
    base.update(over)
    return Summary(**base)


def _record(n: int, **over: Any) -> Record:
    handler = Handler("ping.ping", "ping", "sync", 0.0, None, 0.001, "ok", "", (("pong", None),))
    base = dict(uid=f"u{n}", id=f"e{n}", owner="tenant:a", session=None, type="message", text="/ping", size=5,
                worker="w", ts=1000.0 + n, outcome="ok", message="", codes=(), duration=0.002, matched=1, replies=1,
                errors=0, blocked_by=None, handlers=(handler,), replies_truncated=False)
    base.update(over)
    return Record(**base)


def test_the_local_store_keeps_the_newest_events_and_forgets_their_keys() -> None:
    store = LocalStore(max_events=5)
    store.add([_record(n) for n in range(8)])
    assert store.count() == 5 and [s.id for s in store.scan()] == ["e7", "e6", "e5", "e4", "e3"]
    assert store.get("tenant:a", "e2") is None and store.body("u2") is None  # trimmed with their index
    assert json.loads(store.get("tenant:a", "e7") or "")["uid"] == "u7"


def test_the_local_store_keeps_its_traces_within_its_bytes(settings: Any) -> None:
    """Without Redis the recent store is the worker's memory: 100,000 traces of a plugin that replies
    4 KiB and fails with an 8 KiB message (MAX_ERROR_CHARS) held 1.27 GB. HISTORY_LOCAL_MAX_BYTES
    bounds it: the oldest go first, as past HISTORY_MAX_EVENTS."""
    import tracemalloc

    settings.EXECAPP = {"HISTORY_LOCAL_MAX_BYTES": 4 * 1024 * 1024}
    history_store.reset_local()
    store = history_store.store()
    assert isinstance(store, LocalStore) and store.max_events == 100_000

    def failed(n: int) -> Record:
        handler = Handler("big.run", "big", "sync", 0.0, None, 0.001, "handler_error", f"{n}" + "m" * 8192,
                          ((f"{n}" + "r" * 3900, None),))
        return _record(n, outcome="error", codes=("handler_error",), errors=1, handlers=(handler,))

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for chunk in range(10):
            store.add([failed(n) for n in range(chunk * 100, chunk * 100 + 100)])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.bytes <= 4 * 1024 * 1024 and 100 < store.count() < 1000
    assert held < 8 * 1024 * 1024, f"{held} bytes held"  # ~13 MB for the 1000 traces without the bound
    assert store.get("tenant:a", "e999") is not None and store.get("tenant:a", "e0") is None  # oldest gone
    history_store.reset_local()


def test_a_record_as_json_keeps_every_field() -> None:
    failed = Handler("boom.boom", None, None, None, None, 0.0, "plugin_busy", 'busy "now"\n', ())
    data = {"nested": [1, 2.5, None, "x\u00e9"], "ok": True}
    r = _record(1, session="s-1", outcome="error", codes=("plugin_busy",), errors=1, blocked_by="guard.guard",
                handlers=(Handler("echo.echo", "echo", "pool", 0.25, 0.25, 0.5, "ok", "", (("a\tb", data),)), failed),
                replies_truncated=True, text='quote " and \\ and \u2028')
    back = json.loads(to_json(r))
    assert back == {"uid": "u1", "id": "e1", "owner": "tenant:a", "session": "s-1", "type": "message",
                    "text": r.text, "size": 5, "worker": "w", "ts": 1001.0, "outcome": "error", "message": "",
                    "codes": ["plugin_busy"], "duration": 0.002, "matched": 1, "replies": 1, "errors": 1,
                    "blocked_by": "guard.guard", "replies_truncated": True,
                    "handlers": [{"matcher": "echo.echo", "plugin": "echo", "exec": "pool", "start": 0.25,
                                  "wait": 0.25, "duration": 0.5, "code": "ok", "message": "",
                                  "replies": [["a\tb", data]]},
                                 {"matcher": "boom.boom", "plugin": None, "exec": None, "start": None, "wait": None,
                                  "duration": 0.0, "code": "plugin_busy", "message": 'busy "now"\n', "replies": []}]}
    odd = _record(2, handlers=(Handler("x", None, "sync", 0.0, None, 0.0, "ok", "", ((None, {1, 2}),)),))
    assert json.loads(to_json(odd))["handlers"][0]["replies"] == [[None, "{1, 2}"]]  # not JSON: its text


def test_summary_lines_round_trip_and_filters_match() -> None:
    s = _summary(1, session="s\t1", outcome="error", codes=("timeout",), matchers=("a.b", "c:d"),
                 plugins=("a", "c"))
    back = Summary.from_line(s.to_line())
    assert back == s._replace(session="s 1")
    assert Summary.from_line("short\tline") is None
    assert Filters(outcome="failed").match(s) and Filters(outcome="timeout").match(s)
    assert Filters(outcome="error", plugin="c", matcher="a.b").match(s)
    assert not Filters(outcome="ok").match(s) and not Filters(plugin="b").match(s)
    assert Filters(since=1001.0, until=1002.0).match(s) and not Filters(since=1001.5).match(s)
    assert not Filters(before=1001.0).match(s)
    # the paging cursor (ts, uid): the same ts is on the next page when its uid sorts lower
    assert Filters(before=1001.0, before_uid="u2").match(s) and not Filters(before=1001.0, before_uid="u1").match(s)
    assert not Filters(before=1000.5, before_uid="u2").match(s) and Filters(before=1001.5, before_uid="u0").match(s)


@pytest.mark.redis
def test_the_redis_store_is_bounded_and_shared(redis_url: str, settings: Any) -> None:
    settings.REDIS_URL = redis_url
    settings.EXECAPP = {"HISTORY_MAX_EVENTS": 50}
    store = history_store.store()
    assert isinstance(store, RedisStore)
    for start in range(0, 120, 40):  # three flushes, as several workers would add
        store.add([_record(n) for n in range(start, start + 40)])
    assert store.count() == 50
    assert [s.id for s in store.scan()][:3] == ["e119", "e118", "e117"]
    assert json.loads(store.get("tenant:a", "e119") or "") == json.loads(to_json(_record(119)))
    assert store.get("tenant:a", "e60") is None and store.body("u60") is None
    # Every body and pointer of a trimmed trace is gone: 50 bodies + 50 pointers + the log, the
    # owner's list, the owners' counts and bytes, the total traces and bytes, the evictions.
    keys = store.client.keys(store.prefix + "*")
    assert len(keys) == 107 and store.client.llen(store.prefix + "o:" + owner_key("tenant:a")) == 50
    # Another process (a second worker) sees the same traces.
    other = RedisStore(redis_url, 50)
    assert other.get("tenant:a", "e100") == store.get("tenant:a", "e100")


async def test_search_merges_the_recent_store_and_the_database(recorded: Any) -> None:
    await send_all([{"type": "message", "id": f"ok{i}", "text": "/ping", "session": "sx"} for i in range(3)]
                   + [{"type": "message", "id": "fail-now", "text": "/boom", "session": "sx"}])
    await flush()
    await _old_failure("fail-old", days_ago=2)  # only in the database (the store forgot it)
    newest = (await asearch(Filters(session="sx")))
    assert [s.id for s in newest] == ["fail-now", "ok2", "ok1", "ok0"]
    failed = (await asearch(Filters(outcome="failed")))
    assert [s.id for s in failed] == ["fail-now", "fail-old"]
    assert [s.id for s in (await asearch(Filters(matcher="command:boom")))] == ["fail-now", "fail-old"]
    assert [s.id for s in (await asearch(Filters(plugin="test", outcome="handler_error")))] == ["fail-now", "fail-old"]
    assert [s.id for s in (await asearch(Filters(outcome="ok", session="sx"), limit=2))] == ["ok2", "ok1"]
    since = time.time() - 3600
    assert [s.id for s in (await asearch(Filters(outcome="failed", since=since)))] == ["fail-now"]
    from asgiref.sync import sync_to_async

    assert (await sync_to_async(history.detail, thread_sensitive=False)(failed[1].uid))["id"] == "fail-old"


@pytest.mark.django_db
def test_a_resend_finds_its_runs_trace_behind_a_newer_refusal_of_its_id(settings: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of a resend event refused while it ran (resend_in_progress) is the pair's newest
    trace when the run's record is made durable: the run's own trace is still the one found."""
    from types import SimpleNamespace

    from execapp import resend

    settings.REDIS_URL = ""
    settings.EXECAPP = {}
    history_store.reset_local()
    monkeypatch.setattr(history, "current", lambda: SimpleNamespace(flush=lambda **_: 0))
    run = _record(1, id="r", worker="w1", duration=0.25)
    refusal = _record(2, id="r", worker="w2", outcome="resend_in_progress", message="still running", handlers=(),
                      codes=("resend_in_progress",), duration=0.0, matched=0, replies=0)
    try:
        history_store.store().add([run, refusal])
        assert json.loads(history_store.store().get("tenant:a", "r") or "")["uid"] == "u2"  # the refusal is newest
        assert resend._durable_trace("tenant:a", "r", "w1", 0.25) == "u1"
        with pytest.raises(resend.ResendError) as refused:
            resend._durable_trace("tenant:a", "r", "w1", 0.5)  # no trace of a run that long
        assert refused.value.code == "resend_unavailable"
    finally:
        history_store.reset_local()


# -- retention: prune ---------------------------------------------------------------------------------

@pytest.mark.redis
def test_by_default_the_last_100000_events_and_7_days_of_failures_are_kept(redis_url: str, settings: Any) -> None:
    """The defaults a new user gets: both recent stores keep 100,000 traces (the Redis one of every
    worker, the local one of this process: tests above check the bound itself with smaller values)
    and the database keeps failures 7 days (the prune test checks what that deletes)."""
    from execapp import conf

    settings.EXECAPP = {}
    assert conf.get("HISTORY_MAX_EVENTS") >= 100_000 and conf.get("HISTORY_FAILURE_DAYS") >= 7
    settings.REDIS_URL = ""
    history_store.reset_local()
    local = history_store.store()
    assert isinstance(local, LocalStore) and local.max_events == 100_000
    settings.REDIS_URL = redis_url
    shared = history_store.store()
    assert isinstance(shared, RedisStore) and shared.max_events == 100_000
    history_store.reset_local()


@pytest.mark.django_db
def test_prune_deletes_failures_past_the_retention(settings: Any) -> None:
    from asgiref.sync import async_to_sync

    async_to_sync(_old_failure)("old", days_ago=8)
    async_to_sync(_old_failure)("recent", days_ago=6)
    from io import StringIO

    out = StringIO()
    call_command("prune_history", "--dry-run", stdout=out)
    assert "would delete 1 event traces older than 7 days" in out.getvalue()
    assert EventTrace.objects.count() == 2
    out = StringIO()
    call_command("prune_history", stdout=out)
    assert "deleted 1 event traces older than 7 days" in out.getvalue() and "1 kept" in out.getvalue()
    assert list(EventTrace.objects.values_list("event_id", flat=True)) == ["recent"]
    settings.EXECAPP = {"HISTORY_FAILURE_DAYS": 1}
    assert history.prune() == 1 and not EventTrace.objects.exists()


@pytest.mark.django_db
def test_a_retention_longer_than_the_calendar_keeps_everything(settings: Any) -> None:
    """``--days 1e6`` or ``inf`` ("keep everything"), or such a HISTORY_FAILURE_DAYS (the workers'
    hourly prune): before, an OverflowError traceback (timedelta, or a date before year 1)."""
    from io import StringIO

    from asgiref.sync import async_to_sync
    from django.core.management.base import CommandError

    async_to_sync(_old_failure)("old", days_ago=8)
    for days in ("1e6", "inf", "1e10"):
        out = StringIO()
        call_command("prune_history", "--dry-run", "--days", days, stdout=out)
        assert "would delete 0 event traces" in out.getvalue(), days
        out = StringIO()
        call_command("prune_history", "--days", days, stdout=out)
        assert "deleted 0 event traces" in out.getvalue() and "1 kept" in out.getvalue(), days
    settings.EXECAPP = {"HISTORY_FAILURE_DAYS": 1e6}
    assert history.prune() == 0 and EventTrace.objects.count() == 1
    with pytest.raises(CommandError, match="--days nan: use a number of days >= 0"):
        call_command("prune_history", "--days", "nan")


@pytest.mark.django_db
def test_prune_keeps_each_owner_s_newest_failures_up_to_its_cap(settings: Any) -> None:
    """A quota on the database: a tenant whose events all fail keeps its newest N, the others theirs."""
    now = timezone.now()

    def rows(owner: str, n: int) -> list[EventTrace]:
        return [EventTrace(uid=f"{owner}-{i}", event_id=f"e{i}", owner=owner, outcome="error",
                           created_at=now - dt.timedelta(seconds=n - i), trace={}) for i in range(n)]

    EventTrace.objects.bulk_create(rows("tenant:flood", 130) + rows("tenant:quiet", 7))
    settings.EXECAPP = {"HISTORY_FAILURES_PER_OWNER": 50}
    assert history.prune_owners() == 80
    flood = list(EventTrace.objects.filter(owner="tenant:flood").order_by("id").values_list("event_id", flat=True))
    assert flood == [f"e{i}" for i in range(80, 130)]  # the newest 50
    assert EventTrace.objects.filter(owner="tenant:quiet").count() == 7
    assert history.prune_owners() == 0  # within the cap now
    from io import StringIO

    EventTrace.objects.bulk_create(rows("tenant:more", 60))
    out = StringIO()
    call_command("prune_history", stdout=out)
    assert "and 10 past each owner's newest 50" in out.getvalue(), out.getvalue()


async def test_events_still_running_when_the_worker_stops_are_recorded_incomplete(recorded: Any) -> None:
    async with Client(app=_app("tenant:acme")) as c:
        await c.send({"type": "message", "id": "unfinished", "text": "/slow 5000"})
        from .ws_fixtures import wait_for

        await wait_for(lambda: ws_handlers.slow_running.is_set())
        rec = recorder()
        from asgiref.sync import sync_to_async

        await sync_to_async(rec.flush, thread_sensitive=False)(expire_all=True)
        ws_handlers.slow_release.set()
        await c.until_done("unfinished")
    trace = await trace_of("tenant:acme", "unfinished")
    assert trace["outcome"] == "incomplete" and trace["duration"] is None


# -- the hot path's bound -------------------------------------------------------------------------------

def test_hooks_do_nothing_without_a_recorder_and_the_buffer_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from execapp.engine import Completion

    assert history.current() is None
    conn = object()
    history.accepted(conn, Event(text="/x", id="a"))
    assert not history._pending and not history._buffer  # no recorder: nothing kept
    monkeypatch.setattr(history, "_recorder", object())
    monkeypatch.setattr(history, "BUFFER_LIMIT", 2)
    dropped = history.count_value(history._dropped)
    for n in range(5):
        history.accepted(conn, Event(text="/x", id=f"e{n}"))
        history.delivered(conn, Completion(f"e{n}", 0, 0, (), None, 0.0))
    assert len(history._buffer) == 2 and history.count_value(history._dropped) == dropped + 3
    assert not history._pending  # completed events leave the in-flight map
    history.discard_buffer()


class _Collect:
    """A recent store that keeps what the recorder adds, as it is."""

    name = "collect"

    def __init__(self) -> None:
        self.records: list[tuple] = []

    def add(self, records: list[tuple]) -> None:
        self.records.extend(records)


def _direct_recorder(monkeypatch: pytest.MonkeyPatch) -> history.Recorder:
    """A started recorder of its own (restored after the test) whose store is a _Collect."""
    from types import SimpleNamespace

    from execapp.engine import Engine

    monkeypatch.setattr(history, "_recorder", None)
    rec = history.Recorder(SimpleNamespace(engine=Engine(pool_enabled=False), id="w1"))
    rec.store = _Collect()  # type: ignore[assignment]
    rec.text_chars, rec.reply_bytes = 10, 50
    rec.start()
    return rec


def _one_run(conn: Any, event: Event, exec_class: Any, reply: Any, matcher: str = "command:ping") -> None:
    """What the connection and the engine tell the hooks for an event with one handler run."""
    from types import SimpleNamespace

    from execapp.engine import Completion, Reply

    history.accepted(conn, event)
    if reply is not None:
        history.delivered(conn, Reply(event.id, matcher, "p", reply[0], reply[1], exec_class, 0.002))
    history._observe(SimpleNamespace(name=matcher, plugin="p"), exec_class, 0.002, "ok", event)
    history.delivered(conn, Completion(event.id, 1, 0 if reply is None else 1, (), None, 0.003))


def test_the_common_event_leaves_plain_values_and_its_flat_record_keeps_every_field(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    from types import SimpleNamespace

    from execapp.engine.profile import ExecClass
    from execapp.history_record import FLAT_LEN, flat, view

    rec = _direct_recorder(monkeypatch)
    conn = SimpleNamespace(owner="tenant:t")
    before = time.time()
    _one_run(conn, Event(text="/ping 0123456789", id="c1", session="s"), ExecClass.SYNC, ("pong", None))
    _one_run(conn, Event(text="/ping", id="c2"), ExecClass.POOL, (None, 7))
    _one_run(conn, Event(text="/ping", id="c3"), ExecClass.SYNC, ("x" * 60, None))  # over reply_bytes
    _one_run(conn, Event(text="/quiet", id="c4"), ExecClass.SYNC, None)
    after = time.time()
    assert not history._pending and len(history._buffer) == 4
    gc.collect()
    assert not any(gc.is_tracked(item) for item in history._buffer)  # plain values only until the flush
    assert rec.flush() == 4
    c1, c2, c3, c4 = rec.store.records  # type: ignore[attr-defined]
    assert all(len(r) == FLAT_LEN for r in (c1, c2, c3, c4))
    assert before - 0.01 <= c1[8] <= after + 0.01  # wall time, from the monotonic clock and the offset
    start = c1[20]
    assert start >= 0.0
    assert c1 == flat(c1[0], "c1", "tenant:t", "s", "message", "/ping 0123", 16, "w1", c1[8], 0.003, 1, 1, None,
                      "command:ping", "p", "sync", start, None, 0.002, "pong", None, True)
    assert view(c2).handlers[0][2:5] == ("pool", c2[20], c2[20]) and view(c2).handlers[0][8] == ((None, 7),)
    assert view(c3).handlers[0][8] == () and view(c3).replies_truncated and view(c3).replies == 1
    assert view(c4).handlers[0][8] == () and not view(c4).replies_truncated and view(c4).replies == 0
    assert len({c1[0], c2[0], c3[0], c4[0]}) == 4  # uids unique


def test_an_id_in_flight_on_two_connections_keeps_two_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from execapp.engine import Completion, Reply
    from execapp.engine.profile import ExecClass
    from execapp.history_record import view

    rec = _direct_recorder(monkeypatch)
    a, b = SimpleNamespace(owner="tenant:a"), SimpleNamespace(owner="tenant:b")
    ea, eb = Event(text="/echo a", id="same"), Event(text="/echo b", id="same")
    history.accepted(a, ea)
    history.accepted(b, eb)  # the clients' own ids: both in flight at once
    for event in (eb, ea):  # each run is told to the trace of its own event, not of its id
        history._observe(SimpleNamespace(name="command:echo", plugin="p"), ExecClass.SYNC, 0.001, "ok", event)
    history.delivered(b, Reply("same", "command:echo", "p", "b", {"n": 2}, ExecClass.SYNC, 0.001))
    history.delivered(a, Reply("same", "command:echo", "p", "a", {"n": 1}, ExecClass.SYNC, 0.001))
    history.delivered(a, Completion("same", 1, 1, (), None, 0.001))
    history.delivered(b, Completion("same", 1, 1, (), None, 0.001))
    assert not history._pending
    # The same connection accepting an id it never completed: the earlier one is recorded incomplete.
    history.accepted(a, Event(text="/slow", id="again"))
    history.accepted(a, Event(text="/ping", id="again"))
    history.delivered(a, Completion("again", 0, 0, (), None, 0.0))
    assert rec.flush() == 4
    got = [view(r) for r in rec.store.records]  # type: ignore[attr-defined]
    assert [(r.owner, r.handlers[0][8]) for r in got[:2]] == [("tenant:a", (("a", {"n": 1}),)),
                                                              ("tenant:b", (("b", {"n": 2}),))]
    assert all(r.handlers[0][3] is not None and r.handlers[0][2] == "sync" for r in got[:2])  # observed: timed
    assert [(r.text, r.outcome) for r in got[2:]] == [("/slow", "incomplete"), ("/ping", "ok")]


# -- helpers ----------------------------------------------------------------------------------------------

async def _db_row(event_id: str) -> EventTrace:
    from asgiref.sync import sync_to_async

    return await sync_to_async(EventTrace.objects.get)(event_id=event_id)


async def _db_exists(event_id: str) -> bool:
    from asgiref.sync import sync_to_async

    return await sync_to_async(EventTrace.objects.filter(event_id=event_id).exists)()


async def _old_failure(event_id: str, days_ago: float) -> None:
    from asgiref.sync import sync_to_async

    when = timezone.now() - dt.timedelta(days=days_ago)
    trace = {"uid": f"old-{event_id}", "id": event_id, "owner": "tenant:acme", "ts": when.timestamp(),
             "outcome": "error", "codes": ["handler_error"], "worker": "gone", "session": None, "type": "message",
             "text": "/boom", "size": 5, "message": "", "duration": 0.001, "matched": 1, "replies": 0, "errors": 1,
             "blocked_by": None, "replies_truncated": False,
             "handlers": [{"matcher": "command:boom", "plugin": "test", "exec": "sync", "start": 0.0, "wait": None,
                           "duration": 0.001, "code": "handler_error", "message": "boom (old)", "replies": []}]}
    await sync_to_async(EventTrace.objects.create)(
        uid=trace["uid"], event_id=event_id, owner="tenant:acme", event_type="message", text="/boom",
        outcome="error", codes="handler_error", matchers=",command:boom,", plugins=",test,", worker="gone",
        created_at=when, duration_seconds=0.001, trace=trace)


def test_the_local_store_adds_nothing_for_the_garbage_collector_to_walk() -> None:
    """100,000 kept traces must not make every full collection of the worker walk them: the store
    holds bytes in flat tuples, which the collector does not track (a tuple of tuples stays tracked)."""
    import gc

    from execapp.history_record import flat

    store = LocalStore(max_events=100)
    store.add([_record(n) for n in range(10)])  # nested handlers: kept marshalled
    common = flat("f1", "e-f", "tenant:a", None, "message", "/ping", 5, "w", 1000.5, 0.002, 1, 1, None, "ping.ping",
                  "ping", "sync", 0.0, None, 0.001, "pong", None, True)
    store.add([common])  # the common event: a flat tuple of plain values, kept as it is
    gc.collect()
    assert not any(gc.is_tracked(kept) or gc.is_tracked(kept[1]) for kept in store._items.values())
    assert not any(gc.is_tracked(v) for v in store._by_key.values())
    assert json.loads(store.body("u3") or "") == json.loads(to_json(_record(3)))
    assert json.loads(store.body("f1") or "") == json.loads(to_json(_record(1, uid="f1", id="e-f", ts=1000.5)))


def test_one_owner_s_failures_reach_the_database_at_its_budget_and_leave_the_others_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A tenant whose events all fail wrote a row per event at the rate it could send (the flush
    # cap, 2,000 rows, filled by it alone left no room for the others).
    monkeypatch.setattr(history, "DB_ROWS_PER_OWNER_PER_SECOND", 5)
    from types import SimpleNamespace

    monkeypatch.setattr(history, "_mono", lambda: 1000.0)  # one budget window
    rec = history.Recorder(SimpleNamespace(engine=Engine(pool_enabled=False), id="w1"))

    def failed(n: int, owner: str) -> Record:
        handler = Handler("command:boom", "p", "sync", 0.0, None, 0.001, "handler_error", "failed", ())
        return Record(f"u-{owner}-{n}", f"e{n}", owner, None, "message", "/boom", 5, "w1", 1000.0, "error", "",
                      ("handler_error",), 0.001, 1, 1, 1, None, (handler,), False)

    rec._write_failures([failed(i, "tenant:flood") for i in range(20)] + [failed(i, "tenant:calm") for i in range(3)])
    rows = list(EventTrace.objects.values_list("owner", flat=True))
    assert rows.count("tenant:flood") == 5 and rows.count("tenant:calm") == 3
    assert rec.db_written == 8 and rec.db_skipped == 15


@pytest.mark.redis
def test_a_lone_surrogate_in_a_plugin_s_reply_fails_no_flush_of_the_redis_store(redis_url: str) -> None:
    # A JS plugin's reply or error can hold one ("\ud800"); the Redis client could not encode the
    # trace and the whole flush was lost.
    store = RedisStore(redis_url, 100)
    handler = Handler("command:boom", "p", "sync", 0.0, None, 0.001, "handler_error", "bad \ud800 message",
                      (("re\udc00ply \u00e9", None),))
    lone = Record("u-lone", "e1", "tenant:a", None, "message", "/boom", 5, "w1", 1000.0, "error", "",
                  ("handler_error",), 0.001, 1, 1, 1, None, (handler,), False)
    plain = lone._replace(uid="u-plain", id="e2", handlers=())
    store.add([lone, plain])
    assert json.loads(store.body("u-lone"))["handlers"][0]["message"] == "bad \ud800 message"  # as kept
    assert store.body("u-plain") is not None


# -- what the buffer holds while the housekeeper is behind -------------------------------------------------

async def _drive(rec: history.Recorder, frames: list[str], handler: Any) -> None:
    """The real path: frames into a Connection whose Engine runs ``handler`` for /big, inline."""
    from execapp.connection import Connection
    from execapp.protocol import Limits

    from .ws_fixtures import Admission

    engine = Engine(pool_enabled=False)
    engine.on_command("big", handler)

    async def send(text: str) -> None:
        pass

    conn = Connection(engine, Admission(), Limits(), send, owner="tenant:big")
    for frame in frames:
        await conn.receive(frame)
    await conn.flush()


def _big_strings(limit: int) -> int:
    """How many strings longer than ``limit`` the buffer's items hold (walking their lists and outcomes)."""
    seen = 0
    stack: list[Any] = list(history._buffer)
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            seen += len(value) > limit
        elif isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, (Event,)):
            stack.extend((value.text, list(value.data.values())))
        elif hasattr(value, "text") and hasattr(value, "data"):  # a Reply
            stack.extend((value.text, value.data))
    return seen


async def test_a_reply_too_large_for_any_trace_is_not_held_until_the_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin replying 256 KiB (MAX_REPLY_BYTES) to every event used to leave each reply, and the
    event's 60 KB text, in the buffer until the housekeeper's next flush (~320 KiB an event: 2,000
    events held 627 MiB). They are cut as they enter: the buffer holds what the trace will keep."""
    import tracemalloc

    rec = _direct_recorder(monkeypatch)
    rec.text_chars, rec.reply_bytes = 200, 4096
    rec.start()
    big = "x" * (256 * 1024)
    frames = [json.dumps({"id": f"b{i}", "text": "/big " + "y" * 60_000}) for i in range(100)]
    frames += [json.dumps({"id": f"d{i}", "type": "order", "data": {"items": ["z" * 60_000]}}) for i in range(10)]

    def reply(ctx: Any) -> str:
        return ctx.args[:1] + big  # a new string each time, as a plugin's reply is

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        await _drive(rec, frames[:100], reply)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(history._buffer) == 100
    assert held < 100 * 16 * 1024, f"{held} bytes held for 100 buffered events"  # was ~100 x 320 KiB
    assert _big_strings(4096 + history.REPLY_FRAME_SLACK) == 0
    rec.flush()
    records = [history.view(r) for r in rec.store.records]  # type: ignore[attr-defined]
    assert len(records) == 100 and all(r.replies_truncated and r.replies == 1 for r in records)
    assert all(r.text == ("/big " + "y" * 60_000)[:200] for r in records)


def test_a_large_event_of_the_general_kind_is_kept_small_until_the_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """An event that failed (or had several handlers) is buffered as its in-flight list: its
    decoded data (a 60 KB frame) is replaced by the first characters the trace keeps."""
    from types import SimpleNamespace

    from execapp.engine import Completion, Failure
    from execapp.engine.profile import ExecClass

    rec = _direct_recorder(monkeypatch)
    conn = SimpleNamespace(owner="tenant:t")
    event = Event(type="order", data={"items": ["z" * 60_000]}, id="g1", size=60_020)
    history.accepted(conn, event)
    history._observe(SimpleNamespace(name="event:order", plugin="p"), ExecClass.SYNC, 0.001, "handler_error", event)
    history.delivered(conn, Failure("g1", "event:order", "p", "handler_error", "boom", ExecClass.SYNC, 0.001))
    history.delivered(conn, Completion("g1", 1, 0, ("handler_error",), None, 0.002))
    assert _big_strings(1000) == 0
    rec.flush()
    (r,) = [history.view(x) for x in rec.store.records]  # type: ignore[attr-defined]
    assert r.text == '{"items":["zzzzz'[:rec.text_chars] and r.size == 60_020 and r.codes == ("handler_error",)


def test_the_buffer_is_bounded_in_bytes_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past BUFFER_BYTES (what the kept text and replies add up to) new items are dropped and
    counted, as past BUFFER_LIMIT; a flush makes room again."""
    from types import SimpleNamespace

    from execapp.engine.profile import ExecClass

    rec = _direct_recorder(monkeypatch)  # replies up to 50 bytes kept, text 10 characters
    history.discard_buffer()
    monkeypatch.setattr(history, "BUFFER_BYTES", 10 * history._ITEM_BYTES)
    conn = SimpleNamespace(owner="tenant:t")
    dropped = history.count_value(history._dropped)
    for n in range(20):
        _one_run(conn, Event(text="/ping", id=f"p{n}"), ExecClass.SYNC, ("p" * 40, None))
    assert 5 <= len(history._buffer) < 10  # each costs _ITEM_BYTES and what it keeps
    assert history.count_value(history._dropped) == dropped + 20 - len(history._buffer)
    assert rec.flush() == len(rec.store.records)  # type: ignore[attr-defined]
    assert history._bytes[0] == history._bytes[1]  # all taken: the room is back
    _one_run(conn, Event(text="/ping", id="again"), ExecClass.SYNC, ("pong", None))
    assert len(history._buffer) == 1
    history.discard_buffer()  # nothing left for the next test's recorder


def test_failure_rows_are_written_again_when_sqlite_says_a_table_is_locked(
        recorded: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite's shared cache answers "database table is locked" at once (no busy timeout) while
    another connection of the process is mid-transaction: the failure rows, the lasting record,
    are written again after a short wait instead of being dropped (seen in a CI run)."""
    from django.db import OperationalError
    from django.db.models import QuerySet

    calls: list[int] = []

    def locked_once(self: QuerySet, objs: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(objs))  # (not written for real: the housekeeper's own writes may lock it too)
        if len(calls) == 1:
            raise OperationalError("database table is locked")
        return list(objs)

    monkeypatch.setattr(QuerySet, "bulk_create", locked_once)
    monkeypatch.setattr(history, "DB_LOCKED_RETRY_SECONDS", (0.0,))
    rec = recorder()
    written = rec.db_written
    rec._write_failures([_record(7, outcome="error", codes=("handler_error",), owner="tenant:retry")])
    assert calls == [1, 1] and rec.db_written == written + 1
    monkeypatch.setattr(QuerySet, "bulk_create", lambda *a, **k: (_ for _ in ()).throw(OperationalError("locked")))
    skipped = rec.db_skipped
    rec._write_failures([_record(8, outcome="error", codes=("handler_error",), owner="tenant:retry")])
    assert rec.db_skipped == skipped + 1  # still locked after every wait: counted, not raised


def test_the_database_thread_ends_when_the_worker_stops(recorded: worker_module.Worker) -> None:
    """A stopped worker leaves no history database thread behind, and a late tick starts none: its
    prunes and writes went on against a database being flushed (a test's flush failed "table is
    locked" in CI) and each recorder of the process kept one thread forever."""
    rec = recorder()
    rec.tick()
    thread = rec._db_thread
    assert thread is not None and thread.is_alive()
    recorded.stop(timeout=10)
    assert not thread.is_alive()
    rec.tick()
    assert rec._db_thread is thread and not thread.is_alive()
