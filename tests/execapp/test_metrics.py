"""Prometheus metrics: /metrics shows each app metric with the values a known workload implies,
and multiprocess mode compacts dead processes' files without losing counts."""
from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from execapp import extensions, metrics
from execapp import worker as worker_module
from execapp.engine import Event, HandlerTimeout
from execapp.metrics_multiprocess import compact
from tests.conftest import ROOT, wait_until

LIVENESS = 10.0
PLUGIN_ROWS: list[dict[str, Any]] = [{"plugin": "lua-demo", "runtime": "lua", "strategy": "pooled", "capacity": 4,
                                      "busy": 1, "idle": 3, "waiting": 2, "waits_total": 7, "timeouts_total": 1,
                                      "errors_total": 3}]


def scrape(client: Any) -> dict[tuple[str, tuple], float]:
    """GET /metrics through Django and parse it: {(sample name, sorted labels): value}."""
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture
def metered_worker(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[worker_module.Worker]:
    """A Worker with a 2-thread pool and 1 queue slot, whose only service is the metrics updater."""
    settings.EXECAPP = {"POOL_MAX_WORKERS": 2, "POOL_QUEUE_SIZE": 1, "OVERFLOW_POLICY": "reject",
                        "POOL_IDLE_SECONDS": 0.5}
    monkeypatch.setattr(worker_module, "SERVICE_FACTORIES", ["execapp.metrics_updater.metrics_updater"])
    # The plugins app registers its instance pools as the "plugin_pools" stats (execapp.extensions);
    # this stands in for it at that boundary (the plugin runtimes are tested in tests/plugins/).
    PLUGIN_ROWS[0].update(waits_total=7, timeouts_total=1, errors_total=3)
    previous = extensions.add_stats_provider("plugin_pools", lambda: [dict(r) for r in PLUGIN_ROWS])
    worker = worker_module.Worker("metrics-test")
    worker.start()
    yield worker
    worker.stop(timeout=5)
    if previous is None:
        extensions.remove_stats_provider("plugin_pools")
    else:
        extensions.add_stats_provider("plugin_pools", previous)


def _ok(ctx: Any) -> str:
    return "ok"


def _boom(ctx: Any) -> None:
    raise RuntimeError("boom")


def _late(ctx: Any) -> None:
    raise HandlerTimeout("ran past its budget")


def test_metrics_show_the_values_of_a_known_workload(metered_worker: worker_module.Worker, client: Any) -> None:
    engine = metered_worker.engine
    gate = threading.Event()
    for name, handler in (("fast", _ok), ("boom", _boom), ("late", _late), ("quick", _ok),
                          ("hold", lambda ctx: gate.wait(LIVENESS) and "released")):
        engine.add(engine.make_matcher("command", name, handler, plugin="demo"))
    slow = engine.add(engine.make_matcher("command", "slow", lambda ctx: __import__("time").sleep(0.11),
                                          plugin="demo"))
    before = scrape(client)
    PLUGIN_ROWS[0].update(waits_total=7 + 5, timeouts_total=1 + 1, errors_total=3 + 2)  # the plugins' calls

    def run(text: str) -> Any:
        event_run = engine.process_event(Event(text=text))
        completion = event_run.wait(LIVENESS)
        assert completion is not None
        metrics.DONE_TALLY[1 if completion.errors else 0] += 1  # as the connection does per done
        return completion

    for _ in range(40):  # learning (pooled) until the window proves it fast, then inline
        run("/fast")
    run("/slow")  # one run over 100 ms: promoted
    run("/boom")
    run("/late")
    # Fill the pool: two handlers running, one queued; the next pooled handler falls back inline
    # (synchronous entry point) and an asyncio one is refused (overflow "reject").
    held = [engine.process_event(Event(text="/hold")) for _ in range(3)]
    fallback = run("/quick")
    refused = asyncio.run(engine.process_event_async(Event(text="/quick")))
    assert refused.completion is not None and refused.completion.errors[0].code == "overloaded"
    metrics.count_event("overloaded")
    busy = scrape(client)
    gate.set()
    for h in held:
        assert h.wait(LIVENESS) is not None
    after = scrape(client)

    counts, pool = engine.counts, metered_worker.pool.stats()
    fast = engine.profile_for("command:fast")
    assert fast.demotions == 1 and slow.profile.promotions == 1 and fallback.errors == ()
    # Gauges while the pool was full, and after.
    # Per-worker gauges carry the worker's slot number (one process, no supervisor: slot 0).
    w0 = {"worker": "0"}
    assert value(busy, "execapp_pool_in_flight", **w0) == 2 and value(busy, "execapp_pool_queued", **w0) == 1
    assert value(busy, "execapp_pool_capacity", **w0) == 2 and value(busy, "execapp_pool_queue_capacity", **w0) == 1
    assert value(after, "execapp_pool_in_flight", **w0) == 0 and value(after, "execapp_pool_queued", **w0) == 0
    assert value(after, "execapp_worker_draining", **w0) == 0
    # Totals: exactly what the engine and pool counted for this workload.
    pooled = counts["pooled"]
    assert pooled == pool["submitted"] >= 32 + 1 + 3  # fast's learning runs, slow, the held three
    assert delta(after, before, "execapp_pool_submitted_total") == pooled
    assert delta(after, before, "execapp_pool_completed_total") == pool["completed"] == pooled
    assert delta(after, before, "execapp_pool_failed_total") == 0
    assert delta(after, before, "execapp_pool_rejected_total") == pool["rejected"] == 2
    assert delta(after, before, "execapp_pool_fallbacks_total") == counts["fallbacks"] == 1
    assert delta(after, before, "execapp_pool_overloaded_total") == counts["overloaded"] == 1
    assert delta(after, before, "execapp_events_dispatched_total") == counts["events"] == 40 + 1 + 2 + 3 + 2
    assert delta(after, before, "execapp_pool_scheduling_delay_seconds_count") == pooled
    # Handler durations by matcher and exec class: every run of /fast, split pool/sync.
    fast_pool = delta(after, before, "execapp_handler_duration_seconds_count", matcher="command:fast", plugin="demo",
                      exec_class="pool")
    fast_sync = delta(after, before, "execapp_handler_duration_seconds_count", matcher="command:fast", plugin="demo",
                      exec_class="sync")
    assert fast_pool + fast_sync == 40 and fast_pool >= 32 and fast_sync >= 1
    assert delta(after, before, "execapp_handler_duration_seconds_count", matcher="command:slow", plugin="demo",
                 exec_class="pool") == 1
    assert delta(after, before, "execapp_handler_duration_seconds_bucket", matcher="command:slow", plugin="demo",
                 exec_class="pool", le="0.1") == 0  # it took over 100 ms
    assert delta(after, before, "execapp_handler_duration_seconds_count", matcher="command:quick", plugin="demo",
                 exec_class="sync") == 1  # the fallback ran inline
    assert delta(after, before, "execapp_handler_runs_total", outcome="ok") == 40 + 1 + 3 + 1
    assert delta(after, before, "execapp_handler_runs_total", outcome="handler_error") == 1
    assert delta(after, before, "execapp_handler_runs_total", outcome="timeout") == 1
    assert delta(after, before, "execapp_handler_runs_total", outcome="overloaded") == 1
    assert delta(after, before, "execapp_events_total", outcome="ok") == 40 + 1 + 1
    assert delta(after, before, "execapp_events_total", outcome="error") == 2
    assert delta(after, before, "execapp_events_total", outcome="overloaded") == 1
    assert delta(after, before, "execapp_profile_promotions_total", matcher="command:slow") == 1
    assert delta(after, before, "execapp_profile_demotions_total", matcher="command:fast") == 1
    # Plugin instance pools.
    assert delta(after, before, "execapp_plugin_instance_waits_total", plugin="lua-demo") == 5
    assert delta(after, before, "execapp_plugin_timeouts_total", plugin="lua-demo") == 1
    assert delta(after, before, "execapp_plugin_errors_total", plugin="lua-demo") == 2
    assert value(after, "execapp_plugin_instances_busy", plugin="lua-demo") == 1
    assert value(after, "execapp_plugin_instances_waiting", plugin="lua-demo") == 2
    # Low cardinality: no label carries an event id.
    event_ids = {c.event_id for c in (fallback, refused.completion)}
    assert not any(v in event_ids for key in after for _, v in key[1])


def test_unknown_event_outcomes_collapse_to_other(client: Any) -> None:
    before = scrape(client)
    metrics.count_event("some-new-code-123")
    after = scrape(client)
    assert delta(after, before, "execapp_events_total", outcome="other") == 1
    assert value(after, "execapp_events_total", outcome="some-new-code-123") == 0


# -- multiprocess mode: compaction of dead processes' files -------------------------------------

_CHILD = textwrap.dedent("""
    import os, sys
    from prometheus_client import Counter, Gauge, Histogram
    c = Counter("t_requests_total", "requests", ["kind"])
    h = Histogram("t_latency_seconds", "latency", buckets=(0.1, 1.0))
    live = Gauge("t_in_flight", "in flight", multiprocess_mode="livesum")
    peak = Gauge("t_peak", "peak", multiprocess_mode="max")
    n = int(sys.argv[1])
    c.labels("a").inc(n)
    h.observe(0.05 * n)
    live.set(n)
    peak.set(n)
    if sys.argv[2] == "crash":
        os._exit(0)  # no atexit: what a SIGKILLed worker leaves behind
    from execapp.metrics_multiprocess import mark_process_dead
    mark_process_dead(os.getpid())
""")


def _child(path: Path, n: int, how: str) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(path)}
    subprocess.run([sys.executable, "-c", _CHILD, str(n), how], cwd=ROOT, env=env, check=True, timeout=60)


