"""Admin: plugins with their limits and inline bindings, code upload/edit, enable/disable."""
from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db import transaction

from .forms import BindingFormSet, PluginForm
from .models import QUOTA_FIELDS, Binding, KVEntry, Plugin, RegistryState


class BindingInline(admin.TabularInline):
    model = Binding
    formset = BindingFormSet
    extra = 1
    fields = ["kind", "pattern", "handler", "priority", "block", "enabled"]


@admin.register(Plugin)
class PluginAdmin(admin.ModelAdmin):
    form = PluginForm
    inlines = [BindingInline]
    list_display = ["name", "runtime", "enabled", "version", "strategy_shown", "timeout_ms", "memory_mb",
                    "max_concurrency", "binding_count", "updated_at"]
    list_filter = ["runtime", "enabled", "strategy"]
    search_fields = ["name", "description"]
    readonly_fields = ["version", "module_size", "kv_stored", "created_at", "updated_at"]
    actions = ["enable_plugins", "disable_plugins"]
    fieldsets = [
        (None, {"fields": ["name", "description", "runtime", "enabled", "version"]}),
        ("Code", {"fields": ["source", "upload", "module_size"],
                  "description": "Edit the source, or upload a file (.lua, .js, .wat, or a .wasm binary). "
                                 "Saving validates it in the sandbox."}),
        ("Permissions", {"fields": ["permissions", "http_allowlist"]}),
        ("Limits and instances", {"fields": ["timeout_ms", "memory_mb", "max_concurrency", "strategy", "pool_size",
                                             "shard_count"]}),
        ("Host quotas", {"fields": [*QUOTA_FIELDS, "kv_stored"],
                         "description": "A KV or HTTP quota ends the call with its code (quota_kv, "
                                        "quota_kv_writes, quota_http); log lines past a log quota are dropped "
                                        "and counted in one summary line. 0 allows none; empty: the default."}),
        ("History", {"fields": ["created_at", "updated_at"]}),
    ]

    def get_queryset(self, request: Any) -> Any:
        return super().get_queryset(request).prefetch_related("bindings")

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
        from .kv import kv_store
        try:
            keys, total = kv_store().usage(obj.name)
        except Exception as exc:  # the admin page must open even when Redis is down
            return f"unavailable ({type(exc).__name__}: {exc})"
        return f"{keys} keys, {total} bytes"

    @admin.display(description="WASM module")
    def module_size(self, obj: Plugin) -> str:
        return f"{len(obj.module)} bytes" if obj.module else "-"

    def save_model(self, request: Any, obj: Plugin, form: Any, change: bool) -> None:
        # The binding formset already checked the new bindings against this code.
        obj.save(check_bindings=False)

    def _set_enabled(self, request: Any, queryset: Any, enabled: bool) -> None:
        with transaction.atomic():
            count = queryset.update(enabled=enabled)
            RegistryState.bump()
            from .sync import refresh_tracked_engines
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
class KVEntryAdmin(admin.ModelAdmin):
    list_display = ["plugin", "key", "value", "updated_at"]
    list_filter = ["plugin"]
    search_fields = ["plugin", "key"]
