"""ExecProfile: every promotion/demotion rule of docs/architecture.md ("Design rules"), driven with
synthetic durations.

Durations are fed to ``record`` directly, so no test depends on how fast this machine is.
Defaults: window 32, slow threshold 50 ms, promote at once over 100 ms, fast below 25 ms,
demotion needs the last 10 runs fast, p50 needs at least 10 samples.
"""
from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from execapp.engine import ConfigError, ExecClass, ExecProfile, ProfileState
from execapp.engine import profile as profile_module
from execapp.engine.profile import RECOVERY_DOUBLINGS

FAST = 0.001  # well under the fast threshold (25 ms)
MID = 0.030  # between fast (25 ms) and slow (50 ms): neither
SLOW = 0.060  # over the slow threshold, under the 100 ms outlier rule
OUTLIER = 0.150  # over 2x threshold: promotes at once


def feed(p: ExecProfile, elapsed: float, n: int = 1) -> None:
    for _ in range(n):
        p.record(elapsed)


def demoted() -> ExecProfile:
    p = ExecProfile()
    feed(p, FAST, 32)
    assert p.state is ProfileState.DEMOTED
    return p


# -- learning: every handler is suspected slow until proven fast ------------------------------------

def test_new_profile_pools():
    p = ExecProfile()
    assert p.state is ProfileState.LEARNING
    assert p.should_pool() is ExecClass.POOL


def test_fast_runs_short_of_a_full_window_still_pool():
    p = ExecProfile()
    feed(p, FAST, 31)
    assert p.should_pool() is ExecClass.POOL
    assert p.state is ProfileState.LEARNING
    p.record(FAST)  # the 32nd fills the window
    assert p.should_pool() is ExecClass.SYNC
    assert p.state is ProfileState.DEMOTED
    assert p.demotions == 1


def test_p50_promotion_needs_min_samples():
    p = ExecProfile()  # min_samples=10
    feed(p, SLOW, 9)
    assert p.state is ProfileState.LEARNING, "9 samples are too few to judge p50"
    p.record(SLOW)
    assert p.state is ProfileState.PROMOTED
    assert p.should_pool() is ExecClass.POOL
    assert p.promotions == 1


def test_min_samples_is_a_constructor_argument():
    p = ExecProfile(min_samples=3)
    feed(p, SLOW, 2)
    assert p.state is ProfileState.LEARNING
    p.record(SLOW)
    assert p.state is ProfileState.PROMOTED


def test_p50_at_threshold_promotes_and_below_does_not():
    # 10 samples: p50 (upper median, nearest rank) is slow once 5 of them are slow.
    p = ExecProfile()
    feed(p, FAST, 6)
    feed(p, SLOW, 4)
    assert p.state is ProfileState.LEARNING  # 4 of 10 slow: p50 fast
    p.record(SLOW)  # 5 of 11: upper median of 11 is the 6th smallest: still fast
    assert p.state is ProfileState.LEARNING
    p.record(SLOW)  # 6 of 12: the 7th smallest of 12 is slow
    assert p.state is ProfileState.PROMOTED


def test_exactly_the_threshold_counts_as_slow():
    p = ExecProfile()
    feed(p, 0.050, 10)
    assert p.state is ProfileState.PROMOTED


# -- demotion: the strict rule ----------------------------------------------------------------------

def test_demotion_needs_p50_under_half_the_threshold():
    p = ExecProfile()
    feed(p, MID, 16)  # 30 ms: not slow, not fast
    feed(p, FAST, 16)  # window full, last 16 fast, but p50 (17th smallest) is 30 ms
    assert p.state is ProfileState.LEARNING
    assert p.should_pool() is ExecClass.POOL
    p.record(FAST)  # evicts one 30 ms sample: 15 MID, 17 FAST -> p50 fast
    assert p.state is ProfileState.DEMOTED


def test_demotion_needs_each_of_the_last_ten_runs_fast():
    p = ExecProfile()
    feed(p, FAST, 31)
    p.record(MID)  # full window, p50 fast, but the latest run was not fast
    assert p.state is ProfileState.LEARNING
    feed(p, FAST, 9)
    assert p.state is ProfileState.LEARNING, "only 9 fast runs since the last slow one"
    p.record(FAST)
    assert p.state is ProfileState.DEMOTED


