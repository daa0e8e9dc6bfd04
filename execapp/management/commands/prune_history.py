"""`manage.py prune_history`: delete failed events' traces older than the retention (HISTORY_FAILURE_DAYS)."""
from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from execapp import conf, history
from execapp.db_command import DatabaseCommand
from execapp.models import EventTrace


class Command(DatabaseCommand):
    help = ("Delete the database's event traces (failed events) older than EXECAPP['HISTORY_FAILURE_DAYS'] "
            "(default 7) or --days, and each owner's past its newest EXECAPP['HISTORY_FAILURES_PER_OWNER'] "
            "(default 100000). Workers also prune hourly; the recent store trims itself.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--days", type=float, default=None,
                            help="keep this many days instead of EXECAPP['HISTORY_FAILURE_DAYS']")
        parser.add_argument("--dry-run", action="store_true", help="only count what would be deleted")

    def handle(self, *args: Any, days: float | None = None, dry_run: bool = False, **options: Any) -> None:
        days = float(conf.get("HISTORY_FAILURE_DAYS")) if days is None else days
        if not days >= 0:
            raise CommandError(f"--days {days}: use a number of days >= 0 (inf keeps every trace)")
        cutoff = history.cutoff(days)
        if dry_run:
            count = EventTrace.objects.filter(created_at__lt=cutoff).count()
            self.stdout.write(f"would delete {count} event traces older than {days:g} days (before "
                              f"{cutoff:%Y-%m-%d %H:%M} UTC)")
            return
        deleted = history.prune(days)
        capped = history.prune_owners()
        kept = EventTrace.objects.count()
        self.stdout.write(f"deleted {deleted} event traces older than {days:g} days (before {cutoff:%Y-%m-%d %H:%M} "
                          f"UTC) and {capped} past each owner's newest {conf.get('HISTORY_FAILURES_PER_OWNER')} "
                          f"(EXECAPP['HISTORY_FAILURES_PER_OWNER']); {kept} kept")
