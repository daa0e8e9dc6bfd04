"""The host API every runtime exposes to guests: one ``Host`` per guest call, checked against the
plugin's permissions, its deadline and its quotas.

``log(msg)``, ``kv_get(key)``, ``kv_set(key, value)``, ``kv_incr(key, delta=1)``, ``sleep(ms)``,
``http_get(url)``. A
denied or failing call raises here; each runtime turns that into an error inside the guest
(Lua ``error``, a rejected JS promise, a WASM trap), which the guest may catch.

Two kinds of failure end the call instead, whatever the guest does: GuestTimeout (every call
first checks the remaining time; ``sleep`` and ``http_get`` get only what is left of it) and
GuestQuota (a KV or HTTP quota of plugins.spec.Quotas; the runtimes make it uncatchable, like a
timeout). Log lines past the log quota are dropped, not refused. A denied call is logged once
per call. The runtime calls ``close()`` when the guest call ends: it writes the one summary
line of what was dropped or denied. Across calls, every line a plugin's calls cause passes its
log rate in this process (plugins.runtimes.log_rate): past it lines are dropped and counted.

``kv_get``/``kv_set``/``kv_incr`` go to the KV store the process installed (plugins.runtimes.kvstore): this
module, like every runtime, knows no backend and imports no Django.
"""
from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import time
import urllib.parse
from typing import Any, Callable, Sequence

from ..errors import GuestQuota, GuestTimeout, HostDenied
from ..spec import PluginSpec
from . import deadline_net, kvstore
from .kvstore import MAX_KEY_CHARS, MAX_SAFE_INTEGER, MAX_VALUE_CHARS, KVValueError
from .log_rate import LogRate

# The logger names predate the move into runtimes/: they are what operators configure.
log = logging.getLogger("plugins.host")
guest_log = logging.getLogger("plugins.guest")

MAX_LOG_CHARS = 2000
MAX_SLEEP_MS = 60_000
#: Upper bound of one http_get even when the plugin's budget is longer.
HTTP_TIMEOUT_SECONDS = 5.0
#: Body bytes of one response (larger: a failed call the guest sees); the per-call total is a quota.
HTTP_MAX_BYTES = 64 * 1024
HTTP_MAX_REDIRECTS = 5
#: Characters of a URL, the guest's or a redirect's (web servers refuse ~8 KB request lines): a
#: longer one is refused before any work, as it would be copied into every message and log line.
MAX_URL_CHARS = 8192
HTTP_CHUNK = 16 * 1024
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


#: The non-public networks ``http_get`` may reach (deadline_net.reachable), read at each call:
#: the plugins app installs a reader of EXECAPP['PLUGIN_HTTP_ALLOWED_NETWORKS']; none without it.
_allowed_networks: Callable[[], Sequence[deadline_net.Network]] = tuple


def install_allowed_networks(reader: Callable[[], Sequence[deadline_net.Network]]) -> None:
    """Set what ``http_get`` reads for the non-public networks an operator allowed."""
    global _allowed_networks
    _allowed_networks = reader


#: The log lines and bytes a second one plugin's calls may write in this process, across calls
#: (plugins.runtimes.log_rate): the plugins app installs a reader of EXECAPP's
#: PLUGIN_LOG_LINES_PER_SECOND and PLUGIN_LOG_BYTES_PER_SECOND; no limit without it.
log_rate = LogRate(lambda: (0.0, 0.0))


def install_log_rate(reader: Callable[[], tuple[float, float]]) -> None:
    """Set what the plugins' log rate reads: ``(lines, bytes)`` a second per plugin (0: unlimited)."""
    log_rate.limits = reader


class HostCallError(Exception):
    """A permitted host call that failed (bad argument, HTTP error); raised inside the guest."""


