"""Loading plugin directories (the bundled examples) into the registry, idempotently."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from django.contrib.admin.models import LogEntry
from django.contrib.contenttypes.models import ContentType
from django.db import connection, transaction

from . import spec as specs
from .errors import PluginInvalid
from .manifest import read_manifest
from .models import QUOTA_FIELDS, Binding, Plugin

EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"
#: The PostgreSQL advisory lock every load takes for its transaction (any fixed number: "loadplugins").
LOAD_LOCK_KEY = 0x6C6F6164706C67


def _one_load_at_a_time() -> None:
    """Inside the load's transaction: wait for any other load to commit first. Every replica of a
    deployment commonly runs `migrate && loadplugins` as it starts: two loads that both found a
    plugin missing both inserted it, and one died with IntegrityError (a traceback, exit 1, the
    replica's start failed). Serialized, the second finds the first's plugins "unchanged".
    SQLite needs nothing: its IMMEDIATE transactions (config/settings.py) already take the write
    lock when they begin."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [LOAD_LOCK_KEY])
_FIELDS = ("description", "runtime", "enabled", "permissions", "http_allowlist", "timeout_ms", "memory_mb",
           "max_concurrency", "strategy", "pool_size", "shard_count", *QUOTA_FIELDS)


def _defaults(entry: dict[str, Any], source: str) -> dict[str, Any]:
    return {
        "description": entry.get("description", ""), "runtime": entry["runtime"], "source": source,
        "enabled": entry.get("enabled", True), "permissions": entry.get("permissions", ["log"]),
        "http_allowlist": "\n".join(entry.get("http_allowlist", [])),
        "timeout_ms": entry.get("timeout_ms", specs.DEFAULT_TIMEOUT_MS),
        "memory_mb": entry.get("memory_mb", specs.DEFAULT_MEMORY_MB),
        "max_concurrency": entry.get("max_concurrency", specs.DEFAULT_MAX_CONCURRENCY),
        "strategy": entry.get("strategy", ""), "pool_size": entry.get("pool_size", specs.DEFAULT_POOL_SIZE),
        "shard_count": entry.get("shard_count", specs.DEFAULT_SHARD_COUNT),
        # Host quotas (docs/plugins.md, "Limits and quotas"): a manifest may set any of them.
        **{field: entry.get(field, Plugin._meta.get_field(field).get_default()) for field in QUOTA_FIELDS},
    }


def _binding_rows(bindings: Any) -> list[list[Any]]:
    return sorted([b["kind"], b["pattern"], b["handler"], b["priority"], b["block"], b["enabled"]] for b in bindings)


def fingerprint(fields: dict[str, Any], bindings: list[list[Any]]) -> str:
    """A hash of a plugin's loadable state: its fields, its source and every binding."""
    state = json.dumps({"fields": {f: fields[f] for f in ("source", *_FIELDS)}, "bindings": bindings},
                       sort_keys=True, default=str)
    return hashlib.sha256(state.encode()).hexdigest()


def _wanted_bindings(entry: dict[str, Any]) -> list[list[Any]]:
    return _binding_rows({"kind": b.get("kind", "command"), "pattern": b["pattern"], "handler": b["handler"],
                          "priority": b.get("priority", 0), "block": b.get("block", False), "enabled": True}
                         for b in entry.get("bindings", []))


def current_fingerprint(plugin: Plugin) -> str:
    """The fingerprint of a stored plugin as it is now (admin edits included)."""
    fields = {f: getattr(plugin, f) for f in ("source", *_FIELDS)}
    return fingerprint(fields, _binding_rows(plugin.bindings.values("kind", "pattern", "handler", "priority",
                                                                     "block", "enabled")))


def _legacy_unedited(plugin: Plugin) -> bool:
    """A plugin loaded before loaded_fingerprint existed: unedited unless the admin logged a change."""
    if plugin.loaded_fingerprint:
        return False
    return not LogEntry.objects.filter(content_type=ContentType.objects.get_for_model(Plugin),
                                       object_id=str(plugin.pk)).exists()


def load_directory(directory: Path = EXAMPLES_DIR, say: Callable[[str], None] = lambda s: None,
                   force: bool = False) -> list[str]:
    """Create or update every plugin in ``directory/manifest.json``; returns per plugin "created",
    "updated", "unchanged" or "skipped".

    A plugin is updated only when it is as loadplugins last wrote it (its ``loaded_fingerprint``):
    one edited since (in the admin or anywhere else) is "skipped" and kept as it is, unless
    ``force``, which makes it exactly the manifest's (bindings it does not list are deleted).
    Unchanged plugins are not saved again (no registry bump). Raises PluginInvalid (nothing is
    saved) if the manifest (plugins.manifest) or any plugin or binding fails validation."""
    entries = read_manifest(directory)  # every entry checked before anything is saved
    results = []
    with transaction.atomic():
        _one_load_at_a_time()
        for entry, source in entries:
            wanted = _defaults(entry, source)
            wanted_fp = fingerprint(wanted, _wanted_bindings(entry))
            plugin = Plugin.objects.filter(name=entry["name"]).first()
            if plugin is None:
                plugin, state = Plugin(name=entry["name"], **wanted), "created"
            else:
                now_fp = current_fingerprint(plugin)
                if now_fp == wanted_fp:
                    if plugin.loaded_fingerprint != wanted_fp:  # same as the manifest: loaded from now on
                        Plugin.objects.filter(pk=plugin.pk).update(loaded_fingerprint=wanted_fp)
                    say(f"{entry['name']} ({entry['runtime']}): unchanged")
                    results.append("unchanged")
                    continue
                if not force and now_fp != plugin.loaded_fingerprint and not _legacy_unedited(plugin):
                    say(f"{entry['name']} ({entry['runtime']}): skipped: edited since it was loaded (kept as it is; "
                        "--force overwrites it with the manifest's)")
                    results.append("skipped")
                    continue
                for field, value in wanted.items():
                    setattr(plugin, field, value)
                state = "updated"
            plugin.loaded_fingerprint = wanted_fp
            plugin.save(check_bindings=False)  # the bindings below are validated one by one
            keep = []
            for b in entry.get("bindings", []):
                binding, created = Binding.objects.get_or_create(
                    plugin=plugin, kind=b.get("kind", "command"), pattern=b["pattern"], handler=b["handler"],
                    defaults={"priority": b.get("priority", 0), "block": b.get("block", False)})
                want = {"priority": b.get("priority", 0), "block": b.get("block", False), "enabled": True}
                if not created and any(getattr(binding, k) != v for k, v in want.items()):
                    for k, v in want.items():
                        setattr(binding, k, v)
                    binding.save()
                keep.append(binding.pk)
            # The manifest's bindings only: ours were checked unchanged above, or this is --force.
            plugin.bindings.exclude(pk__in=keep).delete()
            say(f"{entry['name']} ({entry['runtime']}): {state}")
            results.append(state)
    return results


__all__ = ["EXAMPLES_DIR", "PluginInvalid", "load_directory"]
