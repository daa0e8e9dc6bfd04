"""Django app config for execapp."""
from django.apps import AppConfig


class ExecAppConfig(AppConfig):
    name = "execapp"
    verbose_name = "Adaptive execution"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .client_noise import install_client_noise_filter
        from .logtext import install_token_redactor

        install_token_redactor()  # no ?token=<t> in uvicorn's request lines
        install_client_noise_filter()  # no log line per malformed request
