-- counter: /count -> 1, 2, 3, ... kept in the host key-value store, so it survives restarts.
-- kv_incr adds and stores in one atomic step of the store, so /count runs at once, on any thread
-- of any worker process, each count exactly once (a kv_get then kv_set lost counts between them).
function count(event)
  return tostring(kv_incr("count"))
end
