"""Admin: plugins with their limits and inline bindings, code upload/edit, enable/disable."""
from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.html import format_html

from execapp.admin_filters import BoundedValuesFilter
from execapp.admin_query import BoundedQueryAdmin
from execapp.history_admin import events_url

from .forms import BindingFormSet, PluginForm
from .kv import kv_store
from .models import (
    EVERY_MESSAGE,
    QUOTA_FIELDS,
    Binding,
    KVEntry,
    Plugin,
    RegistryState,
    code_bytes,
    code_total_limit,
    registry_limits,
)
from .runtimes import registry
from .sync import refresh_tracked_engines


def runtime_label(name: str) -> str:
    """A runtime's label from the registry (its bare name if it is no longer registered)."""
    runtime = registry.get(name)
    return runtime.label if runtime is not None else f"{name} (not registered)"


class RuntimeFilter(admin.SimpleListFilter):
    """The runtimes the stored plugins use, by their registry labels (the field has no choices)."""

    title = "runtime"
    parameter_name = "runtime"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        used = Plugin.objects.order_by("runtime").values_list("runtime", flat=True).distinct()
        return [(name, runtime_label(name)) for name in used]

    def queryset(self, request: Any, queryset: Any) -> Any:
        return queryset.filter(runtime=self.value()) if self.value() else queryset


class BindingInline(admin.TabularInline):
    model = Binding
    formset = BindingFormSet
    extra = 1
    fields = ["kind", "pattern", "handler", "priority", "block", "enabled"]


@admin.register(Plugin)
class PluginAdmin(BoundedQueryAdmin):
    form = PluginForm
    inlines = [BindingInline]
    list_display = ["name", "runtime_shown", "enabled", "version", "strategy_shown", "timeout_ms", "memory_mb",
                    "max_concurrency", "binding_count", "updated_at", "failures_link"]
    list_filter = [RuntimeFilter, "enabled", "strategy"]
    search_fields = ["name", "description"]
    readonly_fields = ["version", "module_size", "kv_stored", "created_at", "updated_at", "failures_link"]
    actions = ["enable_plugins", "disable_plugins"]
    fieldsets = [
        (None, {"fields": ["name", "description", "runtime", "enabled", "version", "loaded_at"]}),
        ("Code", {"fields": ["source", "upload", "module_size"],
                  "description": "Edit the source, or upload a file (a runtime's source text, or its binary, "
                                 "e.g. .wasm). Saving validates it in the sandbox."}),
        ("Permissions", {"fields": ["permissions", "http_allowlist"]}),
        ("Limits and instances", {"fields": ["timeout_ms", "memory_mb", "max_concurrency", "strategy", "pool_size",
                                             "shard_count"]}),
        ("Host quotas", {"fields": [*QUOTA_FIELDS, "kv_stored"],
                         "description": "A KV or HTTP quota ends the call with its code (quota_kv, "
                                        "quota_kv_writes, quota_http); log lines past a log quota are dropped "
                                        "and counted in one summary line. 0 allows none; empty: the default."}),
        ("History", {"fields": ["created_at", "updated_at", "failures_link"]}),
    ]

    def get_queryset(self, request: Any) -> Any:
        return super().get_queryset(request).prefetch_related("bindings")

    @admin.display(description="runtime", ordering="runtime")
    def runtime_shown(self, obj: Plugin) -> str:
        return runtime_label(obj.runtime)

    @admin.display(description="strategy")
    def strategy_shown(self, obj: Plugin) -> str:
        return obj.effective_strategy + ("" if obj.strategy else " (default)")

    @admin.display(description="bindings")
    def binding_count(self, obj: Plugin) -> int:
        return len(obj.bindings.all())

    @admin.display(description="KV stored now")
    def kv_stored(self, obj: Plugin) -> str:
        if not obj.pk:
            return "-"
        try:
            keys, total = kv_store().usage(obj.name)
        except Exception as exc:  # the admin page must open even when Redis is down
            return f"unavailable ({type(exc).__name__}: {exc})"
        return f"{keys} keys, {total} bytes"

    @admin.display(description="recent failures")
    def failures_link(self, obj: Plugin) -> str:
        # The Events page (execapp/history_admin.py), filtered to this plugin's failed events.
        return format_html('<a href="{}">events</a>', events_url(plugin=obj.name, outcome="failed")) if obj.pk else "-"

    @admin.display(description="binary module")
    def module_size(self, obj: Plugin) -> str:
        return f"{len(obj.module)} bytes" if obj.module else "-"

    def save_model(self, request: Any, obj: Plugin, form: Any, change: bool) -> None:
        # The binding formset already checked the new bindings against this code.
        obj.save(check_bindings=False)

    def _set_enabled(self, request: Any, queryset: Any, enabled: bool) -> None:
        if enabled:
            most_plugins, most_regex = registry_limits()
            plugins = Plugin.objects.filter(enabled=True).count() + queryset.filter(enabled=False).count()
            regexes = Binding.objects.filter(EVERY_MESSAGE).filter(
                Q(plugin__enabled=True) | Q(plugin__in=queryset)).count()
            code = code_bytes(Plugin.objects.filter(Q(enabled=True) | Q(pk__in=queryset)))
            if plugins > most_plugins or regexes > most_regex or code > code_total_limit():
                self.message_user(request, f"Nothing enabled: {plugins} plugins with {regexes} regex bindings and "
                                  f"{code} bytes of code would be enabled; at most {most_plugins}, {most_regex} and "
                                  f"{code_total_limit()} may be (EXECAPP['MAX_PLUGINS'], ['MAX_REGEX_BINDINGS'], "
                                  "['MAX_TOTAL_CODE_BYTES']). Select fewer, or disable others first.", messages.ERROR)
                return
        with transaction.atomic():
            # updated_at too (update() skips auto_now): a page opened before this is refused, not
            # allowed to switch the plugin back unseen.
            count = queryset.update(enabled=enabled, updated_at=timezone.now())
            RegistryState.bump()
            transaction.on_commit(refresh_tracked_engines)
        self.message_user(request, f"{count} plugin(s) {'enabled' if enabled else 'disabled'}.", messages.SUCCESS)

    # allowed_permissions: Django hides the action from a user without change_plugin and answers
    # "No action selected" to a forged POST naming it (tests/execapp/test_admin_permissions.py).
    @admin.action(description="Enable selected plugins", permissions=["change"])
    def enable_plugins(self, request: Any, queryset: Any) -> None:
        self._set_enabled(request, queryset, True)

    @admin.action(description="Disable selected plugins", permissions=["change"])
    def disable_plugins(self, request: Any, queryset: Any) -> None:
        self._set_enabled(request, queryset, False)


@admin.register(KVEntry)
class KVEntryAdmin(BoundedQueryAdmin):
    list_display = ["plugin", "key", "value", "updated_at"]
    list_filter = [("plugin", BoundedValuesFilter)]
    search_fields = ["plugin", "key"]
