"""Wall-clock deadlines for QuickJS Contexts: a watchdog thread interrupts a guest past its deadline.

Why: the quickjs-ng binding (0.17.0.2, ``module.c``) only offers ``Context.set_time_limit``, whose
interrupt handler stops the guest when ``clock() - start >= limit``; ``clock()`` is the CPU time of
the whole process, so with other threads busy a guest was stopped early (0.51 s of a 1 s
budget). QuickJS's ``JS_SetInterruptHandler`` is exported, but a handler must be a C function:
one made with ctypes would take the GIL at every interrupt poll, and while a time limit is set
the binding installs its own handler at every entry into JS. No C compiler is assumed.

How: that handler reads ``start`` and ``limit`` from the Context's own C struct (``RuntimeData``
in module.c: ``interrupt_data``), and the binding rewrites both from the Context's time limit
every time it enters JS. So:

- each Context gets a CPU limit that cannot be reached before its wall-clock budget ends:
  ``budget x os.cpu_count()`` (a process cannot burn more CPU than that in that wall time). It
  stays as a backstop, should the watchdog ever stall;
- one daemon thread per process wakes every ``TICK`` seconds and, for each Context whose call
  is past its deadline, writes a negative ``limit`` into that struct: the guest's next interrupt
  poll (QuickJS polls every ~10,000 branches or calls, tens of microseconds) stops it with the
  uncatchable ``InternalError: interrupted``; it also zeroes the JSContext's poll counter, so
  a loop of expensive built-in calls is asked at its next iteration, not 10,000 iterations
  later. A guest is never stopped before its deadline, and at most ``TICK`` plus one GIL
  hand-off after it (passes slow down to ``IDLE_TICK`` while no call runs, so a budget
  shorter than that may end up to ``IDLE_TICK - budget`` later). One built-in call that never
  reaches a poll point still runs to its end (docs/plugins.md lists the known ones);
- "uncatchable" holds for ``try``/``catch`` in bytecode only: a built-in that calls guest code
  and turns its exception into a value (the Promise constructor with its executor, an async
  function's body, Promise combinators) catches the interrupt too, and its caller
  runs on. Nested (``new Promise(() => { for (;;) new Promise(() => { for (;;) {} }) })``), the
  interrupt lands in the innermost loop nearly every time and the guest never stopped. So a
  call still running ``ESCALATE`` after its interrupt fired gets its runtime's stack limit set
  above the stack itself (``JS_SetMaxStackSize(rt, 1)``): every call into JS, the only way a
  built-in reaches guest code again, then fails, and the interrupt unwinds the frames left one
  by one. Such a Context is spent: ``fired`` makes its call a timeout, and timeouts discard it.

Both structs are the binding's and QuickJS's private business, so they are checked once per
process before use (~5 ms): QuickJS's own accessors (``JS_GetRuntimeOpaque(rt)`` is the Context
object, ``JS_GetRuntime(ctx)`` is ``rt``), the values ``set_time_limit`` writes, how the counter
moves over a known loop, and real interrupts of running loops. If the Context's struct differs,
``available()`` is False and the JS runtime falls back to the binding's CPU-time limit; if only
the counter does, the watchdog runs without hurrying polls (each logged once, with the fix).
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import math
import os
import threading
import time
import weakref
from typing import Any

import quickjs

log = logging.getLogger("plugins.runtimes.js")

#: Seconds between two watchdog passes while a call runs: the most a guest runs past its
#: deadline (plus one GIL hand-off). The same period as the WASM epoch ticker.
TICK = 0.005
#: Seconds between passes while no call was running at the last pass (an idle worker wakes 40
#: times a second, not 200). A call is seen within this; a budget shorter than it can end up
#: to ``IDLE_TICK - budget`` late.
IDLE_TICK = 0.025
#: ``deadline`` of a Context that is not running a call.
IDLE = math.inf
#: Seconds a call may run on after its interrupt fired before its stack is clamped (module
#: docstring): two passes, so an interrupt that is simply being taken is never escalated.
ESCALATE = 2 * TICK
#: CPUs this process can use at most: CPU time grows at most this fast per wall-clock second.
CPUS = os.cpu_count() or 1
#: Written into ``interrupt_data.limit``: ``clock() - start >= FIRE`` holds at once.
_FIRE = -(1 << 62)

# module.c (quickjs-ng 0.17.0.2): typedef struct { PyObject_HEAD; JSRuntime *runtime;
# JSContext *context; int has_time_limit; clock_t time_limit; PyThreadState *thread_state;
# InterruptData {clock_t start; clock_t limit;} interrupt_data; ... } RuntimeData;
_HEAD = object.__basicsize__
_RUNTIME, _CONTEXT, _HAS_LIMIT, _TIME_LIMIT = _HEAD, _HEAD + 8, _HEAD + 16, _HEAD + 24
_START, _LIMIT = _HEAD + 40, _HEAD + 48
_CLOCKS_PER_SEC = 1_000_000  # POSIX (XSI) fixes it; checked against what set_time_limit writes
# QuickJS-NG's JSContext (this build's debug info: `gdb -batch -ex "ptype /o struct JSContext"
# _quickjs.abi3.so`): ``int interrupt_counter`` at 548, decremented at every poll point (loop
# back-edges, calls) and reset to 10,000 when it reaches 0 and the handler is asked. A loop
# whose body is one expensive built-in call (a 1 MB JSON.stringify) reaches it every few
# seconds only: the watchdog zeroes it so the very next poll asks the handler.
_CTX_INTERRUPT_COUNTER = 548
_INTERRUPT_COUNTER_INIT = 10_000


def cpu_backstop(budget: float) -> float:
    """The CPU-time limit (seconds) a Context gets for a wall-clock ``budget``: never reached first."""
    return budget * CPUS


class Slot:
    """One Context's place in the watchdog: the deadline of its current call and its interrupt word.

    The owner sets ``deadline`` before it enters JS and calls ``end()`` when the call is over;
    the watchdog writes the interrupt only while ``deadline`` is that of a call past it.
    """

    __slots__ = ("deadline", "flipping", "fired", "_limit", "_counter", "_context", "_clamped", "_key", "_owner")

    def __init__(self, ctx: Any) -> None:
        self.deadline = IDLE
        self.flipping = False
        #: time.monotonic() of the first interrupt written (0.0: none). Never reset: a Context
        #: whose call was interrupted is discarded (js.py), so its slot sees no other call.
        self.fired = 0.0
        self._context = id(ctx)  # its JSRuntime is read only if the escalation needs it (rarely)
        self._clamped = False
        # Point into the Context's C structs: written only while a call runs (deadline set),
        # and the running call holds the Context alive.
        self._limit, counter = _words(ctx)
        self._counter = counter if _hurry_polls else None
        self._key = next(_keys)
        self._owner: weakref.ref | None = None

    def end(self) -> None:
        """The call is over: no interrupt may land after this returns (the next call starts clean)."""
        self.deadline = IDLE
        # A watchdog pass that read the old deadline before the line above may still be about
        # to write: it raised ``flipping`` before reading, so wait for it to finish (Dekker-style
        # hand-shake; the GIL orders these attribute accesses, no lock on the hot path).
        while self.flipping:
            time.sleep(0)

    def _interrupt_if_due(self, now: float) -> None:
        self.flipping = True
        try:
            if self.deadline <= now:  # read after raising the flag: see end()
                self._limit.value = _FIRE
                if self._counter is not None:  # and the next poll point asks the handler
                    self._counter.value = 0
                if not self.fired:
                    self.fired = now
                elif now - self.fired >= ESCALATE and not self._clamped and _set_stack_size is not None:
                    # Still running: the interrupt was caught by a built-in (module docstring).
                    # Two plain stores into the runtime, read by the guest's thread at its next
                    # call's stack check (as the limit word above is read at its next poll).
                    _set_stack_size(ctypes.c_void_p.from_address(self._context + _RUNTIME).value, 1)
                    self._clamped = True
        finally:
            self.flipping = False


_slots: dict[int, Slot] = {}
_keys = itertools.count()
_state_lock = threading.Lock()
_watchdog_pid = 0  # the process that started the watchdog (a forked child has none)
_watchdog_running = False  # in this process: cleared in a forked child, cheaper than os.getpid() per Context
_available: bool | None = None
_hurry_polls = False  # the JSContext poll counter checked: the watchdog zeroes it
# hold(): the binding's interrupt handler (a static C function, found while installed) and the
# C API to install it; 0 when not found or not checked (hold() then does nothing).
_binding_handler = 0
_set_handler: Any = None
# JS_SetMaxStackSize, for the escalation (None until the layout checked out).
_set_stack_size: Any = None
#: (time.monotonic(), time.process_time()) at the watchdog's last pass: hold()'s CPU clock.
_cpu_reading = (0.0, 0.0)


def available() -> bool:
    """True if the binding's Context struct checked out (checked once per process, ~5 ms)."""
    global _available
    if _available is None:
        with _state_lock:
            if _available is None:
                _available = _self_check()
    return _available


