-- The sandbox of every Lua plugin runtime (plugins/runtimes/lua.py runs this chunk once per
-- runtime, trusted, with the full standard library, before any guest code): the hook and the
-- deadline, the guarded standard library, fresh environments and the call entry points.
local clock, py_host, COUNT, TIMEOUT, GUARDS_BC, PATTERNS_BC, LIMITS, REGISTER = ...
local B = {deadline = math.huge, expired = false, loading = false, cos = {}, ncos = 0}
-- Kept alive here: the names the VM reads weak modes and __call under (lua_interrupt.retire_events).
B.mode_name, B.call_name = LIMITS.MODE_NAME, LIMITS.CALL_NAME
local error, pcall, xpcall, type, tostring, next, select = error, pcall, xpcall, type, tostring, next, select
local setmetatable, getmetatable, rawget = setmetatable, getmetatable, rawget
local sethook, co_create, co_resume = debug.sethook, coroutine.create, coroutine.resume
local co_close, co_status = coroutine.close, coroutine.status
local load, math_huge = load, math.huge

-- Once the budget is spent, the thread that sees it gets the hook at every instruction (count 1,
-- B.rearm: back to COUNT when the next call starts): the error unwinds through the guest's
-- __close handlers, and each would otherwise run up to COUNT instructions first (20,000 nested
-- frames with a looping __close ran 1.6 s past the deadline); now each stops at its first.
-- The sandbox's own entry points (OWN, below: they run before and after the guest's pcall, never
-- guest code once the call is spent, and call only natives and each other) are not interrupted:
-- the guest is, at its first instruction.
local OWN, getinfo = {}, debug.getinfo
local function hook()
  if B.expired or clock() > B.deadline then
    B.expired, B.rearm = true, true
    sethook(hook, "", 1)
    if OWN[getinfo(2, "f").func] then return end
    error(TIMEOUT, 0)
  end
end
sethook(hook, "", COUNT)
local function spent(why, level) -- the budget is spent (or a quota): end the call from this thread
  B.expired, B.rearm = true, true
  sethook(hook, "", 1)
  error(why, level)
