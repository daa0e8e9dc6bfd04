"""The plugin registry: plugins, their bindings, their key-value data and the registry version."""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.db.backends.base.operations import BaseDatabaseOperations
from django.db.models import Sum
from django.db.models.functions import Coalesce, Length

from execapp import conf
from execapp.engine.linear_regex import LinearRegex, RegexRefused

from . import spec as specs
from .errors import CompileError, PluginInvalid
from .loaded import validate
from .runtimes import registry
from .runtimes.host import allowlist_entry_problem


def integer_range(field: models.Field) -> tuple[int, int]:
    """The whole numbers an integer model field holds on every database Django supports (a
    PositiveIntegerField is 32-bit on PostgreSQL, 64-bit on SQLite: the narrower range)."""
    return BaseDatabaseOperations.integer_field_ranges[field.get_internal_type()]


def column_problem(field: models.Field, value: Any) -> str | None:
    """Why ``value`` cannot be stored in ``field``'s column on every supported database (None: it
    can): a whole number past its range, or text past a CharField's max_length. Past them was an
    OverflowError (SQLite) or a DataError (PostgreSQL) at save, or, as SQLite does not check a
    length, text stored whole: a manifest's 500 KB event pattern made a 500 KB matcher name (in
    every metric label, history trace and profile row of it)."""
    if isinstance(field, models.IntegerField) and isinstance(value, int) and not isinstance(value, bool):
        low, high = integer_range(field)
        if not low <= value <= high:
            return f"{field.name} {value} is outside {low}..{high}, what the database stores"
    elif isinstance(field, models.CharField) and field.max_length and isinstance(value, str):
        if len(value) > field.max_length:
            return f"{field.name} is {len(value)} characters, over its {field.max_length}"
    return None


NAME_VALIDATOR = RegexValidator(r"^[a-z0-9][a-z0-9_-]{0,62}$",
                                "Use 1-63 lowercase letters, digits, '_' or '-', starting with a letter or digit.")


#: The label, field class and help text of each host quota's Plugin field ``quota_<name>``. The
#: names, their order and the defaults are plugins.spec.Quotas' own: a new quota is one Quotas
#: field, one entry here (importing this module fails without it) and a migration.
QUOTA_TEXTS: dict[str, tuple[str, type[models.Field], str]] = {
    "kv_keys": ("KV keys", models.PositiveIntegerField,
                "Keys the plugin may keep in its KV namespace (a kv_set or kv_incr of a new key past it fails: "
                "quota_kv)."),
    "kv_bytes": ("KV bytes", models.PositiveBigIntegerField,
                 "UTF-8 bytes of keys plus values the plugin may keep in its KV namespace (quota_kv)."),
    "kv_writes": ("KV writes per call", models.PositiveIntegerField,
                  "kv_set and kv_incr calls one handler call may make; one more ends the call (quota_kv_writes)."),
    "kv_reads": ("KV reads per call", models.PositiveIntegerField,
                 "kv_get calls one handler call may make; one more ends the call (quota_kv_reads)."),
    "kv_read_bytes": ("KV read bytes per call", models.PositiveBigIntegerField,
                      "UTF-8 bytes of values one handler call may read with kv_get; a read past it ends the call "
                      "(quota_kv_reads)."),
    "log_lines": ("log lines per call", models.PositiveIntegerField,
                  "Log lines one handler call may write; later lines are dropped and counted in one summary line."),
    "log_bytes": ("log bytes per call", models.PositiveIntegerField,
                  "UTF-8 bytes of log lines one handler call may write; later lines are dropped."),
    "http_requests": ("HTTP requests per call", models.PositiveIntegerField,
                      "http_get requests (redirects included) one handler call may make (quota_http)."),
    "http_bytes": ("HTTP bytes per call", models.PositiveIntegerField,
                   "Response body bytes one handler call may receive over all its http_get calls (quota_http)."),
}
#: The names of plugins.spec.Quotas, in its order (the admin's too).
QUOTA_NAMES = [f.name for f in dataclasses.fields(specs.Quotas)]
#: The Plugin fields that are host quotas.
QUOTA_FIELDS = [f"quota_{name}" for name in QUOTA_NAMES]


