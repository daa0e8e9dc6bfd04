"""Engine dispatch (synchronous entry points): the bugs of the seed's history, one test each.

docs/architecture.md ("Design rules"): every matcher has a profile; blocking is computed before
the pool decision; the context is cloned before submission; a full pool falls back inline; a shared pool belongs to
its owner. Profiles are forced with ``restore`` where a test is about dispatch, not learning.
"""
from __future__ import annotations

import threading
import time

import pytest

from execapp.engine import (
    Completion,
    ConfigError,
    Engine,
    Event,
    ExecClass,
    ExecPool,
    ExecProfile,
    HandlerTimeout,
    Matcher,
    MatcherKind,
    ProfileState,
    Reply,
)

from .helpers import LIVENESS, Gate, Outcomes, add_cmd, demote, promote, wait_until


@pytest.fixture
def engines():
    made: list[Engine] = []
    pools: list[ExecPool] = []

    def make(**kwargs) -> Engine:
        engine = Engine(**kwargs)
        made.append(engine)
        if kwargs.get("pool") is not None:
            pools.append(kwargs["pool"])
        return engine

    yield make
    for engine in made:
        engine.shutdown(timeout=5)
    for pool in pools:
        pool.drain(timeout=5)


def run_event(engine: Engine, text: str = "/cmd", **kwargs) -> tuple[Completion, Outcomes]:
    out = Outcomes()
    run = engine.process_event(Event(text=text, **kwargs), out)
    completion = run.wait(LIVENESS)
    assert completion is not None, "the event never completed"
    return completion, out


# -- every matcher has a profile, commands included (the seed's v1.21.1 bug) ------------------------

@pytest.mark.parametrize("register, text", [
    (lambda e, h: e.on_command("work", h), "/work now"),
    (lambda e, h: e.on_regex(r"^work", h), "work now"),
    (lambda e, h: e.on_event("work", h), None),
])
def test_every_matcher_kind_learns_and_is_pooled_when_slow(engines, register, text):
    # Thresholds far above what a trivial handler takes even on a loaded machine (fast means
    # under 50 ms here), so the 32 trivial runs are reliably judged fast.
    engine = engines(profile_factory=lambda: ExecProfile(slow_threshold=0.100))
    caller = threading.get_ident()
    delay = {"s": 0.0}
    where: list[int] = []

    def handler(ctx) -> str:
        where.append(threading.get_ident())
        if delay["s"]:
            time.sleep(delay["s"])  # the point: a handler as slow as the test makes it
        return "done"

    m = register(engine, handler)
    assert isinstance(m.profile, ExecProfile) and m.profile is engine.profile_for(m.name)
    event = (lambda: Event(text=text)) if text else (lambda: Event(type="work"))

    def dispatch() -> Reply:
        out = Outcomes()
        assert engine.process_event(event(), out).wait(LIVENESS) is not None
        assert len(out.replies) == 1
        return out.replies[0]

    first = dispatch()
    assert first.exec_class is ExecClass.POOL and where[-1] != caller, "unproven handlers run in the pool"
    for _ in range(31):
        dispatch()
    assert m.profile.state is ProfileState.DEMOTED
    fast = dispatch()
    assert fast.exec_class is ExecClass.SYNC and where[-1] == caller, "proven-fast handlers run inline"
    delay["s"] = 0.25  # one run over 2x the threshold (200 ms)...
    dispatch()
    assert m.profile.state is ProfileState.PROMOTED
    delay["s"] = 0.0
    slow = dispatch()  # ...and the next one goes to the pool
    assert slow.exec_class is ExecClass.POOL and where[-1] != caller
    assert m.profile.runs == 35


def test_make_matcher_always_attaches_the_engines_profile(engines):
    engine = engines()
    for kind in MatcherKind:
        m = engine.make_matcher(kind, "x", lambda ctx: None, name=f"n-{kind.value}")
        assert m.profile is engine.profile_for(f"n-{kind.value}")
    with pytest.raises(ConfigError):
        Matcher(kind=MatcherKind.COMMAND, pattern="x", handler=lambda ctx: None, profile=None,  # type: ignore
                name="bare")


