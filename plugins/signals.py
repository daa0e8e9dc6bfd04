"""Registry change signals: bump the registry version and refresh this process's engines."""
from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from .models import Binding, Plugin, RegistryState


@receiver([post_save, post_delete], sender=Plugin, dispatch_uid="plugins.registry.plugin")
@receiver([post_save, post_delete], sender=Binding, dispatch_uid="plugins.registry.binding")
def registry_changed(sender: Any, instance: Any, raw: bool = False, **kwargs: Any) -> None:
    """Every worker polls the version (REGISTRY_POLL_SECONDS); this process also refreshes its
    engines as soon as the change commits, so the next event already sees it."""
    if raw:
        return
    RegistryState.bump()
    from .sync import refresh_tracked_engines
    transaction.on_commit(refresh_tracked_engines)
