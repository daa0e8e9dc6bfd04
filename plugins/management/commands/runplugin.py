"""manage.py runplugin <plugin> <handler> '<json event>': call one handler and print its reply."""
from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandError

from execapp.db_command import DatabaseCommand
from execapp.engine import ExecAppError, parse_command
from plugins.loaded import LoadedPlugin
from plugins.models import Plugin


class Command(DatabaseCommand):
    help = ("Call one plugin handler with a JSON event and print the reply (text as is, data as JSON). "
            "Example: manage.py runplugin echo echo '{\"text\": \"/echo hi\"}'")

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("plugin")
        parser.add_argument("handler")
        parser.add_argument("event", nargs="?", default="{}",
                            help='JSON event: {"type", "text", "data", "session", "args"}; args defaults to the '
                                 "text after the command name.")

    def handle(self, *args: Any, **options: Any) -> None:
        plugin = Plugin.objects.filter(name=options["plugin"]).first()
        if plugin is None:
            known = ", ".join(Plugin.objects.values_list("name", flat=True)) or "none (run loadplugins)"
            raise CommandError(f"no plugin {options['plugin']!r}; known: {known}")
        try:
            event = json.loads(options["event"])
        except ValueError as exc:
            raise CommandError(f"the event is not JSON: {exc}") from None
        if not isinstance(event, dict):
            raise CommandError('the event must be a JSON object, like {"text": "/ping"}')
        event.setdefault("type", "message")
        event.setdefault("text", "")
        event.setdefault("data", {})
        event.setdefault("id", "runplugin")
        event.setdefault("session", None)
        if "args" not in event:
            command = parse_command(event["text"]) if event["type"] == "message" else None
            event["args"] = command[1] if command else event["text"]
        try:
            plugin.prepare_code()
            loaded = LoadedPlugin(plugin.to_spec())
            reply = loaded.call(options["handler"], event)
        except ExecAppError as exc:
            raise CommandError(f"[{exc.code}] {exc}") from None
        finally:
            if "loaded" in locals():
                loaded.close()
        if reply is None:
            self.stdout.write("(no reply)")
        elif isinstance(reply, str):
            self.stdout.write(reply)
        else:
            self.stdout.write(json.dumps(reply, ensure_ascii=False))
