"""Failed WebSocket authentications per client network: past a burst, its handshakes are not judged.

Each handshake with a bad token (or a bad session cookie) costs a database lookup on the
worker's one sync thread, which every other sync call of the worker queues on too: a client
trying tokens as fast as it can (measured: 488 a second) made a legitimate handshake take
113 ms instead of 4 ms, and every open connection slower. Here each client network has a bucket
of ``AUTH_FAILURES_BURST`` failures that refills at ``AUTH_FAILURES_PER_MINUTE``; while it is
empty, that network's handshakes are closed at once (1013, with the seconds to wait in the
reason) without any lookup. Only failures take from the bucket: a client with a good token is
never slowed, and one that is refused unjudged does not dig itself deeper.

A network is an IPv4 address or an IPv6 /64 (one host's usual allocation: rotating addresses
inside it gains nothing), as ``scope["client"]`` gives it: behind a proxy that is the proxy's
address unless the proxy is listed in ``--forwarded-allow-ips`` (docs/operations.md). One table
per worker process, event loop only, of at most ``MAX_NETWORKS`` networks (the least recently
seen forgotten first). ``AUTH_FAILURES_BURST`` 0 turns it off.
"""
from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from typing import Any, Callable

from . import conf

#: Client networks remembered per worker process (~200 bytes each: ~13 MB at most).
MAX_NETWORKS = 65_536


class AuthThrottle:
    """Token buckets of failed authentications, one per client network (loop thread only)."""

    def __init__(self, burst: int, per_minute: float, max_networks: int = MAX_NETWORKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.rate = per_minute / 60.0
        self.max_networks = max_networks
        self._clock = clock
        #: network -> [failures it may still have, when that was computed]
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()
        #: Handshakes refused unjudged since start.
        self.refused = 0

    def _level(self, network: str) -> list[float] | None:
        """The network's bucket brought up to now (None: it has never failed, or refilled and forgotten)."""
        bucket = self._buckets.get(network)
        if bucket is None:
            return None
        now = self._clock()
        bucket[0] = min(float(self.burst), bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        if bucket[0] >= self.burst:  # full again: nothing to remember
            del self._buckets[network]
            return None
        self._buckets.move_to_end(network)
        return bucket

    def retry_after(self, network: str | None) -> float:
        """0 if a handshake from ``network`` may be judged now; else the seconds until it may."""
        if network is None or self.burst <= 0:
            return 0.0
        bucket = self._level(network)
        if bucket is None or bucket[0] >= 1.0:
            return 0.0
        self.refused += 1
        return (1.0 - bucket[0]) / self.rate if self.rate > 0 else float("inf")

    def failed(self, network: str | None) -> None:
        """A handshake from ``network`` was judged and refused: one failure out of its bucket."""
        if network is None or self.burst <= 0:
            return
        bucket = self._level(network)
        if bucket is None:
            bucket = self._buckets[network] = [float(self.burst), self._clock()]
            if len(self._buckets) > self.max_networks:
                self._buckets.popitem(last=False)
        bucket[0] -= 1.0

    def __len__(self) -> int:
        return len(self._buckets)


def client_network(scope: dict[str, Any]) -> str | None:
    """The client network of a connection's scope: its IPv4 address or IPv6 /64; None if unknown
    (a Unix socket, a test scope)."""
    client = scope.get("client")
    if not client:
        return None
    try:
        address = ipaddress.ip_address(client[0])
    except (ValueError, TypeError, IndexError):
        return None
    if address.version == 6:
        mapped = address.ipv4_mapped
        if mapped is not None:
            return str(mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


_current: tuple[tuple[Any, Any], AuthThrottle] | None = None


def current() -> AuthThrottle:
    """This process's throttle, made again when its settings change (read at each handshake)."""
    global _current
    key = (conf.get("AUTH_FAILURES_BURST"), conf.get("AUTH_FAILURES_PER_MINUTE"))
    if _current is None or _current[0] != key:
        _current = (key, AuthThrottle(int(key[0]), float(key[1])))
    return _current[1]
