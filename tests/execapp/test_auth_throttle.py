"""Failed authentications per client network (execapp/auth_throttle.py): buckets, networks, bounds."""
from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from execapp.auth_throttle import AuthThrottle, client_network


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_network_is_judged_for_its_burst_of_failures_then_waits_for_them_to_refill() -> None:
    clock = Clock()
    throttle = AuthThrottle(burst=3, per_minute=60, clock=clock)  # one failure back a second
    for _ in range(3):
        assert throttle.retry_after("203.0.113.9") == 0
        throttle.failed("203.0.113.9")
    assert throttle.retry_after("203.0.113.9") == 1.0
    assert throttle.retry_after("198.51.100.7") == 0  # another network is not held
    clock.now += 0.5
    assert throttle.retry_after("203.0.113.9") == 0.5  # waiting unjudged takes nothing more
    clock.now += 0.5
    assert throttle.retry_after("203.0.113.9") == 0
    throttle.failed("203.0.113.9")
    assert throttle.retry_after("203.0.113.9") > 0
    assert throttle.refused == 3
    clock.now += 10
    assert throttle.retry_after("203.0.113.9") == 0 and len(throttle) == 0  # refilled: forgotten


def test_off_at_burst_zero_and_for_an_unknown_address() -> None:
    off = AuthThrottle(burst=0, per_minute=30)
    on = AuthThrottle(burst=1, per_minute=30)
    for _ in range(100):
        off.failed("203.0.113.9")
        on.failed(None)
    assert off.retry_after("203.0.113.9") == 0 and on.retry_after(None) == 0 and len(off) == len(on) == 0


def test_the_table_keeps_at_most_max_networks_the_least_recently_seen_forgotten() -> None:
    throttle = AuthThrottle(burst=1, per_minute=1, max_networks=100, clock=Clock())
    for n in range(1000):
        throttle.failed(f"10.0.{n // 256}.{n % 256}")
    assert len(throttle) == 100
    assert throttle.retry_after("10.0.3.231") > 0  # the newest are remembered
    assert throttle.retry_after("10.0.0.0") == 0


def test_a_network_is_an_ipv4_address_or_an_ipv6_slash_64() -> None:
    def net(host: str) -> str | None:
        return client_network({"client": (host, 1234)})

    assert net("203.0.113.9") == "203.0.113.9"
    assert net("2001:db8:1:2:aaaa::1") == net("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert net("2001:db8:1:3::1") != net("2001:db8:1:2::1")
    assert net("::ffff:203.0.113.9") == "203.0.113.9"  # an IPv4 client on a dual-stack socket
    assert net("not-an-address") is None and client_network({}) is None
    assert client_network({"client": None}) is None


@settings(max_examples=200, deadline=None)
@given(burst=st.integers(1, 20), per_minute=st.floats(1, 600),
       steps=st.lists(st.floats(0, 5), min_size=1, max_size=300))
def test_judged_failures_never_exceed_the_burst_plus_what_the_rate_earned(burst: int, per_minute: float,
                                                                          steps: list[float]) -> None:
    """A client retrying bad credentials at any pace: the failures judged by time t are at most
    burst + rate * t (each judged handshake fails: the worst case)."""
    clock = Clock()
    start = clock.now
    throttle = AuthThrottle(burst=burst, per_minute=per_minute, clock=clock)
    judged = 0
    for step in steps:
        clock.now += step
        if throttle.retry_after("203.0.113.9") == 0:
            throttle.failed("203.0.113.9")
            judged += 1
        assert judged <= burst + (clock.now - start) * per_minute / 60 + 1e-9


def test_manage_py_check_names_a_bad_throttle_setting_and_its_fix(settings: Any) -> None:
    from execapp.checks import check_execapp_settings

    def ids() -> list[str]:
        return [e.id for e in check_execapp_settings() if e.id in ("execapp.E093", "execapp.E094")]

    assert ids() == []
    settings.EXECAPP = {"AUTH_FAILURES_BURST": -1, "AUTH_FAILURES_PER_MINUTE": 0}
    assert ids() == ["execapp.E093", "execapp.E094"]
    settings.EXECAPP = {"AUTH_FAILURES_BURST": 0, "AUTH_FAILURES_PER_MINUTE": 0.5}  # off is allowed
    assert ids() == []
