"""Regex matchers match in linear time (RE2): a plugin's pattern cannot stall the loop by
backtracking, and a pattern RE2 cannot run in linear time is refused with the reason."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execapp.engine import ConfigError, Engine
from execapp.engine.linear_regex import MAX_PROGRAM_SIZE, LinearRegex, RegexRefused

# Patterns Python's re backtracks on exponentially, each with a text it never finishes.
CATASTROPHIC = [
    (r"(a+)+$", "a" * 60 + "b"),
    (r"(a|aa)*c", "a" * 80),
    (r"^(\w+\s?)*$", "word " * 30 + "!"),
    (r"(x+x+)+y", "x" * 60),
]


def test_catastrophic_patterns_end_at_once_through_the_engine() -> None:
    # In a child: with backtracking, each of these holds the GIL for hours, which no timeout in
    # this process could interrupt. 60 s is far past RE2 (microseconds) and far short of re.
    script = textwrap.dedent(f"""
        from execapp.engine import Engine, Event
        from execapp.engine.linear_regex import LinearRegex
        cases = {CATASTROPHIC!r}
        engine = Engine(pool_enabled=False)
        for i, (pattern, text) in enumerate(cases):
            engine.on_regex(pattern, lambda ctx: "matched", matcher_name=f"m{{i}}")
        for pattern, text in cases:
            assert engine.process_event_sync(Event(text=text)).replies is not None
            assert LinearRegex(pattern).search(text) is None, pattern
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("pattern, text, found", [
    (r"(?i)\bforbidden\b", "it is FORBIDDEN here", True),
    (r"(?i)\bforbidden\b", "forbiddenness", None),
    (r"^/x", "/x y", True),
    (r"^/x", "a /x", None),
    ("café", "un café", True),
    (r"caf\x{e9}", "un café", True),
    (r"", "", True),
    (r"\d{3}", "ab 123", True),
])
def test_everyday_patterns_match_as_re_does(pattern: str, text: str, found: bool | None) -> None:
    import re

    assert LinearRegex(pattern).search(text) is found
    if "\\x{" not in pattern:  # RE2's spelling of a code point
        assert (re.search(pattern, text) is not None) == bool(found)


@pytest.mark.parametrize("pattern, why", [
    (r"(a)\1", "not RE2 syntax"),
    (r"foo(?=bar)", "not RE2 syntax"),
    (r"(", "not RE2 syntax"),
    (r"caf\u00e9", r"write \\x\{e9\}"),
    ("x{1000}" * 3, f"over the limit of {MAX_PROGRAM_SIZE}"),
])
def test_a_pattern_that_cannot_run_in_linear_time_is_refused_with_the_reason(pattern: str, why: str) -> None:
    with pytest.raises(RegexRefused, match=why):
        LinearRegex(pattern)
    with pytest.raises(ConfigError, match="matcher 'm'.*" + why.split()[0]):
        Engine(pool_enabled=False).on_regex(pattern, lambda ctx: None, matcher_name="m")


# -- the literal shortcut ------------------------------------------------------------------------

PATTERNS = [r"(?i)\bforbidden\b", r"^/x", r"hel+o", r"(abc)def", r"(?:foo)+bar", r"x{3}yz", r"(?i)kelvins?",
            r"(?i:ab)c", r"a.b", r"(?i)s\w+k"]


@given(st.sampled_from(PATTERNS), st.text(alphabet="abcdefhiklnorsxyzABKS/ \u212a\u017f\u00e9", max_size=30))
@settings(max_examples=400, deadline=None)
def test_the_literal_shortcut_answers_as_re2_itself(pattern: str, text: str) -> None:
    """A text without the literal every match needs is no match without calling RE2; with case
    folding, a text RE2 folds beyond ASCII (the Kelvin sign, the long s) still goes to RE2."""
    import re2

    options = re2.Options()
    options.log_errors = False
    expected = re2.compile(pattern, options).search(text) is not None
    for probe in (text, "forbidden " + text, text + "Forbidden", "hello " + text, "/x" + text):
        assert bool(LinearRegex(pattern).search(probe)) == (re2.compile(pattern, options).search(probe) is not None)
    assert bool(LinearRegex(pattern).search(text)) == expected


def test_a_text_without_the_needed_literal_never_lets_another_thread_take_the_gil() -> None:
    """The RE2 binding releases the GIL around each match: on the event loop, every call let any
    thread waiting for the GIL run first. A message the shortcut rules out must not call it."""
    import threading
    import time

    ran = [0]
    stop = threading.Event()

    def other() -> None:
        while not stop.is_set():
            ran[0] += 1
            time.sleep(0)  # give the GIL back at once: it runs only when the main thread lets go

    regex = LinearRegex(r"(?i)\bforbidden\b")
    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)  # no forced switch: only a release lets the other thread run
    thread = threading.Thread(target=other)
    try:
        thread.start()
        time.sleep(0.01)  # it runs once and now waits for the GIL
        before = ran[0]
        for _ in range(2000):
            regex.search("/ping")
        during = ran[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(old)
        thread.join()
    # Measured: 0 with the shortcut; 21-34 without it (the main thread often takes the GIL back
    # before the other thread wakes, but not always).
    assert during <= 2, during
    assert regex.search("this is forbidden") is True  # the match itself still goes to RE2
