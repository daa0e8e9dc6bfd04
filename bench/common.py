"""Helpers shared by the bench modules: rows, medians, repetition, machine facts, Django set-up."""
from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def row(bench: str, case: str, value: float | None, unit: str, *, baseline: str = "", ratio: float | None = None,
        target: str = "", ok: bool | None = None) -> dict[str, Any]:
    """One line of the table (see bench/run.py for what each key means)."""
    return {"bench": bench, "case": case, "value": value, "unit": unit, "baseline": baseline, "ratio": ratio,
            "target": target, "ok": ok}


def median(values: Iterable[float]) -> float:
    """The median of ``values`` (benchmarks quote medians: the machine is shared and noisy)."""
    return statistics.median(list(values))


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1) of unsorted ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def per_call_us(fn: Callable[[], Any], n: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Microseconds per call of ``fn`` over ``n`` back-to-back calls, with the GC paused (as timeit does);
    ``clock=time.thread_time`` counts this thread's CPU instead of the wall clock."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = clock()
        for _ in range(n):
            fn()
        return (clock() - start) / n * 1e6
    finally:
        if enabled:
            gc.enable()


def cpu_per_call_us(fn: Callable[[], Any], n: int) -> float:
    """Microseconds of this thread's CPU per call of ``fn`` (GC paused, as timeit does).

    CPU time, not wall time: on the shared 2-core machine the wall clock also counts the time
    this thread waits for a core while the neighbours run, which is noise here."""
    return per_call_us(fn, n, time.thread_time)


def interleaved(cases: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    """Run each case ``reps`` times, alternating between cases (so drift in machine load hits
    every case alike), and return each case's median."""
    results: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            results[name].append(fn())
    return {name: median(values) for name, values in results.items()}


def fmt(value: float | None, digits: int = 3) -> str:
    """A number for the table: 3 significant digits, or '-' for None."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": str(os.cpu_count()), "cpu": model, "python": platform.python_version(),
            "implementation": platform.python_implementation(), "system": f"{platform.system()} {platform.release()}"}


def setup_django() -> None:
    """Configure Django (config.settings) for a bench module that needs the ORM or Channels."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
