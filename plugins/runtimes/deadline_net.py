"""A TCP (and TLS) connection whose whole transfer ends by a deadline: the transport of ``http_get``.

A socket timeout bounds one read, not a transfer: a server that trickles one byte per 100 ms
never trips it. These sockets re-arm their timeout to what is left of the deadline before
every read and write (http.client reads through sock.makefile, i.e. recv_into), and fail at
once when nothing is left, so name lookup, connect, TLS handshake, headers and body together
end by the deadline (plugins.runtimes.host). No Django, no plugin state.

Where a connection may go: a plugin's allowlist names hosts, but whoever controls a name's DNS
(a plugin's author, for "api.their-plugin.example") decides which address it reaches. So every
resolved address is checked before the connect, and only public unicast addresses are used
(``reachable``): not loopback, private, link-local (cloud metadata at 169.254.169.254), shared,
reserved or multicast ones, nor an IPv6 address embedding such an IPv4 one. The socket connects
to the very address that was checked, so a DNS answer that changes between two lookups (DNS
rebinding) changes nothing. The caller passes the non-public networks an operator allowed.
"""
from __future__ import annotations

import ipaddress
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Sequence, Union

Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: the last 32 bits are an IPv4 address


class AddressRefused(OSError):
    """Every address a host name resolved to is one a plugin may not reach."""

    def __init__(self, host: str, addresses: list[str]) -> None:
        super().__init__(f"{host!r} resolves only to {', '.join(addresses[:4])}, "
                         f"{'a non-public address' if len(addresses) == 1 else 'non-public addresses'}")
        self.host, self.addresses = host, addresses


def _embedded(ip: Address) -> Iterator[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (mapped, 6to4, Teredo, NAT64)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            yield ip.ipv4_mapped
        if ip.sixtofour is not None:
            yield ip.sixtofour
        if ip.teredo is not None:
            yield from ip.teredo
        if ip in _NAT64:
            yield ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)


def _public(ip: Address) -> bool:
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_link_local or ip.is_loopback
                                 or getattr(ip, "is_site_local", False))  # fec0::/10, deprecated but routed


def reachable(ip: Address, allowed: Sequence[Network] = ()) -> bool:
    """True for a public unicast address whose embedded IPv4 addresses are public too, or for an
    address in one of the ``allowed`` networks (an operator's choice)."""
    if any(ip.version == net.version and ip in net for net in allowed):
        return True
    return _public(ip) and all(_public(v4) for v4 in _embedded(ip))


class _DeadlineIO:
    """Mixin: every send/receive first gets only what is left of ``self.deadline``."""

    __slots__ = ()
    deadline: float

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the plugin's deadline passed during the transfer")
        self.settimeout(left)  # type: ignore[attr-defined]

    def recv(self, *args: Any) -> bytes:
        self._arm()
        return super().recv(*args)  # type: ignore[misc]

    def recv_into(self, *args: Any) -> int:
        self._arm()
        return super().recv_into(*args)  # type: ignore[misc]

    def send(self, *args: Any) -> int:
        self._arm()
        return super().send(*args)  # type: ignore[misc]

    def sendall(self, *args: Any) -> None:
        self._arm()
        return super().sendall(*args)  # type: ignore[misc]


class _DeadlineSocket(_DeadlineIO, socket.socket):
    __slots__ = ("deadline",)


class _DeadlineSSLSocket(_DeadlineIO, ssl.SSLSocket):
    pass


_resolver: ThreadPoolExecutor | None = None
_resolver_lock = threading.Lock()
#: Resolver threads (shared by every plugin of the process; made as lookups need them). With at most
#: MAX_PENDING_LOOKUPS per plugin, it takes 8 plugins whose names never answer to hold them all.
RESOLVER_THREADS = 16
#: Lookups one owner (a plugin) may have queued or running at once. A lookup outlives its call's
#: deadline until the system resolver gives up (seconds): a plugin whose names never answer
#: (its own DNS) would otherwise hold every resolver thread, and every other plugin's http_get
#: would time out waiting behind it.
MAX_PENDING_LOOKUPS = 2
_pending: dict[str, int] = {}


class LookupsPending(OSError):
    """The owner already has MAX_PENDING_LOOKUPS name lookups queued or running."""


def _resolve(host: str, port: int, deadline: float, owner: str = "") -> list:
    """getaddrinfo bounded by the deadline: a literal address at once, a name on a resolver thread
    (getaddrinfo cannot be interrupted; a lookup that outlives the deadline keeps its thread
    until the system resolver gives up; one that has not started by then is cancelled). An
    owner has at most MAX_PENDING_LOOKUPS lookups at once, of RESOLVER_THREADS threads."""
    global _resolver
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no time left to look up the host")
    with _resolver_lock:
        if _resolver is None:
            _resolver = ThreadPoolExecutor(max_workers=RESOLVER_THREADS, thread_name_prefix="plugins-dns")
        if _pending.get(owner, 0) >= MAX_PENDING_LOOKUPS:
            raise LookupsPending(f"{MAX_PENDING_LOOKUPS} earlier lookups of this plugin's host names have not "
                                 "finished (their DNS does not answer); try again later")
        _pending[owner] = _pending.get(owner, 0) + 1
        future = _resolver.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    future.add_done_callback(lambda _: _lookup_done(owner))  # finished, failed or cancelled
    try:
        return future.result(timeout=left)
    except TimeoutError:
        future.cancel()  # still queued: it never runs
        raise


def _lookup_done(owner: str) -> None:
    with _resolver_lock:
        n = _pending.get(owner, 0) - 1
        if n > 0:
            _pending[owner] = n
        else:
            _pending.pop(owner, None)


def connect(host: str, port: int, deadline: float, allowed: Sequence[Network] = (), owner: str = "") -> socket.socket:
    """A TCP connection to ``host``, made and then used within ``deadline``, to one of its addresses
    that is ``reachable`` (raises AddressRefused when none is); ``owner``'s name lookups are
    limited to MAX_PENDING_LOOKUPS at once (LookupsPending)."""
    error: OSError | None = None
    refused: list[str] = []
    for family, kind, proto, _, address in _resolve(host, port, deadline, owner):
        if not reachable(ipaddress.ip_address(address[0]), allowed):
            refused.append(address[0])
            continue
        sock = _DeadlineSocket(family, kind, proto)
        sock.deadline = deadline
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no time left to connect")
            sock.settimeout(left)
            sock.connect(address)
            return sock
        except TimeoutError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            error = exc
    if error is None and refused:
        raise AddressRefused(host, refused)
    raise error or OSError(f"no address for {host!r}")


_tls_context: ssl.SSLContext | None = None


def tls(sock: socket.socket, host: str, deadline: float) -> socket.socket:
    """``sock`` wrapped in TLS (verified, with SNI), the handshake within the deadline."""
    global _tls_context
    if _tls_context is None:
        context = ssl.create_default_context()
        context.sslsocket_class = _DeadlineSSLSocket
        _tls_context = context
    tls = _tls_context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    try:
        tls.deadline = deadline  # type: ignore[attr-defined]
        tls._arm()  # type: ignore[attr-defined]
        tls.do_handshake()  # the ssl module bounds a whole handshake by the socket's timeout
    except BaseException:
        tls.close()
        raise
    return tls
