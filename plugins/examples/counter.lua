-- counter: /count -> 1, 2, 3, ... kept in the host key-value store, so it survives restarts.
-- max_concurrency 1 serializes the read-increment-write within a worker process.
function count(event)
  local n = (tonumber(kv_get("count")) or 0) + 1
  kv_set("count", n)
  return tostring(n)
end
