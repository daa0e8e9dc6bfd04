"""Keeping engines in step with the plugin registry, and the instance-pool stats of this process.

- ``sync_engine(engine, force=False)`` builds matchers from the enabled plugins and bindings
  and installs them with ``engine.set_matchers`` when the registry version changed (one
  indexed query otherwise). Matcher names are ``<plugin>.<handler>`` (plus ``@kind:pattern``
  when one plugin binds a handler twice): stable, so profiles survive refreshes.
- ``registry_sync(worker)`` is the worker service that polls the version every
  ``EXECAPP['REGISTRY_POLL_SECONDS']`` (registered as ``"plugins.sync"`` with
  execapp.extensions by plugins.apps). Within one process a save or delete also refreshes
  every engine synced before, on commit: an edit takes effect on the next event there;
  other processes see it within one poll interval.
- ``instance_pool_stats()`` has one row per loaded plugin (dashboard, Prometheus, execstatus:
  the stats provider ``"plugin_pools"`` of execapp.extensions).

A stored plugin the runtime refuses (code that no longer compiles, or a top level that runs
past its budget, ``timeout``) is skipped with one error log naming it while every other plugin
serves. The refusal is remembered for that version and limits (a runaway top level costs its
``timeout_ms`` once per worker, not at every registry change); a ``timeout`` refusal is
retried after ``REFUSAL_RETRY_SECONDS`` in case the machine was only busy.
"""
from __future__ import annotations

import atexit
import collections
import itertools
import logging
import threading
import time
import weakref
from typing import Any, Iterable

from django.db import close_old_connections

from execapp import conf
from execapp.engine import Matcher
from execapp.engine.linear_regex import LinearRegex, RegexRefused
from execapp.seams import EngineLike, WorkerLike

from .errors import PluginInvalid
from .loaded import LoadedPlugin, validate
from .models import (
    Binding,
    Plugin,
    RegistryState,
    binding_limits,
    code_total_limit,
    fan_out_key,
    fan_out_limit,
    registry_limits,
    sees_every_message,
)

log = logging.getLogger("plugins.sync")

#: How long starting a worker waits for its first registry sync (compiles every plugin once).
FIRST_SYNC_WAIT_SECONDS = 10.0
#: After this long a plugin refused with ``timeout`` (its top level ran past its budget) is
#: validated again at the next sync; other refusals last until the plugin changes.
REFUSAL_RETRY_SECONDS = 60.0


class PluginManager:
    """The process's loaded plugins by name, shared by every engine (so limits are per process)."""

    def __init__(self) -> None:
        self._loaded: dict[str, LoadedPlugin] = {}
        # Versions load() replaced, closed by the next retain(): after the engine has switched
        # to the new matchers, so only events already on their way meet a closed version.
        self._replaced: list[LoadedPlugin] = []
        # name -> (config_key, the refusal, when): a refused version is not validated again
        self._refused: dict[str, tuple[tuple, PluginInvalid, float]] = {}
        self._lock = threading.Lock()

    def load(self, plugin: Any) -> LoadedPlugin:
        """The LoadedPlugin for a Plugin row, rebuilt only when its code or limits changed (the
        version it replaces serves on until the next ``retain``).

        Raises PluginInvalid if the runtime refuses it; the same refusal again (without running
        the code) while the plugin is unchanged (a ``timeout`` one for REFUSAL_RETRY_SECONDS).
        """
        spec = plugin.to_spec()
        with self._lock:
            current = self._loaded.get(spec.name)
            if current is not None and current.spec.config_key == spec.config_key:
                return current
            refused = self._refused.get(spec.name)
            if refused is not None and refused[0] == spec.config_key and (
                    refused[1].code != "timeout" or time.monotonic() - refused[2] < REFUSAL_RETRY_SECONDS):
                again = PluginInvalid(str(refused[1]), code=refused[1].code)
                again.logged = True  # type: ignore[attr-defined]  # sync_engine logged the first one
                raise again
        try:
            compiled = validate(spec)
        except PluginInvalid as exc:
            with self._lock:
                self._refused[spec.name] = (spec.config_key, exc, time.monotonic())
            raise
        with self._lock:
            self._refused.pop(spec.name, None)
        loaded = LoadedPlugin(spec, compiled)
        with self._lock:
            old, self._loaded[spec.name] = self._loaded.get(spec.name), loaded
            if old is not None:
                self._replaced.append(old)
        return loaded

    def retain(self, names: set[str]) -> None:
        """Close every loaded plugin not in ``names`` (disabled or deleted) and every version
        ``load`` replaced; a call that reaches a closed one is refused with PluginUnavailable."""
        with self._lock:
            gone = [self._loaded.pop(n) for n in list(self._loaded) if n not in names]
            gone += self._replaced
            self._replaced = []
            for name in [n for n in self._refused if n not in names]:
                del self._refused[name]
        for loaded in gone:
            loaded.close()

    def get(self, name: str) -> LoadedPlugin | None:
        return self._loaded.get(name)

    def all(self) -> list[LoadedPlugin]:
        with self._lock:
            return list(self._loaded.values())

    def clear(self) -> None:
        self.retain(set())


