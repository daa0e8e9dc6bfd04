"""Lua 5.5 through lupa (``lupa.lua55``): a locked-down environment, an un-swallowable time budget and a memory cap.

Sandbox (built once per lupa runtime, in Lua, while the standard library is still reachable):
- guests see only a base table of safe functions: no os, io, debug, load/loadfile/dofile,
  require, collectgarbage or string.dump, and no ``python`` table; lupa runs with
  ``register_eval=False``, ``register_builtins=False`` and an attribute filter refusing every
  Python attribute;
- library tables (string, table, math, utf8, coroutine) are read-only proxies and the string
  metatable is protected, so no call can change what the next one sees;
- plugin source is compiled once per version with ``load(src, name, "t")`` (text only: a
  plugin can never hand us bytecode) and dumped, a large source in a child process bounded in
  time (``lua_compile.py``); only that bytecode of ours is ever loaded;
- a count hook checks the wall-clock deadline every ``HOOK_COUNT`` instructions and raises;
  once the budget is spent ``pcall``/``xpcall``/``coroutine.resume``/``wrap``/``close`` re-raise and
  new coroutines get the hook too, so neither pcall nor coroutines can swallow the timeout;
- ``max_memory`` caps the runtime's allocator (the plugin's memory cap);
- guards (``lua_guards.lua``): every library C function whose cost depends on its arguments
  (pattern functions, ``string.rep``, ``table.concat``/``move``/``sort``..., ``tonumber``) is
  replaced in the read-only library tables (and so in the string metatable) by a guard that
  bounds each native call's work before it starts, charges it to a meter that checks the
  deadline, and runs larger work in pieces the hook can stop (a pure-Lua pattern matcher,
  ``lua_patterns.lua``, chunked table ranges) or refuses it with a clear error (a result
  larger than the memory cap);
- a deadline watchdog (``lua_interrupt.py``) makes the count hook fire at the next instruction
  once a call is past its deadline, so a loop of O(n) instructions (``s .. "x"`` on a 30 MB
  string) cannot run for seconds between two hooks.
- weak tables and ``__call`` are off (``lua_interrupt.retire_events``: an ephemeron chain makes one
  GC step quadratic, a chain of callable tables one call instruction, seconds to minutes in one C
  call); ``setmetatable`` refuses ``__mode``, ``__gc`` and ``__call``;
- what crosses into Python after the deadline runs no guest code and is bounded: an error
  object's ``__tostring`` runs in the sandbox under the call's deadline, its text is cut to
  4 KiB of valid UTF-8; a table reply is read raw, at most ``MAX_REPLY_VALUES`` values (a
  table counted once per reference), ``MAX_DEPTH`` levels and strings up to ``MAX_REPLY_BYTES``
  characters in all (or the memory cap if smaller), with string/number keys only, within the
  call's deadline; any reply over ``MAX_REPLY_BYTES`` is refused by ``plugins.loaded``.
``GUARDS = False`` (or ``_LuaVM(..., guards=False)``) builds the sandbox without the guards and
the watchdog, for benchmarks.

Strategies: ``call_isolated`` (per_request) keeps one runtime per thread per plugin version
and runs every call in a fresh environment table with the bytecode loaded into it (full
isolation of everything the guest can write, at near pooled cost); ``new_instance`` (pooled,
sharded) is a runtime whose environment persists between calls (warm state).
"""
from __future__ import annotations

import threading
import time
import types
import weakref
from pathlib import Path
from typing import Any

import lupa.lua55 as lupa

from ..errors import CompileError, GuestError, GuestMemory, GuestQuota, GuestTimeout
from ..spec import PluginSpec
from .base import MAX_REPLY_BYTES, MAX_REPLY_DEPTH, load_budget_note, load_seconds, to_reply
from .host import MAX_LOG_CHARS, Host, HostCallError
from .kvstore import MAX_VALUE_CHARS
from .lua_compile import compile_bytecode, refuse_attributes
from .lua_interrupt import CALL_NAME, MODE_NAME, Interrupts, retire_events
from .lua_reaper import reaper