def test_profiles_survive_re_registration(engines):
    engine = engines()
    first = engine.on_command("cmd", lambda ctx: None)
    promote(first)
    second = engine.make_matcher("command", "cmd", lambda ctx: "new")
    engine.set_matchers([second])
    assert second.profile is first.profile and second.profile.state is ProfileState.PROMOTED


# -- blocking is computed before the pool decision ----------------------------------------------------

def _blocking_case(engines, mode: str, *, block_flag: bool):
    pool = ExecPool(1, 0)
    engine = engines(pool=pool, pool_enabled=mode != "disabled")
    lower_ran = threading.Event()

    def high(ctx) -> str:
        return "high"

    a = add_cmd(engine, high, name="high", priority=10, block=block_flag)
    b = add_cmd(engine, lambda ctx: lower_ran.set() or "low", name="low", priority=0)
    demote(b)
    gate = Gate()
    if mode == "inline":
        demote(a)
    elif mode in ("pooled", "disabled"):
        promote(a)
    elif mode == "fallback":  # judged slow, but the pool is full: it runs inline instead
        promote(a)
        gate.fill(pool)
    try:
        completion, out = run_event(engine)
    finally:
        gate.open()
    wait_until(lambda: pool.busy() == 0)
    return completion, out, lower_ran.is_set(), a


@pytest.mark.parametrize("mode", ["inline", "pooled", "fallback", "disabled"])
def test_block_flag_stops_lower_matchers_whether_pooled_or_inline(engines, mode):
    completion, out, lower_ran, a = _blocking_case(engines, mode, block_flag=True)
    assert not lower_ran
    assert completion.blocked_by == a.name
    assert (completion.matched, completion.replies) == (1, 1)
    expected = ExecClass.POOL if mode == "pooled" else ExecClass.SYNC
    assert [r.exec_class for r in out.replies] == [expected]


@pytest.mark.parametrize("mode", ["inline", "pooled", "fallback", "disabled"])
def test_without_block_lower_matchers_run_whether_pooled_or_inline(engines, mode):
    completion, out, lower_ran, _ = _blocking_case(engines, mode, block_flag=False)
    assert lower_ran
    assert completion.blocked_by is None
    assert (completion.matched, completion.replies) == (2, 2)


def test_a_handler_cannot_block_at_run_time_only_its_matcher_flag_blocks():
    # ctx.set_block() blocked lower matchers only when the handler happened to run inline
    # (issue 9): blocking must not depend on where a handler ran, so it is gone.
    from execapp.engine import Context
    assert not hasattr(Context, "set_block") and "blocked" not in Context.__slots__


def test_blocking_pooled_handler_still_completes_before_the_event(engines):
    engine = engines()
    finished = threading.Event()

    def slow(ctx) -> None:
        time.sleep(0.02)  # the point: the handler is still running when the loop would complete the event
        finished.set()

    promote(engine.on_command("cmd", slow, block=True))
    completion, _ = run_event(engine)
    assert finished.is_set(), "completion waits for the pooled blocking handler"
    assert completion.blocked_by == "command:cmd"


# -- a pooled handler cannot see or tear another handler's context ------------------------------------

