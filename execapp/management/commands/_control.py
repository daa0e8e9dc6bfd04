"""Shared parts of the drain, undrain and execstatus commands: asking the workers, printing answers."""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from execapp import conf
from execapp.control_client import ControlResult, request_sync
from execapp.engine.errors import ExecAppError
from execapp.status import liveness_lines


class ControlCommand(BaseCommand):
    """A command that sends one control op to every worker (or ``--worker ID``)."""

    op = ""

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--worker", metavar="ID", help="only this worker (ids: manage.py execstatus)")
        parser.add_argument("--json", action="store_true", help="print the answers as JSON")

    def execute(self, *args: Any, **options: Any) -> Any:
        """Run the command; under --json an error is printed as JSON on stdout too (code, message)."""
        try:
            return super().execute(*args, **options)
        except CommandError as exc:
            if not options.get("json"):
                raise
            code = getattr(exc, "code", None) or "command_error"
            error = {"code": code, "message": str(exc)}
            if getattr(exc, "reason", ""):
                error["reason"] = exc.reason
            self.stdout.write(json.dumps({"op": self.op, "ok": False, "error": error}, indent=2, sort_keys=True))
            if getattr(self, "_called_from_command_line", False):
                raise SystemExit(exc.returncode) from None  # the JSON is the whole answer: no plain-text line
            raise

    #: What an interrupted command (Ctrl+C) says about the workers it asked: the op runs on them.
    interrupted_note = "nothing was changed"

    def ask(self, worker: str | None, timeout: float | None = None) -> ControlResult:
        """Send the op; operator errors (no shared layer, unknown worker) and Ctrl+C become CommandError."""
        try:
            result = request_sync(self.op, worker=worker, timeout=timeout)
        except KeyboardInterrupt:
            # A traceback said nothing of the workers' state: a drain goes on without this command.
            error = CommandError(f"interrupted: {self.interrupted_note}", returncode=130)
            error.code = "interrupted"
            raise error from None
        except ExecAppError as exc:
            error = CommandError(f"{exc.code}: {exc}")
            error.code = exc.code  # what --json reports
            error.reason = getattr(exc, "reason", "")  # control_unavailable: the short cause (Redis unreachable)
            raise error from exc
        if not result.answers and not result.missing:
            error = CommandError(
                f"no worker answered within {result.waited_seconds:.1f} s: is the server running with the same "
                f"REDIS_URL and REDIS_PREFIX as this command (this command: REDIS_PREFIX={conf.redis_prefix()!r})?")
            error.code = "no_worker_answered"
            raise error
        return result

    def print_json(self, result: ControlResult) -> None:
        self.stdout.write(json.dumps({"op": result.op, "workers": result.answers, "missing": result.missing,
                                      "gone": result.gone, "died": result.died, "silent": result.silent,
                                      "waited_seconds": result.waited_seconds}, indent=2, sort_keys=True))


def missing_lines(result: ControlResult) -> list[str]:
    """One line per expected worker that did not answer (with how long it had been silent, if it had)."""
    lines = []
    for wid in result.missing:
        line = f"worker {wid}: did not answer within {result.waited_seconds:.1f} s"
        if wid in result.silent:
            line += (f"; silent for {result.silent[wid]:g} s before it was asked (its event loop is stalled, or it "
                     "cannot reach Redis: it may still be serving; see its /healthz and log)")
        lines.append(line)
    return lines


def gone_lines(result: ControlResult) -> list[str]:
    """One line per registered worker whose process no longer exists (not asked, not a failure)."""
    return [f"worker {wid}: gone (its process {pid} no longer exists: killed or crashed; the supervisor "
            "starts another)" for wid, pid in sorted(result.gone.items())] + [
        f"worker {wid}: died while it was asked (its process {pid} is gone: killed or crashed; its clients' events "
        "in flight got no done)" for wid, pid in sorted(result.died.items())]


