"""The runtime registry: every runtime a plugin may name, and what the rest of the app needs of it.

A runtime is one module (its ``Compiled``/``Instance`` classes, plugins.runtimes.base) plus one
``Runtime`` entry registered here: its name, label, what its code is (source text, or a binary
with an optional text form), its default instance strategy, its compile function and the file
extensions the admin's upload recognises. ``plugins.spec`` (default strategies), the models
(validation in ``clean()``, binary handling: no ``choices`` on the field, so a new runtime
needs no migration), the admin form (choices, uploads) and every message that lists the
runtimes read this registry; nothing else names a runtime.

The built-in entries name their compile function by dotted path (``"module:attribute"``),
imported at the first compile: ``plugins.spec`` and the models read the registry, and the
runtime modules import the spec, so the registry sits below both; it also keeps lupa, wasmtime
and QuickJS (~0.5 s of imports together) out of processes that never compile a plugin
(``migrate``, ``createsuperuser``). An entry may give the callable itself instead.

Registration happens at import or at ``AppConfig.ready``, before any worker runs; readers see
one dict that ``register``/``unregister`` replace whole, so reading needs no lock.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable

from execapp.engine.errors import ConfigError

from ..errors import CompileError

if TYPE_CHECKING:  # types only: the spec imports this module
    from ..spec import PluginSpec
    from .base import Compiled

#: The instance strategies every runtime runs under, with what the admin shows for each
#: (plugins/strategies.py implements them; docs/plugins.md). The one list of their names.
STRATEGIES: dict[str, str] = {"per_request": "per request (fresh instance)", "pooled": "pooled",
                              "sharded": "sharded by session"}
#: Bytes of a plugin's code in any runtime: its source text (UTF-8), a binary, or a binary's text form.
#: Compiling is linear in it but cannot be interrupted, runs on whichever thread loads the plugin
#: (each worker's registry sync, the admin's save) and allocates outside the plugin's memory cap:
#: a 64 MB Lua source took 2.5 s and 1.1 GB to compile, and every per_request call then loaded
#: its 219 MB of bytecode. The admin's upload limit (plugins.forms) and WASM's module limit are
#: the same 4 MiB; this one holds for code that reaches the database otherwise (loadplugins, SQL).
MAX_CODE_BYTES = 4 << 20
#: The longest runtime name (the length of ``Plugin.runtime``; a longer one needs a migration).
MAX_NAME_LENGTH = 32
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class Runtime:
    """One registry entry: everything the models, forms, spec and loader need of a runtime."""

    #: What ``Plugin.runtime`` and ``PluginSpec.runtime`` hold: lowercase letters, digits, '_'.
    name: str
    #: What the admin shows (e.g. "Lua 5.5").
    label: str
    #: The strategy a plugin with a blank ``strategy`` gets (one of STRATEGIES).
    default_strategy: str
    #: ``compile(spec) -> Compiled``, or its dotted path "package.module:attribute"; raises
    #: plugins.errors.CompileError when the code is refused.
    compile: Callable[[PluginSpec], Compiled] | str = field(repr=False)
    #: True: the runtime loads a binary (``Plugin.module``; uploaded, or made from the text
    #: form kept in ``source`` by ``text_to_binary``). False: it loads ``source`` text.
    binary: bool = False
    #: Upload file names the admin takes as this runtime's source text (e.g. ".lua", ".wat").
    source_extensions: tuple[str, ...] = ()
    #: Upload file names the admin takes as this runtime's binary (e.g. ".wasm"); binary only.
    binary_extensions: tuple[str, ...] = ()
    #: The first bytes of every binary of this runtime (an upload starting so is one); binary only.
    binary_magic: bytes = b""
    #: ``text_to_binary(text) -> bytes`` (or its dotted path): the text form in ``source``
    #: compiled to the binary at save; raises CompileError. None: binaries are uploaded only.
    text_to_binary: Callable[[str], bytes] | str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or len(self.name) > MAX_NAME_LENGTH:
            raise ConfigError(f"runtime name {self.name!r} is not 1-{MAX_NAME_LENGTH} lowercase letters, digits "
                              "or '_' starting with a letter; rename the runtime")
        if self.default_strategy not in STRATEGIES:
            raise ConfigError(f"runtime {self.name!r}: default strategy {self.default_strategy!r} is not one of "
                              f"{', '.join(STRATEGIES)}; use one of those")
        if not self.binary and (self.binary_extensions or self.binary_magic or self.text_to_binary):
            raise ConfigError(f"runtime {self.name!r} loads source text but names binary extensions, magic or "
                              "text_to_binary; set binary=True or drop them")

    @cached_property
    def compiler(self) -> Callable[[PluginSpec], Compiled]:
        """The compile function, imported on first use when the entry names it by path."""
        return _resolve(self.compile, self.name, "compile")

    @cached_property
    def binary_compiler(self) -> Callable[[str], bytes] | None:
        """The text-to-binary function (None when binaries are only uploaded)."""
        return None if self.text_to_binary is None else _resolve(self.text_to_binary, self.name, "text_to_binary")

    def matches_binary(self, filename: str, data: bytes) -> bool:
        """True if an upload called ``filename`` holding ``data`` is one of this runtime's binaries."""
        return self.binary and (filename.endswith(self.binary_extensions)
                                or (bool(self.binary_magic) and data.startswith(self.binary_magic)))


