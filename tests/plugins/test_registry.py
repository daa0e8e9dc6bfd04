"""The registry models and the admin: validation on save, uploads, enable/disable, version bumps."""
from __future__ import annotations

import html
import re
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import override_settings

from execapp.engine.linear_regex import LinearRegex
from plugins.errors import PluginInvalid
from plugins.models import Binding, Plugin, RegistryState
from plugins.runtimes.wasm import wat_to_wasm

from .guests import WAT

pytestmark = pytest.mark.django_db


def test_saving_broken_code_is_refused_with_the_runtime_message() -> None:
    with pytest.raises(PluginInvalid) as info:
        Plugin.objects.create(name="bad", runtime="lua", source="function broken(")
    assert "plugin 'bad'" in str(info.value) and "<eof>" in str(info.value)
    assert not Plugin.objects.filter(name="bad").exists()


def test_a_binding_to_a_missing_handler_is_refused() -> None:
    plugin = Plugin.objects.create(name="p", runtime="js", source="function hello(ev) { return 'hi'; }")
    Binding.objects.create(plugin=plugin, pattern="hello", handler="hello")
    with pytest.raises(PluginInvalid) as info:
        Binding.objects.create(plugin=plugin, pattern="bye", handler="bye")
    assert "plugin 'p': handler 'bye' is not defined" in str(info.value) and "hello" in str(info.value)


def test_a_regex_binding_needs_a_pattern_re2_runs_in_linear_time() -> None:
    plugin = Plugin.objects.create(name="p", runtime="js", source="function hello(ev) { return 'hi'; }")
    with pytest.raises(PluginInvalid, match=r"plugin 'p' handler 'hello': regex 'hel\(\?=lo\)' is not RE2 syntax"):
        Binding.objects.create(plugin=plugin, kind="regex", pattern="hel(?=lo)", handler="hello")
    Binding.objects.create(plugin=plugin, kind="regex", pattern="(?i)^hel+o", handler="hello")
    assert plugin.bindings.count() == 1


def test_a_disabled_bindings_regex_hint_is_matched_in_linear_time() -> None:
    """The hint for a message nobody matched tries the disabled bindings' patterns on the loop."""
    from plugins import sync

    sync._use_hints({("regex", r"(a+)+$"): "plugin 'p' is disabled"})
    try:
        # With backtracking, this holds the GIL for hours (a child process would be needed to
        # see it fail; the engine's own test does that): RE2 answers at once.
        assert sync.unmatched_hint("message", "a" * 40 + "b") is None
        assert sync.unmatched_hint("message", "aaa") == ("no enabled handler matched; regex '(a+)+$' would have: "
                                                         "plugin 'p' is disabled")
        assert isinstance(sync._regex_hints[0][0], LinearRegex)
    finally:
        sync._use_hints({})


@pytest.mark.parametrize("field, value, limit", [("memory_mb", 1025, 1024), ("pool_size", 257, 256),
                                                ("shard_count", 1000, 256), ("max_concurrency", 10**6, 256)])
def test_what_one_plugin_may_make_each_worker_hold_is_bounded(field: str, value: int, limit: int) -> None:
    with pytest.raises(PluginInvalid, match=f"plugin 'big': {field} {value} is above {limit}"):
        Plugin.objects.create(name="big", runtime="lua", source="function a(ev) return 'a' end", **{field: value})
    assert not Plugin.objects.filter(name="big").exists()
    Plugin.objects.create(name="big", runtime="lua", source="function a(ev) return 'a' end", **{field: limit})


@pytest.mark.parametrize("entry", ["https://api.example.com", "api.example.com:8443", "api.example.com/v1", "*",
                                   "*.*", "*example.com", "user@api.example.com", "api..example.com",
                                   "api.example.com."])
def test_an_allowlist_entry_that_can_match_no_host_is_refused_naming_it(entry: str) -> None:
    # host_allowed compares a URL's host name with each entry: these matched nothing, and every
    # http_get to the host the operator meant was denied at run time instead.
    from plugins.runtimes.host import host_allowed

    assert not host_allowed("api.example.com", (entry,))
    with pytest.raises(PluginInvalid, match=re.escape(f"http_allowlist entry '{entry}' is not a host name")):
        Plugin.objects.create(name="h", runtime="lua", source="function a(ev) return 'a' end",
                              http_allowlist=f"ok.example.com\n{entry}")
    good = "api.example.com\n*.example.org, 203.0.113.5\n[2001:db8::1]\nbücher.de"
    Plugin.objects.create(name="h", runtime="lua", source="function a(ev) return 'a' end", http_allowlist=good)


