"""The admin's Events page: who may see it, filters and search by id, the trace as a timeline, and
the links from a matcher's and a plugin's admin pages to their recent failures."""
from __future__ import annotations

import time
from typing import Any, Iterator

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import User
from django.test import Client

from execapp import history, history_store
from execapp.history_record import Handler, Record
from execapp.models import ExecProfileRecord

from .test_admin_permissions import staff
from .test_history import flush, recorded, send_all  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)
EVENTS = "/admin/execapp/eventtrace/"


@pytest.fixture(autouse=True)
def fresh_search_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's users start with a full bucket of searches (user ids repeat across tests)."""
    from execapp import history_admin
    from execapp.user_rate import UserRate

    monkeypatch.setattr(history_admin, "_search_rate", UserRate())


def _send(frames: list[dict]) -> None:
    async_to_sync(send_all)(frames)
    async_to_sync(flush)()


def test_the_events_page_needs_the_view_permission(recorded: Any) -> None:
    _send([{"type": "message", "id": "p1", "text": "/ping"}])
    assert staff("nobody", []).get(EVENTS).status_code == 403
    viewer = staff("viewer", ["execapp.view_eventtrace"])
    page = viewer.get(EVENTS)
    assert page.status_code == 200 and [r["id"] for r in page.context["rows"]] == ["p1"]
    uid = page.context["rows"][0]["uid"]
    assert staff("nobody2", []).get(f"{EVENTS}{uid}/change/").status_code == 403
    assert viewer.get(f"{EVENTS}{uid}/change/").status_code == 200
    assert Client().get(EVENTS).status_code == 302  # not logged in: the admin login
    # Read-only: nothing to add, change or delete from the admin (prune_history deletes).
    admin = staff("admin", ["execapp.view_eventtrace", "execapp.add_eventtrace", "execapp.change_eventtrace",
                            "execapp.delete_eventtrace"])
    assert admin.get(f"{EVENTS}add/").status_code == 403
    assert admin.post(f"{EVENTS}{uid}/delete/", {"post": "yes"}).status_code in (403, 404)


def test_filters_search_and_the_timeline_say_why_an_event_failed(recorded: Any) -> None:
    from .ws_fixtures import demote

    demote(recorded, "command:ping")
    _send([{"type": "message", "id": f"ok-{i}", "text": "/ping", "session": "room-1"} for i in range(3)]
          + [{"type": "message", "id": "the-failure", "text": "/boom <b>not html</b>", "session": "room-1"},
             {"type": "message", "id": "slow-one", "text": "/slow 20"}])
    superuser = User.objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(superuser)

    def ids(query: str) -> list[str]:
        page = client.get(EVENTS + query)
        assert page.status_code == 200
        return [r["id"] for r in page.context["rows"]]

    assert ids("") == ["slow-one", "the-failure", "ok-2", "ok-1", "ok-0"]  # newest first
    assert ids("?q=ok-1") == ["ok-1"]
    assert ids("?outcome=failed") == ["the-failure"]
    assert ids("?outcome=handler_error&plugin=test") == ["the-failure"]
    assert ids("?matcher=command:ping") == ["ok-2", "ok-1", "ok-0"]
    assert ids("?session=room-1&outcome=ok") == ["ok-2", "ok-1", "ok-0"]
    assert ids("?owner=tenant:acme&matcher=command:slow") == ["slow-one"]
    assert ids("?owner=tenant:other") == []
    assert ids(f"?since={time.time() + 60}") == []
    bad = client.get(EVENTS + "?since=yesterday")
    assert "is not a time" in bad.content.decode()
    for crafted in ("nan", "inf", "-inf", "1e20", "-5"):  # floats no datetime holds: a 500 before
        page = client.get(EVENTS + f"?since={crafted}&until={crafted}&before={crafted}")
        assert page.status_code == 200 and "is not a time" in page.content.decode(), crafted

    listed = client.get(EVENTS + "?q=the-failure")
    uid = listed.context["rows"][0]["uid"]
    page = client.get(f"{EVENTS}{uid}/change/")
    html = page.content.decode()
    assert page.status_code == 200
    assert "boom: the handler failed on purpose" in html and "handler_error" in html
    assert "&lt;b&gt;not html&lt;/b&gt;" in html and "<b>not html</b>" not in html  # escaped
    [lane] = page.context["timeline"]
    assert lane["matcher"] == "command:boom" and lane["failed"] and lane["run_width"] > 0
    assert "/admin/execapp/eventtrace/?matcher=command%3Aboom&amp;outcome=failed" in html

    slow_uid = client.get(EVENTS + "?q=slow-one").context["rows"][0]["uid"]
    [lane] = client.get(f"{EVENTS}{slow_uid}/change/").context["timeline"]
    assert lane["exec"] == "pool" and lane["duration_ms"] != "-" and float(lane["duration_ms"]) >= 20
    assert client.get(f"{EVENTS}no-such-uid/change/").status_code == 404


def _every_page() -> list[str]:
    """The ids on the Events page and every older page after it, following its *older* links."""
    client = staff("viewer", ["execapp.view_eventtrace"])
    seen, url = [], EVENTS
    while url:
        page = client.get(url)
        seen += [r["id"] for r in page.context["rows"]]
        url = EVENTS + page.context["older_url"] if page.context["older_url"] else None
    return seen


