-- Floods the log: 2,000-character lines as fast as it can.
function f(e)
  local s = string.rep("y", 2000)
  for i = 1, 1000000 do log(s) end
  return "logged everything"
end
