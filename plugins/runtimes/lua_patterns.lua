-- A pure-Lua port of Lua 5.4.8's pattern matcher (lstrlib.c; 5.5's matches alike) for the sandbox's guarded string
-- functions (plugins/runtimes/lua_guards.lua). The guards call the native C functions when a
-- pattern's worst-case cost on the subject at hand is small; otherwise they call this port,
-- whose steps are Lua instructions the count hook interrupts at the deadline.
--
-- Same semantics as lstrlib: captures, position captures, %b, %f, back-references, anchors,
-- gsub with a string/table/function replacement and a max count, gmatch (where '^' is a
-- literal), find with plain search, and the same error messages (without a position prefix,
-- as a native error raised inside the guards has none).
--
-- Two ways to run a pattern, chosen by the guard from the pattern's per-attempt cost bound:
-- level 2 loops over start positions in Lua and runs each attempt natively (the pattern with an
-- anchor), level 3 runs the whole match in Lua.
local NAT, charge, cfg = ...

local byte, sub, char, s_find, s_match = NAT.byte, NAT.sub, NAT.char, NAT.find, NAT.match
local concat, tointeger, error, type, select, tostring = NAT.concat, NAT.tointeger, NAT.error, NAT.type, NAT.select, NAT.tostring
local unpack = NAT.unpack
local STEP, BYTE = cfg.W_STEP, cfg.W_BYTE

local L_ESC = 37          -- '%'
local MAXCCALLS = 200     -- lstrlib's recursion limit for 'match'
local MAXCAPTURES = 32    -- LUA_MAXCAPTURES
local CAP_UNFINISHED, CAP_POSITION = -1, -2

-- Character classes as the native matcher sees them in this process (its C locale): each
-- class letter maps to a 0..255 membership table, asked from the native matcher itself.
local CLASS = {}
do
  local all = {}
  for c = 0, 255 do all[c + 1] = char(c) end
  all = concat(all)
  for _, letter in ipairs({"a", "c", "d", "g", "l", "p", "s", "u", "w", "x", "z"}) do
    for _, cl in ipairs({letter, letter:upper()}) do
      local set = {}
      for c = 0, 255 do set[c] = false end
      local pat = "%" .. cl
      local i = 1
      while true do
        local a = s_find(all, pat, i)
        if a == nil then break end
        set[a - 1] = true
        i = a + 1
      end
      CLASS[byte(cl)] = set
    end
  end
end

local function match_class(c, cl)
  local set = CLASS[cl]
  if set then return set[c] end
  return cl == c
end

-- Match state: s (subject), src_end (#s + 1), p (pattern), p_end (#p + 1), level (captures
-- opened), cinit/clen (1-based capture starts and lengths), depth (recursion budget).

local function classend(ms, p)
  local P, pend = ms.p, ms.p_end
  local c = byte(P, p)
  p = p + 1
  if c == L_ESC then
    if p >= pend then error("malformed pattern (ends with '%')", 0) end
    return p + 1
  elseif c == 91 then -- '['
    if byte(P, p) == 94 then p = p + 1 end
    repeat
      if p >= pend then error("malformed pattern (missing ']')", 0) end
      local cc = byte(P, p)
      p = p + 1
      if cc == L_ESC and p < pend then p = p + 1 end
    until byte(P, p) == 93
    return p + 1
  end
  return p
end

local function matchbracketclass(ms, c, p, ec)
  local P = ms.p
  local sig = true
  if byte(P, p + 1) == 94 then sig = false; p = p + 1 end
  while true do
    p = p + 1
    if p >= ec then break end
    local pc = byte(P, p)
    if pc == L_ESC then
      p = p + 1
      if match_class(c, byte(P, p)) then return sig end
    elseif byte(P, p + 1) == 45 and p + 2 < ec then -- range a-z
      p = p + 2
      if pc <= c and c <= byte(P, p) then return sig end
    elseif pc == c then
      return sig
    end
  end
  return not sig
end

local function singlematch(ms, s, p, ep)
  if s >= ms.src_end then return false end
  local c = byte(ms.s, s)
  local pc = byte(ms.p, p)
  if pc == 46 then return true                                   -- '.'
  elseif pc == L_ESC then return match_class(c, byte(ms.p, p + 1))
  elseif pc == 91 then return matchbracketclass(ms, c, p, ep - 1) -- '['
  end
  return pc == c