def test_pooled_handlers_get_private_deep_copies_of_the_event_data(engines):
    engine = engines()
    n_pooled = 4
    both_inside = threading.Barrier(n_pooled, timeout=LIVENESS)
    seen: dict[str, dict] = {}
    lock = threading.Lock()

    def pooled(tag: str):
        def handler(ctx) -> None:
            data = ctx.event.data
            data["items"].append(tag)  # mutate nested containers...
            data["nested"]["owner"] = tag
            data[tag] = True
            both_inside.wait()  # ...while every other pooled handler is running too
            with lock:
                seen[tag] = {"items": list(data["items"]), "owner": data["nested"]["owner"],
                             "keys": sorted(k for k in data if k not in ("items", "nested")),
                             "matcher": ctx.matcher.name, "args": ctx.args, "class": ctx.exec_class}
            for i in range(3):
                ctx.reply(f"{tag}-{i}")
        return handler

    for i in range(n_pooled):
        promote(add_cmd(engine, pooled(f"p{i}"), name=f"pooled-{i}"))
    inline_saw: list[dict] = []
    demote(add_cmd(engine, lambda ctx: inline_saw.append(ctx.event.data) and None, priority=-1,
                    name="inline"))
    data = {"items": [0], "nested": {"owner": None}}
    out = Outcomes()
    run = engine.process_event(Event(text="/cmd arg", data=data), out)
    completion = run.wait(LIVENESS)
    assert completion is not None and completion.errors == ()
    for i in range(n_pooled):
        tag = f"p{i}"
        assert seen[tag] == {"items": [0, tag], "owner": tag, "keys": [tag], "matcher": f"pooled-{i}",
                             "args": "arg", "class": ExecClass.POOL}
    assert data == {"items": [0], "nested": {"owner": None}}, "the caller's data is untouched"
    assert inline_saw == [{"items": [0], "nested": {"owner": None}}]
    # Reply isolation: every reply is attributed to the handler that made it, none lost or doubled.
    by_matcher: dict[str, list[str]] = {}
    for r in out.replies:
        by_matcher.setdefault(r.matcher, []).append(r.text)
    assert by_matcher == {f"pooled-{i}": [f"p{i}-0", f"p{i}-1", f"p{i}-2"] for i in range(n_pooled)}
    assert completion.replies == 3 * n_pooled


def test_an_inline_handler_mutating_the_event_cannot_reach_a_pooled_one(engines):
    engine = engines()
    started = threading.Event()
    proceed = threading.Event()
    pooled_saw: list[dict] = []

    def pooled(ctx) -> None:
        started.set()
        proceed.wait(LIVENESS)
        pooled_saw.append(dict(ctx.event.data))

    def inline(ctx) -> None:
        assert ctx.exec_class is ExecClass.SYNC
        assert started.wait(LIVENESS), "the pooled handler runs concurrently"
        ctx.event.data["x"] = "changed by inline"
        proceed.set()

    promote(engine.add(engine.make_matcher("event", "tick", pooled, priority=1, name="pooled")))
    demote(engine.add(engine.make_matcher("event", "tick", inline, priority=0, name="inline")))
    run = engine.process_event(Event(type="tick", data={"x": "original"}))
    completion = run.wait(LIVENESS)
    assert completion is not None and completion.errors == ()
    assert pooled_saw == [{"x": "original"}]


# -- handler exceptions --------------------------------------------------------------------------------

@pytest.mark.parametrize("placement", ["inline", "pooled"])
def test_handler_exception_is_counted_reported_and_kills_nothing(engines, placement):
    pool = ExecPool(1, 4, idle_seconds=5.0)  # one worker: if the failure killed it, nothing pooled would run
    engine = engines(pool=pool)

    def boom(ctx) -> None:
        raise ValueError("bad input 42")

    bad = engine.on_command("bad", boom)
    good = engine.on_command("good", lambda ctx: "fine")
    (demote if placement == "inline" else promote)(bad)
    promote(good)
    completion, out = run_event(engine, "/bad")
    assert completion.replies == 0 and len(completion.errors) == 1
    failure = completion.errors[0]
    assert (failure.code, failure.matcher, failure.message) == ("handler_error", "command:bad", "bad input 42")
    assert out.failures == [failure]
    assert failure.exec_class is (ExecClass.SYNC if placement == "inline" else ExecClass.POOL)
    assert bad.profile.errors == 1 and bad.profile.last_error == "bad input 42"
    assert engine.stats()["errors"] == 1
    for _ in range(3):  # the engine and the pool's worker go on
        completion, out = run_event(engine, "/good")
        assert [r.text for r in out.replies] == ["fine"] and completion.errors == ()
    assert pool.stats()["workers"] == 1


