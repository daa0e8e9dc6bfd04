"""Instance strategies (docs/plugins.md, "Choosing a strategy"): per_request, pooled and sharded, for every runtime.

A strategy's ``call`` is the whole per-call path of a loaded plugin (LoadedPlugin.call is bound
to it): the plugin's concurrency slot, the instance, the deadline, the guest call, putting the
instance back (or replacing it), the counters and the mapping of guest failures to engine
errors. It is kept flat on purpose: at 2-5 us per bare guest call, every extra frame, lock or
object shows in bench/bench_plugins.py (docs/benchmarks.md has the per-step costs).

Every acquisition has two modes. ``blocking=False`` is for a handler running inline on the
event loop: it takes a free slot/shard at once or raises PluginBusy, never waits.
``blocking=True`` (a pool thread) waits up to the plugin's timeout, then raises PluginBusy.

``deadline`` (a time.monotonic() value, from the engine's ``ctx.deadline``): the guest's
deadline is min(now + the plugin's timeout, deadline), computed when the guest is about to
run, and a wait for a slot or shard ends by it too. Inline, it is the engine's inline budget.
"""
from __future__ import annotations

import abc
import collections
import itertools
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Protocol
from zlib import crc32

from execapp.engine import HandlerError, HandlerTimeout

from .errors import (
    GuestError,
    GuestMemory,
    GuestQuota,
    GuestTimeout,
    PluginBusy,
    PluginMemoryExceeded,
    PluginUnavailable,
    QuotaExceeded,
)
from .runtimes.base import MAX_REPLY_BYTES, MAX_REPLY_DEPTH, Compiled, Instance, clip_error
from .spec import PluginSpec

_now = time.monotonic
#: Keys (sessions) whose shard a Sharded strategy remembers at most.
_SHARD_KEYS = 4096
#: Tenants whose last turn a Slots remembers at most (then it forgets them all: a turn lost is one
#: tie decided by arrival order).
_SERVED_TENANTS = 256


class _Waiter:
    """A pool thread waiting for a slot: its tenant, and a lock held until it is woken for its turn."""

    __slots__ = ("tenant", "ready", "woken")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.ready = threading.Lock()
        self.ready.acquire()
        self.woken = False


