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
