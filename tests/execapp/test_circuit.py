"""A dependency known down fails at once (execapp/circuit.py), and the resend ledger uses it."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from execapp.circuit import Circuit, CircuitOpen

from .test_resilience import RedisServer, redis_server  # noqa: F401


def _down() -> None:
    raise ConnectionError("refused")


def test_a_failure_opens_the_circuit_then_one_call_tries_again_and_closes_it() -> None:
    circuit = Circuit("redis", (ConnectionError,), open_seconds=0.2)
    with pytest.raises(ConnectionError, match="refused"):
        circuit.call(_down)
    with pytest.raises(CircuitOpen, match=r"redis failed a moment ago \(ConnectionError: refused\)"):
        circuit.call(lambda: "not called")
    assert circuit.is_open and circuit.refused == 1
    time.sleep(0.25)
    assert circuit.call(lambda: "answered") == "answered"  # the probe: closes it
    assert not circuit.is_open and circuit.call(lambda: 1) == 1


def test_while_one_call_probes_the_others_fail_at_once() -> None:
    circuit = Circuit("redis", (ConnectionError,), open_seconds=0.0)
    with pytest.raises(ConnectionError):
        circuit.call(_down)

    def slow_probe() -> str:
        with pytest.raises(CircuitOpen):
            circuit.call(lambda: "a second caller")
        return "probe"

    assert circuit.call(slow_probe) == "probe"
    assert circuit.refused == 1


def test_an_error_of_another_kind_means_the_dependency_answered() -> None:
    circuit = Circuit("redis", (ConnectionError,))
    with pytest.raises(ConnectionError):
        circuit.call(_down)
    circuit._open_until = 1.0  # lapsed: the next call probes
    with pytest.raises(ValueError):
        circuit.call(lambda: int("x"))
    assert not circuit.is_open


@pytest.mark.redis
def test_claims_queued_behind_a_hung_redis_fail_at_once(redis_server: RedisServer, settings: Any) -> None:  # noqa: F811
    # 30 connections sending "resend": true events while Redis was paused got resend_unavailable only
    # after up to 10 s: their claims (2 s socket timeout each) queued on the loop's 6 executor threads.
    from execapp.resend import RedisLedger

    ledger = RedisLedger(redis_server.url)
    redis_server.client().execute_command("CLIENT", "PAUSE", 8000, "ALL")  # our own redis-server: hung

    def claim(i: int) -> str:
        try:
            ledger.claim("owner", f"id{i}", "w", 3.0)
            return "claimed"
        except Exception as exc:
            return type(exc).__name__

    started = time.monotonic()
    with ThreadPoolExecutor(6) as threads:  # the event loop's default executor on 2 cores
        outcomes = list(threads.map(claim, range(30)))
    assert time.monotonic() - started < 4.0  # without the circuit: 5 rounds of 2 s
    assert "claimed" not in outcomes and outcomes.count("CircuitOpen") >= 20, outcomes