def register(ctx: Any, owner: object) -> Slot | None:
    """A Slot for ``ctx`` (dropped with ``owner``), or None when wall-clock deadlines are unavailable."""
    if not available():
        return None
    if not _watchdog_running:  # first use, or a forked child (threads do not survive fork)
        _start_watchdog()
    slot = Slot(ctx)
    key = slot._key
    # An instance may be dropped without close() (a pool thread's locals): forget its slot then.
    # The weak reference lives in the slot, so its callback stays armed while the slot is known.
    def forget(_ref: weakref.ref, key: int = key) -> None:
        _slots.pop(key, None)

    slot._owner = weakref.ref(owner, forget)
    _slots[key] = slot
    return slot


def unregister(slot: Slot) -> None:
    """Forget ``slot`` (its Context is about to be freed)."""
    slot.end()
    _slots.pop(slot._key, None)


class _Tail(ctypes.Structure):
    """RuntimeData from its ``runtime`` field on (module.c; offsets checked by _layout_problem)."""

    _fields_ = [("runtime", ctypes.c_void_p), ("context", ctypes.c_void_p), ("has_time_limit", ctypes.c_int),
                ("time_limit", ctypes.c_long), ("thread_state", ctypes.c_void_p), ("start", ctypes.c_long),
                ("limit", ctypes.c_long)]


