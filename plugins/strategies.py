"""Instance strategies (design.md §3): per_request, pooled and sharded, for every runtime.

Every acquisition has two modes. ``blocking=False`` is for a handler running inline on the
event loop: it takes a free instance/shard at once or raises PluginBusy, never waits.
``blocking=True`` (a pool thread) waits up to ``wait`` seconds, then raises PluginBusy.
"""
from __future__ import annotations

import queue
import threading
import time
import zlib
from concurrent.futures import Future
from typing import Any, Callable

from .errors import GuestError, GuestTimeout, PluginBusy
from .host import Host
from .runtimes.base import Compiled, Instance
from .spec import PluginSpec


class Slots:
    """A counting limit that also reports busy / waiting and counts waits and refusals.

    The fast path is one C-level lock (threading.Semaphore is pure Python and costs ~2.5 us
    per acquire/release pair here); only a caller that has to wait touches the Condition.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self.busy = 0
        self.waiting = 0
        self.waits_total = 0
        self.refused_total = 0

    def acquire(self, blocking: bool, wait: float) -> bool:
        """Take a slot: at once, or (``blocking``) within ``wait`` seconds. False if none."""
        with self._lock:
            if self.busy < self.capacity:
                self.busy += 1
                return True
            if not blocking:
                self.refused_total += 1
                return False
            self.waiting += 1
            self.waits_total += 1
            deadline = time.monotonic() + max(wait, 0.0)
            try:
                while self.busy >= self.capacity:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self._freed.wait(remaining) and self.busy >= self.capacity:
                        self.refused_total += 1
                        return False
                self.busy += 1
                return True
            finally:
                self.waiting -= 1

    def release(self) -> None:
        with self._lock:
            self.busy -= 1
            if self.waiting:
                self._freed.notify()


def _host(spec: PluginSpec) -> Host:
    # The deadline starts when the guest is about to run, after any wait for a slot.
    return Host(spec, time.monotonic() + spec.timeout)


class Strategy:
    """Base: how instances are made, chosen and reused for one loaded plugin."""

    name = ""

    def __init__(self, spec: PluginSpec, compiled: Compiled) -> None:
        self.spec = spec
        self.compiled = compiled
        self.closed = False
        self._lock = threading.Lock()
        self.busy = 0
        self.waiting = 0
        self.created_total = 0
        self.discarded_total = 0

    def call(self, handler: str, event: dict[str, Any], blocking: bool, wait: float) -> Any:
        raise NotImplementedError

    def capacity(self) -> int:
        raise NotImplementedError

    def idle(self) -> int:
        raise NotImplementedError

    def live(self) -> int:
        """Instances alive now (for leak checks)."""
        return self.created_total - self.discarded_total

    def _new(self) -> Instance:
        inst = self.compiled.new_instance()
        with self._lock:
            self.created_total += 1
        return inst

    def _discard(self, inst: Instance) -> None:
        try:
            inst.close()
        finally:
            with self._lock:
                self.discarded_total += 1

    def _busy(self, delta: int) -> None:
        with self._lock:
            self.busy += delta

    def close(self) -> None:
        self.closed = True


class PerRequest(Strategy):
    """A fresh instance (Lua: a fresh environment on a per-thread runtime) for every call."""

    name = "per_request"

    def call(self, handler: str, event: dict[str, Any], blocking: bool, wait: float) -> Any:
        self._busy(1)
        try:
            return self.compiled.call_isolated(handler, event, _host(self.spec))
        finally:
            self._busy(-1)

    def capacity(self) -> int:
        return self.spec.max_concurrency

    def idle(self) -> int:
        return self.compiled.idle_isolated()

    def live(self) -> int:
        return 0


class Pooled(Strategy):
    """``pool_size`` instances behind a semaphore and a free list; poisoned ones are replaced.

    Thread-bound runtimes (QuickJS) keep each idle instance on the thread that made it: the
    free list is per thread, and the semaphore still bounds how many run at once.
    """

    name = "pooled"

    def __init__(self, spec: PluginSpec, compiled: Compiled) -> None:
        super().__init__(spec, compiled)
        self.slots = Slots(spec.pool_size)
        self._free: list[Instance] = []
        self._local = threading.local()

    def call(self, handler: str, event: dict[str, Any], blocking: bool, wait: float) -> Any:
        if not self.slots.acquire(blocking, wait):
            raise PluginBusy(f"plugin {self.spec.name!r}: all {self.spec.pool_size} pooled instances are busy"
                             + (f" after waiting {wait:g} s" if blocking else "") + "; raise its pool size")
        inst: Instance | None = None
        try:
            inst = self._take()
            result = inst.call(handler, event, _host(self.spec))
        except GuestError as exc:
            if exc.poison and inst is not None:
                self._discard(inst)
                inst = None
            raise
        finally:
            if inst is not None:
                self._give(inst)
            self.slots.release()
        return result

    def _take(self) -> Instance:
        if self.compiled.thread_bound:
            inst = getattr(self._local, "idle", None)
            if inst is not None:
                self._local.idle = None
                return inst
            return self._new()
        try:
            return self._free.pop()  # list.pop is atomic under the GIL
        except IndexError:
            return self._new()

    def _give(self, inst: Instance) -> None:
        if self.closed:
            self._discard(inst)
        elif self.compiled.thread_bound:
            if getattr(self._local, "idle", None) is None:
                self._local.idle = inst
            else:
                self._discard(inst)
        else:
            self._free.append(inst)

    def capacity(self) -> int:
        return self.spec.pool_size

    def idle(self) -> int:
        if self.compiled.thread_bound:
            return max(self.live() - self.slots.busy, 0)
        return len(self._free)

    def close(self) -> None:
        super().close()
        while self._free:
            try:
                self._discard(self._free.pop())
            except IndexError:
                break


class _Shard:
    __slots__ = ("lock", "instance", "queue", "thread")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.instance: Instance | None = None
        self.queue: queue.SimpleQueue | None = None
        self.thread: threading.Thread | None = None


class Sharded(Strategy):
    """``shard_count`` instances; the event's session (else its id) picks one; serial per shard.

    Keeps per-session ordering and warm state. For thread-bound runtimes each shard owns a
    thread that runs its calls (the caller holds the shard's lock while it waits).
    """

    name = "sharded"

    def __init__(self, spec: PluginSpec, compiled: Compiled) -> None:
        super().__init__(spec, compiled)
        self.shards = [_Shard() for _ in range(spec.shard_count)]

    def shard_for(self, event: dict[str, Any]) -> int:
        key = event.get("session") or event.get("id") or ""
        return zlib.crc32(str(key).encode()) % len(self.shards)

    def call(self, handler: str, event: dict[str, Any], blocking: bool, wait: float) -> Any:
        index = self.shard_for(event)
        shard = self.shards[index]
        got = shard.lock.acquire(blocking=False)
        if not got and blocking:
            with self._lock:
                self.waiting += 1
            try:
                got = shard.lock.acquire(timeout=max(wait, 0.0))
            finally:
                with self._lock:
                    self.waiting -= 1
        if not got:
            raise PluginBusy(f"plugin {self.spec.name!r}: shard {index} is busy with an earlier event of the same "
                             "session" + (f" after waiting {wait:g} s" if blocking else ""))
        self._busy(1)
        try:
            if self.compiled.thread_bound:
                return self._on_shard_thread(shard, lambda: self._run(shard, handler, event))
            return self._run(shard, handler, event)
        finally:
            self._busy(-1)
            shard.lock.release()

    def _run(self, shard: _Shard, handler: str, event: dict[str, Any]) -> Any:
        if shard.instance is None:
            shard.instance = self._new()
        try:
            return shard.instance.call(handler, event, _host(self.spec))
        except GuestError as exc:
            if exc.poison:
                inst, shard.instance = shard.instance, None
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
        return sum(1 for s in self.shards if s.instance is not None and not s.lock.locked())

    def close(self) -> None:
        super().close()
        for shard in self.shards:
            if shard.queue is not None:
                shard.queue.put(None)
            elif shard.instance is not None and shard.lock.acquire(blocking=False):
                inst, shard.instance = shard.instance, None
                shard.lock.release()
                if inst is not None:
                    self._discard(inst)


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


STRATEGIES: dict[str, type[Strategy]] = {"per_request": PerRequest, "pooled": Pooled, "sharded": Sharded}


def make_strategy(spec: PluginSpec, compiled: Compiled) -> Strategy:
    """The strategy object for ``spec.strategy``."""
    return STRATEGIES[spec.strategy](spec, compiled)