def test_editing_code_away_from_a_bound_handler_is_refused() -> None:
    plugin = Plugin.objects.create(name="p", runtime="lua", source="function a(ev) return 'a' end")
    Binding.objects.create(plugin=plugin, pattern="a", handler="a")
    plugin.source = "function b(ev) return 'b' end"
    with pytest.raises(PluginInvalid, match="handler 'a' is not defined"):
        plugin.save()


def test_wat_source_is_compiled_to_a_module_and_versioned() -> None:
    plugin = Plugin.objects.create(name="w", runtime="wasm", source=WAT)
    assert bytes(plugin.module) == wat_to_wasm(WAT)
    first = plugin.version
    plugin.source = WAT.replace("(i32.const 104)", "(i32.const 72)")
    plugin.save()
    assert plugin.version and plugin.version != first


def test_every_change_bumps_the_registry_version() -> None:
    v0 = RegistryState.current()
    plugin = Plugin.objects.create(name="p", runtime="lua", source="function a(ev) return 'a' end")
    binding = Binding.objects.create(plugin=plugin, pattern="a", handler="a")
    binding.delete()
    plugin.delete()
    assert RegistryState.current() == v0 + 4


@pytest.fixture
def admin_client(client, django_user_model):
    user = django_user_model.objects.create_superuser("admin", "admin@example.com", "pw")
    client.force_login(user)
    return client


def _form(**overrides):
    data = {"name": "up", "description": "", "runtime": "lua", "enabled": "on", "source": "",
            "permissions": ["log"], "http_allowlist": "", "timeout_ms": "1000", "memory_mb": "16",
            "max_concurrency": "8", "strategy": "", "pool_size": "4", "shard_count": "4",
            "bindings-TOTAL_FORMS": "1", "bindings-INITIAL_FORMS": "0", "bindings-MIN_NUM_FORMS": "0",
            "bindings-MAX_NUM_FORMS": "1000", "bindings-0-kind": "command", "bindings-0-pattern": "up",
            "bindings-0-handler": "up", "bindings-0-priority": "0", "bindings-0-enabled": "on"}
    data.update(overrides)
    return data


def test_admin_shows_the_runtime_message_for_a_syntax_error(admin_client) -> None:
    response = admin_client.post("/admin/plugins/plugin/add/", _form(source="function up(ev) return end end"))
    assert response.status_code == 200  # the form again, not a redirect
    body = html.unescape(response.content.decode())
    assert "plugin 'up'" in body and "the lua runtime refused the code" in body
    assert "up:1: <eof> expected near 'end'" in body  # Lua's own message
    assert "plugin 'up' (handlers up): the lua runtime refused" in body  # names the bound handler
    assert not Plugin.objects.filter(name="up").exists()


def test_one_admin_save_runs_a_refused_top_level_once(admin_client, monkeypatch: pytest.MonkeyPatch) -> None:
    # The form, the bindings' formset and the save each validate the code: a top level that ran
    # past its budget ran past it once for each, and the page answered after 2x timeout_ms.
    from plugins import loaded

    runs: list[str] = []
    real = loaded.compile_plugin
    monkeypatch.setattr(loaded, "compile_plugin", lambda spec: runs.append(spec.name) or real(spec))
    response = admin_client.post("/admin/plugins/plugin/add/", _form(
        source="while true do end\nfunction up(ev) return 'x' end", timeout_ms="200"))
    body = html.unescape(response.content.decode())
    assert response.status_code == 200 and "the top level ran past the plugin's timeout of 200 ms" in body
    assert "plugin 'up' (handlers up): the lua runtime refused" in body  # still names the bound handler
    assert runs == ["up"], "the same refused code ran in the sandbox again within one save"
    # Once the refusal is no longer fresh, saving again runs it again (a busy moment is not remembered).
    monkeypatch.setattr(loaded, "REFUSAL_MEMORY_SECONDS", 0.0)
    admin_client.post("/admin/plugins/plugin/add/", _form(source="while true do end\nfunction up(ev) end",
                                                          timeout_ms="200"))
    assert runs == ["up", "up", "up"]


