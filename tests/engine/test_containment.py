"""Engine containment (issue 9 items 3-4, issue 10 item 4): every rule here would fail if removed.

- a handler raising BaseException is a Failure recorded in its profile, pooled or inline;
- a matcher's ``timeout``: a pooled run past it is reported ``timeout`` at its deadline by the
  pool's one watcher, the event completes, the thread counts as stuck, the late result is dropped;
- the inline budget: ``ctx.deadline``, a sandboxed plugin stopped by it, an overrun or timeout
  while inline promotes at once;
- inline is earned per input size: a much larger event goes to the pool before it runs;
- the inline slot names the running inline handler; quarantine pins a matcher to the pool;
- a failure on the way to a handler (its data cannot be copied) is that handler's Failure,
  and one cause is logged once per interval, not once per event.
"""
from __future__ import annotations

import logging
import mmap
import sys
import threading
import time

import pytest

from execapp.engine import (
    BadEvent,
    ConfigError,
    Context,
    Engine,
    Event,
    ExecClass,
    ExecPool,
    ExecProfile,
    HandlerTimeout,
    ProfileState,
)
from execapp.engine import engine as engine_module
from execapp.engine import pool as pool_module
from execapp.engine.engine import INLINE_ESCAPE_SECONDS
from execapp.engine.errors import MAX_MESSAGE_CHARS
from execapp.engine.matcher import MARK_SIZE, make_mark
from execapp.engine.profile import SIZE_FACTOR, SIZE_FLOOR

from .helpers import LIVENESS, Outcomes, add_cmd, demote, promote, wait_until


@pytest.fixture
def engines():
    made: list[Engine] = []

    def make(**kwargs) -> Engine:
        engine = Engine(**kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown(timeout=5)
        if engine.pool is not None and not engine.owns_pool:
            engine.pool.drain(timeout=5)


def dispatch(engine: Engine, text: str = "/cmd", **kwargs):
    out = Outcomes()
    completion = engine.process_event(Event(text=text, **kwargs), out).wait(LIVENESS)
    assert completion is not None, "the event never completed"
    return completion, out


def watcher_threads(pool: ExecPool) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"{pool.name}-watcher"]


# -- BaseException ------------------------------------------------------------------------------------

@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()], ids=type)
@pytest.mark.parametrize("placement", ["pooled", "inline"])
def test_a_handler_raising_base_exception_is_a_recorded_failure(engines, placement, raised):
    engine = engines()

    def handler(ctx):
        raise raised

    m = add_cmd(engine, handler, name="dies")
    (promote if placement == "pooled" else demote)(m)
    errors_before = m.profile.errors
    completion, out = dispatch(engine)  # inline: nothing escapes into the dispatching thread
    assert [f.code for f in out.failures] == ["handler_error"]
    assert type(raised).__name__ in out.failures[0].message
    assert completion.errors == tuple(out.failures)
    assert m.profile.errors == errors_before + 1
    assert type(raised).__name__ in m.profile.last_error
    assert engine.pool.stats()["failed"] == 0, "the engine handled it; the pool's last resort never saw it"
    m.handler = lambda ctx: "alive"  # the same engine and pool keep serving
    assert dispatch(engine)[1].replies[0].text == "alive"


class _UnreadableError(Exception):
    def __init__(self, raised: BaseException) -> None:
        super().__init__()
        self.raised = raised

    def __str__(self) -> str:
        raise self.raised


@pytest.mark.parametrize("raised", [_UnreadableError(RuntimeError("no text")), _UnreadableError(SystemExit(2)),
                                    ValueError("x" * 1_000_000)], ids=["str-raises", "str-exits", "huge"])
@pytest.mark.parametrize("placement", ["pooled", "inline"])
def test_a_handler_error_whose_message_raises_or_is_huge_is_one_bounded_failure(engines, placement, raised):
    # Inline, an exception whose str() raised escaped the dispatch: the event's other handlers
    # were skipped and its failure lost (a SystemExit from str() stopped the server); pooled, its
    # failure was lost. A 1 MB message went whole into the error frame.
    engine = engines()

    def handler(ctx):
        raise raised

    m = add_cmd(engine, handler, name="odd", priority=1)
    (promote if placement == "pooled" else demote)(m)
    demote(add_cmd(engine, lambda ctx: "next ran", name="next"))
    completion, out = dispatch(engine)
    assert [f.code for f in out.failures] == ["handler_error"]
    assert [r.text for r in out.replies] == ["next ran"]
    assert completion.errors == tuple(out.failures) and completion.matched == 2
    message = out.failures[0].message
    assert len(message) <= MAX_MESSAGE_CHARS + 100
    assert ("could not be read" in message) is isinstance(raised, _UnreadableError)
    assert m.profile.errors == 1


