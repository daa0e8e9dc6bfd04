"""Engine benchmarks (issue 2 item 5): inline dispatch overhead, pool hand-off, mixed workload.

Every figure is a median over repetitions and is compared with a baseline measured in the
same run (the machine is a shared 2-core VM: absolute numbers move by up to ~2x between runs).

1. Inline dispatch overhead: ``Engine.process_event`` with one trivial matched handler whose
   profile is demoted (so it runs inline) against calling the handler directly, in this
   thread's CPU time: with a prebuilt event, with an Event built per call, and as in a worker
   (a new Event, a reply, an on_outcome callback and the watchdog's inline slot). Overheads are
   medians of per-repetition differences from the direct call. The full run adds the same
   overheads in instructions (valgrind's callgrind, bench/callgrind_hot_path.py): the figure
   that does not move with the neighbours' load.
2. Pool hand-off: ``ExecPool`` submit-to-completion round trip and pipelined throughput
   against ``concurrent.futures.ThreadPoolExecutor`` (same worker count, same trivial task,
   same completion signal); and ExecPool with ``idle_seconds=0`` (a thread start per task)
   against the default linger, which is what justifies the linger.
3. Mixed workload inside one asyncio event loop, the shape of an ASGI worker: 90% fast
   handlers (50 us of CPU: calibrated Python work) and 10% slow ones (a 200 ms blocking wait), arriving from another
   process over a socket (as network traffic would: no GIL needed to arrive) at a steady rate
   and above capacity. Fast-event latency (arrival -> completion seen on the loop) p50/p99 and
   fast-event throughput for: adaptive (the Engine, profiles trained: fast demoted, slow
   promoted, via start_event, the loop caller's path) under each overflow policy,
   always-inline, always-pool, and asgiref ``sync_to_async`` (thread_sensitive True and
   False); bench_dispatch.py adds the minimal dispatcher of issue 14 on the same harness.

   Bounded run time: arrivals last ``window`` seconds; at ``window + grace`` every handler
   turns into a no-op so a collapsed strategy drains at once, and a fast event not done by
   then counts with latency ``deadline - arrival``: a lower bound, marked ">=" in the table.
"""
from __future__ import annotations

import asyncio
import gc
import math
import queue
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter
from time import thread_time as _thread_time
from typing import Any, Awaitable, Callable

from bench.common import cpu_per_call_us, interleaved, median, percentile, row
from execapp.engine import Engine, Event, ExecPool, ExecProfile

# -- 1. inline dispatch overhead -----------------------------------------------------------------


def bench_inline(quick: bool) -> list[dict[str, Any]]:
    """process_event with one demoted trivial handler vs calling that handler directly."""
    n, reps = (20_000, 5) if quick else (50_000, 9)

    def handler(ctx: Any) -> None:
        return None

    engine = Engine(pool_enabled=True)
    m = engine.on_command("ping", handler)
    m.profile.restore("demoted", [0.00001] * m.profile.window)
    event = Event(text="/ping")
    # As in a worker: the protocol's shape (a new Event per frame, an on_outcome, a 'pong' reply)
    # with the watchdog's inline slot set.
    worker = Engine(pool_enabled=True)
    r = worker.on_command("ping", lambda ctx: "pong")
    r.profile.restore("demoted", [0.00001] * r.profile.window)
    worker.set_inline_slot(bytearray(64))
    sink: list[Any] = []
    pe, pe_sync, pe_worker = engine.process_event, engine.process_event_sync, worker.process_event

    def direct() -> None:
        handler(None)

    def as_in_worker() -> None:
        pe_worker(Event("message", "/ping", None, None, None, 5), sink.append)
        sink.clear()

    cases: dict[str, Callable[[], float]] = {
        "direct": lambda: cpu_per_call_us(direct, n),
        "process_event": lambda: cpu_per_call_us(lambda: pe(event), n),
        "event": lambda: cpu_per_call_us(lambda: Event(text="/ping"), n),
        "event+process_event": lambda: cpu_per_call_us(lambda: pe(Event(text="/ping")), n),
        "process_event_sync": lambda: cpu_per_call_us(lambda: pe_sync(event), n),
        "worker": lambda: cpu_per_call_us(as_in_worker, n),
    }
    # Each repetition measures every case back to back, so a burst of the neighbours' load hits
    # one repetition's cases alike: an overhead is the median of the per-repetition differences
    # from the direct call (not the difference of two medians taken from different moments).
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            runs[name].append(fn())
    if m.profile.should_pool().value != "sync" or r.profile.should_pool().value != "sync":
        raise RuntimeError("the benchmark handler left the inline path")
    results = {name: median(values) for name, values in runs.items()}
    base = results["direct"]

    def over(case: str) -> float:
        return median(a - b for a, b in zip(runs[case], runs["direct"]))

    overhead, built = over("process_event"), over("event+process_event")
    bench = "inline dispatch"
    rows = [
        row(bench, "direct handler call (baseline, CPU time)", base, "us"),
        row(bench, "process_event, 1 inline handler, prebuilt event", results["process_event"], "us",
            baseline="direct call", ratio=results["process_event"] / base),
        row(bench, "  overhead per event, prebuilt event", overhead, "us", target="<= 1.5 us", ok=overhead <= 1.5),
        row(bench, "Event(text=...) alone", results["event"], "us"),
        row(bench, "  overhead per event, Event built + process_event", built, "us", target="<= 3 us",
            ok=built <= 3.0),
        row(bench, "process_event_sync, 1 handler", results["process_event_sync"], "us", baseline="direct call",
            ratio=results["process_event_sync"] / base),
        row(bench, "as in a worker: Event + 'pong' reply + on_outcome + watchdog slot", results["worker"], "us",
            baseline="direct call", ratio=results["worker"] / base),
    ]
    if not quick:
        rows += _inline_instructions(base)
    return rows


