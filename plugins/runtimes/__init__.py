"""Runtimes behind one interface (plugins.runtimes.base): Lua (lupa), WASM (wasmtime), JS (QuickJS)."""
from __future__ import annotations

from ..spec import PluginSpec
from .base import Compiled, Instance


def compile_plugin(spec: PluginSpec) -> Compiled:
    """Compile and validate ``spec`` in its runtime's sandbox; raises plugins.errors.CompileError."""
    if spec.runtime == "lua":
        from .lua import LuaCompiled
        return LuaCompiled(spec)
    if spec.runtime == "wasm":
        from .wasm import WasmCompiled
        return WasmCompiled(spec)
    if spec.runtime == "js":
        from .js import JsCompiled
        return JsCompiled(spec)
    from ..errors import CompileError
    raise CompileError(f"unknown runtime {spec.runtime!r}; use lua, wasm or js")


__all__ = ["Compiled", "Instance", "compile_plugin"]
