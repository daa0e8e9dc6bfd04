"""manage.py drain: every worker stops taking events, finishes what it accepted and reports."""
from __future__ import annotations

import math
from typing import Any

from django.core.management.base import CommandError, CommandParser

from execapp import conf

from ._control import ControlCommand, counted, drain_line, gone_lines, missing_lines


class Command(ControlCommand):
    help = ("Drain every ASGI worker (or --worker ID): refuse new events with `draining`, finish every running "
            "and queued handler, flush profiles. One line per worker; exits 1 naming any worker that did not "
            "finish in time. `manage.py undrain` resumes. Needs REDIS_URL (docs/operations.md).")
    op = "drain"
    interrupted_note = ("the workers asked go on draining without this command (they refuse new events); "
                        "`manage.py execstatus` shows them, `manage.py undrain` resumes them")

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                            help="how long each worker may take (EXECAPP['DRAIN_TIMEOUT_SECONDS'], default 25)")

    def handle(self, *args: Any, **options: Any) -> None:
        timeout = options["timeout"] if options["timeout"] is not None else float(conf.get("DRAIN_TIMEOUT_SECONDS"))
        # nan passed `< 0` and reached the workers (a drain of 0 s reported as "within nan s");
        # inf left this command waiting forever on a worker that cannot finish.
        if not 0 <= timeout < math.inf:
            raise CommandError(f"--timeout {timeout}: use a finite number of seconds >= 0 (e.g. 60)")
        result = self.ask(options["worker"], timeout)
        if options["json"]:
            self.print_json(result)
        else:
            for wid in sorted(result.answers):
                self.stdout.write(drain_line(result.answers[wid]))
            for line in missing_lines(result):
                self.stdout.write(line)
            for line in gone_lines(result):
                self.stdout.write(line)
        failed = [f"{wid} (still running: {counted(a.get('still_running') or [])}; "
                  f"{a.get('events_in_flight', 0)} events without done)"
                  for wid, a in sorted(result.answers.items()) if not a.get("ok")]
        failed += [f"{wid} (did not answer)" for wid in result.missing]
        failed += [f"{wid} (died during the drain)" for wid in sorted(result.died)]
        if failed:
            asked = len(result.answers) + len(result.missing) + len(result.died)
            raise CommandError(f"{len(failed)} of {asked} workers did not drain within {timeout:g} s: "
                               f"{', '.join(failed)}")
