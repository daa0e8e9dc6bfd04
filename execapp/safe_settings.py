"""What Django's error reports (the DEBUG=1 error page, ADMINS mails) show of the settings: Django
hides settings named like API, TOKEN, KEY, SECRET, PASS; this also hides the password in any
URL with credentials, wherever it sits (REDIS_URL, the channel layer's hosts, a cache's LOCATION).
Before, with DEBUG=1, an error page showed ``REDIS_URL = 'redis://:<password>@host'`` twice."""
from __future__ import annotations

import re
from typing import Any

from django.views.debug import SafeExceptionReporterFilter

#: scheme://user:password@ : the password is what goes.
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^:/@\s]*:)[^@/\s]+@")


def without_passwords(text: str) -> str:
    """``text`` with every URL's password replaced by stars."""
    return _URL_PASSWORD.sub(r"\1********@", text)


class SafeSettingsFilter(SafeExceptionReporterFilter):
    """Django's filter, plus URL passwords (see the module docstring)."""

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        value = super().cleanse_setting(key, value)  # recurses into dicts, lists and tuples through this method
        return without_passwords(value) if isinstance(value, str) else value
