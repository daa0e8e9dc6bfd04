"""Red-team cases against the WASM sandbox, from the outside, as a hostile plugin author writes them.

Each asserts what an operator expects: a clean error or a timeout within the budget plus a small
margin, and the worker fine. One case documents an escape no host-side check can reach (bulk
memory instructions are single native operations that epochs do not interrupt): it is an xfail
that says how far past the budget it runs at a 1 GiB memory cap.
"""
from __future__ import annotations

import gc
import threading
import time
from dataclasses import replace

import pytest
from wasmtime import _func as wasm_func

from execapp.engine import HandlerError, HandlerTimeout
from plugins.errors import PluginInvalid
from plugins.loaded import LoadedPlugin, validate
from plugins.runtimes import wasm
from plugins.spec import PluginSpec
from tests.plugins.test_wasm_hostile import EVENT, HARD_SECONDS, bounded, call, handler, module, spec

LOG = '(import "env" "log" (func $log (param i32 i32)))'
SLEEP = '(import "env" "sleep" (func $sleep (param i32)))'


@pytest.mark.parametrize("body, message", [
    # a reply length of 4 GiB, a pointer past the 32-bit space, and a pointer + length that wraps
    ("(call $pack (i32.const 0) (i32.const -1))", "outside memory or over"),
    ("(call $pack (i32.const -16) (i32.const 8))", "outside memory or over"),
    ("(i64.const 0x7fffffffffffffff)", "outside memory or over"),
])
def test_a_reply_pointer_or_length_out_of_range_is_refused(body: str, message: str) -> None:
    with pytest.raises(HandlerError, match=message):
        call(module(handler(body)))


@pytest.mark.parametrize("ptr, length, message", [
    (0, 0x7FFFFFFF, "over the 262144-byte limit"),  # 2 GiB of log line
    (0, -1, "over the 262144-byte limit"),  # a negative length (i32 -1)
    (-8, 4, "outside linear memory"),  # a negative pointer
    (65530, 100, "outside linear memory"),  # past the end of the one page
])
def test_a_host_call_with_a_bad_pointer_or_length_traps_cleanly(ptr: int, length: int, message: str) -> None:
    body = handler(f"(call $log (i32.const {ptr}) (i32.const {length})) (i64.const 0)")
    with pytest.raises(HandlerError, match=message):
        call(module(body, imports=LOG))


def test_a_sleep_past_the_deadline_is_a_timeout_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(HandlerTimeout):
        call(module(handler("(call $sleep (i32.const 60000)) (i64.const 0)"), imports=SLEEP))
    assert time.monotonic() - started < 0.3 + 0.5


def test_growing_a_table_past_its_limit_fails_in_the_guest() -> None:
    # table.grow returns -1 past MAX_TABLE_ELEMENTS (table memory is outside the memory cap):
    # the handler replies with what it got.
    head = ('(memory (export "memory") 1) (func (export "alloc") (param i32) (result i32) (i32.const 1024))'
            ' (table $t 1 funcref)')
    body = handler("(i32.store (i32.const 0) (i32.add (i32.const 48) (i32.eq (table.grow $t (ref.null func)"
                   " (i32.const 0x40000000)) (i32.const -1)))) (call $pack (i32.const 0) (i32.const 1))")
    assert call(module(body, head=head)) == "1"


def test_deep_recursion_traps_quickly_with_a_short_message() -> None:
    code = module("(func $r (param i32) (result i32) (call $r (i32.add (local.get 0) (i32.const 1))))"
                  + handler("(drop (call $r (i32.const 0))) (i64.const 0)"))
    started = time.monotonic()
    with pytest.raises(HandlerError) as info:
        call(code)
    assert time.monotonic() - started < 0.3 + 0.5
    assert len(str(info.value)) < 9000  # the backtrace of ~100,000 frames is not all of it


# memory.fill / memory.copy over the whole memory, in a loop: one instruction is one native
# memset/memmove that epochs never interrupt; the loop around it is checked.
BULK = {
    "fill": "(memory.fill (i32.const 0) (i32.const 1) (local.get $size))",
    "copy": "(memory.copy (i32.const 0) (i32.const 1) (i32.sub (local.get $size) (i32.const 1)))",
}


def bulk_loop(op: str, pages: int) -> bytes:
    return module(handler(f"(drop (memory.grow (i32.const {pages - 1})))"
                          " (local.set $size (i32.mul (memory.size) (i32.const 65536)))"
                          f" (loop $l {BULK[op]} (br $l)) (i64.const 0)", locals_="(local $size i32)"))


