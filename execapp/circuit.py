"""A circuit breaker for one dependency: while it is known down, calls fail at once.

A call to a Redis that hangs waits its socket timeout; calls made from a shared thread pool then
queue behind each other, each waiting in turn. Measured: 30 connections sending ``"resend": true``
events while Redis was paused each got ``resend_unavailable`` only after up to 10 s (their claims,
2 s each, queued on the event loop's 6 default executor threads). With a circuit the first
failure opens it: the calls queued behind fail at once, and after ``open_seconds`` one call at a
time tries the dependency again (half-open) and closes the circuit when it answers.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


class CircuitOpen(ConnectionError):
    """The dependency failed a moment ago and is not tried again yet (a ConnectionError, so callers
    that handle the dependency being unreachable handle this too)."""


class Circuit:
    """Fail fast for ``open_seconds`` after a call raised one of ``failures``; then let one call
    at a time through until one succeeds. Thread-safe."""

    def __init__(self, name: str, failures: tuple[type[BaseException], ...], open_seconds: float = 1.0) -> None:
        self.name = name
        self.failures = failures
        self.open_seconds = open_seconds
        self._lock = threading.Lock()
        self._open_until = 0.0  # monotonic; 0: closed
        self._probing = False
        self._reason = ""
        #: Calls refused at once while open (tests, stats).
        self.refused = 0

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until > 0.0

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, unless the circuit is open: CircuitOpen then, naming the failure that opened it."""
        with self._lock:
            if self._open_until > 0.0:
                now = time.monotonic()
                if now < self._open_until or self._probing:
                    self.refused += 1
                    wait = max(0.0, self._open_until - now)
                    raise CircuitOpen(f"{self.name} failed a moment ago ({self._reason}); not tried again for "
                                      f"{wait:.1f} s")
                self._probing = True  # this call tries it; the others keep failing fast meanwhile
        try:
            result = fn()
        except self.failures as exc:
            with self._lock:
                self._open_until = time.monotonic() + self.open_seconds
                self._probing = False
                self._reason = f"{type(exc).__name__}: {exc}".strip()[:200]
            raise
        except BaseException:
            with self._lock:  # another kind of error: the dependency answered
                self._open_until, self._probing = 0.0, False
            raise
        with self._lock:
            self._open_until, self._probing = 0.0, False
        return result
