"""LoadedPlugin: one plugin version ready to run, with its strategy, its limits and its counters."""
from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
from typing import Any, Callable, Iterable

from execapp.engine import Context, ExecClass, HandlerTimeout

from .errors import CompileError, PluginInvalid
from .runtimes.base import MAX_REPLY_BYTES, Compiled, ReplyTooDeep, reply_bytes
from .runtimes.registry import compile_plugin
from .runtimes.weighed_lru import WeighedLRU
from .spec import PluginSpec
from .strategies import PluginCall, Slots, Strategy, make_strategy

log = logging.getLogger("plugins")
_now = time.monotonic

COMPILED_CACHE_SIZE = 128
#: Bytes of code (source or binary, plus Lua's bytecode) the compiled versions above may hold
#: together: a version is up to 4 MiB of code (registry.MAX_CODE_BYTES) and ~3x that in bytecode,
#: and every save of a plugin is a new version (plugins.runtimes.weighed_lru).
COMPILED_CACHE_BYTES = 64 << 20
_compiled: "WeighedLRU[tuple, Compiled]" = WeighedLRU()
_compiled_lock = threading.Lock()
#: How long a refusal of one exact spec is remembered: one admin save validates the code in the
#: form, in the bindings' formset and at save, and a top level that ran past a 60 s timeout ran
#: past it once for each (the page answered after 2x the budget). Long enough for the repeats
#: of one request; short enough that saving again after a busy moment compiles again.
REFUSAL_MEMORY_SECONDS = 5.0
_refused: "collections.OrderedDict[tuple, tuple[float, CompileError]]" = collections.OrderedDict()

#: Seconds the engine allows a plugin's handler beyond its ``timeout_ms`` before its pool
#: watcher reports it ``timeout`` and counts the thread stuck. The sandbox stops a guest at
#: its deadline plus a margin of milliseconds; the engine is only the backstop for a guest
#: that escapes it (a C call no hook reaches), so the grace is wide enough never to race the
#: sandbox and small enough that such a run still ends within 2x its budget + 0.5 s.
ENGINE_GRACE_SECONDS = 0.5
#: A text reply this short is within MAX_REPLY_BYTES whatever its characters (4 bytes at most each).
_SHORT_REPLY_CHARS = MAX_REPLY_BYTES // 4


def forget_refusals() -> None:
    """Forget the specs refused lately, so that the next validation runs them again (tests that
    change a runtime's limits between two validations of one spec)."""
    with _compiled_lock:
        _refused.clear()


@atexit.register
def _drop_compiled() -> None:
    # Free compiled plugins while their runtimes' libraries are still loaded: wasmtime objects
    # collected during interpreter teardown print "Exception ignored" noise. (The loaded
    # plugins, plugins.sync, and the runtimes' own caches, plugins.runtimes.wasm, are dropped
    # by their modules' exit hooks.)
    with _compiled_lock:
        _compiled.clear()
        _refused.clear()


def compiled_for(spec: PluginSpec) -> Compiled:
    """``spec`` compiled and validated in its sandbox, once per version and limits (an LRU)."""
    key = (spec.name, spec.runtime, spec.config_key)
    with _compiled_lock:
        compiled = _compiled.get(key)
        if compiled is not None:
            return compiled
        refused = _refused.get(key)
        if refused is not None and _now() - refused[0] < REFUSAL_MEMORY_SECONDS:
            # The same spec, refused a moment ago: not run again (a new exception: one shared
            # object would collect every raiser's traceback).
            raise CompileError(str(refused[1]), code=refused[1].code)
    try:
        compiled = compile_plugin(spec)  # outside the lock: compiling may take milliseconds (a top level, seconds)
    except CompileError as exc:
        with _compiled_lock:
            _refused[key] = (_now(), exc)
            _refused.move_to_end(key)
            while len(_refused) > COMPILED_CACHE_SIZE:
                _refused.popitem(last=False)
        raise
    with _compiled_lock:
        _compiled.put(key, compiled, compiled_bytes(spec, compiled), COMPILED_CACHE_SIZE, COMPILED_CACHE_BYTES)
    return compiled


def compiled_bytes(spec: PluginSpec, compiled: Compiled) -> int:
    """What one compiled version holds, as the cache counts it: its code and any bytecode or
    machine code made of it (``native_bytes``: a WASM module's, up to ~50x its binary)."""
    bytecode = getattr(compiled, "bytecode", b"")
    native = getattr(compiled, "native_bytes", 0)
    return len(spec.code) + (len(bytecode) if isinstance(bytecode, (bytes, bytearray)) else 0) + \
        (native if isinstance(native, int) else 0)


def validate(spec: PluginSpec, handlers: Iterable[str] = ()) -> Compiled:
    """Compile ``spec`` in its sandbox and check that every handler in ``handlers`` exists.

    Raises PluginInvalid naming the plugin, the handler(s) and the runtime's own message.
    """
    handlers = sorted(set(handlers))
    try:
        compiled = compiled_for(spec)
    except CompileError as exc:
        bound = f" (handlers {', '.join(handlers)})" if handlers else ""
        raise PluginInvalid(f"plugin {spec.name!r}{bound}: the {spec.runtime} runtime refused the code: {exc}",
                            code=exc.code) from None
    for handler in handlers:
        if handler not in compiled.handlers:
            defined = ", ".join(sorted(compiled.handlers)) or "none"
            raise PluginInvalid(f"plugin {spec.name!r}: handler {handler!r} is not defined by the code "
                                f"({spec.runtime} defines: {defined}); add the function or fix the binding")
    return compiled


