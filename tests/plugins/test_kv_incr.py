"""kv_incr, the host API's atomic add: each runtime's binding (Lua, JS, WASM) through LoadedPlugin,
the refusals, and both KV stores counting exactly under concurrent use.

The guests' KV store is the database (pytest-django's ``db``); the store tests run the same cases on
Redis (``redis_url``: a key prefix of the test's own). Concurrency across threads and processes:
real Redis in this process; the database in worker processes of their own (``manage.py shell``) on
an SQLite file and on PostgreSQL, as worker processes share it in production.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Iterator

import pytest
from django.test import override_settings

from execapp.engine import HandlerError
from plugins import kv
from plugins.errors import GuestQuota, QuotaExceeded
from plugins.loaded import LoadedPlugin
from plugins.runtimes import kvstore
from plugins.runtimes.host import Host, HostCallError
from plugins.runtimes.kvstore import MAX_SAFE_INTEGER, KVValueError
from plugins.runtimes.wasm import wat_to_wasm
from plugins.spec import DEFAULT_QUOTAS, PluginSpec
from tests.conftest import ROOT, manage

RUNTIMES = ["lua", "js", "wasm"]


def event(args: str = "") -> dict:
    return {"args": args, "text": args, "type": "message", "id": "1", "session": None, "data": {}}


def loaded(runtime: str, code: Any, name: str = "inc", permissions: tuple = ("kv",), **quotas: int) -> LoadedPlugin:
    return LoadedPlugin(PluginSpec(name=name, runtime=runtime, code=code, timeout=2.0,
                                   permissions=frozenset(permissions), quotas=replace(DEFAULT_QUOTAS, **quotas)))


# Handlers: one (+1), minus (-3), huge (delta 2**60: refused), many (101 adds: past the writes quota).
# Each returns the new value as text; Lua and JS say what type it is (an integer, not a float).
LUA = r"""
function one(e) local v = kv_incr("n"); return math.type(v) .. " " .. v end
function minus(e) return tostring(kv_incr("n", -3)) end
function huge(e) return tostring(kv_incr("n", 1 << 60)) end
function many(e) for i = 1, 101 do kv_incr("n") end return "done" end
function caught(e)
  local ok, err = pcall(kv_incr, e.args)
  return (ok and "counted " or "refused: ") .. tostring(err)
