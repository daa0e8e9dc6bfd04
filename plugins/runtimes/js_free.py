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
from typing import Any

import quickjs

from . import js_deadline

log = logging.getLogger("plugins.runtimes.js")

#: Runtimes waiting for the reaper: past this, the caller frees its own (still without the GIL),
#: so the memory of discarded Contexts stays bounded.
MAX_PENDING = 8

_lib: Any = None
_pending: queue.SimpleQueue = queue.SimpleQueue()
_reaper_pid = 0
_lock = threading.Lock()


def _bind() -> Any:
    """QuickJS's C API through ctypes.CDLL (each call releases the GIL), or None if unavailable."""
    global _lib
    if _lib is None:
        if not js_deadline.available():
            _lib = False
        else:
            lib = ctypes.CDLL(quickjs._quickjs.__file__)
            lib.JS_NewRuntime.restype = ctypes.c_void_p
            lib.JS_NewContextRaw.restype = ctypes.c_void_p
            lib.JS_NewContextRaw.argtypes = [ctypes.c_void_p]
            lib.JS_FreeContext.argtypes = [ctypes.c_void_p]
            lib.JS_FreeRuntime.argtypes = [ctypes.c_void_p]
            _lib = lib
    return _lib or None


def release(ctx: Any, refs: int) -> bool:
    """Hand ``ctx``'s runtime to the reaper if the caller's ``refs`` references are its only ones
    (``sys.getrefcount`` as the caller sees it); False: nothing done, drop it as usual."""
    lib = _bind()
    if lib is None or sys.getrefcount(ctx) - 2 != refs:  # (-2: this frame's and getrefcount's own)
        return False
    donor_rt = lib.JS_NewRuntime()
    donor_ctx = lib.JS_NewContextRaw(donor_rt) if donor_rt else None
    if not donor_ctx:
        if donor_rt:
            lib.JS_FreeRuntime(donor_rt)
        return False
    tail = js_deadline._Tail.from_address(id(ctx) + js_deadline._RUNTIME)
    guest = (tail.context, tail.runtime)
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
