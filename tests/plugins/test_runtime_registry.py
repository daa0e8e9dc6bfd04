"""The runtime registry: a runtime is one module plus one registry entry, and everything that
names runtimes (spec defaults, validation, the model's clean(), the form, messages, the
registry sync) takes it from there. The module here is tests/plugins/toy_runtime.py."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import SimpleUploadedFile

from execapp.engine import ConfigError, Engine, Event
from plugins import sync
from plugins.errors import CompileError, PluginInvalid
from plugins.forms import PluginForm
from plugins.loaded import LoadedPlugin, validate
from plugins.models import Binding, KVEntry, Plugin
from plugins.runtimes import registry
from plugins.runtimes.registry import Runtime
from plugins.spec import PluginSpec

from . import toy_runtime

TOY = "greet = hello {args}\nfail = !no luck\ncount = +hits\n"


@pytest.fixture
def toy() -> Iterator[None]:
    # The one registry entry of each toy runtime (the text one, and a binary one).
    registry.register(Runtime("toy", "Toy", "sharded", "tests.plugins.toy_runtime:ToyCompiled",
                              source_extensions=(".toy",)))
    registry.register(Runtime("toyb", "Toy binary", "per_request", toy_runtime.ToyCompiled, binary=True,
                              source_extensions=(".toyt",), binary_extensions=(".toyb",),
                              binary_magic=toy_runtime.MAGIC, text_to_binary="tests.plugins.toy_runtime:to_binary"))
    try:
        yield
    finally:
        registry.unregister("toy")
        registry.unregister("toyb")
        sync.manager.clear()


def event(**fields: Any) -> dict[str, Any]:
    return {"type": "message", "text": "", "args": "", "id": "e1", "session": None, "data": {}, **fields}


def test_a_toy_runtime_validates_and_runs_through_a_loaded_plugin(toy: None) -> None:
    spec = PluginSpec(name="t", runtime="toy", code=TOY)
    assert spec.strategy == "sharded"  # the registry entry's default, not the fallback
    assert validate(spec, ["greet", "fail"]).handlers == {"greet", "fail", "count"}
    loaded = LoadedPlugin(spec)
    try:
        assert loaded.strategy.name == "sharded"
        assert loaded.call("greet", event(args="world")) == "hello world"
        with pytest.raises(Exception, match="plugin 't' handler 'fail'.*no luck"):
            loaded.call("fail", event())
    finally:
        loaded.close()
    with pytest.raises(PluginInvalid, match=r"handler 'bye' is not defined by the code \(toy defines: count, fail, "
                                            r"greet\)"):
        validate(spec, ["bye"])
    with pytest.raises(PluginInvalid, match="the toy runtime refused the code: line 2: expected 'handler = reply'"):
        validate(PluginSpec(name="t", runtime="toy", code="a = b\nnonsense"))


@pytest.mark.django_db
def test_the_model_accepts_a_registered_runtime_and_serves_it(toy: None) -> None:
    plugin = Plugin(name="tp", runtime="toy", source=TOY, permissions=["log", "kv"])
    plugin.full_clean()  # no choices on the field: the registry decides, no migration needed
    plugin.save()
    assert plugin.effective_strategy == "sharded"
    Binding.objects.create(plugin=plugin, pattern="greet", handler="greet")
    Binding.objects.create(plugin=plugin, pattern="count", handler="count")
    engine = Engine(pool_enabled=False)
    assert sync.sync_engine(engine, force=True)
    replies: list[Any] = []
    for text in ("/greet you", "/count", "/count"):
        completion = engine.process_event_sync(Event(text=text), on_outcome=replies.append)
        assert completion.errors == (), completion.errors
    assert [r.text for r in replies if hasattr(r, "text")] == ["hello you", "1", "2"]
    # The host API reached the KV store the plugins app injected (the database here).
    assert KVEntry.objects.get(plugin="tp", key="hits").value == "2"
    with pytest.raises(ValidationError, match="the toy runtime refused the code: line 1"):
        Plugin(name="tq", runtime="toy", source="???").full_clean()


@pytest.mark.django_db
def test_an_unregistered_runtime_is_refused_and_skipped_by_name(toy: None, caplog: pytest.LogCaptureFixture) -> None:
    plugin = Plugin.objects.create(name="tp", runtime="toy", source=TOY)
    Binding.objects.create(plugin=plugin, pattern="greet", handler="greet")
    registry.unregister("toy")
    with pytest.raises(ValidationError, match="runtime 'toy' is not one of lua, wasm, js, toyb"):
        plugin.full_clean()
    with pytest.raises(CompileError, match="unknown runtime 'toy'; use lua, wasm, js or toyb"):
        registry.compile_plugin(PluginSpec(name="tp", runtime="toy", code=TOY))
    caplog.set_level(logging.ERROR, logger="plugins.sync")
    engine = Engine(pool_enabled=False)
    sync.sync_engine(engine, force=True)  # every other plugin serves; this one is logged and skipped
    assert engine.matchers == [] or all(m.plugin != "tp" for m in engine.matchers)
    assert any("plugin tp not loaded" in r.getMessage() and "unknown runtime 'toy'" in r.getMessage()
               for r in caplog.records)


def _form(**overrides: Any) -> dict[str, Any]:
    data = {"name": "up", "description": "", "runtime": "toyb", "enabled": "on", "source": "",
            "permissions": ["log"], "http_allowlist": "", "timeout_ms": "1000", "memory_mb": "16",
            "max_concurrency": "8", "strategy": "", "pool_size": "4", "shard_count": "4"}
    return {**data, **overrides}


@pytest.mark.django_db
def test_a_binary_runtime_takes_its_text_form_and_its_uploads(toy: None) -> None:
    # The text form in `source` is compiled to the stored binary at save (as .wat is for WASM).
    plugin = Plugin.objects.create(name="tb", runtime="toyb", source="greet = hi {args}")
    assert bytes(plugin.module) == toy_runtime.MAGIC + b"greet = hi {args}" and plugin.code() == bytes(plugin.module)
    with pytest.raises(PluginInvalid, match="the toyb runtime refused the code: line 1"):
        Plugin.objects.create(name="tc", runtime="toyb", source="???")
    # The admin form offers the registered runtimes and recognises the binary upload.
    assert ("toyb", "Toy binary") in PluginForm().fields["runtime"].choices
    binary = toy_runtime.MAGIC + b"greet = up {args}"
    form = PluginForm(data=_form(), files={"upload": SimpleUploadedFile("guest.toyb", binary)})
    assert form.is_valid(), form.errors
    form.save()
    saved = Plugin.objects.get(name="up")
    assert bytes(saved.module) == binary and saved.source == ""
    loaded = LoadedPlugin(saved.to_spec())
    try:
        assert loaded.call("greet", event(args="x")) == "up x"
    finally:
        loaded.close()
    # By its magic bytes too, whatever its name; and it needs its own runtime.
    form = PluginForm(data=_form(name="up2", runtime="lua"), files={"upload": SimpleUploadedFile("g.bin", binary)})
    assert not form.is_valid()
    assert "g.bin is a TOYB binary: set the runtime to Toy binary" in str(form.errors)


def test_a_bad_registry_entry_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="runtime name 'Toy Runtime' is not"):
        Runtime("Toy Runtime", "Toy", "pooled", toy_runtime.ToyCompiled)
    with pytest.raises(ConfigError, match="default strategy 'fast' is not one of per_request, pooled, sharded"):
        Runtime("toy", "Toy", "fast", toy_runtime.ToyCompiled)
    with pytest.raises(ConfigError, match="set binary=True"):
        Runtime("toy", "Toy", "pooled", toy_runtime.ToyCompiled, binary_extensions=(".toyb",))
    missing = Runtime("toy", "Toy", "pooled", "tests.plugins.toy_runtime:NoSuchClass")
    with pytest.raises(ConfigError, match="'tests.plugins.toy_runtime:NoSuchClass' does not name an importable"):
        _ = missing.compiler  # resolving the dotted path fails


@pytest.mark.django_db
def test_the_admin_list_shows_and_filters_runtimes_by_their_registry_labels(toy: None, admin_client: Any) -> None:
    lua = Plugin.objects.create(name="pl", runtime="lua", source="function a(ev) return 'a' end")
    toy_plugin = Plugin.objects.create(name="pt", runtime="toy", source=TOY)
    listing = admin_client.get("/admin/plugins/plugin/").content.decode()
    assert "Lua 5.5" in listing and ">Toy<" in listing
    only_toy = admin_client.get("/admin/plugins/plugin/?runtime=toy").content.decode()
    assert f"/admin/plugins/plugin/{toy_plugin.pk}/change/" in only_toy
    assert f"/admin/plugins/plugin/{lua.pk}/change/" not in only_toy
    registry.unregister("toy")
    assert "toy (not registered)" in admin_client.get("/admin/plugins/plugin/").content.decode()


@pytest.mark.parametrize("runtime, filler", [("lua", "-- {}\n"), ("js", "// {}\n"), ("lua", "-- é\n")])
def test_code_over_the_size_limit_is_refused_before_it_is_parsed(runtime: str, filler: str) -> None:
    # Compiling is linear in the code but cannot be interrupted, on the thread that loads it and
    # outside the memory cap (a 64 MB Lua source: 2.5 s and 1.1 GB): code that reached the
    # database past the admin's upload limit (loadplugins, SQL) is refused before any parsing.
    code = filler.format("x" * 60) * (registry.MAX_CODE_BYTES // len(filler.encode()) + 1)
    assert len(code) <= registry.MAX_CODE_BYTES or filler.isascii()  # ("é": under the limit in characters)
    with pytest.raises(PluginInvalid, match=rf"the code is \d+ bytes, over the limit of {registry.MAX_CODE_BYTES} "
                                            r"bytes for a plugin's code \(MAX_CODE_BYTES\); make it smaller"):
        validate(PluginSpec(name="big", runtime=runtime, code=code))


@pytest.mark.django_db
def test_a_binary_runtimes_text_over_the_size_limit_is_refused_before_it_is_compiled(toy: None,
                                                                                       monkeypatch: Any) -> None:
    compiled: list[str] = []
    monkeypatch.setattr(toy_runtime, "to_binary", lambda text: compiled.append(text) or b"")
    text = "greet = hi\n" + "\n" * registry.MAX_CODE_BYTES
    with pytest.raises(PluginInvalid, match="MAX_CODE_BYTES"):
        Plugin(name="bigt", runtime="toyb", source=text).save()
    assert compiled == []