class Slots:
    """A plugin's concurrency limit, shared in turn by the tenants waiting for it; reports busy /
    waiting and counts waits and refusals.

    Why in turn: a plugin's slots serve every tenant of the worker. One tenant's many pooled events
    kept every slot busy and queued for them; another tenant's event waited among them, woken in no
    particular order, and was refused ``plugin_busy`` when its wait ran out (19 of 24 refused in
    tests/execapp/test_plugin_share_e2e.py). While callers wait, a freed slot wakes a waiter of the
    waiting tenant that took a slot least recently (each tenant's waiters in arrival order), so a
    tenant waits for about one call per other waiting tenant, not for another tenant's whole queue.
    A pool thread that comes while others wait joins the line (``take`` refuses it); a caller that
    never waits (inline on the event loop, ``barge``) may still take a slot that is free, as before:
    a woken waiter that finds its slot so taken keeps its place at the front. ``tenant`` is the
    event's opaque owner id ("" for callers without one).

    The slots are tokens in a ``collections.deque`` (C code, ``pop``/``append`` atomic under the GIL):
    while nobody waits, taking and giving one back are two C calls with no Python-level lock (a
    Lock/Condition pair cost ~0.3 us per call, a threading.Semaphore ~2.5 us; exact per-tenant counts
    under a lock ~0.8 us). Only while callers wait does a give touch the lock. (Not a
    ``queue.SimpleQueue``: its ``get_nowait`` compacts its list every other call, a realloc per
    slot; and the methods are called on the deque, not through bound methods kept as attributes,
    which Python 3.11 cannot specialize: ~300 instructions a call.)
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._tokens: collections.deque = collections.deque([None] * capacity)
        self._lock = threading.Lock()
        self._waiters: list[_Waiter] = []  # not woken yet, in arrival order
        self._woken = 0  # woken for a free slot, not yet back for it
        #: The turn at which each tenant last took a slot (a count: next() on it is one C call).
        self._served: dict[str, int] = {}
        #: The tenant of the last take: a tenant taking slot after slot is recorded at the first of
        #: its run only (the order of the tenants' last turns is the same; a lost race misorders one tie).
        self._last: str | None = None
        self._turns = itertools.count()
        self.waits_total = 0
        self.refused_total = 0

    @property
    def busy(self) -> int:
        """Slots taken now."""
        return self.capacity - len(self._tokens)

    @property
    def waiting(self) -> int:
        """Callers waiting for a slot now."""
        return len(self._waiters) + self._woken

    def take(self, tenant: str = "", barge: bool = False) -> bool:
        """The hot path: a free slot at once, or False. A pool thread (not ``barge``) gets none
        while others wait: they come first."""
        if (self._waiters or self._woken) and not barge:
            return False
        try:
            self._tokens.pop()
        except IndexError:
            return False
        if tenant != self._last:
            self._record(tenant)
        return True

    def _record(self, tenant: str) -> None:
        """Note that ``tenant`` took a slot now (its turn)."""
        served = self._served
        if len(served) > _SERVED_TENANTS:
            served.clear()  # C calls, atomic under the GIL like the store below: no lock on this path
        served[tenant] = next(self._turns)
        self._last = tenant

    def give(self, tenant: str = "") -> None:
        """Give a slot back; while callers wait, wake the one whose turn it is."""
        self._tokens.append(None)
        # A waiter appends itself before it looks for a token (both under the lock), so either it
        # sees this token or this sees it: no slot stays free while someone waits unwoken.
        if self._waiters:
            with self._lock:
                self._wake()

    def release(self, tenant: str = "") -> None:
        self.give(tenant)

    def acquire(self, blocking: bool, wait: float, tenant: str = "") -> bool:
        """Take a slot: at once, or (``blocking``) within ``wait`` seconds. False if none."""
        return self.take(tenant, not blocking) or self.wait(blocking, wait, tenant)

    def wait(self, blocking: bool, wait: float, tenant: str = "") -> bool:
        """The slow path once ``take`` found no free slot: wait in turn (``blocking``) or refuse."""
        if not blocking:
            with self._lock:
                self.refused_total += 1
            return False
        waiter = _Waiter(tenant)
        end = _now() + max(wait, 0.0)
        with self._lock:
            self._waiters.append(waiter)
            self.waits_total += 1
            self._wake()
        while True:
            got = waiter.ready.acquire(timeout=max(end - _now(), 0.0))
            with self._lock:
                if not waiter.woken:  # the wait ran out (only _wake releases it, with woken set)
                    self._waiters.remove(waiter)
                    self.refused_total += 1
                    return False
                if not got:  # woken just as the wait ran out: re-arm (it was released with woken)
                    waiter.ready.acquire(False)
                waiter.woken = False
                self._woken -= 1
                try:
                    self._tokens.pop()
                except IndexError:  # a caller that never waits took it first
                    if _now() >= end:
                        self.refused_total += 1
                        return False
                    self._waiters.insert(0, waiter)  # keeps its place
                    self._wake()
                    continue
                self._record(tenant)
                return True

    def _wake(self) -> None:
        """Under the lock: for each free slot no woken waiter is coming for, wake the waiter whose
        tenant's turn it is (the one that took a slot least recently)."""
        waiters, served = self._waiters, self._served
        while waiters and len(self._tokens) > self._woken:
            best, oldest = 0, None
            seen: set[str] = set()
            for i, waiter in enumerate(waiters):
                if waiter.tenant in seen:
                    continue
                seen.add(waiter.tenant)
                turn = served.get(waiter.tenant, -1)
                if oldest is None or turn < oldest:
                    best, oldest = i, turn
                    if turn < 0:
                        break
            waiter = waiters.pop(best)
            waiter.woken = True
            self._woken += 1
            waiter.ready.release()


class PluginCall(Protocol):
    """A loaded plugin's call: ``handler`` on ``event`` under its limits; the reply (str, dict, list or None)."""

    def __call__(self, handler: str, event: dict[str, Any], blocking: bool = True,
                 deadline: float | None = None) -> Any: ...


