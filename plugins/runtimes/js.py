"""JavaScript through QuickJS-NG (``quickjs-ng``, imported as ``quickjs``), chosen by measurement.

runtime-facts.md and bench/bench_plugins.py: a new QuickJS Context ~0.1-0.2 ms and a reused
call with JSON in ~6-10 us, against ~3.6 ms and ~215 us for mini-racer (V8), whose every call
also hops to a thread of its own. QuickJS gives per-context memory, stack and time limits.
The original ``quickjs`` 1.19.4 binding segfaults on common guest out-of-memory patterns
(upstream QuickJS OOM bugs); QuickJS-NG, a drop-in with the same Python API, survives them.

Rules this module keeps:
- a Context runs one call at a time, on whichever thread holds it (a pooled free-list pop, a
  shard's lock, a per_request Context of its own); a second entry at once is refused. QuickJS
  keeps no thread-local state: what ties a runtime to a thread is its stack top, which the
  binding moves to the calling thread at every entry into JS (``prepare_call_js`` calls
  ``JS_UpdateStackTop``, quickjs-ng 0.17.0.2 module.c; our one C-API entry, the prelude, does
  too), and its saved thread state, set and restored within one entry. So a Context may move
  between threads between calls (pooled and sharded calls run on the caller's thread; the
  shard thread hop cost 30-70 us a call);
- QuickJS refuses to call into Python while a time limit is set, so guests never call Python:
  the host API is asynchronous in JS (``await kv_get(k)``); calls queue requests that the
  host runs between steps, then resolves the promises and runs the pending jobs;
- one wall-clock deadline per call (per top-level evaluation at load), kept at every boundary:
  inside JS by the js_deadline watchdog (the binding's own limit counts process CPU time and
  fired early under load; it stays only as a backstop that cannot fire first), after every
  pending job, before every host call and between steps;
- values cross as JSON strings, or as strings themselves (the event's fields, a string reply the
  binding can carry), never as objects;
- no guest value leaves an entry point: the binding would turn it into text with guest code
  (toString, getters) after removing the interrupt handler, with the GIL held; what QuickJS
  itself throws past any catch (interrupted, out of memory) is an InternalError, whose
  prototype is frozen first. The plugin's top level (the binding's own eval) runs with the
  interrupt handler held across the binding's exits (js_deadline.hold) instead;
- a Context that hit its memory limit, timed out or failed in the host is discarded (QuickJS
  has crashed on a Context reused after an out-of-memory error).
"""
from __future__ import annotations

import ctypes
import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import quickjs

from ..errors import CompileError, GuestError, GuestMemory, GuestQuota, GuestTimeout
from . import js_deadline, js_free
from .base import (
    MAX_ERROR_CHARS,
    MAX_REPLY_BYTES,
    FreshInstanceIsolation,
    load_budget_note,
    load_seconds,
    scan_json,
    to_json,
    to_reply,
)
from .host import MAX_LOG_CHARS, MAX_URL_CHARS, Host
from .js_atoms import SCAN_CHARS, crowded_keys
from .kvstore import MAX_KEY_CHARS, MAX_VALUE_CHARS

if not quickjs._quickjs.__file__.endswith(".abi3.so"):
    # The old `quickjs` 1.19.4 binding (its .so wins over quickjs-ng's when both are installed)
    # segfaults when a guest hits its memory limit: refuse to run plugins on it.
    raise ImportError("the old 'quickjs' binding is loaded instead of quickjs-ng: run "
                      "`.venv/bin/pip uninstall -y quickjs quickjs-ng && .venv/bin/pip install quickjs-ng==0.17.0.2`")

STACK_BYTES = 512 << 10
MAX_STEPS = 10_000
#: Characters of JSON one step may hand to Python (its reply, error and queued host calls): what
#: crosses is copied into Python, outside the memory cap, before any check there.
MAX_STEP_CHARS = 8 << 20
#: Characters of host calls one step hands over, and of host results one resume hands back: past
#: it, the rest wait for the next step (each side takes at least one). Python holds what crosses in
#: one step outside the memory cap: 2,000 kv_get of a 64 KiB value queued at once held 128M
#: characters of results (~440 MB of RSS) for a plugin capped at 16 MiB.
MAX_BATCH_CHARS = 1 << 20
#: Wall-clock deadlines inside JS through the js_deadline watchdog (read when a Context is made).
#: False gives the binding's CPU-time limit per step instead: only for the benchmark comparing
#: the hot path guarded and unguarded; the checks after jobs and before host calls stay.
GUARDED = True
#: A regexp literal is compiled while the source is parsed, in C with no poll, and each `\k<name>` in
#: it (a named back-reference) before its group, or with no such group, scans the whole pattern: a
#: literal of 20,000 of them (100 KB) held the save's validation 3.1 s past a 0.3 s budget, 200,000
#: would take minutes, at every new Context too. A source whose count of `\k<` times its length
#: passes this is refused at save (at most 16 in a 4 MiB source, 640 in 100 KB); `new RegExp` at run
#: time is checked by the guards instead (js_guards.js: a pattern of at most 16,384 characters).
MAX_BACKREF_WORK = 1 << 26
#: How much a regexp's property escapes (``\p{...}``, ``\P{...}``) may weigh: each builds a Unicode
#: set when the pattern compiles, in C with no poll (1,200 ``\p{RGI_Emoji}`` in one 16 KB pattern:
#: 2.7 s of CPU at 256 MiB). Each counts 1 (at most ~0.24 ms measured), a property of strings
#: (``RGI_Emoji...``, ``Basic_Emoji``: 0.9-3.6 ms) HEAVY_PROPERTY. Checked by the guards for every
#: pattern compiled at run time, and at save for the plugin's source as a whole (its regexp literals
#: compile as it is parsed, in every new Context).
MAX_PROPERTY_WORK = 1 << 8
HEAVY_PROPERTY = 16
#: The host calls a guest's requests may name (the prelude's; anything else breaks the protocol).
_HOST_OPS = frozenset({"log", "kv_get", "kv_set", "kv_incr", "sleep", "http_get"})