# -- matcher timeout: the pool's watcher ------------------------------------------------------------

def test_matcher_timeout_is_validated_and_defaults_to_the_handlers_attribute(engines):
    engine = engines()
    for bad in (0, -1, "1", True, float("nan")):
        with pytest.raises(ConfigError, match="timeout"):
            engine.make_matcher("command", "x", lambda ctx: None, timeout=bad)

    def handler(ctx):
        return None

    handler.timeout = 1.5  # what LoadedPlugin.engine_handler carries
    assert engine.make_matcher("command", "x", handler).timeout == 1.5
    assert engine.make_matcher("command", "x", handler, timeout=0.25).timeout == 0.25
    assert engine.on_command("y", lambda ctx: None, timeout=2).timeout == 2.0
    assert engine.on_command("z", lambda ctx: None).timeout is None


def test_a_pooled_run_past_its_timeout_is_reported_at_its_deadline_and_counted_stuck(engines):
    pool = ExecPool(4, 4, idle_seconds=0.5, name="stuck-pool")
    engine = engines(pool=pool)
    release = threading.Event()
    started = threading.Event()
    after_release = threading.Event()

    def stuck(ctx):
        started.set()
        release.wait(LIVENESS * 3)  # blocks in C like a runaway extension call
        after_release.set()
        return "late"

    m = promote(engine.on_command("cmd", stuck, timeout=0.2))
    out = Outcomes()
    t0 = time.monotonic()
    run = engine.process_event(Event(text="/cmd"), out)
    completion = run.wait(LIVENESS)
    took = time.monotonic() - t0
    try:
        assert completion is not None and started.is_set()
        assert 0.2 <= took <= 2 * 0.2 + 0.5, f"reported after {took:.3f} s"
        assert [f.code for f in out.failures] == ["timeout"] and "0.2 s" in out.failures[0].message
        assert completion.errors == tuple(out.failures) and completion.replies == 0
        assert out.items[-1] is completion
        stats = pool.stats()
        assert (stats["stuck"], stats["stuck_total"]) == (1, 1)
        assert engine.stats()["pool"]["stuck"] == 1
        assert m.profile.timeouts == 1 and m.profile.state is ProfileState.PROMOTED
        assert len(watcher_threads(pool)) == 1
    finally:
        release.set()
    assert after_release.wait(LIVENESS)
    assert wait_until(lambda: pool.stats()["stuck"] == 0 and pool.busy() == 0)
    assert pool.stats()["stuck_total"] == 1
    # The pool is idle: the late run's task has returned, so a late "late" would be in `out` by now.
    assert out.replies == [] and len(out.completions) == 1, "the late result is dropped, never emitted twice"
    assert m.profile.runs == 1, "the late run is not recorded a second time"


def test_a_pooled_run_within_its_timeout_is_not_stuck_and_sees_its_deadline(engines):
    pool = ExecPool(4, 4, idle_seconds=0.5)
    engine = engines(pool=pool)
    seen: list[float | None] = []

    def quick(ctx):
        seen.append(None if ctx.deadline is None else ctx.deadline - time.monotonic())
        return "ok"

    promote(engine.on_command("cmd", quick, timeout=5))
    promote(engine.on_command("bare", quick))
    completion, out = dispatch(engine, "/cmd")
    assert [r.text for r in out.replies] == ["ok"] and not out.failures
    assert 4.0 < seen[0] <= 5.0
    dispatch(engine, "/bare")
    assert seen[1] is None, "a pooled run without a timeout has no deadline"
    assert pool.stats()["stuck_total"] == 0 and pool._watched == set()


