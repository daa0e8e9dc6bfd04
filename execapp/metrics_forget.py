"""Series of plugins and matchers no longer served (deleted, renamed, disabled) are forgotten, not
only hidden: ``metrics_view`` leaves them out of every scrape, but their values stayed, the
registry's children in one process and the archives' keys in multiprocess mode, growing with
every plugin ever loaded and read by every scrape."""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import REGISTRY

from .metrics_multiprocess import compact, multiprocess_dir


def forget_registry(keep: Callable[[dict[str, str]], bool], registry: Any = REGISTRY) -> int:
    """Remove from ``registry`` (a single process's) the labelled children ``keep`` refuses; how many."""
    removed = 0
    for collector in list(getattr(registry, "_collector_to_names", {})):
        names = getattr(collector, "_labelnames", ())
        children = getattr(collector, "_metrics", None)
        if not names or not isinstance(children, dict) or not ({"plugin", "matcher"} & set(names)):
            continue
        for values in list(children):
            if not keep(dict(zip(names, values))):
                collector.remove(*values)
                removed += 1
    return removed


def forget(keep: Callable[[dict[str, str]], bool] | None) -> int:
    """Forget the series ``keep`` refuses: from the dead processes' archives (multiprocess mode:
    a live process's own files cannot be edited under it; they are merged, and filtered, when it
    has exited) or from this process's registry; how many. ``keep`` None: nothing."""
    if keep is None:
        return 0
    if multiprocess_dir():
        return compact(keep=keep)["dropped"]
    return forget_registry(keep)
