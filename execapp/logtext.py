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