_PRELUDE = r"""
(function () {
  "use strict";
  const g = globalThis;
  // Captured before the plugin's code runs: a guest that replaces JSON or Object.assign
  // cannot break the protocol with the host.
  const stringify = JSON.stringify, parse = JSON.parse, assign = Object.assign, NativePromise = Promise;
  // (a guest's String made errstr return its object: a dict reached the host as the error text)
  const NativeString = String;
  const reject = Promise.reject;
  // The host calls queued since the last step, each as its JSON text (queued[head..tail)), and the
  // promises waiting on them by id: objects without a prototype, written and read with no guest
  // code on the way (a guest's Array.prototype.push, a setter on an index or Object.prototype.toJSON
  // saw the queue itself, and could hand the host any value). dirty: a call was queued since the
  // last reset.
  let queued = {__proto__: null}, head = 0, tail = 0, seq = 0, waiting = {__proto__: null};
  // calls: this Context's calls so far. A job belongs to the call that queued it: one a call left
  // pending (a sync reply returns before any job runs) runs in a later call, where its error or its
  // settlement must not become that call's outcome (a microtask's error naming tenant A's event was
  // tenant B's next reply).
  let done = null, loading = true, dirty = false, value = null, calls = 0;
  // Every string that leaves JS is copied into Python, outside the memory cap: a 4M-character
  // reply, error or log line made Python allocate 76-137 MB for a plugin capped at 64 MiB. So
  // each is bounded here, before it crosses: a reply refused past its limit (it would be
  // anyway), an error text cut as the host cuts it, a log line cut to what the host can keep (it
  // keeps __MAX_LOG__ code points: at most twice as many UTF-16 units), and one step's JSON
  // refused past __MAX_STEP__ characters.
  const MAX_REPLY = __MAX_REPLY__, MAX_ERROR = __MAX_ERROR__;
  const tooLarge = (what, n) => ({s: "err", e: what + " is " + n + " characters, over the limit of " + MAX_REPLY +
                                             " bytes (MAX_REPLY_BYTES); reply with less"});
  // Nothing a guest throws may leave an entry point: the binding turns an escaping exception
  // into text (toString, name, message, stack getters: guest code) after it has removed the
  // interrupt handler, so a looping toString froze the process with the GIL held. Guest values
  // are turned into text here, inside JS, under the deadline; errstr itself never throws.
  const errstr = (e) => {
    let s;
    try {
      if (e instanceof Error) {
        const at = NativeString(e.stack || "").split("\n").map(s => s.trim()).filter(Boolean)[0];
        s = e.name + ": " + e.message + (at ? " (" + at + ")" : "");
      } else {
        s = NativeString(e);
      }
    } catch (_) {
      return "the handler threw a value that cannot be turned into text (converting it failed: a stack overflow, " +
             "out of memory or its own error); throw an Error with a short message";
    }
    // (cut as base.clip_error cuts, short enough that it leaves this text alone)
    return s.length <= MAX_ERROR ? s :
      apply(sSlice, s, [0, MAX_ERROR - 64]) + " ... (cut: the message was " + s.length + " characters)";
  };
  // What does leave JS uncaught is QuickJS's own InternalError (interrupted, out of memory):
  // its text comes from InternalError.prototype, frozen here before any guest code runs with
  // own copies of everything the binding reads (a new property's attributes default to false).
  const ip = InternalError.prototype;
  Object.defineProperties(ip, {toString: {value: Error.prototype.toString}, stack: {value: ""},
                               [Symbol.toPrimitive]: {value: undefined}});
  Object.freeze(ip);
  // Jobs QuickJS runs outside any entry of ours would throw straight to the binding: a
  // microtask's callback is wrapped (its error fails the call); FinalizationRegistry, whose
  // callbacks run whenever the GC decides and whose original constructor any instance leads
  // back to, is not offered.
  const microtask = queueMicrotask;
  g.queueMicrotask = (f) => {
    const mine = calls;
    return microtask(typeof f !== "function" ? f : () => {
      try { f(); } catch (e) { if (mine === calls) done = {s: "err", e: errstr(e)}; }
    });
  };
  delete g.FinalizationRegistry;
  // Error.prepareStackTrace (QuickJS-NG has V8's hook) runs guest code whenever an error is made,
  // QuickJS's own "interrupted" InternalError included, with that error in hand: a hook that gave
  // it a `message` getter that loops hung the process (the binding reads it with no interrupt
  // handler). Not offered: undefined, and no setter left to install a hook with.
  Object.defineProperty(Error, "prepareStackTrace", {value: undefined, writable: false, configurable: false});
__NATIVE_GUARDS__
  // A host call's argument as the JSON of what the host reads: a primitive (an object's own JSON
  // when that is one: a Date's string, a Number's number), a string past the limit `n` cut to a
  // length the host still refuses (2n + 2 UTF-16 units hold more than n code points), or an empty
  // array or object for any other value, which the host refuses by its type. A whole nested value
  // crossed before: its JSON cost Python ~30 bytes a character, outside the memory cap.
  const arg = (v, n) => {
    if (v !== null && (typeof v === "object" || typeof v === "function" || typeof v === "bigint")) {
      const s = stringify(v);  // (the guest's toJSON: under the deadline, its errors reject the call)
      if (s === undefined) return "null";
      if (s[0] === "{" || s[0] === "[") return s[0] === "{" ? "{}" : "[]";
      v = parse(s);
    }
    if (typeof v === "string") return stringify(v.length > 2 * n + 2 ? apply(sSlice, v, [0, 2 * n + 2]) : v);
    return typeof v === "number" || typeof v === "boolean" ? stringify(v) : "null";
  };
  const enqueue = (id, op, args) => {
    queued[tail++] = "[" + id + ",\"" + op + "\"," + args + "]";
    dirty = true;
  };
  // `args()` gives the arguments' JSON text (a guest's toJSON may throw: the call's promise rejects).
  const request = (op, args) => {
    if (loading)
      throw new Error(op + ": the host API is not available while the plugin's top level runs; call it from a handler");
    let text;
    try { text = "[" + args() + "]"; } catch (e) { return apply(reject, NativePromise, [e]); }
    return new NativePromise((resolve, reject) => {
      const id = ++seq;
      waiting[id] = [resolve, reject];
      enqueue(id, op, text);
    });
  };
  // Read-only, not enumerable, not configurable: a new property's attributes default to false.
  const define = (name, value) => Object.defineProperty(g, name, {value});
  define("log", (msg) => {
    if (loading) request("log", null);
    const s = NativeString(msg);  // (cut to what the host can keep)
    enqueue(0, "log", "[" + stringify(s.length > 2 * __MAX_LOG__ ? apply(sSlice, s, [0, 2 * __MAX_LOG__]) : s) + "]");
  });
  define("kv_get", (key) => request("kv_get", () => arg(key, __MAX_KEY__)));
  define("kv_set", (key, value) => request("kv_set", () => arg(key, __MAX_KEY__) + "," + arg(value, __MAX_VALUE__)));
  // No delta: 1. NaN and the infinities cross as their names, which the host refuses (their JSON is
  // null, which would have counted 1).
  define("kv_incr", (key, delta) => request("kv_incr", () => arg(key, __MAX_KEY__) + "," +
    (delta === undefined ? "1" : delta !== delta || delta === 1 / 0 || delta === -1 / 0 ? '"' + delta + '"' :
     arg(delta, 32))));
  define("sleep", (ms) => request("sleep", () => arg(ms, 16)));
  define("http_get", (url) => request("http_get", () => arg(url, __MAX_URL__)));
  // One step's JSON, written here from texts (no guest code but a reply's toJSON): the state and the
  // host calls queued first, up to __MAX_BATCH__ characters of them (at least one; each counted 64
  // more, for the objects Python makes of it); with calls left over it says "wait" and "more",
  // whatever the handler's outcome, until all have crossed.
  const step = () => {
    let q = "", more = 0, size = 0;
    while (head < tail) {
      const entry = queued[head];
      size += entry.length + 64;
      if (q.length > 0 && size > __MAX_BATCH__) { more = 1; break; }
      delete queued[head++];
      q = q.length > 0 ? q + "," + entry : entry;
    }
    let state = '{"s":"wait","more":' + more;
    if (done && !more) {
      let s = done.s, json;
      try {
        json = s === "ok" ? stringify(done.v) ?? "null" : stringify(done.e);  // (a function's JSON: null)
        if (s === "ok" && json.length > MAX_REPLY) {
          s = "err";
          json = stringify(tooLarge("the reply's JSON", json.length).e);
        }
      } catch (e) {  // the reply's toJSON threw
        s = "err"; json = stringify(errstr(e));
      }
      state = '{"s":"' + s + '","' + (s === "ok" ? "v" : "e") + '":' + json;
    }
    const out = state + ',"q":[' + q + "]}";
    // (flat: the binding cannot read a rope, the string `+` builds past ~1,000 characters)
    return out.length <= __MAX_STEP__ ? apply(sSlice, out, [0]) : stringify({s: "err", q: [], e: "one step of the " +
      "handler (its reply, error and queued host calls) is " + out.length + " characters of JSON, over the limit " +
      "of __MAX_STEP__"});
  };
  // One call: `event` is the event's JSON, or (fields) an object whose `data` is its JSON.
  // What it returns, for the common case of a plain value and no host call queued: a string
  // reply itself (the binding converts it in C; JSON-encoding it here and scanning it in
  // Python cost ~0.5 us), null for null or undefined, or 1 when the value's JSON is to be read
  // with __execapp_value (other values, and strings the binding cannot carry: a NUL would cut
  // it short, a lone surrogate fails its UTF-8 conversion). Anything else leaves the outcome
  // in `done` and returns 0: the host reads the state with __execapp_step.
  const run = (name, event, fields) => {
    // All of it in the try: the handler lookup, the reset, the reply checks can all reach
    // guest code (a getter on globalThis, a replaced Map or String method).
    try {
      // Reset only what a previous call left (this runs on every call).
      loading = false; done = null; value = null; calls++;
      if (dirty) { queued = {__proto__: null}; head = tail = 0; waiting = {__proto__: null}; dirty = false; }
      const f = g[name];
      if (typeof f !== "function") { done = {s: "err", e: "no handler function '" + name + "'"}; return 0; }
      if (fields) event.data = parse(event.data); else event = parse(event);
      const r = f(event);
      if (r !== null && typeof r === "object" && typeof r.then === "function") {
        // A job's error (set first) wins, as it did when it failed the call from outside.
        const mine = calls;
        r.then(v => { if (mine === calls) done ??= {s: "ok", v: v === undefined ? null : v}; },
               e => { if (mine === calls) done ??= {s: "err", e: errstr(e)}; });
        return 0;
      }
      if (dirty) { done = {s: "ok", v: r === undefined ? null : r}; return 0; }
      // (A guest that replaces these two methods can only spoil its own reply: a string cut at
      // a NUL, or a reply the host refuses as a protocol error.)
      // (includes: the native one; the guest's sees the wrapper of js_guards.js, ~0.5 us more)
      if (typeof r === "string") {
        if (r.length > MAX_REPLY) { done = tooLarge("the reply", r.length); return 0; }  // (at least as many bytes)
        // (flat: the binding cannot read a rope, which `+` makes of strings past 512 characters)
        if (r.isWellFormed() && !apply(sIncludes, r, ["\0"])) return r.length > 256 ? apply(sSlice, r, [0]) : r;
      }
      if (r === undefined || r === null) return null;
      value = r;
      return 1;
    } catch (e) { done = {s: "err", e: errstr(e)}; return 0; }
  };
  // The JSON of the plain value the last call returned 1 for (a value JSON cannot represent,
  // like a function, is null); 0 (the error in `done`) if its toJSON threw.
  define("__execapp_value", () => {
    try {
      const s = stringify(value) ?? "null";
      if (s.length <= MAX_REPLY) return s;
      done = tooLarge("the reply's JSON", s.length);
    } catch (e) { done = {s: "err", e: errstr(e)}; }
    return 0;
  });
  define("__execapp_run", (name, event) => run(name, event, false));
  // The engine's event with its strings as arguments: only `data` crosses as JSON.
  define("__execapp_call", (name, id, type, text, data, session, tenant, args) =>
    run(name, {id, type, text, data, session, tenant, args}, true));
  // The host's results ([id, ok, value] each), handed to the promises waiting on them (settled as
  // jobs: the host runs those, then takes the next step).
  define("__execapp_resume", (results) => {
    try {  // (index loops over arrays JSON.parse made: no iterator; Error can be the guest's by now)
      const r = parse(results);
      for (let i = 0; i < r.length; i++) {
        const id = r[i][0], w = waiting[id];
        delete waiting[id];
        if (w) { if (r[i][1]) w[0](r[i][2]); else w[1](new Error(r[i][2])); }
      }
    } catch (e) { done = {s: "err", e: errstr(e)}; }
    return 0;
  });
  define("__execapp_step", step);
})();
"""

