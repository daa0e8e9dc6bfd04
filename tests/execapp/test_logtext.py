"""Plain log lines: a client's or a plugin's text in a message cannot start a line of its own
(execapp/logtext.py, the ``plain`` formatter of config/settings.py)."""
from __future__ import annotations

import logging
import sys
from logging.config import DictConfigurator
from typing import Any

from django.conf import settings


def _plain() -> logging.Formatter:
    """The project's plain formatter, built from settings.LOGGING as dictConfig builds it."""
    config: Any = settings.LOGGING
    return DictConfigurator(config).configure_formatter(dict(config["formatters"]["plain"]))


def _record(msg: str, *args: Any, exc_info: Any = None) -> logging.LogRecord:
    return logging.LogRecord("plugins.guest", logging.INFO, __file__, 1, msg, args, exc_info)


def test_line_breaks_in_logged_values_are_escaped() -> None:
    forged = "hello\n2025-01-01 00:00:00,000 ERROR execapp.auth forged\r\x1b[31m\u2028\x85end"
    line = _plain().format(_record("[%s] %s", "evil", forged))
    assert len(line.splitlines()) == 1, line
    assert line.endswith("[evil] hello\\n2025-01-01 00:00:00,000 ERROR execapp.auth forged\\r\\x1b[31m\\u2028"
                         "\\x85end"), line


def test_ordinary_text_tabs_and_the_servers_traceback_stay_readable() -> None:
    plain = _plain()
    assert plain.format(_record("a\tb é %s", "ü")).endswith(" a\tb é ü")
    try:
        raise ValueError("boom")
    except ValueError:
        line = plain.format(_record("failed: %s", "x\ny", exc_info=sys.exc_info()))
    head, *traceback = line.splitlines()
    assert head.endswith("failed: x\\ny") and traceback[0] == "  | Traceback (most recent call last):"
    assert traceback[-1] == "  | ValueError: boom" and all(t.startswith("  | ") for t in traceback)


def test_a_client_text_in_an_exception_message_cannot_start_a_line_of_its_own() -> None:
    forged = "bad id\n2025-01-01 00:00:00,000 ERROR execapp.auth forged\x1b[31m"
    plain = _plain()
    try:
        try:
            raise KeyError(forged)
        except KeyError as exc:
            raise ValueError(forged) from exc
    except ValueError:
        record = _record("failed")
        record.exc_info = sys.exc_info()
        record.stack_info = "Stack (most recent call last):\n" + forged
        line = plain.format(record)
    head, *rest = line.splitlines()
    assert head.endswith("failed") and len(rest) > 6
    assert all(t.startswith("  | ") for t in rest), rest
    assert "  | 2025-01-01 00:00:00,000 ERROR execapp.auth forged\\x1b[31m" in rest


def test_a_server_error_is_logged_with_its_traceback_without_debug() -> None:
    """A view's unhandled exception is written to the server's log as the server configures it
    (DEBUG off): Django's default handler for it writes only with DEBUG=1, and a 500 left no line."""
    import os
    import subprocess
    import sys

    code = ("import django, logging; django.setup()\n"
            "try:\n    raise KeyError('source')\n"
            "except KeyError:\n    logging.getLogger('django.request').error('Internal Server Error: %s', "
            "'/admin/x/', exc_info=True)\n")
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "DEBUG": "0", "LOG_FORMAT": "plain"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ERROR django.request Internal Server Error: /admin/x/" in done.stderr
    assert "KeyError: 'source'" in done.stderr
