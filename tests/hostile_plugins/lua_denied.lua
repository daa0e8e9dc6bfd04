-- No permissions: every attempt is denied (and must not write a log line each).
function f(e)
  for i = 1, 1000000 do pcall(kv_set, "a", "b") end
  return "tried everything"
end