class Strategy(abc.ABC):
    """Base: how instances are made, chosen and reused for one loaded plugin, and its call path."""

    name = ""

    def __init__(self, spec: PluginSpec, compiled: Compiled) -> None:
        self.spec = spec
        self.compiled = compiled
        self.closed = False
        self._lock = threading.Lock()
        #: The plugin's concurrency limit (shared by every engine of the process).
        self.slots = Slots(self.limit())
        self._timeout = spec.timeout
        # next() on itertools.count is one atomic C call: calls are counted without a lock.
        self._calls = itertools.count()
        self.errors_total = 0
        self.timeouts_total = 0
        self.waiting = 0  # callers waiting for something other than a slot (a shard)
        self.waits_total = 0
        self.refused_total = 0
        self.created_total = 0
        self.discarded_total = 0

    @abc.abstractmethod
    def call(self, handler: str, event: dict[str, Any], blocking: bool = True, deadline: float | None = None) -> Any:
        """Run ``handler`` on an instance chosen by this strategy, under the plugin's limits and
        by ``deadline`` (time.monotonic()) when one is given."""

    def limit(self) -> int:
        """How many calls may run at once (the slots' capacity)."""
        return self.spec.max_concurrency

    @abc.abstractmethod
    def capacity(self) -> int:
        """How many instances this strategy may keep."""

    @abc.abstractmethod
    def idle(self) -> int:
        """Instances alive and not running a call now."""

    @property
    def busy(self) -> int:
        """Calls in progress now."""
        return self.slots.busy

    @property
    def calls_total(self) -> int:
        # itertools.count has no public getter; its repr is "count(N)".
        return int(repr(self._calls)[6:-1])

    def live(self) -> int:
        """Instances alive now (for leak checks)."""
        return self.created_total - self.discarded_total

    def _wait_for(self, deadline: float | None) -> float:
        """How long a pool thread may wait for a slot or shard: the plugin's timeout, cut to
        what is left before ``deadline``."""
        wait = self._timeout
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - _now()))
        return wait

    def _no_slot(self, handler: str, blocking: bool, deadline: float | None = None, tenant: str = "") -> None:
        """Slow path: wait for a slot (pool thread) or raise PluginBusy."""
        wait = self._wait_for(deadline)
        if not self.slots.wait(blocking, wait, tenant):
            raise PluginBusy(self._busy_message(handler) + (f" after waiting {wait:g} s" if blocking else "")
                             + "; " + self._busy_fix())

    def _busy_message(self, handler: str) -> str:
        return (f"plugin {self.spec.name!r} handler {handler!r}: all {self.spec.max_concurrency} concurrent "
                "calls allowed are running")

    def _busy_fix(self) -> str:
        return "retry, or raise the plugin's max concurrency"

    def _closed(self, handler: str) -> PluginUnavailable:
        """The refusal of a call that got its slot after close() (its instances are going, or gone)."""
        spec = self.spec
        return PluginUnavailable(f"plugin {spec.name!r} handler {handler!r}: version {spec.version} was replaced, "
                                 "disabled or deleted before this call started; send the event again (it runs on "
                                 "the plugin's current version, if the plugin is still enabled)")

    def _failed(self, handler: str, exc: GuestError) -> Exception:
        """Count a guest failure and turn it into the engine's error naming plugin and handler.

        The guest's message is cut to MAX_ERROR_CHARS: it is the guest's own text (a JS throw of
        a 16 MB string), and every copy of it downstream runs on the event loop."""
        spec = self.spec
        timeout = isinstance(exc, GuestTimeout)
        with self._lock:
            self.errors_total += not timeout
            self.timeouts_total += timeout
        detail = clip_error(str(exc))
        if timeout:
            return HandlerTimeout(f"plugin {spec.name!r} handler {handler!r}: timeout: {detail}")
        if isinstance(exc, GuestQuota):
            return QuotaExceeded(f"plugin {spec.name!r} handler {handler!r}: {exc.code}: {detail}", exc.code)
        if isinstance(exc, GuestMemory):
            return PluginMemoryExceeded(f"plugin {spec.name!r} handler {handler!r}: {detail}")
        return HandlerError(f"plugin {spec.name!r} handler {handler!r}: {spec.runtime} error: {detail}")

    def reply_too_large(self, handler: str, size: int) -> HandlerError:
        """Count a reply over MAX_REPLY_BYTES as the handler's error (plugins.loaded refuses it)."""
        with self._lock:
            self.errors_total += 1
        return HandlerError(f"plugin {self.spec.name!r} handler {handler!r}: its reply is {size} bytes (UTF-8 of the "
                            f"text, or of the data's JSON), over the limit of {MAX_REPLY_BYTES} bytes "
                            "(MAX_REPLY_BYTES); reply with less, e.g. a summary or a key kept with kv_set")

    def reply_too_deep(self, handler: str) -> HandlerError:
        """Count a data reply nested deeper than MAX_REPLY_DEPTH as the handler's error (plugins.loaded)."""
        with self._lock:
            self.errors_total += 1
        return HandlerError(f"plugin {self.spec.name!r} handler {handler!r}: its data reply nests arrays/objects "
                            f"more than {MAX_REPLY_DEPTH} levels deep (MAX_REPLY_DEPTH); flatten it")

    def _new(self, deadline: float | None) -> Instance:
        # The new instance's top level stops by the caller's deadline too: inline on the event
        # loop that is the worker's inline budget, which a pooled Lua or JS top level of up to
        # timeout_ms (60 s at most) otherwise held the loop past (tests/plugins/test_strategies.py).
        inst = self.compiled.new_instance(deadline)
        with self._lock:
            self.created_total += 1
        return inst

    def _discard(self, inst: Instance) -> None:
        try:
            inst.close()
        finally:
            with self._lock:
                self.discarded_total += 1

    def close(self) -> None:
        """Refuse new calls (PluginUnavailable); running calls finish, their instances are dropped."""
        self.closed = True


