"""The dashboard in real headless Chromium (Debian's package, driven by Playwright): log into the
admin, open the dashboard, drive the bundled Lua plugin's /slow over real WebSockets and watch the
numbers move.

EXECAPP_DASHBOARD_SCREENSHOT=docs/dashboard.png also keeps the under-load screenshot there;
EXECAPP_DASHBOARD_WAVES=N sends N waves of load (1 by default) for a chart with some history.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import manage

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]
PAGE = "/admin/execapp/dashboard/"
PASSWORD = "browser-test-pw-81"
# 160 events of 0.8 s; the slow plugin runs 32 at a time (its max_concurrency): ~4 s of load.
CONNECTIONS, PER_CONNECTION, SLOW_MS = 10, 16, 800


def _chromium() -> str:
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    message = f"{CHROMIUM} is missing: `make sysdeps` installs Debian's chromium"
    if os.environ.get("EXECAPP_REQUIRE_SERVICES", "") in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def _client(url: str, n: int, results: list, errors: list) -> None:
    """One WebSocket client: send n /slow events at once, then read until every one is done."""
    from websockets.sync.client import connect

    try:
        with connect(url, open_timeout=10, close_timeout=5) as ws:
            for _ in range(n):
                ws.send(json.dumps({"type": "message", "text": f"/slow {SLOW_MS}"}))
            done = 0
            while done < n:
                frame = json.loads(ws.recv(timeout=60))
                done += frame["type"] == "done"
            results.append(done)
    except Exception as exc:  # reported by the test thread
        errors.append(repr(exc))


def _load(ws_url: str) -> tuple[list[threading.Thread], list, list]:
    results: list = []
    errors: list = []
    threads = [threading.Thread(target=_client, args=(ws_url, PER_CONNECTION, results, errors), daemon=True)
               for _ in range(CONNECTIONS)]
    for t in threads:
        t.start()
    return threads, results, errors


def _number(page: Any, selector: str) -> float:
    return float(page.text_content(selector).split("/")[0].replace(",", "").replace("%", "").strip() or "nan")


@pytest.mark.e2e
@pytest.mark.browser
def test_dashboard_shows_load_moving_in_headless_chromium(sqlite_env: dict[str, str], asgi_server_factory: Any,
                                                          tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    chromium = _chromium()
    env = {**sqlite_env, "DJANGO_SUPERUSER_PASSWORD": PASSWORD}
    loaded = manage("loadplugins", env=env)  # the bundled plugins, as `make run` loads them
    assert loaded.returncode == 0, loaded.stderr
    made = manage("createsuperuser", "--noinput", "--username", "admin", "--email", "admin@example.com", env=env)
    assert made.returncode == 0, made.stderr
    issued = manage("create_token", "browser-load", env=env)
    assert issued.returncode == 0, issued.stderr
    token = issued.stdout.strip().splitlines()[-1]
    server = asgi_server_factory(env)
    ws_url = f"{server.ws_url}/ws/events/?token={token}"
    waves = int(os.environ.get("EXECAPP_DASHBOARD_WAVES", "1"))

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1400})
            page.goto(f"{server.url}/admin/login/?next={PAGE}")
            page.fill("#id_username", "admin")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url(f"**{PAGE}")
            page.wait_for_function("Number(document.getElementById('dash').dataset.updates || 0) >= 1")
            assert page.text_content("#card-submitted").strip() == "0"
            assert page.text_content("#backend").strip() == "local"
            assert page.locator("#workers-table tbody tr[data-worker]").count() == 1

            shot = tmp_path / "dashboard.png"
            for wave in range(waves):
                threads, results, errors = _load(ws_url)
                # Under load: the pool fills, saturation and running rise, submissions count up.
                page.wait_for_function(
                    "parseFloat(document.getElementById('card-saturation').textContent) > 10"
                    " && parseInt(document.getElementById('card-running').textContent) > 0", timeout=20_000)
                if wave == waves - 1:
                    page.wait_for_timeout(1200)  # one more poll: the charts show the climb
                    page.screenshot(path=str(shot), full_page=True)
                for t in threads:
                    t.join(90)
                assert not errors and sum(results) == CONNECTIONS * PER_CONNECTION
                if wave < waves - 1:
                    time.sleep(6)
            # Load over: every handler finished; the page sees the pool empty again.
            page.wait_for_function(
                "document.getElementById('card-running').textContent.trim().startsWith('0 ')"
                " && document.getElementById('card-queued').textContent.trim().startsWith('0 ')", timeout=20_000)
            total = waves * CONNECTIONS * PER_CONNECTION
            page.wait_for_function(f"parseInt(document.getElementById('card-submitted').textContent"
                                   f".replace(/[^0-9]/g, '')) >= {total}", timeout=10_000)
            assert _number(page, "#card-saturation") == 0
            plugin_cell = page.locator("td:nth-child(2)", has_text="slow")
            slow_row = page.locator("#matchers-table tbody tr").filter(has=plugin_cell)
            assert slow_row.count() == 1  # the bundled Lua plugin's matcher
            assert "pool" in slow_row.inner_text() and "promoted" in slow_row.inner_text()
            assert page.locator("#plugin-pools-table tbody tr", has_text="slow").count() >= 1
            assert page.locator("#chart-saturation path").count() >= 1  # the chart has a line
            assert page.locator("#chart-eps path").count() >= 1
        finally:
            browser.close()
    assert shot.exists() and shot.stat().st_size > 10_000
    keep = os.environ.get("EXECAPP_DASHBOARD_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)
