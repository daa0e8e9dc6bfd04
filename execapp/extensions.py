"""Extension points of the server: what apps built on execapp register at ``AppConfig.ready``.

execapp never imports the apps above it (the plugins app): they register here instead, and
the worker, the metrics and the drain read what was registered. Registration happens once per
process, while Django starts, before any worker exists; reading is lock-free afterwards.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

#: ``factory(worker) -> Service`` (see execapp.worker.Service).
ServiceFactory = Callable[[Any], Any]
#: ``provider() -> rows``: one dict per row (e.g. one per loaded plugin's instance pool).
StatsProvider = Callable[[], list[dict[str, Any]]]


class Registered(NamedTuple):
    """One registered worker service: a name (for logs and for tests that remove it) and its factory."""

    name: str
    factory: ServiceFactory


_services: list[Registered] = []
_stats: dict[str, StatsProvider] = {}


def add_service(name: str, factory: ServiceFactory) -> None:
    """Run ``factory(worker)``'s service on every worker, after execapp's own observability
    services and before the watchdog (so it sees the matchers the service installs).
    Registering a name again replaces it (Django may call ``ready`` twice in tests)."""
    remove_service(name)
    _services.append(Registered(name, factory))


def remove_service(name: str) -> None:
    """Forget the service registered as ``name`` (test servers that install their own matchers)."""
    _services[:] = [s for s in _services if s.name != name]


def services() -> list[Registered]:
    """The registered services, in registration order."""
    return list(_services)


def add_stats_provider(name: str, provider: StatsProvider) -> None:
    """Publish ``provider()``'s rows as the stats called ``name`` (e.g. ``"plugin_pools"``)."""
    _stats[name] = provider


def stats(name: str) -> list[dict[str, Any]] | None:
    """The rows of the provider registered as ``name`` now, or None when no app registered one."""
    provider = _stats.get(name)
    return None if provider is None else provider()
