"""Django app config for the plugin system: wires the plugins app into execapp at startup."""
from django.apps import AppConfig

from execapp import conf, extensions
from execapp.networks import Network, parse_networks

from .runtimes import host, kvstore


def http_allowed_networks() -> tuple[Network, ...]:
    """EXECAPP['PLUGIN_HTTP_ALLOWED_NETWORKS'] now (read at each http_get; none when unset)."""
    value = conf.get("PLUGIN_HTTP_ALLOWED_NETWORKS")
    return () if value is None else parse_networks(value, "EXECAPP['PLUGIN_HTTP_ALLOWED_NETWORKS']")


def log_rate() -> tuple[float, float]:
    """EXECAPP's PLUGIN_LOG_LINES_PER_SECOND and PLUGIN_LOG_BYTES_PER_SECOND now (0 for a value
    that is not a number of 0 or more: `manage.py check` reports it, and logging goes on unlimited)."""
    return _rate("PLUGIN_LOG_LINES_PER_SECOND"), _rate("PLUGIN_LOG_BYTES_PER_SECOND")


def _rate(key: str) -> float:
    value = conf.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else 0.0


class PluginsConfig(AppConfig):
    name = "plugins"
    verbose_name = "Plugins"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Connect the signals, give the runtimes' host API its KV store, allowed networks and log rate, and
        register with execapp what its workers run and report (execapp never imports this app)."""
        # Imported here, not at the top: Django imports apps.py before models can be loaded.
        from . import checks, kv, signals, sync  # noqa: F401  (signals, checks: register themselves)

        kvstore.install(kv.ConfiguredKV())
        host.install_allowed_networks(http_allowed_networks)
        host.install_log_rate(log_rate)
        extensions.add_service("plugins.sync", sync.registry_sync)
        extensions.add_stats_provider("plugin_pools", sync.instance_pool_stats)
        extensions.add_hint_provider("plugins.disabled", sync.unmatched_hint)