def _inline_instructions(direct_us: float) -> list[dict[str, Any]]:
    """The same overheads in instructions (bench/callgrind_hot_path.py): repeatable to well under
    1% where CPU time moves 2-4x with the neighbours' load. Converted to microseconds at the
    direct call's instructions per microsecond in this run: that rate moves with the load as
    the CPU times do, so the figure is this run's speed applied to a count that does not move.
    The engine's code retires fewer instructions per ns than the bare call (~12 against ~15
    on a quiet machine), so the conversion reads ~20% low: the CPU-time rows stay the measure
    of record. Skipped (no rows) without valgrind."""
    if shutil.which("valgrind") is None:
        print("    inline dispatch: valgrind not installed, no instruction counts", file=sys.stderr)
        return []
    from bench.callgrind_hot_path import per_call

    counts = {case: per_call(case) for case in ("direct", "process_event", "event+process_event", "worker")}
    rate = counts["direct"] / direct_us  # instructions per us of CPU in this run
    bench = "inline dispatch"
    rows = [row(bench, "instructions: direct handler call (callgrind, baseline)", counts["direct"], "instr")]
    for case, label, target in (("process_event", "prebuilt event", 1.5), ("event+process_event", "Event built", 3.0),
                                ("worker", "as in a worker", None)):
        extra = counts[case] - counts["direct"]
        rows.append(row(bench, f"instructions: overhead per event, {label}", extra, "instr",
                        baseline="direct call", ratio=counts[case] / counts["direct"]))
        rows.append(row(bench, f"  the same in us at this run's direct-call rate ({rate:.0f} instr/us)",
                        extra / rate, "us", target="" if target is None else f"<= {target:g} us",
                        ok=None if target is None else extra / rate <= target))
    return rows


# -- 2. pool hand-off --------------------------------------------------------------------------------


def _round_trips_us(submits: dict[str, Callable[[Callable[[], None]], Any]], n: int, gap: float = 0.0
                    ) -> dict[str, list[float]]:
    """Microseconds from submit to the task's completion being seen by the submitter, per trip.

    The contenders alternate one round trip at a time (A, B, A, B, ...), so a burst of load
    from the machine's other tenants hits them alike; ``gap`` seconds pass between trips."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    put = done.put

    def task() -> None:
        put(None)

    samples: dict[str, list[float]] = {name: [] for name in submits}
    for _ in range(n):
        for name, submit in submits.items():
            start = perf_counter()
            if submit(task) is False:
                raise RuntimeError("pool refused a round-trip task")
            done.get()
            samples[name].append((perf_counter() - start) * 1e6)
            if gap:
                time.sleep(gap)
    return samples


def _paired(samples: dict[str, list[float]], base: str, other: str) -> tuple[float, float, float]:
    """(median of base, median of other, median of the per-pair ratios other/base).

    Each pair ran back to back, so its ratio is taken under the same machine load: the
    median ratio is far steadier on a shared VM than the ratio of two medians."""
    ratios = [o / b for b, o in zip(samples[base], samples[other])]
    return median(samples[base]), median(samples[other]), median(ratios)


def _pipelined_us(submit: Callable[[Callable[[], None]], Any], n: int) -> float:
    """Microseconds per task when ``n`` tasks are submitted back to back and then awaited."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    put = done.put

    def task() -> None:
        put(None)

    start = perf_counter()
    for _ in range(n):
        if submit(task) is False:
            raise RuntimeError("pool refused a pipelined task")
    for _ in range(n):
        done.get()
    return (perf_counter() - start) / n * 1e6