def test_one_watcher_thread_per_pool_whatever_the_number_of_runs(engines, monkeypatch):
    monkeypatch.setattr(pool_module, "WATCH_LINGER", 0.2)
    pool = ExecPool(8, 8, idle_seconds=0.5, name="one-watcher")
    engine = engines(pool=pool)
    gate = threading.Event()
    promote(engine.on_command("cmd", lambda ctx: gate.wait(LIVENESS), timeout=LIVENESS))
    runs = [engine.process_event(Event(text="/cmd")) for _ in range(8)]
    assert wait_until(lambda: len(pool._watched) == 8)
    assert len(watcher_threads(pool)) == 1
    gate.set()
    assert all(r.wait(LIVENESS) for r in runs)
    assert wait_until(lambda: not watcher_threads(pool)), "an idle watcher exits after its linger"
    dispatch(engine)  # and a new one starts on demand
    assert pool._watcher is not None or not pool._watched


def test_pool_watch_and_finish_claim_each_run_once(monkeypatch):
    monkeypatch.setattr(pool_module, "WATCH_LINGER", 0.2)
    pool = ExecPool(2, 2, idle_seconds=0.1, name="claim-once")
    fired: list[int] = []
    w = pool.watch(time.monotonic() - 1, lambda: fired.append(1))  # already overdue
    assert wait_until(lambda: fired == [1])
    assert (pool.stuck, pool.stuck_total) == (1, 1)
    assert pool.finish(w) is False, "the watcher reported it first: the late result is discarded"
    assert pool.stuck == 0 and pool.finish(w) is False
    w2 = pool.watch(time.monotonic() + LIVENESS, lambda: fired.append(2))
    assert pool.finish(w2) is True and pool._watched == set()
    # The watcher exits after its linger: every pass it would make over the entries is made.
    assert wait_until(lambda: not watcher_threads(pool))
    assert fired == [1] and pool.stats()["stuck_total"] == 1


# -- the inline budget --------------------------------------------------------------------------------

def test_inline_runs_get_the_inline_budget_as_their_deadline(engines):
    engine = engines(inline_timeout=0.3)
    seen: list[float | None] = []
    m = demote(add_cmd(engine, lambda ctx: seen.append(ctx.deadline and ctx.deadline - time.monotonic()),
                       name="fast"))
    dispatch(engine)
    assert 0.0 < seen[0] <= 0.3
    # Inline only because the pool is off / the call is the deterministic sync entry point: no
    # budget (there is no pool to move to), the matcher's own timeout instead.
    m.timeout = 7.0
    engine.process_event_sync(Event(text="/cmd"))
    assert 6.0 < seen[1] <= 7.0
    with pytest.raises(ConfigError, match="inline_timeout"):
        Engine(inline_timeout=0)


def test_an_inline_overrun_promotes_at_once_and_the_result_still_counts(engines):
    # Thresholds so high that no ordinary rule would promote a 0.15 s run (promote_after = 10 s).
    engine = engines(inline_timeout=0.05, profile_factory=lambda: ExecProfile(slow_threshold=5.0))
    m = demote(add_cmd(engine, lambda ctx: time.sleep(0.15) or "slow but done", name="overrun"))
    completion, out = dispatch(engine)
    assert [(r.text, r.exec_class) for r in out.replies] == [("slow but done", ExecClass.SYNC)]
    assert m.profile.state is ProfileState.PROMOTED and m.profile.should_pool() is ExecClass.POOL
    m.handler = lambda ctx: "fast"
    _, out = dispatch(engine)
    assert out.replies[0].exec_class is ExecClass.POOL, "runs inline again only after proving fast afresh"


def test_one_event_starts_inline_runs_only_within_one_inline_budget(engines, monkeypatch):
    # A frame matching many proven-fast handlers (a plugin may bind 100 to one command), each
    # slow on a crafted input but within its own budget, held a real worker's loop 47 x 0.1 s
    # until its watchdog killed it. The event's inline runs now share one budget: once it is
    # spent the rest of its handlers go to the pool, without changing their profiles.
    now = [1000.0]
    monkeypatch.setattr(engine_module, "_clock", lambda: now[0])
    engine = engines(inline_timeout=0.05, profile_factory=lambda: ExecProfile(slow_threshold=5.0))

    def costly(ctx):
        now[0] += 0.03  # each run within its own budget (0.05 s), two of them past it
        return ctx.matcher.name

    matchers = [demote(add_cmd(engine, costly, name=f"h{i}")) for i in range(5)]
    completion, out = dispatch(engine)
    assert completion.matched == 5 and not out.failures
    classes = {r.text: r.exec_class for r in out.replies}
    assert classes == {"h0": ExecClass.SYNC, "h1": ExecClass.SYNC, "h2": ExecClass.POOL, "h3": ExecClass.POOL,
                       "h4": ExecClass.POOL}
    assert all(m.profile.state is ProfileState.DEMOTED for m in matchers), "moved for this event only"
    assert engine.counts["inline"] == 2 and engine.counts["pooled"] == 3
    _, out = dispatch(engine)  # the next event has a budget of its own
    assert [r.exec_class for r in out.replies if r.text == "h0"] == [ExecClass.SYNC]


