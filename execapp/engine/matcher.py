"""Matchers: a rule (command, regex or event type), a priority, a block flag, a handler and a profile."""
from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import ConfigError
from .linear_regex import LinearRegex, RegexRefused
from .profile import ExecProfile

Handler = Callable[[Any], Any]

#: Bytes of a matcher's inline mark (Engine.set_inline_slot): its name, UTF-8, NUL-padded.
MARK_SIZE = 64


def make_mark(name: str) -> bytes:
    """``name`` as the fixed-size mark written into the inline slot: its UTF-8 bytes cut at
    MARK_SIZE, NUL-padded. A reader (execapp.watchdog) takes the bytes up to the first NUL; no
    NUL means the name was cut, and it matches matchers by the same 64-byte prefix (decoding
    with errors="ignore", as a cut may split a character)."""
    return name.encode("utf-8", "replace")[:MARK_SIZE].ljust(MARK_SIZE, b"\0")


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
    """One handler registration. ``profile`` is required: no matcher exists without one.

    ``timeout`` (seconds, optional): the engine's deadline for one run of the handler. A
    pooled run past it is reported as ``timeout`` and its thread counted as stuck (the pool's
    watcher); plugin bindings carry their plugin's timeout plus a grace (the sandbox stops the
    guest first; this is the backstop). ``mark``: the name as written into the inline slot.
    """

    kind: MatcherKind
    pattern: str
    handler: Handler
    profile: ExecProfile
    name: str
    priority: int = 0
    block: bool = False
    plugin: str | None = None
    seq: int = 0  # registration order, the tie-break for equal priorities
    timeout: float | None = None
    _regex: LinearRegex | None = field(default=None, repr=False)
    mark: bytes = field(default=b"", repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.profile, ExecProfile):
            raise ConfigError(f"matcher {self.name!r} has no ExecProfile; every matcher must have one")
        if self.timeout is not None:
            if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
                raise ConfigError(f"matcher {self.name!r}: timeout={self.timeout!r}; use a number of seconds > 0, "
                                  "or None for no engine deadline")
            self.timeout = float(self.timeout)
        self.mark = make_mark(self.name)  # made once: the inline path only copies it
        if self.kind is MatcherKind.REGEX:
            try:
                self._regex = LinearRegex(self.pattern)
            except RegexRefused as exc:
                raise ConfigError(f"matcher {self.name!r}: {exc}") from None
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


_COMMAND = MatcherKind.COMMAND
_REGEX = MatcherKind.REGEX
_EVENT = MatcherKind.EVENT


class Routes:
    """The registered matchers in dispatch order and, per event shape, the ones that can match.

    Built once per registration change and replaced whole (copy-on-write: a dispatch reads one
    Routes and keeps it), so an event is tested only against its candidates, in dispatch order:
    for a ``/name`` message the command matchers of ``name`` plus what matches any message
    (regex matchers, event matchers of type ``message``); for another message only the latter;
    for any other type its event matchers. Every table is keyed by registered patterns, so it
    stays as small as the registrations, whatever names and types clients send.
    """

    __slots__ = ("matchers", "message", "commands", "heads", "types")

    def __init__(self, matchers: tuple[Matcher, ...] = ()) -> None:
        self.matchers = matchers
        # One pass over the matchers, then one merge per command name: each table was a scan of
        # every matcher per registered name, with a list search per matcher (commands x matchers x
        # regexes: 20 plugins within their binding limits, 2,000 matchers, took 12 s under the
        # engine's registration lock; now linear in the tables' size). Positions keep dispatch order.
        any_message: list[tuple[int, Matcher]] = []
        by_command: dict[str, list[tuple[int, Matcher]]] = {}
        by_type: dict[str, list[Matcher]] = {}
        for position, m in enumerate(matchers):
            if m.kind is _COMMAND:
                by_command.setdefault(m.pattern, []).append((position, m))
            elif m.kind is _REGEX or m.pattern == "message":
                any_message.append((position, m))
            else:
                by_type.setdefault(m.pattern, []).append(m)
        #: Candidates of a message that is not a registered command.
        self.message: tuple[Matcher, ...] = tuple(m for _, m in any_message)
        #: Candidates of a ``/name`` message, by registered command name: its command matchers and
        #: the message's candidates, merged in dispatch order.
        self.commands: dict[str, tuple[Matcher, ...]] = {
            name: tuple(m for _, m in heapq.merge(own, any_message)) for name, own in by_command.items()}
        #: The same keyed by the message's first word, ``/name``: a command sent without arguments
        #: is looked up by the event's text itself (no slice; a str caches its hash).
        self.heads: dict[str, tuple[Matcher, ...]] = {f"/{name}": plan for name, plan in self.commands.items()}
        #: Candidates of an event of another type, by registered type.
        self.types: dict[str, tuple[Matcher, ...]] = {etype: tuple(own) for etype, own in by_type.items()}

    def plan(self, etype: str, text: str) -> tuple[tuple[Matcher, ...], str]:
        """(the candidates for an event, in dispatch order; a command's argument string or "")."""
        if etype != "message":
            return self.types.get(etype, ()), ""
        if text[:1] == "/":  # parse_command, inlined: this runs for every message
            head, _, rest = text.partition(" ")
            plan = self.heads.get(head)
            if plan is not None:
                return plan, rest.strip()
        return self.message, ""