#: The Array.prototype methods that walk ``length`` in C and that this QuickJS has, each replaced
#: by a proxy with the guards' ``arrayTraps`` (js_guards.js: concat, flat and flatMap have
#: wrappers of their own).
#: Asked once, of a scratch Context, so that no guard adds a method.
_GUARDED_METHODS = tuple(json.loads(quickjs.Context().eval("JSON.stringify(%s.filter(n => typeof Array.prototype[n] "
                                                           "=== 'function'))" % json.dumps([
    "join", "toString", "toLocaleString", "indexOf", "lastIndexOf", "includes", "fill", "copyWithin", "reverse",
    "forEach", "map", "filter", "some", "every", "find", "findIndex", "findLast", "findLastIndex", "reduce",
    "reduceRight", "slice", "splice", "sort", "shift", "unshift", "with", "toReversed", "toSorted", "toSpliced"]))))
def _code_lines(path: Path) -> str:
    """The file's text without its comment lines: the slow paths are carried as text in every
    new Context (a string constant of the prelude's bytecode), their comments too otherwise."""
    return "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("//"))


def _template(text: str) -> str:
    """``text`` as a JS template literal whose cooked string is ``text`` (the tag sees it as is)."""
    return "`" + text.replace("\\", "\\\\").replace("`", "\\`").replace("${", "\\${") + "`"


