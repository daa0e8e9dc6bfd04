"""Deadline interrupts for the Lua sandbox: once a call's deadline has passed, its count hook fires
at the next VM instruction, whatever the guest is doing.

The count hook runs every ``HOOK_COUNT`` instructions, and some single instructions cost O(n):
``s .. "x"`` copies a 30 MB string, ``s1 < s2`` compares two, a vararg call copies up to a
million values, ``next`` scans a sparse table. A loop of them runs for seconds (a minute with
a 128 MB cap) between two hooks, and no library guard sees them. So a watchdog thread checks
every ``POLL_SECONDS`` (``IDLE_POLL_SECONDS`` when no call was running) which Lua calls are
past their deadline and sets the running state's
``hookcount`` to 1: Lua 5.5 decrements it at every instruction of a hooked state and calls
the hook when it reaches 0, and the hook raises the timeout. The run ends within one
instruction (or one guarded C call) of the next poll after its deadline.

How: lupa releases the GIL while Lua runs, and exports the Lua C API. The address of a
``lua_State`` is what ``tostring(coroutine.running())`` prints; the offset of ``hookcount`` in
it is found once per process next to ``basehookcount`` (the hook count we set) and
``hookmask`` (LUA_MASKCOUNT), and checked against the exported ``lua_gethookcount`` /
``lua_gethookmask``; each new state is checked again before it is used. If anything does not
match, interrupts are off (logged once) and the hook and the guards remain. Lua documents
``lua_sethook`` as safe to call asynchronously; we write only the counter (one aligned int,
no walk over the call stack, which another thread may be changing): a write racing the
interpreter's own decrement may be lost, and the next poll writes again.

Safety: a state is only written while it is alive. A VM's main state lives as long as its
runtime, and the VM calls ``Interrupts.forget()`` (under the lock the watchdog writes with)
before its runtime can be freed (``close`` and ``__del__``). A coroutine is written only while
registered for the current call, and the sandbox keeps every registered coroutine referenced
until the next call starts, after the VM has unregistered it (``end_call``).

Weak tables and ``__call`` off (``retire_events``; for ``__call`` see there): Lua's collector
converges ephemeron tables (``__mode`` with ``k``) in passes over all of them, one link of a chain
per pass in the worst case, inside one uninterruptible GC step: 40,000 single-entry ephemeron
tables chained back and forth (3 MB) stall a 16 MB sandbox for 5 s, quadratically more with a
larger cap. The collector reads a table's mode from its metatable under the event name
``g->tmname[TM_MODE]``, not from the string ``"__mode"``, so each sandbox runtime gets that name
replaced by a random one no guest can write: ``__mode`` is then an ordinary field, whenever it is
set (and ``__call`` the same way). The name array is found before the main state (Lua 5.5's
``global_State`` ends with its main thread, ``mainth``; ``tmname`` is 1,144 bytes before it on
64-bit) as the 25 interned event names in order, each address checked; if they are not found
nothing is written (logged once). Every scan stays inside the ``global_State`` or the
``lua_State`` it reads (Lua 5.5's lstate.h).
"""
from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
import time
import weakref

import lupa.lua55 as lupa

log = logging.getLogger("plugins.lua")

#: How often the watchdog looks for Lua calls past their deadline while one runs (the latency
#: it adds to a timeout), and when none was running at its last pass (a call shorter than this
#: that overruns is seen at most this late).
POLL_SECONDS = 0.005
IDLE_POLL_SECONDS = 0.025
LUA_MASKCOUNT = 8
#: Bytes of a lua_State searched for the hook fields: sizeof(lua_State) in 64-bit Lua 5.5 (they sit
#: at 188-200), and no further: a coroutine's lua_State ends its allocation.
_SCAN_BYTES = 208

_lib = ctypes.CDLL(lupa.__file__)  # the extension module itself: lupa links Lua statically
_lib.lua_gethookcount.argtypes = [ctypes.c_void_p]
_lib.lua_gethookcount.restype = ctypes.c_int
_lib.lua_gethookmask.argtypes = [ctypes.c_void_p]
_lib.lua_gethookmask.restype = ctypes.c_int
_lib.lua_pushlstring.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
_lib.lua_pushlstring.restype = ctypes.c_void_p
_lib.lua_gettop.argtypes = [ctypes.c_void_p]
_lib.lua_gettop.restype = ctypes.c_int
_lib.lua_settop.argtypes = [ctypes.c_void_p, ctypes.c_int]
_lib.lua_settop.restype = None

_offset: int | None = None  # of hookcount in lua_State; None: not found yet
_disabled = False
_layout_lock = threading.Lock()


