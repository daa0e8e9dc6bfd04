"""GET /metrics: the app's and django-prometheus's metrics behind the access check, up to date,
without the series of plugins and matchers that no longer serve."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import prometheus_client
from django.http import HttpRequest, HttpResponse
from prometheus_client import multiprocess

from .metrics_access import refusal
from .metrics_live import live_filter
from .metrics_multiprocess import dir_lock, multiprocess_dir, prune_dead_gauges
from .metrics_updater import refresh_local


def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics: after refreshing this process's metrics and, in multiprocess mode, while
    holding the compaction lock shared. Only for the clients that execapp.metrics_access admits
    (allowed networks, bearer token); 403 with what to set otherwise. Series labelled with a
    plugin or matcher this worker no longer serves (disabled or deleted: multiprocess mode cannot
    unregister them) are left out."""
    refused = refusal(request)
    if refused is not None:  # before any work: a refused client costs no refresh and no file read
        return HttpResponse(refused, status=403, content_type="text/plain; charset=utf-8")
    refresh_local()
    path = multiprocess_dir()
    if not path:
        return _export(prometheus_client.REGISTRY)
    prune_dead_gauges(path)
    with dir_lock(path, exclusive=False):
        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=path)
        return _export(registry)


def _export(registry: Any) -> HttpResponse:
    keep = live_filter()
    source = registry if keep is None else _Filtered(registry, keep)
    return HttpResponse(prometheus_client.generate_latest(source), content_type=prometheus_client.CONTENT_TYPE_LATEST)


class _Filtered:
    """A registry view whose families leave out the samples ``keep`` refuses."""

    def __init__(self, registry: Any, keep: Callable[[dict[str, str]], bool]) -> None:
        self.registry = registry
        self.keep = keep

    def collect(self) -> Iterator[Any]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if self.keep(s.labels)]
            yield family


__all__ = ["metrics_view", "live_filter"]