class PerRequest(Strategy):
    """A fresh instance (Lua: a fresh environment on a per-thread runtime) for every call."""

    name = "per_request"

    def __init__(self, spec: PluginSpec, compiled: Compiled) -> None:
        super().__init__(spec, compiled)

    def call(self, handler: str, event: dict[str, Any], blocking: bool = True, deadline: float | None = None) -> Any:
        tenant = event.get("tenant", "")
        if not self.slots.take(tenant, not blocking):
            self._no_slot(handler, blocking, deadline, tenant)
        if self.closed:
            self.slots.give(tenant)
            raise self._closed(handler)
        try:
            # The deadline starts when the guest is about to run, after any wait for a slot.
            due = _now() + self._timeout
            if deadline is not None and deadline < due:
                due = deadline
            return self.compiled.call_isolated(handler, event, due)
        except GuestError as exc:
            raise self._failed(handler, exc) from None
        finally:
            self.slots.give(tenant)
            next(self._calls)

    def capacity(self) -> int:
        return self.spec.max_concurrency

    def idle(self) -> int:
        # Warm per-thread runtimes (Lua) not running a call now; a busy call holds its thread's.
        return max(self.compiled.idle_isolated() - self.slots.busy, 0)

    def live(self) -> int:
        return 0


class Pooled(Strategy):
    """``pool_size`` instances on a free list; poisoned ones are replaced.

    One slot limit bounds both the plugin's concurrency and the pool: its capacity is
    ``min(max_concurrency, pool_size)``, so a caller holding a slot always finds or may create
    an instance and at most that many instances ever exist.
    """

    name = "pooled"

    def __init__(self, spec: PluginSpec, compiled: Compiled) -> None:
        super().__init__(spec, compiled)
        # pop/append atomic under the GIL; a deque, not a list: a list of one instance shrinks and
        # grows back (two reallocs) on every call. PooledPerThread's is per thread.
        self._free: collections.deque[Instance] | _IdlePerThread = collections.deque()

    def limit(self) -> int:
        return min(self.spec.max_concurrency, self.spec.pool_size)

    def _busy_message(self, handler: str) -> str:
        if self.spec.pool_size < self.spec.max_concurrency:
            return f"plugin {self.spec.name!r}: all {self.spec.pool_size} pooled instances are busy"
        return super()._busy_message(handler)

    def _busy_fix(self) -> str:
        return "raise its pool size" if self.spec.pool_size < self.spec.max_concurrency else super()._busy_fix()

    def call(self, handler: str, event: dict[str, Any], blocking: bool = True, deadline: float | None = None) -> Any:
        tenant = event.get("tenant", "")
        if not self.slots.take(tenant, not blocking):
            self._no_slot(handler, blocking, deadline, tenant)
        if self.closed:
            self.slots.give(tenant)
            raise self._closed(handler)
        inst: Instance | None = None
        try:
            try:
                inst = self._free.pop()
            except IndexError:
                inst = self._new(deadline)
            due = _now() + self._timeout
            if deadline is not None and deadline < due:
                due = deadline
            return inst.call(handler, event, due)
        except GuestError as exc:
            if exc.poison and inst is not None:
                self._discard(inst)
                inst = None
            raise self._failed(handler, exc) from None
        finally:
            if inst is not None:
                if self.closed:
                    self._discard(inst)
                else:
                    self._free.append(inst)
            self.slots.give(tenant)
            next(self._calls)

    def capacity(self) -> int:
        return self.spec.pool_size

    def idle(self) -> int:
        return len(self._free)

    def close(self) -> None:
        super().close()
        while self._free:
            try:
                self._discard(self._free.pop())
            except IndexError:
                break