def test_recent_and_window_are_constructor_arguments():
    p = ExecProfile(window=8, recent=3, min_samples=4)
    feed(p, FAST, 7)
    assert p.state is ProfileState.LEARNING
    p.record(FAST)
    assert p.state is ProfileState.DEMOTED
    p = ExecProfile(window=8, recent=3, min_samples=4, slow_threshold=0.010)
    feed(p, 0.004, 8)  # under a 10 ms threshold, fast means < 5 ms: 4 ms is fast
    assert p.state is ProfileState.DEMOTED
    p = ExecProfile(window=8, recent=3, min_samples=4, slow_threshold=0.010)
    feed(p, 0.006, 8)  # ...and 6 ms is not
    assert p.state is ProfileState.LEARNING


# -- the asymmetry: one very slow run promotes at once ---------------------------------------------

def test_one_outlier_promotes_a_learning_profile_at_once():
    p = ExecProfile()
    p.record(OUTLIER)
    assert p.state is ProfileState.PROMOTED
    assert p.should_pool() is ExecClass.POOL


def test_one_outlier_promotes_a_demoted_profile_and_clears_demotion():
    p = demoted()
    p.record(OUTLIER)
    assert p.state is ProfileState.PROMOTED
    assert p.should_pool() is ExecClass.POOL
    assert p.promotions == 1 and p.demotions == 1


def test_a_run_at_exactly_twice_the_threshold_is_not_an_outlier():
    p = demoted()
    p.record(0.100)  # "over 100 ms" promotes at once; 100 ms itself is only one slow sample
    assert p.state is ProfileState.DEMOTED


def test_one_slow_run_does_not_undo_demotion_but_one_outlier_does():
    # Asymmetric on purpose: it takes 32 fast runs to demote, one >2x run to promote.
    p = demoted()
    p.record(SLOW)
    assert p.state is ProfileState.DEMOTED
    p.record(OUTLIER)
    assert p.state is ProfileState.PROMOTED


def test_promote_after_is_a_constructor_argument():
    p = ExecProfile(slow_threshold=0.050, promote_after=0.500)
    p.record(OUTLIER)  # 150 ms < 500 ms: no longer an outlier
    assert p.state is ProfileState.LEARNING


# -- improvement 1: recovery after promotion, judged only on post-promotion samples -----------------

def test_promoted_profile_recovers_only_on_a_full_window_of_post_promotion_samples():
    p = demoted()  # a window of fast history...
    p.record(OUTLIER)  # ...then one outlier promotes
    assert p.state is ProfileState.PROMOTED
    feed(p, FAST, 31)
    # Judged on the whole window (31 fast + 1 outlier), p50 and the last 10 would allow demotion
    # long ago; judged on post-promotion samples only, the window is not yet full.
    assert p.state is ProfileState.PROMOTED
    assert p.should_pool() is ExecClass.POOL
    # Its second demotion: it needs two windows of fresh runs (see the next test).
    feed(p, FAST, p.recovery_needed - 31 - 1)
    assert p.state is ProfileState.PROMOTED
    p.record(FAST)
    assert p.state is ProfileState.DEMOTED
    assert p.should_pool() is ExecClass.SYNC
    assert p.demotions == 2


def test_each_demotion_doubles_the_fresh_runs_the_next_one_needs_up_to_a_cap():
    # A handler fast on 32 events and slow on a crafted 33rd came back inline after every 32
    # fast runs, to hold the loop its whole inline budget again: the attacker's pace, forever.
    p = ExecProfile(window=4, recent=2, min_samples=2)
    needed = []
    for _ in range(RECOVERY_DOUBLINGS + 3):
        runs = 0
        while p.state is not ProfileState.DEMOTED:
            p.record(FAST)
            runs += 1
        needed.append(runs)
        p.record(OUTLIER)  # the crafted event: promoted again
    assert needed[:4] == [4, 8, 16, 32]
    assert needed[-1] == needed[-2] == 4 << RECOVERY_DOUBLINGS
    assert p.snapshot()["recovery_needed"] == 4 << RECOVERY_DOUBLINGS


def test_promoted_profile_window_is_fresh():
    p = ExecProfile()
    feed(p, FAST, 20)
    p.record(OUTLIER)
    assert p.samples() == [OUTLIER], "promotion starts a fresh window with the run that caused it"
    p.record(FAST)
    assert p.samples() == [OUTLIER, FAST]


def test_an_always_slow_promoted_handler_keeps_a_full_window_to_report():
    p = ExecProfile()
    feed(p, OUTLIER, 40)
    assert p.state is ProfileState.PROMOTED and p.promotions == 1
    snap = p.snapshot()
    assert snap["window"] == [OUTLIER] * 32 and snap["p50"] == OUTLIER