def bench_pool(quick: bool) -> list[dict[str, Any]]:
    """ExecPool vs ThreadPoolExecutor, and ExecPool's linger vs no linger."""
    reps = 3 if quick else 7
    n_rt, n_pipe, n_cold = (400, 2000, 40) if quick else (800, 5000, 60)
    workers = 64  # the default POOL_MAX_WORKERS, for both pools
    tpe = ThreadPoolExecutor(max_workers=workers)
    pool = ExecPool(workers, queue_size=n_pipe)  # room for the whole pipelined batch, as TPE's queue
    cold = ExecPool(workers, queue_size=n_pipe, idle_seconds=0.0)
    tpe2, pool2 = ThreadPoolExecutor(max_workers=2), ExecPool(2, queue_size=n_pipe)
    try:
        for submit in (tpe.submit, pool.try_submit):  # warm both: threads exist before timing
            _pipelined_us(submit, 200)
        _round_trips_us({"tpe": tpe.submit, "pool": pool.try_submit}, 100)
        rt = _paired(_round_trips_us({"tpe": tpe.submit, "pool": pool.try_submit}, n_rt * reps), "tpe", "pool")
        # No linger: every round trip starts a thread (and the previous one may still be exiting).
        cold_rt = _paired(_round_trips_us({"linger": pool.try_submit, "cold": cold.try_submit}, n_cold * reps),
                          "linger", "cold")
        pipe = interleaved({
            "tpe": lambda: _pipelined_us(tpe.submit, n_pipe),
            "pool": lambda: _pipelined_us(pool.try_submit, n_pipe),
        }, reps)
        # Bursty arrivals: one task every 2 ms. With no linger each one starts a thread.
        gap = _paired(_round_trips_us({"linger": pool.try_submit, "cold": cold.try_submit}, n_cold * reps,
                                      gap=0.002), "linger", "cold")
        # Two workers each: the round trip without thread starts (no token is ever free while
        # no worker is idle), which isolates the hand-off itself from the 64-thread ramp.
        rt2 = _paired(_round_trips_us({"tpe": tpe2.submit, "pool": pool2.try_submit}, n_rt * reps), "tpe", "pool")
    finally:
        tpe.shutdown(wait=True)
        tpe2.shutdown(wait=True)
        for p in (pool, cold, pool2):
            p.drain(timeout=5)
    bench = "pool hand-off"
    return [
        row(bench, "ThreadPoolExecutor round trip (baseline)", rt[0], "us"),
        row(bench, "ExecPool round trip", rt[1], "us", baseline="ThreadPoolExecutor (paired)", ratio=rt[2],
            target="<= 1.0x", ok=rt[2] <= 1.0),
        row(bench, "ThreadPoolExecutor round trip, 2 workers (baseline)", rt2[0], "us"),
        row(bench, "ExecPool round trip, 2 workers", rt2[1], "us", baseline="ThreadPoolExecutor 2 workers (paired)",
            ratio=rt2[2]),
        row(bench, "ThreadPoolExecutor pipelined, per task (baseline)", pipe["tpe"], "us"),
        row(bench, "ExecPool pipelined, per task", pipe["pool"], "us", baseline="ThreadPoolExecutor",
            ratio=pipe["pool"] / pipe["tpe"], target="<= 1.0x", ok=pipe["pool"] <= pipe["tpe"]),
        row(bench, "ExecPool round trip, linger 2 s (baseline)", cold_rt[0], "us"),
        row(bench, "ExecPool round trip, idle_seconds=0", cold_rt[1], "us", baseline="linger 2 s (paired)",
            ratio=cold_rt[2]),
        row(bench, "ExecPool, 1 task / 2 ms, linger 2 s (baseline)", gap[0], "us"),
        row(bench, "ExecPool, 1 task / 2 ms, idle_seconds=0", gap[1], "us", baseline="linger 2 s (paired)",
            ratio=gap[2]),
    ]


