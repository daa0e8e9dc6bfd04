"""A slow or locked database never holds the event history's Redis flush (execapp/history.py), which
a resend event's done waits for (execapp/resend.py)."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from execapp.models import EventTrace

from .test_history import aget, recorded, recorder, send_all  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


async def test_a_flush_for_a_resend_does_not_wait_for_a_hung_failure_write(
        recorded: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # Measured on a 3-worker server: while execapp_eventtrace was locked (LOCK TABLE, as a
    # migration does), every resend event got its reply and no done (30 s, the client's patience):
    # the housekeeper's flush held the recorder's lock while it wrote failed traces to the
    # database, and a resend's done waits for a flush of that recorder.
    entered, release = threading.Event(), threading.Event()

    def hung_database(*args: Any, **kwargs: Any) -> list:  # the database: a lock nobody releases yet
        entered.set()
        release.wait(10)
        return []

    monkeypatch.setattr(EventTrace.objects, "bulk_create", hung_database)
    await send_all([{"type": "message", "id": "failed", "text": "/boom"}])
    housekeeper = threading.Thread(target=recorder().flush)
    housekeeper.start()
    try:
        assert await asyncio.to_thread(entered.wait, 5), "the failed trace's write never started"
        await send_all([{"type": "message", "id": "later", "text": "/quiet"}])
        started = time.monotonic()
        await asyncio.to_thread(recorder().flush, database=False)  # what a resend's done waits for
        assert time.monotonic() - started < 1.0, "the flush waited for the database"
        assert await aget("tenant:acme", "later") is not None
    finally:
        release.set()
        await asyncio.to_thread(housekeeper.join, 10)


async def test_the_housekeeper_s_tick_does_not_wait_for_a_hung_failure_write(
        recorded: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # The tick runs on the thread that also updates the metrics and publishes the dashboard
    # snapshots: with PostgreSQL stalled and events failing, the worker's snapshot went 11.6 s old
    # (stale, out of the dashboard's totals) while each write waited for its deadline.
    entered, release = threading.Event(), threading.Event()
    written: list[int] = []

    def hung_database(rows: list, *args: Any, **kwargs: Any) -> list:
        entered.set()
        release.wait(10)
        written.append(len(rows))
        return []

    monkeypatch.setattr(EventTrace.objects, "bulk_create", hung_database)
    await send_all([{"type": "message", "id": "failed", "text": "/boom"}])
    try:
        started = time.monotonic()
        await asyncio.to_thread(recorder().tick)
        assert await asyncio.to_thread(entered.wait, 5), "the failed trace's write never started"
        await send_all([{"type": "message", "id": "failed-2", "text": "/boom"}])
        await asyncio.to_thread(recorder().tick)  # while the first write hangs
        assert time.monotonic() - started < 2.0, "the tick waited for the database"
        assert await aget("tenant:acme", "failed-2") is not None  # its trace is in the store already
    finally:
        release.set()
    await asyncio.to_thread(recorder().tick)
    for _ in range(50):  # the second failure is written once the first write ends
        if sum(written) >= 2:
            break
        await asyncio.sleep(0.1)
    assert sum(written) == 2, written