def hold(ctx: Any, cpu_limit: float) -> _Tail | None:
    """Keep ``ctx``'s interrupt handler installed across the binding's exits until release(); None if
    that is unavailable. ``ctx`` has had ``set_time_limit(cpu_limit)``.

    Why: when an exception escapes ``ctx.eval``, the binding turns it into text (the thrown
    value's toString and the like: guest code) after removing the handler, so a guest's top
    level that throws ``{toString() { for (;;) {} }}`` ran forever with the GIL held, freezing
    the process. The binding installs and removes the handler only while ``has_time_limit`` is
    set: here it is installed once by hand (the binding's own handler, CPU limit from now) and
    the flag cleared, so the conversion runs under the handler. The watchdog cannot run then
    (the GIL is held): the CPU limit ends such a loop, ``cpu_limit`` of process CPU later.
    Used for a Context's top level; calls catch guest values inside JS (js.py's prelude).
    """
    if not _binding_handler:
        return None
    tail = _Tail.from_address(id(ctx) + _RUNTIME)
    # "Now" in CPU time: the watchdog's reading (a syscall is ~0.8 us), the limit stretched by
    # the most CPU the process can have used since, so that it is never reached early.
    read_at, cpu = _cpu_reading
    now = time.monotonic()
    if now - read_at > 0.1:  # no recent pass (first use, a forked child)
        read_at, cpu = now, time.process_time()
    tail.start = int(cpu * _CLOCKS_PER_SEC)
    tail.limit = int((cpu_limit + (now - read_at) * CPUS) * _CLOCKS_PER_SEC)
    _set_handler(tail.runtime, _binding_handler, id(ctx) + _START)
    tail.has_time_limit = 0
    return tail


def release(tail: _Tail) -> None:
    """End hold(): the binding installs and removes the handler at each entry again."""
    tail.has_time_limit = 1


def _watch() -> None:
    global _cpu_reading
    # One pass every TICK while some call runs, IDLE_TICK otherwise. list() of the dict's values
    # is one C call under the GIL: slots registered meanwhile wait for the next pass.
    sleep, now = time.sleep, time.monotonic
    tick = TICK
    while True:
        sleep(tick)
        try:
            t = now()
            _cpu_reading = (t, time.process_time())
            tick = IDLE_TICK
            for slot in list(_slots.values()):
                deadline = slot.deadline
                if deadline != IDLE:
                    tick = TICK
                    if deadline <= t:
                        slot._interrupt_if_due(t)
        except Exception:  # never let the one watchdog of the process die (the CPU backstop remains)
            log.exception("JS deadline watchdog: a pass failed; continuing")
            tick = TICK


def _start_watchdog() -> None:
    global _watchdog_pid, _watchdog_running
    with _state_lock:
        if _watchdog_pid != os.getpid():
            threading.Thread(target=_watch, name="js-deadline", daemon=True).start()
            _watchdog_pid = os.getpid()
        _watchdog_running = True