end
function delta(e) return tostring(kv_incr("d", tonumber(e.args) or e.args)) end
function table_delta(e) return tostring(kv_incr("d", {})) end
"""

JS = r"""
async function one(e) { const v = await kv_incr("n"); return (Number.isInteger(v) ? "integer " : "float ") + v; }
async function minus(e) { return String(await kv_incr("n", -3)); }
async function huge(e) { return String(await kv_incr("n", 2 ** 60)); }
async function many(e) { for (let i = 0; i < 101; i++) await kv_incr("n"); return "done"; }
async function caught(e) {
  try { return "counted " + await kv_incr(e.args); } catch (err) { return "refused: " + err.message; }
}
async function queued(e) {  // queued at once, crossing in one batch: each gets its own value, in order
  const got = await Promise.all(Array.from({length: Number(e.args)}, () => kv_incr("q")));
  return got.join(",");
}
async function delta(e) {
  const d = {nan: NaN, inf: -Infinity, half: 0.5, text: "2", none: undefined, obj: {a: 1}}[e.args];
  return String(await kv_incr("d", d));
}
"""

# kv_incr(key_ptr, key_len, delta: i64) -> i64; the reply is the new value in decimal (written
# backwards from 600). The key "n" is at 100, "s" at 101.
WAT = r"""
(module
  (import "env" "kv_incr" (func $kv_incr (param i32 i32 i64) (result i64)))
  (memory (export "memory") 1)
  (data (i32.const 100) "ns")
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func $decimal (param $v i64) (result i64)
    (local $p i32) (local $neg i32)
    (local.set $p (i32.const 600))
    (if (i64.lt_s (local.get $v) (i64.const 0))
      (then (local.set $neg (i32.const 1)) (local.set $v (i64.sub (i64.const 0) (local.get $v)))))
    (loop $digit
      (local.set $p (i32.sub (local.get $p) (i32.const 1)))
      (i32.store8 (local.get $p) (i32.add (i32.const 48) (i32.wrap_i64 (i64.rem_u (local.get $v) (i64.const 10)))))
      (local.set $v (i64.div_u (local.get $v) (i64.const 10)))
      (br_if $digit (i64.ne (local.get $v) (i64.const 0))))
    (if (local.get $neg)
      (then (local.set $p (i32.sub (local.get $p) (i32.const 1))) (i32.store8 (local.get $p) (i32.const 45))))
    (i64.or (i64.shl (i64.extend_i32_u (local.get $p)) (i64.const 32))
            (i64.extend_i32_u (i32.sub (i32.const 600) (local.get $p)))))
  (func (export "one") (param i32 i32) (result i64)
    (call $decimal (call $kv_incr (i32.const 100) (i32.const 1) (i64.const 1))))
  (func (export "minus") (param i32 i32) (result i64)
    (call $decimal (call $kv_incr (i32.const 100) (i32.const 1) (i64.const -3))))
  (func (export "huge") (param i32 i32) (result i64)
    (call $decimal (call $kv_incr (i32.const 100) (i32.const 1) (i64.const 0x1000000000000000))))
  (func (export "many") (param i32 i32) (result i64)
    (local $i i32)
    (loop $l
      (drop (call $kv_incr (i32.const 100) (i32.const 1) (i64.const 1)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 101))))
    (i64.const 0))
  (func (export "bad") (param i32 i32) (result i64)
    (call $decimal (call $kv_incr (i32.const 101) (i32.const 1) (i64.const 1))))
)
"""

CODE = {"lua": LUA, "js": JS, "wasm": wat_to_wasm(WAT)}


def stored(key: str, plugin: str = "inc") -> str | None:
    return kv.kv_store().get(plugin, key, 5.0)


# -- the runtimes ----------------------------------------------------------------------------------

@pytest.mark.django_db
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_kv_incr_adds_and_returns_the_new_integer(runtime: str) -> None:
    plugin = loaded(runtime, CODE[runtime])
    first = plugin.call("one", event())
    assert first == ("1" if runtime == "wasm" else "integer 1")  # a missing key counts from 0
    assert plugin.call("one", event()) == ("2" if runtime == "wasm" else "integer 2")
    assert plugin.call("minus", event()) == "-1"
    assert stored("n") == "-1"  # stored as kv_get reads it: decimal text
    assert kv.kv_store().usage("inc") == kv.recount("inc")  # the totals follow the writes


@pytest.mark.django_db
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_kv_incr_refuses_a_result_past_the_safe_integers_and_keeps_the_value(runtime: str) -> None:
    plugin = loaded(runtime, CODE[runtime])
    plugin.call("one", event())
    # (JS writes 2**60 as 1152921504606847000: its shortest decimal form)
    with pytest.raises(HandlerError, match=r"delta 11529215046068\d{5} is outside \+-9007199254740991"):
        plugin.call("huge", event())
    kv.kv_store().set("inc", "n", str(MAX_SAFE_INTEGER), 5.0)
    with pytest.raises(HandlerError, match=r"'n' holds 9007199254740991, and adding 1 would give 9007199254740992"):
        plugin.call("one", event())
    assert stored("n") == str(MAX_SAFE_INTEGER)


@pytest.mark.django_db
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_kv_incr_counts_against_the_kv_writes_quota(runtime: str) -> None:
    plugin = loaded(runtime, CODE[runtime], kv_writes=100)
    with pytest.raises(QuotaExceeded) as info:
        plugin.call("many", event())
    assert info.value.code == "quota_kv_writes" and "kv_incr" in str(info.value)
    assert stored("n") == "100"


@pytest.mark.django_db
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_kv_incr_needs_the_kv_permission(runtime: str) -> None:
    plugin = loaded(runtime, CODE[runtime], permissions=("log",))
    with pytest.raises(HandlerError, match="kv_incr: plugin 'inc' has no 'kv' permission"):
        plugin.call("one", event())
    assert stored("n") is None


@pytest.mark.django_db
@pytest.mark.parametrize("runtime", ["lua", "js"])
def test_a_value_that_is_not_an_integer_is_a_catchable_error_naming_the_key(runtime: str) -> None:
    plugin = loaded(runtime, CODE[runtime])
    kv.kv_store().set("inc", "word", "seven", 5.0)
    reply = plugin.call("caught", event("word"))
    assert reply.startswith("refused: ") and "kv_incr: the value stored under 'word' is 'seven', not an integer" \
        in reply and "store a number there with kv_set first, or count under another key" in reply
    assert stored("word") == "seven"
    assert plugin.call("caught", event("fresh")) == "counted 1"


@pytest.mark.django_db
def test_js_adds_queued_without_await_each_count_once_in_order() -> None:
    plugin = loaded("js", JS)
    assert plugin.call("queued", event("50")) == ",".join(str(n) for n in range(1, 51))
    assert stored("q") == "50"
    with pytest.raises(QuotaExceeded) as info:  # past the writes quota: the call ends, 100 counted
        plugin.call("queued", event("150"))
    assert info.value.code == "quota_kv_writes" and stored("q") == "150"


@pytest.mark.django_db
def test_a_wasm_guest_traps_on_a_value_that_is_not_an_integer() -> None:
    plugin = loaded("wasm", CODE["wasm"])
    kv.kv_store().set("inc", "s", "1.5", 5.0)
    with pytest.raises(HandlerError, match="the value stored under 's' is '1.5', not an integer"):
        plugin.call("bad", event())


@pytest.mark.django_db
@pytest.mark.parametrize("args, refused", [
    ("nan", "got 'NaN'"), ("inf", "got '-Infinity'"), ("half", "got 0.5"), ("text", "got '2'"),
    ("obj", "got dict"), ("none", None)])
def test_a_js_delta_must_be_an_integer(args: str, refused: str | None) -> None:
    plugin = loaded("js", JS)
    if refused is None:  # no delta: 1
        assert plugin.call("delta", event(args)) == "1"
        return
    with pytest.raises(HandlerError, match=f"kv_incr: delta must be an integer number, {refused}"):
        plugin.call("delta", event(args))
    assert stored("d") is None  # refused before the store


@pytest.mark.django_db
def test_a_lua_delta_must_be_an_integer() -> None:
    plugin = loaded("lua", LUA)
    assert plugin.call("delta", event("2.0")) == "2"  # an integral float counts
    with pytest.raises(HandlerError, match="kv_incr: delta must be an integer number, got 0.5"):
        plugin.call("delta", event("0.5"))
    with pytest.raises(HandlerError, match="kv_incr: delta must be an integer number, got 'x'"):
        plugin.call("delta", event("x"))
    with pytest.raises(HandlerError, match="kv_incr: argument 2 is a table; host calls take strings and numbers"):
        plugin.call("table_delta", event())
    assert stored("d") == "2"


# -- the stores ------------------------------------------------------------------------------------

@pytest.fixture(params=[pytest.param("database", marks=pytest.mark.django_db),
                        pytest.param("redis", marks=pytest.mark.redis)])
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "database":
        yield kv.kv_store()
        return
    with override_settings(REDIS_URL=request.getfixturevalue("redis_url")):
        redis_store = kv.kv_store()
        assert isinstance(redis_store, kv.RedisKV)
        yield redis_store


@pytest.mark.parametrize("value", ["+5", "007", "-0", "1.5", "1e3", " 5", "5 ", "abc", "", "٣",
                                   "9007199254740992", "-9007199254740992", "12345678901234567890"])
def test_both_stores_count_only_what_they_both_call_an_integer(store: Any, value: str) -> None:
    store.set("forms", "k", value, 5.0)
    with pytest.raises(KVValueError, match="the value stored under 'k' is .*, not an integer kv_incr can count"):
        store.incr("forms", "k", 1, 5.0)
    assert store.get("forms", "k", 5.0) == value


@pytest.mark.parametrize("value, delta, result", [
    ("0", 1, 1), ("-5", 3, -2), ("41", -41, 0), (str(MAX_SAFE_INTEGER - 1), 1, MAX_SAFE_INTEGER),
    (str(-MAX_SAFE_INTEGER), MAX_SAFE_INTEGER, 0), (None, -MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER)])
def test_both_stores_add_exactly_up_to_the_safe_integers(store: Any, value: str | None, delta: int,
                                                         result: int) -> None:
    if value is not None:
        store.set("adds", "k", value, 5.0)
    assert store.incr("adds", "k", delta, 5.0) == result
    assert store.get("adds", "k", 5.0) == str(result)
    with pytest.raises(KVValueError, match="'fresh' holds 0, and adding 9007199254740992 would give"):
        store.incr("adds", "fresh", MAX_SAFE_INTEGER + 1, 5.0)  # (the host refuses such a delta first)
    if result:
        with pytest.raises(KVValueError, match="outside the integers kv_incr keeps"):
            store.incr("adds", "k", MAX_SAFE_INTEGER if result > 0 else -MAX_SAFE_INTEGER, 5.0)
        assert store.get("adds", "k", 5.0) == str(result)


def test_both_stores_keep_the_quotas_and_totals_on_kv_incr(store: Any) -> None:
    quotas = replace(DEFAULT_QUOTAS, kv_keys=2, kv_bytes=30)
    assert store.incr("q", "a", 1, 5.0, quotas) == 1
    assert store.incr("q", "b", 9, 5.0, quotas) == 9
    assert store.usage("q") == (2, 4)
    with pytest.raises(GuestQuota, match="kv_incr: plugin 'q' already stores 2 keys") as info:
        store.incr("q", "c", 1, 5.0, quotas)
    assert info.value.code == "quota_kv"
    assert store.incr("q", "b", 1, 5.0, quotas) == 10  # an existing key grows within the bytes
    store.set("q", "a", "1" * 25, 5.0)  # 26 + 3 bytes: one more digit is past 30
    with pytest.raises(GuestQuota, match="kv_incr: plugin 'q' would store 31 bytes") as info:
        store.incr("q", "b", 990, 5.0, quotas)
    assert info.value.code == "quota_kv" and store.get("q", "b", 5.0) == "10"
    assert store.usage("q") == (2, 29)


@pytest.mark.redis
def test_redis_counts_every_add_of_many_threads_exactly_once(redis_url: str) -> None:
    with override_settings(REDIS_URL=redis_url):
        store = kv.kv_store()
        assert isinstance(store, kv.RedisKV)
        seen: list[int] = []

        def adder() -> None:
            mine = [store.incr("race", "n", 1, 5.0) for _ in range(50)]
            seen.extend(mine)  # (list.extend is atomic under the GIL)

        threads = [threading.Thread(target=adder) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Every add returned a value no other add returned: none was lost or counted twice.
        assert sorted(seen) == list(range(1, 401))
        assert store.get("race", "n", 5.0) == "400"
        assert store.usage("race") == (1, len("n") + len("400"))


# A worker process of its own: THREADS threads each add 1 ADDS times, and print every value they got.
_ADDER = """
import json, threading
from django.db import connections
from plugins import kv
store = kv.kv_store()
assert isinstance(store, kv.DatabaseKV), store
seen = []
def adder():
    try:
        seen.extend(store.incr("race", "n", 1, 30.0) for _ in range({adds}))
    finally:
        connections.close_all()
