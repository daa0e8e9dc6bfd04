"""Plain log lines (``LOG_FORMAT=plain``, config/settings.py) that no logged value can split.

Log arguments carry text from clients and plugins: an event id, a WebSocket path (percent-decoded:
``%0a`` is a newline), a guest's ``log()`` line. A line break in one would start a line that reads
like the server's own (``... ERROR execapp.auth ...``). ``PlainFormatter`` escapes control
characters and Unicode line separators in the message as ``repr`` writes them (``\\n``); a tab
stays. A traceback or stack the record carries keeps its line breaks, but an exception's message
in it can hold a client's text too: each of its lines is written after ``TRACE_MARK`` (and its
other control characters escaped), so no line of it starts where a record's line does.
"""
from __future__ import annotations

import logging
from typing import Any
from urllib.parse import unquote_plus

#: What breaks or hides a line: C0 controls but the tab, DEL, C1 controls, U+2028 and U+2029.
_ESCAPES = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029) if c != 0x09}


def one_line(text: str) -> str:
    """``text`` with its line breaks and other control characters escaped (``\\n``, ``\\x1b``...)."""
    # isprintable is one C pass and true for nearly every message: the table is applied only then.
    return text if text.isprintable() else text.translate(_ESCAPES)


#: What starts every line of a traceback or stack in a plain record.
TRACE_MARK = "  | "


def marked(text: str) -> str:
    """``text`` (a traceback) with each line after ``TRACE_MARK`` and escaped by ``one_line``."""
    return "\n".join(TRACE_MARK + one_line(line) for line in text.splitlines())


class PlainFormatter(logging.Formatter):
    """``logging.Formatter`` whose rendered message is one line (see the module docstring)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        # format() set record.message just before; each formatter sets it again for itself.
        record.message = one_line(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return marked(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return marked(super().formatStack(stack_info))


#: The loggers that write request URLs, query string included: uvicorn's WebSocket lines
#: (``"WebSocket /ws/events/?token=..." [accepted]``, on uvicorn.error) and its access log.
URL_LOGGERS = ("uvicorn.error", "uvicorn.access")
REDACTED = "[redacted]"


def redact_token(text: str) -> str:
    """``text`` with the value of every ``token`` parameter of a query string in it replaced by
    ``[redacted]``: the name is compared as the server reads it (percent-decoded: ``tok%65n`` is
    ``token``), so a client cannot spell it past the filter."""
    if "?" not in text or "=" not in text:
        return text
    head, _, query = text.partition("?")
    tail = ""
    end = next((i for i, c in enumerate(query) if c in ' "#'), len(query))  # a log line: the URL ends there
    query, tail = query[:end], query[end:]
    parts = query.split("&")
    for n, part in enumerate(parts):
        name, eq, _ = part.partition("=")
        if eq and unquote_plus(name) == "token":
            parts[n] = f"{name}={REDACTED}"
    return f"{head}?{'&'.join(parts)}{tail}"


class TokenRedactor(logging.Filter):
    """Takes API tokens out of logged URLs (``?token=<t>``): a log is read by more people, and kept
    longer, than a token may be. Installed on ``URL_LOGGERS`` by execapp's AppConfig.ready."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_token(a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = redact_token(record.msg)
        return True


def install_token_redactor() -> None:
    """Add one TokenRedactor to each of ``URL_LOGGERS`` (idempotent)."""
    for name in URL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, TokenRedactor) for f in logger.filters):
            logger.addFilter(TokenRedactor())