class Host:
    """The host API bound to one call of one plugin: its permissions, deadline and per-call counts.

    Made by the runtime for one guest call (lazily, at the call's first host call) and used by
    that call's thread only, so the counters need no lock.
    """

    __slots__ = ("spec", "deadline", "loading", "quotas", "kv_writes", "kv_reads", "kv_read_bytes", "log_lines",
                 "log_bytes", "log_dropped", "http_requests", "http_bytes", "denied", "closed")

    def __init__(self, spec: PluginSpec, deadline: float, loading: bool = False) -> None:
        self.spec = spec
        self.deadline = deadline  # time.monotonic() value
        self.loading = loading  # the plugin's top level is running: no host calls then
        self.quotas = spec.quotas
        self.kv_writes = self.kv_reads = self.kv_read_bytes = self.log_lines = self.log_bytes = self.log_dropped = 0
        self.http_requests = self.http_bytes = self.denied = 0
        self.closed = False

    def _check(self, perm: str, call: str) -> None:
        if self.loading:
            raise HostCallError(f"{call}: the host API is not available while the plugin's top level runs; "
                                "call it from a handler")
        if time.monotonic() >= self.deadline:
            raise GuestTimeout(f"{call}: no time left of the plugin's {self.spec.timeout * 1000:g} ms timeout")
        if perm not in self.spec.permissions:
            raise self._deny(f"{call} denied (no {perm!r} permission)",
                             f"{call}: plugin {self.spec.name!r} has no {perm!r} permission; "
                             f"grant it in the plugin's permissions")

    def _deny(self, what: str, message: str) -> HostDenied:
        """Count a denied call; only the first of the call is logged (a guest may retry in a loop)."""
        self.denied += 1
        if self.denied == 1 and log_rate.allow(self.spec.name, len(what)):
            log.warning("plugin %r: %s; further denials in this call are counted, not logged",
                        self.spec.name, what)
        return HostDenied(message)

    def remaining(self) -> float:
        """Seconds left before this call's deadline."""
        return self.deadline - time.monotonic()

    def close(self) -> None:
        """The guest call ended: write the summary of dropped log lines and denied calls, once."""
        if self.closed:
            return
        self.closed = True
        name = self.spec.name
        if self.log_dropped and log_rate.allow(name, 100):
            q = self.quotas
            guest_log.warning("plugin %r: %d log lines dropped (limit %d lines and %d bytes per call)",
                              self.spec.name, self.log_dropped, q.log_lines, q.log_bytes)
        if self.denied > 1 and log_rate.allow(name, 60):
            log.info("plugin %r: %d host calls denied in one call", name, self.denied)
        due = log_rate.due_summary(name)
        if due is not None:  # at most one a SUMMARY_SECONDS per plugin: not itself rate-limited
            lines, bytes_ = log_rate.limits()
            guest_log.warning("plugin %r: %d log lines dropped in the last %.0f s, over its log rate in this worker "
                              "process (%g lines and %g bytes a second: EXECAPP['PLUGIN_LOG_LINES_PER_SECOND'], "
                              "EXECAPP['PLUGIN_LOG_BYTES_PER_SECOND']); log less per event", name, due[0], due[1],
                              lines, bytes_)

    def __del__(self) -> None:
        # A safety net for a runtime that never called close(): CPython frees the Host when its
        # call's last reference goes, so the summary is still written, just not by design.
        try:
            self.close()
        except Exception:  # interpreter teardown: logging may be gone
            pass

    def log(self, message: Any) -> None:
        """Write one line to the 'plugins.guest' logger, tagged with the plugin's name.

        Past the log quota of the call the line is dropped (and so is every later one); past the
        plugin's log rate in this process (``log_rate``) too.
        """
        self._check("log", "log")
        text = str(message)[:MAX_LOG_CHARS]
        size = len(text.encode("utf-8", "replace"))
        q = self.quotas
        if self.log_dropped or self.log_lines >= q.log_lines or self.log_bytes + size > q.log_bytes:
            self.log_dropped += 1
            return
        self.log_lines += 1
        self.log_bytes += size
        if log_rate.allow(self.spec.name, size):
            guest_log.info("[%s] %s", self.spec.name, text)

    def kv_get(self, key: Any) -> str | None:
        """The value stored under ``key`` in this plugin's namespace, or None.

        Each call counts against the call's KV reads quota, and the value's UTF-8 bytes against its
        KV read bytes: a read past either ends the call (``quota_kv_reads``; the value is not
        returned). Unbounded, a guest re-reading one 256 KiB value in a loop made a 20-byte event
        fetch ~60 MB from the store in a 1 s budget (one KV round trip per read, ~550 a second).
        """
        self._check("kv", "kv_get")
        q = self.quotas
        if self.kv_reads >= q.kv_reads:
            raise GuestQuota("quota_kv_reads", f"kv_get: plugin {self.spec.name!r} already made {self.kv_reads} "
                                               f"kv_get calls in this call, its KV reads per call quota is "
                                               f"{q.kv_reads}; read less per event (keep what you read), or raise "
                                               "the quota")
        key = _key(key)
        self.kv_reads += 1
        try:
            value = _kv("kv_get").get(self.spec.name, key, self.remaining())
        except TimeoutError:
            raise GuestTimeout("kv_get: the KV store did not answer before the plugin's deadline") from None
        if value is not None:
            self.kv_read_bytes += len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
            if self.kv_read_bytes > q.kv_read_bytes:
                raise GuestQuota("quota_kv_reads", f"kv_get: plugin {self.spec.name!r} read {self.kv_read_bytes} "
                                                   f"bytes of KV values in this call, over its KV read bytes per "
                                                   f"call quota of {q.kv_read_bytes}; read less per event, or "
                                                   "raise the quota")
        return value

    def _writes_left(self, call: str) -> Any:
        """The plugin's quotas, once ``call`` (a KV write) is known to be within the writes per call."""
        q = self.quotas
        if self.kv_writes >= q.kv_writes:
            raise GuestQuota("quota_kv_writes", f"{call}: plugin {self.spec.name!r} already made {self.kv_writes} "
                                                f"kv_set/kv_incr calls in this call, its KV writes per call quota is "
                                                f"{q.kv_writes}; write less per event, or raise the quota")
        return q

    def kv_set(self, key: Any, value: Any) -> None:
        """Store ``value`` (a string; numbers and booleans are converted) under ``key``."""
        self._check("kv", "kv_set")
        q = self._writes_left("kv_set")
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
        _check_text("kv_set: the value", value)
        key = _key(key)
        self.kv_writes += 1
        try:
            _kv("kv_set").set(self.spec.name, key, value, self.remaining(), q)
        except TimeoutError:
            raise GuestTimeout("kv_set: the KV store did not answer before the plugin's deadline") from None

    def kv_incr(self, key: Any, delta: Any = None) -> int:
        """Add ``delta`` (an integer; None: 1) to the integer stored under ``key`` (missing: 0) in one
        atomic step of the store, across every thread and worker process; the new value.

        One write against the call's KV writes quota, like ``kv_set``; a stored value that is not
        an integer, or a result past +-MAX_SAFE_INTEGER, is a failed call (the value unchanged).
        """
        self._check("kv", "kv_incr")
        q = self._writes_left("kv_incr")
        delta = _delta(delta)
        key = _key(key)
        store = _kv("kv_incr")
        incr = getattr(store, "incr", None)
        if incr is None:  # a store a script installed before kv_incr existed
            raise HostCallError(f"kv_incr: the installed KV store ({type(store).__name__}) has no incr(); give it one "
                                "(plugins.runtimes.kvstore.KVStore) or install plugins.kv.ConfiguredKV")
        self.kv_writes += 1
        try:
            return incr(self.spec.name, key, delta, self.remaining(), q)
        except TimeoutError:
            raise GuestTimeout("kv_incr: the KV store did not answer before the plugin's deadline") from None
        except KVValueError as exc:
            raise HostCallError(str(exc)) from None

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
        """GET ``url`` from an allowlisted host; the body as text.

        The whole transfer (name lookup, connect, TLS, headers, body, redirects) ends by the
        call's deadline (and within HTTP_TIMEOUT_SECONDS); every request and body byte counts
        against the call's HTTP quotas.
        """
        self._check("http", "http_get")
        url = str(url)
        _check_text("http_get: the URL", url)
        started = time.monotonic()
        deadline = min(self.deadline, started + HTTP_TIMEOUT_SECONDS)
        for hop in range(HTTP_MAX_REDIRECTS + 1):
            if len(url) > MAX_URL_CHARS:
                raise HostCallError(f"http_get: {'a redirect to ' if hop else ''}a URL of {len(url)} characters, "
                                    f"over the {MAX_URL_CHARS}-character limit")
            try:
                parsed = urllib.parse.urlsplit(url)
                parsed.port  # noqa: B018 - raises for a port out of range, like a bad IPv6 bracket above
            except ValueError as exc:  # a failed call like any other, whatever the runtime catches
                raise HostCallError(f"http_get: {url!r} is not a valid URL ({exc})") from None
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise HostCallError(f"http_get: {url!r} is not an http(s) URL")
            if not host_allowed(parsed.hostname, self.spec.http_allowlist):
                if hop:
                    raise self._deny(f"http_get redirect to {url} denied (host not on the allowlist)",
                                     f"http_get: redirect to {parsed.hostname!r}, which is not on the HTTP allowlist")
                raise self._deny(f"http_get {url} denied (host not on the allowlist)",
                                 f"http_get: host {parsed.hostname!r} is not on plugin {self.spec.name!r}'s "
                                 "HTTP allowlist")
            q = self.quotas
            if self.http_requests >= q.http_requests:
                raise GuestQuota("quota_http", f"http_get: plugin {self.spec.name!r} already made "
                                               f"{self.http_requests} requests in this call, its HTTP requests per "
                                               f"call quota is {q.http_requests}; fetch less per event, or raise "
                                               "the quota")
            self.http_requests += 1
            try:
                status, location, body = self._fetch(parsed, deadline)
            except deadline_net.AddressRefused as exc:
                raise self._deny(f"http_get {url} denied ({exc})",
                                 f"http_get: {exc}; plugins reach public addresses only (an operator can allow a "
                                 "network with EXECAPP['PLUGIN_HTTP_ALLOWED_NETWORKS'], or list the address itself "
                                 "on the plugin's HTTP allowlist)") from None
            except (TimeoutError, socket.timeout):
                if time.monotonic() >= self.deadline or deadline == self.deadline:
                    raise GuestTimeout(f"http_get: {url} ran past the plugin's "
                                       f"{self.spec.timeout * 1000:g} ms timeout") from None
                raise HostCallError(f"http_get: {url} timed out after {HTTP_TIMEOUT_SECONDS:g} s") from None
            except (OSError, http.client.HTTPException, ValueError) as exc:
                if time.monotonic() >= self.deadline:
                    raise GuestTimeout(f"http_get: {url} ran past the plugin's "
                                       f"{self.spec.timeout * 1000:g} ms timeout") from None
                raise HostCallError(f"http_get: {url} failed: {type(exc).__name__}: {exc}") from None
            if status in _REDIRECTS and location:
                url = urllib.parse.urljoin(url, location)
                continue
            if not 200 <= status < 300:
                raise HostCallError(f"http_get: {url} answered HTTP {status}")
            return body.decode("utf-8", "replace")
        raise HostCallError(f"http_get: more than {HTTP_MAX_REDIRECTS} redirects from {url}")

    def _networks(self, host: str) -> list[deadline_net.Network]:
        """The non-public networks this connection may reach: the operator's, plus the host itself
        when it is an address the plugin's allowlist names exactly (also the operator's choice)."""
        try:
            networks = list(_allowed_networks())
        except ValueError as exc:  # fail closed: `manage.py check` reports the setting too
            raise HostCallError(f"http_get: refused, the worker's allowed networks are invalid: {exc}") from None
        literal = _ip_literal(host)
        if literal is not None and host_allowed(host, self.spec.http_allowlist):
            networks.append(ipaddress.ip_network(literal))
        return networks

    def _fetch(self, parsed: urllib.parse.SplitResult, deadline: float) -> tuple[int, str | None, bytes]:
        """One GET: ``(status, Location header, body)``; the body only for a 2xx answer."""
        host = parsed.hostname or ""
        https = parsed.scheme == "https"
        port = parsed.port or (443 if https else 80)
        conn = http.client.HTTPConnection(host, port)
        try:
            sock = conn.sock = deadline_net.connect(host, port, deadline, self._networks(host), self.spec.name)
            if https:
                conn.sock = deadline_net.tls(sock, host, deadline)
            # The socket is connected and deadline-bound: http.client only writes and reads it.
            path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
            conn.request("GET", path, headers={"User-Agent": "execapp-plugin", "Accept-Encoding": "identity",
                                               "Connection": "close"})
            resp = conn.getresponse()
            try:
                if resp.status in _REDIRECTS or not 200 <= resp.status < 300:
                    return resp.status, resp.getheader("Location"), b""
                return resp.status, None, self._read_body(resp, parsed.geturl())
            finally:
                resp.close()
        finally:
            conn.close()

    def _read_body(self, resp: http.client.HTTPResponse, url: str) -> bytes:
        """The body in chunks, each counted against the response cap and the call's byte quota."""
        q = self.quotas
        if resp.length is not None:  # a declared length: refuse before reading any of it
            if self.http_bytes + resp.length > q.http_bytes:
                raise self._bytes_quota(url, self.http_bytes + resp.length)
            if resp.length > HTTP_MAX_BYTES:
                raise HostCallError(f"http_get: response from {url} is over the {HTTP_MAX_BYTES}-byte cap")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = resp.read(HTTP_CHUNK)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            self.http_bytes += len(chunk)
            if self.http_bytes > q.http_bytes:
                raise self._bytes_quota(url, self.http_bytes)
            if size > HTTP_MAX_BYTES:
                raise HostCallError(f"http_get: response from {url} is over the {HTTP_MAX_BYTES}-byte cap")
            chunks.append(chunk)

    def _bytes_quota(self, url: str, total: int) -> GuestQuota:
        return GuestQuota("quota_http", f"http_get: {url} would bring this call's response bytes to {total}, "
                                        f"over plugin {self.spec.name!r}'s HTTP bytes per call quota of "
                                        f"{self.quotas.http_bytes}; fetch less, or raise the quota")


