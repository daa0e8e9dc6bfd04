"""The worker's background services (execapp/worker.py): one that runs long cannot hold the others."""
from __future__ import annotations

import threading
from typing import Any

import pytest

from execapp import worker as worker_module
from plugins import sync
from tests.conftest import wait_until

_release = threading.Event()
_steady_ticks: list[float] = []


class _Stuck:
    """A service whose tick runs until released, as a plugin's top level can for a minute."""

    own_thread = True
    interval = 0.05

    def __init__(self, worker: Any) -> None:
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        _release.wait(30)

    def close(self) -> None:
        pass


class _Steady:
    """A service that counts its ticks (the metrics, the snapshots, the history)."""

    interval = 0.05

    def __init__(self, worker: Any) -> None:
        pass

    def tick(self) -> None:
        _steady_ticks.append(1.0)

    def close(self) -> None:
        pass


def stuck_service(worker: Any) -> _Stuck:
    return _Stuck(worker)


def steady_service(worker: Any) -> _Steady:
    return _Steady(worker)


def test_a_service_on_its_own_thread_does_not_hold_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    # The registry sync compiled plugins and ran their top levels on the thread every service
    # ticks on: a slow one held the metrics, snapshots, history and quarantine list meanwhile.
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", [f"{__name__}.stuck_service",
                                                              f"{__name__}.steady_service"])
    _release.clear()
    _steady_ticks.clear()
    worker = worker_module.Worker("services")
    worker.start()
    try:
        stuck = worker.services[0]
        assert wait_until(lambda: getattr(stuck, "ticks", 0) == 1, 5)
        assert wait_until(lambda: len(_steady_ticks) >= 10, 10), "the steady service stopped ticking"
        assert not worker.ready.is_set()  # ready once every service ticked once: the stuck one has not
        _release.set()
        assert wait_until(worker.ready.is_set, 5)
    finally:
        _release.set()
        worker.stop(timeout=5)


def test_the_registry_sync_runs_on_its_own_thread() -> None:
    assert sync.RegistrySync.own_thread is True


def test_the_profile_store_runs_on_its_own_thread() -> None:
    # Its flush waits for the database: a 20 s lock on execapp_execprofilerecord held the shared
    # thread, and the worker's dashboard snapshot went 17 s stale (its gauges frozen).
    from execapp.persistence import ProfileStore

    assert ProfileStore.own_thread is True


def test_an_undrain_cannot_reopen_a_worker_that_is_shutting_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """`manage.py undrain` during a SIGTERM's drain set the stopping worker admitting events again:
    /healthz said ok to the load balancer, and events accepted then could outlast the grace (their
    `done` lost when the process exits). A stopping worker now refuses the undrain, with a reason."""
    from execapp.drain import drain_worker, undrain_worker

    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", [])
    w = worker_module.Worker("stopping-test")
    w.start()
    try:
        drain_worker(w, 1.0, flush=False)  # an operator's drain: undrain reopens it
        assert undrain_worker(w)["ok"] and not w.draining and w.begin_event()
        w.end_event()
        w.begin_stop()  # what ExecServer.shutdown does on SIGTERM
        answer = undrain_worker(w)
        assert answer["ok"] is False and answer["error"].startswith("stopping:")
        assert w.draining and not w.begin_event(), "a stopping worker admits no event"
        assert w.set_draining(False) is False and w.draining
    finally:
        w.stop(timeout=5)
