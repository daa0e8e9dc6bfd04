"""Python test handlers mirroring the bundled plugins' commands (/ping, /slow N, /echo), plus failure
cases; registered on a Worker's engine by unit tests, and inside e2e servers via e2e_settings."""
from __future__ import annotations

import os
import threading
import time
from typing import Any

from execapp.engine import Engine, HandlerTimeout

#: Set while a /slow handler of this process is sleeping (unit tests look at it).
slow_running = threading.Event()
#: Set by unit-test teardown to cut every sleeping /slow short (never set in e2e servers).
slow_release = threading.Event()


def ping(ctx: Any) -> str:
    return "pong"


def slow(ctx: Any) -> str:
    ms = int(ctx.args or "100")
    slow_running.set()
    try:
        slow_release.wait(ms / 1000)
    finally:
        slow_running.clear()
    return f"slept {ms}"


def echo(ctx: Any) -> str:
    return ctx.args


def multi(ctx: Any) -> None:
    for i in range(int(ctx.args or "3")):
        ctx.reply(f"part {i}", {"i": i})


def boom(ctx: Any) -> None:
    raise RuntimeError("boom: the handler failed on purpose")


def late(ctx: Any) -> None:
    raise HandlerTimeout("handler ran past its 10 ms budget (test)")


def stall(ctx: Any) -> str:
    """/stall [seconds | gil]: answers at once with its process id; with seconds, first blocks in C
    (time.sleep holds the thread that runs it: the event loop itself once it runs inline), which
    no deadline can interrupt: the watchdog's case (tests/execapp/test_watchdog.py)."""
    if ctx.args == "gil":  # blocks in C with the GIL held: no other thread of the worker runs either
        import re

        re.match(r"(a+)+$", "a" * 40 + "!")  # catastrophic backtracking: 2**40 steps in one C call
    seconds = float(ctx.args or 0) if ctx.args != "gil" else 0.0
    if seconds > 0:
        time.sleep(seconds)
    return f"pid {os.getpid()}"


def wedge(ctx: Any) -> str:
    """/wedge [seconds]: registered with a 0.2 s timeout, ignores it (blocks in C for 30 s by
    default): its pool thread stays stuck past the deadline (tests/execapp/test_watchdog.py)."""
    time.sleep(float(ctx.args or 30))
    return "unwedged"


def gc_state(ctx: Any) -> dict:
    """/gcstate: how many objects this process moved out of the cyclic GC's reach (gc.freeze), and
    the GC's thresholds."""
    import gc

    return {"frozen": gc.get_freeze_count(), "threshold": list(gc.get_threshold())}


#: The engine-level timeout of /wedge (seconds): its pooled runs are reported `timeout` then.
WEDGE_TIMEOUT = 0.2


def register(engine: Engine) -> None:
    """Register the test commands on ``engine``."""
    for name, handler in (("ping", ping), ("slow", slow), ("echo", echo), ("multi", multi), ("boom", boom),
                          ("late", late)):
        engine.add(engine.make_matcher("command", name, handler, plugin="test"))
    engine.add(engine.make_matcher("command", "stall", stall, plugin="test"))
    engine.add(engine.make_matcher("command", "gcstate", gc_state, plugin="test"))
    engine.add(engine.make_matcher("command", "wedge", wedge, plugin="test", timeout=WEDGE_TIMEOUT))
    engine.add(engine.make_matcher("event", "tick", lambda ctx: {"seen": ctx.event.data}, plugin="test"))

class _Installed:
    """A do-nothing service: its factory's side effect (registering handlers) is the point."""

    interval = 3600.0

    def __init__(self) -> None:
        self.ticks = 0
        if os.environ.get(HANG_HOUSEKEEPER):
            self.interval = 0.5

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks > 6 and os.environ.get(HANG_HOUSEKEEPER):  # ~3 s on: once the worker serves
            time.sleep(3600)

    def close(self) -> None:
        how = os.environ.get(HANG_AT_STOP)
        if how == "close":  # a service whose close never returns: the loop awaits it, beating
            time.sleep(3600)


#: e2e servers started with this variable set die in every worker process's first service ticks
#: (a plugin whose top level crashes its process at every load: a restart storm, test_lifecycle.py).
CRASH_AT_START = "EXECAPP_TEST_CRASH_AT_START"
#: ... or hang while their Worker is built (a service factory that never returns).
HANG_AT_START = "EXECAPP_TEST_HANG_AT_START"
#: ... or, set to "close", never finish stopping once SIGTERMed: a service's close that never
#: returns (the worker's loop awaits it, beating, its slot `draining`).
HANG_AT_STOP = "EXECAPP_TEST_HANG_AT_STOP"
#: ... or whose housekeeping thread hangs in this service's tick about 3 s after the start (listening by then).
HANG_HOUSEKEEPER = "EXECAPP_TEST_HANG_HOUSEKEEPER"


def install(worker: Any) -> _Installed:
    """Service factory used by e2e_settings: registers the test commands when the worker starts."""
    if os.environ.get(CRASH_AT_START):
        os._exit(17)
    if os.environ.get(HANG_AT_START):
        time.sleep(3600)
    register(worker.engine)
    return _Installed()
