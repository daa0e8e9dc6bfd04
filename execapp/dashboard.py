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

from . import dashboard_limit
from .dashboard_data import collect
from .redis_deadline import redis_deadline

#: The Events page's permission: event contents (failure messages, event ids) on the dashboard need it too.
EVENTS_PERMISSION = "execapp.view_eventtrace"
HIDDEN_NOTE = "the message needs the 'Can view event' permission (Events)"


def without_event_contents(data: dict[str, Any]) -> dict[str, Any]:
    """The dashboard data with each matcher's last failure reduced to its code, time and plugin.

    A failure's message is a plugin's text built from a client's event (a tenant's data) and the
    event id is the client's: the Events page shows them only with ``EVENTS_PERMISSION``, and
    every active staff member may open the dashboard."""
    for m in data.get("matchers", []):
        last = m.get("last_failure")
        code = (last or {}).get("code")
        m["last_error"] = f"{code or 'error'} ({HIDDEN_NOTE})" if m.get("last_error") or last else ""
        m["last_failure"] = {"ts": last.get("ts"), "code": code, "plugin": last.get("plugin")} if last else None
    return data


def dashboard_data(request: HttpRequest) -> JsonResponse:
    """GET .../data/: every worker's snapshot, the total, chart history, matchers and plugin pools.

    It reads what the workers published and starts nothing: a worker of this process (if any)
    re-publishes first, so its own numbers are exact; the others' are at most SNAPSHOT_SECONDS old.
    Event contents are left out for a user without the Events permission (without_event_contents)."""
    with redis_deadline():  # all its Redis calls together: a Redis that does not answer costs it this, once
        data = collect(refresh=True)
    if not request.user.has_perm(EVENTS_PERMISSION):
        data = without_event_contents(data)
    return JsonResponse(data)


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
        """The page and its data, nothing else: ModelAdmin's own change, history and delete views
        would show the proxied ExecProfileRecord rows (last errors included) to every staff member."""
        info = self.opts.app_label, self.opts.model_name
        return [path("data/", self.admin_site.admin_view(self._data_view), name="%s_%s_data" % info),
                path("", self.admin_site.admin_view(self.changelist_view), name="%s_%s_changelist" % info)]

    def _data_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            return JsonResponse({"error": "staff only"}, status=403)
        refused = dashboard_limit.refusal(f"user:{request.user.pk}")
        if refused is not None:  # a tab stuck in a loop, or too many at once: refused before the work
            status, message, retry_after = refused
            return JsonResponse({"error": message, "retry_after": retry_after}, status=status,
                                headers={"Retry-After": str(retry_after)})
        try:
            return dashboard_data(request)
        finally:
            dashboard_limit.running.release()

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
