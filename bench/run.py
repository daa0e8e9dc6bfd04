"""Run every benchmark module in bench/ and print one table (``make bench``).

Module contract (how to add a benchmark):

- A module is ``bench/bench_<name>.py``. run.py imports it with the repo root on sys.path and
  calls ``run(quick: bool) -> list[dict]``. ``quick`` asks for a short run (fewer repetitions,
  smaller windows): the whole ``--quick`` suite should stay well under a minute.
- Each row is a dict with these keys (``bench.common.row`` builds one):
    bench     which benchmark the row belongs to (e.g. "pool hand-off")
    case      what was measured (e.g. "ExecPool round trip")
    value     the median over the module's repetitions (float; None if not measured)
    unit      unit of ``value`` ("us", "ms", "events/s", ...)
    baseline  what ``ratio`` compares against, measured in the same run (str; "" if none)
    ratio     value / baseline value (float or None): quote ratios, not absolute numbers,
              because the machine is shared and noisy
    target    the acceptance target in words (str; "" if none), e.g. "<= 5 us", "<= 1.0x"
    ok        True/False when the row has a target, else None
- A module needing Django calls ``bench.common.setup_django()`` inside ``run``. Progress or
  detail may go to stderr; stdout belongs to the table.
- A module that raises is reported as one failed row; the others still run.

Usage: ``python bench/run.py [--quick] [--only NAME ...] [--markdown PATH]``. ``--only``
selects modules whose name contains NAME ("engine" -> bench_engine.py). ``--markdown`` also
writes the table as markdown (for docs/benchmarks.md). Missed targets are listed at the end;
the exit status is 1 only if a module failed to run.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

from bench.common import fmt, machine, row  # noqa: E402

COLUMNS = ("bench", "case", "value", "unit", "baseline", "ratio", "target", "ok")


#: bench_*.py modules that are not benchmarks: the ASGI application bench_ws serves (importing it
#: sets up Django in the runner's process).
NOT_BENCHES = frozenset({"bench_app"})


def discover(only: list[str] | None) -> list[str]:
    """Module names bench_*.py, filtered by --only."""
    names = sorted(p.stem for p in HERE.glob("bench_*.py") if p.stem not in NOT_BENCHES)
    if only:
        names = [n for n in names if any(o in n for o in only)]
    return names


def cells(r: dict[str, Any]) -> list[str]:
    """One row as table cells."""
    ok = {True: "yes", False: "NO", None: ""}[r.get("ok")]
    ratio = "" if r.get("ratio") is None else f"{fmt(r['ratio'])}x"
    return [str(r.get("bench", "")), str(r.get("case", "")), fmt(r.get("value")), str(r.get("unit", "")),
            str(r.get("baseline", "")), ratio, str(r.get("target", "")), ok]


def text_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table for the terminal."""
    table = [list(COLUMNS)] + [cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = []
    for n, line in enumerate(table):
        lines.append("  ".join(c.rjust(w) if i in (2, 5) else c.ljust(w)
                               for i, (c, w) in enumerate(zip(line, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The same table as markdown."""
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells(r)) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run: fewer repetitions, smaller windows")
    parser.add_argument("--only", action="append", metavar="NAME", help="only modules whose name contains NAME")
    parser.add_argument("--markdown", metavar="PATH", help="also write the table as markdown to PATH")
    args = parser.parse_args(argv)
    names = discover(args.only)
    if not names:
        print(f"no bench module matches {args.only}", file=sys.stderr)
        return 2
    m = machine()
    print(f"machine: {m['nproc']} CPUs, {m['cpu']}, {m['implementation']} {m['python']}, {m['system']}"
          f"{' (quick)' if args.quick else ''}", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for name in names:
        started = time.monotonic()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            module = importlib.import_module(f"bench.{name}")
            got = module.run(args.quick)
            rows.extend(got or [])
        except Exception as exc:  # one broken module must not hide the others' numbers
            traceback.print_exc()
            rows.append(row(name, "module failed", None, "", target="runs", ok=False,
                            baseline=f"{type(exc).__name__}: {exc}"[:80]))
        print(f"  {name}: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    print(text_table(rows))
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(rows) + "\n")
        print(f"markdown table written to {args.markdown}", file=sys.stderr)
    missed = [r for r in rows if r.get("ok") is False]
    for r in missed:
        print(f"target missed: {r['bench']} / {r['case']}: {fmt(r.get('value'))} {r.get('unit', '')} "
              f"(target {r.get('target')})", file=sys.stderr)
    return 1 if any(r.get("case") == "module failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