manager = PluginManager()
# Close the loaded plugins (their instances) while the runtimes' libraries are still loaded.
atexit.register(manager.clear)
_synced: "weakref.WeakKeyDictionary[EngineLike, int]" = weakref.WeakKeyDictionary()
_sync_lock = threading.Lock()


def sync_engine(engine: EngineLike, force: bool = False) -> bool:
    """Install matchers for the enabled plugins if the registry changed; True if it did."""
    version = RegistryState.current()  # read first: a change racing this sync is seen next time
    with _sync_lock:
        if not force and _synced.get(engine) == version:
            return False
        plugins = list(Plugin.objects.filter(enabled=True).prefetch_related("bindings"))
        bindings, not_loaded = _registry_share(plugins)
        matchers: list[Matcher] = []
        for plugin in plugins:
            if plugin.name not in bindings:  # past MAX_PLUGINS: never compiled here
                continue
            try:
                loaded = manager.load(plugin)
            except PluginInvalid as exc:  # saved before a runtime upgrade, or edited in SQL
                not_loaded[plugin.name] = exc.code
                # Logged once per refusal (a remembered one is raised again at every sync).
                if not getattr(exc, "logged", False):
                    exc.logged = True  # type: ignore[attr-defined]
                    log.error("plugin %s not loaded (%s): %s; every other plugin serves", plugin.name, exc.code, exc)
                continue
            matchers.extend(_matchers(engine, plugin, loaded, bindings[plugin.name]))
        engine.set_matchers(matchers)
        _set_hints(plugins, bindings, not_loaded)
        manager.retain({p.name for p in plugins})
        _synced[engine] = version
    log.info("engine synced to registry version %s: %d plugins, %d matchers", version, len(plugins), len(matchers))
    return True


#: Why an unmatched event matched nothing, by (kind, pattern): bindings of disabled plugins,
#: disabled bindings, plugins that did not load. Replaced whole at each sync (read lock-free).
_hints: dict[tuple[str, str], str] = {}
#: The regex hints, compiled when the hints are made (on the sync's thread), not on the loop.
_regex_hints: list[tuple[LinearRegex, str, str]] = []
#: Regex patterns the unmatched hint tries at most: each is a search of every message that
#: matched nothing, on the event loop (the regex bindings of disabled plugins are bounded per plugin only).
MAX_HINT_REGEXES = 32
#: Bindings of disabled plugins the hints are made of at most, at each registry change (the first
#: plugins by id): past them an unmatched event gets no hint, nothing else changes.
MAX_HINT_BINDINGS = 2_000