# -- 3. the mixed workload in one event loop ---------------------------------------------------------

FAST_CPU = 50e-6  # a fast handler: 50 us of CPU
SLOW_WAIT = 0.200  # a slow handler: a 200 ms blocking wait (the stand-in for an external API)
SLOW_EVERY = 10  # 10% of events are slow


class _Deadline:
    """After ``at`` every handler is a no-op, so a collapsed strategy drains at once."""

    at = math.inf


def _work(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def _calibrate() -> int:
    """Iterations of ``_work`` that take FAST_CPU of this thread's CPU (the fastest of 7 tries)."""
    n = 200_000
    best = math.inf
    for _ in range(7):
        start = _thread_time()
        _work(n)
        best = min(best, _thread_time() - start)
    return max(1, round(n * FAST_CPU / best))


_FAST_WORK: list[int] = []  # calibrated once per process


def fast_handler(ctx: Any = None) -> str:
    """50 us of CPU (holds the GIL): a fixed amount of Python work, calibrated once per process.

    Work, not a clock: a handler preempted by a neighbour's process still does the same work,
    so every strategy pays the same for it and the loop's CPU per event compares across runs;
    and it runs bytecode like a real handler (a busy-wait on a clock is mostly clock calls,
    system calls on this VM, which thrash the caches the dispatch code lives in)."""
    if perf_counter() < _Deadline.at:
        _work(_FAST_WORK[0] if _FAST_WORK else _FAST_WORK.append(_calibrate()) or _FAST_WORK[0])
    return "fast"


def slow_handler(ctx: Any = None) -> str:
    """A 200 ms blocking wait (releases the GIL, like I/O)."""
    if perf_counter() < _Deadline.at:
        time.sleep(SLOW_WAIT)
    return "slow"


# The producer: another process writing one byte per event to a socket at the scheduled times,
# like clients over the network. Event k is due at t0 + k/rate on the shared monotonic clock.
PRODUCER = r"""
import socket, sys, time
fd, t0, rate, n = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
s = socket.socket(fileno=fd)
sent = 0
while sent < n:
    now = time.monotonic()
    due = min(n, int((now - t0) * rate) + 1) if now >= t0 else 0
    if due > sent:
        try:
            s.sendall(b"x" * (due - sent))
        except OSError:  # the benchmark stopped reading (past its deadline)
            break
        sent = due
    nxt = t0 + sent / rate
    delay = nxt - time.monotonic()
    if delay > 0:
        time.sleep(min(delay, 0.01))
s.close()
"""


def _trained_profiles() -> dict[str, dict[str, Any]]:
    """Train one profile per handler by running the real handlers (fast demoted, slow promoted)."""
    _Deadline.at = math.inf
    if not _FAST_WORK:  # calibrated here: inside the first fast run it would count as that run's time
        _FAST_WORK.append(_calibrate())
    engine = Engine(pool_enabled=False)
    fast = engine.on_event("fast", fast_handler)
    slow = engine.on_event("slow", slow_handler)
    for _ in range(fast.profile.window):
        engine.process_event_sync(Event(type="fast"))
    engine.process_event_sync(Event(type="slow"))
    if (fast.profile.state.value, slow.profile.state.value) != ("demoted", "promoted"):
        raise RuntimeError(f"training failed: fast {fast.profile.state}, slow {slow.profile.state}")
    return {"fast": fast.profile.snapshot(), "slow": slow.profile.snapshot()}


Dispatch = Callable[[bool], Awaitable[bool]]  # dispatch(slow) -> ran (False: refused)


class _AlwaysPool(ExecProfile):
    """A profile that never demotes: every run goes to the pool (the always-pool strategy)."""

    def restore(self, state: str, window: list[float], **counters: Any) -> None:
        super().restore(state, window, **counters)
        self.quarantine("always-pool strategy")  # pinned to the pool, whatever it learns


def _make_strategy(name: str, profiles: dict[str, dict[str, Any]]
                   ) -> tuple[Dispatch, Callable[[], None], Callable[[], str]]:
    """(dispatch(slow) -> awaitable done when the handler is done, close(), diagnostics()) for one strategy."""
    if name.startswith("adaptive") or name in ("always-inline", "always-pool"):
        policy = name.split(":", 1)[1] if ":" in name else "wait"
        pool = ExecPool(64, 128)
        engine = Engine(pool=pool, pool_enabled=name != "always-inline", overflow=policy,
                        profile_factory=_AlwaysPool if name == "always-pool" else ExecProfile)
        fast = engine.on_event("fast", fast_handler)
        slow = engine.on_event("slow", slow_handler)
        fast.profile.restore(**profiles["fast"])
        slow.profile.restore(**profiles["slow"])
        # Prebuilt events, as the minimal dispatcher gets a prebuilt "is it slow" (building an
        # Event from a frame is the protocol's cost: "inline dispatch" measures it).
        events = {False: Event(type="fast"), True: Event(type="slow")}
        start = engine.start_event

        async def dispatch(is_slow: bool) -> bool:
            # The loop caller's path: dispatch now; await only a handler waiting for a slot, and
            # the run only when something was pooled.
            run, rest = start(events[is_slow])
            if rest is not None:
                await rest
            if not run.done:
                await run
            return not run.errors  # False: refused by the overflow policy

        def close() -> None:
            pool.drain(timeout=5)

        def diagnostics() -> str:
            c = engine.counts
            return (f"fast handler promotions {fast.profile.promotions}, pooled {c['pooled']}, "
                    f"overloaded {c['overloaded']}, fallbacks {c['fallbacks']}")

        return dispatch, close, diagnostics
    if name == "minimal":
        # The baseline of issue 14: a dispatcher that knows which handler is slow and keeps no
        # books: fast handlers called inline, slow ones run_in_executor on 64 threads.
        executor = ThreadPoolExecutor(max_workers=64)

        async def dispatch(is_slow: bool) -> bool:
            if is_slow:
                await asyncio.get_running_loop().run_in_executor(executor, slow_handler)
            else:
                fast_handler()
            return True

        return dispatch, lambda: executor.shutdown(wait=True), lambda: ""
    if name.startswith("sync_to_async"):
        from asgiref.sync import sync_to_async

        sensitive = name.endswith("thread_sensitive=True")
        fast_async = sync_to_async(fast_handler, thread_sensitive=sensitive)
        slow_async = sync_to_async(slow_handler, thread_sensitive=sensitive)

        async def dispatch(is_slow: bool) -> bool:
            await (slow_async() if is_slow else fast_async())
            return True

        return dispatch, lambda: None, lambda: ""
    raise ValueError(name)


async def _mixed_once(strategy: str, profiles: dict[str, dict[str, Any]], rate: float, window: float,
                      grace: float, slow_every: int = SLOW_EVERY) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    dispatch, close, diagnostics = _make_strategy(strategy, profiles)
    n = int(rate * window)
    t0 = time.monotonic() + 0.15  # producer start-up
    deadline = t0 + window + grace
    _Deadline.at = perf_counter() + (deadline - time.monotonic())
    done_at: dict[int, float] = {}  # fast event k -> when the loop saw it done (monotonic)
    slow_latency: list[float] = []  # slow events that ran: arrival -> done
    slow_refused: list[int] = []
    tasks: set[asyncio.Task] = set()
    received = 0

    # The loop thread's CPU per fast event completed over the middle half of the window: its cost
    # per event whatever share of a core the neighbours left it (events/s under overload moves
    # with that share; this does not). Below saturation it also counts the idle loop's own wake-
    # ups (a few us per event). Taken at the first completions past each boundary (a timer would
    # fire late behind a long ready queue).
    marks: list[tuple[float, int]] = []
    bounds = [t0 + window / 4, t0 + 3 * window / 4]

    async def handle(k: int, is_slow: bool) -> None:
        ran = await dispatch(is_slow)
        if not is_slow:
            if ran:  # a refused fast event is not done: it counts as never completed
                done_at[k] = now = time.monotonic()
                if bounds and now >= bounds[0]:
                    bounds.pop(0)
                    marks.append((time.thread_time(), len(done_at)))
        elif ran:
            slow_latency.append(time.monotonic() - (t0 + k / rate))
        else:
            slow_refused.append(k)

    ours, theirs = socket.socketpair()
    ours.setblocking(False)

    def on_readable() -> None:
        nonlocal received
        try:
            data = ours.recv(65536)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(ours)
            return
        for _ in range(len(data)):
            k = received
            received += 1
            task = loop.create_task(handle(k, slow_every > 0 and k % slow_every == slow_every - 1))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    loop.add_reader(ours, on_readable)
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, str(theirs.fileno()), repr(t0), repr(rate), str(n)],
                                pass_fds=(theirs.fileno(),), stderr=subprocess.DEVNULL)
    theirs.close()
    max_lag = 0.0
    try:
        # Meanwhile, watch the loop itself: how late does a 5 ms sleep wake up?
        while time.monotonic() < deadline:
            before = time.monotonic()
            await asyncio.sleep(0.005)
            max_lag = max(max_lag, time.monotonic() - before - 0.005)
    finally:
        loop.remove_reader(ours)
        ours.close()
        while tasks:  # past the deadline handlers are no-ops: whatever is left ends at once
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*list(tasks), return_exceptions=True)
        producer.wait(timeout=10)
        close()
    latencies = []
    censored = 0
    for k in range(n):
        if slow_every and k % slow_every == slow_every - 1:
            continue
        done = done_at.get(k, math.inf)
        if done > deadline:  # not done in time: its latency is at least "deadline - arrival"
            censored += 1
            done = deadline
        latencies.append(done - (t0 + k / rate))
    n_fast = len(latencies)
    in_window = sum(1 for done in done_at.values() if done <= t0 + window)
    n_slow = n - n_fast
    return {"p50": percentile(latencies, 0.50), "p99": percentile(latencies, 0.99), "censored": censored,
            "n_fast": n_fast, "throughput": in_window / window, "slow_p50": percentile(slow_latency, 0.5),
            "slow_done": len(slow_latency) / n_slow if n_slow else None,
            "slow_refused": len(slow_refused) / n_slow if n_slow else None,
            "max_lag": max_lag, "diagnostics": diagnostics(),
            "cpu_per_fast": ((marks[1][0] - marks[0][0]) / (marks[1][1] - marks[0][1])
                             if len(marks) == 2 and marks[1][1] > marks[0][1] else None)}


