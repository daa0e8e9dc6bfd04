"""Compiling a Lua plugin's source to bytecode, bounded in memory (the plugin's cap) and in time.

No hook runs inside Lua's parser, and its cost is not linear in the source: it keeps every
constant in one table (``ls->h``), grown in one step, and numbers are hashed without a seed
(``k % (2^n - 1)``). Under Lua 5.4 65,537 integer constants colliding at one place (712 KB of
source) took 11 s to compile; Lua 5.5 grows a table without lookups, but as many constants
placed on a displaced chain (tests/plugins/test_lua_hostile.py, 708 KB) still take ~2 s, and
it grows quadratically from there, on the thread that saves or loads the plugin. A source up
to ``INPROCESS_BYTES`` (worst case measured ~0.15 s)
compiles in this process; a larger one in a child process stopped at ``TIMEOUT_SECONDS``, as
WASM modules are (plugins/runtimes/wasm.py).
"""
from __future__ import annotations

import subprocess
import sys

import lupa.lua55 as lupa

from ..errors import CompileError
from ..spec import PluginSpec
from .base import COMPILE_NICE

#: Bytes of source compiled in this process (most plugins: no child process, no ~50 ms).
INPROCESS_BYTES = 64 << 10
#: Seconds a child process may spend compiling a larger source (real plugins take milliseconds).
TIMEOUT_SECONDS = 5.0

#: Run in a runtime with the full standard library: (true, bytecode) or (false, message).
_DUMP = ("local src, name = ...; local f, e = load(src, name, 't') "
         "if not f then return false, e end return true, string.dump(f)")

# The compiling child: the same load and dump under the same memory cap, at COMPILE_NICE; writes
# b"B" + the bytecode or b"E" + Lua's message.
_CHILD = """
import os, sys
os.nice(int(sys.argv[4]))  # background work every worker does at once: serving goes first
import lupa.lua55 as lupa
rt = lupa.LuaRuntime(encoding=None, register_eval=False, register_builtins=False, max_memory=int(sys.argv[1]))
try:
    ok, out = rt.execute(sys.argv[3], sys.stdin.buffer.read(), sys.argv[2].encode())
except lupa.LuaMemoryError:
    ok, out = False, b"not enough memory"
sys.stdout.buffer.write((b"B" if ok else b"E") + out)
"""


def refuse_attributes(obj: object, name: object, is_setting: bool) -> object:
    """lupa's attribute filter for plugin runtimes: no Python attribute is ever reachable."""
    raise AttributeError(f"plugins cannot access Python attributes (tried {name!r})")


def compile_bytecode(spec: PluginSpec) -> bytes:
    """Compile plugin source once (text mode only) and return its Lua 5.5 bytecode."""
    if not isinstance(spec.code, str):
        raise CompileError("Lua plugins are source text, not bytes")
    if spec.code.startswith("\x1bLua"):
        raise CompileError("Lua bytecode is refused: upload the plugin's source text")
    source, name = spec.code.encode(), f"={spec.name}"
    # Under the plugin's memory cap: the parser's tables and the bytecode (up to ~3x the source)
    # were allocated without one, and the bytecode must fit the cap to be loaded anyway.
    if len(source) <= INPROCESS_BYTES:
        ok, out = _compile_here(source, name, spec.memory_bytes)
    else:
        ok, out = _compile_in_child(source, name, spec.memory_bytes)
    if ok:
        return out
    message = out.decode("utf-8", "replace") or "syntax error"
    if message == "not enough memory":
        raise CompileError(f"compiling the source needs more than the plugin's memory cap of {spec.memory_bytes} "
                           "bytes; make the code smaller, or raise the plugin's memory_mb", code="memory_limit")
    raise CompileError(message)


def _compile_here(source: bytes, name: str, memory: int) -> tuple[bool, bytes]:
    rt = lupa.LuaRuntime(encoding=None, register_eval=False, register_builtins=False,
                         attribute_filter=refuse_attributes, max_memory=memory)
    try:
        ok, out = rt.execute(_DUMP, source, name.encode())
    except lupa.LuaMemoryError:
        return False, b"not enough memory"
    return bool(ok), out


def _compile_in_child(source: bytes, name: str, memory: int) -> tuple[bool, bytes]:
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _CHILD, str(memory), name, _DUMP, str(COMPILE_NICE)],
                              input=source, capture_output=True, timeout=TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        raise CompileError(f"compiling the source took more than {TIMEOUT_SECONDS:g} s (Lua's parser is quadratic in "
                           "some sources, e.g. many integer constants); make it smaller, or move data out of the "
                           "code (e.g. into the plugin's KV store)", code="timeout") from None
    except OSError:  # no child process here (a sandbox): compile here, unbounded in time
        return _compile_here(source, name, memory)
    out = done.stdout
    if done.returncode or out[:1] not in (b"B", b"E"):
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines() or ["no message"]
        raise CompileError(f"compiling the source failed in its child process (exit status {done.returncode}: "
                           f"{lines[-1][:200]})")
    return out[:1] == b"B", out[1:]
