"""Instance strategies at the boundary where they make instances: a new instance's top level is
part of the call that needs it, so it stops by that call's deadline (the inline budget on the
event loop), not by a budget of its own."""
from __future__ import annotations

import dataclasses
import time

import pytest

from execapp.engine import HandlerTimeout
from plugins.loaded import LoadedPlugin, validate
from plugins.spec import PluginSpec


def event(args: str = "x") -> dict:
    return {"id": "e1", "type": "message", "text": f"/h {args}", "args": args, "data": {}, "session": None}


# A top level that does ~0.1-0.5 s of work (well within its 10 s timeout, so it is valid), then
# defines a fast handler. Lua has no clock in its sandbox: the work is a loop.
LUA_SLOW_TOP = """
local n = 0
for i = 1, 2e7 do n = n + i end
function h(e) return "ok" end
"""


@pytest.mark.parametrize("strategy", ["pooled", "sharded"])
def test_a_new_lua_instance_top_level_stops_by_the_calls_inline_deadline(strategy: str) -> None:
    spec = PluginSpec(name="slow-top", runtime="lua", code=LUA_SLOW_TOP, timeout=10.0, strategy=strategy,
                      pool_size=1, shard_count=1)
    plugin = LoadedPlugin(spec)
    try:
        # Inline on the event loop: no wait, and a budget far shorter than the top level. The new
        # instance's top level used to get the plugin's whole timeout_ms, then the handler ran
        # (and answered "ok") with the loop held for the top level's full length.
        with pytest.raises(HandlerTimeout):
            plugin.call("h", event(), False, time.monotonic() + 0.01)
        # In a pool thread, with the plugin's own budget, the instance is made and serves.
        assert plugin.call("h", event(), True, None) == "ok"
        assert plugin.call("h", event(), False, time.monotonic() + 0.05) == "ok"  # warm now
    finally:
        plugin.close()


def test_a_new_js_instance_top_level_stops_by_the_calls_inline_deadline() -> None:
    # The top level is quick when validated, then spins for 8 s in every Context made once
    # `start` (epoch ms) has passed: what a hostile plugin's pooled instances do on the loop.
    start = int(time.time() * 1000) + 300
    code = (f"if (Date.now() >= {start}) {{ while (Date.now() < {start + 8000}) {{}} }}\n"
            "function h(e) { return 'ok'; }\n")
    spec = PluginSpec(name="slow-top-js", runtime="js", code=code, timeout=20.0, strategy="pooled", pool_size=1,
                      shard_count=1)
    compiled = validate(spec)
    time.sleep(max(0.0, start / 1000 - time.time()) + 0.05)  # the point of the test: past `start`
    for strategy in ("pooled", "sharded"):
        plugin = LoadedPlugin(dataclasses.replace(spec, strategy=strategy), compiled)
        try:
            began = time.monotonic()
            with pytest.raises(HandlerTimeout):
                plugin.call("h", event(), False, time.monotonic() + 0.02)
            # Generous: stopped within the watchdog's passes, where it used to spin the whole 8 s.
            assert time.monotonic() - began < 4.0, strategy
        finally:
            plugin.close()


# -- the sender's tenant ----------------------------------------------------------------------------

def engine_event(tenant: str, session: str | None = "room-1") -> dict:
    """What a LoadedPlugin gets from the engine for a client's event: Event.to_dict() and the args."""
    from execapp.engine import Event

    return {**Event(text="/who x", session=session, tenant=tenant).to_dict(), "args": "x"}


@pytest.mark.parametrize("runtime, code", [
    ("lua", "function who(e) return e.tenant .. '/' .. e.session end"),
    ("js", "function who(e) { return e.tenant + '/' + e.session; }"),
])
@pytest.mark.parametrize("strategy", ["per_request", "pooled", "sharded"])
def test_a_handler_sees_the_sender_s_tenant_beside_the_session(runtime: str, code: str, strategy: str) -> None:
    """Two tenants may both name a session "room-1": a plugin keeps their state apart by keying it
    with event.tenant (docs/plugins.md, "Tenants")."""
    plugin = LoadedPlugin(PluginSpec(name=f"who-{runtime}", runtime=runtime, code=code, strategy=strategy,
                                     timeout=5.0, pool_size=1, shard_count=2))
    try:
        assert plugin.call("who", engine_event("aaaa"), True, None) == "aaaa/room-1"
        assert plugin.call("who", engine_event("bbbb"), True, None) == "bbbb/room-1"
    finally:
        plugin.close()


def test_the_engine_s_event_takes_the_js_fast_path_with_its_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's event (seven fields) crosses as call arguments, not as one JSON string."""
    from plugins.runtimes.js import JsInstance

    def no_json_path(self: object, attr: str, name: str) -> None:
        raise AssertionError(f"the JSON entry point {name} was used for the engine's event")

    plugin = LoadedPlugin(PluginSpec(name="who-fast", runtime="js", code="function who(e) { return e.tenant; }",
                                     strategy="pooled", timeout=5.0, pool_size=1))
    try:
        monkeypatch.setattr(JsInstance, "_entry", no_json_path)
        assert plugin.call("who", engine_event("cccc"), True, None) == "cccc"
    finally:
        plugin.close()


def test_shards_are_picked_by_tenant_and_session() -> None:
    from plugins.runtimes.wasm import _abi_event
    from plugins.strategies import shard_key

    a, b = engine_event("aaaa"), engine_event("bbbb")
    assert shard_key(a) != shard_key(b) and shard_key(a) == shard_key(engine_event("aaaa"))
    assert shard_key({"session": "room-1", "id": "e"}) == "room-1"  # no tenant known: the session
    lone = engine_event("aaaa", session=None)
    assert shard_key(lone) == lone["id"]  # no session: the event's id
    assert _abi_event(a)["tenant"] == "aaaa"  # WASM guests get it in their JSON event too