def _mixed(strategy: str, profiles: dict[str, dict[str, Any]], rate: float, window: float, grace: float,
           slow_every: int = SLOW_EVERY) -> dict[str, Any]:
    """One run of the mixed workload (``slow_every=0``: fast events only) in a fresh event loop."""
    gc.collect()
    return asyncio.run(_mixed_once(strategy, profiles, rate, window, grace, slow_every))


STEADY_RATE = 2000.0  # events/s: below every capacity of the adaptive engine
# Above capacity: 600 slow/s against 64 threads x 5/s = 320/s, so the pool overflows and the
# overflow policy decides; 5,400 fast/s keep the loop itself about half busy. (8,000/s also
# works on a quiet machine, but with other jobs on the 2 cores the loop itself then saturates
# and the figure measures the neighbours instead of the engine.)
SATURATION_RATE = 6000.0


def bench_mixed(quick: bool) -> list[dict[str, Any]]:
    """The mixed workload: adaptive vs always-inline vs always-pool vs sync_to_async."""
    window, grace, reps = (0.8, 0.4, 1) if quick else (2.0, 0.5, 3)
    profiles = _trained_profiles()
    steady = ["adaptive:wait", "always-inline", "always-pool", "sync_to_async thread_sensitive=True",
              "sync_to_async thread_sensitive=False"]
    saturated = ["adaptive:wait", "adaptive:reject", "adaptive:inline", "always-inline", "always-pool",
                 "sync_to_async thread_sensitive=True", "sync_to_async thread_sensitive=False"]
    # Strategies that collapse are measured once: past the deadline their numbers are lower bounds.
    collapsing = {"always-inline", "sync_to_async thread_sensitive=True", "sync_to_async thread_sensitive=False",
                  "adaptive:inline"}
    results: dict[tuple[str, float], dict[str, Any]] = {}
    for rate, names in ((STEADY_RATE, steady), (SATURATION_RATE, saturated)):
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for rep in range(reps):
            for name in names:
                if rep and name in collapsing:
                    continue
                runs[name].append(_mixed(name, profiles, rate, window, grace))
                last = runs[name][-1]
                print(f"    {rate:.0f}/s {name}: p50 {last['p50'] * 1e3:.2f} ms p99 {last['p99'] * 1e3:.2f} ms "
                      f"fast {last['throughput']:.0f}/s censored {last['censored']} max loop lag "
                      f"{last['max_lag'] * 1e3:.0f} ms {last['diagnostics']}", file=sys.stderr, flush=True)
        for name, got in runs.items():
            results[(name, rate)] = {
                "p50": median(r["p50"] for r in got), "p99": median(r["p99"] for r in got),
                "throughput": median(r["throughput"] for r in got), "censored": max(r["censored"] for r in got),
                "n_fast": got[0]["n_fast"], "slow_done": median(r["slow_done"] for r in got),
                "slow_refused": median(r["slow_refused"] for r in got),
                "slow_p50": median(r["slow_p50"] or 0.0 for r in got)}
    return _mixed_rows(results, window)


