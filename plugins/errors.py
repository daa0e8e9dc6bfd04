"""The plugin system's errors: each an ExecAppError with its own ``code``."""
from __future__ import annotations

from execapp.engine.errors import ExecAppError, HandlerError, NotStarted


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


class PluginBusy(NotStarted):
    """A plugin's concurrency limit (or its instance/shard) had no free slot.

    Raised at once for a handler running inline on the event loop (it must never wait there:
    the engine then runs it in the pool, a NotStarted), and after a bounded wait in a pool thread.
    """

    code = "plugin_busy"


class PluginUnavailable(ExecAppError):
    """The plugin version an event was matched to was closed (replaced, disabled or deleted)
    before its call started: raised by the strategy's call (plugins.strategies); not run."""

    code = "plugin_unavailable"


class PluginMemoryExceeded(HandlerError):
    """A handler ran into its plugin's memory cap; the instance that did it is discarded."""

    code = "memory_limit"


class HostDenied(ExecAppError):
    """A host API call the plugin has no permission for (raised inside the guest)."""

    code = "permission_denied"


# Raised by runtimes and turned into HandlerError / HandlerTimeout / PluginMemoryExceeded
# (with the plugin and handler named) by plugins.strategies (the per-call path).


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


# Host quotas (plugins/runtimes/host.py, plugins/runtimes/kvstore.py). A quota stop ends the call
# like a timeout: the guest cannot catch it and go on (Lua marks the call failed, JS leaves the
# host loop, WASM traps).

#: Each quota code a plugin can meet, and what it means (execapp.protocol.ERROR_CODES repeats them).
QUOTA_CODES: dict[str, str] = {
    "quota_kv": "a kv_set or kv_incr would take the plugin's stored KV data past its key or byte quota",
    "quota_kv_writes": "a handler called kv_set or kv_incr more times in one call than its plugin allows",
    "quota_kv_reads": "a handler made more kv_get calls, or read more value bytes, in one call than its plugin "
                      "allows",
    "quota_http": "a handler made more http_get requests, or received more response bytes, in one call "
                  "than its plugin allows",
}


class GuestQuota(GuestError):
    """A host call would exceed one of the plugin's quotas; ``code`` names which (QUOTA_CODES).

    Raised by the host inside a guest call; it ends the call (``poison``: the instance is
    replaced, since the guest was stopped mid-way as by a timeout).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, poison=True)
        self.code = code


class QuotaExceeded(HandlerError):
    """A handler's call was ended because it hit one of its plugin's host quotas.

    ``code`` is the quota's own code (``quota_kv``, ``quota_kv_writes``, ``quota_kv_reads``, ``quota_http``).
    """

    code = "quota"

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code
