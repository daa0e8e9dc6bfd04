"""A toy runtime for the registry's tests: the whole of what a new runtime needs besides its one
registry entry (tests/plugins/test_runtime_registry.py registers it).

The language: one handler per line, ``name = reply``. The reply is a template (``{args}`` and
``{text}`` are the event's), or ``!message`` (the handler fails with it), or ``+key`` (the
handler increments ``key`` in the plugin's KV namespace through the host API, and replies with
the new count). The binary form is ``TOY\\0`` followed by the UTF-8 text (``to_binary``).
"""
from __future__ import annotations

import re
from typing import Any

from plugins.errors import CompileError, GuestError
from plugins.runtimes.base import FreshInstanceIsolation
from plugins.runtimes.host import Host
from plugins.spec import PluginSpec

MAGIC = b"TOY\0"
_LINE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*?)\s*$")


def to_binary(text: str) -> bytes:
    """The binary form of toy source (checked first): what a binary runtime stores in ``module``."""
    _parse(text)
    return MAGIC + text.encode()


def _parse(text: str) -> dict[str, str]:
    handlers: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        if match is None:
            raise CompileError(f"line {number}: expected 'handler = reply', got {line.strip()!r}")
        handlers[match[1]] = match[2]
    return handlers


class ToyInstance:
    """One toy guest: it keeps nothing between calls."""

    def __init__(self, compiled: ToyCompiled) -> None:
        self.compiled = compiled

    def call(self, handler: str, event: dict[str, Any], deadline: float) -> Any:
        """Run ``handler`` on ``event``; the host API is reached as every runtime reaches it."""
        reply = self.compiled.table.get(handler)
        if reply is None:
            raise GuestError(f"no handler {handler!r}")
        if reply.startswith("!"):
            raise GuestError(reply[1:])
        if reply.startswith("+"):
            host = Host(self.compiled.spec, deadline)
            try:
                count = int(host.kv_get(reply[1:]) or 0) + 1
                host.kv_set(reply[1:], count)
            finally:
                host.close()
            return str(count)
        return reply.replace("{args}", str(event.get("args", ""))).replace("{text}", str(event.get("text", "")))

    def close(self) -> None:
        """Nothing to release."""


class ToyCompiled(FreshInstanceIsolation):
    """A toy plugin version: its source (or binary) parsed once."""

    thread_bound = False

    def __init__(self, spec: PluginSpec) -> None:
        self.spec = spec
        code = spec.code
        if isinstance(code, bytes):
            if not code.startswith(MAGIC):
                raise CompileError("not a toy binary (it must start with TOY\\0)")
            code = code[len(MAGIC):].decode()
        self.table = _parse(code)
        self.handlers = frozenset(self.table)

    def new_instance(self, deadline: float | None = None) -> ToyInstance:
        return ToyInstance(self)