# The guards are inlined into the prelude's function, their slow paths as the text of a function
# body (a template literal) that a Context compiles when it first needs one.
_PRELUDE = (_PRELUDE.replace("__MAX_REPLY__", str(MAX_REPLY_BYTES)).replace("__MAX_ERROR__", str(MAX_ERROR_CHARS))
            .replace("__MAX_LOG__", str(MAX_LOG_CHARS)).replace("__MAX_STEP__", str(MAX_STEP_CHARS))
            .replace("__MAX_KEY__", str(MAX_KEY_CHARS)).replace("__MAX_VALUE__", str(MAX_VALUE_CHARS))
            .replace("__MAX_URL__", str(MAX_URL_CHARS)).replace("__MAX_BATCH__", str(MAX_BATCH_CHARS)))
_PRELUDE = _PRELUDE.replace("__NATIVE_GUARDS__", (Path(__file__).with_name("js_guards.js").read_text()
    .replace("__GUARDS_SLOW__", _template(_code_lines(Path(__file__).with_name("js_guards_slow.js"))))
    .replace("__GUARDED_ORIGINALS__", "[" + ", ".join(f"AP.{name}" for name in _GUARDED_METHODS) + "]")
    .replace("__GUARDED_NAMES__", json.dumps(_GUARDED_METHODS))
    .replace("__PROPERTY_WORK__", str(MAX_PROPERTY_WORK)).replace("__HEAVY_PROPERTY__", str(HEAVY_PROPERTY))
))

# Only for validation (list_functions): kept out of _PRELUDE because QuickJS compiles every
# character of the prelude into each new Context (~40 ns/char: the prelude is most of a
# per_request call's cost).
#: Characters of JSON the list of a plugin's global functions may have (read once, at validation):
#: it crosses into Python outside the memory cap. ~20,000 functions of 50-character names.
MAX_FUNCTION_LIST_CHARS = 1 << 20
# Everything it calls is captured here, before the plugin's code runs: the guest's JSON.stringify
# returned 50 MB of "[1000,1000,...]" at a 128 MiB cap, which Python parsed into 10M ints (the
# process grew 478 MB), and a guest's Set.prototype.has listed the prelude's entry points.
_LIST_FUNCTIONS = r"""
(() => {
  const parse = JSON.parse, stringify = JSON.stringify, names = Object.getOwnPropertyNames, g = globalThis,
        slice = String.prototype.slice, apply = Reflect.apply;
  Object.defineProperty(g, "__execapp_functions", {value: (before) => {
    const skip = parse(before), seen = {__proto__: null}, all = names(g);
    for (let i = 0; i < skip.length; i++) seen[skip[i]] = true;
    let out = "";
    for (let i = 0; i < all.length; i++) {
      const k = all[i];
      if (seen[k] !== true && typeof g[k] === "function") {  // (a getter on globalThis: guest code, timed)
        out = out.length > 0 ? out + "," + stringify(k) : stringify(k);
        if (out.length > __MAX__)
          throw new RangeError("the plugin's global functions have more than __MAX__ characters of names " +
                               "(MAX_FUNCTION_LIST_CHARS); define fewer functions at the top level");
      }
    }
    return apply(slice, "[" + out + "]", [0]);  // (flat: the binding cannot read a rope)
  }});
})();
""".replace("__MAX__", str(MAX_FUNCTION_LIST_CHARS))


log = logging.getLogger("plugins.runtimes.js")