def test_paging_goes_back_through_older_events(recorded: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from execapp import history_admin

    monkeypatch.setattr(history_admin, "PAGE_SIZE", 2)
    _send([{"type": "message", "id": f"e{i}", "text": "/ping"} for i in range(5)])
    assert _every_page() == ["e4", "e3", "e2", "e1", "e0"]


@pytest.fixture
def quiet_store() -> Iterator[None]:
    """An empty recent store and no worker: nothing but the test writes (a recorder's housekeeper
    writing beside it locks SQLite's shared in-memory test database: 'database table is locked')."""
    history_store.reset_local()
    yield
    history_store.reset_local()


@pytest.mark.usefixtures("quiet_store")
def test_paging_does_not_skip_traces_that_share_a_timestamp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages end where PAGE_SIZE says, not where a timestamp changes: traces sharing the last shown
    row's ts (one worker's flush, or the database's microseconds) are on the next page. Before, the
    cursor was the ts alone and "strictly older" skipped them."""
    import datetime as dt

    from execapp import history_admin
    from execapp.models import EventTrace

    from .test_history import _record

    monkeypatch.setattr(history_admin, "PAGE_SIZE", 2)
    now = time.time()
    history_store.store().add([_record(n, ts=now, id=f"same{n}") for n in range(5)]
                              + [_record(9, ts=now - 1, id="older")])
    when = dt.datetime.fromtimestamp(round(now - 2, 3), dt.timezone.utc)
    for n in range(3):  # failures the database keeps, sharing one created_at
        EventTrace.objects.create(uid=f"db-{n}", event_id=f"failed{n}", owner="tenant:a", outcome="timeout",
                                  codes="timeout", created_at=when, trace={})
    assert _every_page() == ["same4", "same3", "same2", "same1", "same0", "older", "failed2", "failed1", "failed0"]


def test_a_matchers_and_a_plugins_admin_pages_link_to_their_failures(recorded: Any) -> None:
    from plugins.models import Binding, Plugin

    superuser = User.objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(superuser)
    record = ExecProfileRecord.objects.create(matcher="ping.ping", plugin="ping")
    link = "/admin/execapp/eventtrace/?matcher=ping.ping&amp;outcome=failed"
    assert link in client.get("/admin/execapp/execprofilerecord/").content.decode()
    assert link in client.get(f"/admin/execapp/execprofilerecord/{record.pk}/change/").content.decode()
    plugin = Plugin.objects.create(name="ping", runtime="lua", source="function ping(e) return 'pong' end")
    Binding.objects.create(plugin=plugin, pattern="ping", handler="ping")
    page = client.get(f"/admin/plugins/plugin/{plugin.pk}/change/").content.decode()
    assert "/admin/execapp/eventtrace/?plugin=ping&amp;outcome=failed" in page


@pytest.mark.parametrize("backend", ["local", pytest.param("redis", marks=pytest.mark.redis)])
def test_any_of_the_last_100000_events_is_found_by_id(settings: Any, request: pytest.FixtureRequest,
                                                      backend: str) -> None:
    """The Done-when line: with the default store size, the 100,000th newest event is found by id
    from the Events page; the one before it was trimmed (it ended ok: not in the database). In this
    process's store, and in Redis (every worker's events in one place)."""
    settings.EXECAPP = {}  # defaults: HISTORY_MAX_EVENTS 100,000
    settings.REDIS_URL = request.getfixturevalue("redis_url") if backend == "redis" else ""
    history_store.reset_local()
    store = history_store.store()
    assert store.name == backend
    now = time.time()
    n = 100_001
    handlers = (Handler("ping.ping", "ping", "sync", 0.0, None, 0.001, "ok", "", (("pong", None),)),)
    records = [Record(f"u{i}", f"ev-{i}", "tenant:a", None, "message", "/ping", 5, "w", now - n + i, "ok", "", (),
                      0.002, 1, 1, 0, None, handlers, False) for i in range(n)]
    try:
        for i in range(0, n, 5000):  # as the workers' flushes add them
            store.add(records[i:i + 5000])
        assert store.count() == 100_000
        client = staff("viewer", ["execapp.view_eventtrace"])
        started = time.perf_counter()
        page = client.get(EVENTS + "?q=ev-1")
        elapsed = time.perf_counter() - started
        assert [r["id"] for r in page.context["rows"]] == ["ev-1"]
        assert client.get(EVENTS + "?q=ev-0").context["rows"] == []
        assert history.get("tenant:a", "ev-1")["id"] == "ev-1"  # type: ignore[index]
        print(f"search by id through 100,000 recent events ({backend}): {elapsed * 1000:.0f} ms")
    finally:
        if backend == "redis":
            keys = list(store.client.scan_iter(store.prefix + "*", count=10_000))  # type: ignore[attr-defined]
            for i in range(0, len(keys), 10_000):
                store.client.delete(*keys[i:i + 10_000])  # type: ignore[attr-defined]
        history_store.reset_local()


def test_while_redis_is_down_the_page_finds_failures_in_the_database_and_says_so(settings: Any) -> None:
    """The recent store unreachable (Redis restarting): the Events page and a trace's page still
    answer from the database, and the list says the recent events are missing."""
    from .test_history import _old_failure

    async_to_sync(_old_failure)("failed-yesterday", days_ago=1)
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1: connection refused
    client = staff("viewer", ["execapp.view_eventtrace"])
    page = client.get(EVENTS + "?q=failed-yesterday")
    assert page.status_code == 200
    assert [r["id"] for r in page.context["rows"]] == ["failed-yesterday"]
    assert any("cannot be read now" in p for p in page.context["problems"]), page.context["problems"]
    assert "cannot be read now" in page.content.decode()
    detail = client.get(page.context["rows"][0]["url"])
    assert detail.status_code == 200 and "boom (old)" in detail.content.decode()
    settings.REDIS_URL = ""
    assert client.get(EVENTS).context["problems"] == []


def test_searches_past_the_cap_are_refused_at_once_and_served_again_after(settings: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each search reads up to every trace of the recent store (~0.5 s of CPU for 100,000, on the
    request's thread, sharing the GIL with the event loop): before, every concurrent load of the
    page was another such thread (8 at once delayed the loop ~170 ms). Past HISTORY_MAX_SEARCHES
    the page answers 503 at once, naming the setting; a search that ends frees its place."""
    import threading

    settings.EXECAPP = {"HISTORY_MAX_SEARCHES": 2}
    settings.REDIS_URL = ""
    history_store.reset_local()
    entered, release = threading.Semaphore(0), threading.Event()
    real_search = history.search

    def slow_search(*args: Any, **kwargs: Any) -> Any:
        entered.release()
        release.wait(30)
        return real_search(*args, **kwargs)

    monkeypatch.setattr(history, "search", slow_search)
    client = staff("viewer", ["execapp.view_eventtrace"])
    answers: list[int] = []
    running = [threading.Thread(target=lambda: answers.append(client.get(EVENTS + "?outcome=failed").status_code))
               for _ in range(2)]
    try:
        for t in running:
            t.start()
        assert entered.acquire(timeout=30) and entered.acquire(timeout=30)  # two searches hold their places
        busy = client.get(EVENTS + "?outcome=failed")
        assert busy.status_code == 503 and busy["Retry-After"] == "1"
        assert "runs 2 searches of the events already (EXECAPP['HISTORY_MAX_SEARCHES'])" in busy.content.decode()
        assert not entered.acquire(timeout=0.1)  # refused before searching
    finally:
        release.set()
        for t in running:
            t.join(30)
    assert answers == [200, 200]
    monkeypatch.setattr(history, "search", real_search)
    assert client.get(EVENTS).status_code == 200  # the places are free again


