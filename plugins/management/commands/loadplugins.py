"""manage.py loadplugins: load the bundled example plugins (or another directory) idempotently."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import CommandError

from execapp.db_command import DatabaseCommand
from plugins.bundled import EXAMPLES_DIR, load_directory
from plugins.errors import PluginInvalid


class Command(DatabaseCommand):
    help = ("Create or update the plugins of a directory with a manifest.json (default: the bundled examples); "
            "a plugin edited since it was loaded is kept unless --force.")

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--dir", default=str(EXAMPLES_DIR),
                            help="Directory holding manifest.json and the plugin files.")
        parser.add_argument("--force", action="store_true",
                            help="Also overwrite plugins edited since they were loaded (default: keep them and "
                                 "say which were skipped).")

    def handle(self, *args: Any, **options: Any) -> None:
        directory = Path(options["dir"])
        if not (directory / "manifest.json").is_file():
            raise CommandError(f"{directory} has no manifest.json; see docs/plugins.md for its format")
        try:
            results = load_directory(directory, say=self.stdout.write, force=options["force"])
        except PluginInvalid as exc:
            raise CommandError(f"[{exc.code}] {exc}") from None
        summary = (f"{len(results)} plugins: {results.count('created')} created, {results.count('updated')} updated, "
                   f"{results.count('unchanged')} unchanged")
        skipped = results.count("skipped")
        if skipped:
            self.stdout.write(self.style.WARNING(
                f"{summary}, {skipped} skipped (edited since they were loaded; `loadplugins --force` overwrites "
                "them)"))
        else:
            self.stdout.write(self.style.SUCCESS(summary))
