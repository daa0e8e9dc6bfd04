"""The metrics updater's batched histogram writes leave what one observe() per amount leaves."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from execapp.metrics_updater import observe_many

BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.1, 1.0, 10.0)
amounts = st.lists(st.one_of(st.floats(min_value=0, max_value=100, allow_nan=False), st.sampled_from(BUCKETS),
                             st.just(math.nan), st.just(math.inf), st.floats(max_value=0, allow_nan=False)),
                   max_size=60)


def samples(histogram: Histogram) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in histogram.collect() for s in m.samples
            if not s.name.endswith("_created")}


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@settings(max_examples=200, deadline=None)
@given(amounts)
def test_observe_many_leaves_what_observe_per_amount_leaves(values: list[float]) -> None:
    one = Histogram("one_seconds", "per amount", ["m"], buckets=BUCKETS, registry=CollectorRegistry())
    many = Histogram("one_seconds", "batched", ["m"], buckets=BUCKETS, registry=CollectorRegistry())
    child = one.labels("a")
    for v in values:
        child.observe(v)
    observe_many(many.labels("a"), values)
    expected, got = samples(one), samples(many)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert same(value, got[key]), (key, value, got[key])


def test_observe_many_on_an_unlabelled_histogram_counts_each_amount_in_its_bucket() -> None:
    h = Histogram("h_seconds", "unlabelled", buckets=BUCKETS, registry=CollectorRegistry())
    observe_many(h, [0.0001, 0.0002, 0.002, 5.0, 50.0])
    got = {dict(s.labels).get("le"): s.value for m in h.collect() for s in m.samples if s.name == "h_seconds_bucket"}
    assert got["0.0001"] == 1 and got["0.001"] == 2 and got["0.005"] == 3 and got["10.0"] == 4 and got["+Inf"] == 5


def test_done_tally_reaches_events_total_once_per_flush_and_on_every_scrape_refresh() -> None:
    from execapp import metrics
    from execapp.metrics_updater import refresh_local

    def count(outcome: str) -> float:
        return metrics.EVENTS.labels(outcome)._value.get()

    refresh_local()
    before = {o: count(o) for o in ("ok", "error")}
    metrics.DONE_TALLY[0] += 3
    metrics.DONE_TALLY[1] += 2
    assert {o: count(o) for o in before} == before  # the hot path wrote no counter
    refresh_local()  # what a scrape runs first
    assert {o: count(o) - before[o] for o in before} == {"ok": 3, "error": 2}
    metrics.flush_done()  # nothing new: nothing added twice
    assert {o: count(o) - before[o] for o in before} == {"ok": 3, "error": 2}