def _mixed_rows(results: dict[tuple[str, float], dict[str, Any]], window: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def lat(name: str, rate: float, key: str) -> tuple[float, str]:
        r = results[(name, rate)]
        return r[key] * 1e3, ("ms (>=)" if r["censored"] else "ms")

    steady = f"mixed {STEADY_RATE:.0f}/s"
    ad_p99, _ = lat("adaptive:wait", STEADY_RATE, "p99")
    in_p99, _ = lat("always-inline", STEADY_RATE, "p99")
    for name in ("adaptive:wait", "always-inline", "always-pool", "sync_to_async thread_sensitive=True",
                 "sync_to_async thread_sensitive=False"):
        p50, unit50 = lat(name, STEADY_RATE, "p50")
        p99, unit99 = lat(name, STEADY_RATE, "p99")
        label = "adaptive" if name == "adaptive:wait" else name
        if name == "adaptive:wait":
            rows.append(row(steady, f"{label}: fast p99", p99, unit99, baseline="always-inline p99",
                            ratio=p99 / in_p99, target="<= 2 ms (inline >= 100 ms)",
                            ok=p99 <= 2.0 and in_p99 >= 100.0))
        else:
            rows.append(row(steady, f"{label}: fast p99", p99, unit99, baseline="adaptive p99", ratio=p99 / ad_p99))
        rows.append(row(steady, f"{label}: fast p50", p50, unit50))
        rows.append(row(steady, f"{label}: fast throughput", results[(name, STEADY_RATE)]["throughput"], "events/s"))
    sat = f"mixed {SATURATION_RATE:.0f}/s (saturated)"
    pool_tp = results[("always-pool", SATURATION_RATE)]["throughput"]
    for name in ("adaptive:wait", "adaptive:reject", "adaptive:inline", "always-inline", "always-pool",
                 "sync_to_async thread_sensitive=True", "sync_to_async thread_sensitive=False"):
        r = results[(name, SATURATION_RATE)]
        p50, unit50 = lat(name, SATURATION_RATE, "p50")
        p99, unit99 = lat(name, SATURATION_RATE, "p99")
        label = name.replace("adaptive:", "adaptive, overflow=")
        tp = r["throughput"]
        if name.startswith("adaptive:") and name != "adaptive:inline":
            rows.append(row(sat, f"{label}: fast throughput", tp, "events/s", baseline="always-pool",
                            ratio=tp / pool_tp if pool_tp else None, target=">= 1.5x always-pool",
                            ok=pool_tp == 0 or tp / pool_tp >= 1.5))
        else:
            rows.append(row(sat, f"{label}: fast throughput", tp, "events/s", baseline="always-pool",
                            ratio=tp / pool_tp if pool_tp else None))
        rows.append(row(sat, f"{label}: fast p50", p50, unit50))
        rows.append(row(sat, f"{label}: fast p99", p99, unit99))
        if name.startswith("adaptive:"):
            rows.append(row(sat, f"{label}: slow events done / refused in the run",
                            100 * r["slow_done"], "% done", baseline=f"{100 * r['slow_refused']:.0f}% refused"))
            rows.append(row(sat, f"{label}: slow p50 (those done)", r["slow_p50"] * 1e3, "ms"))
    return rows


def run(quick: bool) -> list[dict[str, Any]]:
    """All engine benchmarks (see the module docstring)."""
    rows = bench_inline(quick)
    rows += bench_pool(quick)
    rows += bench_mixed(quick)
    return rows


if __name__ == "__main__":
    from bench.run import main

    sys.exit(main(["--only", "engine", *sys.argv[1:]]))
