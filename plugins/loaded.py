"""LoadedPlugin: one plugin version ready to run, with its strategy, its limits and its counters."""
from __future__ import annotations

import atexit
import collections
import logging
import threading
from typing import Any, Callable, Iterable

from execapp.engine import Context, ExecClass, HandlerError, HandlerTimeout

from .errors import CompileError, GuestError, GuestMemory, GuestTimeout, PluginBusy, PluginInvalid, PluginMemoryExceeded
from .runtimes import Compiled, compile_plugin
from .spec import PluginSpec
from .strategies import Slots, Strategy, make_strategy

log = logging.getLogger("plugins")

_compiled: "collections.OrderedDict[tuple, Compiled]" = collections.OrderedDict()
_compiled_lock = threading.Lock()
COMPILED_CACHE_SIZE = 128


@atexit.register
def _drop_compiled() -> None:
    # Free compiled modules while their libraries are still loaded: wasmtime objects
    # collected during interpreter teardown print "Exception ignored" noise.
    with _compiled_lock:
        _compiled.clear()
    try:
        from .sync import manager
        manager.clear()
        from .runtimes import wasm
        wasm.drop_caches()
    except Exception:
        pass


def compiled_for(spec: PluginSpec) -> Compiled:
    """``spec`` compiled and validated in its sandbox, once per version and limits (an LRU)."""
    key = (spec.name, spec.runtime, spec.config_key)
    with _compiled_lock:
        compiled = _compiled.get(key)
        if compiled is not None:
            _compiled.move_to_end(key)
            return compiled
    compiled = compile_plugin(spec)  # outside the lock: compiling may take milliseconds
    with _compiled_lock:
        _compiled[key] = compiled
        while len(_compiled) > COMPILED_CACHE_SIZE:
            _compiled.popitem(last=False)
    return compiled


def validate(spec: PluginSpec, handlers: Iterable[str] = ()) -> Compiled:
    """Compile ``spec`` in its sandbox and check that every handler in ``handlers`` exists.

    Raises PluginInvalid naming the plugin, the handler(s) and the runtime's own message.
    """
    handlers = sorted(set(handlers))
    try:
        compiled = compiled_for(spec)
    except CompileError as exc:
        bound = f" (handlers {', '.join(handlers)})" if handlers else ""
        raise PluginInvalid(f"plugin {spec.name!r}{bound}: the {spec.runtime} runtime refused the code: {exc}") from None
    for handler in handlers:
        if handler not in compiled.handlers:
            defined = ", ".join(sorted(compiled.handlers)) or "none"
            raise PluginInvalid(f"plugin {spec.name!r}: handler {handler!r} is not defined by the code "
                                f"({spec.runtime} defines: {defined}); add the function or fix the binding")
    return compiled


class LoadedPlugin:
    """A plugin version with its strategy and its per-plugin concurrency limit (shared by every
    engine of the process, so one plugin can never take the whole ExecPool)."""

    def __init__(self, spec: PluginSpec, compiled: Compiled | None = None) -> None:
        self.spec = spec
        self.compiled = compiled or compiled_for(spec)
        self.slots = Slots(spec.max_concurrency)
        self.strategy: Strategy = make_strategy(spec, self.compiled)
        self._lock = threading.Lock()
        self.calls_total = 0
        self.errors_total = 0
        self.timeouts_total = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def call(self, handler: str, event: dict[str, Any], blocking: bool = True) -> Any:
        """Run ``handler`` on ``event`` under the plugin's limits; the reply (str, dict, list or None).

        ``blocking=False`` (inline on the event loop) never waits for a slot: PluginBusy at once.
        Raises HandlerTimeout, HandlerError (PluginMemoryExceeded) or PluginBusy.
        """
        spec = self.spec
        wait = spec.timeout  # how long a pool thread may wait for a slot
        if not self.slots.acquire(blocking, wait):
            raise PluginBusy(f"plugin {spec.name!r} handler {handler!r}: all {spec.max_concurrency} concurrent "
                             "calls allowed are running" + (f" after waiting {wait:g} s" if blocking else "")
                             + "; retry, or raise the plugin's max concurrency")
        try:
            result = self.strategy.call(handler, event, blocking, wait)
        except GuestTimeout as exc:
            self._count(timeout=True)
            raise HandlerTimeout(f"plugin {spec.name!r} handler {handler!r}: timeout: {exc}") from None
        except GuestMemory as exc:
            self._count(error=True)
            raise PluginMemoryExceeded(f"plugin {spec.name!r} handler {handler!r}: {exc}") from None
        except GuestError as exc:
            self._count(error=True)
            raise HandlerError(f"plugin {spec.name!r} handler {handler!r}: {spec.runtime} error: {exc}") from None
        except PluginBusy:
            self._count()
            raise
        finally:
            self.slots.release()
        self._count()
        return result

    def _count(self, error: bool = False, timeout: bool = False) -> None:
        with self._lock:
            self.calls_total += 1
            self.errors_total += error
            self.timeouts_total += timeout

    def engine_handler(self, handler: str) -> Callable[[Context], Any]:
        """The ``handler(ctx) -> reply`` the engine calls for a binding of ``handler``."""

        def run(ctx: Context) -> Any:
            event = ctx.event.to_dict()
            event["args"] = ctx.args
            return self.call(handler, event, blocking=ctx.exec_class is not ExecClass.SYNC)

        run.__name__ = run.__qualname__ = f"{self.spec.name}.{handler}"
        return run

    def stats(self) -> dict[str, Any]:
        """One row of plugins.sync.instance_pool_stats()."""
        s = self.strategy
        return {
            "plugin": self.spec.name, "runtime": self.spec.runtime, "strategy": s.name, "version": self.spec.version,
            "capacity": s.capacity(), "busy": self.slots.busy, "idle": s.idle(),
            "waiting": self.slots.waiting + s.waiting + getattr(getattr(s, "slots", None), "waiting", 0),
            "max_concurrency": self.spec.max_concurrency, "calls_total": self.calls_total,
            "waits_total": self.slots.waits_total + getattr(getattr(s, "slots", None), "waits_total", 0),
            "refused_total": self.slots.refused_total + getattr(getattr(s, "slots", None), "refused_total", 0),
            "timeouts_total": self.timeouts_total, "errors_total": self.errors_total,
            "instances_created_total": s.created_total, "instances_discarded_total": s.discarded_total,
        }

    def close(self) -> None:
        """Stop handing out instances; in-flight calls finish and their instances are dropped."""
        self.strategy.close()