def drain_line(answer: dict[str, Any]) -> str:
    """One line about one worker's drain."""
    wid = answer.get("worker", "?")
    if answer.get("error"):
        return f"worker {wid}: FAILED: {answer['error']}"
    finished = answer.get("finished", {})
    done = f"finished {finished.get('events', 0)} events and {finished.get('tasks', 0)} pooled tasks"
    if answer.get("ok"):
        line = f"worker {wid}: drained in {answer.get('elapsed_seconds', 0):.2f} s, {done}"
    else:
        running = counted(answer.get("still_running") or [])
        line = (f"worker {wid}: NOT drained ({answer.get('reason') or 'unknown'}) after "
                f"{answer.get('elapsed_seconds', 0):.2f} s, {done}; still running: {running}; "
                f"{answer.get('events_in_flight', 0)} events without done, {answer.get('tasks_queued', 0)} "
                "handlers queued")
    if answer.get("dones_unread"):
        line += (f"; {answer['dones_unread']} done frames wait, queued, for clients that read nothing (their "
                 "handlers are over)")
    if answer.get("flush_errors"):
        line += f"; profile flush failed: {'; '.join(answer['flush_errors'])}"
    return line


def counted(names: list[str]) -> str:
    """Names with their counts, most first: "slow.slow x3, ping.ping" ("-" for none)."""
    counts = Counter(names)
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in
                     sorted(counts.items(), key=lambda item: (-item[1], item[0]))) or "-"


def ms(seconds: Any) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _state(answer: dict[str, Any]) -> str:
    """serving, DRAINING (an operator's drain: `undrain` resumes it) or STOPPING (shutting down: it exits)."""
    if answer.get("stopping"):
        return "STOPPING"
    return "DRAINING" if answer.get("draining") else "serving"


def status_lines(answer: dict[str, Any]) -> list[str]:
    """A few lines about one worker: identity, pool, engine counters, instance pools."""
    pool = answer.get("pool") or {}
    lines = [
        f"worker {answer.get('worker')}  pid {answer.get('pid')}  up {answer.get('uptime_seconds', 0):.0f} s  "
        f"{_state(answer)}  events in flight {answer.get('events_in_flight', 0)}"
        f" (finished {answer.get('events_finished', 0)})",
        *liveness_lines(answer),
        f"  pool: running {pool.get('in_flight', 0)}/{pool.get('capacity', 0)}, queued {pool.get('queued', 0)}/"
        f"{pool.get('queue_capacity', 0)}, saturation {100 * (pool.get('saturation') or 0):.1f}%, threads "
        f"{pool.get('workers', 0)} (idle {pool.get('idle_workers', 0)}), submitted {pool.get('submitted', 0)}, "
        f"completed {pool.get('completed', 0)}, failed {pool.get('failed', 0)}, rejected {pool.get('rejected', 0)}, "
        f"delay p50 {ms(pool.get('delay_p50'))} p99 {ms(pool.get('delay_p99'))}"
        f"{', CLOSED' if pool.get('closed') else ''}",
        f"  engine: events {answer.get('events', 0)}, inline {answer.get('inline', 0)}, pooled "
        f"{answer.get('pooled', 0)}, fallbacks {answer.get('fallbacks', 0)}, overloaded "
        f"{answer.get('overloaded', 0)}, errors {answer.get('errors', 0)}",
    ]
    pools = answer.get("instance_pools")
    rows = pools if isinstance(pools, list) else [{"plugin": k, **v} for k, v in pools.items()
                                                  if isinstance(v, dict)] if isinstance(pools, dict) else []
    for row in sorted(rows, key=lambda r: str(r.get("plugin"))):
        lines.append(
            f"  instance pool {row.get('plugin')} ({row.get('runtime', '?')}, {row.get('strategy', '?')}): "
            f"busy {row.get('busy', 0)}/{row.get('capacity', '?')}, idle {row.get('idle', 0)}, waiting "
            f"{row.get('waiting', 0)}, calls {row.get('calls_total', 0)}, waits {row.get('waits_total', 0)}, "
            f"timeouts {row.get('timeouts_total', 0)}, errors {row.get('errors_total', 0)}")
    if not rows:
        lines.append("  instance pools: none" if not pools else f"  instance pools: {json.dumps(pools)}")
    return lines
