"""loadplugins and runplugin, as an operator runs them."""
from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from plugins.models import Plugin, RegistryState

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue().strip()


def test_loadplugins_is_idempotent() -> None:
    assert "7 created" in run("loadplugins")
    version = RegistryState.current()
    assert "7 unchanged" in run("loadplugins")
    assert RegistryState.current() == version  # nothing saved, no refresh triggered
    assert sorted(Plugin.objects.values_list("name", flat=True)) == [
        "add", "counter", "echo", "guard", "ping", "slow", "upper"]
    # Edited since it was loaded (issue 12: `make run` used to overwrite admin edits): kept, and said so.
    Plugin.objects.filter(name="ping").update(source='function ping(e) return "x" end')
    out = run("loadplugins")
    assert "ping (lua): skipped: edited since it was loaded" in out and "1 skipped" in out
    assert run("runplugin", "ping", "ping", '{"text": "/ping"}') == "x"
    assert "1 updated" in run("loadplugins", "--force")
    assert run("runplugin", "ping", "ping", '{"text": "/ping"}') == "pong"
    assert "7 unchanged" in run("loadplugins")


@pytest.mark.parametrize("plugin,handler,event,reply", [
    ("ping", "ping", {"text": "/ping"}, "pong"),
    ("echo", "echo", {"text": "/echo some text"}, "some text"),
    ("slow", "slow", {"text": "/slow 10"}, "slept 10"),
    ("upper", "upper", {"text": "/upper abc"}, "ABC"),
    ("add", "add", {"text": "/add 19 23"}, "42"),
    ("counter", "count", {"text": "/count"}, "1"),
    ("guard", "guard", {"text": "this is forbidden"}, "blocked"),
])
def test_runplugin_prints_each_examples_reply(plugin: str, handler: str, event: dict, reply: str) -> None:
    run("loadplugins")
    assert run("runplugin", plugin, handler, json.dumps(event)) == reply


def test_runplugin_reports_errors_with_their_code() -> None:
    run("loadplugins")
    with pytest.raises(CommandError, match=r"\[handler_error\] plugin 'ping' handler 'nope'"):
        run("runplugin", "ping", "nope", "{}")
    with pytest.raises(CommandError, match="no plugin 'ghost'"):
        run("runplugin", "ghost", "x", "{}")
    with pytest.raises(CommandError, match="not JSON"):
        run("runplugin", "ping", "ping", "{oops")


@pytest.mark.parametrize("event, message", [
    ({"text": 5}, r"\[bad_event\] text must be a string for a \"message\" event, got int 5"),
    ({"type": "message", "text": None}, r"\[bad_event\] text must be a string"),
    ({"text": "/ping", "data": [1]}, r"\[bad_event\] data must be a JSON object"),
    ({"text": "/ping", "args": 3}, r"\[bad_event\] args must be a string"),
    ({"text": "/ping", "bogus": 1}, r"\[bad_event\] bogus: unknown field"),
    ({"text": "/ping \ud800"}, r"\[bad_event\] text: not valid Unicode"),
])
def test_runplugin_checks_the_event_as_the_server_checks_a_frame(event: dict, message: str) -> None:
    # A text of another type was an AttributeError traceback; a lone surrogate reached the guest.
    run("loadplugins")
    with pytest.raises(CommandError, match=message):
        run("runplugin", "ping", "ping", json.dumps(event))


def test_runplugin_names_a_stored_plugin_that_no_longer_loads() -> None:
    # Stored before a runtime or limit changed (or edited in the database): a CompileError traceback.
    run("loadplugins")
    Plugin.objects.filter(name="ping").update(source="function ping(e) return end end")
    with pytest.raises(CommandError, match=r"\[plugin_invalid\] plugin 'ping' does not load: the lua runtime "
                                           r"refused its code: ping:1: <eof> expected near 'end'; fix it in the admin"):
        run("runplugin", "ping", "ping", '{"text": "/ping"}')
    assert run("runplugin", "echo", "echo", '{"type": "tick", "args": "given"}') == "given"


