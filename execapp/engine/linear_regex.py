"""A regex matcher's pattern: RE2, matched in time linear in the text, the time it takes counted.

Why not ``re``: a matcher's pattern comes from a plugin, and every plugin is hostile until proven
otherwise. Python's backtracking ``re`` takes exponential time on patterns like ``(a+)+$`` (1.5 s
for a 25-character message, hours for 40) and holds the GIL all along, on the event loop: one
short frame froze the whole worker, with no deadline or supervisor able to stop it. RE2 has no
backtracking; its cost is bounded by the text's length times the compiled program's size, which
``MAX_PROGRAM_SIZE`` bounds. What remains (up to tens of ms for a 64 KB message against a
pattern whose DFA states explode) is part of the dispatch's time, which the WebSocket path
charges to the sending owner's share of the loop (execapp.loop_share).

RE2 syntax is Python's without lookarounds and backreferences; ``\\d``, ``\\w``, ``\\s`` and
``\\b`` are ASCII. A pattern RE2 refuses raises ``RegexRefused`` with RE2's reason.
"""
from __future__ import annotations

import re._constants as sre_constants
import re._parser as sre_parser
from typing import Any

import re2
from re2 import _re2

#: The largest compiled program a pattern may have (RE2 instructions). ``x{1000}`` is 1,004;
#: an everyday pattern a few dozen. A match costs at most the text's length times this (RE2's
#: NFA), much less when its DFA applies.
MAX_PROGRAM_SIZE = 2000

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # RE2 would log every refused pattern to stderr
_OPTIONS.never_capture = True  # a matcher asks "does it match" only: no submatch engine, the DFA
_UNANCHORED = _re2.RE2.Anchor.UNANCHORED
_NO_MATCH = (-1, -1)


class RegexRefused(ValueError):
    """A pattern RE2 cannot compile, or whose program is over MAX_PROGRAM_SIZE."""


# The last text encoded and its bytes, as one tuple in a one-item list: an event is tried against
# each regex candidate in turn. One tuple, swapped whole, so that two threads dispatching at once
# (a handler may dispatch from a pool thread) can never pair one text with the other's bytes.
_last: list[tuple[str | None, bytes]] = [(None, b"")]

_LITERAL, _SUBPATTERN = sre_constants.LITERAL, sre_constants.SUBPATTERN


def _needle(pattern: str) -> tuple[str, bool] | None:
    """A literal every match of ``pattern`` contains, and whether it is compared case-blind, or None.

    Why: the RE2 binding releases the GIL around every match, so each call on the loop lets any
    thread waiting for the GIL run first (measured: 255 us a call beside a thread spinning in
    Python, against 0.66 us alone; 6-8 us more server CPU per WebSocket event with the bundled
    guard's regex). Most patterns need a literal (``(?i)\bforbidden\b`` needs "forbidden"), and
    a text without it cannot match: ``in`` answers that, holding the GIL. Found with Python's own
    parser on the top-level sequence (a group without flags of its own counts as part of it);
    None when it cannot parse the pattern or finds no literal: RE2 alone then."""
    try:
        parsed = sre_parser.parse(pattern)
    except Exception:  # RE2 syntax Python does not read (\x{e9}, \pL, [[:alpha:]]): no shortcut
        return None
    best, run = "", []
    items: list[Any] = list(parsed)
    while items:
        op, arg = items.pop(0)
        if op is _LITERAL:
            run.append(chr(arg))
            continue
        if op is _SUBPATTERN and arg[1] == arg[2] == 0:  # (group, add_flags, del_flags, items)
            items[:0] = list(arg[3])
            continue
        if len(run) > len(best):
            best = "".join(run)
        run = []
    if len(run) > len(best):
        best = "".join(run)
    if not best:
        return None
    if parsed.state.flags & sre_constants.SRE_FLAG_IGNORECASE:
        # Compared on ASCII text lowered; RE2's Unicode case folding (k and the Kelvin sign, s and
        # the long s) is left to RE2 itself: a text that is not ASCII skips the shortcut.
        return (best.lower(), True) if best.isascii() else None
    return best, False


class LinearRegex:
    """A compiled pattern; ``search(text)`` is True when it matches anywhere in ``text``, else None."""

    __slots__ = ("pattern", "_match", "_needle", "_blind")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        try:
            regexp = _re2.RE2(pattern.encode("utf-8"), _OPTIONS)
        except UnicodeEncodeError:
            raise RegexRefused(f"regex {pattern!r} holds a lone surrogate; write the character itself") from None
        if not regexp.ok():
            why = regexp.error()
            why = why.decode("utf-8", "replace") if isinstance(why, bytes) else why
            if "\\u" in pattern:
                why += r"; write \x{e9} where Python's re takes \u00e9"
            raise RegexRefused(f"regex {pattern!r} is not RE2 syntax ({why}); matchers use RE2, which "
                               "matches in linear time: no lookarounds or backreferences") from None
        size = regexp.ProgramSize()
        if size > MAX_PROGRAM_SIZE:
            raise RegexRefused(f"regex {pattern!r} compiles to {size} RE2 instructions, over the limit of "
                               f"{MAX_PROGRAM_SIZE}; use smaller repetition counts (x{{1000}} is ~1,000)")
        self._match = regexp.Match
        needle = _needle(pattern)
        self._needle: str | None = needle[0] if needle is not None else None
        self._blind = needle is not None and needle[1]

    def search(self, text: str) -> bool | None:
        needle = self._needle
        if needle is not None:  # a text without the literal every match needs: no match, no RE2 call
            if not self._blind:
                if needle not in text:
                    return None
            elif text.isascii() and needle not in text.lower():
                return None
        last = _last[0]
        if last[0] is text:
            data = last[1]
        else:
            # surrogatepass: a lone surrogate (refused by the protocol, possible from Python
            # callers) becomes bytes that match nothing but themselves, not an exception.
            data = text.encode("utf-8", "surrogatepass")
            _last[0] = (text, data)
        return True if self._match(_UNANCHORED, data, 0, len(data))[0] != _NO_MATCH else None
