"""Settings for end-to-end test servers only: the project's settings plus the Python test handlers
of tests/execapp/ws_handlers.py, registered when the server's worker starts (no plugin needed)."""
from config.settings import *  # noqa: F401,F403
from execapp import extensions as _extensions
from execapp import worker as _worker

# The plugin registry sync owns the engine's whole matcher set (it replaces it on every sync):
# these servers serve the test commands instead. (Removed before the plugins app registers it:
# a removal holds for later registrations too.)
_extensions.remove_service("plugins.sync")
if "tests.execapp.ws_handlers.install" not in _worker.SERVICE_FACTORIES:
    _worker.SERVICE_FACTORIES.append("tests.execapp.ws_handlers.install")

# Per-server EXECAPP overrides from the test that starts the server (JSON), e.g. a small pool.
import json as _json  # noqa: E402
import os as _os  # noqa: E402

EXECAPP = {**EXECAPP, **_json.loads(_os.environ.get("EXECAPP_TEST_SETTINGS", "{}"))}  # noqa: F405
