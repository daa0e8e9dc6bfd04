"""Extension points of the server: what apps built on execapp register at ``AppConfig.ready``.

execapp never imports the apps above it (the plugins app): they register here instead, and
the worker, the metrics, the dashboard and the status command read what was registered.
Registration happens once per process, while Django starts, before any worker exists; reading
is lock-free afterwards.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

from .engine.ratelog import RateLimitedLog
from .seams import ServiceFactory

log = logging.getLogger("execapp.extensions")
#: A failing stats provider is read every second by the metrics and the dashboard: one line a minute.
_rare = RateLimitedLog(log, 60.0)

#: ``provider() -> rows``: one dict per row (e.g. one per loaded plugin's instance pool).
StatsProvider = Callable[[], list[dict[str, Any]]]


class Registered(NamedTuple):
    """One registered worker service: a name (for logs and for tests that remove it) and its factory."""

    name: str
    factory: ServiceFactory


_services: list[Registered] = []
_removed: set[str] = set()
_stats: dict[str, StatsProvider] = {}


def add_service(name: str, factory: ServiceFactory) -> None:
    """Run ``factory(worker)``'s service on every worker, after execapp's own observability
    services and before the watchdog (so it sees the matchers the service installs).
    Registering a name again replaces it (Django may call ``ready`` twice in tests)."""
    _services[:] = [s for s in _services if s.name != name]
    _services.append(Registered(name, factory))


def remove_service(name: str) -> None:
    """Leave the service called ``name`` out of every worker built from now on, whether it is
    registered already or later: a test server's settings module runs before the apps' ``ready``
    (e.g. servers that install their own matchers instead of the plugin registry's)."""
    _removed.add(name)


def services() -> list[Registered]:
    """The registered services, in registration order, without the removed ones."""
    return [s for s in _services if s.name not in _removed]


#: ``provider(event_type, text) -> hint or None``: why an event matched no handler (e.g. its
#: command is bound by a disabled plugin). Called only for events that matched nothing.
HintProvider = Callable[[str, str], "str | None"]
_hints: dict[str, HintProvider] = {}


def add_hint_provider(name: str, provider: HintProvider) -> None:
    """Explain unmatched events with ``provider`` (the plugins app: disabled plugins and bindings)."""
    _hints[name] = provider


def remove_hint_provider(name: str) -> None:
    """Forget the hint provider called ``name`` (no-op when there is none)."""
    _hints.pop(name, None)


def unmatched_hint(event_type: str, text: str) -> str | None:
    """The first registered provider's hint for an event that matched no handler, or None.
    A provider's failure is logged (once a minute per cause) and counts as no hint."""
    for name, provider in list(_hints.items()):
        try:
            hint = provider(event_type, text)
        except Exception as exc:
            _rare.warning((name, type(exc).__name__), "hint provider %r failed: %r", name, exc)
            continue
        if hint:
            return hint
    return None


def add_stats_provider(name: str, provider: StatsProvider) -> StatsProvider | None:
    """Publish ``provider()``'s rows as the stats called ``name`` (e.g. ``"plugin_pools"``);
    returns the provider it replaces, if any (so a test can put it back)."""
    previous = _stats.get(name)
    _stats[name] = provider
    return previous


def remove_stats_provider(name: str) -> None:
    """Forget the provider of the stats called ``name`` (no-op when there is none)."""
    _stats.pop(name, None)


def stats(name: str) -> list[dict[str, Any]] | None:
    """The rows of the provider registered as ``name`` now, or None when no app registered one.
    A provider's exception propagates (see ``rows`` for readers that must not fail)."""
    provider = _stats.get(name)
    return None if provider is None else provider()


def rows(name: str) -> list[dict[str, Any]]:
    """The rows of ``name`` for readers that must always answer (metrics, dashboard): [] when no
    app registered a provider or it failed (logged at most once a minute per cause)."""
    try:
        return list(stats(name) or [])
    except Exception as exc:
        _rare.warning((name, type(exc).__name__), "stats provider %r failed: %r", name, exc)
        return []
