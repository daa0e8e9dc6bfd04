"""Frees retired Lua runtimes off the caller's thread, with the GIL released for the bulk of it.

A pooled or sharded instance is discarded where its call failed (a timeout, the memory cap), and a
per_request thread's runtime the same way: on the thread that made the call, which may be the event
loop. Dropping a lupa runtime runs ``lua_close`` in its dealloc with the GIL held, which frees every
object the guest left: a runtime holding 14 million small tables (a 1 GiB cap, filled over earlier
calls) took 0.6-0.8 s, a timeout that answered that much past its deadline while every Python thread
of the worker, the event loop included, waited for the GIL. So a retired runtime goes to one daemon
thread per process, which first collects its garbage in Lua (``settle``: lupa releases the GIL while
Lua runs, and the guest's environment is unreferenced by then), and only then drops it: ``lua_close``
frees what is left, the sandbox itself (~100 KB).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any, Callable

log = logging.getLogger("plugins.lua")


class Reaper:
    """The process's thread that frees retired Lua runtimes (started with the first)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def retire(self, runtime: Any, settle: Callable[[], Any] | None) -> None:
        """Free ``runtime`` on the reaper thread, after ``settle()`` (a collection in Lua) ran there."""
        self._queue.put((runtime, settle))
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="lua-runtime-reaper", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            runtime, settle = self._queue.get()
            try:
                if settle is not None:
                    settle()
            except Exception:  # a runtime at its cap may fail to collect: it is freed all the same
                log.debug("settling a retired Lua runtime failed", exc_info=True)
            del runtime, settle  # lua_close, now of what the collection left

    def after_fork(self) -> None:
        """In a forked child: the parent's thread is not there; a new one starts with the next runtime."""
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()


reaper = Reaper()
os.register_at_fork(after_in_child=reaper.after_fork)