#: Instructions between two deadline checks (a check calls time.monotonic through lupa: ~1 us;
#: 10k Lua instructions take ~50-100 us, so the check costs ~1-2% and a timeout lands within
#: ~0.1 ms of the deadline).
HOOK_COUNT = 10_000
TIMEOUT_MSG = "execapp: timeout: the plugin ran past its time budget"
MAX_DEPTH = MAX_REPLY_DEPTH - 1  # tables below the reply's own: MAX_REPLY_DEPTH levels of JSON
#: Values (tables and their entries) one table reply may hold. Converting runs in Python after
#: the guest's deadline, so it is bounded before it starts: a table shared by reference is
#: converted once per reference (30 levels of ``t = {t, t}`` are 2**30 values in 30 tables). A
#: reply this large is over MAX_REPLY_BYTES as JSON anyway (each value takes 2 bytes or more).
MAX_REPLY_VALUES = MAX_REPLY_BYTES // 2
#: Bytes a string argument of a host call may have (lua_sandbox.lua's host_call refuses more before
#: any work): a KV value's MAX_VALUE_CHARS at 4 bytes a character; a log line is cut instead.
HOST_ARG_MAX = 4 * MAX_VALUE_CHARS
#: Table entries read between two checks of the deadline, in the sandbox's count and the converter
#: (which also check it before every table: a traversal's first step scans the table's array part,
#: however few entries it holds): each step of a traversal (lua_next) walks the chain of the key it
#: left, which integer keys (hashed without a seed) can make as long as the table: 64 steps of a
#: 500,000-node chain are ~30 ms.
ENTRIES_PER_CHECK = 64
#: Bytes of Lua memory a per_request call may leave behind in its thread's runtime (the sandbox
#: itself is ~100 KB): past this the call's garbage is collected as it ends (lua_sandbox.lua).
ISOLATED_KEEP_BYTES = 1 << 20

#: Build sandboxes with the library guards (lua_guards.lua). Off only to measure what they cost.
GUARDS = True
#: How a guard's refusal of a result larger than the memory cap starts (status 3, memory_limit).
MEMORY_MARK = "execapp: memory_limit: "
#: The guards' cost model, in units of about one nanosecond of native work on an idle core
#: (measured in tests/plugins/test_lua_containment.py and docs/plugins.md):
GUARD_LIMITS = {
    "LIMIT": 1_000_000,        # work between two deadline checks of the meter (~1 ms)
    "NATIVE_MAX": 4_000_000,   # the most one native call may do (~4 ms); more runs in pieces
    "LINEAR_MAX": 64_000_000,  # the same for work linear in the subject (like s:upper(): ~10 ms)
    "FREE": 20_000,            # a call bounded this low is not charged (the hook covers it)
    "BIG": 4096,               # strings up to this many bytes are not charged (cheaper than a hook)
    "CHUNK": 4096,             # table elements per native call over a range
    "CACHE_MAX": 256,          # pattern cost descriptors kept per runtime
    "W_STEP": 8,               # one step of the native pattern matcher
    "W_BYTE": 1,               # one byte of a linear string function
    "W_ELEM": 40,              # one table element read/written by a C loop (lua_geti/seti)
    "W_CMP": 60,               # one comparison of table.sort's default order
    "W_HOP": 16,               # one hop of an access along a metatable's __index/__newindex chain
}


def _stripped_chunk(filename: str) -> bytes:
    """A Lua file of this package compiled once and stripped (no positions of ours in errors)."""
    src = Path(__file__).with_name(filename).read_bytes()
    rt = lupa.LuaRuntime(encoding=None, register_eval=False, register_builtins=False)
    return rt.execute("local src, name = ...; return string.dump(assert(load(src, name, 't')), true)",
                      src, b"=execapp")


_GUARDS_BYTECODE = _stripped_chunk("lua_guards.lua")
_PATTERNS_BYTECODE = _stripped_chunk("lua_patterns.lua")

#: The sandbox chunk (lua_sandbox.lua), run once per runtime before any guest code.
_SANDBOX = Path(__file__).with_name("lua_sandbox.lua").read_text()


