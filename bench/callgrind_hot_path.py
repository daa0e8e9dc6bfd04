"""Instructions per call of the hot paths under valgrind's callgrind: repeatable where wall time is not.

On the shared 2-core machine wall-clock and even CPU-time figures move by 2-4x with the
neighbours' load; the number of instructions a call executes does not (it moves by well under
1% between runs, a few % for the JS cases, where the js-deadline watchdog thread's passes
are counted too). Each case runs in a fresh interpreter under ``valgrind --tool=callgrind``
for N and for 2N calls; the difference over N is the cost of one call, start-up excluded.
``make bench`` counts the inline dispatch cases (bench_engine's full run, when valgrind is
installed); every case takes a few minutes:

    .venv/bin/python bench/callgrind_hot_path.py [CASE ...]

Instructions are not time (a call-heavy loop runs at a higher rate than the engine's code),
so compare cases with each other, and a case before and after a change.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: case -> (setup, the statement timed, N)
CASES: dict[str, tuple[str, str, int]] = {}

_ENGINE = """
from execapp.engine import Engine, Event
def handler(ctx): return None
engine = Engine()
m = engine.on_command("ping", handler)
m.profile.restore("demoted", [0.00001] * m.profile.window)
event = Event(text="/ping")
pe = engine.process_event
engine.process_event(event)
worker = Engine()
w = worker.on_command("ping", lambda ctx: "pong")
w.profile.restore("demoted", [0.00001] * w.profile.window)
worker.set_inline_slot(bytearray(64))
sink = []
"""
CASES["direct"] = (_ENGINE, "handler(None)", 20_000)
CASES["process_event"] = (_ENGINE, "pe(event)", 10_000)
CASES["event"] = (_ENGINE, "Event(text='/ping')", 10_000)
CASES["event+process_event"] = (_ENGINE, "pe(Event(text='/ping'))", 10_000)
CASES["worker"] = (_ENGINE, "worker.process_event(Event('message', '/ping', None, None, None, 5), sink.append); "
                            "sink.clear()", 10_000)

_JS = """
import sys
sys.path.insert(0, "bench")
from bench.common import setup_django
setup_django()
from bench.bench_plugins import _spec, _examples, _js_bare, EVENT
from plugins.loaded import LoadedPlugin
code = _examples()["js"]
bare = _js_bare(code)
ours = {s: LoadedPlugin(_spec("cg-" + s, "js", code, s)) for s in ("per_request", "pooled")}
for _ in range(20):
    bare["fresh"](); bare["reused"](); bare["fresh_fields"](); bare["reused_fields"]()
    ours["per_request"].call("upper", EVENT); ours["pooled"].call("upper", EVENT)
"""
CASES["js bare fresh"] = (_JS, 'bare["fresh"]()', 100)
CASES["js bare fresh fields"] = (_JS, 'bare["fresh_fields"]()', 100)
CASES["js per_request"] = (_JS, 'ours["per_request"].call("upper", EVENT)', 100)
CASES["js bare reused"] = (_JS, 'bare["reused"]()', 2_000)
CASES["js bare reused fields"] = (_JS, 'bare["reused_fields"]()', 2_000)
CASES["js pooled"] = (_JS, 'ours["pooled"].call("upper", EVENT)', 2_000)

_LUA = """
import sys, time
sys.path.insert(0, "bench")
from bench.common import setup_django
setup_django()
from bench.bench_plugins import _spec, _examples, _lua_bare, EVENT
from plugins.loaded import LoadedPlugin
code = _examples()["lua"]
bare = _lua_bare(code)
ours = {s: LoadedPlugin(_spec("cg-" + s, "lua", code, s)) for s in ("per_request", "pooled", "sharded")}
for _ in range(20):
    bare["reused_sandboxed"](); bare["fresh_env"]()
    for s in ours.values(): s.call("echo", EVENT)
"""
CASES["lua bare sandboxed"] = (_LUA, 'bare["reused_sandboxed"]()', 2_000)
CASES["lua pooled"] = (_LUA, 'ours["pooled"].call("echo", EVENT)', 2_000)
CASES["lua sharded"] = (_LUA, 'ours["sharded"].call("echo", EVENT)', 2_000)
CASES["lua bare fresh env"] = (_LUA, 'bare["fresh_env"]()', 2_000)
CASES["lua per_request"] = (_LUA, 'ours["per_request"].call("echo", EVENT)', 2_000)

_PROGRAM = """
import gc, sys
sys.path.insert(0, {root!r})
{setup}
gc.collect()
gc.disable()
for _ in range({n}):
    {stmt}
"""


def instructions(case: str, n: int) -> int:
    """Instructions (Ir) of the whole interpreter run of ``case`` with ``n`` calls."""
    setup, stmt, _ = CASES[case]
    program = _PROGRAM.format(root=str(ROOT), setup=setup, n=n, stmt=stmt)
    # A fixed hash seed: dict probe sequences, and so the count, move with the seed (~1-2%).
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c",
                          program], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "0"}).stderr
    match = re.search(r"Collected : (\d+)", out)
    if not match:
        raise RuntimeError(f"no instruction count in valgrind's output for {case!r}: {out[-500:]}")
    return int(match.group(1))


def per_call(case: str) -> int:
    """Instructions of one call of ``case`` (the difference of 2N and N calls, over N)."""
    n = CASES[case][2]
    return (instructions(case, 2 * n) - instructions(case, n)) // n


def main(argv: list[str]) -> int:
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    unknown = [c for c in argv if c not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    for case in argv or list(CASES):
        print(f"{case:24s} {per_call(case):>12,} instructions per call", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
