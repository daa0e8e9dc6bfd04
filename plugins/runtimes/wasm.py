"""WebAssembly through wasmtime: compiled once per version, an epoch deadline per call, memory caps.

ABI (docs/plugins.md has the full text):
- the module exports ``memory``, ``alloc(len: i32) -> i32`` and each handler as
  ``name(ptr: i32, len: i32) -> i64``;
- per call the host calls ``alloc(n)`` once, writes the event as UTF-8 JSON there (its first
  key is always ``"args"``), calls the handler and reads the reply from the returned
  ``(ptr << 32) | len``; 0 means no reply. A reply starting with ``{`` or ``[`` is JSON
  data, anything else is text. ``alloc`` may reuse memory of earlier calls (bump allocator);
- host functions are imported from module ``env`` (all optional): ``log(ptr, len)``,
  ``kv_get(kptr, klen, out, cap) -> i32`` (-1 if missing, else the value's byte length; at
  most ``cap`` bytes copied), ``kv_set(kptr, klen, vptr, vlen)``,
  ``kv_incr(kptr, klen, delta: i64) -> i64`` (the new value), ``sleep(ms: i32)``,
  ``http_get(uptr, ulen, out, cap) -> i32`` (body length, at most ``cap`` bytes copied). A
  denied or failing host call traps with the host's message; so does one past the deadline
  (reported as ``timeout``) or past a host quota (reported with the quota's code). One
  plugins.runtimes.host.Host serves all host calls of one guest call and is closed when it returns.

Limits: one process-wide Engine with epoch interruption, ticked by a daemon thread every
``EPOCH_TICK`` seconds of the clock while a guest call runs (``_Ticker``); each call sets its store's
deadline from the call's deadline (trap code INTERRUPT -> timeout). An instance is
instantiated by its first call, so a start function runs inside that call's deadline (an
inline call's too), not a budget of its own.
Each store has one linear memory, capped by ``Store.set_limits`` (``memory.grow`` returns -1
past it), at most ``MAX_TABLES`` tables of ``MAX_TABLE_ELEMENTS``, and reserves
``MEMORY_RESERVATION`` bytes of address space instead of wasmtime's default 4 GiB; the GC
proposal and exception handling (a second heap of their own) are off. Compiling cannot be interrupted: its cost is
bounded before it starts (``MAX_MODULE_BYTES``, the section counts of ``MAX_COUNTS``) and it
runs in a child process limited to ``COMPILE_TIMEOUT_SECONDS`` and ``COMPILE_MEMORY_BYTES``.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import json
import math
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, NoReturn, TypeVar

import wasmtime
from wasmtime import _ffi as ffi
from wasmtime import _func as _wasm_func

from ..errors import CompileError, GuestError, GuestMemory, GuestQuota, GuestTimeout
from .base import (
    COMPILE_NICE,
    MAX_REPLY_BYTES,
    FreshInstanceIsolation,
    load_budget_note,
    load_seconds,
    to_json,
    to_reply,
)
from .host import Host
from .weighed_lru import WeighedLRU

EPOCH_TICK = 0.005
MEMORY_RESERVATION = 64 << 20
#: Tables per instance and elements per table: table memory is outside the memory cap.
MAX_TABLES = 4
MAX_TABLE_ELEMENTS = 100_000
#: Bytes of one module binary (the admin's upload limit too).
MAX_MODULE_BYTES = 4 << 20
#: A compile runs in a child process with this much time and address space (the largest
#: module within MAX_COUNTS measured ~2.7 s and ~580 MiB on 2 cores).
COMPILE_TIMEOUT_SECONDS = 10.0
COMPILE_MEMORY_BYTES = 2 << 30
#: Section id -> (what it counts, the most a module may declare). Compiling costs ~40 us and
#: ~6 KB per function (~170 us per exported one, which gets a trampoline), and wasmtime cannot
#: interrupt it: 200,000 functions took 8 s and 1.1 GB, 50,000 exports 11 s. wasmparser's own
#: limits are 10-100x these.
MAX_COUNTS: dict[int, tuple[str, int]] = {
    1: ("types", 10_000), 2: ("imports", 100), 3: ("functions", 20_000), 4: ("tables", MAX_TABLES),
    5: ("memories", 1), 6: ("globals", 10_000), 7: ("exports", 1_000), 9: ("element segments", 10_000),
    11: ("data segments", 10_000),
}
MAX_COUNTS_BY_NAME = {what: limit for what, limit in MAX_COUNTS.values()}
RESERVED_EXPORTS = frozenset({"memory", "alloc", "dealloc", "_start", "_initialize"})

# The call running on this thread: ``call`` (its spec and deadline), ``host`` (its Host, made at
# its first host call: most calls make none) and ``host_error``.
_tls = threading.local()


#: The Engine's settings (the compiling child process builds the same Engine from them). GC
#: objects would live in a heap of their own, capped apart from linear memory: a second cap.
#: So would thrown exceptions (wasmtime allocates each on that GC heap): a guest that kept
#: caught ones in an exnref table held its whole memory cap again (8 MiB of linear memory plus
#: 8 MiB of exceptions at an 8 MiB cap).
ENGINE_SETTINGS: dict[str, Any] = {"epoch_interruption": True, "memory_reservation": MEMORY_RESERVATION,
                                   "memory_guard_size": 64 << 10, "wasm_gc": False, "wasm_exceptions": False}


def _make_engine() -> wasmtime.Engine:
    config = wasmtime.Config()
    for name, value in ENGINE_SETTINGS.items():
        setattr(config, name, value)
    return wasmtime.Engine(config)


ENGINE = _make_engine()


#: The most ticks one late wake of the ticker adds (a minute's): past a stopped process's pause.
MAX_CATCH_UP_TICKS = int(60 / EPOCH_TICK)

# wasmtime_engine_increment_epoch through a handle that keeps the GIL (ctypes.PyDLL): through
# wasmtime-py's (ctypes.CDLL) every call gives the GIL up and waits to take it back, another
# switch interval (5 ms) per tick while other threads run Python. It is one atomic add.
_increment_epoch = ctypes.PyDLL(str(ffi.filename)).wasmtime_engine_increment_epoch
_increment_epoch.argtypes = [ctypes.POINTER(ffi.wasm_engine_t)]
_increment_epoch.restype = None


#: The ticker's wait between wakes (tests stall it).
_tick_sleep = time.sleep


def _advance_epoch(ticks: int) -> None:
    """Advance ENGINE's epoch by ``ticks`` without giving up the GIL (the ticker's late wakes)."""
    engine = ENGINE.ptr()
    for _ in range(ticks):
        _increment_epoch(engine)


class _Ticker:
    """The process's epoch ticker: one daemon thread (started at the first guest call) that
    advances ENGINE's epoch every EPOCH_TICK while a guest call is inside wasmtime, and waits
    without waking while none is."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._active = 0
        self._thread: threading.Thread | None = None
        #: The time up to which the epoch counts (None while idle): read by other threads (owed).
        self._last: float | None = None

    def enter(self) -> None:
        """A guest call is about to run under an epoch deadline: the epoch must advance."""
        with self._cv:
            self._active += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="wasm-epoch", daemon=True)
                self._thread.start()
            elif self._active == 1:
                self._cv.notify()

    def leave(self) -> None:
        """That call is out of wasmtime."""
        with self._cv:
            self._active -= 1

    def owed(self) -> int:
        """Ticks of time already past that the ticker's next wake adds: a deadline set now adds
        them too, or a call starting while a wake is late loses that much of its budget (after a
        stopped process resumed: all of it)."""
        last = self._last
        if last is None:
            return 0
        return min(max(0, int((time.monotonic() - last) / EPOCH_TICK)), MAX_CATCH_UP_TICKS)

    def _run(self) -> None:
        # Ticking only while calls run: a thread that woke 200 times a second for ever took the
        # GIL from the event loop each time in every worker, WASM plugin or not. Deadlines
        # count ticks from the epoch at the call's start, so a paused epoch loses nothing.
        # The epoch follows the clock, not the wakes: a wake needs the GIL, and with other Python
        # threads busy each came ~10-20 ms late (a 0.3 s budget ran 3.4 s beside one busy
        # thread, 1 s ran 7.8 s beside four); a late wake adds every tick it missed (owed).
        cv = self._cv
        self._last = time.monotonic()
        while True:
            with cv:
                if not self._active:
                    self._last = None
                    while not self._active:
                        cv.wait()
                    self._last = time.monotonic()  # idle time is no call's: count from now
            _tick_sleep(EPOCH_TICK)
            now = time.monotonic()
            last = self._last
            ticks = int((now - last) / EPOCH_TICK)
            if ticks > MAX_CATCH_UP_TICKS:  # the process was stopped (SIGSTOP, a debugger): cap the burst
                ticks, last = MAX_CATCH_UP_TICKS, now
            else:
                last += ticks * EPOCH_TICK
            # The epoch first, then _last: a deadline set in between counts those ticks twice
            # (a few ms late), never not at all (early).
            _advance_epoch(ticks)
            self._last = last