def test_admin_takes_a_source_up_to_the_code_limit_and_names_the_limit_past_it(admin_client, settings) -> None:
    # Django read at most 2.5 MiB of form data: a source between that and the 4 MiB code limit
    # was a bare "Bad Request (400)", no reason given.
    from plugins.checks import check_the_admin_takes_the_largest_code

    source = "function up(ev) return 'x' end\n" + "-- padding line\n" * (3 * 1_048_576 // 16)
    response = admin_client.post("/admin/plugins/plugin/add/", _form(source=source))
    assert response.status_code == 302 and len(Plugin.objects.get(name="up").source) > 3 * 1_048_576
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2_621_440  # Django's default
    assert [m.id for m in check_the_admin_takes_the_largest_code()] == ["plugins.W001"]
    response = admin_client.post("/admin/plugins/plugin/add/", _form(name="up2", source=source))
    body = response.content.decode()
    assert response.status_code == 400 and "DATA_UPLOAD_MAX_MEMORY_SIZE = 2621440" in body


def test_admin_refuses_a_binding_to_a_missing_handler(admin_client) -> None:
    response = admin_client.post("/admin/plugins/plugin/add/",
                                 _form(source="function other(ev) return 'x' end"))
    assert response.status_code == 200
    assert "handler &#x27;up&#x27; is not defined" in response.content.decode()
    assert not Plugin.objects.filter(name="up").exists()


def test_admin_accepts_an_uploaded_wasm_binary(admin_client) -> None:
    upload = SimpleUploadedFile("guest.wasm", wat_to_wasm(WAT), content_type="application/wasm")
    data = _form(name="wup", runtime="wasm", **{"bindings-0-pattern": "hi", "bindings-0-handler": "reply"})
    data["upload"] = upload
    response = admin_client.post("/admin/plugins/plugin/add/", data)
    assert response.status_code == 302, response.content.decode()[:3000]
    plugin = Plugin.objects.get(name="wup")
    assert bytes(plugin.module) == wat_to_wasm(WAT) and plugin.source == ""
    assert list(plugin.bindings.values_list("handler", flat=True)) == ["reply"]


def test_admin_accepts_an_uploaded_lua_file_and_lists_it(admin_client) -> None:
    data = _form(upload=SimpleUploadedFile("up.lua", b"function up(ev) return ev.args:upper() end"))
    assert admin_client.post("/admin/plugins/plugin/add/", data).status_code == 302
    listing = admin_client.get("/admin/plugins/plugin/").content.decode()
    assert "up" in listing and Plugin.objects.get(name="up").version in listing


def test_admin_refuses_an_uploaded_source_with_a_nul_character(admin_client) -> None:
    # No database stores a NUL as text (PostgreSQL refuses it): a clear form error, not a 500.
    data = _form(upload=SimpleUploadedFile("up.lua", b"function up(ev) return 'a\x00' end"))
    response = admin_client.post("/admin/plugins/plugin/add/", data)
    assert response.status_code == 200 and "contains a NUL character" in response.content.decode()
    assert not Plugin.objects.filter(name="up").exists()


def test_admin_enable_disable_actions(admin_client) -> None:
    Plugin.objects.create(name="p", runtime="lua", source="function a(ev) return 'a' end")
    v0 = RegistryState.current()
    pk = Plugin.objects.get(name="p").pk
    admin_client.post("/admin/plugins/plugin/", {"action": "disable_plugins", "_selected_action": [pk]})
    assert not Plugin.objects.get(pk=pk).enabled
    admin_client.post("/admin/plugins/plugin/", {"action": "enable_plugins", "_selected_action": [pk]})
    assert Plugin.objects.get(pk=pk).enabled
    assert RegistryState.current() == v0 + 2


def _opened(admin_client, pk: int) -> dict[str, Any]:
    """The change form of plugin ``pk`` as a browser would post it back unchanged."""
    page = admin_client.get(f"/admin/plugins/plugin/{pk}/change/").content.decode()
    binding = Binding.objects.get(plugin_id=pk)
    return _form(**{"loaded_at": html.unescape(re.search(r'name="loaded_at" value="([^"]+)"', page).group(1)),
                    "source": "function up(ev) return 'a' end", "bindings-INITIAL_FORMS": "1",
                    "bindings-0-id": str(binding.pk), "bindings-0-plugin": str(pk)})


def test_a_save_from_a_page_opened_before_anothers_save_is_refused_not_lost(admin_client) -> None:
    # Two operators open the same plugin; the second to save silently undid the first's change.
    plugin = Plugin.objects.create(name="up", runtime="lua", source="function up(ev) return 'a' end")
    Binding.objects.create(plugin=plugin, kind="command", pattern="up", handler="up")
    first, second = _opened(admin_client, plugin.pk), _opened(admin_client, plugin.pk)
    url = f"/admin/plugins/plugin/{plugin.pk}/change/"
    assert admin_client.post(url, {**first, "timeout_ms": "2000"}).status_code == 302
    response = admin_client.post(url, {**second, "description": "from an old page"})
    body = html.unescape(response.content.decode())
    assert response.status_code == 200 and "plugin 'up' was changed by someone else" in body
    assert "nothing was saved. Reload the page" in body
    plugin.refresh_from_db()
    assert plugin.timeout_ms == 2000 and plugin.description == ""  # the first save stands, nothing half-applied
    # Reopened, the same change saves; and the enable/disable action counts as a change too.
    assert admin_client.post(url, {**_opened(admin_client, plugin.pk), "description": "again"}).status_code == 302
    stale = _opened(admin_client, plugin.pk)
    admin_client.post("/admin/plugins/plugin/", {"action": "disable_plugins", "_selected_action": [plugin.pk]})
    assert admin_client.post(url, stale).status_code == 200  # would have re-enabled it unseen
    assert not Plugin.objects.get(pk=plugin.pk).enabled


@override_settings(EXECAPP={"MAX_BINDINGS_PER_PLUGIN": 4, "MAX_REGEX_BINDINGS_PER_PLUGIN": 2})
def test_a_plugin_may_have_so_many_bindings_and_regex_bindings() -> None:
    # Every regex binding costs every message a search on the event loop (disabled ones too, for
    # the unmatched hint): 5,000 of one plugin took 0.3 s of the loop per 64 KB message.
    plugin = Plugin.objects.create(name="many", runtime="lua", source="function h(ev) return 'x' end")
    Binding.objects.create(plugin=plugin, kind="regex", pattern="a+", handler="h")
    Binding.objects.create(plugin=plugin, kind="regex", pattern="b+", handler="h", enabled=False)
    with pytest.raises(PluginInvalid, match=r"plugin 'many' would have 3 regex bindings; a plugin may have at most 2 "
                                            r"\(EXECAPP\['MAX_REGEX_BINDINGS_PER_PLUGIN'\]\)"):
        Binding.objects.create(plugin=plugin, kind="regex", pattern="c+", handler="h", enabled=False)
    Binding.objects.create(plugin=plugin, kind="command", pattern="one", handler="h")
    Binding.objects.create(plugin=plugin, kind="command", pattern="two", handler="h")
    with pytest.raises(PluginInvalid, match=r"would have 5 bindings; a plugin may have at most 4 "
                                            r"\(EXECAPP\['MAX_BINDINGS_PER_PLUGIN'\]\)"):
        Binding.objects.create(plugin=plugin, kind="event", pattern="join", handler="h")
    edited = plugin.bindings.get(pattern="one")
    edited.pattern = "uno"
    edited.save()  # an edit is not one more
    assert plugin.bindings.count() == 4


def test_values_past_what_the_database_stores_are_refused_by_name() -> None:
    # Was an OverflowError traceback (SQLite) or a DataError (PostgreSQL, whose 32-bit columns
    # are narrower: a value saved on SQLite failed there) at save.
    source = "function h(ev) return 'x' end"
    with pytest.raises(PluginInvalid, match=r"plugin 'big': quota_kv_bytes 10{30} is outside "
                                            r"0\.\.9223372036854775807, what the database stores; make it smaller"):
        Plugin.objects.create(name="big", runtime="lua", source=source, quota_kv_bytes=10**30)
    with pytest.raises(PluginInvalid, match=r"quota_http_requests 4294967296 is outside 0\.\.2147483647"):
        Plugin.objects.create(name="big", runtime="lua", source=source, quota_http_requests=2**32)
    plugin = Plugin.objects.create(name="big", runtime="lua", source=source)
    with pytest.raises(PluginInvalid, match=r"plugin 'big' handler 'h': priority -2147483649 is outside "
                                            r"-2147483648\.\.2147483647"):
        Binding.objects.create(plugin=plugin, pattern="x", handler="h", priority=-2**31 - 1)
    with pytest.raises(PluginInvalid, match=r"plugin 'big' handler 'h': pattern is 500000 characters, over its 200"):
        Binding.objects.create(plugin=plugin, kind="event", pattern="y" * 500_000, handler="h")
    assert not plugin.bindings.exists()
    plugin.description = "d" * 201
    with pytest.raises(PluginInvalid, match=r"plugin 'big': description is 201 characters, over its 200"):
        plugin.save()


@override_settings(EXECAPP={"MAX_PLUGINS": 2, "MAX_REGEX_BINDINGS": 3})
def test_enabled_plugins_and_their_regex_bindings_are_counted_across_the_registry() -> None:
    # The per-plugin limits alone let 500 plugins of 10 regexes each make every message 5,000
    # searches on the event loop, and every enabled plugin is compiled in every worker.
    source = "function h(ev) return 'x' end"
    a = Plugin.objects.create(name="a", runtime="lua", source=source)
    Binding.objects.create(plugin=a, kind="regex", pattern="a+", handler="h")
    Binding.objects.create(plugin=a, kind="regex", pattern="b+", handler="h", enabled=False)
    b = Plugin.objects.create(name="b", runtime="lua", source=source)
    Binding.objects.create(plugin=b, kind="regex", pattern="c+", handler="h")
    with pytest.raises(PluginInvalid, match=r"plugin 'b' would bring the enabled plugins' regex bindings to 4; at "
                                            r"most 3 may exist together \(EXECAPP\['MAX_REGEX_BINDINGS'\]\)"):
        Binding.objects.create(plugin=b, kind="regex", pattern="d+", handler="h")
    Binding.objects.create(plugin=b, kind="command", pattern="d", handler="h")  # commands are not counted here
    with pytest.raises(PluginInvalid, match=r"plugin 'c' would be enabled plugin number 3; at most 2 may be enabled "
                                            r"\(EXECAPP\['MAX_PLUGINS'\]\)"):
        Plugin.objects.create(name="c", runtime="lua", source=source)
    c = Plugin.objects.create(name="c", runtime="lua", source=source, enabled=False)
    Binding.objects.create(plugin=c, kind="regex", pattern="e+", handler="h")  # a disabled plugin's: not counted
    c.enabled = True
    with pytest.raises(PluginInvalid, match="would be enabled plugin number 3"):
        c.save()
    b.enabled = False
    b.save()
    a.description = "edited"
    a.save()  # an edit of an enabled plugin is not one more
    c.save()  # in b's place: 2 plugins, 3 regex bindings
    assert list(Plugin.objects.filter(enabled=True).values_list("name", flat=True)) == ["a", "c"]
    with pytest.raises(PluginInvalid, match="regex bindings to 4"):
        Binding.objects.create(plugin=c, kind="regex", pattern="f+", handler="h")


@override_settings(EXECAPP={"MAX_REGEX_BINDINGS_PER_PLUGIN": 2, "MAX_REGEX_BINDINGS": 3})
def test_bindings_that_see_every_message_are_counted_and_copies_refused() -> None:
    # One plugin with 100 event bindings of type message (or 100 copies of one binding) made every
    # message of every client run 100 handlers and send 100 replies: neither was counted.
    source = "function h(ev) return 'x' end"
    a = Plugin.objects.create(name="a", runtime="lua", source=source)
    Binding.objects.create(plugin=a, kind="event", pattern="message", handler="h")
    with pytest.raises(PluginInvalid, match=r"plugin 'a' binds event 'message' to 'h' twice: each copy would run the "
                                            r"handler again for the same event"):
        Binding.objects.create(plugin=a, kind="event", pattern="message", handler="h", priority=5)
    with pytest.raises(PluginInvalid, match="binds command 'x' to 'h' twice"):
        Binding.objects.create(plugin=a, kind="command", pattern="x", handler="h")
        Binding.objects.create(plugin=a, kind="command", pattern="x", handler="h", enabled=False)
    Binding.objects.create(plugin=a, kind="regex", pattern="r+", handler="h")
    with pytest.raises(PluginInvalid, match=r"plugin 'a' would have 3 regex bindings; a plugin may have at most 2 "
                                            r"\(EXECAPP\['MAX_REGEX_BINDINGS_PER_PLUGIN'\]\), event bindings of type "
                                            r"message counted with them"):
        Binding.objects.create(plugin=a, kind="event", pattern="message", handler="h2")
    Binding.objects.create(plugin=a, kind="event", pattern="join", handler="h")  # other types: per event, not counted
    b = Plugin.objects.create(name="b", runtime="lua", source=source)
    Binding.objects.create(plugin=b, kind="event", pattern="message", handler="h")
    with pytest.raises(PluginInvalid, match=r"plugin 'b' would bring the enabled plugins' regex bindings to 4"):
        Binding.objects.create(plugin=b, kind="regex", pattern="s+", handler="h")


@override_settings(EXECAPP={"MAX_BINDINGS_PER_PATTERN": 2})
def test_a_command_or_event_type_is_bound_a_bounded_number_of_times_across_plugins(admin_client) -> None:
    # Each binding runs its handler for every such event: one plugin binding /x to 100 handlers
    # made each /x 100 runs and 100 replies (100 plugins: 10,000).
    source = "function h(ev) return 'x' end function g(ev) return 'y' end"
    a = Plugin.objects.create(name="a", runtime="lua", source=source)
    Binding.objects.create(plugin=a, kind="command", pattern="x", handler="h")
    Binding.objects.create(plugin=a, kind="command", pattern="/x", handler="g")  # the same command
    b = Plugin.objects.create(name="b", runtime="lua", source=source)
    with pytest.raises(PluginInvalid, match=r"plugin 'b' would bring the bindings of command 'x' to 3; at most 2 of "
                                            r"all enabled plugins may share one "
                                            r"\(EXECAPP\['MAX_BINDINGS_PER_PATTERN'\]\)"):
        Binding.objects.create(plugin=b, kind="command", pattern="x", handler="h")
    Binding.objects.create(plugin=b, kind="event", pattern="tick", handler="h")
    Binding.objects.create(plugin=b, kind="event", pattern="tick", handler="g")
    with pytest.raises(PluginInvalid, match="bindings of event 'tick' to 3"):
        Binding.objects.create(plugin=a, kind="event", pattern="tick", handler="h")
    Binding.objects.create(plugin=b, kind="command", pattern="y", handler="h")  # another command
    c = Plugin.objects.create(name="c", runtime="lua", source=source, enabled=False)
    Binding.objects.create(plugin=c, kind="command", pattern="x", handler="h")  # c is disabled: not counted
    c.enabled = True
    with pytest.raises(PluginInvalid, match="plugin 'c' would bring the bindings of command 'x' to 3"):
        c.save()
    response = admin_client.post("/admin/plugins/plugin/add/", _form(
        source="function up(ev) return 'x' end function up2(ev) return 'y' end function up3(ev) return 'z' end", **{
            "bindings-TOTAL_FORMS": "3", "bindings-1-kind": "command", "bindings-1-pattern": "up",
            "bindings-1-handler": "up2", "bindings-1-priority": "0", "bindings-2-kind": "command",
            "bindings-2-pattern": "/up", "bindings-2-handler": "up3", "bindings-2-priority": "0"}))
    assert "would bring the bindings of command 'up' to 3" in html.unescape(response.content.decode())
    assert not Plugin.objects.filter(name="up").exists()


def test_admin_refuses_a_copy_of_a_binding(admin_client) -> None:
    response = admin_client.post("/admin/plugins/plugin/add/", _form(
        source="function up(ev) return 'x' end", **{
            "bindings-TOTAL_FORMS": "2", "bindings-1-kind": "command", "bindings-1-pattern": "up",
            "bindings-1-handler": "up", "bindings-1-priority": "3"}))
    assert response.status_code == 200
    assert "plugin 'up' binds command 'up' to 'up' twice" in html.unescape(response.content.decode())
    assert not Plugin.objects.filter(name="up").exists()


@override_settings(EXECAPP={"MAX_TOTAL_CODE_BYTES": 1000})
def test_the_enabled_plugins_code_is_counted_together() -> None:
    # Every worker holds every enabled plugin's code and what it compiles to (Lua: ~3 MB of
    # bytecode for each MB), and reads it all at each registry change: 20 plugins of 3.9 MB cost
    # 0.6 s and 82 MiB a change, 100 (MAX_PLUGINS) of 4 MiB would hold ~1 GB in each worker.
    def source(size: int) -> str:
        return "function h(ev) return 'x' end\n--" + "x" * (size - 32)

    a = Plugin.objects.create(name="a", runtime="lua", source=source(600))
    with pytest.raises(PluginInvalid, match=r"plugin 'b' would bring the enabled plugins' code to 1100 bytes; at most "
                                            r"1000 may be enabled together \(EXECAPP\['MAX_TOTAL_CODE_BYTES'\]\)"):
        Plugin.objects.create(name="b", runtime="lua", source=source(500))
    b = Plugin.objects.create(name="b", runtime="lua", source=source(400))
    b.source = source(401)
    with pytest.raises(PluginInvalid, match="code to 1001 bytes"):
        b.save()  # an edit counts its new size
    Plugin.objects.create(name="c", runtime="lua", source=source(900), enabled=False)  # disabled: not counted
    a.enabled = False
    a.save()
    b.save()


@override_settings(EXECAPP={"MAX_PLUGINS": 2})
def test_admin_enables_no_more_plugins_than_a_worker_loads(admin_client) -> None:
    source = "function h(ev) return 'x' end"
    Plugin.objects.create(name="a", runtime="lua", source=source)
    off = [Plugin.objects.create(name=n, runtime="lua", source=source, enabled=False) for n in ("b", "c")]
    response = admin_client.post("/admin/plugins/plugin/", {"action": "enable_plugins",
                                                            "_selected_action": [p.pk for p in off]}, follow=True)
    assert "Nothing enabled: 3 plugins with 0 regex bindings and 87 bytes of code would be enabled; at most 2" in \
        html.unescape(response.content.decode())
    assert Plugin.objects.filter(enabled=True).count() == 1
    admin_client.post("/admin/plugins/plugin/", {"action": "enable_plugins", "_selected_action": [off[0].pk]})
    assert Plugin.objects.filter(enabled=True).count() == 2


@override_settings(EXECAPP={"MAX_REGEX_BINDINGS_PER_PLUGIN": 1})
def test_admin_refuses_more_regex_bindings_than_a_plugin_may_have(admin_client) -> None:
    response = admin_client.post("/admin/plugins/plugin/add/", _form(
        source="function up(ev) return 'x' end", **{
            "bindings-TOTAL_FORMS": "2", "bindings-0-kind": "regex", "bindings-0-pattern": "a+",
            "bindings-1-kind": "regex", "bindings-1-pattern": "b+", "bindings-1-handler": "up",
            "bindings-1-priority": "0"}))
    assert response.status_code == 200
    assert "would have 2 regex bindings; a plugin may have at most 1" in html.unescape(response.content.decode())
    assert not Plugin.objects.filter(name="up").exists()


def test_the_unmatched_hint_tries_a_bounded_number_of_patterns_compiled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each regex hint is a search of every unmatched message on the event loop, and past a cache
    of 256 every pattern was compiled again for every such message: the hints are compiled when
    made (on the registry sync's thread), at most MAX_HINT_REGEXES of them."""
    from plugins import sync

    compiled = []
    real = sync.LinearRegex

    def counting(pattern: str) -> Any:
        compiled.append(pattern)
        return real(pattern)

    monkeypatch.setattr(sync, "LinearRegex", counting)
    sync._use_hints({("regex", f"x{i}y"): f"plugin 'p{i}' is disabled" for i in range(1000)})
    try:
        assert len(compiled) == sync.MAX_HINT_REGEXES
        for _ in range(3):
            assert sync.unmatched_hint("message", "x1y") is not None
            assert sync.unmatched_hint("message", f"x{sync.MAX_HINT_REGEXES}y") is None  # past the bound
        assert len(compiled) == sync.MAX_HINT_REGEXES  # nothing compiled per message
    finally:
        sync._use_hints({})