def _after_fork_in_child() -> None:
    global _watchdog_running
    _watchdog_running = False


os.register_at_fork(after_in_child=_after_fork_in_child)


def _self_check() -> bool:
    """Check the binding's struct layouts and real interrupts; False (logged) if the Context's is off."""
    global _hurry_polls
    try:
        problem = _layout_problem()
    except Exception as exc:  # a missing symbol, an unexpected type
        problem = f"{type(exc).__name__}: {exc}"
    if not problem:
        _bind_stack_size()
    if problem:
        log.error("JS plugins: wall-clock deadlines are unavailable (%s); falling back to QuickJS's CPU-time "
                  "limit, which stops guests early when other threads are busy. Fix: install the binding this "
                  "was checked against: pip install quickjs-ng==0.17.0.2", problem)
        return False
    try:
        problem = _counter_problem()
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        log.warning("JS plugins: the deadline watchdog cannot hurry QuickJS's interrupt poll (%s): a loop of "
                    "expensive built-in calls may run up to 10,000 iterations past its deadline. Fix: pip install "
                    "quickjs-ng==0.17.0.2", problem)
    else:
        _hurry_polls = True
    try:
        problem = _hold_problem()
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        _forget_handler()
        log.warning("JS plugins: the interrupt handler cannot be held across the binding's exits (%s): a plugin "
                    "whose top level throws a value with a looping toString hangs the process. Fix: pip install "
                    "quickjs-ng==0.17.0.2", problem)
    return True


def _bind_stack_size() -> None:
    global _set_stack_size
    import _quickjs

    fn = ctypes.PyDLL(_quickjs.__file__).JS_SetMaxStackSize  # GIL kept: two stores
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t]
    _set_stack_size = fn


def _forget_handler() -> None:
    global _binding_handler
    _binding_handler = 0


def _hold_problem() -> str:
    """'' if hold() works: the binding's handler is found while a loop runs, and once held it stops
    a guest value's looping toString while the binding turns the escaping value into text."""
    global _binding_handler, _set_handler
    import _quickjs

    fields = {name: getattr(_Tail, name).offset + _RUNTIME for name in ("has_time_limit", "start", "limit")}
    if fields != {"has_time_limit": _HAS_LIMIT, "start": _START, "limit": _LIMIT}:
        return f"the RuntimeData view is laid out wrong ({fields})"

    api = ctypes.PyDLL(_quickjs.__file__)  # GIL kept: microsecond calls
    cmd = api.js_std_cmd  # QuickJS-NG's test hook: 5 = the runtime's interrupt handler, 6 = its opaque
    cmd.restype, cmd.argtypes = ctypes.c_size_t, [ctypes.c_int, ctypes.c_void_p]
    setter = api.JS_SetInterruptHandler
    setter.restype, setter.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    ctx = quickjs.Context()
    rt = ctypes.c_void_p.from_address(id(ctx) + _RUNTIME).value
    found: list[int] = []
    # The binding installs its handler only while JS runs: read it from another thread then.
    stop = threading.Event()
    limit = _words(ctx)[0]

    def watch() -> None:
        while not stop.wait(0.001):
            if not found and cmd(5, rt) and cmd(6, rt) == id(ctx) + _START:
                found.append(cmd(5, rt))
            if found:
                limit.value = _FIRE

    watcher = threading.Thread(target=watch, name="js-deadline-check", daemon=True)
    ctx.set_time_limit(5.0)  # the CPU backstop of this probe
    watcher.start()
    try:
        ctx.eval("for (;;) {}")
    except quickjs.JSException:
        pass
    finally:
        stop.set()
        watcher.join()
    if not found or cmd(5, rt) != 0:
        return "the binding's interrupt handler was not seen while JS ran"
    _binding_handler, _set_handler = found[0], setter
    # Held, a guest value escaping eval is turned into text under the handler: its looping
    # toString ends by the CPU limit (the GIL is held, no watchdog runs), not never.
    probe = quickjs.Context()
    probe.set_time_limit(5.0)
    held = hold(probe, 0.05)
    assert held is not None
    probe_rt = ctypes.c_void_p.from_address(id(probe) + _RUNTIME).value
    if cmd(5, probe_rt) != _binding_handler or cmd(6, probe_rt) != id(probe) + _START:
        return "the held handler is not installed"
    started = time.monotonic()
    try:
        probe.eval("throw {toString() { for (;;) {} }};")
        return "the probe's throw did not raise"
    except quickjs.JSException:
        pass
    if time.monotonic() - started > 3.0:
        return "a held handler did not stop a looping toString in time"
    if cmd(5, probe_rt) != _binding_handler:
        return "the binding removed a held handler"
    release(held)
    probe.set_time_limit(5.0)
    if probe.eval("1 + 1") != 2 or cmd(5, probe_rt) != 0:
        return "a released Context does not run normally"
    return ""


