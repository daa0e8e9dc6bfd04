-- Fills the KV store: 64 KiB values as fast as it can.
function f(e)
  local v = string.rep("x", 65536)
  for i = 1, 100000 do kv_set("k" .. i, v) end
  return "wrote everything"
end