def _collect(path: Path) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    out = {}
    for family in registry.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_compaction_merges_dead_processes_and_keeps_totals(tmp_path: Path) -> None:
    for n, how in ((1, "exit"), (2, "crash"), (3, "exit")):
        _child(tmp_path, n, how)
    files_before = sorted(os.path.basename(f) for f in glob.glob(str(tmp_path / "*.db")))
    assert len(files_before) >= 7  # a counter, histogram and max-gauge file per pid, plus a crash's live gauge
    before = _collect(tmp_path)

    result = compact(str(tmp_path))

    files_after = sorted(os.path.basename(f) for f in glob.glob(str(tmp_path / "*.db")))
    assert files_after == ["counter_archive.db", "gauge_max_archive.db", "histogram_archive.db"]
    assert result["merged"] == 9 and result["removed"] == 1
    after = _collect(tmp_path)
    requests, le_01 = ("t_requests_total", (("kind", "a"),)), ("t_latency_seconds_bucket", (("le", "0.1"),))
    assert after[requests] == 6 == before[requests]
    assert after[("t_latency_seconds_count", ())] == 3
    assert after[le_01] == 2 == before[le_01]  # 0.05 and 0.1
    assert after[("t_peak", ())] == 3
    assert not any(k[0] == "t_in_flight" for k in after)  # a dead process's live gauge is gone

    # A new generation of processes: the archive keeps accumulating; files do not pile up.
    _child(tmp_path, 4, "crash")
    compact(str(tmp_path))
    files_again = sorted(os.path.basename(f) for f in glob.glob(str(tmp_path / "*.db")))
    assert files_again == files_after
    assert _collect(tmp_path)[("t_requests_total", (("kind", "a"),))] == 10
    assert _collect(tmp_path)[("t_peak", ())] == 4


