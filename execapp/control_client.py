"""The command side of the control protocol: send a request to the workers and collect their answers."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
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

    ``timeout`` is the drain's own timeout (passed to the workers); ``wait`` bounds how long to
    collect answers (default: the drain timeout plus a margin, 3 s for the other ops). With a
    registry the collection ends as soon as every live worker answered; without one it lasts
    until ``wait`` runs out (every answer is kept).
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; use one of {', '.join(OPS)}")
    expected: set[str] | None = None
    gone: dict[str, int] = {}
    live: dict[str, dict[str, Any]] = {}
    silent: dict[str, float] = {}
    if registry is not None:
        live = await asyncio.to_thread(registry.live)
        # A worker that stopped beating a moment ago (its event loop stalled, its Redis connection
        # lost while this command's works) may still be serving: before, it was simply not asked,
        # and a drain reported every worker drained (exit 0) while it took events.
        stale = await asyncio.to_thread(registry.silent, float(conf.get("WORKER_DROP_SECONDS")))
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
    if wait is None:
        wait = (timeout or 0.0) + ANSWER_MARGIN_SECONDS if op == "drain" else ANSWER_MARGIN_SECONDS
    if expected is not None and not expected:  # nobody is registered: give stragglers the margin only
        wait = min(wait, ANSWER_MARGIN_SECONDS)
    result = ControlResult(op, expected=sorted(expected) if expected is not None else None, gone=gone,
                           silent={wid: age for wid, age in silent.items() if expected is None or wid in expected})
    started = time.monotonic()
    deadline = started + wait
    reply_to = await layer.new_channel()
    rid = uuid.uuid4().hex
    await layer.group_send(CONTROL_GROUP, {"type": REQUEST, "op": op, "request": rid,
                                           "reply_to": reply_to, "worker": worker, "timeout": timeout})
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
