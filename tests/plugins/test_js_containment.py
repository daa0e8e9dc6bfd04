"""JS containment (issue 9): one wall-clock deadline per call, kept at every boundary the guest crosses.

Every case runs through the real plugin call path (plugins.loaded.LoadedPlugin) on the real
QuickJS-NG binding, for each strategy: per_request, pooled (per-thread Contexts) and sharded
(a shard thread per shard). A runaway must end with ``timeout`` no earlier than its budget and
within twice its budget plus 0.5 s.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterator

import pytest
import quickjs

from execapp.engine import HandlerTimeout
from plugins.errors import CompileError, PluginInvalid
from plugins.loaded import LoadedPlugin, validate
from plugins.runtimes import js_deadline
from plugins.runtimes.js import JsCompiled
from plugins.spec import PluginSpec, Quotas
from tests.conftest import LIVENESS

STRATEGIES = ["per_request", "pooled", "sharded"]
BUDGET = 0.3

RUNAWAYS = r"""
// issue 9: the job queue never empties
async function await_loop(e) { while (true) await null; }
// the same through a promise chain, from a handler that returns a promise that never settles
function chain_loop(e) { const spin = () => { Promise.resolve().then(spin); }; spin(); return new Promise(() => {}); }
// a busy loop inside a promise job
async function job_loop(e) { await null; while (true) {} }
function busy_loop(e) { while (true) {} }
// built-ins that catch the interrupt and let their caller run on: the Promise constructor around
// its executor, nested (the interrupt lands in the innermost loop nearly every time) ...
function swallow_nested(e) {
  const p = () => new Promise(() => { for (;;) new Promise(() => { for (;;) {} }); });
  for (;;) p();
}
// ... an async function's body, which turns it into a rejected promise ...
function swallow_async(e) {
  const inner = async () => { for (;;) {} }, outer = async () => { for (;;) inner(); };
  for (;;) outer();
}
// ... and once, then a reply past the deadline
function swallow_once(e) { new Promise(() => { for (;;) {} }); return "survived"; }
// each iteration is one expensive built-in call: QuickJS polls for interrupts every ~10,000 (54 s)
function builtin_loop(e) { let s = "x".repeat(1 << 20); while (true) s = JSON.stringify({s}).slice(0, 1 << 20); }
// uses 80% of its budget, checking the wall clock: must never be stopped
function legit(e) {
  const until = Date.now() + Number(e.args);
  let n = 0;
  while (Date.now() < until) n++;
  return "done " + n;
}
// queues 8,000 host calls at once, then awaits them all
async function kv_flood(e) {
  const pending = [];
  for (let i = 0; i < 8000; i++) pending.push(kv_set("k" + i, "v"));
  await Promise.all(pending);
  return "wrote everything";
}
"""


def make(strategy: str, code: str = RUNAWAYS, timeout: float = BUDGET, **options: Any) -> LoadedPlugin:
    spec = PluginSpec(name=f"jsc-{strategy}", runtime="js", code=code, strategy=strategy, timeout=timeout,
                      pool_size=2, shard_count=2, max_concurrency=4, **options)
    return LoadedPlugin(spec)


def event(args: str = "") -> dict:
    return {"id": "e1", "type": "message", "text": f"/x {args}", "args": args, "data": {}, "session": "s1"}


class Worker:
    """One long-lived daemon thread that makes the calls (like a pool thread, so per-thread Contexts
    are reused): a guest that escapes its budget fails the test at once instead of hanging it (or,
    the thread being a daemon, the interpreter's exit)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="js-containment", daemon=True).start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def run(self, fn: Callable[[], Any], budget: float) -> Any:
        future: Future = Future()
        self._jobs.put((fn, future))
        limit = 2 * budget + 0.5 + LIVENESS
        try:
            return future.result(timeout=limit)
        except FutureTimeout:
            pytest.fail(f"the call was still running {limit:g} s later (budget {budget:g} s)")

    def close(self) -> None:
        self._jobs.put(None)


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


def timed_timeout(worker: Worker, plugin: LoadedPlugin, handler: str, args: str = "") -> float:
    """Seconds until ``handler`` failed with the engine's HandlerTimeout (code ``timeout``)."""
    started = time.monotonic()
    with pytest.raises(HandlerTimeout) as info:
        worker.run(lambda: plugin.call(handler, event(args)), plugin.spec.timeout)
    took = time.monotonic() - started
    assert info.value.code == "timeout", info.value
    return took


@pytest.fixture(params=STRATEGIES)
def plugin(request: pytest.FixtureRequest) -> Iterator[LoadedPlugin]:
    loaded = make(request.param)
    yield loaded
    loaded.close()


def test_wall_clock_deadlines_are_available() -> None:
    # Without them every test below would pass or fail on the binding's CPU-time limit instead.
    assert js_deadline.available()


@pytest.mark.parametrize("handler", ["await_loop", "chain_loop", "job_loop"])
def test_an_async_guest_whose_jobs_never_end_times_out(worker: Worker, plugin: LoadedPlugin, handler: str) -> None:
    took = timed_timeout(worker, plugin, handler)
    assert BUDGET <= took <= 2 * BUDGET + 0.5
    assert worker.run(lambda: plugin.call("legit", event("1")), BUDGET).startswith("done")  # it serves on


@pytest.mark.parametrize("handler", ["busy_loop", "builtin_loop"])
def test_a_busy_loop_times_out_within_its_budget(worker: Worker, plugin: LoadedPlugin, handler: str) -> None:
    took = timed_timeout(worker, plugin, handler)
    assert BUDGET <= took <= 2 * BUDGET + 0.5


@pytest.mark.parametrize("handler", ["swallow_nested", "swallow_async", "swallow_once"])
def test_a_guest_whose_interrupt_a_built_in_catches_still_times_out(worker: Worker, plugin: LoadedPlugin,
                                                                    handler: str) -> None:
    took = timed_timeout(worker, plugin, handler)
    assert BUDGET <= took <= 2 * BUDGET + 0.5
    assert worker.run(lambda: plugin.call("legit", event("1")), BUDGET).startswith("done")  # it serves on


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_queued_host_calls_stop_at_the_deadline(worker: Worker, strategy: str) -> None:
    """8,000 kv_set calls queued at once took 15.3 s under a 1 s budget and returned success."""
    from plugins.models import KVEntry

    # Quotas high enough that the deadline, not the KV writes quota, is what ends the flood.
    kv = make(strategy, permissions=frozenset({"kv"}), quotas=Quotas(kv_writes=100_000))
    try:
        took = timed_timeout(worker, kv, "kv_flood")
    finally:
        kv.close()
    # The deadline is checked before every host call: at most one call in flight runs past it.
    assert BUDGET <= took <= BUDGET + 0.5
    assert KVEntry.objects.filter(plugin=kv.spec.name).count() < 8000


class CpuBurners:
    """Threads that burn CPU outside the GIL (QuickJS loops) on every core, until stopped."""

    def __init__(self, n: int = (os.cpu_count() or 1) + 1) -> None:
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._burn, daemon=True) for _ in range(n)]

    def _burn(self) -> None:
        ctx = quickjs.Context()
        ctx.set_time_limit(-1)
        ctx.eval("function burn() { const until = Date.now() + 50; while (Date.now() < until) {} }")
        burn = ctx.get("burn")
        while not self._stop.is_set():
            burn()

    def __enter__(self) -> "CpuBurners":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self.threads:
            t.join()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_busy_neighbour_threads_do_not_shorten_a_budget(worker: Worker, strategy: str) -> None:
    """The binding's own limit counts process CPU time: 0.51 s of a 1 s budget under load."""
    plugin = make(strategy, timeout=1.0)
    try:
        with CpuBurners():
            cpu0, started = time.process_time(), time.monotonic()
            reply = worker.run(lambda: plugin.call("legit", event("800")), 1.0)  # 0.8 s of the 1 s budget
            legit_took, legit_cpu = time.monotonic() - started, time.process_time() - cpu0
            took = timed_timeout(worker, plugin, "busy_loop")
        # "done" is the rule: the guest's 0.8 s ran to its end inside the 1 s budget while the
        # neighbours burned CPU. No upper bound on the wall time: under load, getting the GIL
        # back after the guest returned can take longer than the budget's remaining 0.2 s.
        assert reply.startswith("done"), reply
        assert legit_took >= 0.79  # the guest's 0.8 s is counted in Date.now()'s whole milliseconds
        assert 1.0 <= took <= 2 * 1.0 + 0.5
        # Shown with -s: above 1 s of process CPU, a CPU-time limit would have stopped "legit".
        print(f"\n{strategy}: legit took {legit_took:.3f} s wall, {legit_cpu:.2f} s process CPU; loop {took:.3f} s")
    finally:
        plugin.close()