end

local function matchbalance(ms, s, p)
  if p >= ms.p_end - 1 then error("malformed pattern (missing arguments to '%b')", 0) end
  local S, send = ms.s, ms.src_end
  local b = byte(ms.p, p)
  if (byte(S, s) or 0) ~= b then return nil end
  local e = byte(ms.p, p + 1)
  local cont = 1
  s = s + 1
  while s < send do
    local c = byte(S, s)
    if c == e then
      cont = cont - 1
      if cont == 0 then return s + 1 end
    elseif c == b then
      cont = cont + 1
    end
    s = s + 1
  end
  return nil
end

local do_match

local function max_expand(ms, s, p, ep)
  local i = 0
  while singlematch(ms, s + i, p, ep) do i = i + 1 end
  while i >= 0 do
    local res = do_match(ms, s + i, ep + 1)
    if res then return res end
    i = i - 1
  end
  return nil
end

local function min_expand(ms, s, p, ep)
  while true do
    local res = do_match(ms, s, ep + 1)
    if res then return res end
    if singlematch(ms, s, p, ep) then s = s + 1 else return nil end
  end
end

local function start_capture(ms, s, p, what)
  local level = ms.level
  if level >= MAXCAPTURES then error("too many captures", 0) end
  level = level + 1
  ms.cinit[level], ms.clen[level] = s, what
  ms.level = level
  local res = do_match(ms, s, p)
  if res == nil then ms.level = ms.level - 1 end
  return res
end

local function end_capture(ms, s, p)
  local l = ms.level
  while l >= 1 and ms.clen[l] ~= CAP_UNFINISHED do l = l - 1 end
  if l < 1 then error("invalid pattern capture", 0) end
  ms.clen[l] = s - ms.cinit[l]
  local res = do_match(ms, s, p)
  if res == nil then ms.clen[l] = CAP_UNFINISHED end
  return res
end

local function match_capture(ms, s, d)
  if d < 1 or d > ms.level or ms.clen[d] == CAP_UNFINISHED then
    error("invalid capture index %" .. d, 0)
  end
  local len = ms.clen[d]
  if len < 0 then return nil end -- a position capture: (size_t)-2 never fits
  if ms.src_end - s < len then return nil end
  if len == 0 then return s end
  -- compared in pieces: a mismatch is usually found early, and no copy is larger than 4 KiB
  local S, init = ms.s, ms.cinit[d]
  for off = 0, len - 1, 4096 do
    local last = off + 4095
    if last >= len then last = len - 1 end
    charge((last - off + 1) * BYTE)
    if sub(S, init + off, init + last) ~= sub(S, s + off, s + last) then return nil end
  end
  return s + len
end

do_match = function(ms, s, p)
  if ms.depth == 0 then error("pattern too complex", 0) end
  ms.depth = ms.depth - 1
  local P, pend = ms.p, ms.p_end
  while p ~= pend do
    local pc = byte(P, p)
    if pc == 40 then -- '('
      if byte(P, p + 1) == 41 then s = start_capture(ms, s, p + 2, CAP_POSITION)
      else s = start_capture(ms, s, p + 1, CAP_UNFINISHED) end
      break
    elseif pc == 41 then -- ')'
      s = end_capture(ms, s, p + 1)
      break
    elseif pc == 36 and p + 1 == pend then -- '$' at the end
      if s ~= ms.src_end then s = nil end
      break
    end
    local nx = pc == L_ESC and byte(P, p + 1) or nil
    if nx == 98 then -- %b
      s = matchbalance(ms, s, p + 2)
      if s == nil then break end
      p = p + 4
    elseif nx == 102 then -- %f
      p = p + 2
      if byte(P, p) ~= 91 then error("missing '[' after '%f' in pattern", 0) end
      local ep = classend(ms, p)
      local prev = (s == 1) and 0 or byte(ms.s, s - 1)
      local cur = byte(ms.s, s) or 0
      if not matchbracketclass(ms, prev, p, ep - 1) and matchbracketclass(ms, cur, p, ep - 1) then
        p = ep
      else
        s = nil
        break
      end
    elseif nx and nx >= 48 and nx <= 57 then -- %0-%9
      s = match_capture(ms, s, nx - 48)
      if s == nil then break end
      p = p + 2
    else
      local ep = classend(ms, p)
      local epc = byte(P, ep)
      if not singlematch(ms, s, p, ep) then
        if epc == 42 or epc == 63 or epc == 45 then -- '*' '?' '-' accept empty
          p = ep + 1
        else
          s = nil
          break
        end
      elseif epc == 63 then -- '?'
        local res = do_match(ms, s + 1, ep + 1)
        if res then s = res; break end
        p = ep + 1
      elseif epc == 43 then s = max_expand(ms, s + 1, p, ep); break -- '+'
      elseif epc == 42 then s = max_expand(ms, s, p, ep); break     -- '*'
      elseif epc == 45 then s = min_expand(ms, s, p, ep); break     -- '-'
      else
        s = s + 1
        p = ep
      end
    end
  end
  ms.depth = ms.depth + 1
  return s
