"""A NUL (or a lone surrogate) in a client's or a plugin's text never fails a database write (execapp.dbtext): on
PostgreSQL, which refuses NUL in text and jsonb, one such event used to fail the whole batch of
failure traces of its flush, and one such error message every profile write of its batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from urllib.parse import urlparse

import psycopg
import pytest

from execapp.dbtext import clean_json, clean_text
from tests.conftest import ROOT, manage


def test_clean_text_and_json_replace_nul_and_lone_surrogates_and_nothing_else() -> None:
    assert clean_text("a\x00b\x00") == "a\ufffdb\ufffd"
    # A plugin's JSON can spell a lone surrogate (JS's "\ud800"), which UTF-8 cannot encode.
    assert clean_text("\u00e9\ud800x\udfff\x00") == "\u00e9\ufffdx\ufffd\ufffd"
    plain, emoji = "nothing to do \u00e9\n", "\U0001f600 pair"
    assert clean_text(plain) is plain and clean_text(emoji) is emoji
    value = {"k\x00": ["x\x00", 1, None, {"n": "\x00"}], "ok": 2.5, "t": True}
    assert clean_json(value) == {"k\ufffd": ["x\ufffd", 1, None, {"n": "\ufffd"}], "ok": 2.5, "t": True}


CHILD = textwrap.dedent(r"""
    import json, os
    import django
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()
    from types import SimpleNamespace
    from execapp import history
    from execapp.engine import Engine
    from execapp.history_record import Handler, Record
    from execapp.models import EventTrace, ExecProfileRecord
    from execapp.persistence import ProfileStore

    def failed(uid, event_id, text, message):
        handler = Handler("command:boom", "p", "sync", 0.0, None, 0.001, "handler_error", message,
                          ((text, {"key\x00": "value\x00"}),))
        return Record(uid, event_id, "tenant:a", "s\x00", "message", text, len(text), "w", 1000.0, "error", "",
                      ("handler_error",), 0.001, 1, 1, 1, None, (handler,), False)

    recorder = history.Recorder(SimpleNamespace(engine=Engine(pool_enabled=False), id="w"))
    recorder._write_failures([failed("u1", "bad\x00id", "/boom \x00", "fail\x00ed"),
                              failed("u2", "good", "/boom", "failed"),
                              failed("u3", "lone", "/boom \udc00", "fail\ud800ed")])
    found = history.get("tenant:a", "bad\x00id")  # looked up as stored
    engine = Engine(pool_enabled=False)
    for name, error in (("command:nul", "bad\x00message"), ("command:fine", "plain"),
                        ("command:lone", "bad\ud83dmessage")):
        engine.profile_for(name).record(0.001, error=error)
    ProfileStore(engine).flush()
    print(json.dumps({
        "traces": sorted(EventTrace.objects.values_list("event_id", flat=True)),
        "written": recorder.db_written,
        "found": found and [found["id"], found["handlers"][0]["replies"], found["handlers"][0]["message"]],
        "errors": dict(ExecProfileRecord.objects.values_list("matcher", "last_error")),
    }))
""")


@pytest.mark.postgres
def test_a_nul_from_a_client_or_a_plugin_fails_no_write_on_postgres(postgres_url: str) -> None:
    name = f"execapp_nul_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    env = {"DATABASE_URL": urlparse(postgres_url)._replace(path=f"/{name}").geturl(), "REDIS_URL": ""}
    try:
        migrated = manage("migrate", "--noinput", env=env)
        assert migrated.returncode == 0, migrated.stderr
        done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env={**os.environ, **env},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        got = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    # the good one was not lost with them
    assert got["traces"] == ["bad\ufffdid", "good", "lone"] and got["written"] == 3
    assert got["found"] == ["bad\ufffdid", [["/boom \ufffd", {"key\ufffd": "value\ufffd"}]], "fail\ufffded"]
    assert got["errors"] == {"command:nul": "bad\ufffdmessage", "command:fine": "plain",
                             "command:lone": "bad\ufffdmessage"}