@pytest.mark.parametrize("change, message", [
    ({"timeout_ms": "abc"}, "plugins[0] ('m'): timeout_ms must be a whole number of at least 1, got \"abc\""),
    ({"timeout_ms": True}, "timeout_ms must be a whole number of at least 1, got true"),  # was a 1 ms timeout
    ({"permissions": "kv"}, "permissions must be a list of strings, got \"kv\""),  # was read as 'k', 'v'
    ({"http_allowlist": "x.com"}, "http_allowlist must be a list of strings"),
    ({"enabled": "no"}, "enabled must be true or false"),
    ({"timeout": 500}, "unknown key 'timeout'; use name, runtime, file"),  # a typo was ignored
    ({"file": "missing.lua"}, "file 'missing.lua' cannot be read (No such file or directory)"),
    ({"file": "binary.lua"}, "file 'binary.lua' is not UTF-8 text"),
    ({"bindings": "x"}, "bindings must be a list of objects"),
    ({"bindings": [{"pattern": "x", "handler": "h", "priority": "high"}]},
     "plugins[0] ('m') bindings[0]: priority must be a whole number, got \"high\""),
    ({"bindings": [{"pattern": "x"}]}, "bindings[0]: 'handler' is missing"),
    # Past the column's range: an OverflowError traceback on SQLite, a DataError on PostgreSQL.
    ({"quota_kv_bytes": 10**30}, "quota_kv_bytes must be a whole number of at least 0 and at most "
                                 "9223372036854775807, got 1000000000000000000000000000000"),
    ({"quota_kv_keys": 2**40}, "quota_kv_keys must be a whole number of at least 0 and at most 2147483647"),
    ({"bindings": [{"pattern": "x", "handler": "h", "priority": 2**31}]},
     "bindings[0]: priority must be a whole number and at most 2147483647, got 2147483648"),
    ({"bindings": [{"pattern": "x", "handler": "h", "priority": -2**63}]},
     "bindings[0]: priority must be at least -2147483648, got -9223372036854775808"),
    # SQLite does not check a length: a 500 KB event pattern made a 500 KB matcher name.
    ({"bindings": [{"kind": "event", "pattern": "y" * 201, "handler": "h"}]},
     "bindings[0]: pattern must be at most 200 characters, got 201"),
    ({"description": "d" * 100_000}, "plugins[0] ('m'): description must be at most 200 characters, got 100000"),
    ({"name": None}, "plugins[0]: name must be a string, got null"),
])
def test_loadplugins_names_a_bad_manifest_value_and_loads_nothing(tmp_path: Path, change: dict, message: str) -> None:
    # Each of these was a Python traceback, a misread value or a silently ignored key.
    (tmp_path / "a.lua").write_text("function h(e) return 'x' end")
    (tmp_path / "binary.lua").write_bytes(b"\x00asm\xff\xfe")
    entries = [{"name": "ok", "runtime": "lua", "file": "a.lua"}, {"name": "m", "runtime": "lua", "file": "a.lua"}]
    entries[1].update(change)
    (tmp_path / "manifest.json").write_text(json.dumps({"plugins": entries[1:] + entries[:1]}))
    with pytest.raises(CommandError) as info:
        run("loadplugins", "--dir", str(tmp_path))
    assert str(info.value).startswith("[bad_manifest] manifest.json: ") and message in str(info.value)
    assert not Plugin.objects.exists()  # checked before anything is saved


@pytest.mark.parametrize("manifest", ["{oops", "[1]", '{"plugins": {"name": "m"}}', '{"plugins": [1]}'])
def test_loadplugins_names_a_manifest_of_the_wrong_shape(tmp_path: Path, manifest: str) -> None:
    (tmp_path / "manifest.json").write_text(manifest)
    with pytest.raises(CommandError, match=r"\[bad_manifest\] manifest.json: "):
        run("loadplugins", "--dir", str(tmp_path))


def test_loadplugins_refuses_a_broken_plugin_with_the_runtime_message(tmp_path: Path) -> None:
    (tmp_path / "bad.js").write_text("function hello(ev) { return 'x' ")
    (tmp_path / "manifest.json").write_text(json.dumps({"plugins": [
        {"name": "bad", "runtime": "js", "file": "bad.js",
         "bindings": [{"kind": "command", "pattern": "hello", "handler": "hello"}]}]}))
    with pytest.raises(CommandError) as info:
        run("loadplugins", "--dir", str(tmp_path))
    assert "[plugin_invalid] plugin 'bad'" in str(info.value) and "SyntaxError" in str(info.value)
    assert not Plugin.objects.filter(name="bad").exists()


def test_loadplugins_refuses_code_over_the_size_limit(tmp_path: Path) -> None:
    # A manifest's files have no upload limit in front of them: the code's own limit holds.
    from plugins.runtimes.registry import MAX_CODE_BYTES

    (tmp_path / "big.lua").write_text("function hello(ev) return 'x' end\n" + "-- padding\n" * (MAX_CODE_BYTES // 11))
    (tmp_path / "manifest.json").write_text(json.dumps({"plugins": [
        {"name": "big", "runtime": "lua", "file": "big.lua",
         "bindings": [{"kind": "command", "pattern": "hello", "handler": "hello"}]}]}))
    with pytest.raises(CommandError, match=r"\[plugin_invalid\] plugin 'big'.* over the limit of 4194304 bytes"):
        run("loadplugins", "--dir", str(tmp_path))
    assert not Plugin.objects.filter(name="big").exists()
