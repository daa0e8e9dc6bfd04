"""The dashboard in real headless Chromium (Debian's package, driven by Playwright): log into the
admin, open the dashboard in a 1,280 px window, drive the bundled Lua plugin's /slow over real
WebSockets and watch the numbers move; in one frame under load, the cards, the chart headers and
the Workers table's total agree, and the refusals the clients were told are the ones shown.

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
WIDTH = 1280
# 160 events of 0.8 s; the slow plugin runs 32 at a time (its max_concurrency): ~4 s of load.
# Each connection may have 13 in flight (EXECAPP_MAX_IN_FLIGHT_PER_CONNECTION, the environment
# override): its last 3 are refused with rate_limited, 30 refusals the dashboard must show.
CONNECTIONS, PER_CONNECTION, SLOW_MS, IN_FLIGHT = 10, 16, 800, 13
REFUSED = CONNECTIONS * (PER_CONNECTION - IN_FLIGHT)

#: Everything the test compares, read in one JavaScript turn (one rendered frame: the page
#: updates only between turns).
FRAME = """() => {
  const t = id => document.getElementById(id).textContent.trim();
  const total = [...document.querySelectorAll('#workers-total td')].map(td => td.textContent.trim());
  return {saturation: t('card-saturation'), running: t('card-running'), queued: t('card-queued'),
          eps: t('card-eps'), refused: t('card-refused'), nowSaturation: t('now-saturation'),
          nowLoad: t('now-load'), nowEps: t('now-eps'), total: total,
          refusedTitle: document.getElementById('card-refused-box').title,
          pageWidth: document.documentElement.scrollWidth, viewport: window.innerWidth,
          clipped: [...document.querySelectorAll('#dash .scroll')].filter(d => d.scrollWidth > d.clientWidth)
                     .map(d => d.firstElementChild.id),
          workerCellHeight:
            document.querySelector('#workers-table tbody tr[data-worker] td').getBoundingClientRect().height,
          rowHeight: document.querySelector('#workers-table thead th').getBoundingClientRect().height,
          updates: Number(document.getElementById('dash').dataset.updates || 0)};
}"""


def _wait(page: Any, expression: str, timeout: int = 30_000) -> None:
    """Poll a JavaScript expression until true. Playwright's wait_for_function evaluates it with
    eval() inside the page, which the page's Content-Security-Policy (script-src 'self') refuses;
    page.evaluate goes through the DevTools protocol, which the policy does not apply to."""
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true after {timeout} ms: {expression}"
        time.sleep(0.1)


def _chromium() -> str:
    if os.path.exists(CHROMIUM):
        return CHROMIUM
    message = f"{CHROMIUM} is missing: `make sysdeps` installs Debian's chromium"
    if os.environ.get("EXECAPP_REQUIRE_SERVICES", "") in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def _client(url: str, n: int, results: list, refusals: list, errors: list) -> None:
    """One WebSocket client: send n /slow events at once, then read until each one has its done
    or its refusal (an error frame without a matcher)."""
    from websockets.sync.client import connect

    try:
        with connect(url, open_timeout=10, close_timeout=5) as ws:
            for _ in range(n):
                ws.send(json.dumps({"type": "message", "text": f"/slow {SLOW_MS}"}))
            done = refused = 0
            while done + refused < n:
                frame = json.loads(ws.recv(timeout=60))
                done += frame["type"] == "done"
                if frame["type"] == "error" and not frame.get("matcher"):
                    refused += 1
                    refusals.append(frame["code"])
            results.append(done)
    except Exception as exc:  # reported by the test thread
        errors.append(repr(exc))


def _load(ws_url: str) -> tuple[list[threading.Thread], list, list, list]:
    results: list = []
    refusals: list = []
    errors: list = []
    threads = [threading.Thread(target=_client, args=(ws_url, PER_CONNECTION, results, refusals, errors), daemon=True)
               for _ in range(CONNECTIONS)]
    for t in threads:
        t.start()
    return threads, results, refusals, errors


def _number(text: str) -> float:
    return float(text.split("/")[0].split(" ")[0].replace(",", "").replace("%", "").strip() or "nan")


def _nice_max(v: float) -> float:
    """The dashboard's axis rule (niceMax in the template): 1, 2 or 5 times a power of ten."""
    import math

    if not v > 0:
        return 1.0
    p = 10 ** math.floor(math.log10(v))
    m = v / p
    return (1 if m <= 1 else 2 if m <= 2 else 5 if m <= 5 else 10) * p