def test_a_runaway_top_level_is_refused_at_save_with_timeout() -> None:
    spec = PluginSpec(name="jsc-top", runtime="js", code="while (true) {}\nfunction f(e) { return 1; }",
                      timeout=BUDGET)
    started = time.monotonic()
    with pytest.raises(PluginInvalid) as info:
        validate(spec, ["f"])
    took = time.monotonic() - started
    assert info.value.code == "timeout" and "timeout" in str(info.value), info.value
    assert BUDGET <= took <= 2 * BUDGET + 0.5
    with pytest.raises(CompileError) as compiled:
        JsCompiled(spec)
    assert compiled.value.code == "timeout"


def test_a_per_request_top_level_spends_the_calls_own_budget(worker: Worker) -> None:
    """A fresh Context's top level runs within the call's deadline, not a budget of its own."""
    code = ("const until = Date.now() + 600; while (Date.now() < until) {}\n"
            "function busy_loop(e) { while (true) {} }")
    plugin = make("per_request", code=code, timeout=1.0)  # the top level passes validation (0.6 of 1 s)
    try:
        took = timed_timeout(worker, plugin, "busy_loop")
    finally:
        plugin.close()
    assert 1.0 <= took < 1.0 + 0.4  # top level and call together: not 0.6 + 1.0