def _ip_literal(host: str) -> deadline_net.Address | None:
    """``host`` as an IP address if it is one (``[::1]`` as an allowlist entry too), else None."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def allowlist_entry_problem(entry: str) -> str | None:
    """Why an ``http_allowlist`` entry can never match a URL's host (what to write instead), or
    None if it is a host name, a ``*.domain`` wildcard or an IP address (``host_allowed``'s forms)."""
    host = entry.strip().lower()
    if _ip_literal(host) is not None:
        return None
    name = host[2:] if host.startswith("*.") else host
    if any(c in name for c in "/:@?#*[] \t") or not name or ".." in name or name[0] == "." or name[-1] == ".":
        example = "; a wildcard is *.example.com" if "*" in host else " (no scheme, port, path, user or final dot)"
        return (f"http_allowlist entry {entry.strip()!r} is not a host name and matches no URL: write the host "
                f"alone, e.g. api.example.com{example}")
    return None


def host_allowed(hostname: str, allowlist: tuple[str, ...]) -> bool:
    """True if ``hostname`` is listed exactly, or is a name (not an address) matching a ``*.domain`` entry."""
    hostname = hostname.lower().rstrip(".")
    address = _ip_literal(hostname)
    for entry in allowlist:
        entry = entry.lower().strip()
        if address is not None:  # 127.0.0.1 and ::1 match only themselves, in any spelling
            if _ip_literal(entry) == address:
                return True
        elif hostname == entry or entry.startswith("*.") and (hostname.endswith(entry[1:]) or hostname == entry[2:]):
            return True
    return False


def _kv(call: str) -> kvstore.KVStore:
    """The process's injected KV store (plugins.runtimes.kvstore); a failed host call without one."""
    store = kvstore.installed()
    if store is None:
        raise HostCallError(f"{call}: no KV store is installed in this process; the plugins app installs one "
                            "at startup, a script without Django calls plugins.runtimes.kvstore.install(store)")
    return store


def _key(key: Any) -> str:
    key = str(key) if isinstance(key, (int, float)) else key
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        got = f"{len(key)} chars" if isinstance(key, str) and key else repr(key)[:100]  # not a long key's text
        raise HostCallError(f"kv key must be a non-empty string of at most {MAX_KEY_CHARS} chars, got {got}")
    _check_text("kv key", key)
    return key


def _delta(delta: Any) -> int:
    """``kv_incr``'s delta as an int: None is 1; an integral float (JS numbers, Lua's 2.0) counts."""
    if delta is None:
        return 1
    if delta.__class__ is float and delta.is_integer():
        delta = int(delta)
    if delta.__class__ is not int:  # (a bool is an int subclass: refused, as a string or a fraction)
        shown = repr(delta)[:40] if isinstance(delta, (str, float, bool)) else type(delta).__name__
        raise HostCallError(f"kv_incr: delta must be an integer number, got {shown}; pass a whole number such as "
                            "1 or -1 (or no delta: 1)")
    if abs(delta) > MAX_SAFE_INTEGER:
        raise HostCallError(f"kv_incr: delta {delta} is outside +-{MAX_SAFE_INTEGER} (JavaScript's safe integers, "
                            "the range kv_incr keeps); count in larger units")
    return delta


def _check_text(what: str, text: str) -> None:
    """Refuse what no database stores as text, on every database alike: a NUL (PostgreSQL refuses
    it) and a lone UTF-16 surrogate (a JS guest's strings can hold one; UTF-8 cannot encode it)."""
    if "\x00" in text:
        raise HostCallError(f"{what} must not contain a NUL character; encode binary data (base64)")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise HostCallError(f"{what} is not valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}) at "
                                f"character {exc.start}; send whole characters (a surrogate pair), or encode "
                                "binary data (base64)") from None
