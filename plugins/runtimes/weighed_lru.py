"""WeighedLRU: a least-recently-used cache bounded by its entries' bytes as well as their count.

The caches of compiled plugin versions were bounded by count only, and an entry's size is
the plugin's: saving one plugin 128 times with 2.8 MB of Lua source (each save a new version)
left ~8 MB of source and bytecode per version in every worker that synced it, ~1 GB per
process, never freed. Each entry is put with its size; the least recently used go once the
count or the bytes are over, but the newest entry stays whatever its size (it is in use).

Not locked: its owners hold their own lock around each call.
"""
from __future__ import annotations

import collections
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class WeighedLRU(Generic[K, V]):
    """Entries by recency with their sizes; ``put`` drops the least recently used past a count
    and a number of bytes (the newest one always kept). The bounds are given at each put, so an
    owner's module constants are read when used (tests lower them)."""

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[K, tuple[V, int]] = collections.OrderedDict()
        self.bytes = 0

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, size: int, max_entries: int, max_bytes: int) -> None:
        """Keep ``value`` as ``size`` bytes under ``key`` (the most recently used), then drop the least
        recently used while there are more than ``max_entries`` or ``max_bytes`` (never ``key``)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._entries[key] = (value, size)
        self.bytes += size
        while len(self._entries) > 1 and (len(self._entries) > max_entries or self.bytes > max_bytes):
            self.bytes -= self._entries.popitem(last=False)[1][1]

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
