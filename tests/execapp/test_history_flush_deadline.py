"""The housekeeper's event-history flush on a Redis that does not answer (our own redis-server,
SIGSTOPped): all of one flush's Redis calls end within HISTORY_FLUSH_DEADLINE_SECONDS, so the
housekeeper's other services are not held for the socket timeouts and retries; that flush's
traces are counted lost, as with Redis down."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from execapp import history
from execapp.engine import Event
from execapp.engine.profile import ExecClass
from execapp.history_store import RedisStore

from .test_history import _direct_recorder, _one_run
from .test_resilience import RedisServer, redis_server, stopped_redis  # noqa: F401

FLUSH_DEADLINE = 0.3


@pytest.mark.redis
def test_a_flush_on_a_paused_redis_holds_the_housekeeper_no_longer_than_its_deadline(
        stopped_redis: RedisServer, settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.EXECAPP = {"HISTORY_FLUSH_DEADLINE_SECONDS": FLUSH_DEADLINE}
    rec = _direct_recorder(monkeypatch)
    rec.store = RedisStore(stopped_redis.url, 100, 1 << 20)
    try:
        _one_run(SimpleNamespace(owner="tenant:t"), Event(text="/ping", id="f1"), ExecClass.SYNC, ("pong", None))
        started = time.monotonic()
        rec.tick()
        took = time.monotonic() - started
        # Before: the store's socket timeout (5 s) and redis-py's retry of it.
        assert took < FLUSH_DEADLINE + 1.0, took
        assert rec.store_errors == 1  # the flush's traces are lost, counted, as with Redis down
    finally:
        rec.close()
        history.discard_buffer()
