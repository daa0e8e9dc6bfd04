-- A benign trim: fast on short input, quadratic on a long run of spaces.
function f(e) return (e.args:match("^%s*(.-)%s*$")) end