class _HostGate:
    """The ``py_host`` function a VM's sandbox calls for the host API (``name, *args``).

    It holds the deadline of the VM's current call (set by the VM before every call) and the
    call's one Host: made at the call's first host call (most calls never make one), replaced
    when a host call comes with a new deadline (the next call), and closed by ``py_host(nil)``,
    which the sandbox's ``outcome`` sends when a call that used the host ends. It is not the VM
    itself so that the Lua runtime holds no reference back to the VM: a dropped VM, and its
    runtime of up to ``memory_bytes``, is freed at once rather than at the next cyclic GC.
    """

    __slots__ = ("spec", "deadline", "host")

    #: How a message that ends the call starts (a quota: STOP + code + ": " + message).
    STOP = "execapp: "

    def __init__(self, spec: PluginSpec) -> None:
        self.spec = spec
        self.deadline: float | None = None
        self.host: Host | None = None

    def __call__(self, name: str | None, *args: Any) -> tuple:
        # Called from Lua: never raise into Lua (the guest would see a Python object); return
        # (ok, value-or-message[, stop]) and let the Lua wrapper raise a plain string error;
        # ``stop`` marks a timeout or quota, which ends the call.
        host = self.host
        if name is None:
            if host is not None:
                self.host = None
                host.close()
            return True, None
        if self.deadline is None:
            return False, f"{name}: no host call in progress"
        if host is None or host.deadline != self.deadline:
            if host is not None:
                host.close()
            host = self.host = Host(self.spec, self.deadline)
        try:
            return True, getattr(host, name)(*args)
        except GuestTimeout as exc:
            return False, f"{TIMEOUT_MSG}: {exc}", True
        except GuestQuota as exc:
            return False, f"{self.STOP}{exc.code}: {exc}", True
        except (HostCallError, TypeError, ValueError) as exc:
            return False, str(exc)
        except Exception as exc:  # HostDenied, database or Redis errors: the guest sees the message
            return False, str(exc)


class _LuaVM:
    """One sandboxed lupa runtime of one plugin version (used by one thread at a time)."""

    def __init__(self, spec: PluginSpec, bytecode: bytes, guards: bool | None = None) -> None:
        self.spec = spec
        self.bytecode = bytecode
        self.chunkname = f"={spec.name}"
        self.gate = _HostGate(spec)
        if guards is None:
            guards = GUARDS
        try:
            self.rt = lupa.LuaRuntime(register_eval=False, register_builtins=False, unpack_returned_tuples=True,
                                      attribute_filter=refuse_attributes, max_memory=spec.memory_bytes)
            limits = self.rt.table_from({**GUARD_LIMITS, "memory": spec.memory_bytes, "MEM_MARK": MEMORY_MARK,
                                         "MODE_NAME": MODE_NAME, "CALL_NAME": CALL_NAME,
                                         "ISOLATED_KEEP": ISOLATED_KEEP_BYTES,
                                         "MAX_REPLY_BYTES": MAX_REPLY_BYTES,
                                         "MAX_REPLY_VALUES": MAX_REPLY_VALUES, "MAX_DEPTH": MAX_DEPTH,
                                         "HOST_ARG_MAX": HOST_ARG_MAX, "LOG_MAX": 4 * MAX_LOG_CHARS,
                                         "ENTRIES_PER_CHECK": ENTRIES_PER_CHECK})
            # The deadline watchdog's view of this VM's states (no reference back to the VM).
            self._irq = irq = Interrupts()
            self._new_env, self._call, fresh_for, self._functions, main, self._settle = self.rt.execute(
                _SANDBOX, time.monotonic, self.gate, HOOK_COUNT, TIMEOUT_MSG,
                _GUARDS_BYTECODE if guards else None, _PATTERNS_BYTECODE, limits,
                irq.register if guards else None)
            retire_events(main)  # before any guest code runs here (lua_interrupt.py)
            if guards:
                irq.attach(main, HOOK_COUNT)
        except lupa.LuaMemoryError:
            raise CompileError(f"the memory cap of {spec.memory_bytes} bytes is too small for the Lua "
                               "sandbox") from None
        self._table_from = self.rt.table_from
        # The per_request call of this version (call_isolated): loads the chunk at its first call.
        self._fresh = fresh_for(bytecode, self.chunkname)
        # A table reply's strings, in characters (each at least one byte of the reply's JSON):
        # converting stops past them, before plugins.loaded refuses the reply as over MAX_REPLY_BYTES.
        self._reply_chars = min(spec.memory_bytes, MAX_REPLY_BYTES)

    def load_env(self, deadline: float) -> Any:
        """Run the plugin's top level in a new environment; the environment, or raise."""
        irq = self._irq
        irq.running = deadline
        try:
            env, status, err = self._new_env(self.bytecode, self.chunkname, deadline)
        except lupa.LuaError as exc:  # e.g. the hook's timeout, fired in the sandbox's own code after the pcall
            raise self._lua_error(exc, deadline) from None
        finally:
            irq.running = None
            if irq.coroutines:
                irq.end_call()
        if env is None:
            _raise(status, err, self.spec)
        return env

    def functions(self, env: Any, deadline: float) -> frozenset[str]:
        """The names of ``env``'s functions (its handlers), read within ``deadline`` (GuestTimeout past it)."""
        names = self._functions(env, deadline)
        if names is None:
            raise GuestTimeout("its environment was still being read for handler names")
        return frozenset(names.values())

    # The two call paths below are the hot path (see plugins/strategies.py): the event becomes
    # a Lua table in one C call (no JSON), a str reply comes back as is. ``irq.running`` is the
    # call's deadline for the watchdog (lua_interrupt.py) while the guest runs.

    def call_env(self, env: Any, handler: str, event: dict[str, Any], deadline: float) -> Any:
        """``handler`` of ``env`` (an environment of this runtime) on ``event``."""
        self.gate.deadline = deadline
        irq = self._irq
        irq.running = deadline
        table_from = self._table_from  # (a local: self._table_from(...) is a lookup Python 3.11 cannot specialize)
        try:
            table = table_from(event, recursive=True)
        except OverflowError:  # an integer past Lua's 64 bits (see _fit_ints)
            table = table_from(_fit_ints(event), recursive=True)
        try:
            lua_call = self._call
            status, value = lua_call(env, handler, table, deadline)
        except lupa.LuaError as exc:  # raised outside the guest's pcall (the sandbox's own limits)
            raise self._lua_error(exc, deadline) from None
        except UnicodeDecodeError:  # lupa decodes a str reply as UTF-8
            raise GuestError(NOT_TEXT) from None
        finally:
            irq.running = None
            if irq.coroutines:
                irq.end_call()
        if status:
            _raise(status, value, self.spec)
        return value if value.__class__ is str else to_reply(_to_python(value, self._reply_chars, deadline))

    def call_fresh(self, handler: str, event: dict[str, Any], deadline: float) -> Any:
        """``handler`` on ``event`` in a fresh environment of this VM (the plugin's top level runs
        first): the per_request path, LuaCompiled.call_isolated, on this VM (for tests that hold one;
        a VM poisoned by the call is retired, as call_isolated does)."""
        return LuaCompiled.call_isolated(_OneVM(self), handler, event, deadline)  # type: ignore[arg-type]

    def retire(self) -> None:
        """Free this VM's runtime on the reaper thread (lua_reaper.py), not the caller's; unusable after."""
        self._irq.forget()  # before the runtime can be freed
        rt, settle = self.rt, self._settle
        self._new_env = self._call = self._fresh = self._functions = self._table_from = self._settle = None
        self.rt = None
        if rt is not None:
            reaper.retire(rt, settle)

    def __del__(self) -> None:
        # Runs before the runtime is released: the watchdog must never write to a freed state.
        irq = self.__dict__.get("_irq")
        if irq is not None:
            irq.forget()

    def _lua_error(self, exc: Exception, deadline: float) -> GuestError:
        if isinstance(exc, lupa.LuaMemoryError):
            return GuestMemory(f"memory cap of {self.spec.memory_bytes} bytes exceeded")
        return GuestTimeout() if time.monotonic() >= deadline else GuestError(str(exc), poison=True)


