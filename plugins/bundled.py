"""Loading plugin directories (the bundled examples) into the registry, idempotently."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from django.db import transaction

from . import spec as specs
from .errors import PluginInvalid
from .models import QUOTA_FIELDS, Binding, Plugin

EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"
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


def load_directory(directory: Path = EXAMPLES_DIR, say: Callable[[str], None] = lambda s: None) -> list[str]:
    """Create or update every plugin in ``directory/manifest.json``; unchanged ones are not
    saved again (no registry bump). Returns "created"/"updated"/"unchanged" per plugin.
    Raises PluginInvalid (nothing is saved) if any plugin or binding fails validation."""
    manifest = json.loads((directory / "manifest.json").read_text())
    results = []
    with transaction.atomic():
        for entry in manifest["plugins"]:
            source = (directory / entry["file"]).read_text()
            wanted = _defaults(entry, source)
            plugin = Plugin.objects.filter(name=entry["name"]).first()
            if plugin is None:
                plugin, state = Plugin(name=entry["name"], **wanted), "created"
            elif any(getattr(plugin, f) != wanted[f] for f in ("source", *_FIELDS)):
                for field, value in wanted.items():
                    setattr(plugin, field, value)
                state = "updated"
            else:
                state = "unchanged"
            if state != "unchanged":
                plugin.save(check_bindings=False)  # the bindings below are validated one by one
            for b in entry.get("bindings", []):
                binding, created = Binding.objects.get_or_create(
                    plugin=plugin, kind=b.get("kind", "command"), pattern=b["pattern"], handler=b["handler"],
                    defaults={"priority": b.get("priority", 0), "block": b.get("block", False)})
                want = {"priority": b.get("priority", 0), "block": b.get("block", False), "enabled": True}
                if not created and any(getattr(binding, k) != v for k, v in want.items()):
                    for k, v in want.items():
                        setattr(binding, k, v)
                    binding.save()
                    state = "updated" if state == "unchanged" else state
                elif created and state == "unchanged":
                    state = "updated"
            say(f"{entry['name']} ({entry['runtime']}): {state}")
            results.append(state)
    return results


__all__ = ["EXAMPLES_DIR", "PluginInvalid", "load_directory"]
