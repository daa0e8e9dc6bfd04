// An async guest that never settles: the job queue never empties.
async function f(e) { while (true) await null; }
