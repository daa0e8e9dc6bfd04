"""The staff-only live pool dashboard inside the admin: the page and its JSON data endpoint.

It is the admin "changelist" of the ``Dashboard`` proxy model, so it lives at
``/admin/execapp/dashboard/`` (data at ``.../data/``), shows up in the admin index, and every
view goes through ``admin_site.admin_view`` (active staff only; others go to the admin login).
"""
from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse

from .dashboard_data import collect


def dashboard_data(request: HttpRequest) -> JsonResponse:
    """GET .../data/: every worker's snapshot, the total, chart history, matchers and plugin pools.

    It reads what the workers published and starts nothing: a worker of this process (if any)
    re-publishes first, so its own numbers are exact; the others' are at most SNAPSHOT_SECONDS old."""
    return JsonResponse(collect(refresh=True))


class DashboardAdmin(admin.ModelAdmin):
    """Admin entry of the dashboard: read-only, visible to every active staff member."""

    def has_module_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list:
        data = self.admin_site.admin_view(self._data_view)
        return [path("data/", data, name="execapp_dashboard_data")] + super().get_urls()

    def _data_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            return JsonResponse({"error": "staff only"}, status=403)
        return dashboard_data(request)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """The dashboard page (the JavaScript polls the data endpoint)."""
        if not self.has_view_permission(request):
            return HttpResponse("staff only", status=403)
        context = {
            **self.admin_site.each_context(request),
            "title": "Live pool dashboard",
            "opts": self.model._meta,
            "data_url": reverse("admin:execapp_dashboard_data", current_app=self.admin_site.name),
            "profiles_url": reverse("admin:execapp_execprofilerecord_changelist", current_app=self.admin_site.name),
            # The Events page (execapp/history_admin.py): "last error" links to its trace there.
            "events_url": reverse("admin:execapp_eventtrace_changelist", current_app=self.admin_site.name),
            **(extra_context or {}),
        }
        return TemplateResponse(request, "execapp/dashboard.html", context)