@pytest.mark.parametrize("op", BULK)
def test_bulk_memory_over_the_default_cap_stops_at_the_deadline(op: str) -> None:
    started = time.monotonic()
    with pytest.raises(HandlerTimeout):
        call(bulk_loop(op, 128))  # 8 MiB: the cap of test_wasm_hostile.spec
    assert 0.3 <= time.monotonic() - started < 0.3 + 0.5


@pytest.mark.xfail(reason="not fixed: one memory.fill of 1 GiB (its first touch of the pages) runs ~0.5-1 s past "
                          "the deadline; epochs are checked only between instructions", strict=False)
def test_bulk_memory_at_a_1_gib_cap_stops_near_the_deadline() -> None:
    plugin = LoadedPlugin(PluginSpec(name="bulk", runtime="wasm", code=bulk_loop("fill", 16384), timeout=0.3,
                                     memory_bytes=1 << 30, strategy="per_request"))
    try:
        started = time.monotonic()
        with pytest.raises(HandlerTimeout):
            bounded(lambda: plugin.call("run", dict(EVENT), True, None))
        took = time.monotonic() - started
    finally:
        plugin.close()
    assert took < 0.3 + 0.5, took


def test_a_shared_memory_that_could_block_in_atomic_wait_is_refused_at_save() -> None:
    # memory.atomic.wait32 with no timeout parks the thread where no epoch reaches it: a start
    # function doing it would hang the call. The engine has no shared memories.
    from plugins.errors import CompileError
    from plugins.runtimes.wasm import WasmCompiled

    head = ('(memory (export "memory") 1 1 shared) (func (export "alloc") (param i32) (result i32) (i32.const 16))'
            ' (func $s (drop (memory.atomic.wait32 (i32.const 0) (i32.const 0) (i64.const -1)))) (start $s)')
    with pytest.raises(CompileError, match="shared memory"):
        bounded(lambda: WasmCompiled(PluginSpec(name="shared", runtime="wasm", code=module("", head=head),
                                                timeout=0.3)))


def test_atomic_wait_on_an_unshared_memory_traps_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(HandlerError, match="trap"):
        call(module(handler("(drop (memory.atomic.wait32 (i32.const 0) (i32.const 0) (i64.const -1)))"
                            " (i64.const 0)")))
    assert time.monotonic() - started < 0.3 + 0.5


@pytest.mark.parametrize("extra, body", [
    # a tail call that never returns (no loop back-edge: the epoch is checked at function entry)
    ("(func $f (param i32) (result i64) (return_call $f (local.get 0)))", "(return_call $f (i32.const 0))"),
    # (exceptions are refused at save now: test_exception_handling_..._is_refused_at_save)
], ids=["tail_call"])
def test_newer_control_flow_still_stops_at_the_deadline(extra: str, body: str) -> None:
    started = time.monotonic()
    with pytest.raises(HandlerTimeout):
        call(module(extra + handler(body)))
    assert time.monotonic() - started < 0.3 + 0.5


# wasmtime-py's trampoline keeps a host function's exception in one process-wide slot, and its
# enter_wasm raised whatever was there on any trap: a call that trapped (or timed out) while another
# thread's host call had just failed reported that other call's error, another tenant's message
# included (18 of 72,000 trapping calls, with two threads failing host calls beside them). The slot
# holds such a foreign exception in these tests, as in that race.
FOREIGN = "kv_get: plugin 'other_tenant' has no 'kv' permission"


@pytest.mark.parametrize("body, code, text", [
    ("unreachable", "handler_error", "unreachable"),
    ("(loop $l (br $l)) (i64.const 0)", "timeout", "timeout"),
])
def test_a_trap_reports_its_own_cause_not_another_threads_host_error(monkeypatch: pytest.MonkeyPatch, body: str,
                                                                     code: str, text: str) -> None:
    foreign = wasm._HostTrap(FOREIGN)
    monkeypatch.setattr(wasm_func, "LAST_EXCEPTION", foreign)
    with pytest.raises((HandlerError, HandlerTimeout)) as info:
        call(module(handler(body)))
    assert info.value.code == code and text in str(info.value) and "other_tenant" not in str(info.value)
    assert wasm_func.LAST_EXCEPTION is foreign  # left to its owner


