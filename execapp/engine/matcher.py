"""Matchers: a rule (command, regex or event type), a priority, a block flag, a handler and a profile."""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import ConfigError
from .profile import ExecProfile

Handler = Callable[[Any], Any]


class MatcherKind(str, enum.Enum):
    """What a matcher's pattern is tested against."""

    COMMAND = "command"
    REGEX = "regex"
    EVENT = "event"


def parse_command(text: str) -> tuple[str, str] | None:
    """Split ``/name rest`` into (name, rest); None when the text is not a command."""
    if not text.startswith("/"):
        return None
    head, _, rest = text[1:].partition(" ")
    return (head, rest.strip()) if head else None


@dataclass(eq=False)
class Matcher:
    """One handler registration. ``profile`` is required: no matcher exists without one."""

    kind: MatcherKind
    pattern: str
    handler: Handler
    profile: ExecProfile
    name: str
    priority: int = 0
    block: bool = False
    plugin: str | None = None
    seq: int = 0  # registration order, the tie-break for equal priorities
    _regex: re.Pattern | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.profile, ExecProfile):
            raise ConfigError(f"matcher {self.name!r} has no ExecProfile; every matcher must have one")
        if self.kind is MatcherKind.REGEX:
            try:
                self._regex = re.compile(self.pattern)
            except re.error as exc:
                raise ConfigError(f"matcher {self.name!r}: regex {self.pattern!r} does not compile: {exc}") from exc
        elif self.kind is MatcherKind.COMMAND:
            self.pattern = self.pattern.lstrip("/")
            if not self.pattern or " " in self.pattern:
                raise ConfigError(f"matcher {self.name!r}: command {self.pattern!r} must be one word, like 'ping'")

    def match(self, etype: str, text: str, command: tuple[str, str] | None) -> str | None:
        """The handler's argument string if this matcher applies to the event, else None."""
        if self.kind is MatcherKind.COMMAND:
            if command is not None and command[0] == self.pattern and etype == "message":
                return command[1]
            return None
        if self.kind is MatcherKind.REGEX:
            return text if etype == "message" and self._regex.search(text) else None  # type: ignore[union-attr]
        return text if etype == self.pattern else None

    def sort_key(self) -> tuple[int, int]:
        """Higher priority first, then registration order."""
        return (-self.priority, self.seq)