class LoadedPlugin:
    """A plugin version with its strategy and its per-plugin concurrency limit (shared by every
    engine of the process, so one plugin can never take the whole ExecPool)."""

    #: ``call(handler, event, blocking=True, deadline=None)``: run ``handler`` on ``event`` under
    #: the plugin's limits; the reply (str, dict, list or None). ``blocking=False`` (inline on
    #: the event loop) never waits for a slot: PluginBusy at once. ``deadline``
    #: (time.monotonic()): the guest stops by min(its own timeout, deadline). Raises
    #: HandlerTimeout, HandlerError (PluginMemoryExceeded, QuotaExceeded), PluginBusy, or
    #: PluginUnavailable once the plugin is closed. It is the strategy's own ``call`` (slot,
    #: instance, guest, error mapping), bound here so a call through the plugin costs no extra frame.
    call: PluginCall

    def __init__(self, spec: PluginSpec, compiled: Compiled | None = None) -> None:
        self.spec = spec
        self.compiled = compiled or compiled_for(spec)
        self.strategy: Strategy = make_strategy(spec, self.compiled)
        self.slots: Slots = self.strategy.slots
        self.call = self.strategy.call

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def calls_total(self) -> int:
        return self.strategy.calls_total

    @property
    def errors_total(self) -> int:
        return self.strategy.errors_total

    @property
    def timeouts_total(self) -> int:
        return self.strategy.timeouts_total

    def engine_handler(self, handler: str) -> Callable[[Context], Any]:
        """The ``handler(ctx) -> reply`` the engine calls for a binding of ``handler``.

        The guest's deadline is min(the plugin's timeout, ``ctx.deadline``): inline, the
        engine's inline budget may be the shorter, and a run it stops says so. The function
        carries ``timeout`` (twice the plugin's timeout + ENGINE_GRACE_SECONDS: a pooled call may
        wait up to its timeout for a slot, then run up to its timeout), which the engine takes as
        its matcher's deadline for pooled runs (the backstop behind the sandbox).
        """
        call = self.call
        sync = ExecClass.SYNC
        own = self.spec.timeout
        too_large, too_deep = self.strategy.reply_too_large, self.strategy.reply_too_deep

        def run(ctx: Context) -> Any:
            event = ctx.event.to_dict()
            event["args"] = ctx.args
            inline = ctx.exec_class is sync
            deadline = ctx.deadline
            if not inline and deadline is not None:
                # Pooled, ctx.deadline is the engine's backstop (``run.timeout`` from the run's
                # start): the sandbox stops the guest a whole grace before it, however long the
                # call waited for a slot. A guest that waited longer than the grace was given the
                # backstop's own deadline, raced the watcher, which won under load and counted the
                # thread stuck (76 on a real worker for one frame; 8 at once recycle it).
                deadline -= ENGINE_GRACE_SECONDS
            try:
                reply = call(handler, event, not inline, deadline)
                # The reply's size is checked here, inside the handler's measured run, for every
                # runtime: what comes after (its frame, the outbox, the write, the history) runs on
                # the event loop outside that measure, in time linear in the reply. A short text
                # (at most 4 bytes a character) needs no count.
                if reply is None or (reply.__class__ is str and len(reply) <= _SHORT_REPLY_CHARS):
                    return reply
                try:
                    size = reply_bytes(reply)
                except ReplyTooDeep:
                    raise too_deep(handler) from None
                if size > MAX_REPLY_BYTES:
                    raise too_large(handler, size)
                return reply
            except HandlerTimeout as exc:
                if inline and deadline is not None and _now() >= deadline:
                    # Stopped by the inline budget, not by the plugin's own timeout.
                    raise HandlerTimeout(
                        f"{exc} [stopped by the worker's inline budget, not the plugin's timeout of {own:g} s: "
                        "this handler had proven fast and ran on the event loop, where no run may hold the "
                        "other connections longer (EXECAPP['INLINE_TIMEOUT_SECONDS']); it now runs in the pool "
                        "with its full timeout, so a retry of this event gets it]") from None
                raise

        run.__name__ = run.__qualname__ = f"{self.spec.name}.{handler}"
        run.timeout = 2 * own + ENGINE_GRACE_SECONDS  # type: ignore[attr-defined]
        return run

    def stats(self) -> dict[str, Any]:
        """One row of plugins.sync.instance_pool_stats()."""
        s = self.strategy
        return {
            "plugin": self.spec.name, "runtime": self.spec.runtime, "strategy": s.name, "version": self.spec.version,
            "capacity": s.capacity(), "busy": s.busy, "idle": s.idle(),
            "waiting": s.slots.waiting + s.waiting,
            "max_concurrency": self.spec.max_concurrency, "calls_total": s.calls_total,
            "waits_total": s.slots.waits_total + s.waits_total,
            "refused_total": s.slots.refused_total + s.refused_total,
            "timeouts_total": self.timeouts_total, "errors_total": self.errors_total,
            "instances_created_total": s.created_total, "instances_discarded_total": s.discarded_total,
        }

    def close(self) -> None:
        """Stop handing out instances: calls running now finish and their instances are dropped;
        a call that gets its slot after this is refused with PluginUnavailable."""
        self.strategy.close()