_ticker = _Ticker()


def _after_fork_in_child() -> None:
    # A forked child has no ticker thread, only the parent's object (and maybe its lock held by
    # a thread that does not exist here): without a fresh one no epoch deadline of the child
    # would ever arrive (a guest loop ran forever).
    global _ticker
    _ticker = _Ticker()


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- host imports ---------------------------------------------------------------------------------

_R = TypeVar("_R")


class _HostTrap(Exception):
    """A host call failed; the guest traps with this message."""


def _host() -> Host:
    host = getattr(_tls, "host", None)
    if host is None:
        call = getattr(_tls, "call", None)
        if call is None:
            raise _HostTrap("host calls are not available while the module instantiates")
        host = _tls.host = Host(*call)
    return host


def _fail(exc: BaseException) -> _HostTrap:
    # The host API's own exception, which this thread's call reports (see WasmInstance._failure).
    _tls.host_error = exc
    return _HostTrap(str(exc))


def _raise_failed_entry(error: Any, trap: Any) -> NoReturn:
    """Raise what ended a call into wasmtime that failed: this thread's host-function exception if
    one trapped the guest, else wasmtime's error or trap.

    Not wasmtime-py's ``enter_wasm``: its trampoline keeps a host function's exception in one
    process-wide slot (``LAST_EXCEPTION``) and ``enter_wasm`` raises whatever is there on any trap,
    so a call that trapped on its own (or timed out) while another thread's host call had just
    failed reported that other call's error, another tenant's message included (18 of 72,000
    trapping calls with two other threads failing host calls). The trampoline still writes the
    slot: our own exception is taken back out of it, anyone else's left alone."""
    own = getattr(_tls, "trap", None)
    if own is not None:
        _tls.trap = None
        if _wasm_func.LAST_EXCEPTION is own:
            _wasm_func.LAST_EXCEPTION = None
    failure = wasmtime.WasmtimeError._from_ptr(error) if error else wasmtime.Trap._from_ptr(trap)
    if own is not None:
        raise own
    raise failure