def _set_hints(enabled: list[Any], bindings: dict[str, list[Any]], not_loaded: dict[str, str]) -> None:
    """Rebuild ``_hints`` from this sync's registry read (one more query, on a registry change only)."""
    hints: dict[tuple[str, str], str] = {}
    for plugin in enabled:
        loads = bindings[plugin.name] if plugin.name in bindings else _loadable(plugin.name, plugin.bindings.all())
        for b in loads:
            if plugin.name in not_loaded:
                hints.setdefault((b.kind, b.pattern), f"plugin {plugin.name!r} is enabled but did not load "
                                 f"({not_loaded[plugin.name]}); the server log says why")
            elif not b.enabled:
                hints.setdefault((b.kind, b.pattern), f"its binding in plugin {plugin.name!r} is disabled (enable it "
                                 "in the admin's Plugins page)")
    # Disabled plugins are not counted (MAX_PLUGINS counts enabled ones): their bindings are read
    # up to MAX_HINT_BINDINGS, and without the plugins' code (select_related read a plugin's whole
    # source once per binding). 2,000 disabled plugins of 100 bindings made every registry change
    # cost each worker 40-60 s and ~390 MiB here, and kept 200,000 hints.
    disabled = (Binding.objects.filter(plugin__enabled=False).select_related("plugin")
                .only("pk", "kind", "pattern", "handler", "plugin_id", "plugin__name").order_by("plugin_id", "pk")
                [:MAX_HINT_BINDINGS])
    for _, group in itertools.groupby(disabled, key=lambda b: b.plugin_id):
        for b in _loadable("", group):
            hints.setdefault((b.kind, b.pattern), f"plugin {b.plugin.name!r} is disabled (enable it in the admin's "
                             "Plugins page)")
    _use_hints(hints)


def _use_hints(hints: dict[tuple[str, str], str]) -> None:
    """Serve ``hints`` from now on, their first MAX_HINT_REGEXES regex patterns compiled here (RE2,
    like the matchers: a backtracking engine would hold the loop on a crafted message; and
    compiled once a registry change, where a cache of 256 recompiled every pattern for every
    unmatched message once there were more)."""
    global _hints, _regex_hints
    regexes: list[tuple[LinearRegex, str, str]] = []
    for (kind, pattern), why in hints.items():
        if kind == "regex" and len(regexes) < MAX_HINT_REGEXES:
            try:
                regexes.append((LinearRegex(pattern), pattern, why))
            except RegexRefused:
                pass
    _hints, _regex_hints = hints, regexes


def unmatched_hint(event_type: str, text: str) -> str | None:
    """Why an event matched no handler, when a disabled or unloaded plugin binds it (the hint
    provider plugins.apps registers with execapp.extensions): "/slow: plugin 'slow' is disabled"."""
    hints = _hints
    if not hints:
        return None
    if event_type == "message" and text.startswith("/"):
        word = text[1:].split(None, 1)[0] if text[1:].strip() else ""
        why = hints.get(("command", word))
        if why:
            return f"no enabled handler for /{word}: {why}"
    why = hints.get(("event", event_type))
    if why:
        return f"no enabled handler for events of type {event_type!r}: {why}"
    if event_type == "message":
        for regex, pattern, why in _regex_hints:
            if regex.search(text):
                return f"no enabled handler matched; regex {pattern!r} would have: {why}"
    return None


def _matchers(engine: EngineLike, plugin: Any, loaded: LoadedPlugin, bindings: list[Any]) -> list[Matcher]:
    out: list[Matcher] = []
    seen: set[str] = set()
    pool_only = _pool_only(loaded.spec)
    for b in bindings:
        if not b.enabled:
            continue
        if b.handler not in loaded.compiled.handlers:
            log.error("plugin %s: binding %s skipped: handler %r is not defined", plugin.name, b.pk, b.handler)
            continue
        name = f"{plugin.name}.{b.handler}"
        if name in seen:
            name = f"{name}@{b.kind}:{b.pattern}"
        seen.add(name)
        try:
            matcher = engine.make_matcher(b.kind, b.pattern, loaded.engine_handler(b.handler), priority=b.priority,
                                          block=b.block, name=name, plugin=plugin.name)
        except Exception as exc:  # a pattern the engine refuses: skip the binding, keep the rest
            log.error("plugin %s: binding %s skipped: %s", plugin.name, b.pk, exc)
            continue
        matcher.profile.pin_to_pool(pool_only)
        out.append(matcher)
    return out


