"""One deadline for all the Redis calls of a request (execapp/redis_deadline.py): on a Redis that
accepts connections but does not answer (our own redis-server, SIGSTOPped) the dashboard's data and
the Events page answer degraded at the deadline, and are whole again the moment Redis answers."""
from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from execapp.redis_deadline import RedisDeadline, deadline_client, redis_deadline

from .test_admin_permissions import staff
from .test_resilience import RedisServer, redis_server, stopped_redis  # noqa: F401

DATA = "/admin/execapp/dashboard/data/"
EVENTS = "/admin/execapp/eventtrace/"
#: Far below the clients' socket timeouts (2 s, 5 s), each of which redis-py retries.
DEADLINE = 0.4


@pytest.mark.redis
def test_every_call_of_a_block_shares_one_deadline_and_redis_is_back_at_once(stopped_redis: RedisServer) -> None:
    client = deadline_client(stopped_redis.url, socket_timeout=2, socket_connect_timeout=2)
    started = time.monotonic()
    failures = []
    with redis_deadline(DEADLINE):
        for call in (lambda: client.get("a"), lambda: client.hgetall("b"),
                     lambda: client.pipeline(transaction=False).get("a").llen("c").execute()):
            with pytest.raises(RedisDeadline) as caught:
                call()
            failures.append(caught.value)
    # The first call took the deadline, the others failed at once (each alone: 2 s, retried).
    assert time.monotonic() - started < 3 * DEADLINE + 0.6
    assert {f.code for f in failures} == {"redis_unavailable"}
    assert "REDIS_REQUEST_DEADLINE_SECONDS" in str(failures[0]) and str(stopped_redis.port) in str(failures[0])
    assert isinstance(failures[0], ConnectionError)  # what callers of an unreachable Redis handle
    assert stopped_redis.proc is not None
    stopped_redis.proc.send_signal(signal.SIGCONT)
    with redis_deadline(DEADLINE):  # no circuit: the next request finds Redis answering
        assert client.ping() is True
    assert client.set("k", "v") and client.get("k") == b"v"  # outside a deadline: a plain client again


@pytest.mark.redis
def test_dashboard_data_and_events_page_answer_degraded_at_the_deadline(stopped_redis: RedisServer, settings: Any,
                                                                        db: None) -> None:
    settings.REDIS_URL = stopped_redis.url
    settings.EXECAPP = {"REDIS_REQUEST_DEADLINE_SECONDS": DEADLINE}
    viewer = staff("viewer", ["execapp.view_eventtrace"])

    started = time.monotonic()
    response = viewer.get(DATA)
    assert time.monotonic() - started < DEADLINE + 1.5  # before: 9-10 s (each call its socket timeout, retried)
    data = response.json()
    assert response.status_code == 200 and data["unavailable"] == "redis_unavailable", data
    assert data["warning"].startswith("redis_unavailable:") and data["history"] is None

    started = time.monotonic()
    page = viewer.get(EVENTS)
    assert time.monotonic() - started < DEADLINE + 1.5
    assert page.status_code == 200
    assert any(p.startswith("redis_unavailable:") for p in page.context["problems"]), page.context["problems"]
    started = time.monotonic()
    assert viewer.get(f"{EVENTS}nosuchuid/change/").status_code == 404  # the database answered after the store
    assert time.monotonic() - started < DEADLINE + 1.5

    assert stopped_redis.proc is not None
    stopped_redis.proc.send_signal(signal.SIGCONT)  # Redis answers again: the next request is whole
    data = viewer.get(DATA).json()
    assert data["unavailable"] == "" and data["warning"] == "" and data["history"] is not None
    assert not viewer.get(EVENTS).context["problems"]


def test_a_request_waits_for_its_worker_s_own_publish_only_briefly() -> None:
    # The housekeeper publishes its snapshot every second, and on a Redis that does not answer its
    # publish waits for its calls' socket timeouts, retried: the dashboard's refresh waited for it,
    # and its fallback (the snapshots of this process's workers, built now) found the worker's
    # lock held all along and waited too.
    import threading
    import types

    from execapp import snapshots

    publisher = object.__new__(snapshots.SnapshotPublisher)
    publisher._lock, publisher._publishing = threading.Lock(), threading.Lock()
    publisher.worker = types.SimpleNamespace(id="held")
    publisher.snapshot = lambda advance: ({"worker": "held"}, None)  # type: ignore[method-assign]
    taken, done = threading.Event(), threading.Event()

    class Hung:  # the backend's publish: Redis does not answer (5 s at most here)
        def publish(self, snapshot: Any, point: Any) -> None:
            taken.set()
            done.wait(5.0)

    publisher.store = Hung()  # type: ignore[assignment]
    snapshots._publishers.add(publisher)
    holder = threading.Thread(target=publisher.publish)  # the housekeeper's tick
    holder.start()
    try:
        assert taken.wait(2.0)
        with redis_deadline(DEADLINE):
            snapshots.refresh_local()  # gives up after REFRESH_WAIT_SECONDS (logged), the request goes on
            assert holder.is_alive()  # it did not wait for the housekeeper's publish to end
            assert [s["worker"] for s, _ in snapshots.local_snapshots()] == ["held"]  # built now, shown
            assert holder.is_alive()
    finally:
        done.set()
        holder.join()
        snapshots._publishers.discard(publisher)
