"""A share of a worker for each client network's HTTP requests: a few at once, and a share of the time.

Why: HTTP requests were charged to nobody. Django runs every sync view on one thread of the worker
(asgiref's thread-sensitive executor), which takes the GIL from the event loop every WebSocket
connection shares; the loop also builds each request and writes its response. 50 unauthenticated
keep-alive connections asking for ``/admin/login/`` over and over (no credentials needed) took a
bystander tenant's ``/ping`` from p50 0.6 ms / p99 4.3 ms to p50 14 ms / p99 589 ms (measured on a
shared 2-core machine). execapp.loop_share charges WebSocket owners' frames; nothing charged these.

``HttpShare`` (around the HTTP app, inside execapp.http_limits.RequestBodyLimit) keeps, per client
network (an IPv4 address, an IPv6 /64, as execapp.auth_throttle reads them) and worker process:

- at most ``EXECAPP['HTTP_REQUESTS_PER_NETWORK']`` requests in Django at once; the next wait their
  turn (first come, first served: a waiting request costs a coroutine, and its connection is not
  read meanwhile), and past ``QUEUE_FACTOR`` times that many waiting the request is answered ``429``
  with ``Retry-After`` and its connection closed (answering 429 on a keep-alive connection that
  asked again at once made ~4,000 answers a second, each on the loop: the bystander's p50 x8);
- a share of ``EXECAPP['HTTP_SHARE_PER_NETWORK']`` seconds per second, charged the wall time during
  which at least one of its requests is between its body being in and its response's start (Django's
  work: the view, its queries, the template; overlapping requests charged once);
- and every network together a share of ``EXECAPP['HTTP_SHARE_PER_WORKER']``, the same way (one
  client with many addresses is many networks).

The shares are one owner, ``"http"``, in the worker's ``ShareGroup``: enforced only while another
owner (a WebSocket tenant) is active, so an admin alone on a worker is held by nothing; and, unlike a
tenant's, never raised to the even split (half a worker still put a bystander's /ping p99 at 30 ms).
Past a share the next request waits until it refilled; one that would wait more than
``MAX_WAIT_SECONDS`` is answered ``429`` (closed) instead.

The probes (``/healthz``) and ``/metrics`` are charged but never wait nor refused: a load balancer
behind the same address as a flood must still see the worker. Refusals are counted in
``execapp_connections_closed_total{reason="http_share"}``. Event loop only: no lock.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from typing import Any, Awaitable, Callable

from . import conf, metrics
from .auth_throttle import client_network
from .loop_share import LoopShare, ShareGroup

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]

#: The ``reason`` label of a request refused for its network's share (answered 429).
HTTP_SHARE = "http_share"
#: The owner every HTTP request's share stands for in the worker's ShareGroup.
HTTP_OWNER = "http"
#: Requests of one network that may wait for a turn, as a multiple of HTTP_REQUESTS_PER_NETWORK.
QUEUE_FACTOR = 64
#: The longest a request waits for its network's share to refill before it is answered 429 instead.
MAX_WAIT_SECONDS = 5.0
#: Paths charged but never held: the load balancer's probe and the metrics scrape.
UNHELD_PATHS = frozenset({"/healthz", "/metrics"})


class _Share(LoopShare):
    """A LoopShare refilled at its own share only: HTTP is not an owner the loop is split evenly with
    (at the even split, half a worker, Django's thread held the GIL often enough to put a bystander's
    /ping p99 at 30 ms)."""

    __slots__ = ()

    @property
    def rate(self) -> float:
        return self.share


class _Busy:
    """The wall time during which at least one of some requests is in Django, charged to ``share``
    once however many overlap (charging each request's own time made N at once cost N times as much)."""

    __slots__ = ("share", "inside", "since")

    def __init__(self, share: LoopShare) -> None:
        self.share = share
        self.inside = 0
        self.since = 0.0

    def enter(self) -> None:
        if not self.inside:
            self.since = time.monotonic()
        self.inside += 1

    def leave(self) -> None:
        """One request left Django: the time since the last charge is charged (some were inside all of it)."""
        self.inside -= 1
        self.share.spend_since(self.since)
        self.since = self.share._at  # spend_since's clock reading: no time charged twice or lost


def _owed_seconds(share: LoopShare) -> float:
    """How long ``share`` needs to refill to zero (0: not owed)."""
    return max(0.0, -(share.level + (time.monotonic() - share._at) * share.rate) / share.rate)


class _Network:
    """One client network's requests on this worker: those in Django, those waiting, and its share."""

    __slots__ = ("share", "busy", "running", "waiting")

    def __init__(self, share: LoopShare) -> None:
        self.share = share
        self.busy = _Busy(share)
        self.running = 0
        #: Requests waiting for a turn, oldest first: each one's future, set when it may run.
        self.waiting: deque[asyncio.Future[None]] = deque()

    def idle(self) -> bool:
        """Nothing running or waiting and the share full again: forgetting it loses nothing."""
        share = self.share
        return (not self.running and not self.waiting
                and share.level + (time.monotonic() - share._at) * share.rate >= share.capacity)


class HttpShare:
    """ASGI middleware: each client network's HTTP requests within a number at once and a share of
    the worker's time (see the module docstring)."""

    def __init__(self, app: App) -> None:
        self.app = app
        self._networks: dict[str, _Network] = {}
        #: Used when the process has no Worker (tests, management commands): HTTP networks only.
        self._own_group = ShareGroup()
        #: Every network's requests together (HTTP_SHARE_PER_WORKER); made at the first request (the worker's group).
        self._all: _Busy | None = None

    def _group(self) -> ShareGroup:
        from .worker import current_worker  # here: the worker module imports the engine

        worker = current_worker()
        return worker.share_group if worker is not None else self._own_group

    def _network(self, key: str, share: float) -> _Network:
        group = self._group()
        if self._all is not None and self._all.share.group is not group:  # the process's Worker came (or changed)
            self._networks.clear()
            self._all = None
        if self._all is None:
            self._all = _Busy(_Share(float(conf.get("HTTP_SHARE_PER_WORKER")), group=group, owner=HTTP_OWNER))
        networks = self._networks
        found = networks.get(key)
        if found is None:
            if len(networks) >= 64:  # amortized: forget the networks with nothing owed nor under way
                for gone in [k for k, n in networks.items() if n.idle()]:
                    del networks[gone]
            # One owner "http" in the worker's group for every network (and all of them together): they are
            # held while a WebSocket tenant is active, not for each other (the FIFO above serves them in turn).
            found = networks[key] = _Network(_Share(share, group=group, owner=HTTP_OWNER))
        return found

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        per_network = int(conf.get("HTTP_REQUESTS_PER_NETWORK"))
        if per_network <= 0:  # 0: off
            await self.app(scope, receive, send)
            return
        key = client_network(scope) or "unknown"
        network = self._network(key, float(conf.get("HTTP_SHARE_PER_NETWORK")))
        held = scope.get("path") not in UNHELD_PATHS
        network.running += 1  # a slot, taken now or (past the cap) handed over by the one that ends
        try:
            refusal = await self._admit(network, per_network) if held else None
        except BaseException:
            network.running -= 1
            self._next(network, per_network)
            raise
        if refusal is not None:
            network.running -= 1
            self._next(network, per_network)
            await self._refuse(send, *refusal)
            return
        every = self._all
        assert every is not None  # made by _network
        inside = False  # between the body being in and the response's start: charged

        async def charged_receive() -> dict[str, Any]:
            nonlocal inside
            message = await receive()
            if not inside and message["type"] == "http.request" and not message.get("more_body", False):
                inside = True  # the body is in: Django's work starts (its arrival is not charged)
                network.busy.enter()
                every.enter()
            return message

        def leave() -> None:
            nonlocal inside
            if inside:
                inside = False
                network.busy.leave()
                every.leave()

        async def charged_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                leave()
            await send(message)

        try:
            await self.app(scope, charged_receive, charged_send)
        finally:
            leave()
            network.running -= 1
            self._next(network, per_network)

    async def _admit(self, network: _Network, per_network: int) -> tuple[int, str] | None:
        """Wait for ``network``'s turn (its slot is counted in ``running`` already) and share; the
        (status, text) of the refusal when it may not run."""
        # Past the cap with this one (``running`` counts the waiting too): wait for a slot to be handed over.
        if network.running - len(network.waiting) > per_network:
            if len(network.waiting) >= QUEUE_FACTOR * per_network:
                return 429, (f"more than {per_network} requests from your network at once here, and "
                             f"{len(network.waiting)} waiting (EXECAPP['HTTP_REQUESTS_PER_NETWORK']); send fewer "
                             "at once; retry in 1 s\n")
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            network.waiting.append(turn)
            try:
                await turn
            except BaseException:
                if turn in network.waiting:
                    network.waiting.remove(turn)
                raise
        assert self._all is not None
        for share, whose, key in ((network.share, "your network's requests", "HTTP_SHARE_PER_NETWORK"),
                                  (self._all.share, "this server's HTTP requests", "HTTP_SHARE_PER_WORKER")):
            if share.enforced and share.owed:
                wait = _owed_seconds(share)
                if wait > MAX_WAIT_SECONDS:
                    return 429, (f"{whose} took more than their share of this server (EXECAPP['{key}'] = "
                                 f"{share.share:g} of a second a second while others are served); retry in "
                                 f"{math.ceil(wait)} s\n")
                metrics.LOOP_SHARE_WAITS.inc()
                await share.wait()
        return None

    @staticmethod
    def _next(network: _Network, per_network: int) -> None:
        """A slot of ``network`` was freed: the oldest waiting request may run, if the slots allow."""
        # ``running`` counts the waiting too: those past the cap wait, the rest have their slot.
        waiting = network.waiting
        while waiting and network.running - len(waiting) < per_network:
            turn = waiting.popleft()
            if not turn.done():
                turn.set_result(None)

    @staticmethod
    async def _refuse(send: Send, status: int, text: str) -> None:
        metrics.CONNECTIONS_CLOSED.labels(HTTP_SHARE).inc()
        body = text.encode()
        retry = text.rsplit("retry in ", 1)[-1].split(" ", 1)[0] if "retry in " in text else "1"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(body)).encode()), (b"retry-after", retry.encode()),
                                # Closed after the answer: a client re-asking at once on its keep-alive
                                # connection made ~4,000 429s a second, each on the loop (bystander p50 x10).
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