def _mem(caller: wasmtime.Caller) -> wasmtime.Memory:
    mem = caller.get("memory")
    if not isinstance(mem, wasmtime.Memory):
        raise _HostTrap("the module exports no memory")
    return mem


def _read(caller: wasmtime.Caller, ptr: int, length: int, what: str, *, lossy: bool = False,
          limit: int = MAX_REPLY_BYTES) -> str:
    """The UTF-8 string at ``ptr``; ``what`` (a kv key, a URL) must be valid UTF-8, else the host
    call traps naming it. Only a ``lossy`` read (a log line) turns bad bytes into U+FFFD: strict is
    the default, so a new host import cannot forget it (kv_incr, added later, did: b"a\\xff" and
    b"a\\xfe" counted on one key)."""
    if length < 0 or length > limit:
        raise _HostTrap(f"string of {length} bytes is over the {limit}-byte limit")
    mem = _mem(caller)
    if ptr < 0 or ptr + length > mem.data_len(caller):
        raise _HostTrap(f"pointer {ptr}+{length} is outside linear memory")
    data = bytes(mem.read(caller, ptr, ptr + length))
    if lossy:
        return data.decode("utf-8", "replace")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Replaced, two different byte strings were one key (b"a\xff" and b"a\xfe" both "a\ufffd"):
        # a write to one silently overwrote the other.
        raise _HostTrap(f"{what} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); send "
                        "text, or encode binary data (hex, base64)") from None


def _write(caller: wasmtime.Caller, data: bytes, out: int, cap: int) -> int:
    n = min(len(data), max(cap, 0))
    if n:
        mem = _mem(caller)
        if out < 0 or out + n > mem.data_len(caller):
            raise _HostTrap(f"output buffer {out}+{n} is outside linear memory")
        mem.write(caller, data[:n], out)
    return len(data)


def _host_import(fn: Callable[..., _R]) -> Callable[..., _R]:
    """A host function the guest imports: a failure of the host API traps the guest with its message."""

    @functools.wraps(fn)
    def host_import(*args: Any) -> _R:
        try:
            return fn(*args)
        except _HostTrap as exc:
            _tls.trap = exc  # this thread's (see _raise_failed_entry)
            raise
        except Exception as exc:
            trap = _tls.trap = _fail(exc)
            raise trap from None

    return host_import


@_host_import
def _h_log(caller: wasmtime.Caller, ptr: int, length: int) -> None:
    _host().log(_read(caller, ptr, length, "log: the line", lossy=True))


@_host_import
def _h_kv_get(caller: wasmtime.Caller, kptr: int, klen: int, out: int, cap: int) -> int:
    value = _host().kv_get(_read(caller, kptr, klen, "kv_get: the key"))
    return -1 if value is None else _write(caller, value.encode(), out, cap)


@_host_import
def _h_kv_set(caller: wasmtime.Caller, kptr: int, klen: int, vptr: int, vlen: int) -> None:
    _host().kv_set(_read(caller, kptr, klen, "kv_set: the key"), _read(caller, vptr, vlen, "kv_set: the value"))


@_host_import
def _h_kv_incr(caller: wasmtime.Caller, kptr: int, klen: int, delta: int) -> int:
    return _host().kv_incr(_read(caller, kptr, klen, "kv_incr: the key"), delta)


@_host_import
def _h_sleep(ms: int) -> None:
    _host().sleep(ms)


@_host_import
def _h_http_get(caller: wasmtime.Caller, uptr: int, ulen: int, out: int, cap: int) -> int:
    return _write(caller, _host().http_get(_read(caller, uptr, ulen, "http_get: the URL")).encode(), out, cap)


def _make_linker() -> wasmtime.Linker:
    i32, i64 = wasmtime.ValType.i32(), wasmtime.ValType.i64()
    linker = wasmtime.Linker(ENGINE)
    linker.define_func("env", "log", wasmtime.FuncType([i32, i32], []), _h_log, access_caller=True)
    linker.define_func("env", "kv_get", wasmtime.FuncType([i32] * 4, [i32]), _h_kv_get, access_caller=True)
    linker.define_func("env", "kv_set", wasmtime.FuncType([i32] * 4, []), _h_kv_set, access_caller=True)
    linker.define_func("env", "kv_incr", wasmtime.FuncType([i32, i32, i64], [i64]), _h_kv_incr, access_caller=True)
    linker.define_func("env", "sleep", wasmtime.FuncType([i32], []), _h_sleep)
    linker.define_func("env", "http_get", wasmtime.FuncType([i32] * 4, [i32]), _h_http_get, access_caller=True)
    return linker


LINKER = _make_linker()
#: The imports LINKER defines (module ``env``).
HOST_IMPORTS = frozenset({"log", "kv_get", "kv_set", "kv_incr", "sleep", "http_get"})

# -- compiled modules -----------------------------------------------------------------------------

