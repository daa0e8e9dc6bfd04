"""manage.py undrain: every drained worker takes events again."""
from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from ._control import ControlCommand, gone_lines, missing_lines


class Command(ControlCommand):
    help = "Resume every ASGI worker (or --worker ID) after `manage.py drain`. Needs REDIS_URL."
    op = "undrain"
    interrupted_note = "some workers may have resumed already: `manage.py execstatus` shows which"

    def handle(self, *args: Any, **options: Any) -> None:
        result = self.ask(options["worker"])
        if options["json"]:
            self.print_json(result)
        else:
            for wid, answer in sorted(result.answers.items()):
                state = "resumed" if answer.get("was_draining") else "was not draining"
                self.stdout.write(f"worker {wid}: {state}" if answer.get("ok") else
                                  f"worker {wid}: FAILED: {answer.get('error')}")
            for line in missing_lines(result):
                self.stdout.write(line)
            for line in gone_lines(result):
                self.stdout.write(line)
        failed = [wid for wid, a in result.answers.items() if not a.get("ok")] + result.missing + list(result.died)
        if failed:
            raise CommandError(f"not resumed: {', '.join(sorted(failed))}")
