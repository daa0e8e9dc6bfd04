"""Kubernetes' probes and Prometheus' pod discovery ask by IP address: /healthz answers whatever
the Host, /metrics too when a token guards it; everything else keeps Django's Host check."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

POD = "10.1.2.3:8000"  # the Host header of a request made to the pod's address
TOKEN = "metrics-token-of-the-probe-test"


@pytest.fixture
def quiet_worker(monkeypatch: pytest.MonkeyPatch, install_worker: Any) -> Iterator[Any]:
    """A Worker without services installed as this process's worker: /healthz would otherwise start
    the process's own (with its metrics updater), which outlives the test."""
    from execapp import worker as worker_module

    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", [])
    worker = install_worker(worker_module.Worker("probe-test"))
    worker.start()
    yield worker
    worker.stop(timeout=5)

pytestmark = pytest.mark.usefixtures("quiet_worker")


@pytest.fixture
def public(settings: Any) -> Any:
    settings.ALLOWED_HOSTS = ["exec.example.com"]
    settings.EXECAPP = {"METRICS_ALLOWED_NETWORKS": ["127.0.0.0/8"]}
    return settings


def test_healthz_answers_a_probe_by_address(client: Any, public: Any) -> None:
    # Before: 400 Bad Request (DisallowedHost), so the probe failed and the pod never became ready.
    assert client.get("/healthz", HTTP_HOST=POD).status_code in (200, 503)
    assert client.get("/healthz", HTTP_HOST="exec.example.com").status_code in (200, 503)
    assert client.get("/admin/login/", HTTP_HOST=POD).status_code == 400  # the rest keeps the check


def test_metrics_by_address_only_with_a_token(client: Any, public: Any) -> None:
    # Without a token the Host check stays: it is what keeps a DNS-rebound browser page from reading it.
    assert client.get("/metrics", HTTP_HOST=POD).status_code == 400
    public.EXECAPP = {**public.EXECAPP, "METRICS_TOKEN": TOKEN}
    assert client.get("/metrics", HTTP_HOST=POD, HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    assert client.get("/metrics", HTTP_HOST=POD).status_code == 403  # and the token is still required


def test_a_wildcard_subdomain_pattern_is_used_as_its_domain(client: Any, settings: Any) -> None:
    settings.ALLOWED_HOSTS = [".example.com"]
    assert client.get("/healthz", HTTP_HOST=POD).status_code in (200, 503)