end

local function new_state(s, p, p0)
  return {s = s, src_end = #s + 1, p = p, p0 = p0, p_end = #p + 1, level = 0, cinit = {}, clen = {},
          depth = MAXCCALLS}
end

-- One capture as lstrlib's get_onecapture gives it (i 1-based; the whole match when there are
-- none and i == 1): errors are raised only for a capture actually used, as in lstrlib.
local function get_capture(ms, i, s, e)
  if i > ms.level then
    if i ~= 1 then error("invalid capture index %" .. i, 0) end
    return sub(ms.s, s, e - 1)
  end
  local l = ms.clen[i]
  if l == CAP_UNFINISHED then error("unfinished capture", 0) end
  if l == CAP_POSITION then return ms.cinit[i] end
  return sub(ms.s, ms.cinit[i], ms.cinit[i] + l - 1)
end

-- A matcher is two closures over one subject and pattern: attempt(src) -> the match's end
-- (exclusive) or nil, and caps(src, e, whole) -> get(i), n for that accepted match: get(i)
-- is capture i (1-based, as get_onecapture), n how many push_captures pushes (whole: a bare
-- match counts as one capture, as for match/gmatch/gsub; find passes false).
-- Level 2 runs each attempt natively with the anchored pattern (a second native call fetches
-- the captures of an accepted match; the guard uses level 2 only for patterns that leave no
-- capture open, as native find would raise pushing it); level 3 runs it in Lua.
local function matcher(level, s, p, p0, per_attempt)
  if level == 2 then
    local ap = "^" .. sub(p, p0)
    local function attempt(src)
      charge(per_attempt)
      local _, b = s_find(s, ap, src)
      return b and b + 1
    end
    local function caps(src, e, whole)
      charge(per_attempt)
      local r = {s_find(s, ap, src)}
      local ncap = #r - 2
      local function get(i)
        if i > ncap then
          if i ~= 1 then error("invalid capture index %" .. i, 0) end
          return sub(s, src, e - 1)
        end
        return r[i + 2]
      end
      if ncap == 0 and whole then return get, 1 end
      return get, ncap
    end
    return attempt, caps
  end
  local ms = new_state(s, p, p0)
  local function attempt(src)
    ms.level = 0
    ms.depth = MAXCCALLS
    return do_match(ms, src, p0)
  end
  local function caps(src, e, whole)
    local function get(i) return get_capture(ms, i, src, e) end
    local n = ms.level
    if n == 0 and whole then n = 1 end
    return get, n
  end
  return attempt, caps
end

-- All n captures as values (push_captures: in order, the first error wins).
local function all(get, n)
  if n == 0 then return end
  if n == 1 then return get(1) end
  local out = {}
  for i = 1, n do out[i] = get(i) end
  return unpack(out, 1, n)
end

local M = {}

-- lmemfind for a plain find whose worst case (positions x needle) is too large for one C call:
-- the first byte is found natively (memchr, linear), and each candidate checked natively with
-- the needle as an anchored literal pattern (linear, and no copy of the needle per candidate).
function M.plain_find(s, p, i0)
  local lp, ls = #p, #s
  if lp == 0 then return i0 + 1, i0 end
  if lp > ls - i0 then return nil end
  local first = sub(p, 1, 1)
  local literal = "^" .. NAT.string.gsub(p, "[%^%$%*%+%?%.%(%)%[%]%%%-]", "%%%0")
  local last = ls - lp + 1
  local i = i0 + 1
  charge((ls - i0 + lp) * BYTE)
  while i <= last do
    i = s_find(s, first, i, true)
    if i == nil or i > last then return nil end
    charge(lp * STEP)
    if s_find(s, literal, i) then return i, i + lp - 1 end
    i = i + 1
  end
  return nil
