"""URL routes: the admin (with the execapp dashboard) and Prometheus metrics."""
from django.contrib import admin
from django.urls import include, path

from execapp.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    # django-prometheus's exporter, wrapped: refreshes this process's app metrics and shares the
    # multiprocess compaction lock (execapp/metrics.py); listed first so it wins over the include.
    path("metrics", metrics_view, name="metrics"),
    path("", include("django_prometheus.urls")),
]

# Readiness probe: 503 while this worker drains (docs/operations.md).
from execapp.health import healthz  # noqa: E402

urlpatterns.append(path("healthz", healthz, name="healthz"))