MODULE_CACHE_SIZE = 64
#: Bytes of machine code (a module's serialized size) the compiled modules above may hold
#: together: every save of a plugin is a new version. Counted by the code a module compiled to,
#: not by its binary: 80 KB of empty functions compile to 4.2 MB (52x; ~4 MB of RSS each), so 64
#: such versions counted as 5 MB held ~260 MB.
MODULE_CACHE_BYTES = 64 << 20
#: Version -> (its module, the bytes of machine code it holds).
_modules: "WeighedLRU[str, tuple[wasmtime.Module, int]]" = WeighedLRU()
_modules_lock = threading.Lock()


def _leb_u32(data: bytes, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 at ``pos``: (value, next position); ValueError if malformed."""
    value = shift = 0
    for i in range(pos, min(pos + 5, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    raise ValueError("bad LEB128")


def check_module_size(wasm: bytes) -> None:
    """Refuse a module whose compile would be too costly, before compiling it (CompileError).

    Reads only the section headers and each vector section's count; a malformed module is
    left to wasmtime, which says what is wrong with it.
    """
    if len(wasm) > MAX_MODULE_BYTES:
        raise CompileError(f"the module is {len(wasm)} bytes; the limit is {MAX_MODULE_BYTES} "
                           "(strip debug sections, e.g. wasm-opt --strip-debug)")
    if wasm[:4] != b"\0asm":
        return
    pos, functions = 8, 0
    try:
        while pos < len(wasm):
            section = wasm[pos]
            size, start = _leb_u32(wasm, pos + 1)
            pos = start + size
            if section in MAX_COUNTS and size:
                count = _leb_u32(wasm, start)[0]
                if section == 2:  # imports: each is a function (the host only gives functions)
                    functions += count
                if section == 3:
                    functions += count
                    count = functions
                what, limit = MAX_COUNTS[section]
                if count > limit:
                    raise CompileError(f"the module declares {count} {what}; a plugin may declare at most {limit}")
    except ValueError:
        return


def compile_module(version: str, wasm: bytes) -> wasmtime.Module:
    """The compiled module of one version (see compiled_module)."""
    return compiled_module(version, wasm)[0]


def compiled_module(version: str, wasm: bytes) -> tuple[wasmtime.Module, int]:
    """The compiled module of one version and the bytes of machine code it holds, compiled once
    per process (an LRU of MODULE_CACHE_SIZE entries and MODULE_CACHE_BYTES of machine code): its
    size checked first (check_module_size), then compiled in a bounded child (_compile_bounded)."""
    with _modules_lock:
        entry = _modules.get(version)
        if entry is not None:
            return entry
    check_module_size(wasm)
    entry = _compile_bounded(wasm)
    with _modules_lock:
        _modules.put(version, entry, entry[1], MODULE_CACHE_SIZE, MODULE_CACHE_BYTES)
    return entry


# The compiling child: lowers its priority (COMPILE_NICE), limits its own address space, then in
# mode "wasm" builds the Engine from ENGINE_SETTINGS and compiles stdin, in mode "wat" turns stdin's
# WebAssembly text into a binary; it writes b"M" + the serialized module or the binary, or b"E" +
# wasmtime's message.
_COMPILER = """
import json, os, resource, sys
os.nice(int(sys.argv[3]))
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import wasmtime
data = sys.stdin.buffer.read()
try:
    if sys.argv[4] == "wat":
        out = b"M" + bytes(wasmtime.wat2wasm(data.decode("utf-8", "surrogatepass")))
    else:
        config = wasmtime.Config()
        for name, value in json.loads(sys.argv[2]).items():
            setattr(config, name, value)
        out = b"M" + wasmtime.Module(wasmtime.Engine(config), data).serialize()
except (wasmtime.WasmtimeError, ValueError) as exc:  # ValueError: text wasmtime cannot take (a lone surrogate)
    out = b"E" + str(exc).encode("utf-8", "backslashreplace")
sys.stdout.buffer.write(out)
"""


def _out_of_memory(message: str) -> bool:
    """Whether a compile error of the child is its address-space limit (an mmap or allocation that
    failed: ENOMEM), which wasmtime reports as an error as often as it aborts on it."""
    text = message.lower()
    return any(sign in text for sign in ("cannot allocate memory", "os error 12", "out of memory",
                                         "memory allocation", "failed to allocate"))


def _proposal_hint(message: str) -> str:
    """What to rebuild without when wasmtime refused a proposal the host turns off ("" otherwise)."""
    text = message.lower()
    if "exception" in text and ("not enabled" in text or "without the exception handling feature" in text):
        return (" (WebAssembly exception handling is off: each thrown exception would take memory outside the "
                "plugin's memory cap; build without it, e.g. without -fwasm-exceptions, or with panic=abort)")
    return ""


def _in_child(mode: str, data: bytes, doing: str) -> tuple[bytes | None, str | None]:
    """Run the compiling child in ``mode`` ("wasm" or "wat") on ``data``, bounded by
    COMPILE_TIMEOUT_SECONDS and COMPILE_MEMORY_BYTES: (its output, None), (None, wasmtime's
    message), or (None, None) when no child process can start here (a sandbox). ``doing`` names
    the work in the CompileError (``timeout``, ``memory_limit``) of a child stopped at a bound."""
    # MALLOC_ARENA_MAX: glibc's per-thread arenas reserve 64 MiB of address space each.
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _COMPILER, str(COMPILE_MEMORY_BYTES),
                               json.dumps(ENGINE_SETTINGS), str(COMPILE_NICE), mode], input=data, capture_output=True,
                              env=env, timeout=COMPILE_TIMEOUT_SECONDS, check=False)
    except subprocess.TimeoutExpired:
        raise CompileError(f"{doing} took more than {COMPILE_TIMEOUT_SECONDS:g} s; make it smaller",
                           code="timeout") from None
    except OSError:
        return None, None
    out = done.stdout
    if done.returncode or out[:1] not in (b"M", b"E"):
        # Out of address space, wasmtime aborts ("memory allocation of N bytes failed") or Python
        # raises MemoryError (the traceback's last line): the line that names memory says which.
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines() or ["no message"]
        why = next((line for line in lines if "memory" in line.lower()), lines[-1])[:200]
        raise CompileError(f"{doing} failed within its {COMPILE_MEMORY_BYTES >> 20} MiB of memory "
                           f"(exit status {done.returncode}: {why}); make it smaller", code="memory_limit")
    if out[:1] == b"E":
        message = out[1:].decode("utf-8", "replace")
        if _out_of_memory(message):  # wasmtime reported the allocation failure instead of aborting
            raise CompileError(f"{doing} failed within its {COMPILE_MEMORY_BYTES >> 20} MiB of memory "
                               f"({message[:200]}); make it smaller", code="memory_limit")
        return None, message
    return out[1:], None


def _compile_bounded(wasm: bytes) -> tuple[wasmtime.Module, int]:
    """``wasm`` compiled in a child process bounded by COMPILE_TIMEOUT_SECONDS and
    COMPILE_MEMORY_BYTES (wasmtime cannot interrupt a compile), loaded into ENGINE; with the bytes
    of its serialized form, which is what the loaded module holds (machine code and its tables)."""
    serialized, message = _in_child("wasm", wasm, "compiling the module")
    if serialized is None and message is None:  # no child process here: the size limits still bound the cost
        try:
            module = wasmtime.Module(ENGINE, wasm)
            return module, len(module.serialize())
        except wasmtime.WasmtimeError as exc:
            message = str(exc)
    if serialized is None:
        raise CompileError(f"the module does not compile: {message}{_proposal_hint(message or '')}")
    # Trusted: these bytes are what this process's own child serialized with this wasmtime.
    return wasmtime.Module.deserialize(ENGINE, serialized), len(serialized)


def drop_caches() -> None:
    """Forget every compiled module (process exit, tests)."""
    with _modules_lock:
        _modules.clear()


# Free compiled modules while wasmtime's library is still loaded: modules collected during
# interpreter teardown print "Exception ignored" noise.
atexit.register(drop_caches)


#: Characters of WebAssembly text parsed in this process; longer text is parsed in the bounded
#: compiling child. wasmtime's text parser cannot be interrupted and is not linear: each `br $name`
#: looks its label up through every enclosing block, so 40,000 nested blocks and as many branches
#: to the outermost (0.56 MB) took 2.8 s, and 4 MiB of them minutes, on the admin's save (or a
#: registry sync's thread, for a row holding only text). At this size that shape takes ~50 ms.
WAT_INPROCESS_CHARS = 64 << 10


def wat_to_wasm(text: str) -> bytes:
    """Compile WebAssembly text (.wat) to a binary; raises CompileError with wasmtime's message
    (``timeout`` or ``memory_limit`` for text over WAT_INPROCESS_CHARS that its child could not parse
    within COMPILE_TIMEOUT_SECONDS or COMPILE_MEMORY_BYTES)."""
    binary, message = None, None
    if len(text) > WAT_INPROCESS_CHARS:
        binary, message = _in_child("wat", text.encode("utf-8", "surrogatepass"), "parsing the .wat")
    if binary is None and message is None:
        try:
            binary = bytes(wasmtime.wat2wasm(text))
        except (wasmtime.WasmtimeError, ValueError) as exc:  # ValueError: a lone surrogate
            message = str(exc)
    if binary is None:
        raise CompileError(f"the .wat does not parse: {message}")
    return binary


# -- fast export calls ----------------------------------------------------------------------------

def _export(store: wasmtime.Store, instance: wasmtime.Instance, name: str) -> Any:
    # One export by name, instead of Instance.exports() building the whole map (60-90 us).
    item = ffi.wasmtime_extern_t()
    raw = name.encode()
    if not ffi.wasmtime_instance_export_get(store._context(), ctypes.byref(instance._instance), raw, len(raw),
                                            ctypes.byref(item)):
        return None
    from wasmtime._extern import wrap_extern
    return wrap_extern(item)


_I32: int = ffi.WASMTIME_I32.value


class _Call:
    """A typed call of one exported function: the signature is checked once, not per call
    (Func.__call__ re-reads the function type on every call, most of its 11-35 us)."""

    __slots__ = ("store", "func", "nparams", "result")

    def __init__(self, store: wasmtime.Store, func: wasmtime.Func, params: int, result: str) -> None:
        self.store, self.func, self.nparams, self.result = store, func, params, result

    def __call__(self, *args: int) -> int:
        params = (ffi.wasmtime_val_t * self.nparams)()
        for i, value in enumerate(args):
            # An int, which ctypes converts (the stub types the field as c_uint8; assigning the
            # c_uint8 constant itself costs ~0.2 us more per argument).
            params[i].kind = _I32  # type: ignore[assignment]
            params[i].of.i32 = value
        results = (ffi.wasmtime_val_t * 1)()
        trap = ctypes.POINTER(ffi.wasm_trap_t)()
        error = ffi.wasmtime_func_call(self.store._context(), ctypes.byref(self.func._func), params,
                                       self.nparams, results, 1, ctypes.byref(trap))
        if error or trap:
            _raise_failed_entry(error, trap)
        return results[0].of.i64 if self.result == "i64" else results[0].of.i32


def _instantiate(pre: wasmtime.InstancePre, store: wasmtime.Store) -> wasmtime.Instance:
    """``pre.instantiate(store)``, failing with this thread's own error only (_raise_failed_entry)."""
    instance = ffi.wasmtime_instance_t()
    trap = ctypes.POINTER(ffi.wasm_trap_t)()
    error = ffi.wasmtime_instance_pre_instantiate(pre.ptr(), store._context(), ctypes.byref(instance),
                                                  ctypes.byref(trap))
    if error or trap:
        _raise_failed_entry(error, trap)
    return wasmtime.Instance._from_raw(instance)


def _signature(store: wasmtime.Store, func: wasmtime.Func) -> tuple[tuple[str, ...], tuple[str, ...]]:
    ty = func.type(store)
    return tuple(str(p) for p in ty.params), tuple(str(r) for r in ty.results)


# -- idle memory ----------------------------------------------------------------------------------

#: Resident bytes of linear memory the idle instances of every WASM plugin in this process may keep
#: together between calls. Each pooled or sharded instance kept what its calls touched, up to its
#: plugin's cap, for as long as the plugin was loaded, with no bound over plugins: 10 plugins at the
#: defaults (4 instances of 16 MiB) left a worker +639 MB while all were idle (~6.4 GB at
#: MAX_PLUGINS). A pooled instance ending a call past this budget frees its store instead, and
#: instantiates again at its next call (~0.1 ms plus its start function: what per_request pays);
#: a sharded one counts but keeps its memory (its per-session state).
IDLE_MEMORY_BYTES = 256 << 20
#: Up to this size a memory counts whole; a larger one counts its resident pages (mincore).
_IDLE_COUNT_WHOLE_BYTES = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_mincore.restype = ctypes.c_int
_idle_lock = threading.Lock()
#: Resident bytes the idle instances count now (WasmInstance._idle, summed).
_idle_bytes = 0


def _resident(memory: wasmtime.Memory, store: wasmtime.Store) -> int:
    """Bytes of ``memory`` in RAM (its whole size while small, or if mincore fails)."""
    size = memory.data_len(store)
    if size <= _IDLE_COUNT_WHOLE_BYTES:
        return size
    pages = (size + _PAGE - 1) // _PAGE
    vector = (ctypes.c_ubyte * pages)()
    base = ctypes.cast(memory.data_ptr(store), ctypes.c_void_p).value
    if _mincore(base, size, vector):
        return size
    return (pages - bytes(vector).count(0)) * _PAGE


def idle_memory() -> int:
    """Resident bytes the idle WASM instances of this process keep (stats, tests)."""
    return _idle_bytes


# -- instances ------------------------------------------------------------------------------------

class WasmInstance:
    """One Store + Instance of a module, with its memory, allocator and handlers looked up once.

    Instantiated by ``start`` (at its first call, by that call's deadline): a module's start
    function and data segments run inside the budget of the call that needs them.
    """

    def __init__(self, compiled: "WasmCompiled") -> None:
        self.spec = compiled.spec
        self.compiled: WasmCompiled | None = compiled
        self._version = compiled  # what a freed store is instantiated from again
        self.store: wasmtime.Store | None = None
        self.handlers: dict[str, _Call] = {}
        #: Resident bytes this instance counts in _idle_bytes while idle (0 while a call runs).
        self._idle = 0
        self._started = False  # instantiated, its exports looked up
        #: A shard's memory is the per-session state the strategy exists for (docs/plugins.md): it
        #: counts against IDLE_MEMORY_BYTES but is never freed for it.
        self._keeps_state = compiled.spec.strategy == "sharded"

    def start(self, seconds: float) -> None:
        """Instantiate, running the module's start function for at most ``seconds``."""
        compiled, self.compiled = self.compiled, None
        assert compiled is not None, "instantiated once"
        store = self.store = wasmtime.Store(ENGINE)
        store.set_limits(memory_size=self.spec.memory_bytes, table_elements=MAX_TABLE_ELEMENTS, instances=1,
                         tables=MAX_TABLES, memories=1)
        ticker = _ticker
        ticker.enter()
        try:
            store.set_epoch_deadline(_ticks(seconds) + ticker.owed())
            _tls.trap = None
            self.instance = _instantiate(compiled.pre, store)
        except wasmtime.Trap as exc:
            raise _trap_error(exc, self.spec, seconds) from None
        except wasmtime.WasmtimeError as exc:
            raise GuestError(f"the module does not instantiate: {exc}{_limits_hint(str(exc), self.spec)}",
                             poison=True) from None
        except _HostTrap as exc:  # this thread's host function trapped the start function
            raise GuestError(f"the start function called the host: {exc}; make host calls from handlers",
                             poison=True) from None
        finally:
            ticker.leave()
        memory = _export(store, self.instance, "memory")
        alloc = _export(store, self.instance, "alloc")
        if not isinstance(memory, wasmtime.Memory) or not isinstance(alloc, wasmtime.Func):
            raise GuestError("the module must export 'memory' and 'alloc(len: i32) -> i32' (see the ABI)",
                             poison=True)
        if _signature(store, alloc) != (("i32",), ("i32",)):
            raise GuestError("export 'alloc' must have the type (i32) -> i32", poison=True)
        self.memory = memory
        self.alloc = _Call(store, alloc, 1, "i32")
        for name in compiled.handlers:
            func = _export(store, self.instance, name)
            self.handlers[name] = _Call(store, func, 2, "i64")
        self._started = True

    def call(self, handler: str, event: dict[str, Any], deadline: float) -> Any:
        """One call of ``handler``; as it ends, the instance keeps its memory for the next call
        only within IDLE_MEMORY_BYTES of every idle instance's (else it frees its store)."""
        global _idle_bytes
        if self._idle:
            with _idle_lock:
                _idle_bytes -= self._idle
            self._idle = 0
        try:
            return self._call(handler, event, deadline)
        finally:
            store = self.store
            if store is not None and self._started:
                # Counted whole while that fits (one call, ~2 us); past it, by its resident pages
                # (mincore: ~20 us at 16 MiB, ~1.5 ms at 1 GiB, so only under the budget's pressure).
                kept = self.memory.data_len(store)
                with _idle_lock:
                    keep = _idle_bytes + kept <= IDLE_MEMORY_BYTES
                    if keep:
                        _idle_bytes += kept
                if not keep:
                    kept = _resident(self.memory, store)
                    with _idle_lock:
                        keep = self._keeps_state or _idle_bytes + kept <= IDLE_MEMORY_BYTES
                        if keep:
                            _idle_bytes += kept
                if keep:
                    self._idle = kept
                else:
                    self._free_store()

    def _free_store(self) -> None:
        """Free the store now; the next call instantiates the module again."""
        store, self.store = self.store, None
        self.handlers = {}
        self.instance = None  # type: ignore[assignment]
        self._started = False
        self.compiled = self._version
        if store is not None:
            store.close()

    def _call(self, handler: str, event: dict[str, Any], deadline: float) -> Any:
        if self.compiled is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GuestTimeout()
            self.start(remaining)
        fn = self.handlers.get(handler)
        if fn is None:
            raise GuestError(f"no handler export '{handler}' with the type (i32, i32) -> i64")
        payload = to_json(_abi_event(event)).encode()
        store = self.store
        assert store is not None, "started above"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise GuestTimeout()
        ticker = _ticker
        ticker.enter()
        _tls.call, _tls.host, _tls.host_error, _tls.trap = (self.spec, deadline), None, None, None
        try:
            store.set_epoch_deadline(_ticks(remaining) + ticker.owed())
            ptr = self.alloc(len(payload))
            if ptr <= 0 or ptr + len(payload) > self.memory.data_len(store):
                raise GuestError(f"alloc({len(payload)}) returned {ptr}, outside linear memory", poison=True)
            self.memory.write(store, payload, ptr)
            packed = fn(ptr, len(payload))
        except GuestError:
            raise
        except Exception as exc:
            raise self._failure(exc) from None
        finally:
            ticker.leave()
            host, _tls.host, _tls.call = _tls.host, None, None
            if host is not None:
                host.close()  # the call's end: the summary of dropped log lines and denied calls
        if not packed:
            return None
        rptr, rlen = (packed >> 32) & 0xFFFFFFFF, packed & 0xFFFFFFFF
        if rlen > MAX_REPLY_BYTES or rptr + rlen > self.memory.data_len(store):
            raise GuestError(f"reply pointer {rptr}+{rlen} is outside memory or over {MAX_REPLY_BYTES} bytes")
        text = bytes(self.memory.read(store, rptr, rptr + rlen)).decode("utf-8", "replace")
        if text[:1] in ("{", "["):
            try:
                return json.loads(text)
            except ValueError as exc:
                raise GuestError(f"reply starts like JSON but does not parse: {exc}") from None
            except RecursionError:  # "[[[[..." 256 KiB deep: not the worker's error to raise
                raise GuestError("reply JSON nests too deep to parse; flatten it") from None
        return to_reply(text)

    def _failure(self, exc: BaseException) -> GuestError:
        host_error = getattr(_tls, "host_error", None)
        _tls.host_error = None
        if isinstance(host_error, GuestTimeout):
            return GuestTimeout(str(host_error))
        if isinstance(host_error, GuestQuota):  # the trap already ended the call: report the quota
            return GuestQuota(host_error.code, str(host_error))
        if host_error is not None:
            return GuestError(f"host call failed: {host_error}", poison=True)
        if isinstance(exc, wasmtime.Trap):
            error = _trap_error(exc, self.spec)
            # A guest whose memory.grow failed at the cap usually traps next: say so.
            # (Heuristic: wasmtime-py exposes no limiter callback; "near the cap" is within an
            # eighth of it, or one page.)
            margin = max(65536, self.spec.memory_bytes // 8)
            if not isinstance(error, GuestTimeout) and self.store is not None and \
                    self.memory.data_len(self.store) + margin > self.spec.memory_bytes:
                return GuestMemory(f"memory cap of {self.spec.memory_bytes} bytes reached ({error})")
            return error
        if isinstance(exc, _HostTrap):
            return GuestError(f"host call failed: {exc}", poison=True)
        return GuestError(f"{type(exc).__name__}: {exc}", poison=True)

    def close(self) -> None:
        """Free the instance's store (its linear memory) now; the instance is not used again."""
        global _idle_bytes
        if self._idle:
            with _idle_lock:
                _idle_bytes -= self._idle
            self._idle = 0
        store, self.store = self.store, None
        self.handlers = {}
        self.compiled = None
        self.instance = None  # type: ignore[assignment]
        if store is not None:
            # Now, not when its last Python reference goes: a failed call's exception holds the
            # store through the frames of its traceback, in a reference cycle only the cyclic GC
            # breaks (measured: each failed call at a 1 GiB cap kept its 250 MiB of touched memory
            # after returning, four calls 1 GiB, until a collection ran).
            store.close()


def _limits_hint(message: str, spec: Any) -> str:
    """What to change when wasmtime refused a declaration over the instance's limits ("" otherwise)."""
    if "exceeds memory limits" in message:
        return (f" (the plugin's memory cap is {spec.memory_bytes} bytes, {spec.memory_bytes // 65536} pages of "
                "64 KiB; declare fewer initial pages, or raise the plugin's memory_mb)")
    if "exceeds table limits" in message:
        return f" (a table may hold at most {MAX_TABLE_ELEMENTS} elements; declare a smaller table)"
    return ""


def _ticks(seconds: float) -> int:
    return max(1, math.ceil(seconds / EPOCH_TICK)) + 1


def _trap_error(exc: wasmtime.Trap, spec: Any, budget: float | None = None) -> GuestError:
    code = getattr(exc, "trap_code", None)
    if code == wasmtime.TrapCode.INTERRUPT:
        if budget is not None and budget < spec.timeout:
            return GuestTimeout(f"the start function ran past the {budget * 1000:.0f} ms left of the call's budget")
        return GuestTimeout(f"ran past its {spec.timeout * 1000:g} ms timeout")
    text = str(exc)
    # wasmtime's text is "error while executing at wasm backtrace: ... Caused by: <reason>".
    reason = text.rsplit("Caused by:", 1)[-1].strip() if "Caused by:" in text else text.strip()
    reason = reason.splitlines()[0] if reason else "trap"
    frame = next((line.strip() for line in text.splitlines() if line.strip().startswith("0:")), "")
    return GuestError(f"trap: {reason}" + (f" (at {frame[2:].strip()})" if frame else ""), poison=True)


def _abi_event(event: dict[str, Any]) -> dict[str, Any]:
    # "args" first: a guest may find it without a JSON parser (plugins/examples/add.wat does).
    return {"args": event.get("args", ""), "text": event.get("text", ""), "type": event.get("type"),
            "id": event.get("id"), "session": event.get("session"), "tenant": event.get("tenant", ""),
            "data": event.get("data") or {}}


class WasmCompiled(FreshInstanceIsolation):
    """A WASM plugin version: the module compiled once, linked once (InstancePre), validated."""

    thread_bound = False

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        code = spec.code
        if isinstance(code, str):
            code = wat_to_wasm(code)
        #: Bytes of machine code the module holds (plugins.loaded counts them in its cache).
        self.module, self.native_bytes = compiled_module(spec.version, bytes(code))
        for imp in self.module.imports:
            if imp.module != "env" or imp.name not in HOST_IMPORTS:
                raise CompileError(f"unknown import {imp.module}.{imp.name}: the host provides env.log, env.kv_get, "
                                   "env.kv_set, env.kv_incr, env.sleep and env.http_get")
        try:
            self.pre = LINKER.instantiate_pre(self.module)
        except wasmtime.WasmtimeError as exc:
            raise CompileError(f"the module does not link: {exc}") from None
        names = []
        for exp in self.module.exports:
            ty = exp.type
            if isinstance(ty, wasmtime.FuncType) and exp.name not in RESERVED_EXPORTS:
                if [str(p) for p in ty.params] == ["i32", "i32"] and [str(r) for r in ty.results] == ["i64"]:
                    names.append(exp.name)
        self.handlers = frozenset(names)
        probe = WasmInstance(self)
        try:
            probe.start(load_seconds(spec))  # the module instantiates: memory, alloc and start are fine
        except GuestTimeout as exc:
            note = load_budget_note(spec)
            raise CompileError(f"the start function ran past {load_seconds(spec) * 1000:g} ms{note}" if note
                               else str(exc), code="timeout") from None
        except GuestError as exc:
            code = "timeout" if isinstance(exc, GuestTimeout) else \
                "memory_limit" if isinstance(exc, GuestMemory) else "plugin_invalid"
            raise CompileError(str(exc), code=code) from None
        finally:
            probe.close()

    def new_instance(self, deadline: float | None = None) -> WasmInstance:
        # Instantiated by its first call, within that call's deadline (WasmInstance.start).
        return WasmInstance(self)

    def call_isolated(self, handler: str, event: dict[str, Any], deadline: float) -> Any:
        """One call on a brand-new instance, closed right after (kept by no one: not counted as idle)."""
        inst = WasmInstance(self)
        try:
            return inst._call(handler, event, deadline)
        finally:
            inst.close()