def thread_address(text: str) -> int:
    """The lua_State address in ``tostring(coroutine)`` ("thread: 0x55d4...")."""
    return int(text.rsplit(" ", 1)[-1], 16)


def _ints(address: int, size: int) -> tuple[int, ...]:
    return struct.unpack(f"{size // 4}i", ctypes.string_at(address, size))


def counter_address(state: int, count: int) -> int | None:
    """Where ``hookcount`` of the idle lua_State at ``state`` is, given its count hook of
    ``count`` instructions; None if the layout cannot be confirmed (interrupts then stay off)."""
    global _offset
    if _disabled or state == 0:
        return None
    with _layout_lock:
        if _offset is None:
            if _lib.lua_gethookcount(state) != count or _lib.lua_gethookmask(state) != LUA_MASKCOUNT:
                _disable("the exported hook getters do not report the sandbox's hook")
                return None
            words = _ints(state, _SCAN_BYTES)
            # basehookcount == count, then hookcount (count minus what ran since), then hookmask
            found = [i for i in range(2, len(words) - 2)
                     if words[i] == count and 0 < words[i + 1] <= count and words[i + 2] == LUA_MASKCOUNT]
            if len(found) != 1:
                _disable(f"{len(found)} candidate places for the hook counter")
                return None
            _offset = (found[0] + 1) * 4
        base, current, mask = _ints(state + _offset - 4, 12)
    if base != count or not 0 < current <= count or mask != LUA_MASKCOUNT:
        _disable("a new state does not have the layout found before")
        return None
    return state + _offset


def _disable(why: str) -> None:
    global _disabled
    if not _disabled:
        _disabled = True
        log.warning("Lua deadline interrupts are off (%s): timeouts rely on the count hook and the library "
                    "guards, and an expensive instruction in a loop (a long string concatenation) can overrun", why)


#: Lua 5.5's metamethod event names in TMS order (ltm.h); TM_MODE is the fourth, TM_CALL the 24th.
_EVENTS = tuple(b"__index __newindex __gc __mode __len __eq __add __sub __mul __mod __pow __div __idiv __band __bor "
                b"__bxor __shl __shr __unm __bnot __lt __le __concat __call __close".split())
_TM_MODE = 3
_TM_CALL = 23
#: Bytes before the main lua_State searched for tmname: it starts 1,144 bytes before it, and the
#: global_State holding both starts 1,416 bytes before it (64-bit Lua 5.5), so the scan stays inside.
_TMNAME_SCAN = 1280
_weak_warned = False
#: The names the VM reads a table's weak mode and its ``__call`` under in sandbox runtimes: random
#: per process (39 bytes, so short, interned strings). The sandbox holds them (alive, and interned
#: before we look them up, so the lookup allocates nothing: a failed allocation outside lupa's
#: protected calls would abort the process).
MODE_NAME = "__execapp_mode_" + os.urandom(12).hex()
CALL_NAME = "__execapp_call_" + os.urandom(12).hex()


def retire_events(main_text: str) -> bool:
    """Make ``__mode`` and ``__call`` ordinary fields in the runtime whose idle main state is
    ``main_text`` ("thread: 0x..."), which holds the strings MODE_NAME and CALL_NAME, before any
    guest code runs in it; False (logged once) if the layout is not confirmed and nothing was written.

    ``__call``: Lua 5.4 followed a chain of callable tables (``mt.__call = t`` on t's own metatable,
    or any non-function ``__call``) inside one call instruction, shifting the arguments once per
    link until the stack overflowed: quadratic, minutes in one step no hook or watchdog reaches.
    Lua 5.5 bounds the chain ("'__call' chain too long"); it stays off as defence in depth.
    The sandbox calls Python objects (lupa's ``POBJECT`` metatable) under CALL_NAME instead."""
    global _weak_warned, _tmname_at
    state = thread_address(main_text)
    found = _tmname_at
    if found is not None:  # the place found before: confirm two of its names in this state
        i, header = found
        if _word(state, i + _TM_MODE) != _name(state, b"__mode") - header or \
                _word(state, i + len(_EVENTS) - 1) != _name(state, _EVENTS[-1]) - header:
            found = None
    if found is None:
        found = _find_tmname(state)
    if found is None:
        if not _weak_warned:
            _weak_warned = True
            log.warning("Lua weak tables and __call stay on (the metamethod names were not found next to the main "
                        "state): a __mode or __call set after setmetatable can run for minutes in one step")
        return False
    _tmname_at = i, header = found
    for event, name in ((_TM_MODE, MODE_NAME), (_TM_CALL, CALL_NAME)):
        ctypes.c_void_p.from_address(state + (i + event) * 8).value = _name(state, name.encode()) - header
    return True


_tmname_at: tuple[int, int] | None = None  # (word index from the main state, negative; TString header size)


