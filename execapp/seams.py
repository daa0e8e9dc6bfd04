"""What the modules around the worker need of it and of its engine, as Protocols.

The worker (execapp.worker) builds its background services from dotted paths and hands each
factory itself; the control listener, the drain, the status, the health probe and the server
get it the same way. Those modules type their ``worker`` as ``WorkerLike`` (and an engine as
``EngineLike``) instead of importing execapp.worker, which would import them back, and instead
of ``Any``, which checked nothing. Each member here is used by one of them. mypy checks that
``Worker`` and ``Engine`` satisfy these Protocols where the worker passes itself to its
service factories (``Worker.start``) and where the protocols' users receive the real objects.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from .engine import ExecPool, ExecProfile, Matcher, MatcherKind
from .engine.engine import RunObserver
from .engine.matcher import Handler


class Service(Protocol):
    """A background job of a worker, ticked every ``interval`` seconds off the event loop. One
    whose tick may run long (it runs code it does not control, or waits for a dependency the others
    do not use: the database) sets ``own_thread = True``: the worker ticks it on a thread of its own,
    so it cannot hold the others' ticks."""

    interval: float

    def tick(self) -> None: ...

    def close(self) -> None: ...


class EngineLike(Protocol):
    """What the services use of a worker's engine (execapp.engine.Engine): its matchers and
    profiles (persistence, metrics, snapshots, watchdog), its counters, its run observers, and
    the matchers an app's service installs (the plugins app's registry sync)."""

    @property
    def matchers(self) -> Sequence[Matcher]: ...

    def set_matchers(self, matchers: Iterable[Matcher]) -> None: ...

    def make_matcher(self, kind: MatcherKind | str, pattern: str, handler: Handler, *, priority: int = ...,
                     block: bool = ..., name: str | None = ..., plugin: str | None = ...,
                     timeout: float | None = ...) -> Matcher: ...

    @property
    def profiles(self) -> Mapping[str, ExecProfile]: ...

    def profile_for(self, name: str) -> ExecProfile: ...

    def add_observer(self, fn: RunObserver) -> None: ...

    def quarantine(self, name: str, reason: str = ...) -> ExecProfile: ...

    def stats(self) -> dict[str, Any]: ...


class WorkerLike(Protocol):
    """What the services, the control listener, the drain, the status, the health probe and the
    server need of the process's worker (execapp.worker.Worker)."""

    #: Set by the watchdog service once it asked the supervisor for a replacement.
    recycling: bool

    @property
    def id(self) -> str: ...

    @property
    def started_at(self) -> float: ...

    @property
    def engine(self) -> EngineLike: ...

    @property
    def pool(self) -> ExecPool: ...

    @property
    def draining(self) -> bool: ...

    @property
    def events_in_flight(self) -> int: ...

    @property
    def events_finished(self) -> int: ...

    @property
    def services(self) -> Sequence[Service]: ...

    @property
    def ready(self) -> threading.Event: ...

    def status(self) -> dict[str, Any]: ...

    def set_draining(self, draining: bool) -> bool: ...

    def begin_stop(self) -> None: ...

    def stop(self, timeout: float | None = None) -> bool: ...


#: ``factory(worker) -> Service``: how the worker builds each background service.
ServiceFactory = Callable[[WorkerLike], Service]