def test_an_inline_run_far_past_its_budget_quarantines_its_matcher(engines):
    # A C call no deadline reaches (a QuickJS BigInt turned into text: 3.4 s on a real worker's
    # loop) was only promoted: 46 fast runs later the handler ran inline again, to stall it again.
    engine = engines(inline_timeout=0.05, profile_factory=lambda: ExecProfile(slow_threshold=5.0))
    late = INLINE_ESCAPE_SECONDS + 0.1

    def escapes(ctx):
        if ctx.args == "c-call":
            time.sleep(0.05 + late)  # past the budget, and past what any sandbox's margin explains
            raise HandlerTimeout("stopped, late")
        return "fast"

    m = demote(add_cmd(engine, escapes, name="escapes"))
    _, out = dispatch(engine, "/cmd c-call")
    assert [f.code for f in out.failures] == ["timeout"]
    assert m.profile.quarantined and "out of reach of its deadline" in m.profile.quarantined
    for _ in range(3 * m.profile.window):  # far more fast runs than any recovery needs
        _, out = dispatch(engine)
    assert out.replies[0].exec_class is ExecClass.POOL
    # A run late by less than that (a busy machine, a sandbox's margin) is only promoted, as before.
    m2 = demote(add_cmd(engine, lambda ctx: time.sleep(0.15) or "late", name="late", pattern="late"))
    dispatch(engine, "/late")
    assert m2.profile.state is ProfileState.PROMOTED and m2.profile.quarantined is None


def test_an_inline_timeout_promotes_at_once(engines):
    engine = engines(profile_factory=lambda: ExecProfile(slow_threshold=5.0))

    def times_out(ctx):
        raise HandlerTimeout("stopped by its sandbox")

    m = demote(add_cmd(engine, times_out, name="to"))
    completion, out = dispatch(engine)
    assert [f.code for f in out.failures] == ["timeout"]
    assert m.profile.state is ProfileState.PROMOTED and m.profile.timeouts == 1


LUA_SPIN = "function spin(ev) while true do end end\nfunction echo(ev) return ev.args end\n"


def test_a_sandboxed_plugin_inline_is_stopped_by_the_inline_budget_not_its_own(engines):
    from plugins.loaded import ENGINE_GRACE_SECONDS, LoadedPlugin
    from plugins.spec import PluginSpec

    plugin = LoadedPlugin(PluginSpec(name="spinner", runtime="lua", code=LUA_SPIN, timeout=5.0))
    try:
        engine = engines(inline_timeout=0.1)
        handler = plugin.engine_handler("spin")
        assert handler.timeout == 2 * 5.0 + ENGINE_GRACE_SECONDS  # a wait for a slot, a run, a grace
        m = demote(engine.add(engine.make_matcher("command", "cmd", handler, name="spinner.spin",
                                                  plugin="spinner")))
        assert m.timeout == 2 * 5.0 + ENGINE_GRACE_SECONDS, "plugin bindings carry their budget plus a grace"
        t0 = time.monotonic()
        completion, out = dispatch(engine)
        took = time.monotonic() - t0
        assert took < 2 * 0.1 + 0.5, f"the loop was held {took:.3f} s"
        assert [f.code for f in out.failures] == ["timeout"]
        assert "inline budget" in out.failures[0].message and "INLINE_TIMEOUT_SECONDS" in out.failures[0].message
        assert m.profile.state is ProfileState.PROMOTED
        # Its own deadline still holds in the pool: a shorter ctx.deadline is honoured there too.
        t0 = time.monotonic()
        with pytest.raises(HandlerTimeout) as info:
            plugin.call("spin", {"args": ""}, True, time.monotonic() + 0.1)
        assert time.monotonic() - t0 < 0.1 + 0.5 and "inline budget" not in str(info.value)
        assert plugin.call("echo", {"args": "x"}, False, None) == "x"
    finally:
        plugin.close()


