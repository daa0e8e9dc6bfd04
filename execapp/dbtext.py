"""Text the database can store: PostgreSQL refuses a NUL character in a text column and in jsonb.

Event ids, texts, replies and error messages come from clients and plugins, and one NUL among
them made a whole batched write fail: the failure traces of every event of a flush
(execapp.history), every profile of a batch, again at every tick (execapp.persistence). Every
such value passes through here on its way to a row: a NUL becomes U+FFFD, the replacement
character, and nothing else changes.
"""
from __future__ import annotations

from typing import Any

NUL = "\x00"
REPLACEMENT = "\ufffd"


def clean_text(value: str) -> str:
    """``value`` with every NUL replaced by U+FFFD (the same object when it has none)."""
    return value.replace(NUL, REPLACEMENT) if NUL in value else value


def clean_json(value: Any) -> Any:
    """A decoded JSON value with every NUL in its strings (keys included) replaced by U+FFFD."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_text(k) if isinstance(k, str) else k: clean_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_json(v) for v in value]
    return value
