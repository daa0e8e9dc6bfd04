"""The command side of the control protocol: send a request to the workers and collect their answers."""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar
from urllib.parse import urlparse

from redis.exceptions import RedisError

from . import conf
from .control import (
    ANSWER,
    CONTROL_GROUP,
    OPS,
    REQUEST,
    ControlUnavailable,
    UnknownWorker,
    new_layer,
    require_shared_layer,
)
from .control_registry import Registry, default_registry, process_gone

#: Extra time a command waits past a drain's own timeout for the answers to travel.
ANSWER_MARGIN_SECONDS = 3.0
#: How often a command waiting for answers looks whether a silent worker's process died meanwhile.
GONE_CHECK_SECONDS = 0.5

T = TypeVar("T")


@dataclass
class ControlResult:
    """The answers to one request, by worker id, and the expected workers that stayed silent."""

    op: str
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    #: Registered workers whose process no longer exists (killed, crashed): not asked, not waited for.
    gone: dict[str, int] = field(default_factory=dict)
    #: Expected workers whose process died while they were asked (killed mid-drain): no answer will come.
    died: dict[str, int] = field(default_factory=dict)
    #: Workers that had stopped beating (within WORKER_DROP_SECONDS) when asked, process not provably
    #: gone: seconds since their last beat. Asked and expected like the others: one that stays
    #: silent is in ``missing``, so no command reports success without knowing what it did.
    silent: dict[str, float] = field(default_factory=dict)
    expected: list[str] | None = None
    waited_seconds: float = 0.0


