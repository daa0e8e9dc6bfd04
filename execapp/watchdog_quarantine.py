"""The watchdog's quarantine list: matchers the supervisor caught stalling a worker's loop.

An append-only file (``quarantine.jsonl``) in the watchdog's directory (execapp.watchdog): the
``execapp.serve`` supervisor appends one JSON line per stall, every worker reads it
(``execapp.watchdog_service``) and pins each entry's matcher to the pool. Nothing here imports
Django: the supervisor uses it.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .watchdog import MARK_SIZE

log = logging.getLogger("execapp.watchdog")

QUARANTINE_FILE = "quarantine.jsonl"


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


def quarantine_path(directory: str | os.PathLike[str]) -> Path:
    """The quarantine list's file in the watchdog's ``directory``."""
    return Path(directory) / QUARANTINE_FILE


def append_quarantine(directory: str | os.PathLike[str], matcher: str, truncated: bool, reason: str) -> None:
    """Add one entry to the directory's quarantine list (the supervisor; one line, one write)."""
    line = json.dumps({"matcher": matcher, "truncated": truncated, "reason": reason, "at": time.time()}) + "\n"
    # O_APPEND and a single write: readers never see half a line from this writer.
    fd = os.open(quarantine_path(directory), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def read_quarantine(directory: str | os.PathLike[str]) -> list[QuarantineEntry]:
    """Every entry of the directory's quarantine list, oldest first ([] when there is none)."""
    path = quarantine_path(directory)
    try:
        text = path.read_text("utf-8")
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
            log.warning("skipping a malformed line of %s: %r", path, line[:200])
    return entries
