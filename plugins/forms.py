"""Admin forms: plugin code upload/edit and binding validation inside the sandbox."""
from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.forms.models import BaseInlineFormSet

from .errors import PluginInvalid
from .loaded import validate
from .models import QUOTA_FIELDS, Plugin
from .spec import PERMISSIONS

MAX_UPLOAD_BYTES = 4 << 20


class PluginForm(forms.ModelForm):
    """Plugin settings plus an optional file upload (.lua, .js, .wat or a .wasm binary)."""

    upload = forms.FileField(required=False, help_text="Replaces the code: .lua or .js source, .wat text, "
                                                       "or a .wasm binary for a WASM plugin.")
    permissions = forms.MultipleChoiceField(choices=[(p, p) for p in PERMISSIONS], required=False,
                                            widget=forms.CheckboxSelectMultiple,
                                            help_text="Host API calls this plugin may make.")

    class Meta:
        model = Plugin
        fields = ["name", "description", "runtime", "enabled", "source", "upload", "permissions", "http_allowlist",
                  "timeout_ms", "memory_mb", "max_concurrency", "strategy", "pool_size", "shard_count",
                  *QUOTA_FIELDS]
        widgets = {"source": forms.Textarea(attrs={"rows": 20, "cols": 100, "style": "font-family: monospace"})}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A quota left empty takes its default (and forms posted before quotas existed still save).
        for name in QUOTA_FIELDS:
            if name in self.fields:
                self.fields[name].required = False

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        for name in QUOTA_FIELDS:
            if cleaned.get(name) is None:
                cleaned[name] = Plugin._meta.get_field(name).get_default()
        upload = cleaned.get("upload")
        if upload:
            if upload.size > MAX_UPLOAD_BYTES:
                raise ValidationError(f"{upload.name} is {upload.size} bytes; the limit is {MAX_UPLOAD_BYTES}")
            data = upload.read()
            if upload.name.endswith(".wasm") or data[:4] == b"\0asm":
                if cleaned.get("runtime") != "wasm":
                    raise ValidationError(f"{upload.name} is a WASM binary: set the runtime to WebAssembly")
                self.instance.module = data
                cleaned["source"] = ""  # the binary is the code now
            else:
                try:
                    cleaned["source"] = data.decode("utf-8")
                except UnicodeDecodeError:
                    raise ValidationError(f"{upload.name} is neither UTF-8 source text nor a .wasm binary") from None
                if cleaned.get("runtime") == "wasm":
                    self.instance.module = None
        elif cleaned.get("runtime") == "wasm" and cleaned.get("source", "").strip():
            self.instance.module = None  # recompiled from the .wat on validation
        cleaned["permissions"] = list(cleaned.get("permissions") or [])
        return cleaned


class BindingFormSet(BaseInlineFormSet):
    """Checks every enabled binding's handler against the plugin's new code, in the sandbox."""

    def clean(self) -> None:
        super().clean()
        if any(self.errors):
            return
        plugin: Plugin = self.instance
        handlers = [f.cleaned_data["handler"] for f in self.forms
                    if f.cleaned_data and not f.cleaned_data.get("DELETE") and f.cleaned_data.get("enabled")]
        try:
            plugin.prepare_code()
            plugin.check_fields()
            # Names the plugin, the bound handlers and the runtime's own message, whether the
            # code does not compile or a bound handler is missing from it.
            validate(plugin.to_spec(), handlers)
        except PluginInvalid as exc:
            raise ValidationError(str(exc)) from None
