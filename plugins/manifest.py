"""A plugin directory's manifest.json, checked before anything is loaded from it (loadplugins).

Each mistake is one ``PluginInvalid`` (code ``bad_manifest``) naming the entry, the key, what it
must be and what it was: before, a value of the wrong type was a Python traceback (``TypeError``,
``ValueError``, ``AttributeError``), a string where a list belongs was read a character at a time
(``"permissions": "kv"`` as ``k`` and ``v``), ``true`` was a 1 ms timeout, and a misspelt key
was ignored.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.db import models

from .errors import PluginInvalid
from .models import QUOTA_FIELDS, Binding, Plugin, column_problem, integer_range

#: key -> (what it must be, whether a value is that). Limits are whole numbers from 1, quotas from 0.
_TEXT = ("a string", lambda v: isinstance(v, str))
_FLAG = ("true or false", lambda v: isinstance(v, bool))
_TEXTS = ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v))
_WHOLE = ("a whole number of at least 1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1)
_QUOTA = ("a whole number of at least 0", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)
_ANY_INT = ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool))
_PLUGIN_KEYS: dict[str, tuple[str, Any]] = {
    "name": _TEXT, "runtime": _TEXT, "file": _TEXT, "description": _TEXT, "strategy": _TEXT, "enabled": _FLAG,
    "permissions": _TEXTS, "http_allowlist": _TEXTS, "timeout_ms": _WHOLE, "memory_mb": _WHOLE,
    "max_concurrency": _WHOLE, "pool_size": _WHOLE, "shard_count": _WHOLE, **{f: _QUOTA for f in QUOTA_FIELDS},
    "bindings": ("a list of objects", lambda v: isinstance(v, list) and all(isinstance(b, dict) for b in v)),
}
_REQUIRED = ("name", "runtime", "file")
_BINDING_KEYS: dict[str, tuple[str, Any]] = {"kind": _TEXT, "pattern": _TEXT, "handler": _TEXT, "priority": _ANY_INT,
                                             "block": _FLAG}


#: The keys that are columns of each model (checked against what the column stores).
_COLUMNS: dict[type[models.Model], set[str]] = {
    model: {f.name for f in model._meta.concrete_fields} for model in (Plugin, Binding)}


def _bad(message: str) -> PluginInvalid:
    return PluginInvalid(f"manifest.json: {message} (docs/plugins.md: the manifest's format)", code="bad_manifest")


def _check(where: str, obj: dict[str, Any], keys: dict[str, tuple[str, Any]], required: tuple[str, ...],
           model: type[models.Model]) -> None:
    """Every key known, of its type and (a whole number) within what ``model``'s column stores, the
    required ones present; else PluginInvalid naming the first."""
    for key in obj:
        if key not in keys:
            raise _bad(f"{where}: unknown key {key!r}; use {', '.join(keys)}")
    for key in required:
        if key not in obj:
            raise _bad(f"{where}: {key!r} is missing")
    for key, value in obj.items():
        what, ok = keys[key]
        if not ok(value):
            raise _bad(f"{where}: {key} must be {what}, got {json.dumps(value)[:60]}")
        field = model._meta.get_field(key) if key in _COLUMNS[model] else None
        if field is None or column_problem(field, value) is None:
            continue
        if isinstance(value, str):
            raise _bad(f"{where}: {key} must be at most {field.max_length} characters, got {len(value)}")
        low, high = integer_range(field)
        raise _bad(f"{where}: {key} must be {what} and at most {high}, got {json.dumps(value)[:60]}"
                   if value >= low else f"{where}: {key} must be at least {low}, got {json.dumps(value)[:60]}")


def read_manifest(directory: Path) -> list[tuple[dict[str, Any], str]]:
    """Each plugin entry of ``directory/manifest.json`` with its file's text, all checked; raises
    PluginInvalid (``bad_manifest``) at the first mistake, before anything is loaded."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:  # not JSON, not UTF-8, unreadable
        raise _bad(f"cannot be read: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("plugins"), list):
        raise _bad('it must be an object with "plugins": a list of plugin entries')
    entries = []
    for index, entry in enumerate(manifest["plugins"]):
        where = f"plugins[{index}]"
        if not isinstance(entry, dict):
            raise _bad(f"{where} must be an object, got {json.dumps(entry)[:60]}")
        if isinstance(entry.get("name"), str):
            where += f" ({entry['name'][:63]!r})"
        _check(where, entry, _PLUGIN_KEYS, _REQUIRED, Plugin)
        for number, binding in enumerate(entry.get("bindings", [])):
            _check(f"{where} bindings[{number}]", binding, _BINDING_KEYS, ("pattern", "handler"), Binding)
        path = directory / entry["file"]
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise _bad(f"{where}: file {entry['file']!r} is not UTF-8 text; loadplugins reads source text (for "
                       "WebAssembly its .wat text form; upload a .wasm binary in the admin)") from None
        except OSError as exc:
            raise _bad(f"{where}: file {entry['file']!r} cannot be read ({exc.strerror or exc}) in {directory}") \
                from None
        entries.append((entry, source))
    return entries
