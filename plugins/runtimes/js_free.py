"""Free a QuickJS Context's runtime on a reaper thread, without the GIL.

Why: the binding frees a Context in its deallocator (``runtime_dealloc`` in quickjs-ng 0.17.0.2's
module.c: ``JS_FreeContext``, ``JS_FreeRuntime``, then the Python object), with the GIL held,
on whatever thread drops the last reference. That free costs what the guest left behind: a
1 GiB Context full of small objects held every thread of the worker, its event loop included,
0.8-0.95 s, and a per_request Context at 16 MiB keeping 20,000 keys of one atom hash (each atom
freed walks its hash bucket) 0.32 s at every call's end (measured on a real server: a
neighbour's /ping waited 0.35 s).

How: once nothing but the caller holds the Context (no JS value wrapper of the binding is alive:
each holds a reference, and would free its value through the Context later), its runtime and
context pointers (the struct js_deadline checked) are swapped for a fresh empty runtime's, which
the deallocator then frees in microseconds, and the guest's runtime is handed to one daemon thread
that frees it through QuickJS's C API by ctypes, which releases the GIL for the call. Nothing of a
plugin's runtime calls Python while it is freed: guests never hold Python callables (js.py), and
the binding allocates through malloc, not Python's allocator (``runtime_new``: ``JS_NewRuntime``).
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import sys
import threading
from types import SimpleNamespace
from typing import Any

import quickjs

from . import js_deadline

log = logging.getLogger("plugins.runtimes.js")

#: A runtime holding fewer allocations and bytes than these is left to the binding: freeing it takes
#: a few ms at most (1 GiB of small objects: ~1 s; 20,000 atoms of one hash, ~1.5 MB, 0.3 s: each
#: atom freed walks its bucket; under 4,096 allocations at most ~1,800 are the guest's, ~3 ms), and
#: making the donor costs ~50 us. A per_request Context holds ~2,300 allocations after a call.
SMALL_COUNT, SMALL_BYTES = 4096, 2 << 20
#: Runtimes waiting for the reaper: past this, the caller frees its own (still without the GIL),
#: so the memory of discarded Contexts stays bounded.
MAX_PENDING = 8

_lib: Any = None
# JSRuntime begins with its JSMallocFunctions (five pointers) and JSMallocState {malloc_count,
# malloc_size, malloc_limit, opaque} (quickjs-ng 0.17): checked once against what memory() reports.
_MALLOC_COUNT, _MALLOC_SIZE, _MALLOC_LIMIT = 40, 48, 56
_size_known = False
_pending: queue.SimpleQueue = queue.SimpleQueue()
_reaper_pid = 0
_lock = threading.Lock()


def _bind() -> Any:
    """QuickJS's C API by ctypes (the frees release the GIL), or None if the binding's layout is unknown."""
    global _lib
    if _lib is None:
        if not js_deadline.available():
            _lib = False
        else:
            # The frees through CDLL (the GIL released: they are the long part); the donor's making
            # through PyDLL, under the GIL like every runtime the binding makes, microseconds.
            free, held = ctypes.CDLL(quickjs._quickjs.__file__), ctypes.PyDLL(quickjs._quickjs.__file__)
            lib = SimpleNamespace(JS_NewRuntime=held.JS_NewRuntime, JS_NewContextRaw=held.JS_NewContextRaw,
                                  JS_FreeContext=free.JS_FreeContext, JS_FreeRuntime=free.JS_FreeRuntime)
            lib.JS_NewRuntime.restype = ctypes.c_void_p
            lib.JS_NewContextRaw.restype = ctypes.c_void_p
            lib.JS_NewContextRaw.argtypes = [ctypes.c_void_p]
            lib.JS_FreeContext.argtypes = [ctypes.c_void_p]
            lib.JS_FreeRuntime.argtypes = [ctypes.c_void_p]
            _lib = lib
            _check_size_word()
    return _lib or None


def _check_size_word() -> None:
    """Read sizes from the runtime only if the word at _MALLOC_SIZE is what memory() reports."""
    global _size_known
    probe = quickjs.Context()
    probe.set_memory_limit(12_345_679)
    try:
        rt = ctypes.c_void_p.from_address(id(probe) + js_deadline._RUNTIME).value or 0
        limit = ctypes.c_size_t.from_address(rt + _MALLOC_LIMIT).value
        count = ctypes.c_size_t.from_address(rt + _MALLOC_COUNT).value
        size = ctypes.c_size_t.from_address(rt + _MALLOC_SIZE).value
        usage = probe.memory()
        _size_known = limit == 12_345_679 and (count, size) == (usage["malloc_count"], usage["malloc_size"])
    except Exception:  # noqa: BLE001 - an unexpected binding: every Context goes to the reaper
        _size_known = False
    if not _size_known:
        log.warning("JS plugins: cannot read a QuickJS runtime's size on this binding; every discarded Context "
                    "is freed by the reaper thread (~50 us more a per_request call). Fix: pip install "
                    "quickjs-ng==0.17.0.2")


def release(ctx: Any, refs: int) -> bool:
    """Hand ``ctx``'s runtime to the reaper if it is not small and the caller's ``refs`` references
    are its only ones (``sys.getrefcount`` as the caller sees it); False: nothing done, drop it as usual."""
    lib = _bind()
    if lib is None or sys.getrefcount(ctx) - 2 != refs:  # (-2: this frame's and getrefcount's own)
        return False
    tail = js_deadline._Tail.from_address(id(ctx) + js_deadline._RUNTIME)
    guest = (tail.context, tail.runtime)
    if (_size_known and ctypes.c_size_t.from_address(guest[1] + _MALLOC_COUNT).value < SMALL_COUNT
            and ctypes.c_size_t.from_address(guest[1] + _MALLOC_SIZE).value < SMALL_BYTES):
        return False
    donor_rt = lib.JS_NewRuntime()
    donor_ctx = lib.JS_NewContextRaw(donor_rt) if donor_rt else None
    if not donor_ctx:
        if donor_rt:
            lib.JS_FreeRuntime(donor_rt)
        return False
    tail.context, tail.runtime = donor_ctx, donor_rt  # the deallocator frees the donor
    _hand_over(guest)
    return True


def _hand_over(guest: tuple[int, int]) -> None:
    if _pending.qsize() >= MAX_PENDING or not _reaper_running():
        _free(guest)  # on this thread, still without the GIL
        return
    _pending.put(guest)


def _free(guest: tuple[int, int]) -> None:
    context, runtime = guest
    _lib.JS_FreeContext(context)
    _lib.JS_FreeRuntime(runtime)


def _reap() -> None:
    while True:
        guest = _pending.get()
        try:
            _free(guest)
        except Exception:  # never let the reaper die (the next free would fall back to the caller)
            log.exception("JS runtime reaper: freeing a runtime failed; continuing")


def _reaper_running() -> bool:
    global _reaper_pid
    if _reaper_pid != os.getpid():  # first use, or a forked child (threads do not survive fork)
        with _lock:
            if _reaper_pid != os.getpid():
                threading.Thread(target=_reap, name="js-reaper", daemon=True).start()
                _reaper_pid = os.getpid()
    return True
