"""Hostile guest cases run in child processes, restarted past a case that hangs or crashes one."""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]


def run_in_children(child: str, payload: Callable[[list[str]], dict[str, Any]], names: list[str],
                    hard: float) -> dict[str, dict]:
    """Each case's outcome line from ``child`` (Python source reading ``payload(pending)`` as JSON on
    stdin, printing ``{"start": name}`` then ``{"case": name, ...}`` per case); a case still running
    after ``hard`` seconds is 'hung', one that killed its child 'crashed', and a new child takes the rest."""
    results: dict[str, dict] = {}
    pending = list(names)
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "config.settings"),
           "PYTHONPATH": str(ROOT)}
    while pending:
        proc = subprocess.Popen([sys.executable, "-c", child], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(payload(pending)))
        proc.stdin.close()
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        running, until = None, time.monotonic() + 60  # startup
        try:
            while pending:
                if not sel.select(timeout=max(0.0, until - time.monotonic())):
                    break  # hung (or a startup that never finished)
                line = proc.stdout.readline()
                if not line:
                    break  # the child died (a crash)
                msg = json.loads(line)
                if "start" in msg:
                    running, until = msg["start"], time.monotonic() + hard
                else:
                    results[msg["case"]] = msg
                    pending.remove(msg["case"])
                    running, until = None, time.monotonic() + hard
        finally:
            proc.kill()
            proc.wait()
            sel.close()
        if pending:
            what = "hung" if proc.returncode == -9 else f"crashed ({proc.returncode})"
            lost = running or pending[0]
            results[lost] = {"case": lost, "code": what, "elapsed": hard, "message": "", "reply": "", "after": ""}
            pending.remove(lost)
    return results
