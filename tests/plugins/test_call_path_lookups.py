"""The plugin call path calls methods of the class, not bound methods kept on the instance.

``self._take(...)`` where ``_take`` is an instance attribute holding a bound method (a shortcut
that saved a lookup before Python 3.11) is a method lookup 3.11's specializing interpreter
cannot specialize: ~160 instructions each, ten of them were ~4% of a pooled Lua call
(docs/benchmarks.md, "perf-lua pass"). A local (``f = self._f; f(...)``) or a call on the
object itself (``self._tokens.pop()``) is specialized. No timing here: the bytecode is checked.
"""
from __future__ import annotations

import dis
import time
from typing import Any, Callable

from plugins.loaded import LoadedPlugin
from plugins.runtimes import lua
from plugins.spec import PluginSpec
from plugins.strategies import PerRequest, Pooled, Sharded, Slots

CODE = "function echo(e) return e.text end\n"
EVENT = {"id": "e1", "type": "message", "text": "/x", "args": "", "data": None, "session": "s1", "tenant": "t1"}


def _bound_method_attribute_calls(fn: Callable[..., Any], obj: Any) -> list[str]:
    """The names ``fn`` calls as ``self.<name>(...)`` that are bound methods stored on ``obj``."""
    found = []
    previous = None
    for ins in dis.get_instructions(fn):
        method_call = ins.opname == "LOAD_METHOD" or (ins.opname == "LOAD_ATTR" and "NULL|self" in ins.argrepr)
        if method_call and previous is not None and previous.opname == "LOAD_FAST" and previous.argval == "self":
            value = getattr(obj, "__dict__", {}).get(ins.argval)
            if value is not None and callable(value) and not isinstance(value, type):
                found.append(ins.argval)
        previous = ins
    return found


def _loaded(strategy: str) -> LoadedPlugin:
    plugin = LoadedPlugin(PluginSpec(name=f"lookups-{strategy}", runtime="lua", code=CODE, strategy=strategy,
                                     timeout=2.0, pool_size=1, shard_count=1, max_concurrency=4))
    assert plugin.call("echo", EVENT) == "/x"  # instances made: every attribute the path reads exists
    return plugin


def test_the_strategies_calls_do_not_go_through_bound_methods_stored_on_the_instance() -> None:
    for strategy, cls in (("pooled", Pooled), ("sharded", Sharded), ("per_request", PerRequest)):
        plugin = _loaded(strategy)
        try:
            s = plugin.strategy
            assert type(s) is cls
            assert _bound_method_attribute_calls(cls.call, s) == [], strategy
            assert _bound_method_attribute_calls(Slots.take, s.slots) == []
            assert _bound_method_attribute_calls(Slots.give, s.slots) == []
        finally:
            plugin.close()


def test_the_lua_call_paths_do_not_go_through_bound_methods_stored_on_the_vm() -> None:
    plugin = _loaded("pooled")
    try:
        inst = plugin.strategy._free[0]  # type: ignore[attr-defined]
        assert isinstance(inst, lua.LuaInstance)
        for fn in (lua.LuaInstance.call, lua._LuaVM.call_env, lua.LuaCompiled.call_isolated):
            assert _bound_method_attribute_calls(fn, inst) == [], fn.__qualname__
        assert inst.call("echo", EVENT, time.monotonic() + 2) == "/x"
    finally:
        plugin.close()


def test_the_lua_per_request_call_runs_its_fresh_environment_in_one_frame() -> None:
    # call_isolated is the whole per_request Lua call: it does not call the VM's call_fresh (a
    # frame, ~500 instructions a call); call_fresh goes through it instead.
    assert "call_fresh" not in lua.LuaCompiled.call_isolated.__code__.co_names
    assert "call_isolated" in lua._LuaVM.call_fresh.__code__.co_names
