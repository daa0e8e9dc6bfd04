"""Django app config for the plugin system: wires the plugins app into execapp at startup."""
from django.apps import AppConfig

from execapp import conf, extensions
from execapp.networks import Network, parse_networks

from .runtimes import host, kvstore


def http_allowed_networks() -> tuple[Network, ...]:
    """EXECAPP['PLUGIN_HTTP_ALLOWED_NETWORKS'] now (read at each http_get; none when unset)."""
    value = conf.get("PLUGIN_HTTP_ALLOWED_NETWORKS")
    return () if value is None else parse_networks(value, "EXECAPP['PLUGIN_HTTP_ALLOWED_NETWORKS']")


class PluginsConfig(AppConfig):
    name = "plugins"
    verbose_name = "Plugins"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Connect the signals, give the runtimes' host API its KV store and allowed networks, and register with
        execapp what its workers run and report (execapp never imports this app)."""
        # Imported here, not at the top: Django imports apps.py before models can be loaded.
        from . import checks, kv, signals, sync  # noqa: F401  (signals, checks: register themselves)

        kvstore.install(kv.ConfiguredKV())
        host.install_allowed_networks(http_allowed_networks)
        extensions.add_service("plugins.sync", sync.registry_sync)
        extensions.add_stats_provider("plugin_pools", sync.instance_pool_stats)
        extensions.add_hint_provider("plugins.disabled", sync.unmatched_hint)
