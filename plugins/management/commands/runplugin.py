"""manage.py runplugin <plugin> <handler> '<json event>': call one handler and print its reply."""
from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandError

from execapp.db_command import DatabaseCommand
from execapp.engine import ExecAppError, parse_command
from execapp.protocol import Limits, ProtocolError, parse_request
from plugins.errors import CompileError
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
        event = _event(options["event"])
        try:
            plugin.prepare_code()
            loaded = LoadedPlugin(plugin.to_spec())
        except ExecAppError as exc:
            raise CommandError(f"[{exc.code}] {exc}") from None
        except CompileError as exc:  # stored before a runtime or limit changed, or edited in the database
            raise CommandError(f"[{exc.code}] plugin {plugin.name!r} does not load: the {plugin.runtime} runtime "
                               f"refused its code: {exc}; fix it in the admin (a save validates it)") from None
        try:
            reply = loaded.call(options["handler"], event)
        except ExecAppError as exc:
            raise CommandError(f"[{exc.code}] {exc}") from None
        finally:
            loaded.close()
        if reply is None:
            self.stdout.write("(no reply)")
        elif isinstance(reply, str):
            self.stdout.write(reply)
        else:
            self.stdout.write(json.dumps(reply, ensure_ascii=False))


def _event(raw: str) -> dict[str, Any]:
    """The handler's event from the command line: checked as the server checks a client's frame
    (same codes and messages), plus ``args``; a handler never sees what no client could send it."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise CommandError(f"the event is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise CommandError('the event must be a JSON object, like {"text": "/ping"}')
    args = obj.pop("args", None)
    if args is not None and not isinstance(args, str):
        raise CommandError(f"[bad_event] args must be a string (the text after the command name), got {args!r:.60}")
    if obj.get("type", "message") == "message":
        obj.setdefault("text", "")
    try:
        event, _ = parse_request(json.dumps(obj), None, Limits.from_settings())
    except ProtocolError as exc:
        raise CommandError(f"[{exc.code}] {exc}") from None
    payload = event.to_dict()
    payload["id"] = payload["id"] or "runplugin"
    if args is None:
        command = parse_command(event.text) if event.type == "message" else None
        args = command[1] if command else event.text
    payload["args"] = args
    return payload
