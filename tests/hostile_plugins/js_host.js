// Queues 8,000 host calls at once, then awaits them all.
async function f(e) {
  const pending = [];
  for (let i = 0; i < 8000; i++) pending.push(kv_set("k" + i, "v"));
  await Promise.all(pending);
  return "wrote everything";
}
