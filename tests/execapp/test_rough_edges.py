"""The rough edges a new user hit (issue 12), each fixed with a test: documented commands run as
written, loadplugins keeps edited plugins, clear messages and JSON errors, `make run` says where
to go next, `/` leads to the admin, JSON logs, environment overrides of the EXECAPP limits,
duration buckets that reach the longest timeout, and a hint for a disabled command."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from execapp import conf
from tests.conftest import ROOT, ServerProcess, manage, wait_until

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# -- every documented command works as written from a fresh clone ---------------------------------

def test_docs_run_manage_py_and_the_server_with_the_virtualenvs_python() -> None:
    """`python manage.py ...` fails on a fresh clone (no module named django): every command a
    document shows runs the virtualenv's interpreter, and names a command that exists."""
    commands = set(subprocess.run([sys.executable, "manage.py", "help", "--commands"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout.split())
    bare, unknown = [], []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if re.search(r"(?<![\w/.])python3? (manage\.py|-m execapp)", line):
                bare.append(f"{doc.name}:{n}: {line.strip()}")
            for name in re.findall(r"\.venv/bin/python manage\.py ([a-z_]+)", line):
                if name not in commands:
                    unknown.append(f"{doc.name}:{n}: manage.py {name}")
    assert bare == [], "use .venv/bin/python:\n" + "\n".join(bare)
    assert unknown == [], "\n".join(unknown)


def test_every_option_a_documented_command_shows_is_one_it_takes() -> None:
    """Each `--option` a document shows after `manage.py <command>` or `-m execapp.serve` is one that
    command's parser accepts (a renamed option would fail as written)."""
    from django.core.management import get_commands, load_command_class

    from execapp.serve import build_parser

    apps = get_commands()
    wrong, seen = [], 0
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for name, args in re.findall(r"manage\.py ([a-z_]+)([^`|;&#)]*)", line):
                if name not in apps:
                    continue  # unknown names: the test above
                options = {o for a in load_command_class(apps[name], name).create_parser("manage.py", name)._actions
                           for o in a.option_strings}
                for option in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", args):
                    seen += 1
                    if option not in options:
                        wrong.append(f"{doc.name}:{n}: manage.py {name} {option}")
            for args in re.findall(r"-m execapp\.serve([^`|;&#)]*)", line):
                options = {o for a in build_parser()._actions for o in a.option_strings}
                for option in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", args):
                    seen += 1
                    if option not in options:
                        wrong.append(f"{doc.name}:{n}: -m execapp.serve {option}")
    assert seen >= 10 and wrong == [], "\n".join(wrong)


#: Documented commands safe to run against a fresh SQLite database (the others need a server,
#: Redis, or a terminal: their names and options are checked above).
RUNNABLE = {"migrate", "loadplugins", "create_token", "runplugin", "prune_history", "check"}


def test_the_documented_commands_run_as_written_on_a_fresh_database(sqlite_env: dict[str, str]) -> None:
    """Each `.venv/bin/python manage.py ...` line of a shell block in the docs whose command is in
    RUNNABLE (and has no <placeholder>) runs as written and exits 0; a `# -> x` comment is what it
    prints. Each document starts from the database `make run` leaves: migrated, the bundled plugins
    loaded."""
    import shlex

    loaded = manage("loadplugins", env=sqlite_env)  # what `make run` did first (README, "Set-up")
    assert loaded.returncode == 0, loaded.stderr
    database = Path(sqlite_env["DATABASE_URL"].removeprefix("sqlite:///"))
    fresh = database.with_name("fresh.sqlite3")
    shutil.copyfile(database, fresh)
    ran: list[str] = []
    for doc in DOCS:
        shutil.copyfile(fresh, database)  # each document starts from the fresh clone
        in_block = False
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_block = line.strip() in ("```sh", "```bash", "```console")
                continue
            if not in_block or "<" in line.split("#")[0]:
                continue
            expected = line.split("# ->", 1)[1].strip() if "# ->" in line else None
            for part in line.strip().split("&&"):
                if not part.strip().startswith(".venv/bin/python manage.py ") or part.rstrip().endswith("\\"):
                    continue
                words = shlex.split(part, comments=True)
                if words[:2] != [".venv/bin/python", "manage.py"] or len(words) < 3 or words[2] not in RUNNABLE:
                    continue
                result = manage(*words[2:], env=sqlite_env)
                where = f"{doc.name}:{n}: {part.strip()}"
                assert result.returncode == 0, f"{where}\n{result.stdout}\n{result.stderr}"
                if expected is not None:
                    assert expected in result.stdout, f"{where}: prints {result.stdout!r}, the doc says {expected!r}"
                ran.append(where)
    assert len({r.split(": ", 1)[1].split()[2] for r in ran}) >= 4, ran  # several distinct commands ran


def test_every_make_target_the_docs_name_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    named = {t for doc in DOCS for t in re.findall(r"`make ([a-z][\w-]*)", doc.read_text())}
    assert named and named <= targets, named - targets


def test_make_run_says_where_to_go_next() -> None:
    result = subprocess.run(["make", "--no-print-directory", "welcome", "PORT=9123"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "http://127.0.0.1:9123/admin/" in out
    assert ".venv/bin/python manage.py createsuperuser" in out
    assert ".venv/bin/python manage.py create_token me" in out
    run = re.search(r"^run: (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert run and run.group(1).split() == ["plugins", "welcome", "serve"]  # printed before the server starts


@pytest.mark.django_db
def test_the_site_root_leads_to_the_admin(client: Any) -> None:
    response = client.get("/")
    assert response.status_code == 302 and response["Location"] == "/admin/"


# -- messages: the token command, control commands ----------------------------------------------------

@pytest.mark.django_db
def test_create_token_prints_information_on_stdout_not_as_an_error() -> None:
    out, err = StringIO(), StringIO()
    call_command("create_token", "quiet", stdout=out, stderr=err)
    assert err.getvalue() == ""
    lines = out.getvalue().strip().splitlines()
    assert "only its hash is stored" in out.getvalue() and len(lines[-1]) > 30 and " " not in lines[-1]


def test_a_control_command_under_json_answers_its_error_as_json() -> None:
    """Without a shared channel layer the control commands cannot reach a server: under --json the
    error is a JSON object on stdout (and nothing else), exit status 1."""
    env = {**os.environ, "REDIS_URL": ""}
    result = subprocess.run([sys.executable, "manage.py", "execstatus", "--json"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr == ""
    answer = json.loads(result.stdout)
    assert answer["ok"] is False and answer["op"] == "status" and answer["error"]["code"]
    assert "REDIS_URL" in answer["error"]["message"]
    plain = subprocess.run([sys.executable, "manage.py", "execstatus"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    assert plain.returncode == 1 and "REDIS_URL" in plain.stderr and plain.stdout == ""


@pytest.mark.redis
def test_no_answer_names_this_commands_redis_prefix(redis_url: str, settings: Any) -> None:
    """Nobody listens on this command's prefix (a server started with another REDIS_PREFIX): the
    error names the prefix this command used."""
    settings.REDIS_URL = redis_url
    settings.CHANNEL_LAYERS = {"default": {**settings.CHANNEL_LAYERS["default"],
                                           "BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {**settings.CHANNEL_LAYERS["default"].get("CONFIG", {}),
                                                      "hosts": [redis_url]}}}
    prefix = conf.redis_prefix()
    with pytest.raises(CommandError) as info:
        call_command("execstatus", stdout=StringIO())
    assert "no worker answered" in str(info.value) and f"REDIS_PREFIX={prefix!r}" in str(info.value)


def test_a_drain_that_times_out_counts_what_still_runs() -> None:
    from execapp.management.commands._control import counted, drain_line

    assert counted(["slow.slow", "slow.slow", "ping.ping", "slow.slow"]) == "slow.slow x3, ping.ping"
    assert counted([]) == "-"
    line = drain_line({"worker": "w1", "ok": False, "reason": "timeout", "elapsed_seconds": 0.5,
                       "still_running": ["slow.slow"] * 3, "events_in_flight": 3, "tasks_queued": 0})
    assert "still running: slow.slow x3;" in line and "slow.slow, slow.slow" not in line


# -- loadplugins keeps an edited plugin unless --force -------------------------------------------------

@pytest.mark.django_db
def test_loadplugins_updates_from_the_manifest_but_keeps_edited_plugins(tmp_path: Path) -> None:
    from plugins.bundled import EXAMPLES_DIR
    from plugins.models import Binding, Plugin

    shutil.copytree(EXAMPLES_DIR, tmp_path / "examples")
    directory = tmp_path / "examples"

    def load(*extra: str) -> str:
        out = StringIO()
        call_command("loadplugins", "--dir", str(directory), *extra, stdout=out)
        return out.getvalue()

    assert "7 created" in load()
    # A new release of the manifest: the plugin is as loadplugins left it, so it is updated.
    (directory / "ping.lua").write_text((directory / "ping.lua").read_text().replace('"pong"', '"pong!"'))
    assert "ping (lua): updated" in load()
    assert "pong!" in Plugin.objects.get(name="ping").source
    # An operator's edit (here a disable, as the admin's action does, and a binding of its own):
    Plugin.objects.filter(name="slow").update(enabled=False)
    echo = Plugin.objects.get(name="echo")
    Binding.objects.create(plugin=echo, pattern="say", handler="echo")
    out = load()
    assert "slow (lua): skipped: edited since it was loaded" in out and "echo (lua): skipped" in out
    assert "2 skipped" in out and "--force" in out
    assert not Plugin.objects.get(name="slow").enabled and echo.bindings.filter(pattern="say").exists()
    assert "2 skipped" in load()  # and again: an edit is kept until someone says otherwise
    out = load("--force")
    assert "slow (lua): updated" in out and "echo (lua): updated" in out
    assert Plugin.objects.get(name="slow").enabled and not echo.bindings.filter(pattern="say").exists()
    assert "7 unchanged" in load()


# -- a disabled command says why it matched nothing --------------------------------------------------

@pytest.mark.django_db(transaction=True)
async def test_a_disabled_command_answers_with_a_hint(settings: Any, install_worker: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from asgiref.sync import sync_to_async

    from execapp import worker as worker_module
    from plugins.models import Binding, Plugin

    from .ws_fixtures import Client

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    await sync_to_async(call_command)("loadplugins", stdout=StringIO())
    await sync_to_async(Plugin.objects.filter(name="slow").update)(enabled=False)
    echo = await sync_to_async(Plugin.objects.get)(name="echo")
    await sync_to_async(Binding.objects.filter(plugin=echo).update)(enabled=False)
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", [worker_module.EXTENSION_SERVICES])
    worker = install_worker(worker_module.Worker("hints"))
    await sync_to_async(worker.start, thread_sensitive=False)()
    try:
        async with Client() as c:
            await c.send({"type": "message", "id": "s", "text": "/slow 10"})
            slow = (await c.until_done("s"))[-1]
            await c.send({"type": "message", "id": "e", "text": "/echo hi"})
            echo_done = (await c.until_done("e"))[-1]
            await c.send({"type": "message", "id": "n", "text": "/nobody-binds-this"})
            nobody = (await c.until_done("n"))[-1]
            await c.send({"type": "message", "id": "p", "text": "/ping"})
            ping = (await c.until_done("p"))[-1]
    finally:
        await sync_to_async(worker.stop, thread_sensitive=False)(5)
    assert slow["matched"] == 0 and slow["hint"] == ("no enabled handler for /slow: plugin 'slow' is disabled "
                                                     "(enable it in the admin's Plugins page)")
    assert echo_done["matched"] == 0 and "its binding in plugin 'echo' is disabled" in echo_done["hint"]
    assert nobody["matched"] == 0 and "hint" not in nobody  # nothing to say: no hint
    assert ping["matched"] == 1 and "hint" not in ping


# -- structured logs ----------------------------------------------------------------------------------

def test_log_format_json_makes_every_server_line_json(sqlite_env: dict[str, str]) -> None:
    import urllib.request

    server = ServerProcess(["execapp.serve", "--host", "127.0.0.1", "--workers", "1"],
                           {**sqlite_env, "LOG_FORMAT": "json"}, "logjson")
    try:
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{server.url}/healthz", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        assert wait_until(healthy, 60, interval=0.2), server.log()
    finally:
        assert server.stop() == 0
    lines = [line for line in server.log_path.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert any(r["logger"] == "execapp.serve" for r in records)
    assert any(r["logger"].startswith("uvicorn") for r in records)  # uvicorn's own lines too
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)


# -- EXECAPP limits from the environment ------------------------------------------------------------

def test_environment_overrides_the_execapp_limits(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    from execapp.protocol import Limits

    settings.EXECAPP = {"MAX_IN_FLIGHT_PER_CONNECTION": 50}
    assert Limits.from_settings().max_in_flight == 50
    monkeypatch.setenv("EXECAPP_MAX_IN_FLIGHT_PER_CONNECTION", "7")
    monkeypatch.setenv("EXECAPP_OVERFLOW_WAIT_SECONDS", "0.25")
    assert Limits.from_settings().max_in_flight == 7  # the environment wins over settings.EXECAPP
    assert conf.get("OVERFLOW_WAIT_SECONDS") == 0.25
    assert conf.source("MAX_IN_FLIGHT_PER_CONNECTION") == "environment variable EXECAPP_MAX_IN_FLIGHT_PER_CONNECTION"
    call_command("check")  # valid values pass


def test_a_bad_environment_value_is_refused_by_check_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXECAPP_POOL_MAX_WORKERS", "lots")
    with pytest.raises(Exception) as info:
        call_command("check")
    message = str(info.value)
    assert "execapp.E007" in message and "EXECAPP_POOL_MAX_WORKERS='lots' is not a whole number" in message
    assert "(from the environment variable EXECAPP_POOL_MAX_WORKERS)" in message


# -- duration buckets --------------------------------------------------------------------------------------

def test_duration_buckets_reach_the_longest_timeout_without_big_jumps(monkeypatch: pytest.MonkeyPatch) -> None:
    from execapp import checks, metrics

    buckets = metrics.DURATION_BUCKETS
    assert buckets == tuple(conf.DEFAULTS["DURATION_BUCKETS"])
    assert buckets[-1] >= conf.get("MAX_HANDLER_TIMEOUT_SECONDS")
    assert all(c / b <= 2.5 for b, c in zip(buckets, buckets[1:]) if b >= 1)  # no 10 s -> 30 s jump
    assert metrics.HANDLER_DURATION._upper_bounds[:-1] == list(buckets)
    assert checks._duration_bucket_checks() == []
    monkeypatch.setenv("EXECAPP_DURATION_BUCKETS", "0.1,1,10,30")
    ids = sorted(m.id for m in checks._duration_bucket_checks())
    assert ids == ["execapp.E092", "execapp.W090"]  # ends below 60 s; jumps 1 -> 10 -> 30


@pytest.mark.django_db
def test_a_plugin_timeout_above_the_longest_allowed_is_refused(settings: Any) -> None:
    from plugins.errors import PluginInvalid
    from plugins.models import Plugin

    settings.EXECAPP = {"MAX_HANDLER_TIMEOUT_SECONDS": 5.0}
    with pytest.raises(PluginInvalid, match="timeout_ms 6000 is above the longest handler timeout"):
        Plugin(name="long", runtime="lua", source="function f(e) return 1 end", timeout_ms=6000).save()
    Plugin(name="ok", runtime="lua", source="function f(e) return 1 end", timeout_ms=5000).save()


@pytest.mark.django_db
@pytest.mark.parametrize("next_url", ["//evil.example/", "https://evil.example/admin/", "/\\evil.example"])
def test_a_sign_in_with_another_sites_next_lands_on_the_admin(client: Any, next_url: str) -> None:
    """A link to the login with ?next= pointing elsewhere: Django refuses the redirect, and the
    user landed on its default /accounts/profile/, a 404 here."""
    from django.contrib.auth.models import User

    User.objects.create_user("op", password="pw-login-test-5", is_staff=True)
    response = client.post(f"/admin/login/?next={next_url}", {"username": "op", "password": "pw-login-test-5",
                                                               "next": next_url})
    assert response.status_code == 302 and response["Location"] == "/admin/"
