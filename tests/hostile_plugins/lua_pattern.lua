-- A backtracking pattern: polynomial (n^5) steps inside one C call.
function f(e) return string.find(string.rep("a", 3000), ".-.-.-.-b") end