def _words(ctx: Any) -> tuple[ctypes.c_long, ctypes.c_int]:
    """The interrupt ``limit`` word of ``ctx`` and its JSContext's interrupt counter (checked offsets)."""
    jsctx = ctypes.c_void_p.from_address(id(ctx) + _CONTEXT).value or 0
    return ctypes.c_long.from_address(id(ctx) + _LIMIT), ctypes.c_int.from_address(jsctx + _CTX_INTERRUPT_COUNTER)


def _interrupts(ctx: Any, code: str, counter: bool, within: float) -> str:
    """'' if ``code`` (which never ends by itself) is stopped ``within`` seconds by the watchdog's writes."""
    ctx.set_time_limit(5.0)  # the CPU-time backstop: a check that fails ends by it
    limit, count = _words(ctx)
    stop = threading.Event()

    def fire() -> None:
        # Repeated like the watchdog's passes: a write that lands before the binding's entry
        # into JS is overwritten there.
        while not stop.wait(0.001):
            limit.value = _FIRE
            if counter:
                count.value = 0

    flipper = threading.Thread(target=fire, name="js-deadline-check", daemon=True)
    flipper.start()
    started = time.monotonic()
    try:
        ctx.eval(code)
        return "a forced interrupt did not stop a running loop"
    except quickjs.JSException as exc:
        if "interrupted" not in str(exc):
            return f"a forced interrupt raised {str(exc).splitlines()[0]!r}"
        if time.monotonic() - started >= within:
            return "a forced interrupt was not seen in time"
        return ""
    finally:
        stop.set()
        flipper.join()


def _layout_problem() -> str:
    """'' if RuntimeData is laid out as assumed and a forced interrupt stops a running loop."""
    import _quickjs

    lib = ctypes.CDLL(_quickjs.__file__)
    get_opaque, get_runtime = lib.JS_GetRuntimeOpaque, lib.JS_GetRuntime
    for fn in (get_opaque, get_runtime):
        fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    ctx = quickjs.Context()
    base = id(ctx)
    word = lambda off, t=ctypes.c_long: t.from_address(base + off).value  # noqa: E731
    rt, jsctx = word(_RUNTIME, ctypes.c_void_p), word(_CONTEXT, ctypes.c_void_p)
    if not rt or get_opaque(rt) != base or get_runtime(jsctx) != rt:
        return "the Context object does not start with its JSRuntime and JSContext pointers"
    ctx.set_time_limit(-1)
    if word(_HAS_LIMIT, ctypes.c_int) != 0:
        return "has_time_limit is not where expected"
    ctx.set_time_limit(1.5)
    if word(_HAS_LIMIT, ctypes.c_int) != 1 or word(_TIME_LIMIT) != int(1.5 * _CLOCKS_PER_SEC):
        return "time_limit is not where expected"
    ctx.eval("1")
    if word(_LIMIT) != int(1.5 * _CLOCKS_PER_SEC) or not 0 <= word(_START) <= time.process_time() * 2e6:
        return "interrupt_data is not where expected"
    return _interrupts(ctx, "for (;;) {}", counter=False, within=1.0)


def _counter_problem() -> str:
    """'' if the JSContext's interrupt counter is where assumed and zeroing it hurries the poll."""
    ctx = quickjs.Context()
    ctx.set_time_limit(-1)
    count = _words(ctx)[1]
    ctx.eval("for (let i = 0; i < 10; i++) {}")  # a fresh counter is 0: the first poll resets it
    before = count.value
    ctx.eval("for (let i = 0; i < 1000; i++) {}")  # one or two poll points per iteration
    polls = (before - count.value) % _INTERRUPT_COUNTER_INIT
    if not 0 < before <= _INTERRUPT_COUNTER_INIT or not 1000 <= polls <= 3000:
        return "the JSContext's interrupt counter is not where expected"
    # Each iteration scans 256 KiB in C: 10,000 of them (a poll without the hurry) take ~1 s.
    return _interrupts(ctx, 'const s = "x".repeat(1 << 18); for (;;) s.indexOf("y");', counter=True, within=0.25)
