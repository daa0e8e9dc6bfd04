"""The housekeeper's dashboard snapshot publish on a Redis that does not answer (our own
redis-server, SIGSTOPped): all its Redis calls end within SNAPSHOT_PUBLISH_DEADLINE_SECONDS, not
retried past it, so the housekeeper's other services tick on time; the next publish after Redis
answers again goes through."""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import pytest

from execapp import snapshots
from execapp import worker as worker_module

from .test_resilience import RedisServer, redis_server, stopped_redis  # noqa: F401

PUBLISH_DEADLINE = 0.3
TICKER_INTERVAL = 0.1


class Ticker:
    """A housekeeping service that only notes when it ticked."""

    interval = TICKER_INTERVAL

    def __init__(self) -> None:
        self.ticks: list[float] = []

    def tick(self) -> None:
        self.ticks.append(time.monotonic())

    def close(self) -> None:
        pass


_tickers: list[Ticker] = []


def ticker(worker: Any) -> Ticker:
    """Service factory (SERVICE_FACTORIES, by this path)."""
    service = Ticker()
    _tickers.append(service)
    return service


@pytest.mark.redis
def test_a_publish_on_a_paused_redis_holds_the_housekeeper_no_longer_than_its_deadline(
        stopped_redis: RedisServer, settings: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    settings.REDIS_URL = stopped_redis.url
    settings.EXECAPP = {"SNAPSHOT_PUBLISH_DEADLINE_SECONDS": PUBLISH_DEADLINE, "SNAPSHOT_SECONDS": 0.2,
                        "POOL_MAX_WORKERS": 2, "POOL_QUEUE_SIZE": 2}
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", ["execapp.snapshots.snapshot_publisher",
                                                             f"{__name__}.ticker"])
    _tickers.clear()
    caplog.set_level(logging.WARNING, logger="execapp.snapshots")
    worker = worker_module.Worker("paused-redis")
    started = time.monotonic()
    worker.start()  # its first publish, on this thread, gives up at the deadline too
    try:
        assert time.monotonic() - started < PUBLISH_DEADLINE + 1.2  # before: its socket timeout (2.0 s)
        time.sleep(2.0)  # ~10 publishes, each waiting on Redis until its deadline
        ticks = _tickers[0].ticks
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        # Each round of the housekeeper waits at most one publish deadline for Redis.
        assert len(ticks) >= 3 and max(gaps) < PUBLISH_DEADLINE + 1.2, gaps  # before: 2.1 s
        failing = [r.getMessage() for r in caplog.records if "not published" in r.getMessage()]
        assert failing and "redis_unavailable" in failing[0], failing
        assert "SNAPSHOT_PUBLISH_DEADLINE_SECONDS" in failing[0]

        assert stopped_redis.proc is not None
        stopped_redis.proc.send_signal(signal.SIGCONT)  # Redis answers again: the next publish goes through
        store = snapshots.backend()
        assert isinstance(store, snapshots.RedisBackend)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not store.load():
            time.sleep(0.05)
        assert [s["worker"] for s, _ in store.load()] == ["paused-redis"]
    finally:
        worker.stop(timeout=5)


@pytest.mark.redis
def test_a_publish_within_a_request_keeps_the_request_s_deadline(redis_server: RedisServer,  # noqa: F811
                                                                 settings: Any) -> None:
    from execapp.redis_deadline import redis_deadline, remaining

    settings.REDIS_URL = redis_server.url
    seen: list[float | None] = []
    store = snapshots.backend()
    publisher = object.__new__(snapshots.SnapshotPublisher)
    publisher._lock, publisher._publishing = threading.Lock(), threading.Lock()
    publisher.snapshot = lambda advance: ({"worker": "w"}, None)  # type: ignore[method-assign]

    class Watched:
        def publish(self, snapshot: Any, point: Any) -> None:
            seen.append(remaining())
            store.publish(snapshot, point)

    publisher.store = Watched()  # type: ignore[assignment]
    with redis_deadline(7.0):
        publisher.publish(advance=False)
    publisher.publish(advance=False)  # outside one: its own
    assert seen[0] is not None and 6.0 < seen[0] <= 7.0
    assert seen[1] is not None and seen[1] <= 0.5  # SNAPSHOT_PUBLISH_DEADLINE_SECONDS (its default)
    assert remaining() is None
