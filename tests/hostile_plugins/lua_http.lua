-- GETs the URL in its arguments (an allowlisted host that may trickle its body).
function f(e) return http_get(e.args) end