class PooledPerThread(Pooled):
    """``pooled`` for a thread-bound runtime (none built in today): each thread keeps its own idle instance;
    the slot limit still bounds how many run at once."""

    def __init__(self, spec: PluginSpec, compiled: Compiled) -> None:
        super().__init__(spec, compiled)
        self._local = threading.local()
        # Instances alive now: an idle one leaves with its thread's locals when a pool thread
        # exits, without passing through _discard, so created - discarded would only grow.
        self._alive: weakref.WeakSet = weakref.WeakSet()
        # Pooled.call takes and returns instances through its free list: per thread here.
        self._free = _IdlePerThread(self)

    def _new(self, deadline: float | None) -> Instance:
        inst = super()._new(deadline)
        self._alive.add(inst)
        return inst

    def _discard(self, inst: Instance) -> None:
        self._alive.discard(inst)
        super()._discard(inst)

    def live(self) -> int:
        return len(self._alive)

    def idle(self) -> int:
        return max(self.live() - self.slots.busy, 0)


class _IdlePerThread:
    """PooledPerThread's free list: each thread's one idle instance (as Pooled.call uses a deque).
    Its length is 0: close() leaves the idle instances to their threads' locals."""

    __slots__ = ("_owner",)

    def __init__(self, owner: PooledPerThread) -> None:
        self._owner = owner

    def pop(self) -> Instance:
        """This thread's idle instance (IndexError when it has none, like deque.pop)."""
        local = self._owner._local
        inst = getattr(local, "idle", None)
        if inst is None:
            raise IndexError("no idle instance on this thread")
        local.idle = None
        return inst

    def append(self, inst: Instance) -> None:
        """Keep ``inst`` as this thread's idle instance (one per thread; a second is closed)."""
        local = self._owner._local
        if getattr(local, "idle", None) is not None:
            self._owner._discard(inst)
        else:
            local.idle = inst

    def __len__(self) -> int:
        return 0


class _Shard:
    __slots__ = ("slot", "instance", "queue", "thread")

    def __init__(self) -> None:
        #: One call at a time; while calls wait, tenants take turns (as for a plugin's slots).
        self.slot = Slots(1)
        self.instance: Instance | None = None
        self.queue: queue.SimpleQueue | None = None
        self.thread: threading.Thread | None = None


