"""JS fast paths (issue 14): the prelude from cached bytecode, the event's strings as arguments.

Both must be invisible to a guest: the same globals, the same host API, the same event object,
the same errors; and each falls back (source prelude, JSON event) where it cannot apply.
"""
from __future__ import annotations

import pytest

from plugins.errors import PluginInvalid
from plugins.loaded import LoadedPlugin, validate
from plugins.runtimes import js
from plugins.spec import PluginSpec

SHOW = """
function show(e) { return JSON.stringify([Object.keys(e), e]); }
function api(e) { return [typeof log, typeof kv_get, typeof kv_set, typeof sleep, typeof http_get].join(); }
async function logs(e) { log("from " + e.args); await sleep(1); return "logged " + e.args; }
"""


def make(strategy: str = "per_request", **limits) -> LoadedPlugin:
    return LoadedPlugin(PluginSpec(name="t-compiled", runtime="js", code=SHOW, strategy=strategy, timeout=1.0,
                                   permissions=frozenset({"log", "sleep"}), **limits))


def engine_event(**over) -> dict:
    """The event shape engine_handler passes (Event.to_dict() + args): the fast path's."""
    return {"id": "e1", "type": "message", "text": "/show ünï ✓", "data": {}, "session": None, "args": "ünï ✓",
            **over}


class Shaped(dict):
    """A dict of another class: the general path (the whole event as one JSON string)."""


def test_the_prelude_runs_from_bytecode_compiled_once_per_process():
    plugin = make()
    try:
        assert plugin.call("api", engine_event()) == "function,function,function,function,function"
        assert isinstance(js._prelude._code, bytes) and len(js._prelude._code) > 0, \
            "the bytecode check failed: every Context compiles the prelude's source"
        assert plugin.call("logs", engine_event()) == "logged ünï ✓", "async host calls work from bytecode"
    finally:
        plugin.close()


@pytest.mark.parametrize("strategy", ["per_request", "pooled", "sharded"])
def test_a_guest_sees_the_same_event_through_either_path(strategy: str):
    plugin = make(strategy)
    try:
        for event in (engine_event(), engine_event(data={"n": [1, {"k": None}]}, session="s1"),
                      engine_event(text="", args="")):
            fast = plugin.call("show", event)
            general = plugin.call("show", Shaped(event))
            assert fast == general
        # Not the engine's shape (a missing field, a number, an extra key): the general path.
        assert plugin.call("show", {"id": "e2", "args": "a"}) == '[["id","args"],{"id":"e2","args":"a"}]'
        odd = engine_event(id=7)
        assert plugin.call("show", odd) == plugin.call("show", Shaped(odd))
    finally:
        plugin.close()


def test_without_bytecode_the_prelude_is_compiled_from_source(monkeypatch):
    source_only = js._PreludeBytecode()
    source_only._checked = True  # as after a failed check: no bytecode
    monkeypatch.setattr(js, "_prelude", source_only)
    plugin = make()
    try:
        assert plugin.call("api", engine_event()) == "function,function,function,function,function"
        assert plugin.call("logs", engine_event(args="x")) == "logged x"
    finally:
        plugin.close()


def test_a_memory_cap_too_small_for_the_prelude_is_refused_at_save():
    with pytest.raises(PluginInvalid) as info:
        validate(PluginSpec(name="tiny", runtime="js", code=SHOW, memory_bytes=64 << 10))
    assert "memory" in str(info.value)


REPLIES = r"""
function reply(e) {
  const values = {nul: "a\u0000b", lone: "a\ud800b", pair: "ok \u2713 \ud83d\ude00", empty: "", int: 3, float: 2.5,
                  nan: NaN, inf: -Infinity, yes: true, no: false, nothing: null, undef: undefined,
                  obj: {a: 1, b: [null, "x"]}, arr: [1, "two"], fn: function () {}};
  return values[e.args];
}
"""


@pytest.mark.parametrize("args, expected", [
    ("nul", "a\x00b"), ("lone", "a\ud800b"), ("pair", "ok \u2713 \U0001F600"), ("empty", ""), ("int", "3"),
    ("float", "2.5"), ("nan", None), ("inf", None), ("yes", "true"), ("no", "false"), ("nothing", None),
    ("undef", None), ("obj", {"a": 1, "b": [None, "x"]}), ("arr", [1, "two"]), ("fn", None),
])
def test_every_kind_of_reply_arrives_as_its_json_would(args: str, expected):
    # Strings come back as themselves (not through JSON) unless the binding cannot carry them
    # (a NUL would cut the string short, a lone surrogate fails its conversion): then as JSON.
    plugin = LoadedPlugin(PluginSpec(name="t-replies", runtime="js", code=REPLIES, strategy="pooled", timeout=1.0))
    try:
        for event in (engine_event(args=args), Shaped(engine_event(args=args))):
            reply = plugin.call("reply", event)
            assert reply == expected and type(reply) is type(expected)
    finally:
        plugin.close()
