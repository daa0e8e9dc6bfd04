"""URL routes: the admin (with the execapp dashboard) and Prometheus metrics."""
from django.contrib import admin
from django.urls import path
from django.views.generic import RedirectView

from execapp.metrics_view import metrics_view

urlpatterns = [
    # "/" (the admin's "View site" link, and where a new user looks first) is the admin.
    path("", RedirectView.as_view(pattern_name="admin:index", permanent=False), name="home"),
    path("admin/", admin.site.urls),
    # django-prometheus's exporter, wrapped: only for allowed clients (execapp/metrics_access.py),
    # refreshes this process's app metrics and shares the multiprocess compaction lock
    # (execapp/metrics_view.py). django_prometheus.urls is not included: its unguarded exporter
    # would be a second way in.
    path("metrics", metrics_view, name="metrics"),
]

# Readiness probe: 503 while this worker starts or drains, or its database/Redis is unreachable
# (docs/operations.md).
from execapp.health import healthz  # noqa: E402

urlpatterns.append(path("healthz", healthz, name="healthz"))

# Django's 400 page, saying which limit a form over Django's own hit (execapp/bad_request.py).
handler400 = "execapp.bad_request.bad_request"
