"""Admin forms: plugin code upload/edit and binding validation inside the sandbox."""
from __future__ import annotations

import collections
from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.db import transaction
from django.forms.models import BaseInlineFormSet

from .errors import PluginInvalid
from .loaded import validate
from .models import (
    QUOTA_FIELDS,
    Plugin,
    check_binding_counts,
    check_fan_out,
    check_regex_total,
    duplicate_binding,
    fan_out_key,
    sees_every_message,
)
from .runtimes import registry
from .spec import PERMISSIONS

MAX_UPLOAD_BYTES = 4 << 20


class PluginForm(forms.ModelForm):
    """Plugin settings plus an optional file upload (a runtime's source text or binary): the
    runtime choices, upload kinds and help texts come from the runtime registry."""

    # Callable choices: read at every render, so a runtime registered later is offered too.
    runtime = forms.ChoiceField(choices=lambda: [("", "---------"), *registry.choices()])
    upload = forms.FileField(required=False)
    permissions = forms.MultipleChoiceField(choices=[(p, p) for p in PERMISSIONS], required=False,
                                            widget=forms.CheckboxSelectMultiple,
                                            help_text="Host API calls this plugin may make.")
    #: The plugin's updated_at when the page was opened: a save over a newer version is refused
    #: (two operators editing one plugin: the later save silently undid the earlier one).
    loaded_at = forms.CharField(widget=forms.HiddenInput, required=False)

    class Meta:
        model = Plugin
        fields = ["name", "description", "runtime", "enabled", "source", "upload", "permissions", "http_allowlist",
                  "timeout_ms", "memory_mb", "max_concurrency", "strategy", "pool_size", "shard_count",
                  *QUOTA_FIELDS]
        widgets = {"source": forms.Textarea(attrs={"rows": 20, "cols": 100, "style": "font-family: monospace"})}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk and self.instance.updated_at:
            self.initial["loaded_at"] = self.instance.updated_at.isoformat()
        # A quota left empty takes its default (and forms posted before quotas existed still save).
        for name in QUOTA_FIELDS:
            if name in self.fields:
                self.fields[name].required = False
        # Only the fields the user may edit are here: a view-only page (view_plugin) has none of
        # the model's (its KeyError was a 500 for every view-only operator opening a plugin).
        helps = {"upload": "Replaces the code: " + "; ".join(map(_upload_kinds, registry.all_runtimes())),
                 "source": "The code as text: " + "; ".join(f"{r.label} ({' or '.join(r.source_extensions)})"
                                                            for r in registry.all_runtimes() if r.source_extensions)}
        for name, text in helps.items():
            if name in self.fields:
                self.fields[name].help_text = text

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        self._refuse_stale_edit(cleaned.get("loaded_at") or "")
        for name in QUOTA_FIELDS:
            if cleaned.get(name) is None:
                cleaned[name] = Plugin._meta.get_field(name).get_default()
        runtime = registry.get(cleaned.get("runtime") or "")
        upload = cleaned.get("upload")
        if upload:
            if upload.size > MAX_UPLOAD_BYTES:
                raise ValidationError(f"{upload.name} is {upload.size} bytes; the limit is {MAX_UPLOAD_BYTES}")
            data = upload.read()
            binary = registry.binary_upload(upload.name, data)
            if binary is not None:
                if cleaned.get("runtime") != binary.name:
                    raise ValidationError(f"{upload.name} is a {binary.name.upper()} binary: set the runtime to "
                                          f"{binary.label}")
                self.instance.module = data
                cleaned["source"] = ""  # the binary is the code now
            else:
                try:
                    cleaned["source"] = data.decode("utf-8")
                except UnicodeDecodeError:
                    raise ValidationError(f"{upload.name} is neither UTF-8 source text nor a "
                                          f"{' or '.join(registry.binary_extensions())} binary") from None
                if "\x00" in cleaned["source"]:  # no database stores it as text (PostgreSQL refuses it)
                    raise ValidationError(f"{upload.name} contains a NUL character; source text cannot, remove it "
                                          "(or upload a binary the runtime takes, such as .wasm)")
                if runtime is not None and runtime.binary:
                    self.instance.module = None
        elif runtime is not None and runtime.binary and cleaned.get("source", "").strip():
            self.instance.module = None  # recompiled from the text form on validation
        cleaned["permissions"] = list(cleaned.get("permissions") or [])
        return cleaned


    def _refuse_stale_edit(self, loaded_at: str) -> None:
        """Refuse (code ``plugin_changed``) a save of a page opened before the plugin's last save."""
        if not self.instance.pk or not loaded_at:  # a new plugin, or a post that does not say (a script)
            return
        rows = Plugin.objects.filter(pk=self.instance.pk)
        if transaction.get_connection().in_atomic_block:
            # The admin validates and saves in one transaction: the row stays locked until this save
            # commits, so of two concurrent saves of one page version the second sees the first's.
            rows = rows.select_for_update()
        current = rows.values_list("updated_at", flat=True).first()
        if current is not None and current.isoformat() != loaded_at:
            raise ValidationError(
                f"plugin {self.instance.name!r} was changed by someone else at {current:%Y-%m-%d %H:%M:%S} UTC, "
                "after you opened this page: nothing was saved. Reload the page to see the plugin as it is now, "
                "then make your changes again.", code="plugin_changed")


def _upload_kinds(runtime: registry.Runtime) -> str:
    """What the upload takes for one runtime, e.g. "WebAssembly: .wat text or a .wasm binary"."""
    kinds = [f"{' or '.join(runtime.source_extensions)} {'text' if runtime.binary else 'source'}"] \
        if runtime.source_extensions else []
    kinds += [f"a {ext} binary" for ext in runtime.binary_extensions]
    return f"{runtime.label}: {' or '.join(kinds)}"


class BindingFormSet(BaseInlineFormSet):
    """Checks every enabled binding's handler against the plugin's new code, in the sandbox."""

    def clean(self) -> None:
        super().clean()
        if any(self.errors):
            return
        plugin: Plugin = self.instance
        kept = [f.cleaned_data for f in self.forms if f.cleaned_data and not f.cleaned_data.get("DELETE")]
        handlers = [data["handler"] for data in kept if data.get("enabled")]
        try:
            regexes = sum(sees_every_message(data.get("kind"), data.get("pattern")) for data in kept)
            check_binding_counts(plugin.name, len(kept), regexes)
            seen: set[tuple[Any, ...]] = set()
            fan_out: collections.Counter[tuple[str, str]] = collections.Counter()
            for data in kept:
                key = (data.get("kind"), data.get("pattern"), data.get("handler"))
                if key in seen:
                    raise PluginInvalid(duplicate_binding(plugin.name, *map(str, key)))
                seen.add(key)
                if not sees_every_message(data.get("kind"), data.get("pattern")):
                    fan_out[fan_out_key(str(data.get("kind")), str(data.get("pattern")))] += 1
            if plugin.enabled:
                for (kind, pattern), mine in fan_out.items():
                    check_fan_out(plugin.name, plugin.pk, kind, pattern, mine)
            if plugin.enabled:
                check_regex_total(plugin.name, plugin.pk, regexes)
            plugin.prepare_code()
            plugin.check_fields()
            # Names the plugin, the bound handlers and the runtime's own message, whether the
            # code does not compile or a bound handler is missing from it.
            validate(plugin.to_spec(), handlers)
        except PluginInvalid as exc:
            raise ValidationError(str(exc)) from None
