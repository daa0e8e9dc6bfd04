"""The one small interface every runtime implements: compile (validate), instances, call, close."""
from __future__ import annotations

import json as _json
import json.encoder as _json_encoder
from typing import Any, Callable, Protocol

from execapp.engine.json_depth import json_depth

from ..spec import PluginSpec

#: Bytes of JSON/text a reply may carry back from a guest, whatever its runtime (UTF-8 of the text
#: reply, or of the data reply's JSON): checked for every call on its way to the engine
#: (plugins.loaded), since each reply is encoded, queued and written on the event loop after its
#: handler's time was measured.
MAX_REPLY_BYTES = 256 * 1024
#: The niceness of a compiling child (WASM's; Lua's for a source past 64 KiB). A compile is
#: background work that every worker does at once for each new version (wasmtime on all cores,
#: Lua's parser on one each): at nice 0, two WASM compiles of one plugin's save put a sleeping
#: thread's wake-up at 1.9 ms median and 17-26 ms p99 (0.1 / 2-3 ms idle) for their whole 7-10 s.
#: At 10 they yield to serving (0.1 / 3.7-8.6 ms), and still took their usual time on a loaded
#: machine (4,000 functions: 1.9-2.1 s either way).
COMPILE_NICE = 10
#: Characters of a guest's error message kept (the rest is cut and counted; plugins.strategies):
#: the message is copied into the error frame, the profile and the history on the event loop.
#: Above the Lua sandbox's own cut (4 KiB and its note, lua_sandbox.lua), which stays as it is.
MAX_ERROR_CHARS = 8192
#: Levels of arrays/objects a data reply may nest, whatever its runtime (the Lua sandbox's limit:
#: its reply table and 32 below it; EXECAPP['MAX_FRAME_DEPTH'] is 32 for events): the reply is
#: encoded again on the event loop (its frame, the history), where Python's encoder recurses once
#: per level. A JS or WASM reply ~950 levels deep passed its handler, then failed its frame's
#: encoding at delivery: the client got a ``done`` counting a reply it never received.
MAX_REPLY_DEPTH = 33


#: Seconds a plugin's top level may run when its code is validated: at save, and in every worker
#: whenever it loads a new version, on the registry-sync thread, one plugin after another. The
#: plugin's own timeout_ms (up to EXECAPP['MAX_HANDLER_TIMEOUT_SECONDS'], 60 s) bounded it alone: a
#: top level of 25 s under a 30 s timeout was accepted and cost every worker 25 s at each start and
#: version, with every other plugin's change waiting behind it. A top level is definitions; work
#: belongs in handlers, which get the whole timeout.
LOAD_SECONDS = 2.0


def load_seconds(spec: PluginSpec) -> float:
    """The budget of ``spec``'s top level when it is validated: its timeout, at most LOAD_SECONDS."""
    return min(spec.timeout, LOAD_SECONDS)


def load_budget_note(spec: PluginSpec) -> str:
    """What a validation timeout adds when LOAD_SECONDS, not the plugin's timeout, stopped the top level."""
    if spec.timeout <= LOAD_SECONDS:
        return ""
    return (f" (a top level may run at most {LOAD_SECONDS:g} s when the plugin is loaded, whatever its timeout_ms: "
            "plugins.runtimes.base.LOAD_SECONDS; every worker runs it at each start and new version)")


class ReplyTooDeep(ValueError):
    """A data reply nests deeper than MAX_REPLY_DEPTH (``reply_bytes``)."""


class Instance(Protocol):
    """One live guest: a Lua runtime, a WASM Store+Instance or a QuickJS Context.

    ``call`` runs ``handler`` until ``deadline`` (a time.monotonic() value) and raises
    plugins.errors.GuestError / GuestTimeout / GuestMemory; an error with ``poison`` set means
    this instance must be closed and replaced, never reused. The instance makes the call's
    plugins.runtimes.host.Host only when the guest calls the host API (most calls never do).
    """

    def call(self, handler: str, event: dict[str, Any], deadline: float) -> Any: ...

    def close(self) -> None: ...