end

-- find / match (str_find_aux): i0 is the 0-based start, already checked against #s.
function M.find(level, per_attempt, s, p, i0, find)
  local anchor = byte(p, 1) == 94
  local p0 = anchor and 2 or 1
  local attempt, captures_of = matcher(level, s, p, p0, per_attempt)
  local src, send = i0 + 1, #s + 1
  while true do
    local e = attempt(src)
    if e then
      local get, n = captures_of(src, e, not find)
      if find then return src, e - 1, all(get, n) end
      return all(get, n)
    end
    if src >= send or anchor then return nil end
    src = src + 1
  end
end

-- gmatch: '^' is a literal; the iterator keeps lstrlib's src / lastmatch rules.
function M.gmatch(level, per_attempt, s, p, i0)
  local attempt, captures_of = matcher(level, s, p, 1, per_attempt)
  local src, lastmatch, send = i0 + 1, nil, #s + 1
  return function()
    local cur = src
    while cur <= send do
      local e = attempt(cur)
      if e and e ~= lastmatch then
        src, lastmatch = e, e
        return all(captures_of(cur, e, true))
      end
      cur = cur + 1
    end
    return nil
  end
end

-- A string replacement (add_s), parsed once per gsub call: a list of literal pieces and
-- capture indices (0: the whole match); an invalid '%' raises only when a match uses it.
local function parse_repl(r)
  local parts, n, i, lr = {}, 0, 1, #r
  while true do
    local j = s_find(r, "%", i, true)
    if j == nil then
      if i <= lr then n = n + 1; parts[n] = sub(r, i) end
      return parts, n
    end
    if j > i then n = n + 1; parts[n] = sub(r, i, j - 1) end
    local c = byte(r, j + 1)
    if c == L_ESC then n = n + 1; parts[n] = "%"
    elseif c and c >= 48 and c <= 57 then n = n + 1; parts[n] = c - 48
    else n = n + 1; parts[n] = false end
    i = j + 2
  end
end

function M.gsub(level, per_attempt, s, p, repl, max_n)
  local anchor = byte(p, 1) == 94
  local p0 = anchor and 2 or 1
  local attempt, captures_of = matcher(level, s, p, p0, per_attempt)
  local tr = type(repl)
  local rparts, rn
  if tr == "number" then repl = tostring(repl); tr = "string" end
  local out, no = {}, 0
  local src, send, copied, lastmatch, n, changed = 1, #s + 1, 1, nil, 0, false
  while n < max_n do
    local e = attempt(src)
    if e and e ~= lastmatch then
      n = n + 1
      local get, ncaps = captures_of(src, e, true)
      local whole = sub(s, src, e - 1)
      if copied < src then no = no + 1; out[no] = sub(s, copied, src - 1) end
      if tr == "string" then
        if rparts == nil then rparts, rn = parse_repl(repl) end
        for k = 1, rn do
          local piece = rparts[k]
          if piece == false then error("invalid use of '%' in replacement string", 0) end
          if piece == 0 then
            piece = whole
          elseif type(piece) == "number" then
            piece = get(piece)
            if type(piece) == "number" then piece = tostring(piece) end
          end
          no = no + 1
          out[no] = piece
        end
        changed = true
      else
        local v
        if tr == "function" then
          v = repl(all(get, ncaps))
        else
          v = repl[get(1)]
        end
        if not v then
          no = no + 1
          out[no] = whole
        elseif type(v) == "string" or type(v) == "number" then
          no = no + 1
          out[no] = type(v) == "number" and tostring(v) or v
          changed = true
        else
          error("invalid replacement value (a " .. type(v) .. ")", 0)
        end
      end
      charge((e - src + 16) * BYTE)
      src, lastmatch, copied = e, e, e
    elseif src < send then
      src = src + 1
    else
      break
    end
    if anchor then break end
  end
  if not changed then return s, n end
  if copied < send then no = no + 1; out[no] = sub(s, copied) end
  return concat(out, "", 1, no), n
end

return M