def test_exec_app_errors_keep_their_code(engines):
    engine = engines(pool_enabled=False)

    def late(ctx) -> None:
        raise HandlerTimeout("ran past 1.0 s")

    m = engine.on_command("late", late)
    completion = engine.process_event_sync(Event(text="/late"))
    assert [f.code for f in completion.errors] == ["timeout"]
    assert m.profile.timeouts == 1


def test_a_failing_outcome_callback_does_not_lose_the_completion(engines):
    engine = engines()
    promote(add_cmd(engine, lambda ctx: "pooled reply", name="pooled"))
    demote(add_cmd(engine, lambda ctx: "inline reply", name="inline", priority=-1))
    got: list = []

    def flaky(outcome) -> None:
        got.append(outcome)
        raise RuntimeError("client went away")

    run = engine.process_event(Event(text="/cmd"), flaky)
    completion = run.wait(LIVENESS)
    assert completion is not None and completion.replies == 2
    assert sum(isinstance(o, Completion) for o in got) == 1


# -- a full pool falls back inline and drops nothing -----------------------------------------------------

def test_full_pool_falls_back_inline_and_drops_nothing(engines):
    pool = ExecPool(2, 1)
    engine = engines(pool=pool)
    ran: list[tuple[str, int]] = []
    for i in range(3):
        promote(add_cmd(engine, lambda ctx, i=i: ran.append((f"h{i}", threading.get_ident())) or f"r{i}",
                        name=f"h{i}"))
    gate = Gate()
    gate.fill(pool)
    try:
        completion, out = run_event(engine)
    finally:
        gate.open()
    assert sorted(name for name, _ in ran) == ["h0", "h1", "h2"]
    assert all(tid == threading.get_ident() for _, tid in ran), "with no slot free, each ran on the caller"
    assert completion.replies == 3 and completion.errors == ()
    assert [r.exec_class for r in out.replies] == [ExecClass.SYNC] * 3
    assert engine.stats()["fallbacks"] == 3


def test_burst_larger_than_the_pool_loses_no_event(engines):
    pool = ExecPool(2, 2)
    engine = engines(pool=pool)
    count = {"n": 0}
    lock = threading.Lock()

    def handler(ctx) -> None:
        time.sleep(0.001)  # the point: each run holds its slot, so the burst overflows the pool
        with lock:
            count["n"] += 1

    promote(engine.on_command("cmd", handler))
    runs = [engine.process_event(Event(text="/cmd")) for _ in range(200)]
    assert all(r.wait(LIVENESS) is not None for r in runs)
    assert count["n"] == 200
    stats = engine.stats()
    # Every event ran its handler exactly once: in the pool, or inline (fallbacks included).
    assert stats["pooled"] + stats["inline"] == 200 and stats["fallbacks"] > 0


def test_another_tenants_pooled_handler_runs_before_one_tenants_queued_backlog(engines):
    """The engine queues each pooled handler under its event's tenant: tenant b's event, sent
    after tenant a queued 10, runs after at most one of a's, not after a's whole backlog."""
    pool = ExecPool(1, 64)
    engine = engines(pool=pool)
    gate = threading.Event()
    order: list[str] = []

    def handler(ctx) -> None:
        if ctx.args == "hold":
            gate.wait(LIVENESS)
        else:
            order.append(ctx.event.tenant)

    promote(engine.on_command("cmd", handler))
    runs = [engine.process_event(Event(text="/cmd hold", tenant="a"))]
    runs += [engine.process_event(Event(text="/cmd", tenant="a")) for _ in range(10)]
    runs.append(engine.process_event(Event(text="/cmd", tenant="b")))
    gate.set()
    assert all(r.wait(LIVENESS) is not None for r in runs)
    assert engine.stats()["fallbacks"] == 0, "every run was pooled (queued), none fell back inline"
    assert order.index("b") == 1, order