class _PreludeBytecode:
    """The prelude compiled once per process to QuickJS bytecode, and run from it in each new Context.

    Why: compiling the prelude's source was most of a per_request call (~95 us of ~160 us, the
    Context itself ~60 us); reading its bytecode and running it costs a fraction of that. The
    Python binding (quickjs-ng 0.17.0.2, module.c) exposes no bytecode API, but its .so exports
    QuickJS's C API, called here with ctypes on the Context's own JSContext (found through the
    layout js_deadline checked): ``JS_Eval(..., JS_EVAL_FLAG_COMPILE_ONLY)`` and
    ``JS_WriteObject`` once, then ``JS_ReadObject`` + ``JS_EvalFunction`` per Context.

    Only the prelude, which is ours: it has no loop and needs no deadline (these C calls run
    without the binding's interrupt handler), and the bytes never come from a guest. The
    plugin's own code still goes through ``ctx.eval`` under its budget. Checked once per
    process on scratch Contexts (~1 ms); if the layout or any call is off, every Context
    compiles the prelude's source as before (logged once, with the fix).
    """

    # quickjs.h (QuickJS-NG 0.10, the binding's): JSValue is {union u; int64_t tag} on 64-bit.
    _TAG_EXCEPTION = 6
    _TAG_UNDEFINED = 3
    _TAG_FUNCTION_BYTECODE = -2
    _COMPILE_ONLY = 1 << 5  # JS_EVAL_FLAG_COMPILE_ONLY
    # JS_WRITE_OBJ_BYTECODE | JS_WRITE_OBJ_STRIP_SOURCE | JS_WRITE_OBJ_STRIP_DEBUG: 2.2 KB, not 7.8.
    _WRITE = 1 | 1 << 4 | 1 << 5
    _READ = 1  # JS_READ_OBJ_BYTECODE

    class JSValue(ctypes.Structure):
        _fields_ = [("u", ctypes.c_uint64), ("tag", ctypes.c_int64)]

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._code: bytes | None = None
        self._checked = False

    def load(self, ctx: Any) -> None:
        """Run the prelude in a new Context (limits already set). Raises quickjs.JSException as
        ``ctx.eval`` would (e.g. out of memory under a tiny memory cap)."""
        code = self._code if self._checked else self._prepare()
        if code is None:
            ctx.eval(_PRELUDE)
        else:
            self._run(ctx, code)

    def _run(self, ctx: Any, code: bytes) -> None:
        api = self._api
        jsctx = ctypes.c_void_p.from_address(id(ctx) + js_deadline._CONTEXT).value
        api.JS_UpdateStackTop(ctypes.c_void_p.from_address(id(ctx) + js_deadline._RUNTIME).value)
        fn = api.JS_ReadObject(jsctx, code, len(code), self._READ)
        if fn.tag != self._TAG_EXCEPTION:
            result = api.JS_EvalFunction(jsctx, fn)  # takes fn over
            if result.tag != self._TAG_EXCEPTION:
                if result.tag != self._TAG_UNDEFINED:  # the prelude's value: freeing undefined is a no-op
                    api.JS_FreeValue(jsctx, result)
                return
        raise quickjs.JSException(self._take_exception(jsctx))

    def _take_exception(self, jsctx: int | None) -> str:
        """The pending exception of ``jsctx`` as a string (and cleared), as the binding words it."""
        api = self._api
        exc = api.JS_GetException(jsctx)
        text = api.JS_ToCStringLen2(jsctx, None, exc, 0)
        try:
            return ctypes.string_at(text).decode("utf-8", "replace") if text else "null"
        finally:
            if text:
                api.JS_FreeCString(jsctx, text)
            api.JS_FreeValue(jsctx, exc)

    def _prepare(self) -> bytes | None:
        with self._lock:
            if not self._checked:
                try:
                    self._code = self._compile_and_check()
                except Exception as exc:  # any surprise in the C API: source it is
                    self._code = None
                    log.warning("JS plugins: the prelude's bytecode cannot be used (%s: %s); every new Context "
                                "compiles its source instead (~0.1 ms more per per_request call). Fix: install "
                                "the binding this was checked against: pip install quickjs-ng==0.17.0.2",
                                type(exc).__name__, exc)
                self._checked = True
        return self._code

    def _compile_and_check(self) -> bytes:
        if not js_deadline.available():
            raise RuntimeError("the binding's Context layout did not check out (see js_deadline)")
        import _quickjs

        JSValue = self.JSValue
        # PyDLL: these calls keep the GIL. Each is microseconds, and a CDLL call releases and
        # retakes it, a hand-off to any other thread that waits for it (3 per new Context).
        api = self._api = ctypes.PyDLL(_quickjs.__file__)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for name, restype, argtypes in (
                ("JS_Eval", JSValue, [vp, ctypes.c_char_p, sz, ctypes.c_char_p, ctypes.c_int]),
                ("JS_WriteObject", vp, [vp, ctypes.POINTER(sz), JSValue, ctypes.c_int]),
                ("JS_ReadObject", JSValue, [vp, ctypes.c_char_p, sz, ctypes.c_int]),
                ("JS_EvalFunction", JSValue, [vp, JSValue]),
                ("JS_FreeValue", None, [vp, JSValue]),
                ("JS_GetException", JSValue, [vp]),
                ("JS_ToCStringLen2", vp, [vp, ctypes.POINTER(sz), JSValue, ctypes.c_int]),
                ("JS_FreeCString", None, [vp, vp]),
                ("JS_UpdateStackTop", None, [vp]),
                ("js_free", None, [vp, vp])):
            fn = getattr(api, name)
            fn.restype, fn.argtypes = restype, argtypes
        scratch = quickjs.Context()
        jsctx = ctypes.c_void_p.from_address(id(scratch) + js_deadline._CONTEXT).value
        source = _PRELUDE.encode()
        fn = api.JS_Eval(jsctx, source, len(source), b"<execapp prelude>", self._COMPILE_ONLY)
        if fn.tag != self._TAG_FUNCTION_BYTECODE:
            if fn.tag == self._TAG_EXCEPTION:
                raise RuntimeError(f"compiling the prelude failed: {self._take_exception(jsctx)}")
            raise RuntimeError(f"JS_Eval(COMPILE_ONLY) gave tag {fn.tag}, not a function's bytecode")
        size = sz()
        buf = api.JS_WriteObject(jsctx, ctypes.byref(size), fn, self._WRITE)
        api.JS_FreeValue(jsctx, fn)
        if not buf:
            raise RuntimeError("JS_WriteObject failed")
        code = ctypes.string_at(buf, size.value)
        api.js_free(jsctx, buf)
        # Bytes 1-4 hold a checksum JS_ReadObject recomputes over the whole buffer on every read
        # (~1 us here); UINT32_MAX is QuickJS's own "do not check". These bytes never leave the
        # process, and the probe below runs them.
        code = code[:1] + b"\xff\xff\xff\xff" + code[5:]
        # Run it in a Context set up as a real one, and check the prelude is all there and works.
        probe = quickjs.Context()
        probe.set_memory_limit(16 << 20)
        probe.set_max_stack_size(STACK_BYTES)
        self._run(probe, code)
        probe.eval("function probe(e) { return String(e.x + 1); }")
        kinds = probe.eval("[typeof __execapp_run, typeof __execapp_call, typeof __execapp_resume, "
                           "typeof __execapp_step, typeof __execapp_value, typeof kv_get, typeof log].join()")
        if kinds != ",".join(["function"] * 7):
            raise RuntimeError(f"the prelude loaded from bytecode defines {kinds!r}")
        if probe.get("__execapp_run")("probe", '{"x": 41}') != "42":
            raise RuntimeError("a handler called through the prelude loaded from bytecode gave a wrong answer")
        return code


