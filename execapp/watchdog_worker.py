"""A worker process's end of the watchdog: its slot, found through the environment, and its heartbeat.

The ``execapp.serve`` supervisor tells each worker process the watchdog's directory and its slot
number (``EXECAPP_WATCHDOG_DIR``, ``EXECAPP_WATCHDOG_SLOT``); the worker maps the slots file
(execapp.watchdog) and beats its slot from a task on its event loop, so a stalled loop stops
beating. Nothing here imports Django: ``execapp.server`` uses it before the worker is built.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Callable

from .watchdog import ENV_DIR, ENV_SLOT, FLAG_STOPPING, HEARTBEAT_SECONDS, SLOTS_FILE, SlotFile, WatchdogError
from .watchdog_quarantine import QuarantineEntry, read_quarantine

log = logging.getLogger("execapp.watchdog")

_process_watch: "tuple[tuple[str, str, int], WorkerWatch] | None" = None


class WorkerWatch:
    """A worker process's end of the watchdog: its slot, the heartbeat and the quarantine list."""

    def __init__(self, directory: str | os.PathLike[str], index: int) -> None:
        self.directory = Path(directory)
        self.slots = SlotFile.open(self.directory / SLOTS_FILE)
        self.slot = self.slots.slot(index)
        self.slot.pid = os.getpid()

    @classmethod
    def from_env(cls) -> "WorkerWatch | None":
        """The watch the supervisor set up for this process (one per process), or None without a
        supervisor (bare uvicorn or daphne: no watchdog)."""
        global _process_watch
        directory, index = os.environ.get(ENV_DIR), os.environ.get(ENV_SLOT)
        if not directory or index is None:
            return None
        key = (directory, index, os.getpid())
        if _process_watch is not None and _process_watch[0] == key:
            return _process_watch[1]
        try:
            watch = cls(directory, int(index))
        except (WatchdogError, ValueError) as exc:
            log.error("watchdog disabled in this worker: %s", exc)
            return None
        _process_watch = (key, watch)
        return watch

    @property
    def supervisor_stopping(self) -> bool:
        """True while the supervisor stops every worker (not a recycle of this one)."""
        return bool(self.slots.flags & FLAG_STOPPING)

    def start_heartbeat(self, orphaned: Callable[[], None] | None = None) -> "asyncio.Task[None]":
        """Start the heartbeat on the running loop (``execapp.serve``, before the worker is built);
        ``orphaned`` is called once if the supervisor (this process's parent) goes away."""
        self.slot.beat(time.monotonic())
        return asyncio.get_running_loop().create_task(self.heartbeat(orphaned), name="execapp-heartbeat")

    async def heartbeat(self, orphaned: Callable[[], None] | None = None) -> None:
        """The loop task writing the heartbeat until cancelled; a stalled loop stops writing it. It
        also notices that the supervisor died (SIGKILLed, OOM-killed): this process's parent changes.
        A worker without its supervisor has no watchdog and nobody to restart it, and a new
        supervisor on the same port would serve beside it: ``orphaned`` makes it drain and exit."""
        beat, monotonic, sleep, getppid = self.slot.beat, time.monotonic, asyncio.sleep, os.getppid
        parent = getppid()
        while True:
            beat(monotonic())
            if orphaned is not None and getppid() != parent:
                orphaned()
                orphaned = None
            await sleep(HEARTBEAT_SECONDS)

    def quarantine_list(self) -> list[QuarantineEntry]:
        """The supervisor's quarantine list as it is now."""
        return read_quarantine(self.directory)
