"""A plugin's log lines across its calls: each call stays within its log quota, and the plugin as a
whole within its log rate in the process (plugins.runtimes.log_rate, EXECAPP's
PLUGIN_LOG_LINES_PER_SECOND / PLUGIN_LOG_BYTES_PER_SECOND)."""
from __future__ import annotations

import logging
import time

import pytest
from django.core.checks import Error

from execapp.checks import check_plugin_log_rate
from plugins.loaded import LoadedPlugin
from plugins.runtimes import host, log_rate
from plugins.runtimes.host import Host, HostDenied
from plugins.spec import PluginSpec
from tests.plugins.test_wasm_hostile import EVENT, handler, module

LOG = '(import "env" "log" (func $log (param i32 i32)))'
#: 100 lines of 100 bytes per call: its per-call quota (100 lines, 64 KiB) holds every one.
FLOOD = module('(data (i32.const 0) "' + "x" * 100 + '")' + handler(
    "(local $i i32) (loop $l (call $log (i32.const 0) (i32.const 100)) (local.set $i (i32.add (local.get $i) "
    "(i32.const 1))) (br_if $l (i32.lt_u (local.get $i) (i32.const 100)))) (i64.const 0)"), imports=LOG)


@pytest.fixture(autouse=True)
def fresh_buckets():
    host.log_rate.clear()
    yield
    host.log_rate.clear()


def flooder(name: str) -> LoadedPlugin:
    return LoadedPlugin(PluginSpec(name=name, runtime="wasm", code=FLOOD, timeout=5.0, memory_bytes=8 << 20,
                                   permissions=frozenset({"log"})))


def lines_of(caplog, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "plugins.guest" and r.getMessage().startswith(f"[{name}] ")]


def test_a_plugin_called_in_a_loop_logs_no_more_than_its_rate(settings, caplog, monkeypatch) -> None:
    # Before the rate, every call wrote its quota: 10 calls, 1,000 lines (one caller thread wrote
    # 13,000 lines and 8.5 MB a second).
    settings.EXECAPP = {**settings.EXECAPP, "PLUGIN_LOG_LINES_PER_SECOND": 20, "PLUGIN_LOG_BYTES_PER_SECOND": 0}
    monkeypatch.setattr(log_rate, "SUMMARY_SECONDS", 0.0)
    caplog.set_level("INFO", logger="plugins.guest")
    plugin, other = flooder("chatty"), flooder("quiet")
    started = time.monotonic()
    try:
        for _ in range(10):
            plugin.call("run", dict(EVENT))
        elapsed = time.monotonic() - started
        written = len(lines_of(caplog, "chatty"))
        assert written <= 20 * log_rate.BURST_SECONDS + 20 * elapsed + 1, f"{written} lines in {elapsed:.2f} s"
        summaries = [r.getMessage() for r in caplog.records if "over its log rate" in r.getMessage()]
        assert summaries and all(s.startswith("plugin 'chatty': ") for s in summaries)
        assert "EXECAPP['PLUGIN_LOG_LINES_PER_SECOND']" in summaries[0]
        dropped = sum(int(s.split(": ")[1].split()[0]) for s in summaries)
        assert written + dropped == 1000
        # Another plugin has its own bucket: its first call logs whole.
        other.call("run", dict(EVENT))
        assert len(lines_of(caplog, "quiet")) == 100
    finally:
        plugin.close()
        other.close()


def test_the_byte_rate_holds_too(settings, caplog) -> None:
    settings.EXECAPP = {**settings.EXECAPP, "PLUGIN_LOG_LINES_PER_SECOND": 0, "PLUGIN_LOG_BYTES_PER_SECOND": 1000}
    caplog.set_level("INFO", logger="plugins.guest")
    plugin = flooder("bytes")
    try:
        plugin.call("run", dict(EVENT))
    finally:
        plugin.close()
    assert 100 <= len(lines_of(caplog, "bytes")) <= 101  # 10 s of 1,000 bytes a second: 100 lines of 100


def test_denied_calls_across_calls_are_logged_within_the_rate(settings, caplog) -> None:
    # The first denied host call of each call is a WARNING: one line per call, a call loop's worth.
    settings.EXECAPP = {**settings.EXECAPP, "PLUGIN_LOG_LINES_PER_SECOND": 5}
    caplog.set_level("INFO", logger="plugins.host")
    spec = PluginSpec(name="denied", runtime="wasm", code=b"", timeout=5.0)
    started = time.monotonic()
    for _ in range(500):
        h = Host(spec, time.monotonic() + 5)
        with pytest.raises(HostDenied):
            h.kv_get("k")
        h.close()
    elapsed = time.monotonic() - started
    warnings = [r for r in caplog.records if r.name == "plugins.host" and "denied" in r.getMessage()]
    assert len(warnings) <= 5 * log_rate.BURST_SECONDS + 5 * elapsed + 1


def test_no_rate_logs_every_line_of_every_call(settings, caplog) -> None:
    settings.EXECAPP = {**settings.EXECAPP, "PLUGIN_LOG_LINES_PER_SECOND": 0, "PLUGIN_LOG_BYTES_PER_SECOND": 0}
    caplog.set_level("INFO", logger="plugins.guest")
    plugin = flooder("unlimited")
    try:
        for _ in range(30):
            plugin.call("run", dict(EVENT))
    finally:
        plugin.close()
    assert len(lines_of(caplog, "unlimited")) == 3000


@pytest.mark.parametrize("value", [-1, "lots", float("nan"), True])
def test_a_bad_log_rate_is_a_check_error_and_no_limit(settings, value) -> None:
    settings.EXECAPP = {**settings.EXECAPP, "PLUGIN_LOG_LINES_PER_SECOND": value}
    errors = check_plugin_log_rate()
    assert [e.id for e in errors] == ["execapp.E068"] and isinstance(errors[0], Error)
    assert "PLUGIN_LOG_LINES_PER_SECOND" in errors[0].msg
    assert host.log_rate.limits()[0] == 0.0