def test_promoted_by_p50_recovers_by_the_same_strict_rule():
    p = ExecProfile()
    feed(p, SLOW, 10)
    assert p.state is ProfileState.PROMOTED
    feed(p, MID, 22)
    feed(p, FAST, 10)  # full window of post-promotion samples, last 10 fast, but p50 is 30 ms
    assert p.state is ProfileState.PROMOTED
    feed(p, FAST, 6)  # 16 MID + 16 FAST: the 17th smallest is still MID
    assert p.state is ProfileState.PROMOTED
    p.record(FAST)
    assert p.state is ProfileState.DEMOTED


def test_promoted_profile_with_a_recent_slow_run_does_not_recover():
    p = ExecProfile()
    p.record(OUTLIER)
    feed(p, FAST, 31)
    p.record(MID)
    assert p.state is ProfileState.PROMOTED
    feed(p, FAST, 9)
    assert p.state is ProfileState.PROMOTED
    p.record(FAST)
    assert p.state is ProfileState.DEMOTED


def test_an_outlier_while_promoted_restarts_the_recovery_window():
    p = ExecProfile()
    p.record(OUTLIER)
    feed(p, FAST, 31)
    p.record(OUTLIER)
    feed(p, FAST, 31)
    assert p.state is ProfileState.PROMOTED
    assert p.promotions == 1, "staying promoted is not a new promotion"
    p.record(FAST)
    assert p.state is ProfileState.DEMOTED


# -- improvement 2: a demoted handler notices steady drift ------------------------------------------

def test_demoted_profile_promotes_on_steady_drift_without_any_outlier():
    p = demoted()
    feed(p, SLOW, 15)  # 15 of 32 slow: p50 is still fast
    assert p.state is ProfileState.DEMOTED
    assert p.should_pool() is ExecClass.SYNC
    p.record(SLOW)  # 16 of 32: the upper median (17th smallest) is slow -> p50 >= threshold
    assert p.state is ProfileState.PROMOTED
    assert p.should_pool() is ExecClass.POOL


def test_drift_just_under_the_threshold_keeps_demotion():
    p = demoted()
    feed(p, 0.049, 200)  # slower than fast, never slow: the handler stays inline
    assert p.state is ProfileState.DEMOTED


def test_demoted_record_does_no_percentile_work(monkeypatch):
    calls = []
    real_sorted = sorted

    def counting_sorted(*args, **kwargs):
        calls.append(1)
        return real_sorted(*args, **kwargs)

    monkeypatch.setattr(profile_module, "sorted", counting_sorted, raising=False)
    monkeypatch.setattr(profile_module, "_pct", lambda *a: calls.append(1), raising=True)
    p = demoted()
    feed(p, FAST, 500)
    feed(p, SLOW, 10)
    assert p.state is ProfileState.DEMOTED
    assert calls == [], "record() must stay O(1): no sorting or percentile per call"


# -- bookkeeping -------------------------------------------------------------------------------------

def test_errors_and_timeouts_are_counted():
    p = ExecProfile()
    p.record(FAST, error="boom")
    p.record(FAST, error="late", timeout=True)
    p.record(FAST)
    assert (p.runs, p.errors, p.timeouts, p.last_error) == (3, 2, 1, "late")


def test_a_fast_timeout_proves_nothing_and_promotes_at_once():
    # A 10 ms plugin budget times out in 10 ms: counted as fast, such runs would demote the
    # handler onto the loop, where it would time out again. A timeout is an outlier.
    p = demoted()
    p.record(FAST, error="late", timeout=True)
    assert p.state is ProfileState.PROMOTED and p.should_pool() is ExecClass.POOL
    for _ in range(p.window - 1):
        p.record(FAST)
    p.record(FAST, error="late", timeout=True)  # promoted: recovery starts counting again
    for _ in range(p.window - 1):
        p.record(FAST)
    assert p.state is ProfileState.PROMOTED


def test_note_error_counts_a_failure_without_a_sample():
    p = demoted()
    runs, window = p.runs, p.samples()
    p.note_error("event data could not be copied")
    assert (p.runs, p.errors, p.samples()) == (runs, 1, window)
    assert p.last_error == "event data could not be copied" and p.state is ProfileState.DEMOTED


