"""Structured logs: one JSON object per line (``LOG_FORMAT=json``, config/settings.py).

Each line has ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, ``pid``, ``thread``,
the exception's ``exc_type`` and ``traceback`` when there is one, and every extra attribute a
call passed (``log.info("...", extra={"event_id": ...})``), so a log shipper needs no parsing rules.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

#: Attributes every LogRecord has: not copied as extras.
_STANDARD = frozenset(logging.LogRecord("x", 0, "x", 0, "x", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
            "thread": record.threadName,
        }
        if record.exc_info and record.exc_info[0] is not None:
            out["exc_type"] = record.exc_info[0].__name__
            out["traceback"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_") and key not in out:
                out[key] = value
        return json.dumps(out, ensure_ascii=False, default=repr)


def uvicorn_log_config(base: dict[str, Any]) -> dict[str, Any]:
    """uvicorn's logging config ``base`` with every formatter this module's (its access and error
    lines become JSON too); execapp.serve passes it to uvicorn under LOG_FORMAT=json."""
    import copy

    config = copy.deepcopy(base)
    config["formatters"] = {name: {"()": "execapp.logjson.JsonFormatter"} for name in config.get("formatters", {})}
    return config


def wanted() -> bool:
    """True when the environment asks for JSON logs (LOG_FORMAT=json)."""
    import os

    return os.environ.get("LOG_FORMAT", "").strip().lower() == "json"