_prelude = _PreludeBytecode()
_IDLE = js_deadline.IDLE



class JsInstance:
    """One QuickJS Context with the prelude and the plugin loaded; one call at a time, on any thread.

    The plugin's top level runs here, under the plugin's budget (or ``deadline``, if earlier).
    """

    def __init__(self, compiled: "JsCompiled", list_functions: bool = False, deadline: float | None = None) -> None:
        spec = self.spec = compiled.spec
        # Held for the length of a call: two threads inside one QuickJS runtime at once would
        # corrupt it (the binding releases the GIL while JS runs). Two C calls per call.
        entry = threading.Lock()
        self._enter, self._leave = entry.acquire, entry.release
        # (no local holds the Context: js_free frees it off the GIL only when close() holds the last
        # reference, and a frame in an exception's traceback keeps its locals)
        self.ctx = quickjs.Context()
        self.ctx.set_memory_limit(spec.memory_bytes)
        self.ctx.set_max_stack_size(STACK_BYTES)
        started = time.monotonic()
        deadline = started + spec.timeout if deadline is None else min(deadline, started + spec.timeout)
        slot = self._slot = js_deadline.register(self.ctx, self) if GUARDED else None
        held = None
        if slot is None:
            self.ctx.set_time_limit(max(deadline - started, 0.0))
        else:
            # Set once: a CPU-time limit that cannot be reached before the wall-clock budget ends.
            backstop = js_deadline.cpu_backstop(spec.timeout)
            self.ctx.set_time_limit(backstop)
            slot.deadline = deadline
            # The top level's own throw reaches the binding, which turns it into text with guest
            # code: keep the interrupt handler installed meanwhile (js_deadline.hold).
            held = js_deadline.hold(self.ctx, backstop)
        try:
            _prelude.load(self.ctx)
            before = None
            if list_functions:
                self.ctx.eval(_LIST_FUNCTIONS)
                before = self.ctx.eval("JSON.stringify(Object.getOwnPropertyNames(globalThis))")
            # The top level's completion value is dropped: the binding cannot read a rope (a string
            # `+` made past 512 characters: a plugin ending with `s + s;` failed with a raw TypeError).
            self.ctx.eval(spec.code + "\n;void 0")
            if time.monotonic() >= deadline:  # the top level ended, but past its budget
                raise GuestTimeout(_timeout_message(spec, "in its top level"))
            names = self.ctx.get("__execapp_functions")(before) if before else "[]"
            if names.__class__ is not str or len(names) > MAX_FUNCTION_LIST_CHARS + 2:
                raise GuestError("the plugin broke the host protocol (its list of functions)", poison=True)
            self.functions = frozenset(json.loads(names))
        except quickjs.JSException as exc:
            if held is not None:
                js_deadline.release(held)
            self.close()
            if time.monotonic() >= deadline:  # e.g. the thrown value's text ran into the limit
                raise GuestTimeout(_timeout_message(spec, "in its top level")) from None
            raise _js_error(exc, spec, "in its top level") from None
        except BaseException:
            if held is not None:
                js_deadline.release(held)
            self.close()
            raise
        finally:
            if slot is not None:
                slot.end()
        if held is not None:
            js_deadline.release(held)
        # The entry points, each fetched once (a per_request Context usually needs only the first).
        self._call = self.ctx.get("__execapp_call")
        self._run: Any = None  # __execapp_run: an event of another shape, as one JSON string
        self._resume: Any = None  # __execapp_resume and __execapp_step: host calls and promises
        self._step: Any = None
        self._value: Any = None  # __execapp_value: a reply other than a string or null

    def call(self, handler: str, event: dict[str, Any], deadline: float) -> Any:
        payload = None
        if event.__class__ is dict and len(event) == 7:
            # The engine's event (Event.to_dict() + args): its strings cross as arguments, which
            # the binding converts in C, and only its data as JSON (JSON-encoding the whole event
            # in Python and parsing it in JS was half the cost of a reused call).
            try:
                eid, etype, text, data, session, tenant, args = (event["id"], event["type"], event["text"],
                                                                 event["data"], event["session"], event["tenant"],
                                                                 event["args"])
            except KeyError:
                payload = to_json(event)
            else:
                if (eid.__class__ is str and etype.__class__ is str and text.__class__ is str
                        and args.__class__ is str and tenant.__class__ is str
                        and (session is None or session.__class__ is str)):
                    data = "{}" if data.__class__ is dict and not data else to_json(data)
                    if len(data) > SCAN_CHARS and (crowded := crowded_keys(event["data"], data)) is not None:
                        raise GuestError(crowded)
                else:
                    payload = to_json(event)
        else:
            payload = to_json(event)
        if payload is not None and len(payload) > SCAN_CHARS and (crowded := crowded_keys(event, payload)) is not None:
            raise GuestError(crowded)  # (the client's keys, before any of them is an atom: js_atoms)
        if not self._enter(False):
            # A strategy bug, refused before it can crash the process. Not poison: discarding
            # the Context would free it under the call that holds it.
            raise GuestError("a QuickJS context was entered by a second call while one was running in it")
        started = time.monotonic()
        if started >= deadline:
            self._leave()
            raise GuestTimeout()
        slot = self._slot
        if slot is None:  # unguarded: the binding's CPU-time limit, per step
            self.ctx.set_time_limit(deadline - started)
        else:
            slot.deadline = deadline  # the watchdog interrupts the guest past it
        try:
            if payload is None:
                out = self._call(handler, eid, etype, text, data, session, tenant, args)
            else:
                out = (self._run or self._entry("_run", "__execapp_run"))(handler, payload)
            if out.__class__ is str:  # a string reply, no host call: the hot path
                return out
            if out is None:
                return None
            if out == 1:  # another plain value: its JSON (else its toJSON threw: the state says so)
                out = (self._value or self._entry("_value", "__execapp_value"))()
                if out.__class__ is str:
                    if len(out) > MAX_REPLY_BYTES:  # refused before it is parsed (plugins.loaded would after)
                        raise GuestError(f"the reply's JSON is {len(out)} characters, over the limit of "
                                         f"{MAX_REPLY_BYTES} bytes (MAX_REPLY_BYTES); reply with less")
                    value = scan_json(out, 0)[0]
                    return value if value.__class__ is str else to_reply(value)
            return self._steps((self._step or self._entry("_step", "__execapp_step"))(), deadline)
        except quickjs.JSException as exc:
            raise _js_error(exc, self.spec) from None
        except quickjs.StackOverflow as exc:
            raise GuestError(f"stack overflow: {exc}", poison=True) from None
        except RecursionError:  # a reply ~1,000 levels deep: QuickJS writes it, Python's parser recurses per level
            raise GuestError("the reply's JSON (or a host call's arguments) nests too deep to parse; "
                             "flatten it") from None
        except (StopIteration, ValueError, TypeError, KeyError, IndexError) as exc:  # a broken protocol reply
            raise GuestError(f"the plugin broke the host protocol ({type(exc).__name__})", poison=True) from None
        finally:
            if slot is not None:  # slot.end(), inlined: the wait runs only if a watchdog pass is writing
                slot.deadline = _IDLE
                if slot.flipping:
                    slot.end()
            self._leave()
            # The watchdog interrupted this call: whatever it returned or raised (a built-in may
            # have caught the interrupt and the guest run on), it ran into its deadline.
            if slot is not None and slot.fired:
                raise GuestTimeout(_timeout_message(self.spec)) from None  # noqa: B012

    def _steps(self, out: str, deadline: float) -> Any:
        """The general case: host calls, promises and errors, one JSON state per step."""
        now = time.monotonic
        host: Host | None = None  # one per guest call, made at its first host call
        backlog: list = []  # host calls queued but not yet run (past one resume's MAX_BATCH_CHARS)
        try:
            for _ in range(MAX_STEPS):
                state = json.loads(out)
                status = state["s"]
                queued = backlog + state["q"] if backlog else state["q"]
                results: list = []
                if queued:
                    host = host or Host(self.spec, deadline)
                    # Once the outcome is known the calls run for their effects, their results dropped.
                    results, backlog = self._host_requests(queued, host, deadline, status == "wait")
                if status == "ok":
                    return to_reply(state.get("v"))
                if status == "err":
                    message = state["e"]
                    if message.__class__ is not str:  # the prelude writes text only: a broken prelude
                        raise TypeError("the error is not text")
                    raise _guest_error(message, self.spec)
                # Waiting on host calls or on promise jobs: run them, then look again.
                remaining = deadline - now()
                if remaining <= 0:
                    raise GuestTimeout(_timeout_message(self.spec, "while waiting on promises"))
                if self._slot is None:
                    self.ctx.set_time_limit(remaining)
                if results:
                    (self._resume or self._entry("_resume", "__execapp_resume"))(json.dumps(results))
                ran = False
                # One job at a time, the deadline checked after each: an async loop (``while (true)
                # await null``) queues a new job from every job and never leaves this loop otherwise.
                while self.ctx.execute_pending_job():
                    ran = True
                    if now() >= deadline:
                        raise GuestTimeout(_timeout_message(self.spec, "running promise jobs"))
                out = (self._step or self._entry("_step", "__execapp_step"))()
                if not results and not ran and not backlog and not state.get("more"):
                    raise GuestError("the handler's promise never settled")
            raise GuestError(f"the handler did not finish within {MAX_STEPS} host round trips")
        finally:
            if host is not None:
                host.close()  # the call's end: the host logs its summary (dropped lines, denied calls)

    def _host_requests(self, queue: list, host: Host, deadline: float, keep: bool) -> tuple[list, list]:
        """Run the guest's queued host calls in order, the deadline checked before each one:
        ``(results, calls not run)``. With ``keep`` the results are kept for the guest, and the calls
        stop once they hold MAX_BATCH_CHARS characters (the rest wait for the next resume)."""
        now = time.monotonic
        results: list = []
        held = 0
        for done, (req_id, op, args) in enumerate(queue):
            if held > MAX_BATCH_CHARS:
                return results, queue[done:]
            if now() >= deadline:
                raise GuestTimeout(_timeout_message(self.spec, f"in host calls ({len(queue) - done} of "
                                                               f"{len(queue)} queued calls not run)"))
            if op not in _HOST_OPS:
                raise GuestError(f"the plugin broke the host protocol (unknown host call {op!r})", poison=True)
            try:
                value = getattr(host, op)(*args)
                if req_id and keep:
                    results.append([req_id, True, value])
                    if value.__class__ is str:  # (as JSON: up to 12 characters a code point when not ASCII)
                        held += len(value) if value.isascii() else 12 * len(value)
            except GuestQuota:  # a quota ends the call, like a timeout: the guest cannot catch it
                raise
            except GuestTimeout as exc:
                raise GuestTimeout(str(exc)) from None
            except Exception as exc:  # a denied or failing call rejects the guest's promise
                if not req_id:
                    raise GuestError(str(exc)) from None
                if keep:
                    results.append([req_id, False, message := str(exc)])
                    held += len(message)
        return results, []

    def _entry(self, attr: str, name: str) -> Any:
        """Fetch the prelude's entry point ``name`` into ``self.<attr>`` (once per Context)."""
        fn = self.ctx.get(name)
        setattr(self, attr, fn)
        return fn

    def close(self) -> None:
        """Release the Context (its watchdog slot first: nothing may write into a freed Context)."""
        slot, self._slot = self._slot, None
        if slot is not None:
            js_deadline.unregister(slot)
        self._call = self._run = self._resume = self._step = self._value = None
        ctx, self.ctx = self.ctx, None
        # Freed off the GIL when nothing else holds it (js_free: the guest's heap can take seconds).
        if ctx is not None:
            js_free.release(ctx, 1)


