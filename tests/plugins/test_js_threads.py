"""JS Contexts change threads between calls (issue 14): one call at a time, the stack checked on the caller's thread.

QuickJS ties a runtime to a thread only through its stack top, which the binding moves to the
calling thread at every entry into JS; so pooled JS shares a free list and sharded JS runs on
the caller's thread (no shard thread hop). What must still hold: a second call inside a
running Context is refused, QuickJS's stack limit works on whichever thread calls, and a
runtime that does declare itself thread-bound still gets per-thread instances and shard threads.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from plugins.errors import GuestError
from plugins.loaded import LoadedPlugin
from plugins.runtimes import js, js_deadline
from plugins.spec import PluginSpec
from tests.conftest import wait_until

from .toy_runtime import ToyCompiled

CODE = """
function where(e) { return "ok " + e.args; }
function depth(e) { const f = (n) => n ? 1 + f(n - 1) : 0; return String(f(Number(e.args))); }
async function nap(e) { await sleep(Number(e.args)); return "napped"; }
"""


def spec(strategy: str = "pooled", **limits: Any) -> PluginSpec:
    options = {"timeout": 2.0, "pool_size": 2, "shard_count": 2, "max_concurrency": 8,
               "permissions": frozenset({"sleep"}), **limits}
    return PluginSpec(name="t-threads", runtime="js", code=CODE, strategy=strategy, **options)


def event(args: str = "", session: str | None = "s1") -> dict:
    return {"id": "e1", "type": "message", "text": f"/x {args}", "data": {}, "session": session, "args": args}


def on_thread(fn: Any) -> Any:
    """``fn()`` on a new thread; its result, or the exception it raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def test_a_context_made_on_one_thread_runs_calls_and_stops_deep_recursion_on_others():
    inst = js.JsInstance(js.JsCompiled(spec()))
    try:
        far = time.monotonic() + 60
        assert on_thread(lambda: inst.call("where", event("a"), far)) == "ok a"
        # The stack limit is measured from the calling thread's stack: a moderate recursion is
        # not a false overflow there, and a runaway one is stopped (an error, not a crash).
        assert on_thread(lambda: inst.call("depth", event("200"), far)) == "200"
        err = on_thread(lambda: inst.call("depth", event("10000000"), far))
        assert isinstance(err, GuestError) and "stack" in str(err).lower()
        fresh = js.JsInstance(js.JsCompiled(spec()))
        try:
            assert on_thread(lambda: fresh.call("depth", event("200"), far)) == "200"
            assert fresh.call("where", event("b"), far) == "ok b"  # and back on the thread that made it
        finally:
            fresh.close()
    finally:
        inst.close()


def test_a_second_call_into_a_running_context_is_refused_and_the_first_finishes():
    inst = js.JsInstance(js.JsCompiled(spec()))
    try:
        far = time.monotonic() + 60
        first: list[Any] = []
        napping = threading.Thread(target=lambda: first.append(inst.call("nap", event("300"), far)))
        napping.start()
        # The first call is inside the Context (its watchdog deadline is set) and waits in host sleep.
        assert wait_until(lambda: inst._slot is not None and inst._slot.deadline != js_deadline.IDLE)
        with pytest.raises(GuestError) as info:
            inst.call("where", event("x"), far)
        assert "second call" in str(info.value) and not info.value.poison
        napping.join()
        assert first == ["napped"]
        assert inst.call("where", event("y"), far) == "ok y"  # free again
    finally:
        inst.close()


@pytest.mark.parametrize("strategy", ["pooled", "sharded"])
def test_pooled_and_sharded_js_run_on_the_callers_thread_and_keep_warm_instances(strategy: str):
    plugin = LoadedPlugin(spec(strategy))
    try:
        before = threading.active_count()
        results = [on_thread(lambda: plugin.call("where", event("z"))) for _ in range(4)]
        assert results == ["ok z"] * 4
        assert threading.active_count() == before  # no shard thread was started
        assert plugin.strategy.live() == 1  # one Context served calls from four threads
        if strategy == "sharded":
            assert all(shard.thread is None for shard in plugin.strategy.shards)  # type: ignore[attr-defined]
    finally:
        plugin.close()


class ThreadBoundToy(ToyCompiled):
    """A toy runtime that declares its instances thread-bound, recording where each call runs."""

    thread_bound = True

    def new_instance(self, deadline: float | None = None) -> Any:
        inst = super().new_instance(deadline)
        made_on = threading.get_ident()
        call = inst.call

        def checked(handler: str, ev: dict[str, Any], deadline: float) -> Any:
            if threading.get_ident() != made_on:
                raise GuestError("a thread-bound instance was used off its thread", poison=True)
            return call(handler, ev, deadline)

        inst.call = checked  # type: ignore[method-assign]
        return inst


@pytest.mark.parametrize("strategy", ["pooled", "sharded"])
def test_a_thread_bound_runtime_still_gets_per_thread_instances_and_shard_threads(strategy: str):
    toy = PluginSpec(name="t-bound", runtime="lua", code="greet = hi {args}", strategy=strategy, pool_size=2,
                     shard_count=2, max_concurrency=8)
    plugin = LoadedPlugin(toy, compiled=ThreadBoundToy(toy))
    try:
        results = [on_thread(lambda: plugin.call("greet", event("t"))) for _ in range(3)]
        assert results == ["hi t"] * 3 and plugin.call("greet", event("u")) == "hi u"
        if strategy == "sharded":
            assert any(shard.thread is not None for shard in plugin.strategy.shards)  # type: ignore[attr-defined]
    finally:
        plugin.close()
