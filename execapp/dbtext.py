"""Text the database can store: PostgreSQL refuses a NUL character in a text column and in jsonb,
and no database driver can encode a lone UTF-16 surrogate (U+D800-U+DFFF) as UTF-8.

Event ids, texts, replies and error messages come from clients and plugins, and one NUL among
them made a whole batched write fail: the failure traces of every event of a flush
(execapp.history), every profile of a batch, again at every tick (execapp.persistence). A lone
surrogate did the same: clients' frames refuse them (execapp.protocol), but a plugin's JSON can
spell one (JavaScript's ``"\\ud800"``). Every such value passes through here on its way to a
row: a NUL or a lone surrogate becomes U+FFFD, the replacement character, and nothing else
changes.
"""
from __future__ import annotations

import re
from typing import Any

NUL = "\x00"
REPLACEMENT = "\ufffd"
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def clean_text(value: str) -> str:
    """``value`` with every NUL and lone surrogate replaced by U+FFFD (the same object when it has none)."""
    if value.isascii():  # the common case: one C scan, no regex
        return value.replace(NUL, REPLACEMENT) if NUL in value else value
    return _UNSTORABLE.sub(REPLACEMENT, value)


def clean_json(value: Any) -> Any:
    """A decoded JSON value with every NUL and lone surrogate in its strings (keys included) replaced by U+FFFD."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_text(k) if isinstance(k, str) else k: clean_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_json(v) for v in value]
    return value