end
-- The debug library keeps each coroutine's hook in a weak-keyed table (ldblib.c, registry
-- "_HOOKKEY", its own metatable, mode "k"). With weak mode read under MODE_NAME in this runtime
-- (lua_interrupt.disable_weak_tables), that table says "k" under MODE_NAME too: otherwise every
-- coroutine a guest ever made would stay alive through its hook.
do
  local hooks = debug.getregistry()._HOOKKEY
  local mt = hooks and getmetatable(hooks)
  if mt then mt[LIMITS.MODE_NAME] = mt.__mode end
  -- The VM calls a non-function by its metatable's __call read under CALL_NAME in this runtime:
  -- Python objects (clock, py_host, the watchdog's register) keep theirs there. No guest reaches
  -- this metatable (guests never hold a Python object).
  local py = debug.getregistry().POBJECT
  if type(py) == "table" then py[LIMITS.CALL_NAME] = rawget(py, "__call") end
end

-- Once the budget is spent every protected call re-raises: pcall cannot swallow the timeout.
local function check(...)
  if B.expired then spent(TIMEOUT, 0) end
  return ...
end
local function safe_pcall(f, ...) return check(pcall(f, ...)) end
local function safe_xpcall(f, h, ...)
  return check(xpcall(f, function(e) if B.expired then return e end return h(e) end, ...))
end
-- Hooks are per coroutine: every coroutine a guest makes gets the same hook.
local function co_new(f)
  local co = co_create(f)
  sethook(co, hook, "", COUNT)
  return co
end
-- A coroutine the guest resumes is registered with the deadline watchdog for this call (it can
-- interrupt it between two hooks, lua_interrupt.py) and kept referenced until the next call
-- starts: the VM has stopped writing to it by then (release). Past MAX_TRACKED in one call, all
-- are dropped (the VM first: REGISTER(nil)) and those being resumed now registered again, so a
-- loop over short-lived coroutines does not keep them all alive.
local MAX_TRACKED = 64
local active, nactive = {}, 0 -- the coroutines being resumed now, innermost last
local function register(co)
  B.cos[co] = true
  B.ncos = B.ncos + 1
  REGISTER(tostring(co))
end
local function track(co)
  if REGISTER and not B.cos[co] and type(co) == "thread" then
    if B.ncos >= MAX_TRACKED then
      REGISTER(nil)
      B.cos, B.ncos = {}, 0
      for i = 1, nactive do if not B.cos[active[i]] then register(active[i]) end end
    end
    register(co)
  end
  nactive = nactive + 1
  active[nactive] = co
end
local function untrack(...)
  active[nactive] = nil
  nactive = nactive - 1
  return ...
end
local function release()
  if B.ncos > 0 then B.cos, B.ncos = {}, 0 end
  if nactive > 0 then active, nactive = {}, 0 end
end
local function safe_resume(co, ...) track(co); return check(untrack(co_resume(co, ...))) end
-- Closing a suspended coroutine runs its pending __close handlers in it (guest code in another
-- lua_State): tracked like a resume, or the watchdog cannot reach a loop of expensive
-- instructions there (12-17 s past a 0.3 s budget, on a coroutine resumed in an earlier call or
-- dropped from the tracked set), and a timeout it raises is re-raised, not returned.
-- (A dead one too: a coroutine that failed keeps its to-be-closed variables open until closed.
-- Closing a running or normal one fails at once, untracked.)
local function safe_close(co)
  if type(co) ~= "thread" then return co_close(co) end
  local st = co_status(co)
  if st ~= "suspended" and st ~= "dead" then return co_close(co) end
  track(co)
  return check(untrack(co_close(co)))
end
local function wrap_results(ok, ...)
  if B.expired then spent(TIMEOUT, 0) end
  if not ok then error((...), 0) end
  return ...
end
local function safe_wrap(f)
  local co = co_new(f)
  return function(...) track(co); return wrap_results(untrack(co_resume(co, ...))) end
end

local function readonly(t, name)
  return setmetatable({}, {
    __index = t,
    __newindex = function() error("attempt to modify read-only library table '" .. name .. "'", 2) end,
    __pairs = function()
      local k
      return function() local v; k, v = next(t, k); return k, v end
    end,
    __metatable = false,
  })
end
local function copy(t, skip)
  local c = {}
  for k, v in next, t do if not (skip and skip[k]) then c[k] = v end end
  return c
end

-- The library tables the guest sees: copies of the natives, with the guards in place of every
-- function whose cost depends on its arguments (lua_guards.lua).
local str_lib, table_lib, utf8_lib, guest_tonumber = copy(string, {dump = true}), copy(table), copy(utf8), tonumber
-- Bytes of built strings the collector does not count (lua_guards.lua, built()); true: and reset.
local uncounted = function() return 0 end
local MEM_MARK, plain_find = LIMITS and LIMITS.MEM_MARK, string.find
if GUARDS_BC then
  local NAT = {
    string = copy(string), table = copy(table), utf8 = copy(utf8), type = type, tostring = tostring,
    tonumber = tonumber, select = select, error = error, rawlen = rawlen, rawget = rawget,
    getmetatable = debug.getmetatable, getinfo = debug.getinfo, tointeger = math.tointeger, ult = math.ult,
    floor = math.floor, huge = math.huge, maxinteger = math.maxinteger, log = math.log,
    byte = string.byte, sub = string.sub, char = string.char, find = string.find, match = string.match,
    concat = table.concat, unpack = table.unpack, collect = collectgarbage, pcall = pcall,
  }
  -- The pattern matcher in Lua is compiled in this runtime only when a guard first needs it.
  local function load_port(...) return load(PATTERNS_BC, "=execapp", "b")(...) end
  local G = load(GUARDS_BC, "=execapp", "b")(NAT, hook, LIMITS, load_port)
  for k, v in next, G.string do str_lib[k] = v end
  for k, v in next, G.table do table_lib[k] = v end
  for k, v in next, G.utf8 do utf8_lib[k] = v end
  guest_tonumber = G.tonumber
  uncounted = G.uncounted
end
local str = readonly(str_lib, "string")
local smt = getmetatable("")
smt.__index = str
smt.__metatable = false
local co = copy(coroutine)
-- The random generator's state is the runtime's: a call that seeds it is marked, and the next
-- isolated call reseeds it (randomly, as Lua starts), so no call sees what another one wrote.
-- (Lua's own reseed is time(NULL) and the state's address: the same all second long.)
local math_lib, native_seed, math_tointeger = copy(math), math.randomseed, math.tointeger
math_lib.randomseed = function(...) B.seeded = true; return native_seed(...) end
co.create, co.resume, co.wrap, co.close = co_new, safe_resume, safe_wrap, safe_close

local function safe_setmetatable(t, mt)
  if type(mt) == "table" then
    if rawget(mt, "__gc") ~= nil then error("__gc metamethods are not allowed in plugins", 2) end
    -- Weak tables are off in the sandbox (lua_interrupt.disable_weak_tables: ephemerons make the
    -- collector quadratic); say so rather than let a weak cache silently keep everything.
    if rawget(mt, "__mode") ~= nil then
      error("weak tables (__mode) are not available in plugins; drop entries explicitly (t[k] = nil)", 2)
    end
    -- Off in the sandbox too (lua_interrupt.retire_events): Lua follows a chain of callable tables
    -- (mt.__call = t) in one call instruction, quadratic in its length, minutes no hook can stop.
    if rawget(mt, "__call") ~= nil then
      error("__call metamethods are not available in plugins; call a function (e.g. a field of the table) instead", 2)
    end
  end
  return setmetatable(t, mt)
end

-- The gate's message of a quota that ended the call: "execapp: quota_<resource>: <message>".
local QUOTA = "execapp: quota_"
local utf8_ok, ascii_only, arg_sub = utf8.len, string.gsub, string.sub
-- What a string argument of a host call may be, in bytes: the checks below are native and linear
-- in it (the gsub ~30 ns a byte: seconds on a string the size of a large memory cap, in one C call
-- no hook reaches), and it then crosses into Python whole, a copy outside the memory cap. No host
-- call takes more: a log line is cut to what Host.log keeps (MAX_LOG_CHARS, 4 bytes at most
-- each), any other argument is refused past HOST_ARG_MAX (a KV value's 65,536 characters).
local HOST_ARG_MAX, LOG_MAX = LIMITS.HOST_ARG_MAX, LIMITS.LOG_MAX
local function host_call(name, ...)
  if B.loading then
    error(name .. ": the host API is not available while the plugin's top level runs; call it from a handler", 3)
  end
  -- The host's arguments cross as text: bytes that are not UTF-8 failed inside lupa's conversion
  -- with a bare codec message. (Strict utf8.len: surrogates and overlongs are refused too.) A
  -- log line is diagnostics: its non-ASCII bytes become "?" instead.
  for i = 1, select("#", ...) do
    local a = select(i, ...)
    local ta = type(a)
    if ta ~= "string" and ta ~= "number" and ta ~= "boolean" and ta ~= "nil" then
      -- Only plain values cross: Python reading a table, function or coroutine (str() of a URL)
      -- ran the guest's __tostring inside lupa with the GIL held, freezing every thread of the
      -- worker, the event loop included, for the rest of the call's budget.
      error(name .. ": argument " .. i .. " is a " .. ta .. "; host calls take strings and numbers (convert it "
            .. "with tostring() first)", 3)
    end
    if ta == "string" then
      if name == "log" and #a > LOG_MAX then
        a = arg_sub(a, 1, LOG_MAX)
        local n, bad = utf8_ok(a)
        if not n and bad > LOG_MAX - 3 then a = arg_sub(a, 1, bad - 1) end -- cut inside a character
        return host_call(name, a)
      end
      if #a > HOST_ARG_MAX then
        error(name .. ": argument " .. i .. " is " .. #a .. " bytes, more than a host call takes (" .. HOST_ARG_MAX
              .. " bytes; a KV value is at most 65536 characters)", 3)
      end
      if not utf8_ok(a) then
        if name == "log" then return host_call(name, (ascii_only(a, "[\128-\255]", "?"))) end
        error(name .. ": argument " .. i .. " is not valid UTF-8 text; send text, or encode binary data (hex, base64)", 3)
      end
    end
  end
  B.hosted = true
  local ok, v, stop = py_host(name, ...)
  if ok then return v end
  -- A timeout or a quota ends the call: marked like the count hook's timeout, so no pcall,
  -- xpcall or coroutine of the guest can swallow it.
  if stop then B.why = v; spent(v, 4) end -- (one level more: spent's own)
  error(v, 3)
end

local base = {
  assert = assert, error = error, ipairs = ipairs, next = next, pairs = pairs, select = select,
  pcall = safe_pcall, xpcall = safe_xpcall, rawequal = rawequal, rawget = rawget, rawlen = rawlen,
  setmetatable = safe_setmetatable, getmetatable = getmetatable, tonumber = guest_tonumber,
  tostring = tostring, type = type, _VERSION = _VERSION,
  string = str, table = readonly(table_lib, "table"), math = readonly(math_lib, "math"),
  utf8 = readonly(utf8_lib, "utf8"), coroutine = readonly(co, "coroutine"),
  -- Not tail calls: error level 3 in host_call must point at the guest's line.
  log = function(msg) host_call("log", tostring(msg)) end,
  print = function(...)
    local n, parts = select("#", ...), {...} -- (not select(i, ...) per argument: O(n^2))
    for i = 1, n do parts[i] = tostring(parts[i]) end
    host_call("log", table.concat(parts, "\t", 1, n))
  end,
  kv_get = function(k) local v = host_call("kv_get", k); return v end,
  kv_set = function(k, v) host_call("kv_set", k, v) end,
  kv_incr = function(k, d) local v = host_call("kv_incr", k, d); return v end,
  sleep = function(ms) host_call("sleep", ms) end,
  http_get = function(url) local v = host_call("http_get", url); return v end,
}
local env_mt = {__index = base, __metatable = false}

-- An error message as Python gets it: at most MAX_ERROR bytes of valid UTF-8 (lupa raises
-- UnicodeDecodeError on anything else; a megabyte message would reach the client and the traces).
local MAX_ERROR, str_sub, str_gsub, utf8_len = 4096, string.sub, string.gsub, utf8.len
local MAX_REPLY = LIMITS.MAX_REPLY_BYTES
local MAX_VALUES, MAX_DEPTH, TABLES_PER_CLOCK = LIMITS.MAX_REPLY_VALUES, LIMITS.MAX_DEPTH, 16
local ENTRIES_PER_CLOCK = LIMITS.ENTRIES_PER_CHECK
local TOO_DEEP = "reply nested deeper than " .. tostring(MAX_DEPTH) .. " levels"
local TOO_MANY = "the reply holds more than " .. tostring(MAX_VALUES) .. " values (tables and their entries, a " ..
                 "table counted once per reference); return fewer"
local function error_text(v)
  local n = #v
  if n > MAX_ERROR then v = str_sub(v, 1, MAX_ERROR) end
  if not utf8_len(v) then
    v = str_gsub(v, "[\128-\255]", "?") -- bytes of text cut mid-character, or not text at all
  end
  if n > MAX_ERROR then v = v .. " ... (" .. n .. " bytes)" end
  return v
end

-- status: 0 ok, 1 error, 2 timeout, 3 memory, 4 quota (v: "execapp: <code>: <message>")
local function outcome(ok, v)
  -- The call ends: if it used the host API, the gate closes the call's Host (summary lines).
  if B.hosted then B.hosted = false; py_host(nil) end
  if not ok and not B.expired and type(v) ~= "string" then
    -- An error object's __tostring is guest code: run it under the call's deadline (still set),
    -- and never let its own error escape past the guest's pcall.
    local done, text = pcall(tostring, v)
    if not done then
      if text == "not enough memory" then return 3, text end
      text = "the error object's __tostring failed: " .. (type(text) == "string" and text or type(text))
    end
    v = text
  end
  if B.expired then
    local why = B.why or TIMEOUT
    if plain_find(why, QUOTA, 1, true) == 1 then return 4, why end
    return 2, why
  end
  if ok then
    -- A text reply crosses into Python whole (lupa copies and decodes it) before plugins.loaded
    -- measures it: one over MAX_REPLY_BYTES is refused here, before a copy of up to the memory cap.
    if type(v) == "string" and #v > MAX_REPLY then
      return 1, "the reply is " .. #v .. " bytes of text, over the limit of " .. MAX_REPLY .. " bytes "
             .. "(MAX_REPLY_BYTES); reply with less, e.g. a summary or a key kept with kv_set"
    end
    if type(v) == "table" then
      -- Counted here first (raw next: no guest code), as plugins/runtimes/lua.py's converter counts
      -- (each table once per reference, and each entry): Python reads a reply at ~1.5 us a value
      -- through lupa, so a reply of shared tables (2^30 references in 30 levels) took 0.2 s of the
      -- worker's time, and its call's whole budget under load, before it was refused. A table
      -- deeper than MAX_DEPTH is refused here too (the converter would, on reaching it: stopping
      -- the count there let a shared-table sibling reach the converter); the deadline passing
      -- leaves the rest to the converter, which checks it too. The clock is read every
      -- TABLES_PER_CLOCK tables (a read is ~0.5 us: the 131,072 references of a reply of shared
      -- tables would add 70 ms), and every ENTRIES_PER_CLOCK entries: a traversal's cost is not
      -- its entries. Its first step scans the array part for the first value (a table of one
      -- million nil slots, referenced 60,000 times, was counted and converted for 4.5 s past a
      -- 0.5 s budget, with the clock read every 4,096 tables), and each step walks the chain of
      -- the key it left, which integer keys (hashed without a seed) can make as long as the table
      -- (a kept table of 32,766 colliding keys: 2.7 s past a 5 s budget).
      local left, stack, depths, n, tables = MAX_VALUES, {v}, {0}, 1, 0
      local late = false
      while n > 0 do
        local t, d = stack[n], depths[n]
        stack[n], depths[n], n = nil, nil, n - 1
        if d > MAX_DEPTH then return 1, TOO_DEEP end
        tables = tables + 1
        if tables % TABLES_PER_CLOCK == 0 and clock() > B.deadline then break end
        left = left - 1
        for _, x in next, t do
          left = left - 1
          if left < 0 then return 1, TOO_MANY end
          if type(x) == "table" then n = n + 1; stack[n], depths[n] = x, d + 1 end
          if left % ENTRIES_PER_CLOCK == 0 and clock() > B.deadline then late = true; break end
        end
        if late then break end
      end
    end
    return 0, v
  end
  if v == "not enough memory" then return 3, v end
  -- a guard refused a result larger than the memory cap (its message names the call)
  if MEM_MARK and plain_find(v, MEM_MARK, 1, true) then return 3, v end
  return 1, error_text(v)
end

-- The plugin's top level (chunk, whose _ENV is env) under deadline: env, 0, nil or nil, status, message.
local function top_level(chunk, env, deadline)
  if B.ncos > 0 or nactive > 0 then release() end
  if B.rearm then B.rearm = false; sethook(hook, "", COUNT) end
  B.deadline, B.expired, B.why, B.loading = deadline, false, nil, true
  local status, v = outcome(pcall(chunk))
  B.loading, B.deadline = false, math_huge
  if status ~= 0 then return nil, status, v end
  return env, 0, nil
end

local function new_env(bytecode, name, deadline)
  local env = setmetatable({}, env_mt)
  env._G = env
  local chunk, err = load(bytecode, name, "b", env)
  if not chunk then return nil, 1, err end
  return top_level(chunk, env, deadline)
end

local function call(env, handler, event, deadline, same_call)
  local f = rawget(env, handler)
  if type(f) ~= "function" then return 1, "no handler function '" .. tostring(handler) .. "'" end
  if not same_call and (B.ncos > 0 or nactive > 0) then release() end
  if B.rearm then B.rearm = false; sethook(hook, "", COUNT) end
  B.deadline, B.expired, B.why = deadline, false, nil
  local status, v = outcome(pcall(f, event))
  B.deadline = math_huge
  return status, v
end

-- lauxlib's buffers (string.rep, table.concat, string.format, gsub...) allocate through lupa's
-- capped allocator directly, without the emergency collection Lua runs before it fails one of its
-- own allocations: the previous call's garbage would fail this call's large string with
-- memory_limit. Between two isolated calls only the sandbox is alive, so this collection is cheap.
-- An isolated call also leaves at most KEEP of garbage behind: its runtime stays with its thread
-- (one per pool thread and plugin), so a call that built 700 MB under a 1 GiB cap kept them in
-- every thread that had run it, 2.6 GB for 4 threads of a plugin limited to one call at a time.
-- The collection marks only the sandbox (the call's environment is garbage by then, its reply
-- still referenced) and frees what the call allocated: work the call's own budget paid to build.
-- What is allocated counts the large strings built since the last collection (Lua 5.5 does not).
-- Both counted from what the runtime holds between calls (B.base: the sandbox, and the plugin's
-- loaded chunk, as large as its code).
local GC_AT, KEEP = LIMITS.memory / 2048, LIMITS.ISOLATED_KEEP / 1024 -- in KB
B.base = 0
local function gc(count)
  if count then return collectgarbage("count") + uncounted() / 1024 - B.base end
  uncounted(true)
  collectgarbage()
end
-- The isolated (per_request) call of one plugin version: its chunk is loaded once per runtime, at
-- the first call, and each call runs it again in a fresh environment, a new _ENV upvalue of its
-- own (upvaluejoin: a function an earlier call made keeps the earlier one). Loading it per call
-- (lundump: every prototype and constant made again, before the call's deadline was even set)
-- took ~0.25 s of CPU a call for a 4 MB plugin of 350,000 string constants whose top level only
-- defines functions, on a 50 ms budget, and answered ok. Between calls _ENV is an empty table.
local upvaluejoin, NO_ENV = debug.upvaluejoin, setmetatable({}, {__newindex = function() end, __metatable = false})
local function no_env() return NO_ENV end
local function fresh_for(bytecode, name)
  local chunk
  return function(handler, event, deadline)
    if chunk == nil then
      local err
      chunk, err = load(bytecode, name, "b", NO_ENV)
      if not chunk then return 1, err, false end
      bytecode = nil
      collectgarbage()
      B.base = collectgarbage("count")
    end
    if gc("count") > GC_AT then gc() end
    if B.seeded then B.seeded = false; native_seed(math_tointeger(clock() * 1e9 // 1)) end
    local env = setmetatable({}, env_mt)
    env._G = env
    upvaluejoin(chunk, 1, function() return env end, 1)
    local status, v
    env, status, v = top_level(chunk, env, deadline)
    upvaluejoin(chunk, 1, no_env, 1)
    if env then
      status, v = call(env, handler, event, deadline, true)
      env = nil
    end
    -- (the coroutines the call resumed are still referenced, for the watchdog: settle, next)
    if B.ncos == 0 and gc("count") > KEEP then gc() end
    return status, v, B.ncos > 0
  end
end
-- After an isolated call that resumed coroutines, once the VM has stopped writing to them
-- (lua.py): let them go, and what they hold (a suspended one keeps its locals), then collect.
local function settle()
  release()
  if gc("count") > KEEP then gc() end
end

for _, f in next, {new_env, top_level, call, outcome, error_text, release, settle, gc, uncounted} do OWN[f] = true end

-- The handler names of an environment, or nil once the clock passes deadline: read every
-- ENTRIES_PER_CLOCK keys, since a top level can fill its environment with integer keys chosen to
-- collide, and each step of next then walks a chain as long as the table (32,000 such keys: a
-- 1.5 s walk after a top level within its 2 s load budget, at every save and worker start).
local function functions(env, deadline)
  local names, n = {}, 0
  for k, v in next, env do
    n = n + 1
    if n % ENTRIES_PER_CLOCK == 0 and clock() > deadline then return nil end
    if type(k) == "string" and type(v) == "function" then names[#names + 1] = k end
  end
  return names
end

-- (fresh_for's calls are made OWN as they are made)
local function fresh(bytecode, name)
  local f = fresh_for(bytecode, name)
  OWN[f] = true
  return f
end

return new_env, call, fresh, functions, tostring((coroutine.running())), settle
