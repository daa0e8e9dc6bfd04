"""docs/prometheus/: the recording and alerting rules pass `promtool check rules` and their unit tests
(`promtool test rules`: each alert fires on the series that should fire it), and every metric the
rules and the Grafana dashboard name is one execapp exports (with the labels they use)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
from prometheus_client import REGISTRY

from execapp import metrics  # noqa: F401  (registers the app's metrics)
from execapp.codes import ERROR_CODES, EVENT_REFUSAL_CODES, HANDLER_REFUSAL_CODES, REFUSAL_CODES
from tests.conftest import ROOT

PROM = ROOT / "docs" / "prometheus"
RULES = PROM / "execapp.rules.yml"


def _promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    message = "promtool is missing: `make sysdeps` installs Debian's prometheus package"
    if os.environ.get("EXECAPP_REQUIRE_SERVICES", "") in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_fire_every_alert() -> None:
    result = subprocess.run([_promtool(), "test", "rules", "execapp.rules.test.yml"], cwd=PROM, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    alerts = set(re.findall(r"^\s+- alert: (\w+)", RULES.read_text(), re.M))
    tested = set(re.findall(r"alertname: (\w+)", (PROM / "execapp.rules.test.yml").read_text()))
    assert alerts == tested == {"ExecappPoolSaturated", "ExecappStuckHandlers", "ExecappRefusingHandlers",
                                "ExecappRefusingEvents", "ExecappEventErrorRatio", "ExecappDrainStuck"}


def test_the_refusal_rule_names_exactly_the_handler_refusal_codes() -> None:
    """The rule's code regex and execapp.codes agree: a refusal code added there must be added here."""
    [regex] = re.findall(r'execapp_handler_failures_total\{code=~"([^"]+)"\}', RULES.read_text())
    matched = {code for code in ERROR_CODES if re.fullmatch(regex, code)}
    assert matched == HANDLER_REFUSAL_CODES
    assert EVENT_REFUSAL_CODES | HANDLER_REFUSAL_CODES == REFUSAL_CODES


def _exported() -> dict[str, set[str]]:
    """Every sample name execapp exports, with its label names."""
    names: dict[str, set[str]] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith("execapp_"):
            continue
        base = family.name + ("_total" if family.type == "counter" else "")
        labels = set()
        for sample in family.samples:
            labels |= set(sample.labels) - {"le"}
        for suffix in ("", "_bucket", "_count", "_sum"):
            names[base + suffix if family.type == "histogram" else base] = labels
    # Families with labels have no samples until a child exists: take their declared label names.
    for collector in list(REGISTRY._collector_to_names):
        name = getattr(collector, "_name", "")
        if name.startswith("execapp_"):
            kind = getattr(collector, "_type", "")
            label_names = set(getattr(collector, "_labelnames", ()))
            keys = ([name + s for s in ("_bucket", "_count", "_sum")] if kind == "histogram"
                    else [name + "_total" if kind == "counter" and not name.endswith("_total") else name])
            for key in keys:
                names.setdefault(key, set()).update(label_names)
    return names


def test_the_rules_and_the_dashboard_name_only_what_execapp_exports() -> None:
    exported = _exported()
    rules_text = RULES.read_text()
    recorded = set(re.findall(r"record: (execapp:[\w:]+)", rules_text))
    dashboard = json.loads((PROM / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(dashboard["panels"]) >= 10 and all(exprs)
    for text in [rules_text, *exprs]:
        for name in re.findall(r"\b(execapp_[a-z_]+)", text):
            assert name in exported, f"{name} is not a metric execapp exports"
        for name in re.findall(r"\b(execapp:[\w:]+)", text):
            assert name in recorded, f"{name} is not a recording rule of execapp.rules.yml"
    # The per-worker gauges carry the worker label the rules and panels group by.
    for gauge in ("execapp_pool_in_flight", "execapp_pool_capacity", "execapp_pool_stuck_threads",
                  "execapp_worker_draining"):
        assert exported[gauge] == {"worker"}, gauge
    assert exported["execapp_handler_failures_total"] == {"matcher", "plugin", "code"}
    assert exported["execapp_event_refusals_total"] == {"worker", "code"}
    assert exported["execapp_session_frames_dropped_total"] == {"worker"}