def test_a_pooled_plugin_run_that_waited_for_its_slot_is_stopped_by_its_sandbox_before_the_backstop(engines):
    # A pooled run that waited for its plugin's slot longer than the grace got a guest deadline
    # equal to the engine's backstop (then the plugin's timeout plus the grace from its start):
    # the two raced, the watcher won, and the thread was counted stuck. One frame matching 100
    # handlers of one plugin (8 slots) counted 76 stuck threads on a real worker, where
    # EXECAPP['STUCK_THREADS_LIMIT'] (8) at once recycles it.
    from plugins.loaded import ENGINE_GRACE_SECONDS, LoadedPlugin
    from plugins.spec import PluginSpec

    own = ENGINE_GRACE_SECONDS + 0.3  # the second run waits longer than the grace for the slot
    plugin = LoadedPlugin(PluginSpec(name="spinner", runtime="lua", code=LUA_SPIN, timeout=own, max_concurrency=1))
    given: list[tuple[float, float]] = []  # (the guest's deadline, the engine's) of each pooled call
    call = plugin.call

    def watched_call(handler, event, blocking=True, deadline=None):
        ctx_deadline = next(f.f_locals["ctx"].deadline for f in _frames() if "ctx" in f.f_locals)
        given.append((deadline, ctx_deadline))
        return call(handler, event, blocking, deadline)

    plugin.call = watched_call  # type: ignore[method-assign]
    try:
        engine = engines()
        for i in range(2):
            promote(engine.add(engine.make_matcher("command", "cmd", plugin.engine_handler("spin"),
                                                   name=f"spinner.spin#{i}", plugin="spinner")))
        completion, out = dispatch(engine)
        assert len(out.failures) == 2 and {f.code for f in out.failures} <= {"timeout", "plugin_busy"}
        assert not [f.message for f in out.failures if "did not stop" in f.message], "the backstop fired"
        assert engine.pool.stats()["stuck_total"] == 0
        # The contract, whatever the race's outcome on this machine: the sandbox's deadline is a
        # grace before the backstop's, wait for the slot included.
        assert len(given) == 2 and all(guest <= backstop - ENGINE_GRACE_SECONDS + 1e-9 for guest, backstop in given)
    finally:
        plugin.close()


def _frames():
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


# -- inline is earned per input size ----------------------------------------------------------------

def test_event_size_defaults_to_the_text_length_and_can_be_given():
    assert Event(text="/cmd hello").size == 10
    assert Event(text="x", size=70_000).size == 70_000
    assert Context.for_pool(Event(text="x", size=5), "", None).event.size == 5


def test_profile_proves_sizes_on_fast_successful_runs_only():
    p = ExecProfile(slow_threshold=0.05)
    assert p.inline_max_size == SIZE_FLOOR
    p.record(0.001, 3000)
    assert (p.proven_size, p.inline_max_size) == (3000, SIZE_FACTOR * 3000)
    p.record(0.001, 100_000, error="failed fast")  # a failure proves nothing about its input
    p.record(0.04, 100_000)  # not fast
    assert p.proven_size == 3000
    p.record(0.5, 10)  # an outlier promotes: sizes are proven afresh
    assert (p.proven_size, p.inline_max_size) == (0, SIZE_FLOOR)


def test_a_much_larger_event_goes_to_the_pool_before_it_runs_without_changing_the_profile(engines):
    engine = engines()
    m = demote(add_cmd(engine, lambda ctx: "ok", name="trim"))
    for _ in range(3):
        assert dispatch(engine, "/cmd " + "a" * 20)[1].replies[0].exec_class is ExecClass.SYNC
    assert m.profile.proven_size == 25
    state, runs_before = m.profile.state, m.profile.runs
    assert m.profile.should_pool(60_000) is ExecClass.POOL and m.profile.state is state
    big = "/cmd " + " " * 60_000  # the 60 KB trim frame of issue 9
    _, out = dispatch(engine, big)
    assert out.replies[0].exec_class is ExecClass.POOL, "the large frame never reaches the loop"
    assert m.profile.state is ProfileState.DEMOTED and m.profile.runs == runs_before + 1
    # The fast pooled run proved that size: the same size may run inline now.
    assert m.profile.proven_size == len(big)
    assert dispatch(engine, big)[1].replies[0].exec_class is ExecClass.SYNC
    # The protocol's frame length (Event.size) is what counts, not only the text.
    assert dispatch(engine, "/cmd", size=SIZE_FACTOR * len(big) + 1)[1].replies[0].exec_class is ExecClass.POOL


