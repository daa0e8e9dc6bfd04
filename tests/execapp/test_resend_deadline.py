"""One deadline for a resend event's bookkeeping (execapp/resend.py): on a slow Redis (our own
redis-server behind a proxy that holds every request ``DELAY`` seconds) each call answers within
its timeout, but the sequence of them (the history's flush, the trace read back, the search for
it, the ledger's done or release) used to add up; now together within RESEND_DEADLINE_SECONDS,
past it a ResendError resend_unavailable (the connection's done says ``"recorded": false``)."""
from __future__ import annotations

import socket
import threading
import time
from typing import Any, Iterator

import pytest

from execapp import history_store, resend
from execapp import worker as worker_module

from .test_resilience import RedisServer, redis_server  # noqa: F401

#: Each request to Redis waits this long (a slow Redis, a far one): its calls' own timeouts hold.
DELAY = 0.4
DEADLINE = 1.0


class SlowProxy:
    """127.0.0.1:<free port> -> ``port``, every chunk the client sends held ``delay`` seconds."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.closed = False
        self.delay = 0.0
        self._socks: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self._socks += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, held: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if held and self.delay:
                    time.sleep(self.delay)
                dst.sendall(chunk)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        for sock in self._socks:
            sock.close()


@pytest.fixture
def slow_redis(redis_server: RedisServer) -> Iterator[SlowProxy]:  # noqa: F811
    proxy = SlowProxy(redis_server.port)
    yield proxy
    proxy.close()


@pytest.fixture
def slow_recording_worker(slow_redis: SlowProxy, settings: Any, install_worker: Any, monkeypatch: pytest.MonkeyPatch,
                          db: None) -> Iterator[tuple[worker_module.Worker, SlowProxy]]:
    """The process's Worker with the history recorder, its store and the ledger on the slow Redis."""
    settings.REDIS_URL = slow_redis.url
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.EXECAPP = {"POOL_IDLE_SECONDS": 0.5, "HISTORY_MAX_EVENTS": 1000, "RESEND_DEADLINE_SECONDS": DEADLINE}
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", ["execapp.history.recorder"])
    worker = install_worker(worker_module.Worker("slow-resend"))
    worker.start()
    yield worker, slow_redis
    worker.stop(timeout=10)
    history_store.reset_local()


@pytest.mark.redis
def test_a_resend_s_record_on_a_slow_redis_ends_at_one_deadline(
        slow_recording_worker: tuple[worker_module.Worker, SlowProxy]) -> None:
    worker, proxy = slow_recording_worker[0].id, slow_recording_worker[1]
    claim, frames = resend.claim("tenant:slow", "order-7", worker)  # Redis answers at once: the event runs
    assert claim.state == resend.NEW and frames == []
    proxy.delay = DELAY  # then Redis slows down
    started = time.monotonic()
    with pytest.raises(resend.ResendError) as caught:
        # The flush, the trace read back and looked for, the done or the release: one round trip
        # each at least, each within its own timeout; all of them together over the deadline.
        resend.complete("tenant:slow", "order-7", worker, elapsed=0.001)
    took = time.monotonic() - started
    assert caught.value.code == "resend_unavailable", caught.value
    assert took < DEADLINE + DELAY + 0.5, took  # before: every round trip in turn (> 5 x DELAY)
    assert "RESEND_DEADLINE_SECONDS" in caught.value.message or "redis_unavailable" in caught.value.message or \
        "CircuitOpen" in caught.value.message, caught.value.message
    assert resend.renewer.running() == 0  # its lease is no longer renewed: it lapses if not released