def test_a_start_function_reports_its_own_cause_not_another_threads_host_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    foreign = wasm._HostTrap(FOREIGN)
    monkeypatch.setattr(wasm_func, "LAST_EXCEPTION", foreign)
    code = module("(func $s (loop $l (br $l))) (start $s)" + handler("(i64.const 0)"))
    with pytest.raises(PluginInvalid) as info:
        bounded(lambda: validate(spec(code, timeout=0.2)))
    assert info.value.code == "timeout" and "other_tenant" not in str(info.value)


def test_a_failed_host_call_is_still_reported_as_itself() -> None:
    body = handler("(call $log (i32.const 65530) (i32.const 100)) (i64.const 0)")
    with pytest.raises(HandlerError, match="host call failed: pointer 65530\\+100 is outside linear memory"):
        call(module(body, imports=LOG))
    assert wasm_func.LAST_EXCEPTION is None  # this thread's own exception was taken back out of the slot


def test_a_deadline_holds_while_other_threads_run_python() -> None:
    # The epoch ticker needs the GIL at each wake: beside threads running Python each wake came
    # late, and a deadline counted in wakes (ticks) ran long: a 1 s budget took 2.5 s beside one
    # busy thread, 9 s beside four. The epoch follows the clock instead (wasm._Ticker).
    plugin = LoadedPlugin(spec(module(handler("(loop $l (br $l)) (i64.const 0)")), timeout=1.0))
    stop = threading.Event()

    def busy() -> None:  # the event loop decoding frames, another runtime, the ORM...
        while not stop.is_set():
            sum(range(1000))

    threads = [threading.Thread(target=busy, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(HandlerTimeout):
            bounded(lambda: plugin.call("run", dict(EVENT), True, None))
        took = time.monotonic() - started
    finally:
        stop.set()
        plugin.close()
    assert 1.0 <= took < 1.0 + 0.7, f"a 1 s budget took {took:.2f} s beside two busy threads"


@pytest.mark.parametrize("body", [
    # exceptions caught by reference and kept in a table: each one on wasmtime's GC heap, which
    # is capped apart from linear memory (8 MiB of memory plus 8 MiB of exceptions at an 8 MiB cap)
    "(tag $e (param v128)) (table $t 1000 exnref)" + handler(
        "(table.set $t (i32.const 0) (block $h (result exnref) (try_table (catch_all_ref $h) "
        "(throw $e (v128.const i64x2 0 0))) (unreachable))) (i64.const 0)"),
    "(tag $e)" + handler("(throw $e)"),
])
def test_exception_handling_a_heap_outside_the_memory_cap_is_refused_at_save(body: str) -> None:
    with pytest.raises(PluginInvalid, match="exception handling is off.*memory cap"):
        validate(spec(module(body)))


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) >> 10


@pytest.mark.parametrize("end", ["unreachable", "(loop $l (br $l)) (i64.const 0)",
                                 "(call $log (i32.const -5) (i32.const 5)) (i64.const 0)"],
                         ids=["trap", "timeout", "host_error"])
def test_a_failed_call_frees_its_memory_when_it_returns(monkeypatch: pytest.MonkeyPatch, end: str) -> None:
    # A failed call's exception held its store through its traceback's frames, in a reference
    # cycle: the memory the guest touched stayed until the cyclic GC ran (each failed call at a
    # 1 GiB cap kept 250 MiB; with the GC off, as here, for ever). close() frees the store now.
    stores: list[object] = []
    start = wasm.WasmInstance.start

    def recording_start(self: wasm.WasmInstance, seconds: float) -> None:
        start(self, seconds)
        stores.append(self.store)

    monkeypatch.setattr(wasm.WasmInstance, "start", recording_start)
    code = module(handler("(drop (memory.grow (i32.const 1000))) (memory.fill (i32.const 0) (i32.const 1) "
                          f"(i32.const 64000000)) {end}"), imports=LOG)
    plugin = LoadedPlugin(replace(spec(code, timeout=1.0), memory_bytes=128 << 20))
    gc.disable()
    try:
        before = _rss_mib()
        for _ in range(4):
            with pytest.raises(HandlerError):
                bounded(lambda: plugin.call("run", dict(EVENT), True, None))
        grown = _rss_mib() - before
    finally:
        gc.enable()
        plugin.close()
    assert len(stores) == 4 + 1  # the probe at load, then one instance per call
    for store in stores:
        with pytest.raises(ValueError, match="closed"):
            store.ptr()  # type: ignore[attr-defined]
    assert grown < 100, f"4 failed calls that touched 61 MiB each left {grown} MiB"


class _DictKV:
    def __init__(self) -> None:
        self.data: dict[tuple[str, str], str] = {}

    def get(self, plugin: str, key: str, timeout: float) -> str | None:
        return self.data.get((plugin, key))

    def set(self, plugin: str, key: str, value: str, timeout: float, quotas: object = None) -> None:
        self.data[(plugin, key)] = value

    def incr(self, plugin: str, key: str, delta: int, timeout: float, quotas: object = None) -> int:
        value = self.data[(plugin, key)] = str(int(self.data.get((plugin, key), "0")) + delta)
        return int(value)

    def usage(self, plugin: str) -> tuple[int, int]:
        return len(self.data), 0


KV = ('(import "env" "kv_set" (func $kv_set (param i32 i32 i32 i32)))'
      '(import "env" "kv_get" (func $kv_get (param i32 i32 i32 i32) (result i32)))'
      '(import "env" "kv_incr" (func $kv_incr (param i32 i32 i64) (result i64)))')


@pytest.mark.parametrize("body, what, offset", [
    # b"a\xff" and b"a\xfe" were both read as "a\ufffd": one key, the second write overwrote the first
    ("(call $kv_set (i32.const 0) (i32.const 2) (i32.const 4) (i32.const 1))", "kv_set: the key", 1),
    ("(call $kv_set (i32.const 4) (i32.const 1) (i32.const 0) (i32.const 2))", "kv_set: the value", 1),
    ("(drop (call $kv_get (i32.const 1) (i32.const 1) (i32.const 8) (i32.const 8)))", "kv_get: the key", 0),
    # kv_incr (added later) still replaced them: b"a\xff" and b"a\xfe" counted on one key
    ("(drop (call $kv_incr (i32.const 0) (i32.const 2) (i64.const 1)))", "kv_incr: the key", 1),
], ids=["key", "value", "get", "incr"])
def test_kv_text_that_is_not_utf8_is_refused_not_replaced(body: str, what: str, offset: int) -> None:
    from plugins.runtimes import kvstore

    previous = kvstore.install(_DictKV())
    try:
        code = module('(data (i32.const 0) "a\\ff\\fe\\00x")' + handler(f"{body} (i64.const 0)"), imports=KV)
        with pytest.raises(HandlerError, match=rf"{what} is not valid UTF-8 \(byte 0x(ff|fe) at offset {offset}\); "
                                               "send text, or encode binary data"):
            plugin = LoadedPlugin(replace(spec(code), permissions=frozenset({"kv"})))
            bounded(lambda: plugin.call("run", dict(EVENT), True, None))
    finally:
        kvstore.install(previous)


def test_a_log_line_that_is_not_utf8_is_still_written(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="plugins.guest")
    call(module('(data (i32.const 0) "a\\ffb")' + handler("(call $log (i32.const 0) (i32.const 3)) (i64.const 0)"),
                imports=LOG))
    assert "[hostile] a\ufffdb" in caplog.text


def test_a_call_starting_while_the_ticker_is_late_keeps_its_whole_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # A late wake of the ticker adds every tick it missed; a call that started during the stall
    # would have counted them as its own and timed out at once (a stopped process that resumed
    # timed out every call just starting). Its deadline adds what the ticker owes (_Ticker.owed).
    loop = module(handler("(loop $l (br $l)) (i64.const 0)"))
    keeper, measured = LoadedPlugin(spec(loop, timeout=3.0)), LoadedPlugin(spec(loop, timeout=0.3))
    stalled = threading.Event()

    def stalling_sleep(seconds: float) -> None:
        if not stalled.is_set():
            stalled.set()
            time.sleep(1.0)  # one wake 1 s late: a stopped process, a starved thread
        time.sleep(seconds)

    background = threading.Thread(target=lambda: pytest.raises(HandlerTimeout, keeper.call, "run", dict(EVENT)),
                                  daemon=True)
    try:
        background.start()  # a guest running: the ticker ticks
        time.sleep(0.1)
        monkeypatch.setattr(wasm, "_tick_sleep", stalling_sleep)
        assert stalled.wait(2.0)
        time.sleep(0.9)  # well into the stall
        started = time.monotonic()
        with pytest.raises(HandlerTimeout):
            bounded(lambda: measured.call("run", dict(EVENT), True, None))
        took = time.monotonic() - started
    finally:
        background.join(HARD_SECONDS)
        keeper.close()
        measured.close()
    assert 0.3 <= took < 0.3 + 0.5, f"a 0.3 s budget took {took:.2f} s"