# -- the inline slot --------------------------------------------------------------------------------

def test_the_inline_slot_names_the_inline_run_and_is_cleared_after(engines):
    engine = engines()
    shared = mmap.mmap(-1, 4096)  # what the supervisor's shared file looks like from a worker
    engine.set_inline_slot(memoryview(shared)[64:128])
    seen: list[bytes] = []

    def look(ctx):
        seen.append(bytes(shared[64:128]))
        if ctx.args == "die":
            raise SystemExit(1)
        return "ok"

    demote(add_cmd(engine, look, name="inline.handler"))
    promote(add_cmd(engine, look, name="pooled.handler", pattern="pooled"))
    dispatch(engine, "/cmd")
    dispatch(engine, "/cmd die")
    dispatch(engine, "/pooled")
    assert seen[0] == seen[1] == make_mark("inline.handler") and seen[0].rstrip(b"\0") == b"inline.handler"
    assert seen[2][0] == 0, "pooled runs are not on the loop: the slot stays empty"
    assert shared[64] == 0 and shared[0:64] == bytes(64), "cleared after each run, nothing written outside"
    engine.set_inline_slot(None)
    dispatch(engine, "/cmd")
    assert seen[3][0] == 0
    with pytest.raises(ConfigError):
        engine.set_inline_slot(bytes(64))  # read-only
    with pytest.raises(ConfigError):
        engine.set_inline_slot(bytearray(10))


def test_marks_are_the_names_first_64_bytes_nul_padded():
    # The contract execapp.watchdog reads: bytes up to the first NUL; none means cut at 64.
    name = "a" + "é" * 40  # 81 bytes of UTF-8: the cut splits a character
    mark = make_mark(name)
    assert len(mark) == MARK_SIZE and b"\0" not in mark and mark == name.encode()[:MARK_SIZE]
    assert mark.decode("utf-8", "ignore") == "a" + "é" * 31
    assert make_mark("plugin.handler") == b"plugin.handler" + bytes(MARK_SIZE - 14)


# -- quarantine ------------------------------------------------------------------------------------

def test_quarantine_pins_a_matcher_to_the_pool_until_released(engines):
    engine = engines(profile_factory=lambda: ExecProfile(window=12, recent=4, min_samples=4))
    engine.quarantine("q.handler", "stalled worker w1")  # before registration: a new worker applies its list first
    m = add_cmd(engine, lambda ctx: "ok", name="q.handler")
    assert m.profile.snapshot()["quarantined"] == "stalled worker w1"
    for _ in range(30):
        assert dispatch(engine)[1].replies[0].exec_class is ExecClass.POOL
    assert m.profile.state is ProfileState.PROMOTED, "never demoted while quarantined"
    demote(m)  # a restore (e.g. a stale persisted record) cannot unpin it either
    m.profile.quarantine("again")
    assert m.profile.should_pool() is ExecClass.POOL
    engine.release_quarantine("q.handler")
    assert m.profile.snapshot()["quarantined"] is None
    classes = [dispatch(engine)[1].replies[0].exec_class for _ in range(13)]
    assert classes[0] is ExecClass.POOL and classes[-1] is ExecClass.SYNC, "earns inline again on fresh runs"


def test_quarantine_and_proven_size_survive_a_snapshot_restore_round_trip():
    p = ExecProfile()
    p.record(0.001, 5000)
    p.quarantine("stalled")
    snap = p.snapshot()
    q = ExecProfile()
    q.restore(snap["state"], snap["window"], proven_size=2000, quarantined=snap["quarantined"])
    assert q.should_pool() is ExecClass.POOL and q.quarantined == "stalled"
    assert (q.proven_size, q.inline_max_size) == (2000, SIZE_FACTOR * 2000)
    r = ExecProfile()
    r.restore("demoted", [0.001] * 32, quarantined="stalled")
    assert r.state is ProfileState.PROMOTED and r.should_pool() is ExecClass.POOL


