"""The watchdog's shared memory: the slots file, one heartbeat and inline-mark slot per worker.

The ``execapp.serve`` supervisor creates one small file of slots (``slots``) and an append-only
list of quarantined matchers (``quarantine.jsonl``, execapp.watchdog_quarantine) in one
directory, and tells each worker process its directory and slot number through the environment
(``EXECAPP_WATCHDOG_DIR``, ``EXECAPP_WATCHDOG_SLOT``; the worker's end: execapp.watchdog_worker).
Both sides ``mmap`` the slots file, so what a worker wrote is still there after the worker is
SIGKILLed: the supervisor reads it from outside. What a worker does with the quarantine list
and its stuck threads is execapp.watchdog_service.

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
96     8       drained: 1 while an operator's drain holds this worker (``manage.py drain``, until
               ``undrain``); the supervisor starts whatever replaces it drained too
104    8       housekeeper beat: ``time.monotonic()`` when the worker's housekeeping thread last
               came round (before each round of service ticks, every 0.1 s); the supervisor
               recycles a ready worker whose housekeeper is silent past HOUSEKEEPER_STALL_SECONDS
====== ======= =================================================================================

A 64-byte header holds the supervisor's flags (``FLAG_STOPPING`` while it stops every worker).
Nothing here imports Django: the supervisor and the worker both use it (docs/operations.md).
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

ENV_DIR = "EXECAPP_WATCHDOG_DIR"
ENV_SLOT = "EXECAPP_WATCHDOG_SLOT"
SLOTS_FILE = "slots"
#: A slot's ``drained``: held by a drain of its worker alone (``drain --worker``), or by a drain
#: of every worker (``drain``), which a worker starting beside it follows too (execapp.drain).
HELD_ALONE, HELD_ALL = 1, 2

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
_INT = struct.Struct("=q")  # pid 72, state 80, stuck 88, drained 96
_OFF_BEAT, _OFF_PID, _OFF_STATE, _OFF_STUCK, _OFF_DRAINED, _OFF_HOUSE = 64, 72, 80, 88, 96, 104

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

    def drained_siblings(self, own: int, held: int) -> int:
        """How many other slots belong to a worker that serves now and whose ``drained`` is ``held``."""
        now = time.monotonic()
        return sum(1 for i in range(self.count) if i != own and (slot := self.slot(i)).drained == held
                   and slot.state in (STATE_READY, STATE_RECYCLE) and now - slot.heartbeat < FRESH_SECONDS)

    def read(self) -> list[dict[str, Any]]:
        """Every non-empty slot as a dict (tests and post-mortems)."""
        return [s.describe() for s in (self.slot(i) for i in range(self.count)) if s.pid or s.state]


class _SlotInt:
    """One 8-byte integer field of a slot (pid, state, stuck), read and written in the mmap."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def __get__(self, slot: "Slot", owner: type | None = None) -> int:
        return int(_INT.unpack_from(slot.mm, slot.offset + self.offset)[0])

    def __set__(self, slot: "Slot", value: int) -> None:
        _INT.pack_into(slot.mm, slot.offset + self.offset, value)


class Slot:
    """One worker's view of its slot (or the supervisor's view of it)."""

    __slots__ = ("mm", "offset", "index")

    pid = _SlotInt(_OFF_PID)
    state = _SlotInt(_OFF_STATE)  # STATE_*
    stuck = _SlotInt(_OFF_STUCK)  # pool threads stuck past their deadline now
    drained = _SlotInt(_OFF_DRAINED)  # 1 while an operator's drain holds the worker (inherited by its replacement)

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
        self.pid = pid

    def beat(self, now: float) -> None:
        """Write one heartbeat (the worker's loop)."""
        _BEAT.pack_into(self.mm, self.offset + _OFF_BEAT, now)

    @property
    def heartbeat(self) -> float:
        """The last heartbeat (``time.monotonic()``), 0.0 before the first."""
        return float(_BEAT.unpack_from(self.mm, self.offset + _OFF_BEAT)[0])

    def beat_house(self, now: float) -> None:
        """Write one housekeeper beat (the worker's housekeeping thread, before each round of ticks)."""
        _BEAT.pack_into(self.mm, self.offset + _OFF_HOUSE, now)

    @property
    def house_beat(self) -> float:
        """The housekeeper's last beat (``time.monotonic()``), 0.0 before the first."""
        return float(_BEAT.unpack_from(self.mm, self.offset + _OFF_HOUSE)[0])

    def describe(self) -> dict[str, Any]:
        """The slot as data: index, pid, state name, heartbeat age (s), inline mark, stuck threads."""
        name, cut = self.mark()
        beat, house = self.heartbeat, self.house_beat
        return {"slot": self.index, "pid": self.pid, "state": STATE_NAMES.get(self.state, str(self.state)),
                "heartbeat_age": round(time.monotonic() - beat, 3) if beat else None,
                "housekeeper_age": round(time.monotonic() - house, 3) if house else None, "inline": name,
                "inline_truncated": cut, "stuck": self.stuck, "drained": bool(self.drained)}