def _registry_share(enabled: list[Any]) -> tuple[dict[str, list[Any]], dict[str, str]]:
    """(the bindings this worker loads, by plugin; why the other enabled plugins are not loaded).

    Per plugin its ``_loadable`` bindings; across plugins, by id (the oldest first: a plugin
    added later cannot push out one that serves), at most MAX_PLUGINS plugins and MAX_REGEX_BINDINGS
    regex bindings (plugins.models refuses more at save; rows written otherwise, or kept from
    before a lower limit, are skipped here with one error log each). The per-plugin limits alone
    let 500 plugins of 10 regexes each cost every message 5,000 searches on the event loop, and
    every plugin is compiled and holds its instances in every worker."""
    most_plugins, most_regex = registry_limits()
    most_code, code = code_total_limit(), 0
    most_fan_out, fan_out = fan_out_limit(), collections.Counter[tuple[str, str]]()
    out: dict[str, list[Any]] = {}
    over: dict[str, str] = {}
    regexes = 0
    for plugin in sorted(enabled, key=lambda p: p.pk):
        if len(out) >= most_plugins:
            over[plugin.name] = "too_many_plugins"
            continue
        if code + plugin.code_size() > most_code:
            over[plugin.name] = "too_much_code"
            continue
        code += plugin.code_size()
        kept, dropped, crowded = [], 0, 0
        for b in _loadable(plugin.name, plugin.bindings.all(), say=True):
            if sees_every_message(b.kind, b.pattern):
                if regexes >= most_regex:
                    dropped += 1
                    continue
                regexes += 1
            else:
                key = fan_out_key(b.kind, b.pattern)
                if fan_out[key] >= most_fan_out:
                    crowded += 1
                    continue
                fan_out[key] += 1
            kept.append(b)
        if dropped:
            log.error("plugin %s: %d regex bindings skipped: the enabled plugins may have at most %d regex bindings "
                      "together (EXECAPP['MAX_REGEX_BINDINGS']; the plugins created first keep theirs); remove regex "
                      "bindings in the admin, or raise the setting", plugin.name, dropped, most_regex)
        if crowded:
            log.error("plugin %s: %d bindings skipped: at most %d bindings of all enabled plugins may share one "
                      "command or event type (EXECAPP['MAX_BINDINGS_PER_PATTERN']; the plugins created first keep "
                      "theirs); remove them in the admin, or raise the setting", plugin.name, crowded, most_fan_out)
        out[plugin.name] = kept
    if over:
        log.error("%d enabled plugins not loaded (%s): at most %d enabled plugins load, with at most %d bytes of code "
                  "together (EXECAPP['MAX_PLUGINS'], ['MAX_TOTAL_CODE_BYTES']; the first created load); disable or "
                  "delete some in the admin, or raise the settings", len(over),
                  ", ".join(sorted(over)[:10]) + (", ..." if len(over) > 10 else ""), most_plugins, most_code)
    return out, over