class Compiled(Protocol):
    """One plugin version compiled once (bytecode, compiled module, checked source)."""

    spec: PluginSpec
    #: Handler names the plugin defines (checked against its bindings at save).
    handlers: frozenset[str]
    #: True when an instance must stay on the thread that made it (no built-in runtime today;
    #: tests/plugins use a toy one).
    thread_bound: bool

    def new_instance(self, deadline: float | None = None) -> Instance:
        """A new instance. Its top level (the plugin's code run to define the handlers, a WASM
        start function) stops by ``deadline`` if it is earlier than the plugin's own timeout: the
        caller's call budget, e.g. the worker's inline budget on the event loop."""
        ...

    def call_isolated(self, handler: str, event: dict[str, Any], deadline: float) -> Any:
        """One call with full isolation (the per_request strategy), until ``deadline``."""
        ...

    def idle_isolated(self) -> int:
        """Warm resources kept for call_isolated (for stats); 0 if none."""
        ...

    def close(self) -> None: ...


class FreshInstanceIsolation:
    """``Compiled`` defaults for a runtime whose per-request isolation is simply a new instance
    (the class it is mixed into supplies ``new_instance``)."""

    def new_instance(self, deadline: float | None = None) -> Instance:
        """A new instance: the runtime's class defines it."""
        raise NotImplementedError

    def call_isolated(self, handler: str, event: dict[str, Any], deadline: float) -> Any:
        """One call on a brand-new instance (made within the call's ``deadline``), closed right after."""
        inst = self.new_instance(deadline)
        try:
            return inst.call(handler, event, deadline)
        finally:
            inst.close()

    def idle_isolated(self) -> int:
        """Nothing is kept warm between isolated calls."""
        return 0

    def close(self) -> None:
        """Nothing to release beyond the instances, which close themselves."""


def to_reply(value: Any) -> Any:
    """Normalize a guest's return value: None, a str (text reply), or a dict/list (data reply)."""
    if value is None or isinstance(value, (str, dict, list)):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def reply_bytes(value: Any) -> int:
    """The UTF-8 size of a reply (what ``to_reply`` gives) as a client gets it: a text reply's own,
    a data reply's JSON; 0 for None. O(1) for ASCII text, O(size) otherwise. Raises ReplyTooDeep
    for a data reply nested deeper than MAX_REPLY_DEPTH."""
    if value is None:
        return 0
    if value.__class__ is not str:
        try:
            value = to_json(value)
        except RecursionError:
            raise ReplyTooDeep() from None
        except (TypeError, ValueError):  # not JSON: sent as a short repr (execapp.protocol)
            return 0
        # Fewer brackets than the limit cannot be too deep (the common case: two counts in C).
        if value.count("[") + value.count("{") > MAX_REPLY_DEPTH and \
                json_depth(value.encode("utf-8", "surrogatepass"), MAX_REPLY_DEPTH) > MAX_REPLY_DEPTH:
            raise ReplyTooDeep()
    return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))


def clip_error(message: str) -> str:
    """``message`` cut to MAX_ERROR_CHARS characters, saying how long it was."""
    if len(message) <= MAX_ERROR_CHARS:
        return message
    return f"{message[:MAX_ERROR_CHARS]} ... (cut: the message was {len(message)} characters)"


def _make_to_json() -> Any:
    # json.dumps builds a new JSONEncoder (and a new C encoder) on every call with non-default
    # separators: ~2 us for an event. The C encoder built once is ~0.8 us. markers=None skips
    # the circular-reference check: events and replies come from JSON, so they have no cycles
    # (a cycle would still end in RecursionError, not a crash).
    def default(obj: Any) -> Any:
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")

    # The C encoder is undocumented (typeshed does not list it): None on a Python without it.
    make_encoder = getattr(_json_encoder, "c_make_encoder", None)
    if make_encoder is None:
        return _json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=default).encode
    encode = make_encoder(None, default, _json_encoder.encode_basestring, None, ":", ",", False, False, True)
    join = "".join
    return lambda obj: join(encode(obj, 0))


#: ``to_json(obj) -> str``: compact UTF-8-friendly JSON (what json.dumps(obj, separators=(",", ":"),
#: ensure_ascii=False) gives), for events sent into guests.
to_json = _make_to_json()

#: ``scan_json(text, index) -> (value, end)``: the C JSON scanner; raises StopIteration when no
#: JSON value starts at ``index`` (json.loads adds ~0.7 us of Python around the same call).
#: (typeshed does not list the decoder's ``scan_once`` attribute.)
scan_json: Callable[[str, int], tuple[Any, int]] = _json.JSONDecoder().scan_once  # type: ignore[attr-defined]
