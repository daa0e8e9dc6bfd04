"""The watchdog's shared memory: per-worker heartbeat and inline slots, and the quarantine list.

The ``execapp.serve`` supervisor creates one small file of slots (``slots``) and an append-only
list of quarantined matchers (``quarantine.jsonl``) in one directory, and tells each worker
process its directory and slot number through the environment (``EXECAPP_WATCHDOG_DIR``,
``EXECAPP_WATCHDOG_SLOT``). Both sides ``mmap`` the slots file, so what a worker wrote is still
there after the worker is SIGKILLed: the supervisor reads it from outside.

One slot (``SLOT_SIZE`` bytes) per worker process:

====== ======= =================================================================================
offset bytes   written by the worker (the pid also by the supervisor, before the worker starts)
====== ======= =================================================================================
0      64      inline mark: the name of the matcher running inline on the loop now (UTF-8,
               NUL-padded, truncated to 64 bytes), byte 0 = 0 when none; the engine writes it
               around every inline run (``Engine.set_inline_slot``)
64     8       heartbeat: ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process),
               written every ``HEARTBEAT_SECONDS`` by a task on the worker's event loop
72     8       pid
80     8       state (``STATE_*``)
88     8       pool threads stuck past their deadline now
====== ======= =================================================================================

A 64-byte header holds the supervisor's flags (``FLAG_STOPPING`` while it stops every worker).
Nothing here imports Django: the supervisor and the worker both use it (docs/operations.md).
"""
from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: the supervisor (execapp.serve) imports this module and stays light
    from .seams import EngineLike, WorkerLike

log = logging.getLogger("execapp.watchdog")

ENV_DIR = "EXECAPP_WATCHDOG_DIR"
ENV_SLOT = "EXECAPP_WATCHDOG_SLOT"
SLOTS_FILE = "slots"
QUARANTINE_FILE = "quarantine.jsonl"

MAGIC = b"EXWD0001"
HEADER_SIZE = 64
SLOT_SIZE = 128
MARK_SIZE = 64
#: How often the loop writes its heartbeat: cheap (one 8-byte store), and fine-grained enough
#: that a stall is seen within a few tenths of a second of the limit.
HEARTBEAT_SECONDS = 0.05
#: A heartbeat younger than this means the worker's loop runs now (for "is a sibling serving").
FRESH_SECONDS = 1.0

_FLAGS = struct.Struct("=q")  # header offset 8
_BEAT = struct.Struct("=d")  # slot offset 64
_INT = struct.Struct("=q")  # pid 72, state 80, stuck 88
_OFF_BEAT, _OFF_PID, _OFF_STATE, _OFF_STUCK = 64, 72, 80, 88

FLAG_STOPPING = 1

STATE_EMPTY = 0
STATE_STARTING = 1  # the loop beats; the worker loads its plugins, not listening yet
STATE_READY = 2  # listening and serving
STATE_RECYCLE = 3  # serving, but asks the supervisor for a replacement (stuck pool threads)
STATE_DRAINING = 4  # shutting down (SIGTERM): drains, then exits
STATE_EXITING = 5  # its loop has finished: the heartbeat stops, and that is no stall
STATE_NAMES = {STATE_EMPTY: "empty", STATE_STARTING: "starting", STATE_READY: "ready", STATE_RECYCLE: "recycle",
               STATE_DRAINING: "draining", STATE_EXITING: "exiting"}