def _loadable(plugin: str, bindings: Iterable[Any], say: bool = False) -> list[Any]:
    """The bindings of one plugin a worker loads, by id: at most MAX_BINDINGS_PER_PLUGIN, of them at
    most MAX_REGEX_BINDINGS_PER_PLUGIN regex ones (plugins.models refuses more at save; rows written
    otherwise, or kept from before a lower limit, are skipped here, with one error log if ``say``).
    Every regex binding, and every disabled one in the unmatched hint, costs every message a
    search on the event loop."""
    most, most_regex = binding_limits()
    out: list[Any] = []
    regexes = skipped = 0
    seen: set[tuple[str, str, str]] = set()
    for b in sorted(bindings, key=lambda b: b.pk):
        regex = sees_every_message(b.kind, b.pattern)
        if len(out) >= most or (regex and regexes >= most_regex) or (b.kind, b.pattern, b.handler) in seen:
            skipped += 1  # (a copy of a binding kept: the same handler would run twice for one event)
            continue
        seen.add((b.kind, b.pattern, b.handler))
        regexes += regex
        out.append(b)
    if skipped and say:
        log.error("plugin %s: %d bindings skipped: a plugin may have at most %d bindings, %d of them regex "
                  "(EXECAPP['MAX_BINDINGS_PER_PLUGIN'], ['MAX_REGEX_BINDINGS_PER_PLUGIN']); the first by id load. "
                  "Remove the others in the admin", plugin, skipped, most, most_regex)
    return out


def _pool_only(spec: Any) -> str | None:
    """Why a plugin's handlers may never run inline (None: they may, once proven fast): a memory
    cap over INLINE_MAX_MEMORY_MB, whose longest native step could hold the loop for seconds."""
    limit = int(conf.get("INLINE_MAX_MEMORY_MB"))
    mb = spec.memory_bytes / 1_048_576
    if mb <= limit:
        return None
    return (f"pool only: its memory cap ({mb:g} MiB) is over EXECAPP['INLINE_MAX_MEMORY_MB'] ({limit} MiB); one "
            "native step of a guest grows with its cap and would hold the event loop")


def track(engine: EngineLike) -> None:
    """Refresh ``engine`` whenever this process commits a registry change."""
    with _sync_lock:
        _synced.setdefault(engine, -1)


def refresh_tracked_engines() -> None:
    """Run on commit of a plugin/binding change: bring every known engine up to date now."""
    for engine in list(_synced.keys()):
        try:
            sync_engine(engine)
        except Exception:
            log.exception("refreshing an engine from the plugin registry failed")


def instance_pool_stats() -> list[dict[str, Any]]:
    """One row per loaded plugin: plugin, runtime, strategy, capacity, busy, idle, waiting,
    waits_total, timeouts_total, errors_total (and calls_total, refused_total, version...)."""
    return [loaded.stats() for loaded in manager.all()]


class RegistrySync:
    """Worker service: polls the registry version and re-syncs the worker's engine on change."""

    #: Compiling a plugin and running its top level can take its whole timeout (a minute at
    #: most), a WASM compile up to ten seconds: on a thread of its own (execapp.worker), not the
    #: one every other service of the worker ticks on.
    own_thread = True

    def __init__(self, worker: WorkerLike) -> None:
        self.engine = worker.engine
        self.interval = float(conf.get("REGISTRY_POLL_SECONDS"))
        self._last_error = ""
        track(self.engine)
        # The first sync must land before the worker's first event, or early events find no
        # matchers. The worker may be started from the event loop thread, where Django refuses
        # ORM calls, so the sync runs on a thread of its own; the start waits for it once.
        first = threading.Thread(target=self.tick, name="plugins-first-sync", daemon=True)
        first.start()
        first.join(FIRST_SYNC_WAIT_SECONDS)

    def tick(self) -> None:
        close_old_connections()
        try:
            sync_engine(self.engine)
            self._last_error = ""
        except Exception as exc:  # keep polling; log each distinct failure once
            if str(exc) != self._last_error:
                self._last_error = str(exc)
                log.warning("plugin registry sync failed (retrying every %gs): %s", self.interval, exc)

    def close(self) -> None:
        close_old_connections()


def registry_sync(worker: WorkerLike) -> RegistrySync:
    """The worker service factory plugins.apps registers as ``"plugins.sync"``."""
    return RegistrySync(worker)
