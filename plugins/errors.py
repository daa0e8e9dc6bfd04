"""The plugin system's errors: each an ExecAppError with its own ``code``."""
from __future__ import annotations

from execapp.engine.errors import ExecAppError, HandlerError


class PluginInvalid(ExecAppError):
    """A plugin or binding was refused at save: it does not compile, or a handler is missing.

    ``code`` is ``plugin_invalid`` unless the runtime said why more precisely (``timeout``: the
    top level ran past the plugin's budget; ``memory_limit``).
    """

    code = "plugin_invalid"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class PluginBusy(ExecAppError):
    """A plugin's concurrency limit (or its instance/shard) had no free slot.

    Raised at once for a handler running inline on the event loop (it must never wait there),
    and after a bounded wait in a pool thread.
    """

    code = "plugin_busy"


class PluginUnavailable(ExecAppError):
    """The plugin was disabled, deleted or replaced while the call was being set up."""

    code = "plugin_unavailable"


class PluginMemoryExceeded(HandlerError):
    """A handler ran into its plugin's memory cap; the instance that did it is discarded."""

    code = "memory_limit"


class HostDenied(ExecAppError):
    """A host API call the plugin has no permission for (raised inside the guest)."""

    code = "permission_denied"


# Raised by runtimes and turned into HandlerError / HandlerTimeout / PluginMemoryExceeded
# (with the plugin and handler named) by plugins.loaded.


class GuestError(Exception):
    """The guest raised (error()/throw/trap); ``poison`` means the instance must be replaced."""

    def __init__(self, message: str, poison: bool = False) -> None:
        super().__init__(message)
        self.poison = poison


class GuestTimeout(GuestError):
    """The guest ran past its deadline and was interrupted inside the sandbox."""

    def __init__(self, message: str = "timed out") -> None:
        super().__init__(message, poison=True)


class GuestMemory(GuestError):
    """The guest exceeded its memory cap."""

    def __init__(self, message: str = "memory cap exceeded") -> None:
        super().__init__(message, poison=True)


class CompileError(Exception):
    """The plugin's code does not compile, instantiate or run its top level (runtime's message).

    ``code`` is the protocol code the refusal carries: ``plugin_invalid``, or ``timeout`` when
    the top level ran past the plugin's budget (``memory_limit`` when it hit the memory cap).
    """

    def __init__(self, message: str, code: str = "plugin_invalid") -> None:
        super().__init__(message)
        self.code = code
