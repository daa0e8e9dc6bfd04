"""/metrics access: loopback only by default, EXECAPP['METRICS_ALLOWED_NETWORKS'] and a bearer token
(EXECAPP['METRICS_TOKEN'] / env METRICS_TOKEN); forwarded-for headers are never read by the view."""
from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from django.core import checks

TOKEN = "scrape-token-0123456789abcdef"


def scrape(client: Any, remote: str = "127.0.0.1", token: str | None = None, **headers: str) -> Any:
    """GET /metrics as a client at ``remote`` (REMOTE_ADDR, what the ASGI server reports)."""
    if token is not None:
        headers["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    return client.get("/metrics", REMOTE_ADDR=remote, **headers)


def allowed(response: Any) -> bool:
    return response.status_code == 200 and b"execapp_events_total" in response.content


def refused(response: Any, *words: str) -> bool:
    """403, no metric in the body, and a message naming what to set."""
    text = response.content.decode()
    return (response.status_code == 403 and "execapp_" not in text.replace("EXECAPP[", "")
            and all(w in text for w in words))


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    monkeypatch.delenv("METRICS_TOKEN", raising=False)
    monkeypatch.delenv("METRICS_ALLOWED_NETWORKS", raising=False)
    settings.EXECAPP = {}


def test_by_default_this_host_may_scrape(client: Any) -> None:
    for remote in ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"):
        assert allowed(scrape(client, remote)), remote


def test_by_default_other_networks_are_refused_with_what_to_set(client: Any) -> None:
    for remote in ("10.1.2.3", "192.168.0.7", "2001:db8::1", "::ffff:10.1.2.3", "", "not-an-address"):
        response = scrape(client, remote)
        assert refused(response, "METRICS_ALLOWED_NETWORKS", "METRICS_TOKEN"), (remote, response.content)


def test_forwarded_for_headers_are_not_trusted(client: Any) -> None:
    response = scrape(client, "10.1.2.3", HTTP_X_FORWARDED_FOR="127.0.0.1", HTTP_X_REAL_IP="127.0.0.1",
                      HTTP_FORWARDED="for=127.0.0.1")
    assert refused(response, "METRICS_ALLOWED_NETWORKS")


def test_allowed_networks_setting_replaces_loopback(client: Any, settings: Any) -> None:
    settings.EXECAPP = {"METRICS_ALLOWED_NETWORKS": ["10.1.0.0/16", "2001:db8::/32"]}
    assert allowed(scrape(client, "10.1.2.3"))
    assert allowed(scrape(client, "2001:db8::1"))
    assert refused(scrape(client, "10.2.0.1"))
    assert refused(scrape(client, "127.0.0.1"))  # loopback is not implied once networks are set


def test_allowed_networks_from_the_environment(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRICS_ALLOWED_NETWORKS", "10.1.0.0/16, 127.0.0.1")
    assert allowed(scrape(client, "10.1.2.3")) and allowed(scrape(client, "127.0.0.1"))
    assert refused(scrape(client, "127.0.0.2"))


def test_a_token_is_required_from_every_network_once_set(client: Any, settings: Any) -> None:
    settings.EXECAPP = {"METRICS_TOKEN": TOKEN}
    assert refused(scrape(client), "Authorization: Bearer", "METRICS_TOKEN")  # local, but no token
    assert refused(scrape(client, token="wrong"), "METRICS_TOKEN")
    assert refused(scrape(client, token=TOKEN[:-1]))
    assert refused(scrape(client, HTTP_AUTHORIZATION=f"Basic {TOKEN}"))
    assert allowed(scrape(client, token=TOKEN))
    assert allowed(scrape(client, HTTP_AUTHORIZATION=f"bearer {TOKEN}"))  # the scheme is case-insensitive
    assert refused(scrape(client, "10.1.2.3", token=TOKEN), "METRICS_ALLOWED_NETWORKS")  # both must hold


def test_the_token_from_the_environment_and_the_setting_over_it(client: Any, settings: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRICS_TOKEN", TOKEN)
    assert refused(scrape(client)) and allowed(scrape(client, token=TOKEN))
    settings.EXECAPP = {"METRICS_TOKEN": "another-token-fedcba9876543210"}
    assert refused(scrape(client, token=TOKEN)) and allowed(scrape(client, token="another-token-fedcba9876543210"))
    settings.EXECAPP = {"METRICS_TOKEN": ""}  # explicitly none: the environment's is not used
    assert allowed(scrape(client))


def test_invalid_settings_refuse_everyone_and_fail_the_checks(client: Any, settings: Any) -> None:
    settings.EXECAPP = {"METRICS_ALLOWED_NETWORKS": ["127.0.0.0/8", "localhost"]}
    assert refused(scrape(client), "'localhost' is not a network")
    ids = {m.id for m in checks.run_checks()}
    assert "execapp.E061" in ids
    settings.EXECAPP = {"METRICS_ALLOWED_NETWORKS": ["0.0.0.0/0"]}
    assert "execapp.W060" in {m.id for m in checks.run_checks()}  # open to all, no token
    settings.EXECAPP = {"METRICS_ALLOWED_NETWORKS": ["0.0.0.0/0"], "METRICS_TOKEN": TOKEN}
    assert not {"execapp.W060", "execapp.E061", "execapp.W061"} & {m.id for m in checks.run_checks()}


@pytest.mark.e2e
def test_a_real_server_with_a_token_and_a_same_host_proxy(asgi_server_factory: Any, tmp_path: Path) -> None:
    """uvicorn trusts X-Forwarded-For from 127.0.0.1 (its --forwarded-allow-ips default): through a
    same-host proxy that sets it, the client is the remote one and is refused; without, all looks local."""
    server = asgi_server_factory({"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}", "METRICS_TOKEN": TOKEN})

    def get(**headers: str) -> tuple[int, str]:
        request = urllib.request.Request(f"{server.url}/metrics", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    status, body = get()
    assert status == 403 and "Authorization: Bearer" in body
    status, body = get(Authorization=f"Bearer {TOKEN}")
    assert status == 200 and "execapp_events_total" in body
    status, body = get(Authorization=f"Bearer {TOKEN}", **{"X-Forwarded-For": "203.0.113.7"})
    assert status == 403 and "203.0.113.7" in body


def test_an_invalid_list_of_networks_plugins_may_reach_fails_the_checks(settings: Any) -> None:
    settings.EXECAPP = {"PLUGIN_HTTP_ALLOWED_NETWORKS": ["10.0.0.0/8", "intranet"]}
    errors = [m for m in checks.run_checks() if m.id == "execapp.E063"]
    assert len(errors) == 1 and "'intranet' is not a network" in errors[0].msg
    settings.EXECAPP = {"PLUGIN_HTTP_ALLOWED_NETWORKS": "10.0.0.0/8, fd00::/8"}
    assert "execapp.E063" not in {m.id for m in checks.run_checks()}
