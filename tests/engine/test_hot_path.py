"""The inline hot path (issue 14): what was made cheap must still be exactly right.

Routes test an event only against its candidates, the sync fast path allocates nothing for
the loop, the profile's lock-free fast lane loses and reorders no sample, ``inline_limit`` is
the decision ``should_pool`` describes, a run completed with nobody listening builds its
Completion when read, event ids stay unique across a fork, and the watchdog slot names every
inline run although only one byte is written while the same matcher keeps running.
"""
from __future__ import annotations

import asyncio
import inspect
import mmap
import multiprocessing
import threading

import pytest

from execapp.engine import Engine, Event, EventRun, ExecClass, ExecPool, ExecProfile, ProfileState
from execapp.engine.engine import running_handlers
from execapp.engine.event import Context
from execapp.engine.matcher import Routes, make_mark

from .helpers import LIVENESS, Gate, Outcomes, add_cmd, demote, promote

FAST, MID, SLOW = 0.001, 0.030, 0.060  # below fast (25 ms), between, slow (>= 50 ms, < 100 ms)


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.shutdown(timeout=5)


# -- routes ----------------------------------------------------------------------------------------

def test_each_event_shape_reaches_exactly_its_matchers_in_priority_order(engine):
    seen: list[str] = []

    def handler(name):
        return lambda ctx: seen.append(f"{name}:{ctx.args}")

    demote(engine.on_command("a", handler("cmd-a"), priority=1))
    demote(engine.on_command("b", handler("cmd-b")))
    demote(engine.on_regex(r"^/a", handler("regex"), priority=2))
    demote(engine.on_event("message", handler("any-message"), priority=-1))
    demote(engine.on_event("x", handler("type-x")))
    for text in ("/a one", "/b two", "/c three", "plain", "/ a"):
        engine.process_event_sync(Event(text=text))
    engine.process_event_sync(Event("x", "payload"))
    engine.process_event_sync(Event("y", "nobody"))
    assert seen == [
        "regex:/a one", "cmd-a:one", "any-message:/a one",
        "cmd-b:two", "any-message:/b two",
        "any-message:/c three",  # an unregistered command is just a message
        "any-message:plain",
        "any-message:/ a",  # "/ a" is not a command (no name)
        "type-x:payload",
    ]


def test_route_tables_grow_with_registrations_not_with_what_clients_send(engine):
    demote(engine.on_command("ping", lambda ctx: None))
    demote(engine.on_event("tick", lambda ctx: None))
    routes = engine._routes
    for i in range(500):
        engine.process_event_sync(Event(text=f"/unknown{i} x"))
        engine.process_event_sync(Event(f"type{i}"))
    assert engine._routes is routes, "dispatch never rebuilds the routes"
    assert set(routes.commands) == {"ping"} and set(routes.types) == {"tick"}
    engine.on_command("pong", lambda ctx: None)
    assert set(engine._routes.commands) == {"ping", "pong"}, "registration replaces the routes"


def _reference_routes(matchers):
    """The route tables by their definition (a scan of every matcher per key): what Routes must equal."""
    message = tuple(m for m in matchers
                    if m.kind.value == "regex" or (m.kind.value == "event" and m.pattern == "message"))
    commands = {m.pattern for m in matchers if m.kind.value == "command"}
    types = {m.pattern for m in matchers if m.kind.value == "event" and m.pattern != "message"}
    return (message,
            {n: tuple(m for m in matchers if (m.kind.value == "command" and m.pattern == n) or m in message)
             for n in commands},
            {t: tuple(m for m in matchers if m.kind.value == "event" and m.pattern == t) for t in types})


def test_route_tables_are_the_definition_in_dispatch_order_ties_included(engine):
    import random
    rng = random.Random(7)
    matchers = []
    for i in range(300):
        kind = rng.choice(["command", "regex", "event"])
        pattern = {"command": f"c{rng.randrange(12)}", "regex": f"r{i}",
                   "event": rng.choice(["message", "t1", "t2"])}[kind]
        matchers.append(engine.make_matcher(kind, pattern, lambda ctx: None, name=f"m{i}",
                                            priority=rng.randrange(-2, 3)))  # seq 0: ties on sort_key
    ordered = tuple(sorted(matchers, key=lambda m: m.sort_key()))
    routes = Routes(ordered)
    assert (routes.message, routes.commands, routes.types) == _reference_routes(ordered)
    assert routes.heads == {f"/{n}": plan for n, plan in routes.commands.items()}


