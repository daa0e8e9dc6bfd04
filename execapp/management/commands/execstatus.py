"""manage.py execstatus: each worker's pool and instance-pool state (the dashboard's numbers as text)."""
from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from ._control import ControlCommand, gone_lines, missing_lines, status_lines


class Command(ControlCommand):
    help = ("Print each ASGI worker's drain state, ExecPool and plugin instance pools (--json for machines). "
            "Needs REDIS_URL (docs/operations.md).")
    op = "status"

    def handle(self, *args: Any, **options: Any) -> None:
        result = self.ask(options["worker"])
        if options["json"]:
            self.print_json(result)
        else:
            for wid in sorted(result.answers):
                for line in status_lines(result.answers[wid]):
                    self.stdout.write(line)
            for line in missing_lines(result):
                self.stdout.write(line)
            for line in gone_lines(result):
                self.stdout.write(line)
            self.stdout.write(f"{len(result.answers)} workers answered" +
                              (f", {len(result.missing)} did not" if result.missing else ""))
        if result.missing or result.died:
            raise CommandError(f"workers did not answer: {', '.join(result.missing + sorted(result.died))}")