class Sharded(Strategy):
    """``shard_count`` instances; the event's session (else its id) picks one; serial per shard.

    Keeps per-session ordering and warm state. Each shard is a Slots of one: while calls wait for
    a shard, tenants take turns (a tenant's calls in arrival order), so one tenant's sessions that
    hash to every shard do not keep another tenant's session waiting until refused. The shards
    already bound running calls to ``shard_count``: the plugin's slot is taken only when
    ``max_concurrency`` is lower than that. That case, and thread-bound runtimes (each shard owns
    a thread that runs its calls; the caller holds the shard while it waits), are ShardedGeneral's.
    """

    name = "sharded"

    def __init__(self, spec: PluginSpec, compiled: Compiled) -> None:
        super().__init__(spec, compiled)
        self.shards = [_Shard() for _ in range(spec.shard_count)]
        self._n = len(self.shards)
        self._limited = spec.max_concurrency < spec.shard_count
        self._thread_bound = compiled.thread_bound
        # Shard by (tenant, session), so a session's later calls skip building its shard_key,
        # encoding and hashing it (~0.3 us); cleared when full rather than evicted one by one (a
        # miss costs only the shard_key and crc32 again). Events without a session (keyed by their
        # id, new every event) are not remembered.
        self._by_key: dict[tuple[Any, str], _Shard] = {}

    @property
    def busy(self) -> int:
        return sum(s.slot.busy for s in self.shards)

    def shard_for(self, event: dict[str, Any]) -> int:
        """The shard of an event: crc32 of its shard_key, stable across processes."""
        key = shard_key(event)
        return crc32(key.encode() if key.__class__ is str else str(key).encode()) % self._n

    def _shard_of(self, event: dict[str, Any], tenant: Any, session: Any) -> _Shard:
        """The shard of ``event`` (shard_for), remembered by its (tenant, session) for the session's next calls."""
        shard = self.shards[self.shard_for(event)]
        if session.__class__ is str and session:
            by_key = self._by_key
            if len(by_key) >= _SHARD_KEYS:
                by_key.clear()
            by_key[(tenant, session)] = shard
        return shard

    def call(self, handler: str, event: dict[str, Any], blocking: bool = True, deadline: float | None = None) -> Any:
        # The common case, flat: no plugin slot (the shard locks bound concurrency) and the call
        # runs on the caller's thread. ShardedGeneral covers the other two.
        session = event.get("session")
        tenant = event.get("tenant", "")
        shard = self._by_key.get((tenant, session)) if session.__class__ is str else None
        if shard is None:
            shard = self._shard_of(event, tenant, session)
        slot = shard.slot
        if not slot.take(tenant, not blocking):
            self._wait_shard(shard, event, blocking, deadline, tenant)
        if self.closed:
            slot.give(tenant)
            raise self._closed(handler)
        inst = None
        try:
            inst = shard.instance
            if inst is None:
                inst = shard.instance = self._new(deadline)
            due = _now() + self._timeout
            if deadline is not None and deadline < due:
                due = deadline
            return inst.call(handler, event, due)
        except GuestError as exc:
            if exc.poison and inst is not None:
                shard.instance = None
                self._discard(inst)
            raise self._failed(handler, exc) from None
        finally:
            slot.give(tenant)
            next(self._calls)

    def _wait_shard(self, shard: _Shard, event: dict[str, Any], blocking: bool, deadline: float | None = None,
                    tenant: str = "") -> None:
        """Slow path: the shard is busy; wait for it (pool thread) or raise PluginBusy."""
        wait = self._wait_for(deadline)
        if blocking:
            with self._lock:
                self.waiting += 1
                self.waits_total += 1
            try:
                if shard.slot.wait(True, wait, tenant):
                    return
            finally:
                with self._lock:
                    self.waiting -= 1
        with self._lock:
            self.refused_total += 1
        raise PluginBusy(f"plugin {self.spec.name!r}: shard {self.shard_for(event)} is busy with an earlier event "
                         "of the same session" + (f" after waiting {wait:g} s" if blocking else ""))

    def _run(self, shard: _Shard, handler: str, event: dict[str, Any], deadline: float | None = None) -> Any:
        """One call on the shard's instance (made on first use, replaced after a poisoning error);
        ShardedGeneral's (Sharded.call inlines the same steps)."""
        inst = shard.instance
        if inst is None:
            inst = shard.instance = self._new(deadline)
        due = _now() + self._timeout
        if deadline is not None and deadline < due:
            due = deadline
        try:
            return inst.call(handler, event, due)
        except GuestError as exc:
            if exc.poison:
                shard.instance = None
                self._discard(inst)
            raise

    def _on_shard_thread(self, shard: _Shard, fn: Callable[[], Any]) -> Any:
        if shard.thread is None:
            shard.queue = queue.SimpleQueue()
            shard.thread = threading.Thread(target=_shard_loop, args=(shard.queue,), daemon=True,
                                            name=f"plugin-{self.spec.name}-shard")
            shard.thread.start()
        fut: Future = Future()
        shard.queue.put((fn, fut))  # type: ignore[union-attr]
        try:
            # The guest is bounded by its own deadline; the grace covers thread hand-offs.
            return fut.result(timeout=self.spec.timeout + 5.0)
        except TimeoutError:
            raise GuestTimeout("the shard thread did not answer in time") from None

    def capacity(self) -> int:
        return len(self.shards)

    def idle(self) -> int:
        return sum(1 for s in self.shards if s.instance is not None and not s.slot.busy)

    def close(self) -> None:
        super().close()
        for shard in self.shards:
            if shard.queue is not None:
                shard.queue.put(None)
            elif shard.instance is not None and shard.slot.take("", True):
                inst, shard.instance = shard.instance, None
                shard.slot.give()
                if inst is not None:
                    self._discard(inst)


