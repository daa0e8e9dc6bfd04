-- ping: /ping -> pong
function ping(event)
  return "pong"
end
