"""Model signals of the plugins app, connected when ``PluginsConfig.ready`` imports this module:
registry changes bump the registry version and refresh this process's engines; KV entries
edited outside ``kv_set`` keep their plugin's usage totals exact."""
from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F
from django.db.models.functions import Greatest
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from .kv import entry_bytes, reset_usage
from .models import Binding, KVEntry, KVUsage, Plugin, RegistryState
from .sync import refresh_tracked_engines


@receiver([post_save, post_delete], sender=Plugin, dispatch_uid="plugins.registry.plugin")
@receiver([post_save, post_delete], sender=Binding, dispatch_uid="plugins.registry.binding")
def registry_changed(sender: Any, instance: Any, raw: bool = False, **kwargs: Any) -> None:
    """Every worker polls the version (REGISTRY_POLL_SECONDS); this process also refreshes its
    engines as soon as the change commits, so the next event already sees it."""
    if raw:
        return
    RegistryState.bump()
    transaction.on_commit(refresh_tracked_engines)


# kv_set writes without signals (plugins.kv.DatabaseKV); these keep KVUsage exact when entries
# are edited or deleted another way (the admin, a shell).

@receiver(post_save, sender=KVEntry, dispatch_uid="plugins.kv.entry_saved")
def _kv_entry_saved(sender: type, instance: KVEntry, **kwargs: object) -> None:
    reset_usage(instance.plugin)


@receiver(post_delete, sender=KVEntry, dispatch_uid="plugins.kv.entry_deleted")
def _kv_entry_deleted(sender: type, instance: KVEntry, **kwargs: object) -> None:
    size = entry_bytes(instance.key, instance.value)
    KVUsage.objects.filter(plugin=instance.plugin).update(keys=Greatest(F("keys") - 1, 0),
                                                          bytes=Greatest(F("bytes") - size, 0))
