// A plain busy loop.
function f(e) { while (true) {} }
