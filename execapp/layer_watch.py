"""Channel-layer memberships that outlive a Redis restart: kept here, re-added when Redis is back.

channels_redis keeps group memberships only in Redis (one sorted set per group). A Redis that
restarts without persistence forgets them, and nothing in Channels adds them back: members stay
connected and receive nothing. A ``LayerWatch`` (one per channel-layer instance and event loop:
the ASGI loop's consumers share one, each control listener has its own) remembers what was
joined through it, and:

- checks the layer every ``EXECAPP['LAYER_CHECK_SECONDS']`` with one round trip per Redis shard
  (GETSET + EXPIRE of a marker key of its own, bounded by ``CHECK_TIMEOUT_SECONDS``): an error
  means the layer is down; a missing marker means Redis lost its data (a restart) even when no
  reader happened to see an error;
- once the layer answers again after an error, or lost the marker, re-adds every membership
  (pipelined per shard) before it reports the layer up again; that is what bounds the time from
  Redis' return to working sessions and control (the check interval, not a socket timeout);
- every ``REFRESH_SECONDS`` re-adds them anyway: channels_redis expires a group after its
  ``group_expiry`` (a day by default), however long its members stay connected.

Readers of the layer report a failed ``receive`` with ``failed(exc)`` and ``await wait_up()``
before they receive again: they back off on the watch instead of spinning on a dead Redis.
The in-memory layer cannot fail or forget: its watch runs no checker.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from typing import Any, Awaitable, Callable

from . import conf

log = logging.getLogger("execapp.layer")

#: Longest wait for one check's round trip: a Redis that does not answer within it counts as down.
CHECK_TIMEOUT_SECONDS = 2.0
#: Longest wait for one join (a connection's first event naming a session, or its ?session=): the
#: connection reads none of its frames meanwhile, so a Redis that hangs (a partition, CLIENT PAUSE)
#: held each connection that joined for the socket timeout (15 s), its events without any session
#: included. Past it the layer counts as down and the membership is made by the checker's re-add.
#: A leave waits as long at most (a closing connection leaves its up to 32 sessions one by one).
JOIN_TIMEOUT_SECONDS = 2.0
#: Longest wait for re-adding every membership (pipelined) before the attempt counts as failed.
REJOIN_TIMEOUT_SECONDS = 10.0
#: Memberships are re-added this often even without an outage (channels_redis' group expiry).
REFRESH_SECONDS = 3600.0
#: The marker key's lifetime: it is set again at every check, so only a stopped process lets it go.
MARKER_TTL_SECONDS = 3600
#: Groups per pipeline when re-adding memberships.
REJOIN_BATCH = 500


class LayerWatch:
    """This loop's memberships on one channel layer, and whether that layer works now (see module)."""

    def __init__(self, layer: Any, name: str, interval: float | None = None,
                 on_restored: Callable[[], Awaitable[None]] | None = None, autocheck: bool = True) -> None:
        self.layer = layer
        self.name = name
        #: False: no checker task; the owner calls ``check()`` on its own schedule (a control listener
        #: checks right before each registry beat).
        self.autocheck = autocheck
        self.interval = float(conf.get("LAYER_CHECK_SECONDS") if interval is None else interval)
        #: Called (awaited) after the memberships were re-added following an outage.
        self.on_restored = on_restored
        #: group -> channels of this loop that joined it through this watch.
        self.groups: dict[str, set[str]] = {}
        # channels_redis (and any layer shaped like it) can fail and forget; in-memory cannot.
        self.checked = hasattr(layer, "connection") and hasattr(layer, "ring_size")
        self.marker = f"{getattr(layer, 'prefix', 'asgi')}:execapp:layer-watch:{uuid.uuid4().hex}"
        self._up = asyncio.Event()
        self._up.set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._marked = False
        self._down_since: float | None = None
        #: Outages seen (the layer failed after working), and recoveries (memberships re-added).
        self.outages = 0
        self.restores = 0
        self.last_error = ""
        #: True while the checker re-adds the memberships: a join then is made at once (the re-add's
        #: snapshot may have been taken before it).
        self._rejoining = False

    # -- memberships ------------------------------------------------------------------------------

    async def add(self, group: str, channel: str) -> None:
        """Join ``group`` and remember it; while the layer is down the join is only remembered
        (and made once it answers again): never raises."""
        self.groups.setdefault(group, set()).add(channel)
        self._ensure_checker()
        if self.checked and not self._up.is_set() and not self._rejoining:
            return  # down: the checker's next re-add makes it (no wait here on a Redis that hangs)
        try:
            await asyncio.wait_for(self.layer.group_add(group, channel), JOIN_TIMEOUT_SECONDS)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            self.failed(TimeoutError(f"joining {group} took over {JOIN_TIMEOUT_SECONDS:g} s"))
        except Exception as exc:
            self.failed(exc)

    async def discard(self, group: str, channel: str) -> None:
        """Leave ``group`` and forget it; a layer that is down keeps it until its group expiry."""
        channels = self.groups.get(group)
        if channels is not None:
            channels.discard(channel)
            if not channels:
                del self.groups[group]
        if self.checked and not self._up.is_set():
            return  # down: the membership lapses with the group (a disconnect must not wait on a hung Redis)
        try:
            await asyncio.wait_for(self.layer.group_discard(group, channel), JOIN_TIMEOUT_SECONDS)
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            self.failed(TimeoutError(f"leaving {group} took over {JOIN_TIMEOUT_SECONDS:g} s"))
        except Exception as exc:
            log.debug("%s: leaving %s failed (the layer is down): %r", self.name, group, exc)

    def memberships(self) -> int:
        """How many (group, channel) memberships this watch keeps."""
        return sum(len(c) for c in self.groups.values())

    # -- the layer's state ------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        """False from a reported failure until the memberships were re-added."""
        return self._up.is_set()

    def failed(self, exc: BaseException) -> None:
        """A reader or a join saw the layer fail: it is down until the checker re-adds everything."""
        self.last_error = f"{type(exc).__name__}: {exc}"
        if not self.checked:
            log.warning("%s: channel layer call failed: %s", self.name, self.last_error)
            return
        if self._up.is_set():
            self._up.clear()
            self._down_since = time.monotonic()
            self.outages += 1
            log.warning("%s: the channel layer failed (%s); its %d memberships are re-added once it answers again "
                        "(checked every %.1f s)", self.name, self.last_error, self.memberships(), self.interval)
        self._wake.set()
        self._ensure_checker()

    @property
    def marked(self) -> bool:
        """True once a check has set this watch's marker: from then on a layer that lost its data is seen."""
        return self._marked

    async def wait_up(self) -> None:
        """Return once the layer works (at once when it does)."""
        await self._up.wait()

    def stats(self) -> dict[str, Any]:
        """What the watch knows: up, memberships, outages, restores, the last error."""
        return {"up": self.up, "memberships": self.memberships(), "outages": self.outages,
                "restores": self.restores, "last_error": self.last_error,
                "down_seconds": (round(time.monotonic() - self._down_since, 3)
                                 if self._down_since is not None and not self.up else 0.0)}

    # -- the checker task -------------------------------------------------------------------------

    def _ensure_checker(self) -> None:
        if not self.checked or not self.autocheck:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"execapp-layer-watch-{self.name}")

    async def stop(self) -> None:
        """Stop the checker (a control listener leaving); the memberships are not left."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        # Runs while anything is joined or the layer is down (a reader waits for it); a watch
        # with nothing to watch ends its task and starts it again on the next join.
        refreshed = time.monotonic()
        first = True
        while self.groups or not self._up.is_set():
            if not first:
                try:
                    await asyncio.wait_for(self._wake.wait(), self.interval)
                except asyncio.TimeoutError:
                    pass
            first = False
            self._wake.clear()
            refresh = time.monotonic() - refreshed >= REFRESH_SECONDS
            if await self.check(refresh) and refresh:
                refreshed = time.monotonic()

    async def check(self, refresh: bool = False) -> bool:
        """One check (see the module docstring); True when the layer works and holds every membership."""
        if not self.checked:  # in memory: nothing to lose
            return True
        try:
            lost = await asyncio.wait_for(self._probe(), CHECK_TIMEOUT_SECONDS)
            restore = not self._up.is_set() or lost
            if restore or refresh:
                self._rejoining = True
                try:
                    count = await asyncio.wait_for(self._rejoin(), REJOIN_TIMEOUT_SECONDS)
                finally:
                    self._rejoining = False
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._up.is_set():
                self.failed(exc)
            else:
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.debug("%s: the channel layer is still down: %s", self.name, self.last_error)
            return False
        if restore:
            self.restores += 1
            down = time.monotonic() - self._down_since if self._down_since is not None else 0.0
            why = "lost its data (restarted)" if lost and self._up.is_set() else f"was down for {down:.1f} s"
            log.warning("%s: the channel layer answers again (it %s); re-added %d memberships",
                        self.name, why, count)
            if self.on_restored is not None:
                try:
                    await self.on_restored()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("%s: after the channel layer came back", self.name)
        self._down_since = None
        self._up.set()
        return True

    async def _probe(self) -> bool:
        """One round trip per shard: True when a shard no longer had our marker (it lost its data)."""
        layer = self.layer
        lost = False
        for index in range(layer.ring_size):
            pipe = layer.connection(index).pipeline(transaction=False)
            pipe.getset(self.marker, b"1")
            pipe.expire(self.marker, MARKER_TTL_SECONDS)
            old, _ = await pipe.execute()
            lost = lost or old is None
        if not self._marked:  # the first check sets the marker: nothing was lost yet
            self._marked = True
            return False
        return lost

    async def _rejoin(self) -> int:
        """Add every membership again (a sorted-set ZADD + EXPIRE per group, pipelined per shard)."""
        layer = self.layer
        snapshot = [(group, list(channels)) for group, channels in list(self.groups.items()) if channels]
        group_key = getattr(layer, "_group_key", None)
        if group_key is None:  # another layer: its own group_add, one call each
            for group, channels in snapshot:
                for channel in channels:
                    await layer.group_add(group, channel)
            return sum(len(c) for _, c in snapshot)
        by_shard: dict[int, list[tuple[str, list[str]]]] = {}
        for group, channels in snapshot:
            by_shard.setdefault(layer.consistent_hash(group), []).append((group, channels))
        now = time.time()
        for index, items in by_shard.items():
            connection = layer.connection(index)
            for start in range(0, len(items), REJOIN_BATCH):
                pipe = connection.pipeline(transaction=False)
                for group, channels in items[start:start + REJOIN_BATCH]:
                    key = group_key(group)
                    pipe.zadd(key, {channel: now for channel in channels})
                    pipe.expire(key, layer.group_expiry)
                await pipe.execute()
        return sum(len(c) for _, c in snapshot)


_watches: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, LayerWatch]]" = weakref.WeakKeyDictionary()


def watch_for(layer: Any, name: str = "sessions") -> LayerWatch:
    """The running loop's LayerWatch of ``layer`` (made on first use): the consumers of one process share it."""
    per_loop = _watches.setdefault(asyncio.get_running_loop(), {})
    watch = per_loop.get(id(layer))
    if watch is None or watch.layer is not layer:
        watch = per_loop[id(layer)] = LayerWatch(layer, name)
    return watch
