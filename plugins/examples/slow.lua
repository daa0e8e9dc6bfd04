-- slow: /slow <ms> -> waits <ms> milliseconds through the host sleep, then "slept <ms>".
-- Stands in for a handler that calls an external API: the engine learns it is slow and
-- runs it in the worker's thread pool.
function slow(event)
  local ms = tonumber(event.args)
  if not ms or ms < 0 then
    return "usage: /slow <ms>"
  end
  sleep(ms)
  return "slept " .. event.args
end