class _CountedReads(tuple):
    reads = 0

    def __iter__(self):
        type(self).reads += 1
        return super().__iter__()


def test_building_the_routes_reads_the_matchers_once_whatever_the_number_of_commands(engine):
    # Each command name (and event type) was a scan of every matcher with a list search per
    # matcher: 20 plugins within their binding limits (2,000 matchers, 200 regexes) took 12 s
    # under the engine's registration lock, 50 plugins minutes. One pass plus a merge per name now.
    matchers = [engine.make_matcher("command", f"c{i}", lambda ctx: None, name=f"c{i}") for i in range(200)]
    matchers += [engine.make_matcher("event", f"t{i}", lambda ctx: None, name=f"t{i}") for i in range(50)]
    matchers += [engine.make_matcher("regex", f"r{i}", lambda ctx: None, name=f"r{i}") for i in range(20)]
    _CountedReads.reads = 0
    routes = Routes(_CountedReads(matchers))
    assert _CountedReads.reads <= 1, f"the matchers were read {_CountedReads.reads} times for 250 names"
    assert len(routes.commands["c7"]) == 21 and len(routes.message) == 20


# -- the asyncio entry points ----------------------------------------------------------------------

async def test_an_all_inline_event_completes_without_suspending_or_a_coroutine(engine):
    demote(add_cmd(engine, lambda ctx: "pong", name="ping"))
    out = Outcomes()
    run, rest = engine.start_event(Event(text="/cmd"), out)
    assert rest is None and run.done and run.completion.replies == 1
    assert [type(o).__name__ for o in out.items] == ["Reply", "Completion"]
    # process_event_async never suspends either: one send() runs it to the end.
    coro = engine.process_event_async(Event(text="/cmd"))
    with pytest.raises(StopIteration) as stop:
        coro.send(None)
    assert stop.value.value.done


async def test_start_event_hands_back_the_rest_of_a_dispatch_that_waits_for_a_slot():
    pool = ExecPool(1, 0, idle_seconds=5.0)
    gate = Gate()
    gate.fill(pool)
    engine = Engine(pool=pool, overflow="wait", overflow_wait=LIVENESS)
    try:
        promote(add_cmd(engine, lambda ctx: "slow", name="slow", priority=1))
        demote(add_cmd(engine, lambda ctx: "after", name="after"))
        run, rest = engine.start_event(Event(text="/cmd"))
        assert rest is not None and not run.done, "the slow handler waits for a slot"
        threading.Timer(0.02, gate.open).start()
        assert await asyncio.wait_for(rest, LIVENESS) is run
        completion = await asyncio.wait_for(run, LIVENESS)
        assert completion.replies == 2 and completion.errors == ()
    finally:
        gate.open()
        pool.drain(timeout=5)


# -- the profile's fast lane -----------------------------------------------------------------------

def test_fast_lane_runs_count_at_once_and_reach_the_window_in_order():
    p = ExecProfile()
    p.restore("demoted", [MID] * p.window)
    version = p.version
    samples = [FAST * (1 + i / 1000) for i in range(100)]
    for s in samples:
        p.record(s)
    assert p.runs == 100 and p.version == version + 100
    assert p.samples() == samples[-p.window:], "the window holds the last runs, oldest first"
    assert p.state is ProfileState.DEMOTED and p._n_not_fast == 0


def test_a_slow_run_is_judged_on_a_window_that_includes_the_fast_lane():
    # 15 slow samples of 32: p50 is not slow. 20 fast lane runs evict them all; one more slow run
    # must then find 1 slow sample in the window, not 16 (which would promote on p50).
    p = ExecProfile()
    p.restore("demoted", [SLOW] * 15 + [FAST] * 17)
    for _ in range(20):
        p.record(FAST)
    p.record(SLOW)
    assert p.state is ProfileState.DEMOTED, "the lane was not folded in before the slow run was judged"
    assert p._n_slow == 1


