"""The exception hierarchy: one base, one class per condition, each with a protocol code."""
from __future__ import annotations


class ExecAppError(Exception):
    """Base of every error execapp raises; ``code`` is what a client or operator sees."""

    code = "error"


class HandlerError(ExecAppError):
    """A handler failed; its event still completes with this error recorded."""

    code = "handler_error"


class HandlerTimeout(HandlerError):
    """A handler ran past its time budget (enforced inside its sandbox)."""

    code = "timeout"


class NotStarted(ExecAppError):
    """A handler found what it needs to start taken (its plugin's every slot, say) and did nothing.

    Raised inline on the event loop, where nothing may wait, it sends the handler to the pool,
    where it may wait for what it needs; anywhere else it is the handler's failure.
    """

    code = "not_started"


class Overloaded(ExecAppError):
    """The pool stayed full past the overflow wait; the handler was refused, not run."""

    code = "overloaded"


class PoolClosed(ExecAppError):
    """The pool is draining or drained and accepts no new work."""

    code = "draining"


class BadEvent(ExecAppError):
    """An event has the wrong shape; the message names the field and the fix."""

    code = "bad_event"


class ConfigError(ExecAppError):
    """An engine, pool or profile was built with an impossible setting."""

    code = "config_error"


#: The longest handler error message the engine passes on (characters): a Python handler's
#: ``ValueError("x" * 50_000_000)`` went whole into its error frame, its trace and its log line.
#: Twice the plugins' runtimes' cut of their guests' messages (plugins.runtimes.base.MAX_ERROR_CHARS),
#: so a cut guest message keeps its own note and what the plugin layer adds to it.
MAX_MESSAGE_CHARS = 16384


def describe(exc: BaseException) -> str:
    """``str(exc)`` as an error frame can carry it: cut to MAX_MESSAGE_CHARS, and never raising (an
    exception whose ``__str__`` raises, even SystemExit, is described by its type instead: raised
    on the event loop it skipped the event's other handlers and lost its failure, or stopped the
    server). Empty when the exception has no message."""
    try:
        text = str(exc)
        if text.__class__ is not str:  # a str subclass's own methods could raise too
            text = str.__str__(text)
    except BaseException as inner:  # noqa: B036 - the handler's exception must not escape, whatever it is
        return f"{_name(exc)} (its message could not be read: str() raised {_name(inner)})"
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return f"{text[:MAX_MESSAGE_CHARS]} ... (cut: the message was {len(text)} characters)"


def _name(exc: BaseException) -> str:
    name = type(exc).__name__
    return name if name.__class__ is str else "?"