threads = [threading.Thread(target=adder) for _ in range({threads})]
for t in threads: t.start()
for t in threads: t.join()
print("SEEN " + json.dumps(seen))
"""


def _add_in_processes(env: dict[str, str], processes: int = 3, threads: int = 4, adds: int = 20) -> list[int]:
    """Every value the adds of ``processes`` worker processes on ``env``'s database returned."""
    script = _ADDER.format(adds=adds, threads=threads)
    procs = [subprocess.Popen([sys.executable, "manage.py", "shell", "-c", script], cwd=ROOT,
                              env={**os.environ, "REDIS_URL": "", **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    seen: list[int] = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        seen += json.loads(next(line for line in out.splitlines() if line.startswith("SEEN "))[5:])
    return seen


@pytest.mark.e2e
def test_the_database_counts_every_add_of_many_processes_and_threads_exactly_once_on_sqlite(
        sqlite_env: dict[str, str]) -> None:
    seen = _add_in_processes(sqlite_env)
    assert sorted(seen) == list(range(1, 3 * 4 * 20 + 1))


@pytest.mark.e2e
@pytest.mark.postgres
def test_the_database_counts_every_add_of_many_processes_and_threads_exactly_once_on_postgresql(
        postgres_url: str) -> None:
    env = {"DATABASE_URL": postgres_url}
    result = manage("migrate", "--noinput", env={**env, "REDIS_URL": ""}, timeout=180)
    assert result.returncode == 0, result.stderr
    seen = _add_in_processes(env)
    assert sorted(seen) == list(range(1, 3 * 4 * 20 + 1))



def test_a_store_installed_without_incr_fails_kv_incr_with_what_to_do() -> None:
    class OldStore:  # a script's store from before kv_incr (get/set/usage only)
        def get(self, plugin: str, key: str, timeout: float) -> str | None:
            return None

    previous = kvstore.install(OldStore())  # type: ignore[arg-type]
    try:
        host = Host(PluginSpec(name="old", runtime="lua", code="", permissions=frozenset({"kv"})),
                    time.monotonic() + 2.0)
        with pytest.raises(HostCallError, match=r"the installed KV store \(OldStore\) has no incr\(\)"):
            host.kv_incr("n")
        assert host.kv_writes == 0  # nothing was written: no write counted
    finally:
        kvstore.install(previous)
