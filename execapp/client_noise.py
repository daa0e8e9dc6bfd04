"""uvicorn's log lines that any client causes at will: one line per message per minute, with a count.

uvicorn logs a WARNING on ``uvicorn.error`` for each request its parser refuses ("Invalid HTTP
request received.") and each upgrade it does not serve ("Unsupported upgrade request."): one
unauthenticated client sending garbage on new connections made a worker write ~6,000 log lines a
second (measured), filling the disk and burying the lines an operator needs. ``ClientNoiseFilter``
lets the first of each through, then one a minute saying how many were held back; the refused
requests are counted in ``execapp_connections_closed_total{reason="bad_request"}`` meanwhile
(execapp.handshake). Installed on ``uvicorn.error`` by execapp's AppConfig.ready.
"""
from __future__ import annotations

import logging
import threading
import time

#: uvicorn's messages (``record.msg``, exactly) that a client causes at will.
CLIENT_CAUSED = frozenset(("Invalid HTTP request received.", "Unsupported upgrade request."))
#: Seconds between two records of one of these messages.
INTERVAL_SECONDS = 60.0


class ClientNoiseFilter(logging.Filter):
    """Drops a CLIENT_CAUSED record logged less than INTERVAL_SECONDS after the last one let through."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()  # loggers are called from any thread
        self._seen: dict[str, list[float | int]] = {}  # msg -> [last let through at, held back since]

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if msg.__class__ is not str or msg not in CLIENT_CAUSED:
            return True
        now = time.monotonic()
        with self._lock:
            entry = self._seen.get(msg)
            if entry is not None and now - entry[0] < INTERVAL_SECONDS:
                entry[1] += 1
                return False
            held = int(entry[1]) if entry is not None else 0
            self._seen[msg] = [now, 0]
        if held:
            record.msg = f"{msg} (and {held} more in the last {INTERVAL_SECONDS:g} s, not logged; a client sending " \
                         "malformed requests?)"
        return True


def install_client_noise_filter() -> None:
    """Add one ClientNoiseFilter to uvicorn's error logger (idempotent)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, ClientNoiseFilter) for f in logger.filters):
        logger.addFilter(ClientNoiseFilter())