class WatchdogError(RuntimeError):
    """The watchdog's files are missing or malformed (``code`` says which)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class SlotFile:
    """The mmap of the slots file: a header plus ``count`` slots (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], mm: mmap.mmap, count: int) -> None:
        self.path = Path(path)
        self.mm = mm
        self.count = count

    @classmethod
    def create(cls, path: str | os.PathLike[str], count: int) -> "SlotFile":
        """Create (or truncate) the file with ``count`` zeroed slots; the supervisor's side."""
        size = HEADER_SIZE + count * SLOT_SIZE
        with open(path, "w+b") as f:
            f.write(MAGIC + b"\0" * (size - len(MAGIC)))
            f.flush()
            mm = mmap.mmap(f.fileno(), size)
        return cls(path, mm, count)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "SlotFile":
        """Map an existing slots file (a worker's side, or a test reading it)."""
        try:
            with open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                if size < HEADER_SIZE or (size - HEADER_SIZE) % SLOT_SIZE:
                    raise WatchdogError("bad_slots_file", f"{path}: {size} bytes is not a slots file "
                                        f"({HEADER_SIZE} + n x {SLOT_SIZE}); is {ENV_DIR} right?")
                mm = mmap.mmap(f.fileno(), size)
        except FileNotFoundError:
            raise WatchdogError("no_slots_file", f"{path} does not exist: {ENV_DIR} must name the directory "
                                "the execapp.serve supervisor created") from None
        if mm[:len(MAGIC)] != MAGIC:
            mm.close()
            raise WatchdogError("bad_slots_file", f"{path} does not start with {MAGIC!r}; is {ENV_DIR} right?")
        return cls(path, mm, (size - HEADER_SIZE) // SLOT_SIZE)

    def slot(self, index: int) -> "Slot":
        """One worker's slot."""
        if not 0 <= index < self.count:
            raise WatchdogError("bad_slot", f"slot {index} out of range: {self.path} has {self.count} slots "
                                f"({ENV_SLOT} must be below {self.count})")
        return Slot(self.mm, HEADER_SIZE + index * SLOT_SIZE, index)

    @property
    def flags(self) -> int:
        """The supervisor's flags (``FLAG_STOPPING``)."""
        return int(_FLAGS.unpack_from(self.mm, 8)[0])

    @flags.setter
    def flags(self, value: int) -> None:
        _FLAGS.pack_into(self.mm, 8, value)

    def serving_siblings(self, own: int) -> int:
        """How many other slots belong to a worker that serves now (ready, loop beating)."""
        now = time.monotonic()
        count = 0
        for i in range(self.count):
            if i == own:
                continue
            slot = self.slot(i)
            if slot.state in (STATE_READY, STATE_RECYCLE) and now - slot.heartbeat < FRESH_SECONDS:
                count += 1
        return count

    def read(self) -> list[dict[str, Any]]:
        """Every non-empty slot as a dict (tests and post-mortems)."""
        return [s.describe() for s in (self.slot(i) for i in range(self.count)) if s.pid or s.state]


class Slot:
    """One worker's view of its slot (or the supervisor's view of it)."""

    __slots__ = ("mm", "offset", "index")

    def __init__(self, mm: mmap.mmap, offset: int, index: int) -> None:
        self.mm = mm
        self.offset = offset
        self.index = index

    def mark_buffer(self) -> memoryview:
        """The 64 writable bytes the engine marks each inline run in (``Engine.set_inline_slot``)."""
        return memoryview(self.mm)[self.offset:self.offset + MARK_SIZE]

    def mark(self) -> tuple[str, bool]:
        """(matcher running inline, or '' for none; True when the name was cut at 64 bytes)."""
        raw = bytes(self.mm[self.offset:self.offset + MARK_SIZE])
        if raw[0] == 0:
            return "", False
        name, nul, _ = raw.partition(b"\0")
        # A cut name may end inside a multi-byte character: drop the partial one.
        return name.decode("utf-8", "ignore"), not nul

    def clear(self, pid: int = 0) -> None:
        """Zero the slot (the supervisor, before a new process uses it) and record ``pid``."""
        self.mm[self.offset:self.offset + SLOT_SIZE] = b"\0" * SLOT_SIZE
        _INT.pack_into(self.mm, self.offset + _OFF_PID, pid)

    def beat(self, now: float) -> None:
        """Write one heartbeat (the worker's loop)."""
        _BEAT.pack_into(self.mm, self.offset + _OFF_BEAT, now)

    @property
    def heartbeat(self) -> float:
        """The last heartbeat (``time.monotonic()``), 0.0 before the first."""
        return float(_BEAT.unpack_from(self.mm, self.offset + _OFF_BEAT)[0])

    def _get(self, offset: int) -> int:
        return int(_INT.unpack_from(self.mm, self.offset + offset)[0])

    def _set(self, offset: int, value: int) -> None:
        _INT.pack_into(self.mm, self.offset + offset, value)

    @property
    def pid(self) -> int:
        return self._get(_OFF_PID)

    @pid.setter
    def pid(self, value: int) -> None:
        self._set(_OFF_PID, value)

    @property
    def state(self) -> int:
        return self._get(_OFF_STATE)

    @state.setter
    def state(self, value: int) -> None:
        self._set(_OFF_STATE, value)

    @property
    def stuck(self) -> int:
        return self._get(_OFF_STUCK)

    @stuck.setter
    def stuck(self, value: int) -> None:
        self._set(_OFF_STUCK, value)

    def describe(self) -> dict[str, Any]:
        """The slot as data: index, pid, state name, heartbeat age (s), inline mark, stuck threads."""
        name, cut = self.mark()
        beat = self.heartbeat
        return {"slot": self.index, "pid": self.pid, "state": STATE_NAMES.get(self.state, str(self.state)),
                "heartbeat_age": round(time.monotonic() - beat, 3) if beat else None, "inline": name,
                "inline_truncated": cut, "stuck": self.stuck}


# -- the quarantine list ----------------------------------------------------------------------------

@dataclass(frozen=True)
class QuarantineEntry:
    """One matcher the supervisor caught stalling a worker's loop."""

    matcher: str
    truncated: bool  # the inline mark holds 64 bytes of the name: match matchers by this prefix
    reason: str

    def matches(self, name: str) -> bool:
        """Whether the matcher called ``name`` is this entry's."""
        if not self.truncated:
            return name == self.matcher
        return name.encode("utf-8")[:MARK_SIZE].decode("utf-8", "ignore") == self.matcher


def append_quarantine(directory: str | os.PathLike[str], matcher: str, truncated: bool, reason: str) -> None:
    """Add one entry to the directory's quarantine list (the supervisor; one line, one write)."""
    line = json.dumps({"matcher": matcher, "truncated": truncated, "reason": reason, "at": time.time()}) + "\n"
    # O_APPEND and a single write: readers never see half a line from this writer.
    fd = os.open(Path(directory) / QUARANTINE_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def read_quarantine(directory: str | os.PathLike[str]) -> list[QuarantineEntry]:
    """Every entry of the directory's quarantine list, oldest first ([] when there is none)."""
    try:
        text = (Path(directory) / QUARANTINE_FILE).read_text("utf-8")
    except FileNotFoundError:
        return []
    entries = []
    # Only whole lines: a line being appended right now is read at the next tick.
    for line in text.split("\n")[:-1]:
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            entries.append(QuarantineEntry(str(item["matcher"]), bool(item.get("truncated")),
                                           str(item.get("reason", ""))))
        except (ValueError, KeyError, TypeError):
            log.warning("skipping a malformed line of %s: %r", Path(directory) / QUARANTINE_FILE, line[:200])
    return entries


# -- the worker's side ------------------------------------------------------------------------------

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

    def start_heartbeat(self) -> "asyncio.Task[None]":
        """Start the heartbeat on the running loop (``execapp.serve``, before the worker is built)."""
        self.slot.beat(time.monotonic())
        return asyncio.get_running_loop().create_task(self.heartbeat(), name="execapp-heartbeat")

    async def heartbeat(self) -> None:
        """The loop task writing the heartbeat until cancelled; a stalled loop stops writing it."""
        beat, monotonic, sleep = self.slot.beat, time.monotonic, asyncio.sleep
        while True:
            beat(monotonic())
            await sleep(HEARTBEAT_SECONDS)

    def quarantine_list(self) -> list[QuarantineEntry]:
        """The supervisor's quarantine list as it is now."""
        return read_quarantine(self.directory)


class WatchdogService:
    """Worker service (SERVICE_FACTORIES): applies the quarantine list and watches stuck pool threads.

    Ticked on the housekeeping thread, so a new worker applies the list in its first round of
    ticks, before ``execapp.serve`` lets it listen; a running worker applies a new entry within
    ``interval``. Past ``EXECAPP['STUCK_THREADS_LIMIT']`` stuck pool threads it asks the
    supervisor for a replacement (slot state ``recycle``); the supervisor starts one, waits until
    it listens, then SIGTERMs this worker, which drains.
    """

    interval = 0.5

    def __init__(self, worker: WorkerLike, stuck_limit: int) -> None:
        self.worker = worker
        self.watch: WorkerWatch | None = getattr(worker, "watch", None)
        self.stuck_limit = stuck_limit
        self._list_size = -1
        self._entries: list[QuarantineEntry] = []
        self._applied: set[str] = set()

    def tick(self) -> None:
        """Apply new quarantine entries; publish the stuck-thread count; ask for a recycle past the limit."""
        if self.watch is not None:
            self._apply_quarantine()
        self._check_stuck()

    def _apply_quarantine(self) -> None:
        assert self.watch is not None
        try:
            size = (self.watch.directory / QUARANTINE_FILE).stat().st_size
        except FileNotFoundError:
            size = 0
        if size != self._list_size:  # appended to: read it again (it stays small)
            self._list_size = size
            self._entries = self.watch.quarantine_list()
        if not self._entries:
            return
        engine = self.worker.engine
        # Exact names are pinned even before their matcher is registered here (the profile is
        # kept by name); a name cut at 64 bytes pins every matcher it is a prefix of.
        names = {e.matcher for e in self._entries if not e.truncated}
        if any(e.truncated for e in self._entries):
            names |= set(engine.profiles) | {m.name for m in engine.matchers}
        for name in names:
            if name in self._applied and _is_quarantined(engine, name):
                continue
            entry = next((e for e in self._entries if e.matches(name)), None)
            if entry is None:
                continue
            engine.quarantine(name, entry.reason)
            if name not in self._applied:
                self._applied.add(name)
                log.warning("worker %s: matcher %s quarantined (pinned to the pool): %s", self.worker.id, name,
                            entry.reason)

    def _check_stuck(self) -> None:
        pool = self.worker.pool.stats()
        stuck = int(pool.get("stuck") or 0)
        watch = self.watch
        if watch is not None:
            watch.slot.stuck = stuck
        if stuck < self.stuck_limit or self.worker.recycling:
            return
        if watch is not None and watch.slot.state != STATE_READY:
            return  # starting or already draining: nothing to hand over to
        from .engine.engine import running_handlers

        self.worker.recycling = True
        running = ", ".join(running_handlers()) or "-"
        if watch is None:
            log.error("worker %s: %d pool threads are stuck past their deadline (EXECAPP['STUCK_THREADS_LIMIT'] "
                      "is %d; still running: %s) and no execapp.serve supervisor can replace this worker: "
                      "restart it", self.worker.id, stuck, self.stuck_limit, running)
            return
        log.error("worker %s: %d pool threads are stuck past their deadline (EXECAPP['STUCK_THREADS_LIMIT'] is %d; "
                  "still running: %s): asking the supervisor to recycle this worker", self.worker.id, stuck,
                  self.stuck_limit, running)
        watch.slot.state = STATE_RECYCLE

    def close(self) -> None:
        pass


def _is_quarantined(engine: EngineLike, name: str) -> bool:
    profile = engine.profiles.get(name)
    return profile is not None and bool(getattr(profile, "quarantined", None))


def watchdog_service(worker: WorkerLike) -> WatchdogService:
    """Service factory (SERVICE_FACTORIES): the worker's side of the supervisor's watchdog."""
    from . import conf

    return WatchdogService(worker, int(conf.get("STUCK_THREADS_LIMIT")))