# -- failures on the way to a handler -----------------------------------------------------------------

def _nested(depth: int) -> dict:
    data: dict = {}
    for _ in range(depth):
        data = {"d": data}
    return data


def test_data_that_cannot_be_copied_is_a_bad_event_failure_logged_once(engines, caplog):
    engine = engines()
    m = promote(add_cmd(engine, lambda ctx: "never", name="deep"))
    lower = demote(add_cmd(engine, lambda ctx: "lower ran", name="lower", priority=-1))
    caplog.set_level(logging.DEBUG, logger="execapp")
    for _ in range(20):
        out = Outcomes()
        completion = engine.process_event(Event(type="message", text="/cmd", data=_nested(900)), out).wait(LIVENESS)
        assert completion is not None
        assert [f.code for f in out.failures] == ["bad_event"]
        assert (completion.matched, completion.replies, len(completion.errors)) == (2, 1, 1)
    assert "nested too deeply" in out.failures[0].message
    assert m.profile.errors == 20 and m.profile.runs == 0 and "nested too deeply" in m.profile.last_error
    assert lower.profile.errors == 0
    records = [r for r in caplog.records if r.name.startswith("execapp")]
    assert len(records) == 1, [r.getMessage()[:80] for r in records]
    # A value that is not plain data: the message says what to send instead.
    _, out = dispatch(engine, "/cmd", data={"lock": threading.Lock()})
    assert out.failures[0].code == "bad_event" and "plain JSON" in out.failures[0].message
    with pytest.raises(BadEvent):
        Context.for_pool(Event(data=_nested(900)), "", m)


def test_a_blocking_handler_that_could_not_be_copied_still_blocks(engines):
    engine = engines()
    promote(add_cmd(engine, lambda ctx: "never", name="deep", block=True))
    demote(add_cmd(engine, lambda ctx: "lower ran", name="lower", priority=-1))
    completion, out = dispatch(engine, "/cmd", data=_nested(900))
    assert completion.blocked_by == "deep" and out.replies == []


class _NoThreads(ExecPool):
    """A pool in a process out of threads: starting a worker fails as threading does then."""

    def _start(self, task):
        raise RuntimeError("can't start new thread")


def test_a_submission_failure_is_a_failure_and_the_pool_keeps_its_token(engines):
    pool = _NoThreads(2, 0)
    engine = engines(pool=pool)
    m = promote(add_cmd(engine, lambda ctx: "never", name="sub"))
    completion, out = dispatch(engine)
    assert [f.code for f in out.failures] == ["handler_error"]
    assert "could not be submitted" in out.failures[0].message and m.profile.errors == 1
    assert len(pool._tokens) == 2 and pool.busy() == 0 and pool._handoff == type(pool._handoff)()


def test_one_failing_handler_logs_once_per_interval_not_per_event(engines, caplog):
    engine = engines()
    demote(add_cmd(engine, lambda ctx: 1 / 0, name="zero"))
    caplog.set_level(logging.DEBUG, logger="execapp")
    for _ in range(50):
        dispatch(engine)
    assert len([r for r in caplog.records if "zero" in r.getMessage()]) == 1


# -- the setting -------------------------------------------------------------------------------------

def test_checks_name_bad_inline_timeout_settings(settings):
    from execapp.checks import check_execapp_settings

    ids = lambda: {m.id for m in check_execapp_settings()}  # noqa: E731
    settings.EXECAPP = {}
    assert not ids() & {"execapp.E050", "execapp.W050", "execapp.W051"}, "the defaults are consistent"
    for bad in (0, -0.1, "0.1", True, None):
        settings.EXECAPP = {"INLINE_TIMEOUT_SECONDS": bad}
        assert "execapp.E050" in ids(), bad
    settings.EXECAPP = {"INLINE_TIMEOUT_SECONDS": 0.5}  # past the 250 ms /ping target
    assert "execapp.W050" in ids()
    settings.EXECAPP = {"INLINE_TIMEOUT_SECONDS": 0.05, "SLOW_THRESHOLD_SECONDS": 0.2}
    assert "execapp.W051" in ids()
