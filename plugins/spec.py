"""PluginSpec: the immutable, Django-free description of one plugin version that runtimes load.

The runtimes a spec may name, their default strategies and the strategy names live in the
runtime registry (plugins.runtimes.registry).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .runtimes.registry import default_strategy

PERMISSIONS = ("log", "kv", "sleep", "http")

#: Limits every plugin gets unless its row says otherwise.
DEFAULT_TIMEOUT_MS = 1000
DEFAULT_MEMORY_MB = 16
DEFAULT_MAX_CONCURRENCY = 8
DEFAULT_POOL_SIZE = 4
DEFAULT_SHARD_COUNT = 4
#: The largest memory cap of one instance, and the most instances (pool_size, shard_count) or
#: calls at once (max_concurrency) a plugin may ask for: together, what one plugin can make each
#: worker process hold (up to 256 x 1 GiB of address space is already an operator's deliberate choice).
MAX_MEMORY_MB = 1024
MAX_INSTANCES = 256


@dataclass(frozen=True)
class Quotas:
    """A plugin's host-resource quotas (docs/plugins.md, "Limits and quotas").

    ``kv_keys``/``kv_bytes`` bound what the plugin has stored (UTF-8 bytes of keys plus values,
    across calls and workers); the others bound one call (``kv_reads``/``kv_read_bytes``: kv_get
    calls and the UTF-8 bytes of the values they returned). Hitting a KV or HTTP quota ends the
    call with its code (plugins.errors.QUOTA_CODES); log lines past a log quota are dropped.
    """

    kv_keys: int = 10_000
    kv_bytes: int = 16 << 20
    kv_writes: int = 100
    kv_reads: int = 1_000
    kv_read_bytes: int = 16 << 20
    log_lines: int = 100
    log_bytes: int = 64 << 10
    http_requests: int = 10
    http_bytes: int = 256 << 10


DEFAULT_QUOTAS = Quotas()


def code_version(runtime: str, code: str | bytes) -> str:
    """The content hash that identifies a plugin version (first 16 hex digits of SHA-256)."""
    data = code.encode() if isinstance(code, str) else bytes(code)
    return hashlib.sha256(runtime.encode() + b"\0" + data).hexdigest()[:16]


@dataclass(frozen=True)
class PluginSpec:
    """Everything a runtime and a strategy need about one plugin version; hashable, no Django."""

    name: str
    runtime: str
    code: str | bytes  # Lua/JS source text, or a WASM binary
    timeout: float = DEFAULT_TIMEOUT_MS / 1000  # seconds, enforced inside the sandbox
    memory_bytes: int = DEFAULT_MEMORY_MB << 20
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    strategy: str = ""  # "" means the runtime's default (its registry entry)
    pool_size: int = DEFAULT_POOL_SIZE
    shard_count: int = DEFAULT_SHARD_COUNT
    permissions: frozenset[str] = frozenset({"log"})
    http_allowlist: tuple[str, ...] = ()
    quotas: Quotas = DEFAULT_QUOTAS
    version: str = field(default="")

    def __post_init__(self) -> None:
        if not self.version:
            object.__setattr__(self, "version", code_version(self.runtime, self.code))
        if not self.strategy:
            object.__setattr__(self, "strategy", default_strategy(self.runtime))

    @property
    def config_key(self) -> tuple:
        """Changes whenever anything that requires rebuilding the loaded plugin changes."""
        return (self.version, self.timeout, self.memory_bytes, self.max_concurrency, self.strategy,
                self.pool_size, self.shard_count, self.permissions, self.http_allowlist, self.quotas)
