-- Floods the log: 2,000-character lines as fast as it can, for ever (a million lines took 3 s on
-- the 2-core dev machine: 3x the 1 s budget, not enough).
function f(e)
  local s = string.rep("y", 2000)
  while true do log(s) end
end
