-- echo: /echo <text> -> <text>
function echo(event)
  return event.args
end