def test_the_events_page_and_the_dashboard_say_when_traces_were_evicted_over_the_byte_bound(settings: Any) -> None:
    """Traces evicted to keep the store within its bytes are missing from the Events page: it says
    how many and when, and so does the dashboard's data; before, they were simply not there."""
    from execapp.dashboard_data import collect

    from .test_history import _record

    settings.EXECAPP = {"HISTORY_LOCAL_MAX_BYTES": 200_000}
    history_store.reset_local()
    try:
        history_store.store().add([_record(n, message="x" * 10_000, outcome="error") for n in range(100)])
        page = staff("viewer", ["execapp.view_eventtrace"]).get(EVENTS)
        usage = page.context["usage"]
        assert usage["by_bytes"] > 0 and usage["bytes"] <= 200_000
        text = page.content.decode()
        assert f"{usage['by_bytes']} traces were evicted to keep it within its byte bound" in text
        assert "HISTORY_LOCAL_MAX_BYTES" in text
        assert collect(refresh=False)["history"]["by_bytes"] == usage["by_bytes"]
    finally:
        history_store.reset_local()


def test_a_tab_reloading_the_events_page_in_a_loop_is_told_to_wait(settings: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each search reads the recent store (~0.5 s of CPU at 100,000 traces, beside the event loop):
    a tab reloading the page kept one running all the time. Past a burst of SEARCH_BURST a user
    gets 429 with Retry-After at HISTORY_SEARCHES_PER_MINUTE; another user is still served."""
    from execapp import history_admin
    from execapp.user_rate import UserRate

    monkeypatch.setattr(history_admin, "_search_rate", UserRate(clock=lambda: 500.0))  # time stands still
    settings.EXECAPP = {"HISTORY_SEARCHES_PER_MINUTE": 6.0}
    viewer = staff("looper", ["execapp.view_eventtrace"])
    statuses = [viewer.get(EVENTS).status_code for _ in range(int(history_admin.SEARCH_BURST) + 3)]
    assert statuses == [200] * int(history_admin.SEARCH_BURST) + [429] * 3
    refused = viewer.get(EVENTS)
    assert refused["Retry-After"] == "10" and "HISTORY_SEARCHES_PER_MINUTE" in refused.content.decode()
    assert staff("other", ["execapp.view_eventtrace"]).get(EVENTS).status_code == 200