def test_the_lane_takes_only_runs_that_cannot_change_a_decision():
    p = ExecProfile()
    p.restore("demoted", [FAST] * p.window, proven_size=10)
    p.record(FAST, 10)
    assert len(p._lane) == 1, "fast, proven size, no error: the lane"
    p.record(FAST, 11)  # proves a larger size: under the lock
    p.record(FAST, 5, error="boom")
    p.record(MID, 5)
    assert len(p._lane) == 0 and p.proven_size == 11 and p.errors == 1
    learning = ExecProfile()
    learning.record(FAST)
    assert len(learning._lane) == 0 and learning._count == 1, "a learning profile judges every run"


def test_lane_and_locked_records_from_many_threads_agree_with_the_window():
    p = ExecProfile()
    p.restore("demoted", [FAST] * p.window, proven_size=100)
    threads, per_thread = 4, 3000
    start = threading.Barrier(threads + 1)

    def lane() -> None:
        start.wait()
        for _ in range(per_thread):
            p.record(FAST, 50)

    def locked() -> None:
        start.wait()
        for i in range(per_thread):
            p.record(MID if i % 2 else FAST, 200)  # a larger size than proven: never the lane

    workers = [threading.Thread(target=lane) for _ in range(threads)] + [threading.Thread(target=locked)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert p.runs == (threads + 1) * per_thread
    window = p.samples()
    assert p._count == len(window) == p.window
    assert p._n_not_fast == sum(s >= p.fast_threshold for s in window)
    assert p._n_slow == sum(s >= p.slow_threshold for s in window)


def test_inline_limit_is_the_decision_through_every_transition():
    p = ExecProfile(window=4, recent=2, min_samples=2)
    sizes = (0, 1024, 1025, 5000, 20_000, 20_001)

    def agrees() -> None:
        for size in sizes:
            inline = p.state is ProfileState.DEMOTED and size <= p.inline_max_size
            assert (p.should_pool(size) is ExecClass.SYNC) == inline, (p.state, size, p.inline_limit)

    agrees()  # learning
    for _ in range(4):
        p.record(FAST, 10)
        agrees()
    assert p.state is ProfileState.DEMOTED
    p.record(FAST, 5000)  # a larger proven size raises the limit
    agrees()
    assert p.should_pool(20_000) is ExecClass.SYNC
    p.record(1.0)  # promoted at once
    agrees()
    p.restore("demoted", [FAST] * 4, proven_size=100)
    agrees()
    p.quarantine("test")
    agrees()
    p.release_quarantine()
    for _ in range(p.recovery_needed):
        p.record(FAST)
    agrees()
    assert p.state is ProfileState.DEMOTED


# -- runs, events, contexts ------------------------------------------------------------------------

def test_a_run_completed_with_nobody_listening_builds_its_completion_when_read(engine):
    demote(add_cmd(engine, lambda ctx: "pong", name="ping"))
    run = engine.process_event(Event(text="/cmd", id="e1"))
    assert run.done and run._completion is None, "nothing built yet"
    completion = run.completion
    assert completion is run.completion, "built once"
    assert (completion.event_id, completion.matched, completion.replies) == ("e1", 1, 1)
    assert 0 <= completion.elapsed < LIVENESS
    assert run.wait(0) is completion


def test_an_inline_run_reads_the_clock_twice_per_handler_and_never_for_itself(engine, monkeypatch):
    # The run's clock is its handlers' (EventRun): the first start and the last end; each read
    # costs ~0.1 us on this path. One read each side of every handler, none for the run.
    import execapp.engine.engine as engine_module
    import execapp.engine.event as event_module

    reads: list[float] = []

    def clock() -> float:
        reads.append(real())
        return reads[-1]

    real = engine_module._clock
    monkeypatch.setattr(engine_module, "_clock", clock)
    monkeypatch.setattr(event_module, "monotonic", clock)
    demote(add_cmd(engine, lambda ctx: "one", name="one", priority=1))
    demote(add_cmd(engine, lambda ctx: "two", name="two"))
    out = Outcomes()
    completion = engine.process_event_sync(Event(text="/cmd"), out)
    assert len(reads) == 4, "two handlers, two reads each"
    assert completion.elapsed == reads[3] - reads[0], "first handler's start to last handler's end"
    assert [r.elapsed for r in out.replies] == [reads[1] - reads[0], reads[3] - reads[2]]
    reads.clear()
    nobody = engine.process_event_sync(Event(text="no handler"))
    assert reads == [] and nobody.elapsed == 0.0 and nobody.matched == 0, "no handler ran: 0 s, no read"


def test_a_pooled_run_is_timed_from_its_first_handler_to_its_last_release(engine):
    gate = Gate()
    promote(add_cmd(engine, lambda ctx: gate.event.wait(LIVENESS) and "pooled", name="pooled"))
    run = engine.process_event(Event(text="/cmd"))
    assert not run.done and run.completion is None
    started = run._started
    assert started is not None, "the first pooled submission starts the run's clock"
    gate.open()
    completion = run.wait(LIVENESS)
    assert completion is not None and run.done and completion.replies == 1
    assert completion.elapsed > 0


def test_done_and_completion_agree_for_runs_made_directly():
    run = EventRun(Event(id="e9"), None)
    assert not run.done and run.completion is None
    run.release()
    assert run.done and run.completion.event_id == "e9" and run.completion.elapsed == 0.0


def test_commands_are_found_by_the_first_word_of_the_text(engine):
    seen: list[str] = []
    demote(engine.on_command("ping", lambda ctx: seen.append(f"ping:{ctx.args}")))
    demote(engine.on_command("p", lambda ctx: seen.append(f"p:{ctx.args}")))
    for text in ("/ping", "/ping  a b ", "/p", "/pin", "//ping", "/", "ping", "/ping\tx", "/p ing"):
        engine.process_event_sync(Event(text=text))
    assert seen == ["ping:", "ping:a b", "p:", "p:ing"]
    assert engine._routes.heads == {f"/{name}": plan for name, plan in engine._routes.commands.items()}


def test_profile_record_takes_no_keyword_only_parameters():
    # Every inline run calls ExecProfile.record: CPython 3.11 specialises (runs in the caller's
    # interpreter frame) only calls of functions without keyword-only parameters.
    kinds = {p.kind for p in inspect.signature(ExecProfile.record).parameters.values()}
    assert inspect.Parameter.KEYWORD_ONLY not in kinds


def _child_ids(conn) -> None:
    conn.send([Event().id for _ in range(200)])
    conn.close()


def test_event_ids_stay_unique_in_a_forked_child():
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    Event()  # the parent's counter is in use before the fork
    proc = ctx.Process(target=_child_ids, args=(child,))
    proc.start()
    theirs = parent.recv()
    proc.join(LIVENESS)
    ours = [Event().id for _ in range(200)]
    assert len(set(theirs)) == 200 and all(len(i) == 16 for i in theirs)
    assert not set(theirs) & set(ours), "the child repeated the parent's ids"


def test_a_pooled_context_gets_its_own_copy_of_empty_data_too():
    event = Event("x")
    pooled = Context.for_pool(event, "", object())
    pooled.event.data["k"] = 1
    assert event.data == {}


# -- the watchdog slot and running_handlers --------------------------------------------------------

def test_the_slot_names_each_inline_run_when_matchers_alternate(engine):
    shared = mmap.mmap(-1, 64)
    engine.set_inline_slot(memoryview(shared))
    seen: list[tuple[str, bytes]] = []

    def look(name):
        return lambda ctx: seen.append((name, bytes(shared[0:64])))

    demote(add_cmd(engine, look("first.handler"), name="first.handler", pattern="a"))
    demote(add_cmd(engine, look("second"), name="second", pattern="b"))
    for text in ("/a", "/a", "/b", "/a", "/b", "/b"):
        engine.process_event_sync(Event(text=text))
        assert shared[0] == 0, "cleared after every run"
    assert [mark for _, mark in seen] == [make_mark(name) for name, _ in seen]


def test_running_handlers_sees_inline_and_pooled_runs(engine):
    seen: dict[str, list[str]] = {}
    demote(add_cmd(engine, lambda ctx: seen.setdefault("inline", running_handlers()), name="on.loop", pattern="i"))
    promote(add_cmd(engine, lambda ctx: seen.setdefault("pooled", running_handlers()), name="in.pool",
                    pattern="p"))
    engine.process_event(Event(text="/i"))
    assert engine.process_event(Event(text="/p")).wait(LIVENESS) is not None
    assert seen == {"inline": ["on.loop"], "pooled": ["in.pool"]}