# -- pool ownership ---------------------------------------------------------------------------------------

def test_shared_pool_is_used_and_survives_shutdown(engines):
    shared = ExecPool(4, 4)
    engine = engines(pool=shared)
    assert engine.pool is shared, "a shared pool passed in must be the one used"
    promote(engine.on_command("cmd", lambda ctx: "pooled"))
    completion, out = run_event(engine)
    assert out.replies[0].exec_class is ExecClass.POOL
    # The event completes inside the pool task, a moment before the pool counts the task done.
    assert wait_until(lambda: shared.stats()["completed"] == 1)
    assert engine.shutdown(timeout=1) is True
    assert not shared.closed
    done = threading.Event()
    assert shared.try_submit(done.set) and done.wait(LIVENESS), "the shared pool still accepts work"
    other = engines(pool=shared)  # and another engine can go on using it
    promote(other.on_command("cmd", lambda ctx: "again"))
    _, out = run_event(other)
    assert out.replies[0].exec_class is ExecClass.POOL


def test_owned_pool_is_drained_by_shutdown(engines):
    engine = engines()
    assert engine.pool is not None and engine.owns_pool
    finished = threading.Event()

    def slow(ctx) -> None:
        time.sleep(0.05)  # the point: still running when shutdown() is called
        finished.set()

    promote(engine.on_command("cmd", slow))
    run = engine.process_event(Event(text="/cmd"))
    assert engine.shutdown(timeout=LIVENESS) is True
    assert finished.is_set(), "shutdown waits for running pooled handlers"
    assert run.completion is not None
    assert engine.pool.closed and not engine.pool.try_submit(lambda: None)


def test_pool_disabled_runs_everything_inline_in_order(engines):
    engine = engines(pool_enabled=False)
    assert engine.pool is None
    order: list[str] = []
    for name, prio in (("b", 1), ("a", 2), ("c", 0)):
        promote(add_cmd(engine, lambda ctx, name=name: order.append(name) or name, priority=prio, name=name))
    completion, out = run_event(engine)
    assert order == ["a", "b", "c"] and [r.text for r in out.replies] == ["a", "b", "c"]
    assert {r.exec_class for r in out.replies} == {ExecClass.SYNC}


def test_process_event_sync_is_deterministic_on_a_pooling_engine(engines):
    engine = engines()
    order: list[str] = []
    for name, prio in (("b", 1), ("a", 2), ("c", 1)):
        promote(add_cmd(engine, lambda ctx, name=name: order.append(name) or name, priority=prio, name=name))
    completion = engine.process_event_sync(Event(text="/cmd"))
    assert isinstance(completion, Completion)
    assert order == ["a", "b", "c"], "priority first, then registration order"
    assert completion.replies == 3 and engine.stats()["pooled"] == 0


# -- dispatch details ---------------------------------------------------------------------------------------

def test_replies_carry_matcher_class_and_elapsed_and_completion_comes_last(engines):
    engine = engines()
    demote(add_cmd(engine, lambda ctx: ctx.reply("one") or ctx.reply(data={"n": 2}), name="i"))
    promote(add_cmd(engine, lambda ctx: {"k": ctx.args}, name="p", priority=-1))
    completion, out = run_event(engine, "/cmd xyz")
    assert isinstance(out.items[-1], Completion) and out.completions == [completion]
    texts = {(r.matcher, r.text, repr(r.data), r.exec_class) for r in out.replies}
    assert texts == {("i", "one", "None", ExecClass.SYNC), ("i", None, "{'n': 2}", ExecClass.SYNC),
                     ("p", None, "{'k': 'xyz'}", ExecClass.POOL)}
    assert all(r.elapsed >= 0 for r in out.replies)
    assert (completion.matched, completion.replies, completion.blocked_by) == (2, 3, None)