_PROPERTY_ESCAPE = re.compile(r"\\[pP]\{(RGI_Emoji|Basic_Emoji)?")


def property_work(source: str) -> int:
    """The weight of the regexp property escapes in ``source`` as the guards count it (js_guards.js)."""
    return sum(HEAVY_PROPERTY if m.group(1) else 1 for m in _PROPERTY_ESCAPE.finditer(source))


def _timeout_message(spec: Any, where: str = "") -> str:
    return f"ran past its {spec.timeout * 1000:g} ms timeout" + (f" {where}" if where else "")


def _guest_error(message: str, spec: Any) -> GuestError:
    """A thrown value or rejected promise; QuickJS's own interrupt/OOM errors are classified."""
    if message.startswith("InternalError: interrupted"):
        return GuestTimeout(_timeout_message(spec))
    if message.startswith("InternalError: out of memory") or message in ("null", "[uninitialized]"):
        return GuestMemory(f"memory cap of {spec.memory_bytes} bytes exceeded")
    return GuestError(message)


def _js_error(exc: Exception, spec: Any, where: str = "") -> GuestError:
    """A JSException out of the binding, classified (timeout, memory) or kept as the guest's error."""
    message = str(exc).strip()
    first = message.splitlines()[0] if message else "error"
    if first.startswith("(Failed obtaining QuickJS error string"):  # the binding's words for it
        return GuestError(f"the plugin threw a value that cannot be turned into text {where}".rstrip() +
                          " (converting it failed: a stack overflow, out of memory or its own error); throw an "
                          "Error with a short message", poison=True)
    if "interrupted" in first:
        return GuestTimeout(_timeout_message(spec, where))
    if "out of memory" in first or first in ("null", "[uninitialized]"):
        return GuestMemory(f"memory cap of {spec.memory_bytes} bytes exceeded")
    return GuestError(" ".join(line.strip() for line in message.splitlines()[:2]), poison=True)


