"""Which labelled series the worker serves now: the test /metrics and the archive compaction apply."""
from __future__ import annotations

from typing import Any, Callable

from . import extensions
from .worker import current_worker


def live_filter(worker: Any = None) -> Callable[[dict[str, str]], bool] | None:
    """A test of a sample's labels: False for a plugin or matcher ``worker`` (by default this
    process's) does not serve now. None (keep everything) without a worker to ask."""
    worker = worker if worker is not None else current_worker()
    if worker is None:
        return None
    matchers = worker.engine.matchers
    names = {m.name for m in matchers}
    plugins = {m.plugin for m in matchers if m.plugin} | {str(r.get("plugin")) for r in extensions.rows("plugin_pools")}

    def keep(labels: dict[str, str]) -> bool:
        plugin = labels.get("plugin")
        if plugin and plugin not in plugins:
            return False
        matcher = labels.get("matcher")
        return not (matcher and not plugin and matcher not in names and "." in matcher
                    and matcher.split(".", 1)[0] not in plugins)

    return keep