def _resolve(target: Callable[..., Any] | str, runtime: str, what: str) -> Any:
    if not isinstance(target, str):
        return target
    module, _, attribute = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"runtime {runtime!r}: {what} {target!r} does not name an importable "
                          f"'module:attribute' ({type(exc).__name__}: {exc}); fix the registry entry") from None


_runtimes: dict[str, Runtime] = {}


def register(runtime: Runtime) -> None:
    """Add ``runtime`` (registering a name again replaces its entry)."""
    global _runtimes
    _runtimes = {**_runtimes, runtime.name: runtime}


def unregister(name: str) -> None:
    """Remove the runtime called ``name`` (no-op if there is none): plugins naming it are then
    refused at validation and skipped by the registry sync, with the registered names listed."""
    global _runtimes
    _runtimes = {n: r for n, r in _runtimes.items() if n != name}


def get(name: str) -> Runtime | None:
    """The runtime called ``name``, or None."""
    return _runtimes.get(name)


def all_runtimes() -> list[Runtime]:
    """Every registered runtime, in registration order."""
    return list(_runtimes.values())


def names() -> tuple[str, ...]:
    """The registered runtime names, in registration order."""
    return tuple(_runtimes)


def listing(conjunction: str = "or") -> str:
    """The registered names for a message: "lua, wasm or js"."""
    known = list(_runtimes)
    if len(known) < 2:
        return "".join(known) or "(none registered)"
    return f"{', '.join(known[:-1])} {conjunction} {known[-1]}"


def choices() -> list[tuple[str, str]]:
    """``(name, label)`` pairs for a form's select (callable choices: read at each render)."""
    return [(r.name, r.label) for r in _runtimes.values()]


def default_strategy(name: str) -> str:
    """The strategy a plugin of runtime ``name`` gets when it names none ("pooled" if unknown)."""
    runtime = _runtimes.get(name)
    return runtime.default_strategy if runtime is not None else "pooled"


def binary_extensions() -> tuple[str, ...]:
    """The upload extensions of every binary runtime (".wasm")."""
    return tuple(ext for r in _runtimes.values() for ext in r.binary_extensions)


def binary_upload(filename: str, data: bytes) -> Runtime | None:
    """The binary runtime an upload belongs to (by extension or magic bytes), or None for text."""
    return next((r for r in _runtimes.values() if r.matches_binary(filename, data)), None)


def check_code_size(code: str | bytes) -> None:
    """Refuse code over MAX_CODE_BYTES before anything parses it (CompileError)."""
    size = len(code)
    if isinstance(code, str) and size * 4 > MAX_CODE_BYTES and not code.isascii():
        size = len(code.encode("utf-8", "surrogatepass"))  # (at most 4 bytes a character: only then counted)
    if size > MAX_CODE_BYTES:
        how = "strip its debug sections (e.g. wasm-opt --strip-debug)" if isinstance(code, bytes) else "minify it"
        raise CompileError(f"the code is {size} bytes, over the limit of {MAX_CODE_BYTES} bytes for a plugin's code "
                           f"(MAX_CODE_BYTES); make it smaller: {how}, or keep large data out of the code (a handler "
                           "can fetch it with http_get or keep it with kv_set)")


def compile_plugin(spec: PluginSpec) -> Compiled:
    """Compile and validate ``spec`` in its runtime's sandbox; raises plugins.errors.CompileError."""
    runtime = _runtimes.get(spec.runtime)
    if runtime is None:
        raise CompileError(f"unknown runtime {spec.runtime!r}; use {listing()}")
    check_code_size(spec.code)
    return runtime.compiler(spec)


# The built-in runtimes. Default strategies chosen by bench/bench_plugins.py (docs/benchmarks.md,
# Plugins). Lua: a fresh environment per call on a per-thread runtime costs ~3.8 us against
# ~2.3 us pooled (a fresh runtime + sandbox per call would be ~130 us), so full isolation is the
# default. WASM: a fresh Store+Instance per call is ~72 us against ~17 us pooled, so pooled.
# JS: a new QuickJS Context per call is ~140 us against ~4 us reused, so pooled (a shared free
# list of Contexts, each running one call at a time on whichever thread calls).
register(Runtime("lua", "Lua 5.5", "per_request", "plugins.runtimes.lua:LuaCompiled", source_extensions=(".lua",)))
register(Runtime("wasm", "WebAssembly", "pooled", "plugins.runtimes.wasm:WasmCompiled", binary=True,
                 source_extensions=(".wat",), binary_extensions=(".wasm",), binary_magic=b"\0asm",
                 text_to_binary="plugins.runtimes.wasm:wat_to_wasm"))
register(Runtime("js", "JavaScript (QuickJS)", "pooled", "plugins.runtimes.js:JsCompiled", source_extensions=(".js",)))