def test_concurrent_record_keeps_counts_exact():
    p = ExecProfile()
    threads, per_thread = 8, 4000
    values = [FAST, SLOW, MID, FAST, OUTLIER, FAST, FAST, MID]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # force thread switches inside record()
    try:
        start = threading.Barrier(threads)

        def hammer(i: int) -> None:
            start.wait()
            for k in range(per_thread):
                p.record(values[(i + k) % len(values)], error="e" if k % 7 == 0 else None)

        workers = [threading.Thread(target=hammer, args=(i,)) for i in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert p.runs == threads * per_thread
    assert p.errors == threads * len(range(0, per_thread, 7))
    assert p.version == threads * per_thread
    # The running counts behind the O(1) rules must still agree with the window itself.
    window = p.samples()
    assert p._count == len(window)
    assert p._n_slow == sum(s >= p.slow_threshold for s in window)
    assert p._n_not_fast == sum(s >= p.fast_threshold for s in window)


class _Preemptible(ExecProfile):
    """A profile whose threshold reads give the GIL away, so racing record() calls interleave
    inside the window update (on CPython's GIL a plain read never switches threads there)."""

    @property
    def fast_threshold(self) -> float:
        time.sleep(0)
        return self._fast

    @fast_threshold.setter
    def fast_threshold(self, value: float) -> None:
        self._fast = value


def test_concurrent_record_with_preemption_inside_the_update_stays_consistent():
    p = _Preemptible()
    threads, per_thread = 6, 1500
    start = threading.Barrier(threads)

    def hammer(i: int) -> None:
        start.wait()
        for k in range(per_thread):
            p.record((FAST, SLOW, MID)[(i + k) % 3])

    workers = [threading.Thread(target=hammer, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert p.runs == threads * per_thread
    window = p.samples()
    assert p._count == len(window) <= p.window
    assert p._n_slow == sum(s >= p.slow_threshold for s in window)
    assert p._n_not_fast == sum(s >= p._fast for s in window)


@pytest.mark.parametrize("history", [
    [],
    [FAST] * 5,
    [FAST] * 32,  # demoted
    [FAST] * 40 + [SLOW] * 3,  # demoted with some drift
    [SLOW] * 10 + [FAST] * 7,  # promoted, recovering
    [OUTLIER],
])
def test_restore_round_trips_snapshot(history):
    original = ExecProfile()
    feed_all = [original.record(v) for v in history]
    assert len(feed_all) == len(history)
    snap = json.loads(json.dumps(original.snapshot()))  # what the persistence layer stores
    copy = ExecProfile()
    copy.restore(**snap)
    assert copy.snapshot() == original.snapshot()
    assert copy.should_pool() is original.should_pool()
    # ...and it goes on to make the same decisions (the derived counts were rebuilt).
    for v in [FAST] * 40 + [SLOW] * 20 + [FAST] * 40:
        original.record(v)
        copy.record(v)
        assert (copy.state, copy.should_pool()) == (original.state, original.should_pool())


def test_snapshot_reports_percentiles():
    p = ExecProfile()
    for v in [0.001 * i for i in range(1, 11)]:
        p.record(v)
    snap = p.snapshot()
    assert snap["p50"] == pytest.approx(0.006)
    assert snap["p99"] == pytest.approx(0.010)
    assert snap["state"] == "learning" and snap["exec_class"] == "pool" and snap["runs"] == 10


@pytest.mark.parametrize("kwargs", [
    {"window": 0}, {"recent": 0}, {"min_samples": 0}, {"window": 8, "recent": 9},
    {"window": 8, "min_samples": 9}, {"slow_threshold": 0}, {"fast_threshold": 0.06},
    {"promote_after": 0.04}, {"fast_threshold": 0},
])
def test_impossible_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        ExecProfile(**kwargs)


# -- pinned to the pool by its owner (a plugin's large memory cap) ---------------------------------

def test_a_pool_only_profile_never_runs_inline_whatever_it_proves_and_relearns_once_unpinned():
    p = demoted()
    p.pin_to_pool("memory cap too large")
    assert p.should_pool() is ExecClass.POOL and p.inline_limit == -1 and p.state is ProfileState.PROMOTED
    feed(p, FAST, 200)  # fast forever: still never inline
    assert p.should_pool() is ExecClass.POOL and p.snapshot()["pool_only"] == "memory cap too large"
    p.pin_to_pool(None)  # its cap was lowered: the usual rules, from a fresh window
    assert p.should_pool() is ExecClass.POOL and p.snapshot()["pool_only"] is None
    feed(p, FAST, 32)
    assert p.should_pool() is ExecClass.SYNC


def test_a_pool_only_profile_restored_as_demoted_stays_in_the_pool():
    p = ExecProfile()
    p.pin_to_pool("memory cap too large")
    p.restore("demoted", [FAST] * 32)
    assert p.should_pool() is ExecClass.POOL and p.inline_limit == -1