def _fit_ints(value: Any) -> Any:
    """``value`` with every integer past Lua's 64 bits made a float (infinite past a float's range),
    as JavaScript reads such a JSON number: a client's event data may hold any integer, and lupa
    refuses to convert one it cannot fit (OverflowError)."""
    if isinstance(value, dict):
        return {k: _fit_ints(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_fit_ints(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -2 ** 63 <= value < 2 ** 63:
        try:
            return float(value)
        except OverflowError:
            return float("inf") if value > 0 else float("-inf")
    return value


def _raise(status: int, message: Any, spec: PluginSpec) -> None:
    if status == 2:
        detail = str(message)[len(TIMEOUT_MSG) + 2:] if str(message).startswith(TIMEOUT_MSG + ": ") else ""
        raise GuestTimeout(detail or f"ran past its {spec.timeout * 1000:g} ms timeout")
    if status == 3:
        text = str(message)
        if MEMORY_MARK in text:  # a guard refused a result too large for the cap (names the call)
            raise GuestMemory(text.replace(MEMORY_MARK, "", 1))
        raise GuestMemory(f"memory cap of {spec.memory_bytes} bytes exceeded")
    if status == 4:
        code, _, detail = str(message)[len(_HostGate.STOP):].partition(": ")
        raise GuestQuota(code, detail)
    raise GuestError(str(message))


NOT_TEXT = "the reply is not valid UTF-8 text; return text, or encode binary data (e.g. as hex)"


def _to_python(value: Any, string_chars: int, deadline: float) -> Any:
    """A Lua reply as JSON-able Python: tables with keys 1..n become lists, others dicts.

    Bounded before any work it cannot afford: at most MAX_REPLY_VALUES values, MAX_DEPTH levels
    and ``string_chars`` characters of strings (the memory cap: a string shared by reference
    would otherwise be copied into Python once per reference), and within the call's
    ``deadline`` (checked at every table and every ENTRIES_PER_CHECK entries). No guest code runs (the hook is off
    now): tables are read raw, and a key must be a string, number or boolean (a table key's
    ``__tostring`` would be guest code)."""
    if value is None or value.__class__ is str:
        return value
    try:
        return _Reply(string_chars, deadline).convert(value, 0)
    except UnicodeDecodeError:
        raise GuestError(NOT_TEXT) from None


class _Reply:
    """What is left of a reply's budget while it is converted."""

    __slots__ = ("values", "chars", "deadline")

    def __init__(self, string_chars: int, deadline: float) -> None:
        self.values = MAX_REPLY_VALUES
        self.chars = string_chars
        self.deadline = deadline

    def convert(self, value: Any, depth: int) -> Any:
        cls = value.__class__
        if value is None or cls is str or cls is int or cls is float or cls is bool:  # (a str: charged already)
            return value
        if lupa.lua_type(value) != "table":  # a function or coroutine: lupa names it, no guest code runs
            return str(value)
        if depth > MAX_DEPTH:
            raise GuestError(f"reply nested deeper than {MAX_DEPTH} levels")
        self.values -= 1
        if time.monotonic() > self.deadline:  # (every table: see ENTRIES_PER_CHECK)
            raise GuestTimeout("ran past its timeout while its reply was converted")
        keys: list = []
        values: list = []
        left = self.values  # (a local in the loop: this is the conversion's hot path)
        for k, v in value.items():  # lua_next: raw, no __pairs/__index
            left -= 1
            if left < 0:
                raise GuestError(f"the reply holds more than {MAX_REPLY_VALUES} values (tables and their entries, a "
                                 "table counted once per reference); return fewer")
            if not left % ENTRIES_PER_CHECK and time.monotonic() > self.deadline:  # (a lua_next may walk a chain)
                raise GuestTimeout("ran past its timeout while its reply was converted")
            kc = k.__class__
            if kc is str:
                self._charge(k)
            elif kc is bool:  # as Lua writes it (str() gave "True")
                k = "true" if k else "false"
            elif kc is not int and kc is not float:
                raise GuestError(f"a table in the reply has a {lupa.lua_type(k)} as a key; use string or number keys")
            if v.__class__ is str:
                # Charged now, not when converted below (convert() takes it as charged): lupa has
                # already copied it into Python, and one string in every entry of a table (200 x
                # 4 MB under a 16 MB cap) would be copied once per entry before the first charge.
                self._charge(v)
            keys.append(k)
            values.append(v)
        self.values = left
        if keys and all(k.__class__ is int for k in keys):
            order = sorted(range(len(keys)), key=keys.__getitem__)
            if keys[order[0]] == 1 and keys[order[-1]] == len(keys):  # distinct ints: exactly 1..n
                return [self.convert(values[i], depth + 1) for i in order]
        return {str(k): self.convert(v, depth + 1) for k, v in zip(keys, values)}

    def _charge(self, text: str) -> None:
        self.chars -= len(text)
        if self.chars < 0:
            raise GuestError(f"the reply's strings are longer than {MAX_REPLY_BYTES} characters in all "
                             "(MAX_REPLY_BYTES, or the memory cap if smaller; a string referenced many times "
                             "counts each time); return less text")


class LuaInstance(_LuaVM):
    """A pooled/sharded instance: its own runtime and one environment that persists (warm)."""

    def __init__(self, compiled: "LuaCompiled", deadline: float | None = None) -> None:
        super().__init__(compiled.spec, compiled.bytecode)
        due = time.monotonic() + compiled.spec.timeout
        self.env = self.load_env(due if deadline is None else min(due, deadline))

    def call(self, handler: str, event: dict[str, Any], deadline: float) -> Any:
        # _LuaVM.call_env inlined (one frame less on the hot path).
        self.gate.deadline = deadline
        irq = self._irq
        irq.running = deadline
        table_from = self._table_from  # (a local: self._table_from(...) is a lookup Python 3.11 cannot specialize)
        try:
            table = table_from(event, recursive=True)
        except OverflowError:  # an integer past Lua's 64 bits (see _fit_ints)
            table = table_from(_fit_ints(event), recursive=True)
        try:
            lua_call = self._call
            status, value = lua_call(self.env, handler, table, deadline)
        except lupa.LuaError as exc:
            raise self._lua_error(exc, deadline) from None
        except UnicodeDecodeError:
            raise GuestError(NOT_TEXT) from None
        finally:
            irq.running = None
            if irq.coroutines:
                irq.end_call()
        if status:
            _raise(status, value, self.spec)
        return value if value.__class__ is str else to_reply(_to_python(value, self._reply_chars, deadline))

    def close(self) -> None:
        self.env = None  # (first: the collection on the reaper thread frees the environment)
        self.retire()


class _OneVM:
    """LuaCompiled.call_isolated's view of one given VM (_LuaVM.call_fresh)."""

    def __init__(self, vm: _LuaVM) -> None:
        self._local = types.SimpleNamespace(vm=vm)
        self._live: set[_LuaVM] = set()


class LuaCompiled:
    """A Lua plugin version: source compiled once to bytecode, validated in the sandbox."""

    thread_bound = False

    def __init__(self, spec: PluginSpec) -> None:
        self.spec = spec
        self.bytecode = compile_bytecode(spec)
        vm = _LuaVM(spec, self.bytecode)
        try:
            # The top level runs under the plugin's own budget and guards: a runaway one is
            # refused at save (and skipped at worker start, plugins/sync.py) as `timeout`.
            due = time.monotonic() + load_seconds(spec)
            env = vm.load_env(due)
            self.handlers = vm.functions(env, due)
        except GuestTimeout as exc:
            note = load_budget_note(spec)
            if note:
                raise CompileError(f"the top level ran past {load_seconds(spec) * 1000:g} ms ({exc}){note}; keep the "
                                   "top level to definitions and do the work in handlers", code="timeout") from None
            raise CompileError(f"the top level ran past the plugin's timeout of {spec.timeout * 1000:g} ms ({exc}); "
                               "keep the top level to definitions and do the work in handlers, or raise "
                               "timeout_ms", code="timeout") from None
        except GuestMemory as exc:
            raise CompileError(f"the top level hit the memory cap: {exc}", code="memory_limit") from None
        except GuestError as exc:
            raise CompileError(f"the top level failed: {exc}") from None
        self._local = threading.local()  # per-thread VM for call_isolated
        # The per-thread VMs alive now: a VM goes with its thread's locals when a pool thread
        # exits, so a counter bumped at creation would only grow.
        self._live: weakref.WeakSet = weakref.WeakSet()

    def new_instance(self, deadline: float | None = None) -> LuaInstance:
        return LuaInstance(self, deadline)

    def call_isolated(self, handler: str, event: dict[str, Any], deadline: float) -> Any:
        # One runtime per thread (a lupa runtime serializes threads on its lock); a fresh
        # environment per call. A VM whose call timed out or hit the memory cap is dropped.
        # The fresh call itself is inline here (one frame less on the per_request hot path):
        # _LuaVM.call_fresh comes here too.
        try:
            vm = self._local.vm
        except AttributeError:
            vm = self._local.vm = _LuaVM(self.spec, self.bytecode)
            self._live.add(vm)
        vm.gate.deadline = deadline
        irq = vm._irq
        irq.running = deadline
        table_from = vm._table_from  # (a local: vm._table_from(...) is a lookup Python 3.11 cannot specialize)
        try:
            try:
                table = table_from(event, recursive=True)
            except OverflowError:  # an integer past Lua's 64 bits (see _fit_ints)
                table = table_from(_fit_ints(event), recursive=True)
            try:
                fresh = vm._fresh
                status, value, held = fresh(handler, table, deadline)
            except lupa.LuaError as exc:
                raise vm._lua_error(exc, deadline) from None
            except UnicodeDecodeError:
                raise GuestError(NOT_TEXT) from None
            finally:
                irq.running = None
                if irq.coroutines:
                    irq.end_call()
            if held:  # coroutines the call resumed, and what they hold: freed now, not at this thread's next call
                settle = vm._settle
                settle()
            if status:
                _raise(status, value, vm.spec)
            return value if value.__class__ is str else to_reply(_to_python(value, vm._reply_chars, deadline))
        except GuestError as exc:
            if exc.poison:
                del self._local.vm
                self._live.discard(vm)
                vm.retire()
            raise

    def idle_isolated(self) -> int:
        return len(self._live)

    def close(self) -> None:
        self._local = threading.local()
