"""Django admin registrations of execapp."""
from __future__ import annotations

import secrets
from typing import Any

from django.contrib import admin
from django.contrib.auth.models import Group, User
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.utils.html import format_html

from .admin_filters import BoundedValuesFilter
from .admin_query import BoundedQueryAdmin, bounded
from .auth_watch import revoked_connections_note
from .models import ApiToken, hash_token

#: The request attribute holding a token created by this request (shown by response_add, then gone).
_NEW_TOKEN = "_execapp_new_token"


@admin.register(ApiToken)
class ApiTokenAdmin(BoundedQueryAdmin):
    """API tokens for WebSocket clients: the raw token is shown once, when it is created."""

    list_display = ("name", "tenant", "prefix", "created_at", "last_used_at", "revoked_at", "active")
    list_filter = (("revoked_at", admin.EmptyFieldListFilter), ("tenant", BoundedValuesFilter))
    search_fields = ("name", "tenant", "prefix")
    readonly_fields = ("prefix", "created_at", "last_used_at", "revoked_at")
    actions = ("revoke_tokens",)

    @admin.display(boolean=True, description="active")
    def active(self, obj: ApiToken) -> bool:
        return obj.revoked_at is None

    def get_readonly_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> Any:
        # The name is fixed once issued: clients and logs know a token by it.
        return self.readonly_fields + (("name",) if obj is not None else ())

    def save_model(self, request: HttpRequest, obj: ApiToken, form: Any, change: bool) -> None:
        if change:
            return super().save_model(request, obj, form, change)
        raw = secrets.token_urlsafe(32)  # same format as ApiToken.issue
        obj.token_hash, obj.prefix = hash_token(raw), raw[:8]
        super().save_model(request, obj, form, change)
        # Shown by response_add in this very response, never as a message: Django's message
        # storage carried it to the next page in the `messages` cookie (readable in the browser's
        # cookie store and by anything that logs cookies) or in the session's database row.
        setattr(request, _NEW_TOKEN, raw)

    def response_add(self, request: HttpRequest, obj: ApiToken, post_url_continue: str | None = None) -> HttpResponse:
        """The new token's raw value, once, on a page no cache keeps (instead of a redirect)."""
        raw = getattr(request, _NEW_TOKEN, None)
        if raw is None:
            return super().response_add(request, obj, post_url_continue)
        context = {**self.admin_site.each_context(request), "title": f"Token for {obj.name!r}",
                   "opts": self.model._meta, "token": obj, "raw": raw,
                   "list_url": reverse("admin:execapp_apitoken_changelist", current_app=self.admin_site.name),
                   "add_url": reverse("admin:execapp_apitoken_add", current_app=self.admin_site.name)}
        response = TemplateResponse(request, "execapp/token_created.html", context)
        add_never_cache_headers(response)  # admin_view does too; this page must not depend on it
        return response

    # Revoking is a change: hidden from (and refused to) a user without change_apitoken.
    @admin.action(description="Revoke selected tokens", permissions=["change"])
    def revoke_tokens(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        count = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {count} token(s); {revoked_connections_note()}")


# -- Observability: persisted execution profiles and the live pool dashboard ---------------------

from .dashboard import EVENTS_PERMISSION, HIDDEN_NOTE, DashboardAdmin  # noqa: E402
from .history_admin import EventTraceAdmin, events_url  # noqa: E402
from .models import Dashboard, EventTrace, ExecProfileRecord  # noqa: E402


@admin.register(ExecProfileRecord)
class ExecProfileRecordAdmin(BoundedQueryAdmin):
    """Persisted execution profiles, merged from every worker's flushes: read-only; delete to relearn."""

    list_display = ("matcher", "plugin", "state", "p50_ms", "p99_ms", "runs", "errors", "timeouts", "promotions",
                    "demotions", "promoted_at", "demoted_at", "updated_at", "failures_link")
    list_filter = ("state", ("plugin", BoundedValuesFilter))
    search_fields = ("matcher", "plugin", "last_error")
    readonly_fields = ["failures_link", *(f.name for f in ExecProfileRecord._meta.fields)]

    @admin.display(description="recent failures")
    def failures_link(self, obj: ExecProfileRecord) -> str:
        return format_html('<a href="{}">events</a>', events_url(matcher=obj.matcher, outcome="failed"))

    # last_error is a plugin's text about a client's event (a tenant's data): like the Events page
    # and the dashboard, shown and searched only with the Events permission.
    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        fields = list(super().get_readonly_fields(request, obj))
        if request.user.has_perm(EVENTS_PERMISSION):
            return fields
        return ["last_error_hidden" if f == "last_error" else f for f in fields]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        fields = super().get_fields(request, obj)
        return fields if request.user.has_perm(EVENTS_PERMISSION) else [f for f in fields if f != "last_error"]

    def get_search_fields(self, request: HttpRequest) -> Any:
        fields = super().get_search_fields(request)
        return fields if request.user.has_perm(EVENTS_PERMISSION) else [f for f in fields if f != "last_error"]

    @admin.display(description="last error")
    def last_error_hidden(self, obj: ExecProfileRecord) -> str:
        return f"({HIDDEN_NOTE})" if obj.last_error else "-"

    @admin.display(description="p50 (ms)", ordering="p50_seconds")
    def p50_ms(self, obj: ExecProfileRecord) -> str:
        return "-" if obj.p50_seconds is None else f"{obj.p50_seconds * 1000:.2f}"

    @admin.display(description="p99 (ms)", ordering="p99_seconds")
    def p99_ms(self, obj: ExecProfileRecord) -> str:
        return "-" if obj.p99_seconds is None else f"{obj.p99_seconds * 1000:.2f}"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # rows come from workers' flushes

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


admin.site.register(Dashboard, DashboardAdmin)
admin.site.register(EventTrace, EventTraceAdmin)

# Django's own admins of users and groups search as ours do: bounded (execapp/admin_query.py).
for _model, _model_admin in [(m, a) for m, a in admin.site._registry.items() if m in (User, Group)]:
    admin.site.unregister(_model)
    admin.site.register(_model, bounded(type(_model_admin)))
