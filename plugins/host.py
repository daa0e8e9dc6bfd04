"""The host API every runtime exposes to guests, each call checked against the plugin's permissions.

``log(msg)``, ``kv_get(key)``, ``kv_set(key, value)``, ``sleep(ms)``, ``http_get(url)``. A
denied or failing call raises here; each runtime turns that into an error inside the guest
(Lua ``error``, a rejected JS promise, a WASM trap). ``sleep`` and ``http_get`` respect the
call's deadline: a sleep that would end past it fails at once with a timeout.
"""
from __future__ import annotations

import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .errors import GuestTimeout, HostDenied
from .kv import MAX_KEY_CHARS, MAX_VALUE_CHARS, kv_store
from .spec import PluginSpec

log = logging.getLogger("plugins.host")
guest_log = logging.getLogger("plugins.guest")

MAX_LOG_CHARS = 2000
MAX_SLEEP_MS = 60_000
HTTP_TIMEOUT_SECONDS = 5.0
HTTP_MAX_BYTES = 64 * 1024


class HostCallError(Exception):
    """A permitted host call that failed (bad argument, HTTP error); raised inside the guest."""


class Host:
    """The host API bound to one call of one plugin (its permissions and its deadline)."""

    __slots__ = ("spec", "deadline", "loading")

    def __init__(self, spec: PluginSpec, deadline: float, loading: bool = False) -> None:
        self.spec = spec
        self.deadline = deadline  # time.monotonic() value
        self.loading = loading  # the plugin's top level is running: no host calls then

    def _check(self, perm: str, call: str) -> None:
        if self.loading:
            raise HostCallError(f"{call}: the host API is not available while the plugin's top level runs; "
                                "call it from a handler")
        if perm not in self.spec.permissions:
            log.warning("plugin %r: %s denied (no %r permission)", self.spec.name, call, perm)
            raise HostDenied(f"{call}: plugin {self.spec.name!r} has no {perm!r} permission; "
                             f"grant it in the plugin's permissions")

    def remaining(self) -> float:
        """Seconds left before this call's deadline."""
        return self.deadline - time.monotonic()

    def log(self, message: Any) -> None:
        """Write one line to the 'plugins.guest' logger, tagged with the plugin's name."""
        self._check("log", "log")
        guest_log.info("[%s] %s", self.spec.name, str(message)[:MAX_LOG_CHARS])

    def kv_get(self, key: Any) -> str | None:
        """The value stored under ``key`` in this plugin's namespace, or None."""
        self._check("kv", "kv_get")
        return kv_store().get(self.spec.name, _key(key), self.remaining())

    def kv_set(self, key: Any, value: Any) -> None:
        """Store ``value`` (a string; numbers and booleans are converted) under ``key``."""
        self._check("kv", "kv_set")
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, float) and value.is_integer():
            value = str(int(value))
        elif isinstance(value, (int, float)):
            value = str(value)
        if not isinstance(value, str):
            raise HostCallError(f"kv_set: value must be a string or a number, not {type(value).__name__}")
        if len(value) > MAX_VALUE_CHARS:
            raise HostCallError(f"kv_set: value of {len(value)} chars is over the {MAX_VALUE_CHARS} limit")
        kv_store().set(self.spec.name, _key(key), value, self.remaining())

    def sleep(self, ms: Any) -> None:
        """Wait ``ms`` milliseconds (the stand-in for an external call), within the deadline."""
        self._check("sleep", "sleep")
        try:
            ms = float(ms)
        except (TypeError, ValueError):
            raise HostCallError(f"sleep: {ms!r} is not a number of milliseconds") from None
        if not 0 <= ms <= MAX_SLEEP_MS:
            raise HostCallError(f"sleep: {ms:g} ms is outside 0..{MAX_SLEEP_MS}")
        if ms / 1000 > self.remaining():
            raise GuestTimeout(f"sleep({ms:g}) would run past the plugin's {self.spec.timeout * 1000:g} ms timeout")
        time.sleep(ms / 1000)

    def http_get(self, url: Any) -> str:
        """GET ``url`` from an allowlisted host; the body as text (capped, with its own timeout)."""
        self._check("http", "http_get")
        url = str(url)
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise HostCallError(f"http_get: {url!r} is not an http(s) URL")
        if not host_allowed(parsed.hostname, self.spec.http_allowlist):
            log.warning("plugin %r: http_get %s denied (host not on the allowlist)", self.spec.name, url)
            raise HostDenied(f"http_get: host {parsed.hostname!r} is not on plugin {self.spec.name!r}'s "
                             "HTTP allowlist")
        timeout = min(HTTP_TIMEOUT_SECONDS, self.remaining())
        if timeout <= 0:
            raise GuestTimeout("http_get: no time left before the plugin's timeout")
        opener = urllib.request.build_opener(_AllowlistRedirects(self.spec.http_allowlist))
        try:
            with opener.open(url, timeout=timeout) as resp:
                body = resp.read(HTTP_MAX_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise HostCallError(f"http_get: {url} answered HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            if self.remaining() <= 0:
                raise GuestTimeout(f"http_get: {url} ran past the plugin's timeout") from None
            raise HostCallError(f"http_get: {url} failed: {getattr(exc, 'reason', exc)}") from None
        if len(body) > HTTP_MAX_BYTES:
            raise HostCallError(f"http_get: response from {url} is over the {HTTP_MAX_BYTES}-byte cap")
        return body.decode("utf-8", "replace")


def host_allowed(hostname: str, allowlist: tuple[str, ...]) -> bool:
    """True if ``hostname`` is listed exactly, or matches a ``*.domain`` entry."""
    hostname = hostname.lower().rstrip(".")
    for entry in allowlist:
        entry = entry.lower().strip()
        if entry.startswith("*.") and (hostname.endswith(entry[1:]) or hostname == entry[2:]):
            return True
        if hostname == entry:
            return True
    return False


class _AllowlistRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to another allowlisted host."""

    def __init__(self, allowlist: tuple[str, ...]) -> None:
        self.allowlist = allowlist

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        host = urllib.parse.urlsplit(newurl).hostname or ""
        if not host_allowed(host, self.allowlist):
            raise HostDenied(f"http_get: redirect to {host!r}, which is not on the HTTP allowlist")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _key(key: Any) -> str:
    key = str(key) if isinstance(key, (int, float)) else key
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        raise HostCallError(f"kv key must be a non-empty string of at most {MAX_KEY_CHARS} chars, got {key!r}")
    return key
