-- Guarded versions of the standard-library C functions whose cost depends on their arguments,
-- built once per sandboxed runtime (plugins/runtimes/lua.py). No hook fires inside a C call,
-- so every such function here:
--   * bounds the work of each native call before it starts, by a cheap worst-case estimate: a
--     native call does at most NATIVE_MAX units (a few milliseconds);
--   * runs larger work in pieces that the count hook and the deadline watchdog
--     (lua_interrupt.py) can stop between two native calls: table ranges in chunks, pattern
--     matching natively per start position or in Lua (lua_patterns.lua, loaded on first use),
--     sorting in runs and merges; or refuses it with a clear error when its result cannot fit
--     the memory cap at all;
--   * charges work above FREE units to a meter that checks the clock every LIMIT units (tick():
--     the hook's own check), a second line behind the watchdog for loops around such calls.
-- A unit is about one nanosecond of native work on an idle core; the estimates are upper bounds
-- (measured native time per unit: 0.02-0.5 ns on worst-case inputs).
--
-- This chunk is compiled once per process and stripped of debug information, so a native
-- error raised through a guard carries no position of ours.
local NAT, tick, cfg, load_port = ...

local type, tostring, select, error, rawlen, rawget = NAT.type, NAT.tostring, NAT.select, NAT.error, NAT.rawlen, NAT.rawget
local getmetatable, getinfo, tointeger, ult, floor, huge = NAT.getmetatable, NAT.getinfo, NAT.tointeger, NAT.ult, NAT.floor, NAT.huge
local maxinteger, log = NAT.maxinteger, NAT.log
local S, T, U = NAT.string, NAT.table, NAT.utf8
-- Natives are called as fields (S.rep(...), not a local): stripped bytecode keeps field names,
-- so a native argument error still reads "bad argument #2 to 'rep'".

local LIMIT, NATIVE_MAX, BIG, CHUNK, FREE = cfg.LIMIT, cfg.NATIVE_MAX, cfg.BIG, cfg.CHUNK, cfg.FREE
-- A call whose bound is linear in the subject (degree <= 1) is like s:upper(): its cost is
-- bounded by the memory cap; it may run natively up to LINEAR_MAX.
local LINEAR_MAX = cfg.LINEAR_MAX
local function limit_for(degree) return degree <= 1 and LINEAR_MAX or NATIVE_MAX end
local STEP, BYTE, ELEM, CMP = cfg.W_STEP, cfg.W_BYTE, cfg.W_ELEM, cfg.W_CMP
local MEMORY, MEM_MARK = cfg.memory, cfg.MEM_MARK
local CACHE_MAX = cfg.CACHE_MAX

-- The meter: units of native work since the last clock check.
local W = 0
local function charge(u)
  W = W + u
  if W >= LIMIT then
    W = 0
    tick()
  end
end

local port
local function P()
  if port == nil then port = load_port(NAT, charge, cfg) end
  return port
end

-- Lua 5.5 makes a lauxlib buffer's result (string.rep, format, gsub, table.concat, upper...: any
-- string built over ~1 KB) an external string whose bytes the collector does not count: it paces
-- itself on the rest of the heap, so a loop of 6 MB gsub results under a 16 MB cap failed with
-- memory_limit at the third, the first two garbage (lauxlib's own allocations fail at the cap
-- without the emergency collection Lua runs for its own). The guards count those bytes, and
-- collect once they reach a quarter of the cap (5.4's collector ran a cycle per heap doubling);
-- the sandbox adds what is counted since to collectgarbage("count") (uncounted()).
local collect, UNCOUNTED_MAX, uncounted = NAT.collect, MEMORY // 4, 0
local function built(r)
  if type(r) == "string" and #r > BIG then
    uncounted = uncounted + #r
    if uncounted > UNCOUNTED_MAX then
      uncounted = 0
      collect()
    end
  end
  return r
end
local function built2(r, n) return built(r), n end

local function too_big(fname, what, size, fix)
  error(MEM_MARK .. fname .. ": " .. what .. " would be " .. floor(size) .. " bytes, more than the plugin's memory cap of "
        .. MEMORY .. " bytes; " .. fix, 3)
end

-- A C loop's access to a key a table lacks follows the table's __index (a write: __newindex)
-- natively, table after table, up to MAXTAGLOOP hops in one access (lvm.c luaV_finishget/finishset)
-- with no hook between: ~15-30 ns a hop, so 30-60 us for an access ELEM takes as one. gsub with a
-- table replacement behind a 2,000-table chain ran 600,000 lookups in one native call, 33 s on a
-- 0.3 s budget. The units of one access: the chain as long as it is when the guard starts, or the
-- longest one (MAXTAGLOOP) if it ends in a function (guest code, which may lengthen the chain while
-- the native call still runs) or anything else that is not a table or string.
local W_HOP, MAXTAGLOOP = cfg.W_HOP, 2000
local WORST = ELEM + MAXTAGLOOP * W_HOP
local function access(t, event)
  local mt = getmetatable(t)
  if mt == nil then return ELEM end
  local hops = 0
  while mt ~= nil do
    local via = rawget(mt, event)
    if via == nil then break end
    local tv = type(via)
    if (tv ~= "table" and tv ~= "string") or hops >= MAXTAGLOOP then return WORST end
    hops = hops + 1
    mt = getmetatable(via)
  end
  return ELEM + hops * W_HOP
end
-- Elements one native call over a range may take at `per` units an element.
local function chunk_for(per)
  if per <= ELEM then return CHUNK end
  local c = NATIVE_MAX // per
  if c < 1 then return 1 end
  if c > CHUNK then return CHUNK end
  return c
end
-- The same for a range read and written in place (insert, remove): CHUNK for a plain table.
local function rw_chunk(t)
  if getmetatable(t) == nil then return CHUNK end
  return chunk_for(access(t, "__index") + access(t, "__newindex"))
end

---------------------------------------------------------------------------------------------
-- Pattern cost bounds. A bound is a polynomial in N = (subject length from init) + 1, kept as
-- a coefficient list {c0, c1, ...}. Walking the pattern from its end, each suffix gets:
--   ff: the worst cost of an attempt of this suffix that fails;
--   fa: the worst cost of one that succeeds, apart from
--   cs: work per character of the match's span (lazy expansions, greedy runs a never-failing
--       rest stops at): disjoint matches cover at most N characters, so it counts once;
--   canfail: false if the suffix matches from any position (x*, x-, x?, captures, or '.*'/'.-'
--       before a rest that matches at the end); endok: it matches at the end of the subject.
-- A quantifier before a rest that can fail multiplies by N (the tries), '?' by 2, %b and
-- back-references add N. The call's bound: find/match N*ff + fa + N*cs (one success, failures
-- at each start), gsub/gmatch N*(ff + fa) + N*cs (a success per start at most); anchored: one
-- attempt. The units are STEP per step.
---------------------------------------------------------------------------------------------
local function padd(a, b)
  local r = {}
  for i = 1, (#a > #b and #a or #b) do r[i] = (a[i] or 0) + (b[i] or 0) end
  return r
end
local function pN(a) -- a * N
  local r = {0}
  for i = 1, #a do r[i + 1] = a[i] end
  return r
end
local function pk(a, k)
  local r = {}
  for i = 1, #a do r[i] = a[i] * k end
  return r
end
local ZERO = {}
local function C(k) return {k} end

-- K and degree with K * N^d >= the polynomial for N >= 1; the largest N within `limit`.
local function within(K, d, limit)
  if d == 0 then return (K <= limit) and huge or 0 end
  return floor((limit / K) ^ (1 / d))
end

-- (largest N within NATIVE_MAX, K, d, largest N within FREE: calls that cheap are not charged)
local function fit(poly, weight)
  local K, d = 0, 0
  for i = 1, #poly do
    if poly[i] ~= 0 then K = K + poly[i]; d = i - 1 end
  end
  K = K * weight
  if K <= 0 then return huge, 0, 0, huge end
  return within(K, d, limit_for(d)), K, d, within(K, d, FREE)
end

-- classend over a pattern string: the index after the class at i, or nil if malformed.
local function cend(p, i, lp)
  local c = S.byte(p, i)
  i = i + 1
  if c == 37 then
    if i > lp then return nil end
    return i + 1
  elseif c == 91 then
    if S.byte(p, i) == 94 then i = i + 1 end
    repeat
      if i > lp then return nil end
      local cc = S.byte(p, i)
      i = i + 1
      if cc == 37 and i <= lp then i = i + 1 end
    until S.byte(p, i) == 93
    return i + 1
  end
  return i
end

local SPECIALS = "[%^%$%*%+%?%.%(%[%%%-]"
-- The analysis itself is bounded: a longer pattern, or a bound of a higher degree, is
-- "unbounded" (always the Lua matcher), unless it has no special character (a literal: linear).
local MAX_ANALYZED, MAX_DEGREE = 4096, 32

local function descriptor(ff, fa, cs, anchored, open, plain, lp)
  local once = padd(padd(ff, fa), pN(cs))
  local fm, gs
  if anchored then
    fm, gs = once, once
  else
    fm = padd(padd(pN(ff), fa), pN(cs))
    gs = padd(pN(padd(ff, fa)), pN(cs))
  end
  local d = {}
  d[1], d[2], d[3], d.free = fit(fm, STEP)
  d[4], d[5], d[6], d.gfree = fit(gs, STEP)
  d[7], d[8], d[9] = fit(once, STEP)
  d.pk = (lp + 1) * BYTE -- plain search: positions x pattern length
  d.anchored = anchored
  d.level2 = not anchored and open == 0
  -- find() does a plain search (lmemfind) when there is no special character
  d.plain = plain
  return d
end

local UNBOUNDED = {0, huge, 0, 0, huge, 0, 0, huge, 0, free = 0, gfree = 0, pk = huge, anchored = false,
                   level2 = false, plain = false}

local function analyze(p, honor_anchor)
  local lp = #p
  local literal = S.find(p, SPECIALS) == nil
  if literal then -- singles only: an attempt walks at most the pattern
    return descriptor(C(lp), C(lp), C(lp), false, 0, honor_anchor, lp)
  end
  if lp > MAX_ANALYZED then return UNBOUNDED end
  local i, anchored = 1, false
  if honor_anchor and S.byte(p, 1) == 94 then anchored, i = true, 2 end
  local items = {}
  local open = 0 -- captures left open: native find raises pushing them (no level 2)
  local poskey = nil -- the first capture is a position: gsub looks a table replacement up by integers
  while i <= lp do
    local c, nx = S.byte(p, i), S.byte(p, i + 1)
    local it
    if c == 40 then
      it = {k = "cap"}
      if poskey == nil then poskey = (nx == 41) end
      if nx ~= 41 then open = open + 1 end
      i = i + ((nx == 41) and 2 or 1)
    elseif c == 41 then
      it = {k = "cap"}
      if open > 0 then open = open - 1 end -- (a ')' with none open raises when reached)
      i = i + 1
    elseif c == 36 and i == lp then
      it = {k = "end"}
      i = i + 1
    elseif c == 37 and nx == 98 then
      if i + 3 > lp then it = {k = "err"} else it = {k = "bal"} end
      i = i + 4
    elseif c == 37 and nx == 102 then
      local ep = S.byte(p, i + 2) == 91 and cend(p, i + 2, lp)
      if not ep then it = {k = "err"} else it = {k = "front", c = ep - i - 2} end
      i = ep or lp + 1
    elseif c == 37 and nx and nx >= 48 and nx <= 57 then
      it = {k = "back"}
      i = i + 2
    else
      local ep = cend(p, i, lp)
      if not ep then
        it = {k = "err"}
        i = lp + 1
      else
        local q = S.byte(p, ep)
        local cost = (c == 91) and (ep - i) or 1
        if q == 42 or q == 43 or q == 45 or q == 63 then
          it = {k = "q", q = q, c = cost, any = (c == 46 and ep == i + 1)}
          i = ep + 1
        else
          it = {k = "single", c = cost}
          i = ep
        end
      end
    end
    items[#items + 1] = it
    if it.k == "err" then break end
  end
  local ff, fa, cs, canfail, endok = ZERO, C(1), ZERO, false, true
  local N1 = pN(C(1))
  for j = #items, 1, -1 do
    local it = items[j]
    local k, c = it.k, it.c
    local rff = canfail and ff or ZERO
    if k == "cap" then
      ff = canfail and padd(ff, C(1)) or ZERO
      fa = padd(fa, C(1))
    elseif k == "end" or k == "err" then
      ff, fa, cs, canfail, endok = C(1), C(1), ZERO, true, (k == "end")
    elseif k == "single" or k == "front" then
      ff = padd(C(c), rff)
      fa = padd(fa, C(c))
      if k == "single" then cs = padd(cs, C(c)) end
      canfail, endok = true, false
    elseif k == "bal" or k == "back" then
      ff = padd(N1, rff)
      fa = padd(fa, C(1))
      cs = padd(cs, C(1))
      canfail, endok = true, false
    else -- quantified single
      local q = it.q
      if q == 42 or q == 43 then -- '*' '+'
        local first = (q == 43) and c or 0
        if not canfail or (it.any and endok) then
          -- the first try of the rest succeeds: the expansion is part of the match's span
          ff = (q == 43) and C(c) or ZERO
          fa = padd(fa, C(c + first))
          cs = padd(cs, C(c))
          canfail = (q == 43)
          endok = (q == 42) and (endok or it.any)
        else
          local tries = padd(pN(C(c)), pN(ff))
          ff = padd(C(first), tries)
          fa = padd(padd(C(first), tries), fa)
          canfail = true
          endok = (q == 42) and endok
        end
      elseif q == 45 then -- '-'
        if not canfail then
          fa = padd(fa, C(1))
          ff = ZERO
        elseif it.any and endok then
          cs = padd(cs, padd(C(c), ff))
          fa = padd(fa, C(1))
          ff, canfail = ZERO, false
        else
          cs = padd(cs, padd(C(c), ff))
          fa = padd(fa, C(1))
          ff = pN(padd(C(c), ff))
        end
      else -- '?'
        if not canfail then
          fa = padd(fa, C(c))
          ff = ZERO
        else
          fa = padd(padd(C(c), ff), fa)
          ff = padd(C(c), pk(ff, 2))
        end
      end
    end
    if #ff > MAX_DEGREE or #fa > MAX_DEGREE or #cs > MAX_DEGREE then return UNBOUNDED end
  end
  local d = descriptor(ff, fa, cs, anchored, open, false, lp)
  d.poskey = poskey
  return d
end

-- Descriptors by pattern string, for find/match/gsub (a leading '^' anchors) and for gmatch
-- (a leading '^' is a literal). Bounded: a plugin building patterns from its input must not
-- grow the cache without limit.
local FM, GM, ncached = {}, {}, 0
local function describe(p, gm)
  local cache = gm and GM or FM
  local d = cache[p]
  if d == nil then
    if ncached >= CACHE_MAX then
      FM, GM, ncached = {}, {}, 0
      cache = gm and GM or FM
    end
    d = analyze(p, not gm)
    cache[p] = d
    ncached = ncached + 1
  end
  return d
end

-- Subject and pattern as luaL_checklstring takes them (numbers become strings); nil if the
-- native function must raise its own argument error.
local function str(x)
  local t = type(x)
  if t == "string" then return x end
  if t == "number" then return tostring(x) end
  return nil
end

-- posrelatI(init) - 1: the 0-based start; nil if init is not an integer (native raises).
local function start0(init, ls)
  if init == nil then return 0 end
  local i = tointeger(init)
  if i == nil then return nil end
  if i > 0 then return i - 1 end
  if i == 0 or i < -ls then return 0 end
  return ls + i
end

-- The level for a pattern call: 1 native (charging the bound), 2 native attempts, 3 Lua.
local function level(d, N, k)
  local u = d[k + 2] * N ^ d[k + 3]
  if u <= limit_for(d[k + 3]) then charge(u); return 1, 0 end
  local a = d[8] * N ^ d[9]
  if d.level2 and a <= limit_for(d[9]) then return 2, a end
  return 3, 0
end

local function find_slow(s, p, init, plain, find)
  local s2, p2 = str(s), str(p)
  if s2 == nil or p2 == nil or start0(init, #s2) == nil then
    if find then return S.find(s, p, init, plain) end
    return S.match(s, p, init)
  end
  local ls = #s2
  local i0 = start0(init, ls)
  if i0 > ls then return nil end
  local N = ls - i0 + 1
  -- a plain search (asked for, or a pattern without specials) needs no pattern analysis
  local d = nil
  if not (find and plain) then d = describe(p2, false) end
  if find and (plain or d.plain) then
    local u = N * (#p2 + 1) * BYTE
    if u <= LINEAR_MAX then charge(u); return S.find(s, p, init, plain) end
    return P().plain_find(s2, p2, i0)
  end
  local lvl, per = level(d, N, 0)
  if lvl == 1 then
    if find then return S.find(s, p, init, plain) end
    return S.match(s, p, init)
  end
  return P().find(lvl, per, s2, p2, i0, find)
end

local G = {}

-- The fast paths: a pattern seen before (its descriptor cached), a string subject, no start
-- offset, and a bound within NATIVE_MAX; a bound within FREE is not even charged.
function G.find(s, p, init, plain)
  local d = FM[p]
  if d ~= nil and (init == nil or init == 1) and type(s) == "string" then
    local n = #s
    if plain or d.plain then
      local u = (n + 1) * d.pk
      if u <= LINEAR_MAX then
        if u > FREE then charge(u) end
        return S.find(s, p, init, plain)
      end
    elseif n < d[1] then
      if n >= d.free then charge(d[2] * (n + 1) ^ d[3]) end
      return S.find(s, p, init, plain)
    end
  end
  return find_slow(s, p, init, plain, true)
end

function G.match(s, p, init)
  local d = FM[p]
  if d ~= nil and init == nil and type(s) == "string" then
    local n = #s
    if n < d[1] then
      if n >= d.free then charge(d[2] * (n + 1) ^ d[3]) end
      return S.match(s, p)
    end
  end
  return find_slow(s, p, init, nil, false)
end

function G.gmatch(s, p, init)
  local s2, p2 = str(s), str(p)
  if s2 == nil or p2 == nil then return S.gmatch(s, p, init) end
  local ls = #s2
  local i0 = start0(init, ls)
  if i0 == nil then return S.gmatch(s, p, init) end
  if i0 > ls then i0 = ls + 1 end
  -- gmatch's whole iteration tries each start at most once: its bound is charged here.
  local lvl, per = level(describe(p2, true), ls - i0 + 2, 3)
  if lvl == 1 then return S.gmatch(s, p, init) end
  return P().gmatch(lvl, per, s2, p2, i0)
end

local REPL = {string = true, number = true, ["function"] = true, table = true}
local REPL_COST = 48 -- units per match for gsub's replacement step (a buffer append, a lookup)

local gsub_slow

function G.gsub(s, p, repl, n)
  local d = FM[p]
  if d ~= nil and n == nil and type(s) == "string" and type(repl) == "string" then
    local N = #s + 1
    if N <= d[4] then
      local u = d[5] * N ^ d[6] + N * (#repl + REPL_COST) * BYTE
      if u <= limit_for(d[6]) then
        if u > FREE then charge(u) end
        return built2(S.gsub(s, p, repl))
      end
    end
  end
  return gsub_slow(s, p, repl, n)
end

function gsub_slow(s, p, repl, n)
  local s2, p2, tr = str(s), str(p), type(repl)
  if s2 == nil or p2 == nil or not REPL[tr] then return S.gsub(s, p, repl, n) end
  local ls = #s2
  local max_n = ls + 1
  if n ~= nil then
    max_n = tointeger(n)
    if max_n == nil then return S.gsub(s, p, repl, n) end
  end
  local N = ls + 1
  local d = FM[p2] or describe(p2, false)
  -- the replacement's own work: each match appends the replacement (a string's length), or looks
  -- the match up in the table, through its __index chain (access)
  local per = (tr == "string" and #repl or 0) + REPL_COST
  if tr == "table" then per = per + access(repl, "__index") - ELEM end
  local u = d[5] * N ^ d[6] + N * per * BYTE
  -- A position capture looks the table up by integer keys, which Lua hashes without a seed: a
  -- guest can make each absent one's lookup walk a chain as long as the table (a gsub of '()' over
  -- 800,000 positions next to 16,382 colliding keys ran 20 s past a 20 s budget in one native
  -- call). Those lookups run in Lua (level 2 or 3), where the hook sees each.
  if tr == "table" and d.poskey then u = huge end
  if u <= limit_for(d[6]) then
    charge(u)
    return built2(S.gsub(s, p, repl, n))
  end
  local a = d[8] * N ^ d[9]
  local lvl = (d.level2 and a <= limit_for(d[9])) and 2 or 3
  return built2(P().gsub(lvl, a, s2, p2, repl, max_n))
end

function G.rep(s, n, sep)
  local s2, sep2 = str(s), ""
  local k = tointeger(n)
  if sep ~= nil then sep2 = str(sep) end
  if s2 == nil or k == nil or sep2 == nil then return S.rep(s, n, sep) end
  if k <= 0 then return "" end
  local l, lsep = #s2, #sep2
  -- "" repeated: no allocation and no result, only k iterations of nothing.
  if l + lsep == 0 then return "" end
  local total = (l + 0.0) * k + (lsep + 0.0) * (k - 1)
  -- lauxlib builds the result in a buffer, then copies it into the string: twice its size at once
  -- (5.5e8 bytes under a 1 GiB cap failed after ~0.5 s of copying, with no word of string.rep).
  if 2 * total > MEMORY then
    too_big("string.rep", "the result and the buffer it is built in", 2 * total,
            "repeat fewer times, or raise the plugin's memory_mb")
  end
  charge(total * BYTE + k)
  local unit = l + lsep
  if k > CHUNK and unit < CHUNK then
    -- k tiny copies are one C loop of k steps (16M for a 16 MB "a"; 1e9 ran 3 s on a 0.3 s
    -- budget): repeat ~64 KB pieces instead, a few thousand large copies, built straight into
    -- the one result (no second copy to join: this works up to the memory cap). With X = s..sep
    -- the result is X^(k-1)..s, and rep(X^m..s, q + 1, sep..X^j) is X^(q*(m+1+j) + m)..s: take
    -- p = m+1+j units a period, q = (k-1) // p, m = (k-1) % p.
    local one = s2 .. sep2
    local p = 65536 // unit
    local q, m = (k - 1) // p, (k - 1) % p
    return built(S.rep(S.rep(one, m) .. s2, q + 1, sep2 .. S.rep(one, p - 1 - m)))
  end
  return built(S.rep(s, n, sep))
end

-- Functions linear in one string argument, charged beyond BIG bytes (smaller ones cost less
-- than the hook's granularity). Written out: a native called as S.<literal> keeps its name.
function G.byte(s, i, j)
  if type(s) == "string" and #s > BIG then charge(#s * BYTE) end
  return S.byte(s, i, j)
end
function G.sub(s, i, j)
  if type(s) == "string" and #s > BIG then charge(#s * BYTE) end
  return S.sub(s, i, j)
end
function G.lower(s)
  if type(s) == "string" and #s > BIG then charge(#s * 4 * BYTE) end
  return built(S.lower(s))
end
function G.upper(s)
  if type(s) == "string" and #s > BIG then charge(#s * 4 * BYTE) end
  return built(S.upper(s))
end
function G.reverse(s)
  if type(s) == "string" and #s > BIG then charge(#s * 4 * BYTE) end
  return built(S.reverse(s))
end
function G.packsize(fmt)
  if type(fmt) == "string" and #fmt > BIG then charge(#fmt * 4 * BYTE) end
  return S.packsize(fmt)
end

-- Bytes of the string arguments (select(i, ...) is O(n): many arguments are packed once), and how
-- many are tables (the only values a guest can give a metatable: converted by its __tostring or __name).
local function strings_cost(n, ...)
  local u, other = n, 0
  if n <= 8 then
    for i = 1, n do
      local v = select(i, ...)
      local tv = type(v)
      if tv == "string" then u = u + #v elseif tv == "table" then other = other + 1 end
    end
  else
    local args = {...}
    for i = 1, n do
      local v = args[i]
      local tv = type(v)
      if tv == "string" then u = u + #v elseif tv == "table" then other = other + 1 end
    end
  end
  return u, other
end

-- %q of a string is one C loop of ~60 ns a byte at worst (control bytes: a sprintf each): a
-- second for 16 MB, in one call. A %q argument over Q_PIECE bytes is escaped here in pieces
-- instead (each a native %q of ~4 ms at most), and the format gets it through a %s.
local Q_PIECE, Q_WORK = 65536, 60
local function is_digit(c) return c ~= nil and c >= 48 and c <= 57 end
local function quoted(x)
  local n, parts, np, a = #x, {}, 0, 1
  while a <= n do
    local b = a + Q_PIECE - 1
    if b >= n then
      b = n
    elseif is_digit(S.byte(x, b + 1)) and not is_digit(S.byte(x, b)) then
      b = b + 1 -- a control byte's escape depends on whether a digit follows: never split there
    end
    charge((b - a + 1) * Q_WORK * BYTE)
    local q = S.format("%q", S.sub(x, a, b))
    np = np + 1
    parts[np] = S.sub(q, 2, -2)
    a = b + 1
  end
  return '"' .. T.concat(parts, "", 1, np) .. '"'
end

-- fmt with each %q whose argument is a string over Q_PIECE bytes made a %s, and that argument
-- escaped (quoted) in args; nil if there is none (or the format is malformed: the native raises).
-- The next conversion of fmt from pos: the position of its '%', of its letter, and the letter
-- ("%%" skipped); nil when there is none; i and nil when the one at i is malformed.
local function next_conversion(fmt, pos)
  while true do
    local i = S.find(fmt, "%", pos, true)
    if i == nil then return nil end
    if S.byte(fmt, i + 1) ~= 37 then -- not "%%"
      -- a conversion is at most 32 characters (lstrlib's MAX_FORMAT: longer raises), so the
      -- backtracking match runs on a bounded piece, whatever the format holds after the '%'
      local _, e, conv = S.find(S.sub(fmt, i + 1, i + 40), "^[-+ #0]*%d*%.?%d*(%a)")
      if e == nil then return i, nil end
      return i, i + e, conv
    end
    pos = i + 2
  end
end

local function split_q(fmt, args, nargs)
  local out, no, pos, last, arg = {}, 0, 1, 1, 0
  while true do
    local i, e, conv = next_conversion(fmt, pos)
    if i == nil then break end
    if e == nil then return nil end
    arg = arg + 1
    local x = args[arg]
    if conv == "q" and e == i + 1 and arg <= nargs and type(x) == "string" and #x > Q_PIECE then
      no = no + 1
      out[no] = S.sub(fmt, last, i - 1) .. "%s"
      last = e + 1
      args[arg] = quoted(x)
    end
    pos = e + 1
  end
  if no == 0 then return nil end
  out[no + 1] = S.sub(fmt, last)
  return T.concat(out, "", 1, no + 1)
end

-- A format's conversions one native call each (the literal text before each goes with it), for a
-- format whose arguments cost more than one linear native call may do (LINEAR_MAX: the arguments'
-- bytes are not bounded by the memory cap, one string may be passed many times): the native runs them all in one
-- call, and each %s of a string (or of what a __tostring returns, a native one like `next` too)
-- with a precision is a strlen of the whole string: 2,000 x "%.1s" of one 30 MB string ran 5 s
-- unpolled. A piece's argument error names its place in the whole call, as the native's does.
local function renumber(arg, ok, ...)
  if ok then return ... end
  local e = ...
  if type(e) == "string" then
    -- (called through pcall, the native is named as a global: 'string.format')
    local _, n = S.find(e, "^bad argument #2 to '[%w.]*format' ")
    if n then e = "bad argument #" .. (arg + 1) .. " to 'format' " .. S.sub(e, n + 1) end
  end
  error(e, 0)
end
local function format_pieces(fmt, args, nargs)
  local out, no, pos, last, arg = {}, 0, 1, 1, 0
  while true do
    local i, e, conv = next_conversion(fmt, pos)
    if e == nil then break end -- none left, or malformed: the rest raises below, at this conversion
    arg = arg + 1
    local piece, x = S.sub(fmt, last, e), args[arg]
    local u = #piece
    if type(x) == "string" then u = u + #x end
    if conv == "q" and e == i + 1 and type(x) == "string" and #x > Q_PIECE then
      piece, x = S.sub(fmt, last, i - 1) .. "%s", quoted(x)
    else
      u = u * 4 -- %q escapes (up to 4 bytes per byte)
    end
    charge(u * BYTE)
    no = no + 1
    if arg > nargs then
      out[no] = renumber(arg, NAT.pcall(S.format, piece))
    elseif conv == "s" and e == i + 1 and type(x) == "string" then
      -- a plain %s of a string is the string: not copied once more (the literal text before it
      -- still goes through the native, for its %%)
      out[no] = S.format(S.sub(piece, 1, -3))
      no = no + 1
      out[no] = x
    else
      -- (counted as built: each piece is a string the collector does not count, see built())
      out[no] = built(renumber(arg, NAT.pcall(S.format, piece, x)))
    end
    last, pos = e + 1, e + 1
  end
  -- the literal text after the last conversion, or the rest from a malformed one (which raises as
  -- in the whole call: "no value" if no argument is left, else "invalid conversion")
  local rest = S.sub(fmt, last)
  charge(#rest * BYTE)
  no = no + 1
  if arg < nargs then
    out[no] = renumber(arg + 1, NAT.pcall(S.format, rest, args[arg + 1]))
  else
    out[no] = renumber(arg + 1, NAT.pcall(S.format, rest))
  end
  return T.concat(out, "", 1, no)
end

function G.format(fmt, ...)
  local nargs = select("#", ...)
  local u, other = strings_cost(nargs, ...)
  if type(fmt) == "string" then u = u + #fmt end
  -- more than one native call's work, or more than one conversion whose cost is not known before
  -- (a __tostring or __name of the argument): each conversion on its own
  if nargs > 1 and type(fmt) == "string" and (u * 4 > LINEAR_MAX or other > 1) then
    return built(format_pieces(fmt, {...}, nargs))
  end
  if u > Q_PIECE and type(fmt) == "string" and S.find(fmt, "%q", 1, true) then
    local args = {...}
    local f2 = split_q(fmt, args, nargs)
    if f2 then
      charge(u * BYTE)
      return built(S.format(f2, T.unpack(args, 1, nargs)))
    end
  end
  -- %q escapes (up to 4 bytes per byte)
  if u > BIG then charge(u * 4 * BYTE) end
  return built(S.format(fmt, ...))
end

function G.pack(fmt, ...)
  -- sizes in the format (c1000000, i16, ...) pad the result; the arguments' strings are copied
  local u = strings_cost(select("#", ...), ...)
  if type(fmt) == "string" then
    u = u + #fmt * 16
    for num in S.gmatch(fmt, "%d+") do u = u + (NAT.tonumber(num) or 0) end
  end
  if u > MEMORY then too_big("string.pack", "the result", u, "pack less data") end
  if u > BIG then charge(u * BYTE) end
  return built(S.pack(fmt, ...))
end

function G.unpack(fmt, s, pos)
  local u = (type(fmt) == "string" and #fmt or 0) + (type(s) == "string" and #s or 0)
  if u > BIG then charge(u * 4 * BYTE) end
  return S.unpack(fmt, s, pos)
end

---------------------------------------------------------------------------------------------
-- table: the C loops run over an index range that __len / arguments can make as large as
-- they like (table.move({}, 1, 1e12, 1) moves nils for ever), and with __index/__newindex
-- metamethods every element may be a C call. Ranges over CHUNK elements run in chunks.
---------------------------------------------------------------------------------------------
local function raw_len(t)
  -- #t when no __len can run (the length a native call sees), else nil
  if type(t) ~= "table" then return nil end
  local mt = getmetatable(t)
  if mt ~= nil and rawget(mt, "__len") ~= nil then return nil end
  return rawlen(t)
end

local function plain(t)
  return type(t) == "table" and getmetatable(t) == nil
end

local function g_move(a1, f, e, t, a2)
  local fi, ei, ti = tointeger(f), tointeger(e), tointeger(t)
  if fi == nil or ei == nil or ti == nil or ei < fi then return T.move(a1, f, e, t, a2) end
  if not (fi > 0 or ei < maxinteger + fi) then return T.move(a1, f, e, t, a2) end
  local n = ei - fi -- elements - 1
  local dst = a2
  if a2 == nil then dst = a1 end
  -- each element is a read of a1 and a write of dst, either through a metatable's chain (access)
  local per = ELEM
  if getmetatable(a1) ~= nil or getmetatable(dst) ~= nil then per = access(a1, "__index") + access(dst, "__newindex") end
  local chunk = chunk_for(per)
  if n < chunk then
    charge((n + 1) * per)
    return T.move(a1, f, e, t, a2)
  end
  if ti > maxinteger - n then return T.move(a1, f, e, t, a2) end -- native raises "wrap around"
  if ti > ei or ti <= fi or (a2 ~= nil and a1 ~= a2) then
    for c = 0, n, chunk do
      local last = c + chunk - 1
      if last > n then last = n end
      charge((last - c + 1) * per)
      T.move(a1, fi + c, fi + last, ti + c, a2)
    end
  else
    -- overlapping, destination after the source: from the top down, as the native loop does
    local c = n - n % chunk
    while c >= 0 do
      local last = c + chunk - 1
      if last > n then last = n end
      charge((last - c + 1) * per)
      T.move(a1, fi + c, fi + last, ti + c, a2)
      c = c - chunk
    end
  end
  return dst
end

local function g_concat(list, sep, i, j)
  if type(list) ~= "table" then return T.concat(list, sep, i, j) end
  local ii = 1
  if i ~= nil then ii = tointeger(i) end
  local jj
  if j == nil then jj = tointeger(#list) else jj = tointeger(j) end
  if ii == nil or jj == nil or jj < ii then return T.concat(list, sep, i, j) end
  local sep2 = ""
  if sep ~= nil then sep2 = str(sep) end
  local span = (jj + 0.0) - ii -- elements - 1, as a float: jj - ii may overflow
  local per, chunk = ELEM, CHUNK
  if getmetatable(list) ~= nil then
    per = access(list, "__index")
    chunk = chunk_for(per)
  end
  if sep2 == nil or span < chunk then
    charge((span + 1) * per)
    return built(T.concat(list, sep, ii, jj))
  end
  local parts, np = {}, 0
  local est = 0
  for k = ii, jj, chunk do
    local last = k + chunk - 1
    if last > jj or last < k then last = jj end
    charge((last - k + 1) * per)
    np = np + 1
    parts[np] = T.concat(list, sep2, k, last)
    est = est + #parts[np] + #sep2
    if est > MEMORY then too_big("table.concat", "the result", est, "concatenate fewer elements") end
  end
  return built(T.concat(parts, sep2, 1, np))
end

local function check_len(t, fname)
  local n = tointeger(#t)
  if n == nil then error("object length is not an integer", 3) end
  return n
end

local function g_insert(t, ...)
  local nargs = select("#", ...)
  local n = raw_len(t)
  if nargs ~= 2 or (n ~= nil and n < rw_chunk(t)) then
    return T.insert(t, ...)
  end
  if type(t) ~= "table" then return T.insert(t, ...) end
  local pos, v = ...
  local e = (n or check_len(t, "insert")) + 1 -- wraps around like luaL_intop
  local ipos = tointeger(pos)
  if ipos == nil then
    if type(pos) == "number" then error("bad argument #2 to 'insert' (number has no integer representation)", 2) end
    error("bad argument #2 to 'insert' (number expected, got " .. type(pos) .. ")", 2)
  end
  if not ult(ipos - 1, e) then error("bad argument #2 to 'insert' (position out of bounds)", 2) end
  if e > ipos then g_move(t, ipos, e - 1, ipos + 1) end
  t[ipos] = v
end

local function g_remove(t, pos)
  local size = raw_len(t)
  if type(t) ~= "table" or (size ~= nil and size < rw_chunk(t)) then
    return T.remove(t, pos)
  end
  size = size or check_len(t, "remove")
  local ipos = size
  if pos ~= nil then
    ipos = tointeger(pos)
    if ipos == nil then return T.remove(t, pos) end
  end
  if ipos ~= size and not (ult(ipos - 1, size) or ipos - 1 == size) then
    error("bad argument #2 to 'remove' (position out of bounds)", 2)
  end
  local v = t[ipos]
  if ipos < size then
    g_move(t, ipos + 1, size, ipos)
    ipos = size
  end
  t[ipos] = nil
  return v
end

local function g_unpack(list, i, j)
  if type(list) ~= "table" then return T.unpack(list, i, j) end
  local ii = 1
  if i ~= nil then ii = tointeger(i) end
  local jj
  if j == nil then jj = tointeger(#list) else jj = tointeger(j) end
  if ii == nil or jj == nil or jj < ii then return T.unpack(list, i, j) end
  local n = (jj + 0.0) - ii
  if n >= 1e6 then return T.unpack(list, ii, jj) end -- too many results: the native call refuses at once
  n = jj - ii
  local per, chunk = ELEM, CHUNK
  if getmetatable(list) ~= nil then
    per = access(list, "__index")
    chunk = chunk_for(per)
  end
  if n >= chunk then
    -- Gathered in chunks first, plain tables too: every element may be a metamethod call, and in a
    -- plain table a key's lookup walks the hash chain at its main position, which integer keys
    -- (hashed without a seed) can make as long as the table: 800,000 absent keys read next to a
    -- chain of 16,382 colliding ones (built in ~0.3 s) took 8 s in one native unpack. The copy's
    -- keys 1..n+1 are its array part: the last native unpack reads no chain.
    local buf = g_move(list, ii, jj, 1, {})
    charge((n + 1) * ELEM)
    return T.unpack(buf, 1, n + 1)
  end
  charge((n + 1) * per)
  return T.unpack(list, ii, jj)
end

-- table.sort: with the default order (or a C function as order), the whole sort is one C
-- call of ~n*log2(n) comparisons, each up to the length of the strings compared. Up to
-- NATIVE_MAX of that work it runs natively; beyond, runs of the table are sorted natively and
-- merged here (needing a second array of n elements). A Lua order function gives the hook a
-- chance at every comparison: that sort runs natively whatever its size.
local function lua_function(f)
  return type(f) == "function" and getinfo(f, "S").what ~= "C"
end

local function lt_default(a, b)
  if type(a) == "string" and type(b) == "string" then
    local l = #a < #b and #a or #b
    if l > BIG then charge(l * BYTE) end
  end
  return a < b
end

-- Comparisons of a sort of n elements whose longest string has maxl bytes, in units.
local function sort_work(n, maxl)
  if n < 2 then return 0 end
  return n * (log(n, 2) + 1) * (CMP + maxl * BYTE)
end

local function merge_sort(t, n, comp, maxl, is_plain)
  local lt = comp or lt_default
  -- the largest run the native sort may do in one call
  local run = CHUNK
  while run > 2 and sort_work(run, maxl) > NATIVE_MAX do run = run // 2 end
  local a = t
  if not is_plain then a = g_move(t, 1, n, 1, {}) end
  if run > 2 then
    for r = 1, n, run do
      local last = r + run - 1
      if last > n then last = n end
      local chunk = T.move(a, r, last, 1, {})
      charge(sort_work(last - r + 1, maxl) + (last - r + 1) * 2 * ELEM)
      T.sort(chunk, comp)
      T.move(chunk, 1, last - r + 1, r, a)
    end
  else
    run = 1
  end
  local b = {}
  local width = run
  while width < n do
    for lo = 1, n, 2 * width do
      local mid, hi = lo + width - 1, lo + 2 * width - 1
      if hi > n then hi = n end
      if mid >= hi then
        T.move(a, lo, hi, lo, b)
      else
        local i, j, k = lo, mid + 1, lo
        while i <= mid and j <= hi do
          local x, y = a[i], a[j]
          if lt(y, x) then b[k] = y; j = j + 1 else b[k] = x; i = i + 1 end
          k = k + 1
        end
        if i <= mid then T.move(a, i, mid, k, b) else T.move(a, j, hi, k, b) end
      end
      charge((hi - lo + 1) * ELEM)
    end
    a, b = b, a
    width = width * 2
  end
  if a ~= t then g_move(a, 1, n, 1, t) end
end

local function g_sort(t, comp)
  if type(t) ~= "table" or (comp ~= nil and type(comp) ~= "function") then return T.sort(t, comp) end
  local n = raw_len(t)
  if comp ~= nil and lua_function(comp) then
    if n ~= nil then
      charge(n * ELEM)
      return T.sort(t, comp)
    end
  elseif n ~= nil then
    if n < 2 then return T.sort(t, comp) end
    -- the longest string a comparison may walk (only the default order compares strings)
    local maxl = 0
    for i = 1, n do
      local v = rawget(t, i)
      if type(v) == "string" and #v > maxl then maxl = #v end
    end
    -- a comparison's two reads (and a swap's writes) of a table with a metatable may each walk a
    -- chain (access): counted as longer strings
    local work = sort_work(n, maxl)
    if not plain(t) then
      work = sort_work(n, maxl + 2 * (access(t, "__index") + access(t, "__newindex") - 2 * ELEM) // BYTE)
    end
    if work <= NATIVE_MAX then
      charge(work)
      return T.sort(t, comp)
    end
    if n >= 2147483647 then return T.sort(t, comp) end
    return merge_sort(t, n, comp, maxl, plain(t))
  end
  -- a __len metamethod: its length once, then every element through the table's metamethods
  n = check_len(t, "sort")
  if n < 2 then return end
  if n >= 2147483647 then error("bad argument #1 to 'sort' (array too big)", 2) end
  return merge_sort(t, n, comp, BIG, false)
end

-- table.create (Lua 5.5) allocates and clears its sizes in one C call: 2^24 hash nodes took 0.32 s
-- under a 1 GiB cap. The sizes are only a hint (the table is empty either way and grows as any
-- other), so sizes over NATIVE_MAX units are cut to it, after the native's own argument checks.
local W_SLOT, W_NODE = 2, 20 -- units per array slot, per hash node (measured: ~1.5 ns, ~19 ns)
local function g_create(n, m)
  local n2, m2 = tointeger(n), m == nil and 0 or tointeger(m)
  if n2 == nil or m2 == nil or n2 < 0 or m2 < 0 or n2 > 2147483647 or m2 > 2147483647 then
    return T.create(n, m)
  end
  if n2 * W_SLOT > NATIVE_MAX then n2 = NATIVE_MAX // W_SLOT end
  if m2 * W_NODE > NATIVE_MAX then m2 = NATIVE_MAX // W_NODE end
  local u = n2 * W_SLOT + m2 * W_NODE
  if u > FREE then charge(u) end
  return T.create(n2, m2)
end

G.table = {move = g_move, concat = g_concat, insert = g_insert, remove = g_remove, unpack = g_unpack, sort = g_sort,
           create = T.create and g_create}

---------------------------------------------------------------------------------------------
-- utf8: linear in the string; the codes() iterator is wrapped (it can be called with any
-- string and position).
---------------------------------------------------------------------------------------------
G.utf8 = {}
function G.utf8.len(s, i, j, lax)
  if type(s) == "string" and #s > BIG then charge(#s * 2 * BYTE) end
  return U.len(s, i, j, lax)
end
function G.utf8.codepoint(s, i, j, lax)
  if type(s) == "string" and #s > BIG then charge(#s * 8 * BYTE) end
  return U.codepoint(s, i, j, lax)
end
function G.utf8.offset(s, n, i)
  if type(s) == "string" and #s > BIG then charge(#s * 2 * BYTE) end
  return U.offset(s, n, i)
end
function G.utf8.codes(s, lax)
  local f, a, b = U.codes(s, lax)
  return function(s1, i)
    if type(s1) == "string" and #s1 > BIG then charge(#s1 * BYTE) end
    return f(s1, i)
  end, a, b
end

function G.tonumber(x, ...)
  if type(x) == "string" and #x > BIG then charge(#x * 4 * BYTE) end
  return NAT.tonumber(x, ...)
end

G.string = {find = G.find, match = G.match, gmatch = G.gmatch, gsub = G.gsub, rep = G.rep, format = G.format,
            pack = G.pack, unpack = G.unpack, byte = G.byte, lower = G.lower, upper = G.upper,
            reverse = G.reverse, sub = G.sub, packsize = G.packsize}

-- For the sandbox: the overrides per library, and the meter (reset per call; tests read it).
return {string = G.string, table = G.table, utf8 = G.utf8, tonumber = G.tonumber, charge = charge,
        describe = describe, port = P,
        uncounted = function(reset) local n = uncounted if reset then uncounted = 0 end return n end}
