"""System checks of the plugins app (registered when the app is ready)."""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks

from .runtimes.registry import MAX_CODE_BYTES

#: Room for the rest of the admin's plugin form (fields, bindings, multipart headers) and for the
#: CR LF line ends browsers send a textarea with.
FORM_MARGIN_BYTES = 1_048_576


@checks.register()
def check_the_admin_takes_the_largest_code(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """DATA_UPLOAD_MAX_MEMORY_SIZE holds a plugin's largest source as the admin's form sends it."""
    limit, need = settings.DATA_UPLOAD_MAX_MEMORY_SIZE, MAX_CODE_BYTES + FORM_MARGIN_BYTES
    if limit is not None and limit < need:
        return [checks.Warning(
            f"DATA_UPLOAD_MAX_MEMORY_SIZE is {limit} bytes, below a plugin's largest code ({MAX_CODE_BYTES} bytes, "
            "MAX_CODE_BYTES) and its form: the admin answers a source pasted between the two with Bad Request (400)",
            hint=f"Set DATA_UPLOAD_MAX_MEMORY_SIZE to at least {need} (config/settings.py: 5 MiB), and keep "
                 "EXECAPP['MAX_REQUEST_BODY_BYTES'] above it.", id="plugins.W001")]
    return []
