"""Guest code used by the plugin tests: the same handlers written for each runtime."""
from __future__ import annotations

from plugins.runtimes.wasm import wat_to_wasm

LUA = r"""
calls = 0
function reply(ev) calls = calls + 1; return "hi " .. ev.args end
function count(ev) calls = calls + 1; return tostring(calls) end
function data(ev) return {text = ev.text, session = ev.session, list = {1, 2, 3}} end
function loop(ev) while true do end end
function loop_pcall(ev) while true do pcall(function() while true do end end) end end
function loop_coroutine(ev)
  local co = coroutine.create(function() while true do end end)
  while true do coroutine.resume(co) end
end
function loop_wrap(ev) while true do pcall(coroutine.wrap(function() while true do end end)) end end
function bomb(ev) local t = {} for i = 1, 1e9 do t[i] = string.rep("x", 1024) .. i end end
function fail(ev) error("kaput") end
function nap(ev) sleep(tonumber(ev.args)); return "napped" end
function denied(ev) local v = kv_get("x"); return v end
function escape(ev)
  local what = ev.args
  if what == "os" then return os.execute("true") end
  if what == "io" then return io.open("/etc/passwd") end
  if what == "require" then return require("os") end
  if what == "python" then return python.eval("1") end
  if what == "load" then return load("return 1")() end
  if what == "bytecode" then return string.dump(reply) end
  if what == "debug" then return debug.getinfo(1) end
  if what == "string" then string.upper = function() return "pwned" end end
  if what == "metatable" then getmetatable("").__index.upper = nil end
  return "escaped"
end
"""

JS = r"""
let calls = 0;
function reply(ev) { calls++; return "hi " + ev.args; }
function count(ev) { calls++; return String(calls); }
function data(ev) { return {text: ev.text, session: ev.session, list: [1, 2, 3]}; }
function loop(ev) { while (true) {} }
function loop_try(ev) { while (true) { try { while (true) {} } catch (e) {} } }
async function loop_async(ev) { await null; while (true) {} }
function bomb(ev) { const a = []; while (true) a.push("x".repeat(1024) + a.length); }
function fail(ev) { throw new Error("kaput"); }
async function nap(ev) { await sleep(Number(ev.args)); return "napped"; }
async function denied(ev) { return await kv_get("x"); }
async function escape(ev) {
  const what = ev.args;
  if (what === "require") return require("fs");
  if (what === "process") return process.env;
  if (what === "std") return std.loadFile("/etc/passwd");
  if (what === "import") return await import("os");
  if (what === "fetch") return await fetch("http://example.com");
  return "escaped";
}
"""

# The WASM ABI (docs/plugins.md): memory, alloc(len) -> ptr, handlers (ptr, len) -> (ptr << 32) | len.
WAT = r"""
(module
  (import "env" "sleep" (func $sleep (param i32)))
  (import "env" "kv_get" (func $kv_get (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (global $calls (mut i32) (i32.const 0))
  (data (i32.const 16) "napped")
  (data (i32.const 32) "key")
  (func (export "alloc") (param $len i32) (result i32) (i32.const 1024))
  (func $pack (param $p i32) (param $n i32) (result i64)
    (i64.or (i64.shl (i64.extend_i32_u (local.get $p)) (i64.const 32)) (i64.extend_i32_u (local.get $n))))
  ;; the event JSON itself: a data reply
  (func (export "data") (param $p i32) (param $n i32) (result i64)
    (call $pack (local.get $p) (local.get $n)))
  ;; "hi": a text reply, counting calls in a global (warm state)
  (func (export "reply") (param $p i32) (param $n i32) (result i64)
    (global.set $calls (i32.add (global.get $calls) (i32.const 1)))
    (i32.store8 (i32.const 0) (i32.const 104))
    (i32.store8 (i32.const 1) (i32.const 105))
    (call $pack (i32.const 0) (i32.const 2)))
  ;; the call count as one digit (tests stay below 10 calls per instance)
  (func (export "count") (param $p i32) (param $n i32) (result i64)
    (global.set $calls (i32.add (global.get $calls) (i32.const 1)))
    (i32.store8 (i32.const 8) (i32.add (i32.const 48) (global.get $calls)))
    (call $pack (i32.const 8) (i32.const 1)))
  (func (export "loop") (param $p i32) (param $n i32) (result i64)
    (loop $l (br $l))
    (i64.const 0))
  (func (export "bomb") (param $p i32) (param $n i32) (result i64)
    (loop $l (br_if $l (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))
    unreachable)
  (func (export "fail") (param $p i32) (param $n i32) (result i64)
    unreachable)
  ;; sleeps 300 ms through the host
  (func (export "nap") (param $p i32) (param $n i32) (result i64)
    (call $sleep (i32.const 300))
    (call $pack (i32.const 16) (i32.const 6)))
  (func (export "denied") (param $p i32) (param $n i32) (result i64)
    (drop (call $kv_get (i32.const 32) (i32.const 3) (i32.const 64) (i32.const 16)))
    (i64.const 0))
)
"""

WASM = wat_to_wasm(WAT)

CODE = {"lua": LUA, "js": JS, "wasm": WASM}
LOOPS = {"lua": ["loop", "loop_pcall", "loop_coroutine", "loop_wrap"], "js": ["loop", "loop_try", "loop_async"],
         "wasm": ["loop"]}
SYNTAX_ERRORS = {"lua": ("function broken(", "<eof>"), "js": ("function broken(", "SyntaxError"),
                 "wasm": ("(module (func $f (result i32)))", "type mismatch")}
