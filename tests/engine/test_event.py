"""Events, contexts and the per-event run: the records a caller gets back."""
from __future__ import annotations

import dataclasses
import threading

import pytest

from execapp.engine import Completion, Context, Engine, Event, EventRun, ExecClass, Reply

from .helpers import LIVENESS


def test_event_ids_are_unique_16_hex_digits():
    ids = {Event().id for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids)


def test_outcome_records_are_frozen_dataclasses():
    reply = Reply("e1", "m", None, "hi", None, ExecClass.SYNC, 0.5)
    assert reply == Reply("e1", "m", None, "hi", None, ExecClass.SYNC, 0.5)
    assert dataclasses.replace(reply, text="yo").text == "yo"
    assert dataclasses.asdict(reply)["matcher"] == "m"
    with pytest.raises(dataclasses.FrozenInstanceError):
        reply.text = "changed"  # type: ignore[misc]
    completion = Completion("e1", 1, 1, (), None, 0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        completion.replies = 2  # type: ignore[misc]
    assert "replies=1" in repr(completion)


def test_context_for_pool_is_a_deep_private_copy():
    event = Event(type="x", data={"a": [1], "b": {"c": 2}}, session="s1", tenant="t1")
    ctx = Context(event, "args", object(), ExecClass.SYNC)
    pooled = Context.for_pool(ctx.event, ctx.args, ctx.matcher)
    assert pooled is not ctx and pooled.exec_class is ExecClass.POOL
    assert (pooled.event.id, pooled.event.type, pooled.event.session, pooled.event.tenant, pooled.args) == (
        event.id, "x", "s1", "t1", "args")
    assert pooled.event.to_dict() == {**event.to_dict(), "data": event.data}
    pooled.event.data["a"].append(2)
    pooled.event.data["b"]["c"] = 3
    assert event.data == {"a": [1], "b": {"c": 2}}


def test_replies_queue_until_the_handler_returns():
    ctx = Context(Event(), "", None, ExecClass.SYNC)
    ctx.reply("one")
    ctx.reply(data={"k": 1})
    ctx.reply(42)  # text is always a string
    assert ctx._replies == [("one", None), (None, {"k": 1}), ("42", None)]


def test_an_all_inline_event_is_complete_when_dispatch_returns():
    engine = Engine(pool_enabled=False)
    engine.on_event("x", lambda ctx: "done")
    run = engine.process_event(Event(type="x"))
    assert run.completion is not None and run.completion.replies == 1
    assert run.wait(0) is run.completion
    seen: list[Completion] = []
    run.add_done_callback(seen.append)
    assert seen == [run.completion], "a callback added after completion runs at once"


def test_a_run_completes_once_after_its_last_hold():
    run = EventRun(Event(), None)
    run.hold()
    run.hold()
    seen: list[Completion] = []
    run.add_done_callback(seen.append)
    run.add_done_callback(lambda c: 1 / 0)  # a failing callback must not stop the others
    run.add_done_callback(seen.append)
    release = [threading.Thread(target=run.release) for _ in range(2)]
    for t in release:
        t.start()
    for t in release:
        t.join()
    assert run.completion is None and seen == []
    run.release()  # the dispatcher's own hold
    assert run.wait(LIVENESS) is not None
    assert seen == [run.completion, run.completion]


def test_emit_counts_replies_and_failures():
    engine = Engine(pool_enabled=False)
    engine.on_event("x", lambda ctx: ctx.reply("a") or ctx.reply("b"))
    engine.on_event("x", lambda ctx: 1 / 0, matcher_name="bad")
    completion = engine.process_event_sync({"type": "x"})
    assert completion.replies == 2 and [f.matcher for f in completion.errors] == ["bad"]
    assert completion.matched == 2 and completion.elapsed >= 0


def test_a_pooled_copy_of_plain_data_runs_no_python_per_value():
    # copy.deepcopy walked the data in Python on the dispatching thread (the event loop): ~30 ms of
    # it per pooled handler for a 60 KB event of 15,000 empty lists. Counted here as Python calls.
    import sys

    event = Event("x", data={"a": [[] for _ in range(15_000)], "b": [{"k": i} for i in range(1_000)]})
    calls = 0

    def count(frame, what, arg):
        nonlocal calls
        calls += what == "call"

    # A collection during the copy would run other tests' finalizers and weakref callbacks,
    # Python calls that are not the copy's: none runs while it is measured.
    import gc

    gc.collect()
    gc.disable()
    sys.setprofile(count)
    try:
        pooled = Context.for_pool(event, "", object())
    finally:
        sys.setprofile(None)
        gc.enable()
    assert calls < 50, calls
    assert pooled.event.data == event.data and pooled.event.data["a"][0] is not event.data["a"][0]


def test_a_pooled_copy_keeps_what_a_deep_copy_keeps():
    shared = [1, 2]
    data = {"t": (1, "x"), 3: "int key", "s1": shared, "s2": shared, "f": frozenset({1})}
    data["self"] = data  # a cycle
    copied = Context.for_pool(Event("x", data=data), "", object()).event.data
    assert copied["t"] == (1, "x") and copied[3] == "int key" and copied["f"] == frozenset({1})
    assert copied["s1"] is copied["s2"] and copied["s1"] is not shared
    assert copied["self"] is copied
    # Not picklable: deep-copied as before (a function is kept, not copied).
    fn = lambda: None  # noqa: E731
    assert Context.for_pool(Event("x", data={"fn": fn}), "", object()).event.data["fn"] is fn