def _word(state: int, i: int) -> int:
    return ctypes.c_uint64.from_address(state + i * 8).value


def _name(state: int, name: bytes) -> int:
    """The address of the characters of the interned string ``name``, which must exist already
    (event names are fixed, MODE_NAME and CALL_NAME are held by the sandbox): the address stays valid once popped."""
    top = _lib.lua_gettop(state)
    address = _lib.lua_pushlstring(state, name, len(name))
    _lib.lua_settop(state, top)
    return address


def _find_tmname(state: int) -> tuple[int, int] | None:
    names = [_name(state, name) for name in _EVENTS]
    words = struct.unpack(f"{_TMNAME_SCAN // 8}Q", ctypes.string_at(state - _TMNAME_SCAN, _TMNAME_SCAN))
    for header in (24, 16, 32):  # offsetof(TString, contents): 24 on 64-bit Lua 5.5
        want = [p - header for p in names]
        for i in range(len(words) - len(want) + 1):
            if words[i] == want[0] and list(words[i:i + len(want)]) == want:
                return i - len(words), header
    return None


def poke(address: int) -> None:
    """Make the count hook of the state whose counter is at ``address`` fire at its next instruction."""
    ctypes.c_int.from_address(address).value = 1


class Interrupts:
    """The hook counters of one VM's states the watchdog may write, and its call's deadline.

    ``running`` is the deadline of the call in progress (None between calls; the VM sets it on
    the hot path). ``counters`` holds the main state's counter and, during a call, those of
    the coroutines the guest resumed (``register``, called from the sandbox, which keeps them
    referenced until the next call starts). Separate from the VM so that the Lua runtime holds
    no reference back to it.
    """

    __slots__ = ("counters", "coroutines", "running", "count", "_lock", "__weakref__")

    def __init__(self) -> None:
        self.counters: list[int] = []
        self.coroutines = False  # counters beyond the main state's, dropped at the call's end
        self.running: float | None = None
        self.count = 0
        self._lock = threading.Lock()

    def attach(self, main_text: str, count: int) -> None:
        """Once the sandbox is built: its main state ("thread: 0x...") with a count hook of
        ``count``; watched from now on, unless the layout could not be confirmed."""
        self.count = count
        address = counter_address(thread_address(main_text), count)
        if address is not None:
            self.counters = [address]
            watchdog.watch(self)

    def register(self, text: str | None) -> None:
        """Called from the sandbox when the guest first resumes a coroutine in this call; with
        None, to drop every coroutine registered so far (the sandbox then lets them go)."""
        if text is None:
            self.end_call()
            return
        if not self.counters:
            return
        address = counter_address(thread_address(text), self.count)
        if address is not None:
            with self._lock:
                self.counters.append(address)
                self.coroutines = True

    def end_call(self) -> None:
        """After a call that resumed coroutines: stop writing theirs (the sandbox lets them go next)."""
        with self._lock:
            del self.counters[1:]
            self.coroutines = False

    def interrupt(self) -> int:
        """Write every counter (the watchdog, for a call past its deadline); how many."""
        with self._lock:
            for address in self.counters:
                poke(address)
            return len(self.counters)

    def forget(self) -> None:
        """Before the VM's runtime is freed: never write its states again."""
        with self._lock:
            self.counters = []
            self.coroutines = False


class Watchdog:
    """The process's watchdog thread over every live VM's Interrupts (started with the first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[weakref.ref] = []
        self._thread: threading.Thread | None = None
        self.interrupts_total = 0  # counters written (a run may need more than one poll)

    def watch(self, irq: Interrupts) -> None:
        with self._lock:
            self._watched.append(weakref.ref(irq))
            self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lua-deadline-watchdog", daemon=True)
            self._thread.start()

    def after_fork(self) -> None:
        """In a forked child: the parent's thread is not there; start ours for the VMs we inherited."""
        self._lock = threading.Lock()
        self._thread = None
        if self._watched:
            self._start()

    def _run(self) -> None:
        pause = IDLE_POLL_SECONDS
        while True:
            time.sleep(pause)
            with self._lock:
                refs = list(self._watched)
            now = time.monotonic()
            dead = 0
            pause = IDLE_POLL_SECONDS
            for ref in refs:
                irq = ref()
                if irq is None:
                    dead += 1
                    continue
                deadline = irq.running
                if deadline is not None:
                    pause = POLL_SECONDS
                    if now > deadline:
                        self.interrupts_total += irq.interrupt()
            if dead:
                with self._lock:
                    self._watched = [r for r in self._watched if r() is not None]


watchdog = Watchdog()
os.register_at_fork(after_in_child=watchdog.after_fork)
