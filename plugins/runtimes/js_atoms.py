"""QuickJS's atom table against object keys chosen to crowd it, counted before an event crosses.

QuickJS makes each object key of a JSON text it parses an atom. Its atom table is a hash table
with a fixed hash (``h * 263 + unit`` over the key's UTF-16 units, from 1, taken mod 2**30), its
buckets picked by the hash's low bits, and each new atom walks its whole bucket in C, where no
interrupt is polled. An event's data is a client's text: a 62 KB frame of 4,800 keys sharing
one bucket made the parse of one event ~170-200 ms of a single native call (4 ms for other
keys), past any handler's deadline, for every JS plugin the event reached. So before an event
crosses into a Context, its distinct keys are counted by the low ``BUCKET_BITS`` bits of that
hash, and past ``COLLIDING`` in one group the call is refused. Counting buckets, not whole
hashes: 4-character keys have few distinct hashes, and 83 keys to each of 58 hashes crowded one
bucket just as well. (Pure Python: runs anywhere, no Django.)
"""
from __future__ import annotations

from typing import Any

#: Distinct keys of one group allowed: a few ms of bucket walks at most, never met by chance
#: (10,000 ordinary keys put at most ~10 in a group).
COLLIDING = 128
#: The groups: the hash's low 12 bits, the buckets of a table of 4,096 (what the largest event,
#: 64 KiB, grows a Context's table to; a smaller table only merges groups: at most a few
#: thousand short walks more).
BUCKET_BITS = 12
#: A JSON text with at most this many colons (so at most this many keys) is not counted: however
#: its keys crowd, ~5 ms of bucket walks at most (1,024 keys in one bucket: 4.7 ms, against 0.3 ms
#: for other keys; 2,048: 19 ms). Counting costs ~1 us a key: an event with a few hundred keys
#: would pay it for nothing.
FEW_KEYS = 1024
#: A JSON text of at most this many characters is not counted: it cannot hold FEW_KEYS keys.
SCAN_CHARS = 5 * FEW_KEYS
_MASK = (1 << BUCKET_BITS) - 1
_WORD = 0xFFFFFFFF


def atom_bucket(key: str) -> int:
    """The group of ``key``: its QuickJS atom hash's low BUCKET_BITS bits."""
    h = 1
    if key.isascii():
        for unit in key.encode():
            h = (h * 263 + unit) & _WORD
    else:
        for unit in memoryview(key.encode("utf-16-le", "surrogatepass")).cast("H"):
            h = (h * 263 + unit) & _WORD
    return h & _MASK  # (taken mod 2**30 first: the low bits are the same)


def crowded_keys(value: Any, text: str) -> str | None:
    """Why ``value`` (a JSON value whose text is ``text``) may not cross into QuickJS, or None.

    Cheap for what is not hostile: a short text, or one with at most FEW_KEYS colons (at most
    that many keys), is not walked; otherwise each distinct key is hashed once (~1 us)."""
    if len(text) <= SCAN_CHARS or text.count(":") <= FEW_KEYS:
        return None
    groups: dict[int, int] = {}
    seen: set[str] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if item.__class__ is dict:
            for key, inner in item.items():
                if key not in seen:
                    seen.add(key)
                    bucket = atom_bucket(key)
                    count = groups[bucket] = groups.get(bucket, 0) + 1
                    if count > COLLIDING:
                        return (f"the event's data has more than {COLLIDING} distinct keys that share one bucket of "
                                "QuickJS's atom table (each new key is compared with all of them, in one native "
                                "loop no deadline stops); the sandbox allows at most "
                                f"{COLLIDING}: send other keys, or the values as a list")
                if inner.__class__ is dict or inner.__class__ is list:
                    stack.append(inner)
        elif item.__class__ is list:
            stack.extend(inner for inner in item if inner.__class__ is dict or inner.__class__ is list)
    return None