def test_matching_rules(engines):
    engine = engines(pool_enabled=False)
    got: list[tuple[str, str]] = []
    engine.on_command("ping", lambda ctx: got.append(("cmd", ctx.args)) and None)
    engine.on_regex(r"hel+o", lambda ctx: got.append(("re", ctx.args)) and None)
    engine.on_event("join", lambda ctx: got.append(("ev", ctx.event.type)) and None)
    assert engine.process_event_sync(Event(text="/ping  a b ")).matched == 1
    assert engine.process_event_sync(Event(text="/pingx")).matched == 0
    assert engine.process_event_sync(Event(text="say hello")).matched == 1
    assert engine.process_event_sync(Event(type="join")).matched == 1
    assert engine.process_event_sync({"type": "message", "text": "nothing"}).matched == 0
    assert got == [("cmd", "a b"), ("re", "say hello"), ("ev", "join")]


def test_observers_see_every_run(engines):
    engine = engines()
    seen: list[tuple[str, ExecClass, str, str]] = []
    engine.add_observer(lambda m, cls, elapsed, code, event: seen.append((m.name, cls, code, event.text)))
    demote(engine.on_command("a", lambda ctx: None))
    promote(engine.on_command("b", lambda ctx: 1 / 0))
    run_event(engine, "/a")
    run_event(engine, "/b x")  # the observer is told the event each run was for, on either thread
    assert seen == [("command:a", ExecClass.SYNC, "ok", "/a"), ("command:b", ExecClass.POOL, "handler_error", "/b x")]


def test_stats_count_events_and_placements(engines):
    engine = engines()
    demote(engine.on_command("a", lambda ctx: None))
    promote(engine.on_command("b", lambda ctx: None))
    for text in ("/a", "/b", "/b", "/none"):
        run_event(engine, text)
    stats = engine.stats()
    assert (stats["events"], stats["inline"], stats["pooled"], stats["fallbacks"]) == (4, 1, 2, 0)
    assert wait_until(lambda: engine.stats()["pool"]["completed"] == 2)


def test_unknown_overflow_policy_is_refused():
    with pytest.raises(ConfigError, match="overflow"):
        Engine(overflow="drop")


def test_two_handlers_of_one_command_learn_separately(engines):
    engine = engines()
    fast = engine.on_command("cmd", lambda ctx: None)
    slow = engine.on_command("cmd", lambda ctx: None)
    assert (fast.name, slow.name) == ("command:cmd", "command:cmd#2")
    promote(slow)
    assert slow.profile is not fast.profile and fast.profile.state is ProfileState.LEARNING
    named = engine.on_command("cmd", lambda ctx: None, matcher_name="mine", plugin="p")
    assert (named.name, named.plugin, named.profile) == ("mine", "p", engine.profile_for("mine"))


def test_profiles_of_matchers_no_longer_registered_are_kept_up_to_a_bound(monkeypatch) -> None:
    # Every matcher name ever registered kept its profile (~3 KB each): a plugin with 100 bindings
    # of one handler re-saved with new patterns added 100 profiles a save, in every worker.
    from execapp.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "RETIRED_PROFILES", 50, raising=False)
    engine = Engine(pool_enabled=False)

    def register(names: list[str]) -> None:
        engine.set_matchers([engine.make_matcher("command", n, lambda ctx: None, name=n) for n in names])

    register(["kept"] + [f"a{i}" for i in range(30)])
    learned = engine.profile_for("a0")
    for save in range(20):  # each save binds 30 new names
        register(["kept"] + [f"s{save}-{i}" for i in range(30)])
    assert len(engine.profiles) == 31 + 50, "the live matchers' profiles and the 50 most recently retired"
    assert "s18-0" in engine.profiles and "a0" not in engine.profiles
    kept = engine.profile_for("kept")
    register(["kept", "s19-0"])  # re-registered: the same profiles, with what they learned
    assert engine.profile_for("kept") is kept and "s18-29" in engine.profiles
    register(["s18-0"])
    assert engine.profile_for("a0") is not learned  # retired past the bound: a new profile