class ShardedGeneral(Sharded):
    """``sharded`` with a plugin slot (``max_concurrency`` below ``shard_count``) or a thread-bound
    runtime (each shard's calls run on the shard's own thread)."""

    def call(self, handler: str, event: dict[str, Any], blocking: bool = True, deadline: float | None = None) -> Any:
        limited = self._limited
        tenant = event.get("tenant", "")
        if limited and not self.slots.take(tenant, not blocking):
            self._no_slot(handler, blocking, deadline, tenant)
        try:
            shard = self.shards[self.shard_for(event)]
            if not shard.slot.take(tenant, not blocking):
                self._wait_shard(shard, event, blocking, deadline, tenant)
        except BaseException:
            if limited:
                self.slots.give(tenant)
            raise
        if self.closed:  # a thread-bound shard's thread has stopped: nothing would run the call
            shard.slot.give(tenant)
            if limited:
                self.slots.give(tenant)
            raise self._closed(handler)
        try:
            if self._thread_bound:
                return self._on_shard_thread(shard, lambda: self._run(shard, handler, event, deadline))
            return self._run(shard, handler, event, deadline)
        except GuestError as exc:
            raise self._failed(handler, exc) from None
        finally:
            shard.slot.give(tenant)
            if limited:
                self.slots.give(tenant)
            next(self._calls)


def shard_key(event: dict[str, Any]) -> Any:
    """What picks an event's shard: its sender's tenant and its session (two tenants' "room-1" are
    two keys, so neither's calls queue behind the other's or share its ordering), else its id."""
    session = event.get("session")
    if session:
        tenant = event.get("tenant")
        return f"{tenant}/{session}" if tenant else session
    return event.get("id") or ""


def _shard_loop(jobs: queue.SimpleQueue) -> None:
    # A thread-bound runtime's shard: every call of the shard runs here, in order.
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, fut = job
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)


#: Each strategy's class by its name; the names are those of runtimes.registry.STRATEGIES.
IMPLEMENTATIONS: dict[str, type[Strategy]] = {cls.name: cls for cls in (PerRequest, Pooled, Sharded)}


def make_strategy(spec: PluginSpec, compiled: Compiled) -> Strategy:
    """The strategy object for ``spec.strategy`` (and the runtime's thread rules)."""
    if spec.strategy == "pooled" and compiled.thread_bound:
        return PooledPerThread(spec, compiled)
    if spec.strategy == "sharded" and (compiled.thread_bound or spec.max_concurrency < spec.shard_count):
        return ShardedGeneral(spec, compiled)
    return IMPLEMENTATIONS[spec.strategy](spec, compiled)
