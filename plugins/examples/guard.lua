-- guard: any message containing the word "forbidden" -> "blocked". Bound with the highest
-- priority and block=true, so no other handler runs for such a message.
function guard(event)
  return "blocked"
end
