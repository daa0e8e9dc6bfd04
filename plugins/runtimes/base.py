"""The one small interface every runtime implements: compile (validate), instances, call, close."""
from __future__ import annotations

from typing import Any, Protocol

from ..host import Host
from ..spec import PluginSpec

#: Bytes of JSON/text a reply may carry back from a guest.
MAX_REPLY_BYTES = 256 * 1024


class Instance(Protocol):
    """One live guest: a Lua runtime, a WASM Store+Instance or a QuickJS Context.

    ``call`` raises plugins.errors.GuestError / GuestTimeout / GuestMemory; an error with
    ``poison`` set means this instance must be closed and replaced, never reused.
    """

    def call(self, handler: str, event: dict[str, Any], host: Host) -> Any: ...

    def close(self) -> None: ...


class Compiled(Protocol):
    """One plugin version compiled once (bytecode, compiled module, checked source)."""

    spec: PluginSpec
    #: Handler names the plugin defines (checked against its bindings at save).
    handlers: frozenset[str]
    #: True when an instance must stay on the thread that made it (QuickJS).
    thread_bound: bool

    def new_instance(self) -> Instance: ...

    def call_isolated(self, handler: str, event: dict[str, Any], host: Host) -> Any:
        """One call with full isolation (the per_request strategy)."""
        ...

    def idle_isolated(self) -> int:
        """Warm resources kept for call_isolated (for stats); 0 if none."""
        ...

    def close(self) -> None: ...


class FreshInstanceIsolation:
    """``Compiled`` defaults for a runtime whose per-request isolation is simply a new instance
    (the class it is mixed into supplies ``new_instance``)."""

    def call_isolated(self, handler: str, event: dict[str, Any], host: Host) -> Any:
        """One call on a brand-new instance, closed right after."""
        inst = self.new_instance()
        try:
            return inst.call(handler, event, host)
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