def test_compaction_leaves_live_processes_alone(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    live = subprocess.Popen([sys.executable, "-c", "from prometheus_client import Counter; import sys; "
                             "Counter('t_live_total', 'x').inc(5); print('up', flush=True); sys.stdin.read()"],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "up"
        compact(str(tmp_path))
        assert os.path.exists(tmp_path / f"counter_{live.pid}.db")
        assert _collect(tmp_path)[("t_live_total", ())] == 5
    finally:
        live.stdin.close()
        live.wait(10)


# -- end to end: two uvicorn worker processes, one /metrics, restarts without pile-up ------------

def _ws_load(ws_url: str, connections: int, per_connection: int) -> int:
    """Send /ping events over several real WebSocket connections; returns the dones received."""
    from websockets.sync.client import connect

    done = 0
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(connect(ws_url, open_timeout=10)) for _ in range(connections)]
        for ws in sockets:
            for _ in range(per_connection):
                ws.send('{"type": "message", "text": "/ping"}')
        for ws in sockets:
            seen = 0
            while seen < per_connection:
                frame = json.loads(ws.recv(timeout=30))
                seen += frame["type"] == "done"
            done += seen
    return done


def _scrape_until(url: str, name: str, expected: float) -> dict[tuple[str, tuple], float]:
    """Scrape until ``name`` reaches ``expected``: the workers that do not serve the scrape copy
    their counts into the shared files on their next tick (SNAPSHOT_SECONDS). A liveness bound,
    not a timing assertion."""
    scraped: list[dict[tuple[str, tuple], float]] = []
    wait_until(lambda: scraped.append(_scrape_http(url)) or scraped[-1].get((name, ())) == expected,
               LIVENESS, interval=0.2)  # each try is an HTTP scrape
    return scraped[-1]


def _scrape_http(url: str) -> dict[tuple[str, tuple], float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.e2e
def test_multiprocess_metrics_across_two_workers_and_a_restart(sqlite_env: dict[str, str], asgi_server_factory: Any,
                                                               tmp_path: Path) -> None:
    from tests.conftest import manage

    prom_dir = tmp_path / "prometheus"
    prom_dir.mkdir()
    env = {**sqlite_env, "PROMETHEUS_MULTIPROC_DIR": str(prom_dir)}
    assert manage("loadplugins", env=env).returncode == 0
    issued = manage("create_token", "metrics-e2e", env=env)
    token = issued.stdout.strip().splitlines()[-1]

    server = asgi_server_factory(env, workers=2)
    ws_url = f"{server.ws_url}/ws/events/?token={token}"
    assert _ws_load(ws_url, 6, 20) == 120
    first = _scrape_until(server.url, "execapp_events_dispatched_total", 120)
    # Whichever worker serves the scrape, the totals are the deployment's: every event counted once.
    assert first[("execapp_events_dispatched_total", ())] == 120
    assert first[("execapp_handler_runs_total", (("outcome", "ok"),))] == 120
    # One series per worker, labelled with its slot number (0 and 1), not its pid.
    capacity = {dict(k[1])["worker"]: v for k, v in first.items() if k[0] == "execapp_pool_capacity"}
    assert set(capacity) <= {"0", "1"} and sum(capacity.values()) in (64, 128)  # the workers that started a pool
    assert server.stop() is not None

    again = asgi_server_factory(env, workers=2)
    assert _ws_load(f"{again.ws_url}/ws/events/?token={token}", 2, 5) == 10  # starts a Worker: compaction
    second = _scrape_until(again.url, "execapp_events_dispatched_total", 130)
    # The first generation's pools left the live gauges (pruned at the scrape: uvicorn workers
    # end by re-raising SIGTERM, so no atexit hook runs), the new ones count.
    capacity = {dict(k[1])["worker"]: v for k, v in second.items() if k[0] == "execapp_pool_capacity"}
    assert set(capacity) <= {"0", "1"} and sum(capacity.values()) in (64, 128)  # same labels after the restart
    assert not any(p.name.startswith("gauge_livesum_") and int(p.name[14:-3]) not in _children(again.proc.pid)
                   for p in prom_dir.glob("gauge_livesum_*.db"))
    assert second[("execapp_events_dispatched_total", ())] == 130  # the first run's counts survived
    files = sorted(p.name for p in prom_dir.glob("*.db"))
    dead_pid_files = [n for n in files if "archive" not in n and n.rsplit("_", 1)[-1][:-3] not in
                      {str(pid) for pid in _children(again.proc.pid)}]
    assert dead_pid_files == [], files  # the first generation's files were merged into archives
    assert "counter_archive.db" in files


def _children(pid: int) -> set[int]:
    """Pids of ``pid``'s descendants (the uvicorn workers), read from /proc."""
    kids: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            child = int(stat.parent.name)
            kids |= {child} | _children(child)
    return kids


def test_series_of_disabled_or_deleted_plugins_are_left_out_of_a_scrape(metered_worker: worker_module.Worker,
                                                                         client: Any, install_worker: Any) -> None:
    """Multiprocess mode cannot unregister a series: /metrics leaves out every series of a plugin
    (or a plugin's matcher) that this worker no longer serves, and keeps the others."""
    install_worker(metered_worker)  # the serving process's worker: what it serves decides
    engine = metered_worker.engine
    engine.add(engine.make_matcher("command", "fast", _ok, name="demo.fast", plugin="demo"))
    metrics.HANDLER_FAILURES.labels("gone.run", "gone", "timeout").inc()
    metrics.HANDLER_FAILURES.labels("demo.fast", "demo", "timeout").inc()
    metrics.PROMOTIONS.labels("gone.run").inc()
    metrics.PLUGIN_BUSY.labels("gone").set(3)
    samples = scrape(client)
    names = {(name, dict(labels).get("plugin"), dict(labels).get("matcher")) for name, labels in samples}
    assert ("execapp_handler_failures_total", "demo", "demo.fast") in names
    assert ("execapp_plugin_instances_busy", "lua-demo", None) in names  # loaded (a plugin_pools row)
    assert not any(plugin == "gone" or matcher == "gone.run" for _, plugin, matcher in names)
    # The plugin is disabled: its pool row goes, and with it its series.
    PLUGIN_ROWS_BEFORE = list(PLUGIN_ROWS)
    PLUGIN_ROWS.clear()
    try:
        after = scrape(client)
    finally:
        PLUGIN_ROWS.extend(PLUGIN_ROWS_BEFORE)
    assert [k for k in after if dict(k[1]).get("plugin") == "lua-demo"] == []
    assert value(after, "execapp_handler_failures_total", matcher="demo.fast", plugin="demo", code="timeout") >= 1


_PLUGIN_CHILD = textwrap.dedent("""
    from prometheus_client import Counter
    c = Counter("t_failures_total", "failures", ["matcher", "plugin"])
    c.labels("gone.run", "gone").inc(3)
    c.labels("demo.fast", "demo").inc(2)
""")


def test_compaction_drops_the_archived_series_of_plugins_no_longer_served(tmp_path: Path) -> None:
    """Scrapes left a deleted plugin's series out, but its values stayed in the archive for ever,
    read by every scrape and growing with every plugin ever loaded. Now they are dropped."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _PLUGIN_CHILD], cwd=ROOT, env=env, check=True, timeout=60)
    compact(str(tmp_path))  # archived as it was: no filter
    assert _collect(tmp_path)[("t_failures_total", (("matcher", "gone.run"), ("plugin", "gone")))] == 3

    result = compact(str(tmp_path), keep=lambda labels: labels.get("plugin") != "gone")

    assert result["dropped"] == 1
    after = _collect(tmp_path)
    assert not any(dict(k[1]).get("plugin") == "gone" for k in after)
    assert after[("t_failures_total", (("matcher", "demo.fast"), ("plugin", "demo")))] == 2
    assert compact(str(tmp_path), keep=lambda labels: True)["dropped"] == 0


def test_a_deleted_plugin_s_series_are_forgotten_in_one_process(metered_worker: worker_module.Worker,
                                                                install_worker: Any) -> None:
    from execapp.metrics_updater import MetricsUpdater

    install_worker(metered_worker)
    engine = metered_worker.engine
    engine.add(engine.make_matcher("command", "fast", _ok, name="demo.fast", plugin="demo"))
    metrics.HANDLER_FAILURES.labels("gone.run", "gone", "timeout").inc()
    metrics.HANDLER_FAILURES.labels("demo.fast", "demo", "timeout").inc()
    metrics.PROMOTIONS.labels("gone.run").inc()
    metrics.PLUGIN_BUSY.labels("gone").set(3)
    updater = next(s for s in metered_worker.services if isinstance(s, MetricsUpdater))
    assert updater.forget_gone() >= 3
    children = {(c._name, k) for c in (metrics.HANDLER_FAILURES, metrics.PROMOTIONS, metrics.PLUGIN_BUSY)
                for k in c._metrics}
    assert not any("gone" in k or "gone.run" in k for _, k in children), children
    assert ("execapp_handler_failures", ("demo.fast", "demo", "timeout")) in children