def assert_one_snapshot(frame: dict[str, Any]) -> None:
    """Cards, chart headers and the Workers total row show the same numbers."""
    assert frame["saturation"] == frame["nowSaturation"], frame
    running, queued = frame["nowLoad"].split(" running, ")
    assert _number(frame["running"]) == _number(running), frame
    assert _number(frame["queued"]) == _number(queued.replace(" queued", "")), frame
    assert frame["nowEps"] == frame["eps"] + "/s", frame
    total = frame["total"]  # worker, status, running / cap., queued / cap., saturation, submitted, fallbacks, refused
    assert total[2] == frame["running"] and total[3] == frame["queued"], frame
    assert total[4].endswith(frame["saturation"]) and total[7] == frame["refused"], frame


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
    server = asgi_server_factory({**env, "EXECAPP_MAX_IN_FLIGHT_PER_CONNECTION": str(IN_FLIGHT)})
    ws_url = f"{server.ws_url}/ws/events/?token={token}"
    waves = int(os.environ.get("EXECAPP_DASHBOARD_WAVES", "1"))

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 1500})
            page.goto(f"{server.url}/admin/login/?next={PAGE}")
            page.fill("#id_username", "admin")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url(f"**{PAGE}")
            _wait(page, "Number(document.getElementById('dash').dataset.updates || 0) >= 1")
            # The dashboard runs under the Content-Security-Policy, which runs no inline script:
            # one a string from a client or plugin smuggled into the page would stay inert.
            page.evaluate("() => { const s = document.createElement('script');"
                          " s.textContent = 'window.__inline_ran = true'; document.body.appendChild(s); }")
            assert page.evaluate("window.__inline_ran === undefined")
            assert page.text_content("#card-submitted").strip() == "0"
            assert page.text_content("#backend").strip() == "local"
            # A dashboard starts no worker (bare uvicorn, no execapp.serve): none is shown until
            # the first WebSocket client starts this process's worker (below).
            assert page.locator("#workers-table tbody tr[data-worker]").count() == 0
            assert page.text_content("#worker-count").strip() == "0 live"

            shot = tmp_path / "dashboard.png"
            told: list[str] = []
            under_load: list[dict[str, Any]] = []
            for wave in range(waves):
                threads, results, refusals, errors = _load(ws_url)
                # Under load: the pool fills, saturation and running rise, submissions count up.
                _wait(page,
                    "parseFloat(document.getElementById('card-saturation').textContent) > 10"
                    " && parseInt(document.getElementById('card-running').textContent) > 0", timeout=20_000)
                under_load.append(page.evaluate(FRAME))
                assert page.locator("#workers-table tbody tr[data-worker]").count() == 1
                if wave == waves - 1:  # one more poll: the charts show the climb
                    polls = under_load[-1]["updates"]
                    _wait(page, f"Number(document.getElementById('dash').dataset.updates || 0) > {polls}",
                                           timeout=20_000)
                    under_load.append(page.evaluate(FRAME))
                    page.screenshot(path=str(shot), full_page=True)
                for t in threads:
                    t.join(90)
                assert not errors and sum(results) == CONNECTIONS * IN_FLIGHT
                told += refusals
                if wave < waves - 1:
                    time.sleep(6)  # the point: a quiet stretch between waves on the charts (screenshots only)
            # In every frame read under load, one snapshot fed cards, headers and the total row.
            for frame in under_load:
                assert_one_snapshot(frame)
                assert _number(frame["eps"]) > 0  # a burst stays in the rate while its handlers run
                # A 1,280 px window: no horizontal scroll; a worker id stays on one line.
                assert frame["pageWidth"] <= frame["viewport"] == WIDTH, frame
                assert frame["clipped"] == [], frame  # every table fits: none needs its scroll bar
                assert frame["workerCellHeight"] < 2 * frame["rowHeight"] + 4, frame
            # Load over: every handler finished; the page sees the pool empty again.
            _wait(page,
                "document.getElementById('card-running').textContent.trim().startsWith('0 ')"
                " && document.getElementById('card-queued').textContent.trim().startsWith('0 ')", timeout=20_000)
            total = waves * CONNECTIONS * IN_FLIGHT
            _wait(page, f"parseInt(document.getElementById('card-submitted').textContent"
                                   f".replace(/[^0-9]/g, '')) >= {total}", timeout=10_000)
            # The refusals the clients were told are the ones shown, with their code.
            assert told == ["rate_limited"] * (waves * REFUSED)
            _wait(page, f"document.getElementById('card-refused').textContent.trim() === "
                                   f"'{waves * REFUSED}'", timeout=10_000)
            after = page.evaluate(FRAME)
            assert_one_snapshot(after)
            assert f"rate_limited: {waves * REFUSED}" in after["refusedTitle"]
            assert _number(after["saturation"]) == 0
            # The saturation chart is scaled to its data: the top of its axis is the nice
            # number above the highest point plus 10%, never above 100%.
            data = page.evaluate("window.__dash")
            fields = {f: i for i, f in enumerate(data["series_fields"])}
            highest = max(100 * (pt[fields["in_flight"]] + pt[fields["queued"]])
                          / max(1, pt[fields["capacity"]] + pt[fields["queue_capacity"]])
                          for pt in data["total"]["series"])
            top = page.evaluate("[...document.querySelectorAll('#chart-saturation text.axis')][4].textContent")
            assert _number(top) == pytest.approx(min(100.0, _nice_max(highest * 1.1)), rel=0.01)
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
