"""Failed sign-ins per client network and per username: past a burst, an attempt is refused unhashed.

``MAX_PASSWORD_CHECKS`` (execapp/login_limit.py) bounds the CPU a flood of sign-in attempts costs a
worker, but alone it was the lockout: one client posting wrong passwords on a few connections
held every check slot, and staff signing in from elsewhere were refused "try again in a moment"
for as long as the flood lasted. Here the failures are counted where they come from:

- per client network (an IPv4 address, an IPv6 /64, as ``execapp.auth_throttle`` reads them): a
  bucket of ``LOGIN_FAILURES_BURST`` failures refilled at ``LOGIN_FAILURES_PER_MINUTE``; while it
  is empty that network's attempts are refused before hashing, and nobody else's are;
- per username (case-folded): the same bucket, so guessing one account's password from many
  networks is slowed too; a network that signed that username in before (in this process) is not
  held by it, so the account's owner is not locked out by a flood against their name;
- per device (``execapp/login_device.py``): an attempt with a valid device cookie for its
  username is judged by that device's bucket alone, wherever it comes from.

The address is ``REMOTE_ADDR``, which Django takes from the ASGI scope: behind a proxy it is the
proxy's own unless the proxy is listed in ``--forwarded-allow-ips`` (then uvicorn puts the
forwarded client there). ``X-Forwarded-For`` is never read here, so a client cannot choose its key.
A request without an address (a Unix socket, no request at all) is judged by its username only.
Tables are per worker process and bounded (the least recently seen forgotten first); Django runs
each request's view in a thread of its own, so every method takes one lock (each is O(1)).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from . import conf
from .auth_throttle import AuthThrottle, client_network

#: Keys (networks, usernames, known pairs) remembered per table and worker process (~200 bytes each).
MAX_KEYS = 65_536
#: Longest username kept as a key: Django's own field is 150 characters.
MAX_USERNAME_CHARS = 150

#: What an attempt was refused for (the ``reason`` label of execapp_password_checks_refused_total).
NETWORK, USERNAME, DEVICE = "network", "username", "device"


def request_network(request: Any) -> str | None:
    """The client network of a Django request (its ``REMOTE_ADDR``), None when it has none."""
    meta = getattr(request, "META", None) or {}
    address = meta.get("REMOTE_ADDR")
    return client_network({"client": (address, 0)}) if address else None


def username_key(username: Any) -> str | None:
    """The key a username is counted under: case-folded and cut to Django's length; None if empty."""
    if not isinstance(username, str) or not username.strip():
        return None
    return username.strip().casefold()[:MAX_USERNAME_CHARS]


class LoginThrottle:
    """Token buckets of failed sign-ins per client network and per username (any thread)."""

    def __init__(self, burst: int, per_minute: float, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self.burst = burst
        self._networks = AuthThrottle(burst, per_minute, max_keys, clock)
        self._usernames = AuthThrottle(burst, per_minute, max_keys, clock)
        self._devices = AuthThrottle(burst, per_minute, max_keys, clock)
        #: (username, network) pairs that signed in: the username's bucket does not hold them.
        self._known: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._max_keys = max_keys

    def refusal(self, network: str | None, username: str | None,
                device: str | None = None) -> tuple[str, float] | None:
        """(``"network"``, ``"username"`` or ``"device"``, seconds to wait) if an attempt must be refused
        now, else None. An attempt from a known ``device`` is judged by that device's failures only."""
        with self._lock:
            if device is not None:
                wait = self._devices.retry_after(device)
                return (DEVICE, wait) if wait > 0 else None
            wait = self._networks.retry_after(network)
            if wait > 0:
                return NETWORK, wait
            if username is None or (network is not None and (username, network) in self._known):
                return None
            wait = self._usernames.retry_after(username)
            return (USERNAME, wait) if wait > 0 else None

    def failed(self, network: str | None, username: str | None, device: str | None = None) -> None:
        """An attempt was hashed and refused: one failure out of its device's bucket if it had one,
        else out of its network's and username's."""
        with self._lock:
            if device is not None:
                self._devices.failed(device)
                return
            self._networks.failed(network)
            if username is not None and (network is None or (username, network) not in self._known):
                self._usernames.failed(username)

    def succeeded(self, network: str | None, username: str | None) -> None:
        """An attempt signed in: its network is known for that username from now on."""
        if network is None or username is None or self.burst <= 0:
            return
        with self._lock:
            self._known[(username, network)] = None
            self._known.move_to_end((username, network))
            if len(self._known) > self._max_keys:
                self._known.popitem(last=False)


_current: tuple[tuple[Any, Any], LoginThrottle] | None = None
_current_lock = threading.Lock()


def current() -> LoginThrottle:
    """This process's throttle, made again when its settings change (read at each attempt)."""
    global _current
    key = (conf.get("LOGIN_FAILURES_BURST"), conf.get("LOGIN_FAILURES_PER_MINUTE"))
    with _current_lock:
        if _current is None or _current[0] != key:
            _current = (key, LoginThrottle(int(key[0]), float(key[1])))
        return _current[1]