def test_a_watchdog_pass_in_progress_finishes_before_the_call_ends() -> None:
    """Slot.end() waits for a pass that read the old deadline: its write cannot hit the next call."""
    ctx = quickjs.Context()
    owner = type("Owner", (), {})()
    slot = js_deadline.register(ctx, owner)
    assert slot is not None
    try:
        slot.flipping = True  # a watchdog pass that has just read this call's deadline
        ended = threading.Event()
        threading.Thread(target=lambda: (slot.end(), ended.set()), daemon=True).start()
        assert not ended.wait(0.05)
        slot.flipping = False
        assert ended.wait(5.0)
    finally:
        js_deadline.unregister(slot)


SPARSE = {  # a C loop over `length` polls no interrupt: each of these ran for minutes unguarded
    "join": "a.join(',')", "indexOf": "a.indexOf(1)", "forEach": "a.forEach(x => x)", "sort": "a.sort()",
    "fill": "a.fill(0, 2 ** 31 - 2)", "generic join": "Array.prototype.join.call({length: 2 ** 31})",
    "String()": "String(a)",
}


@pytest.mark.parametrize("case", SPARSE)
def test_a_built_in_walking_a_huge_length_is_refused_not_run_past_the_deadline(worker: Worker, case: str) -> None:
    code = f"function f(e) {{ const a = []; a.length = 2 ** 31; for (;;) {SPARSE[case]}; }}"
    plugin = make("pooled", code=code, timeout=BUDGET)
    try:
        def call() -> Any:
            try:
                return plugin.call("f", event())
            except Exception as exc:  # noqa: BLE001 - the refusal is the result under test
                return exc
        started = time.monotonic()
        failed = worker.run(call, BUDGET)
        assert "RangeError" in str(failed) and "the sandbox allows at most" in str(failed), failed
        assert time.monotonic() - started < BUDGET
        # An ordinary array is untouched.
        plugin2 = make("pooled", code="function f(e) { return [3, 1, 2].sort().join('-') + [5, 6].indexOf(6); }")
        try:
            assert worker.run(lambda: plugin2.call("f", event()), BUDGET) == "1-2-31"
        finally:
            plugin2.close()
    finally:
        plugin.close()
