"""One deadline for all the Redis calls of a request (the dashboard's data, the Events page).

Each Redis call has its socket timeout (2-5 s) and redis-py retries a timed-out call: on a Redis
that accepts connections but does not answer (paused, ``SIGSTOP``, a full server's slow log) a
dashboard poll waited for its calls one after another (its own worker's re-publish, the
snapshots, the history's usage: 9-10 s), and the Events page as long. Within
:func:`redis_deadline` (one per request) the clients made by :func:`deadline_client` give each
call only what is left of the request's deadline, as its socket's timeout, and past it fail at
once, without retrying, with :class:`RedisDeadline` (``redis_unavailable``): the first call that
hangs takes the deadline, the others fail without waiting, and the request answers a degraded
page. No state outlives the request (no circuit): the next request tries Redis again, so it is
back the moment Redis answers. A worker's background job on Redis (the dashboard snapshot's
publish) bounds itself the same way, with its own setting. Outside a deadline the clients behave
as plain redis-py ones.
"""
from __future__ import annotations

import contextvars
import time
from contextlib import contextmanager
from typing import Any, Iterator

import redis
from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection

from . import conf
from .engine.errors import ExecAppError

#: (monotonic deadline, seconds it was given, the setting that gave them) of the request (or the
#: background job) running in this context, if any.
_deadline: contextvars.ContextVar[tuple[float, float, str] | None] = contextvars.ContextVar(
    "execapp_redis_deadline", default=None)
#: A read that timed out this close to the deadline timed out because of it.
_SLACK = 0.05


#: The setting a request's deadline comes from (the default of :func:`redis_deadline`).
REQUEST_SETTING = "REDIS_REQUEST_DEADLINE_SECONDS"


class RedisDeadline(ExecAppError, ConnectionError):
    """Redis did not answer within the request's deadline (REDIS_REQUEST_DEADLINE_SECONDS). A
    ConnectionError (what callers handling an unreachable Redis catch) that redis-py does not retry."""

    code = "redis_unavailable"

    def __init__(self, seconds: float, where: str, cause: BaseException | None = None,
                 setting: str = REQUEST_SETTING) -> None:
        reason = f" ({type(cause).__name__}: {str(cause).strip()[:200]})" if cause is not None else ""
        super().__init__(
            f"{self.code}: Redis at {where} did not answer within {seconds:.3g} s "
            f"(EXECAPP['{setting}']){reason}; check that Redis answers (paused, stopped, "
            "overloaded), or raise the setting")


@contextmanager
def redis_deadline(seconds: float | None = None, setting: str = REQUEST_SETTING) -> Iterator[None]:
    """Every Redis call of the block (through :func:`deadline_client`'s clients) ends within
    ``seconds`` (default: EXECAPP[setting], REDIS_REQUEST_DEADLINE_SECONDS) of the block's start, all
    together. ``setting`` is what its RedisDeadline names as the one to raise."""
    if seconds is None:
        seconds = float(conf.get(setting))
    token = _deadline.set((time.monotonic() + seconds, seconds, setting))
    try:
        yield
    finally:
        _deadline.reset(token)


def remaining() -> float | None:
    """Seconds left of this context's deadline (0 when passed), or None outside one."""
    current = _deadline.get()
    return None if current is None else max(0.0, current[0] - time.monotonic())


class _DeadlineMixin:
    """A redis-py connection whose every send, read and connect is bounded by the deadline."""

    _lowered = False
    socket_connect_timeout: float | None  # (redis-py's connection's)

    def _left(self) -> float | None:
        current = _deadline.get()
        if current is None:
            if self._lowered:  # a request lowered the kept socket's timeout: back to the client's own
                self._set_timeout(self.socket_timeout)  # type: ignore[attr-defined]
                self._lowered = False
            return None
        left = current[0] - time.monotonic()
        if left <= 0:
            self.disconnect()  # type: ignore[attr-defined]  # a reply may be pending: never reused
            raise RedisDeadline(current[1], self._where(), setting=current[2])
        return left

    def _where(self) -> str:
        host = getattr(self, "path", None) or f"{getattr(self, 'host', '?')}:{getattr(self, 'port', '?')}"
        return str(host)

    def _set_timeout(self, timeout: float | None) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.settimeout(timeout)

    def _bound(self, left: float | None) -> None:
        if left is not None:
            own = self.socket_timeout  # type: ignore[attr-defined]
            self._set_timeout(left if own is None else min(own, left))
            self._lowered = True

    def _passed(self, exc: BaseException) -> None:
        """Raise RedisDeadline for ``exc`` when it came from the deadline."""
        current = _deadline.get()
        if current is not None and current[0] - time.monotonic() <= _SLACK:
            self.disconnect()  # type: ignore[attr-defined]
            raise RedisDeadline(current[1], self._where(), exc, current[2]) from exc

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        left = self._left()
        if left is None or getattr(self, "_sock", None) is not None:
            super().connect_check_health(check_health, retry_socket_connect)  # type: ignore[misc]
            return
        own = self.socket_connect_timeout  # (per connection: one thread at a time uses it)
        self.socket_connect_timeout = left if own is None else min(own, left)
        try:
            super().connect_check_health(check_health, False)  # type: ignore[misc]
        except RedisDeadline:  # (its handshake's read: an OSError too)
            raise
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._passed(exc)
            raise
        finally:
            self.socket_connect_timeout = own
        self._bound(self._left())

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self._bound(self._left())  # (not connected yet: its connect, bounded too, sets the timeout)
        try:
            super().send_packed_command(command, check_health)  # type: ignore[misc]
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._passed(exc)
            raise

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        self._bound(self._left())
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._passed(exc)
            raise


class DeadlineConnection(_DeadlineMixin, Connection):
    """TCP (redis://)."""


class DeadlineSSLConnection(_DeadlineMixin, SSLConnection):
    """TLS (rediss://)."""


class DeadlineUnixConnection(_DeadlineMixin, UnixDomainSocketConnection):
    """A Unix socket (unix://)."""


def deadline_client(url: str, **kwargs: Any) -> redis.Redis:
    """``redis.Redis.from_url(url, **kwargs)`` whose calls keep the deadline of :func:`redis_deadline`."""
    scheme = url.split(":", 1)[0].lower()
    kind = {"rediss": DeadlineSSLConnection, "unix": DeadlineUnixConnection}.get(scheme, DeadlineConnection)
    return redis.Redis.from_url(url, connection_class=kind, **kwargs)