class Plugin(models.Model):
    """A sandboxed plugin: its code, runtime, limits, permissions and instance strategy.

    Saving validates inside the sandbox (the code compiles, a WASM module instantiates, every
    enabled binding's handler exists) and is refused with PluginInvalid otherwise. ``runtime``
    names an entry of the runtime registry (plugins.runtimes.registry), checked in ``clean()``
    and at save, not by field choices: a new runtime needs no migration.
    """

    name = models.CharField(max_length=63, unique=True, validators=[NAME_VALIDATOR])
    description = models.CharField(max_length=200, blank=True, default="")
    runtime = models.CharField(max_length=registry.MAX_NAME_LENGTH,
                               help_text="A registered runtime (plugins.runtimes.registry), e.g. lua, wasm, js.")
    source = models.TextField(blank=True, default="",
                              help_text="Source text, or the text form of a binary runtime's code (e.g. WebAssembly "
                                        ".wat).")
    module = models.BinaryField(blank=True, null=True, editable=False,
                                help_text="The binary of a binary runtime, e.g. WebAssembly (uploaded, or compiled "
                                          "from the text form in source).")
    version = models.CharField(max_length=16, editable=False, default="",
                               help_text="Content hash of the code: changes with every edit.")
    enabled = models.BooleanField(default=True)
    permissions = models.JSONField(default=list, blank=True,
                                   help_text="Host API permissions: any of log, kv, sleep, http.")
    http_allowlist = models.TextField(blank=True, default="",
                                      help_text="Hosts http_get may reach, one per line (*.example.com allowed).")
    timeout_ms = models.PositiveIntegerField(default=specs.DEFAULT_TIMEOUT_MS, validators=[MinValueValidator(1)],
                                             help_text="Wall-clock budget of one call, enforced inside the sandbox.")
    memory_mb = models.PositiveIntegerField(default=specs.DEFAULT_MEMORY_MB, validators=[MinValueValidator(1)],
                                            help_text="Memory cap of one instance, in MiB.")
    max_concurrency = models.PositiveIntegerField(default=specs.DEFAULT_MAX_CONCURRENCY,
                                                  validators=[MinValueValidator(1)],
                                                  help_text="Calls of this plugin running at once, per worker.")
    strategy = models.CharField(max_length=12, choices=[("", "runtime default"), *registry.STRATEGIES.items()],
                                blank=True, default="")
    pool_size = models.PositiveIntegerField(default=specs.DEFAULT_POOL_SIZE, validators=[MinValueValidator(1)])
    shard_count = models.PositiveIntegerField(default=specs.DEFAULT_SHARD_COUNT, validators=[MinValueValidator(1)])
    # Host quotas: the fields quota_<name> of QUOTA_TEXTS, added below the class. 0 allows none.
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # What `loadplugins` last wrote (plugins.bundled.fingerprint): a plugin whose state differs
    # from it was edited since it was loaded, and loadplugins keeps it unless told --force.
    loaded_fingerprint = models.CharField(max_length=64, blank=True, default="", editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def effective_strategy(self) -> str:
        """The strategy the plugin runs under: its own, else its runtime's default."""
        return self.strategy or registry.default_strategy(self.runtime)

    def code(self) -> str | bytes:
        """What the runtime loads: source text, or the binary of a binary runtime."""
        runtime = registry.get(self.runtime)
        if runtime is not None and runtime.binary:
            return bytes(self.module) if self.module else self.source
        return self.source

    def prepare_code(self) -> None:
        """Compile a binary runtime's text form (e.g. .wat) to the stored binary, and refresh the
        version hash."""
        runtime = registry.get(self.runtime)
        if runtime is not None and runtime.binary_compiler is not None and self.source.strip():
            try:
                registry.check_code_size(self.source)  # before the text is compiled, too
                self.module = runtime.binary_compiler(self.source)
            except CompileError as exc:
                raise PluginInvalid(f"plugin {self.name!r}: the {self.runtime} runtime refused the code: {exc}",
                                    code=exc.code) from None
        code = self.code()
        self.version = specs.code_version(self.runtime, code) if code else ""

    def to_spec(self) -> specs.PluginSpec:
        """The Django-free description the runtimes load."""
        return specs.PluginSpec(
            name=self.name, runtime=self.runtime, code=self.code(), timeout=self.timeout_ms / 1000,
            memory_bytes=self.memory_mb << 20, max_concurrency=self.max_concurrency,
            strategy=self.effective_strategy, pool_size=self.pool_size, shard_count=self.shard_count,
            permissions=frozenset(self.permissions or ()), http_allowlist=tuple(self.allowlist()),
            quotas=self.quotas())

    def quotas(self) -> specs.Quotas:
        """The plugin's host quotas as the runtimes read them."""
        return specs.Quotas(**{name: getattr(self, f"quota_{name}") for name in QUOTA_NAMES})

    def allowlist(self) -> list[str]:
        return [h.strip() for h in self.http_allowlist.replace(",", "\n").splitlines() if h.strip()]

    def check_fields(self) -> None:
        """Field rules the database cannot express; raises PluginInvalid."""
        if registry.get(self.runtime) is None:
            raise PluginInvalid(f"plugin {self.name!r}: runtime {self.runtime!r} is not one of "
                                f"{', '.join(registry.names())}")
        if self.strategy and self.strategy not in registry.STRATEGIES:
            raise PluginInvalid(f"plugin {self.name!r}: strategy {self.strategy!r} is not one of "
                                f"{', '.join(registry.STRATEGIES)}")
        bad = [p for p in (self.permissions or []) if p not in specs.PERMISSIONS]
        if not isinstance(self.permissions, list) or bad:
            raise PluginInvalid(f"plugin {self.name!r}: unknown permission(s) {bad or self.permissions!r}; "
                                f"use a list of {', '.join(specs.PERMISSIONS)}")
        for field in self._meta.concrete_fields:
            if not field.primary_key:
                problem = column_problem(field, getattr(self, field.attname))
                if problem is not None:
                    raise PluginInvalid(f"plugin {self.name[:63]!r}: {problem}; make it smaller")
        if self.memory_mb > specs.MAX_MEMORY_MB:
            raise PluginInvalid(f"plugin {self.name!r}: memory_mb {self.memory_mb} is above {specs.MAX_MEMORY_MB}, "
                                "the most one instance may have; lower it")
        for field in ("pool_size", "shard_count", "max_concurrency"):
            if getattr(self, field) > specs.MAX_INSTANCES:
                raise PluginInvalid(f"plugin {self.name!r}: {field} {getattr(self, field)} is above "
                                    f"{specs.MAX_INSTANCES}, the most instances or calls at once per worker "
                                    "process; lower it (each may hold memory_mb)")
        for entry in self.allowlist():
            problem = allowlist_entry_problem(entry)
            if problem is not None:  # it would deny every http_get to the host meant, silently
                raise PluginInvalid(f"plugin {self.name!r}: {problem}")
        longest = conf.get("MAX_HANDLER_TIMEOUT_SECONDS")
        if self.timeout_ms / 1000 > longest:
            raise PluginInvalid(f"plugin {self.name!r}: timeout_ms {self.timeout_ms} is above the longest handler "
                                f"timeout, EXECAPP['MAX_HANDLER_TIMEOUT_SECONDS'] = {longest:g} s; lower it (or raise "
                                "that setting together with EXECAPP['DURATION_BUCKETS'])")
        if not self.code():
            binaries = " or ".join(r.name.upper() for r in registry.all_runtimes() if r.binary)
            raise PluginInvalid(f"plugin {self.name!r}: no code; give source (or a "
                                f"{' or '.join(registry.binary_extensions())} module for {binaries})")

    def validate_code(self, handlers: list[str] | None = None) -> None:
        """Compile and load the code in its sandbox and check the handlers (default: the enabled
        bindings already saved); raises PluginInvalid naming plugin, handler and runtime message."""
        self.prepare_code()
        self.check_fields()
        if handlers is None:
            handlers = list(self.bindings.filter(enabled=True).values_list("handler", flat=True)) if self.pk else []
        validate(self.to_spec(), handlers)

    def clean(self) -> None:
        # The code alone: the admin's binding formset checks the handlers against this code.
        try:
            self.validate_code(handlers=[])
        except PluginInvalid as exc:
            raise ValidationError(str(exc)) from None

    def save(self, *args: Any, check_bindings: bool = True, **kwargs: Any) -> None:
        """Validate in the sandbox, then save. ``check_bindings=False`` checks the code only
        (for a caller that validated the new bindings itself, like the admin's formset).
        A plugin becoming enabled must fit MAX_PLUGINS and, with its stored bindings, MAX_REGEX_BINDINGS."""
        if self.enabled and not (self.pk and Plugin.objects.filter(pk=self.pk, enabled=True).exists()):
            check_plugin_count(self.name, self.pk)
            if check_bindings and self.pk:
                check_regex_total(self.name, self.pk, self.bindings.filter(EVERY_MESSAGE).count())
                mine = collections.Counter(fan_out_key(b.kind, b.pattern)
                                           for b in self.bindings.exclude(EVERY_MESSAGE).only("kind", "pattern"))
                for (kind, pattern), count in mine.items():
                    check_fan_out(self.name, self.pk, kind, pattern, count)
        self.validate_code(handlers=None if check_bindings else [])
        if self.enabled:
            check_code_total(self.name, self.pk, self.code_size())
        super().save(*args, **kwargs)

    def code_size(self) -> int:
        """What the plugin's code counts against MAX_TOTAL_CODE_BYTES: characters of its source
        (a binary runtime's text form included: every worker reads it too) plus bytes of its module."""
        return len(self.source) + len(self.module or b"")


def _add_quota_fields() -> None:
    """Give Plugin one field per host quota (QUOTA_TEXTS), defaulting to plugins.spec.DEFAULT_QUOTAS."""
    for name in QUOTA_NAMES:
        label, field_class, help_text = QUOTA_TEXTS[name]
        field = field_class(label, default=getattr(specs.DEFAULT_QUOTAS, name), help_text=help_text)
        Plugin.add_to_class(f"quota_{name}", field)


_add_quota_fields()


def binding_limits() -> tuple[int, int]:
    """(bindings one plugin may have, regex bindings among them): EXECAPP's MAX_BINDINGS_PER_PLUGIN
    and MAX_REGEX_BINDINGS_PER_PLUGIN (docs/operations.md)."""
    return int(conf.get("MAX_BINDINGS_PER_PLUGIN")), int(conf.get("MAX_REGEX_BINDINGS_PER_PLUGIN"))


def duplicate_binding(plugin: str, kind: str, pattern: str, handler: str) -> str:
    """The refusal of a binding the plugin already has (the same kind, pattern and handler)."""
    return (f"plugin {plugin!r} binds {kind} {pattern[:200]!r} to {handler!r} twice: each copy would run the handler "
            "again for the same event (one plugin with 100 copies sent every client 100 replies a message); keep one")


def check_binding_counts(plugin: str, total: int, regexes: int) -> None:
    """Refuse a plugin with more bindings (or regex bindings) than a worker loads; PluginInvalid."""
    most, most_regex = binding_limits()
    if total > most:
        raise PluginInvalid(f"plugin {plugin!r} would have {total} bindings; a plugin may have at most {most} "
                            "(EXECAPP['MAX_BINDINGS_PER_PLUGIN']): remove some, or route several commands to one "
                            "handler that reads the event")
    if regexes > most_regex:
        raise PluginInvalid(f"plugin {plugin!r} would have {regexes} regex bindings; a plugin may have at most "
                            f"{most_regex} (EXECAPP['MAX_REGEX_BINDINGS_PER_PLUGIN']), event bindings of type "
                            "message counted with them: every message is searched with each regex on the event loop, "
                            "and runs each message binding's handler; join patterns with '|' or use command bindings")


#: The bindings every message meets (a search, or a handler run, per message): regex ones and
#: event bindings of type "message", counted together by the *REGEX_BINDINGS* limits. Event
#: bindings of type message were not counted: one plugin with 100 of them made every message of
#: every client run 100 handlers and send 100 replies.
EVERY_MESSAGE = models.Q(kind="regex") | models.Q(kind="event", pattern="message")


def sees_every_message(kind: str | None, pattern: str | None) -> bool:
    """Whether a binding of ``kind`` and ``pattern`` meets every message (EVERY_MESSAGE)."""
    return kind == "regex" or (kind == "event" and pattern == "message")


def fan_out_key(kind: str, pattern: str) -> tuple[str, str]:
    """What one event matches a command or event binding by: its kind and its command name (the
    engine strips a command's leading '/') or event type."""
    return kind, pattern.lstrip("/") if kind == "command" else pattern


def fan_out_limit() -> int:
    """Bindings of all enabled plugins one command or event type may have: MAX_BINDINGS_PER_PATTERN."""
    return int(conf.get("MAX_BINDINGS_PER_PATTERN"))


def check_fan_out(plugin: str, pk: int | None, kind: str, pattern: str, mine: int) -> None:
    """Refuse a command or event type bound more than MAX_BINDINGS_PER_PATTERN times by the enabled
    plugins, counting ``mine`` bindings of plugin ``pk`` (PluginInvalid): each runs its handler for
    every such event, so one plugin binding /x to 100 handlers made each /x 100 runs and replies."""
    word = fan_out_key(kind, pattern)[1]
    same = models.Q(pattern=word) | models.Q(pattern__regex=r"^/+" + re.escape(word) + "$") if kind == "command" \
        else models.Q(pattern=word)
    others = Binding.objects.filter(same, plugin__enabled=True, kind=kind).exclude(plugin_id=pk).count()
    most = fan_out_limit()
    if others + mine > most:
        raise PluginInvalid(f"plugin {plugin!r} would bring the bindings of {kind} {word[:200]!r} to {others + mine}; "
                            f"at most {most} of all enabled plugins may share one "
                            "(EXECAPP['MAX_BINDINGS_PER_PATTERN']): each runs its handler for every such event; route "
                            "them to one handler")


def registry_limits() -> tuple[int, int]:
    """(enabled plugins a worker loads, regex bindings of all enabled plugins together): EXECAPP's
    MAX_PLUGINS and MAX_REGEX_BINDINGS (docs/operations.md)."""
    return int(conf.get("MAX_PLUGINS")), int(conf.get("MAX_REGEX_BINDINGS"))


def check_plugin_count(plugin: str, pk: int | None) -> None:
    """Refuse one more enabled plugin than a worker loads (PluginInvalid): every enabled plugin is
    compiled and holds its instances in every worker, and adds its bindings to every message's routes."""
    most = registry_limits()[0]
    others = Plugin.objects.filter(enabled=True).exclude(pk=pk).count()
    if others >= most:
        raise PluginInvalid(f"plugin {plugin!r} would be enabled plugin number {others + 1}; at most {most} may be "
                            "enabled (EXECAPP['MAX_PLUGINS']): disable or delete one you no longer need, or join "
                            "plugins into one")


def code_total_limit() -> int:
    """Bytes of code all enabled plugins may have together: EXECAPP['MAX_TOTAL_CODE_BYTES']."""
    return int(conf.get("MAX_TOTAL_CODE_BYTES"))


def code_bytes(plugins: Any) -> int:
    """The code of the plugins of a queryset as Plugin.code_size counts it, summed by the database."""
    sums = plugins.aggregate(text=Coalesce(Sum(Length("source")), 0), binary=Coalesce(Sum(Length("module")), 0))
    return int(sums["text"]) + int(sums["binary"])


def check_code_total(plugin: str, pk: int | None, size: int) -> None:
    """Refuse code that brings the enabled plugins' code past MAX_TOTAL_CODE_BYTES (PluginInvalid):
    every worker holds every enabled plugin's code and what it compiles to, and reads all of it
    at each registry change."""
    most = code_total_limit()
    total = code_bytes(Plugin.objects.filter(enabled=True).exclude(pk=pk)) + size
    if total > most:
        raise PluginInvalid(f"plugin {plugin!r} would bring the enabled plugins' code to {total} bytes; at most {most} "
                            "may be enabled together (EXECAPP['MAX_TOTAL_CODE_BYTES']): every worker holds it all and "
                            "what it compiles to; make the code smaller, or disable plugins you no longer need")


def check_regex_total(plugin: str, pk: int | None, regexes: int) -> None:
    """Refuse regex bindings past MAX_REGEX_BINDINGS across the enabled plugins, counting ``regexes``
    for plugin ``pk`` (PluginInvalid): each is a search of every message on the event loop."""
    most = registry_limits()[1]
    others = Binding.objects.filter(EVERY_MESSAGE, plugin__enabled=True).exclude(plugin_id=pk).count()
    if others + regexes > most:
        raise PluginInvalid(f"plugin {plugin!r} would bring the enabled plugins' regex bindings to {others + regexes}; "
                            f"at most {most} may exist together (EXECAPP['MAX_REGEX_BINDINGS']), event bindings of "
                            "type message counted with them: every message is searched with each regex on the event "
                            "loop, and runs each message binding's handler; use command bindings, or join patterns "
                            "with '|'")


class Binding(models.Model):
    """One matcher of a plugin: a command, regex or event type routed to a handler function."""

    KINDS = [("command", "command"), ("regex", "regex"), ("event", "event type")]

    plugin = models.ForeignKey(Plugin, on_delete=models.CASCADE, related_name="bindings")
    kind = models.CharField(max_length=8, choices=KINDS, default="command")
    pattern = models.CharField(max_length=200, help_text="Command name (without /), regex, or event type.")
    handler = models.CharField(max_length=100, validators=[RegexValidator(r"^[A-Za-z_][A-Za-z0-9_]*$")],
                               help_text="Function name in the plugin's code.")
    priority = models.IntegerField(default=0, help_text="Higher runs first.")
    block = models.BooleanField(default=False, help_text="Stop lower-priority handlers for a matched event.")
    enabled = models.BooleanField(default=True)

    class Meta:
        ordering = ["plugin__name", "-priority", "id"]

    def __str__(self) -> str:
        return f"{self.plugin.name}: {self.kind} {self.pattern!r} -> {self.handler}"

    def check_pattern(self) -> None:
        """The pattern must make a valid matcher; raises PluginInvalid."""
        if self.kind == "regex":
            try:
                LinearRegex(self.pattern)
            except RegexRefused as exc:
                raise PluginInvalid(f"plugin {self.plugin.name!r} handler {self.handler!r}: {exc}") from None
        elif self.kind == "command":
            word = self.pattern.lstrip("/")
            if not word or " " in word:
                raise PluginInvalid(f"plugin {self.plugin.name!r} handler {self.handler!r}: command "
                                    f"{self.pattern!r} must be one word, like 'ping'")

    def clean(self) -> None:
        try:
            self.check_pattern()
        except PluginInvalid as exc:
            raise ValidationError({"pattern": str(exc)}) from None
        except Plugin.DoesNotExist:
            return

    def validate_handler(self) -> None:
        """The plugin's code defines this binding's handler; raises PluginInvalid."""
        self.check_pattern()
        plugin = self.plugin
        plugin.prepare_code()
        validate(plugin.to_spec(), [self.handler])

    def check_count(self) -> None:
        """The plugin's bindings with this one stay within binding_limits(); raises PluginInvalid."""
        others = self.plugin.bindings.exclude(pk=self.pk) if self.pk else self.plugin.bindings.all()
        every = sees_every_message(self.kind, self.pattern)
        regexes = others.filter(EVERY_MESSAGE).count() + every
        check_binding_counts(self.plugin.name, others.count() + 1, regexes)
        if every and self.plugin.enabled:
            check_regex_total(self.plugin.name, self.plugin.pk, regexes)
        if others.filter(kind=self.kind, pattern=self.pattern, handler=self.handler).exists():
            raise PluginInvalid(duplicate_binding(self.plugin.name, self.kind, self.pattern, self.handler))
        if not every and self.plugin.enabled:
            key = fan_out_key(self.kind, self.pattern)
            mine = 1 + sum(fan_out_key(b.kind, b.pattern) == key for b in others.only("kind", "pattern"))
            check_fan_out(self.plugin.name, self.plugin.pk, self.kind, self.pattern, mine)

    def save(self, *args: Any, **kwargs: Any) -> None:
        for name in ("kind", "pattern", "handler", "priority"):
            problem = column_problem(Binding._meta.get_field(name), getattr(self, name))
            if problem is not None:
                raise PluginInvalid(f"plugin {self.plugin.name!r} handler {self.handler[:100]!r}: {problem}; make it "
                                    "smaller")
        self.check_count()
        if self.enabled:
            self.validate_handler()
        super().save(*args, **kwargs)


class KVEntry(models.Model):
    """One key of a plugin's host key-value namespace (when Redis is not configured)."""

    plugin = models.CharField(max_length=63, db_index=True)
    key = models.CharField(max_length=200)
    value = models.TextField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "plugin key-value entry"
        verbose_name_plural = "plugin key-value entries"
        constraints = [models.UniqueConstraint(fields=["plugin", "key"], name="plugins_kv_unique_key")]

    def __str__(self) -> str:
        return f"{self.plugin}:{self.key}"


class KVUsage(models.Model):
    """What one plugin has stored in the database KV: its key count and UTF-8 bytes (keys plus
    values). Kept by plugins.kv.DatabaseKV in the same transaction as every write, so the
    quota check needs no scan; its row is also the lock that serializes a plugin's writes."""

    plugin = models.CharField(max_length=63, unique=True)
    keys = models.PositiveBigIntegerField(default=0)
    bytes = models.PositiveBigIntegerField(default=0)

    class Meta:
        verbose_name = "plugin key-value usage"
        verbose_name_plural = "plugin key-value usage"

    def __str__(self) -> str:
        return f"{self.plugin}: {self.keys} keys, {self.bytes} bytes"


class RegistryState(models.Model):
    """A single row whose ``version`` is bumped on every plugin/binding change (workers poll it)."""

    version = models.BigIntegerField(default=0)

    @classmethod
    def current(cls) -> int:
        row = cls.objects.filter(pk=1).values_list("version", flat=True).first()
        return row or 0

    @classmethod
    def bump(cls) -> None:
        if not cls.objects.filter(pk=1).update(version=models.F("version") + 1):
            cls.objects.get_or_create(pk=1, defaults={"version": 1})