async def request(op: str, *, layer: Any, registry: Registry | None = None, worker: str | None = None,
                  timeout: float | None = None, wait: float | None = None) -> ControlResult:
    """Send ``op`` to every worker (or to ``worker``) and collect the answers.

    ``timeout`` is the drain's own timeout (passed to the workers); ``wait`` bounds the whole
    request, its registry reads and its send included (default: the drain timeout plus a margin, 3 s
    for the other ops; a Redis step not done by then raises TimeoutError). With a
    registry the collection ends as soon as every live worker answered; without one it lasts
    until ``wait`` runs out (every answer is kept).
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; use one of {', '.join(OPS)}")
    if wait is None:
        wait = (timeout or 0.0) + ANSWER_MARGIN_SECONDS if op == "drain" else ANSWER_MARGIN_SECONDS
    # One deadline for the whole command, its Redis calls before the collection included: on a Redis
    # answering in ~1 s (a slow link, an overloaded server) `execstatus` took 16 s and `drain
    # --timeout 2` 15.5 s, a call at a time, each within its socket timeout.
    started = time.monotonic()
    deadline = started + wait
    expected: set[str] | None = None
    gone: dict[str, int] = {}
    live: dict[str, dict[str, Any]] = {}
    silent: dict[str, float] = {}
    if registry is not None:
        live = await _within(deadline, wait, _on_daemon_thread(registry.live))
        # A worker that stopped beating a moment ago (its event loop stalled, its Redis connection
        # lost while this command's works) may still be serving: before, it was simply not asked,
        # and a drain reported every worker drained (exit 0) while it took events.
        drop = float(conf.get("WORKER_DROP_SECONDS"))
        stale = await _within(deadline, wait, _on_daemon_thread(lambda: registry.silent(drop)))
        for wid, (age, info) in stale.items():
            if wid not in live and not process_gone(info):
                live[wid], silent[wid] = info, round(age, 1)
        # A worker killed a moment ago still looks live for LIVE_SECONDS: on this machine its
        # missing process says so, and nobody waits for it to answer (a drain right after a
        # SIGKILL said "did not answer" and failed, after waiting its whole timeout).
        gone = {wid: info["pid"] for wid, info in live.items() if process_gone(info)}
        if worker is not None and worker in gone:
            raise UnknownWorker(f"worker {worker!r} is gone: its process {gone[worker]} no longer exists; live "
                                f"workers: {', '.join(sorted(set(live) - set(gone))) or 'none'} (run `manage.py "
                                "execstatus`)")
        if worker is not None and worker not in live:
            raise UnknownWorker(f"no live worker {worker!r}; live workers: {', '.join(sorted(live)) or 'none'} "
                                "(run `manage.py execstatus`)")
        expected = {worker} if worker is not None else set(live) - set(gone)
    elif worker is not None:
        expected = {worker}
    if expected is not None and not expected:  # nobody is registered: give stragglers the margin only
        deadline = min(deadline, started + ANSWER_MARGIN_SECONDS)
    result = ControlResult(op, expected=sorted(expected) if expected is not None else None, gone=gone,
                           silent={wid: age for wid, age in silent.items() if expected is None or wid in expected})
    reply_to = await _within(deadline, wait, layer.new_channel())
    rid = uuid.uuid4().hex
    await _within(deadline, wait, layer.group_send(CONTROL_GROUP, {"type": REQUEST, "op": op, "request": rid,
                                                                   "reply_to": reply_to, "worker": worker,
                                                                   "timeout": timeout}))
    receiving: asyncio.Future[dict[str, Any]] | None = None
    try:
        while not (expected and expected <= set(result.answers)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if receiving is None:
                receiving = asyncio.ensure_future(layer.receive(reply_to))
            # One receive, never cancelled between checks: every GONE_CHECK_SECONDS the silent
            # workers' processes are looked at, so one killed while it drains ends the wait for it.
            await asyncio.wait((receiving,), timeout=min(remaining, GONE_CHECK_SECONDS))
            if not receiving.done():
                if expected:
                    for wid in sorted(expected - set(result.answers)):
                        if process_gone(live.get(wid) or {}):
                            result.died[wid] = int(live[wid]["pid"])
                            expected.discard(wid)
                    if not expected - set(result.answers):
                        break
                continue
            message, receiving = receiving.result(), None
            if message.get("type") == ANSWER and message.get("request") == rid:
                result.answers[message["worker"]] = message.get("result") or {}
    finally:
        if receiving is not None:
            receiving.cancel()
    result.missing = sorted((expected or set()) - set(result.answers))
    result.waited_seconds = round(time.monotonic() - started, 3)
    return result


async def _within(deadline: float, wait: float, step: Awaitable[T]) -> T:
    """``step`` if it ends by ``deadline``; else TimeoutError (the command's ``control_unavailable``)."""
    try:
        return await asyncio.wait_for(step, max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise TimeoutError(f"Redis did not answer within the command's {wait:.3g} s") from None


def _on_daemon_thread(fn: Callable[[], T]) -> "asyncio.Future[T]":
    """``fn()`` (a blocking registry read) on a daemon thread of its own: a command that stops
    waiting for it at its deadline neither waits for it at exit (asyncio.run joins its default
    executor's threads, here held up to the registry client's socket timeout) nor keeps it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def run() -> None:
        try:
            value, error = fn(), None
        except BaseException as exc:  # handed to the waiting coroutine
            value, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the command's loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name="execapp-control-registry", daemon=True).start()
    return future


def request_sync(op: str, *, worker: str | None = None, timeout: float | None = None,
                 wait: float | None = None) -> ControlResult:
    """``request`` from synchronous code (the management commands), on the settings' layer and registry.

    Raises ControlUnavailable (code ``control_unavailable``, with ``reason``) when the layer
    cannot carry the request: in memory, or its Redis cannot be reached (never a raw redis
    traceback)."""
    require_shared_layer()
    layer = new_layer()
    try:
        return asyncio.run(request(op, layer=layer, registry=default_registry(), worker=worker, timeout=timeout,
                                   wait=wait))
    except (RedisError, OSError, TimeoutError) as exc:  # ConnectionError, a timeout: the layer is unreachable
        raise layer_unreachable(exc) from exc


def layer_unreachable(exc: BaseException) -> ControlUnavailable:
    """The ControlUnavailable for a channel layer whose Redis does not answer, naming where and why."""
    url = conf.redis_url()
    parsed = urlparse(url)
    where = f"{parsed.hostname}:{parsed.port or 6379}" if parsed.hostname else (url or "the channel layer")
    reason = f"{type(exc).__name__}: {exc}".strip()
    return ControlUnavailable(
        f"the channel layer's Redis at {where} cannot be reached ({reason}); no worker can be asked now. Check that "
        "Redis is up and that this command has the server's REDIS_URL; the workers re-join by themselves within "
        "EXECAPP['LAYER_CHECK_SECONDS'] of Redis coming back (docs/operations.md, \"When Redis goes away\")",
        reason=f"redis at {where} unreachable: {reason}")