class JsCompiled(FreshInstanceIsolation):
    """A JS plugin version: source checked by loading it once into a sandboxed Context."""

    # A Context may change threads between calls (module docstring): pooled JS shares a free
    # list and sharded JS runs on the caller's thread, as Lua and WASM do.
    thread_bound = False

    def __init__(self, spec: Any) -> None:
        if not isinstance(spec.code, str):
            raise CompileError("JS plugins are source text")
        backrefs = spec.code.count("\\k<")
        if backrefs * len(spec.code) > MAX_BACKREF_WORK:
            raise CompileError(f"the source has {backrefs} named back-references (\\k<...>) in {len(spec.code)} "
                               f"characters: QuickJS compiles each regexp literal while it parses, and each "
                               f"back-reference in one scan of its whole pattern, which cannot be interrupted; the "
                               f"sandbox allows at most {MAX_BACKREF_WORK} as their count x the source's length "
                               f"(MAX_BACKREF_WORK): use fewer, or build such a regexp with new RegExp in a handler")
        work = property_work(spec.code)
        if work > MAX_PROPERTY_WORK:
            raise CompileError(f"the source's regexp property escapes (\\p{{...}}, \\P{{...}}) weigh {work}: "
                               f"QuickJS compiles each regexp literal while it parses, in every new Context, and "
                               f"each escape builds a Unicode set that cannot be interrupted; the sandbox allows at "
                               f"most {MAX_PROPERTY_WORK} (MAX_PROPERTY_WORK: each counts 1, a property of strings "
                               f"such as RGI_Emoji {HEAVY_PROPERTY}): use fewer")
        self.spec = spec
        try:
            probe = JsInstance(self, list_functions=True, deadline=time.monotonic() + load_seconds(spec))
        except GuestTimeout as exc:
            note = load_budget_note(spec)
            why = f"ran past {load_seconds(spec) * 1000:g} ms in its top level{note}" if note else str(exc)
            raise CompileError(f"the plugin {why}; move long work out of the top level into a handler",
                               code="timeout") from None
        except GuestMemory as exc:
            raise CompileError(f"the plugin's top level: {exc}", code="memory_limit") from None
        except GuestError as exc:
            raise CompileError(str(exc)) from None
        self.handlers = probe.functions
        probe.close()

    def new_instance(self, deadline: float | None = None) -> JsInstance:
        return JsInstance(self, deadline=deadline)

    def call_isolated(self, handler: str, event: dict[str, Any], deadline: float) -> Any:
        """One call on a brand-new Context whose top level also runs within the call's ``deadline``."""
        inst = self.new_instance(deadline)
        try:
            return inst.call(handler, event, deadline)
        finally:
            inst.close()
