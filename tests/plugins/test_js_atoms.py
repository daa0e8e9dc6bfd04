"""Object keys that crowd one bucket of QuickJS's atom table: refused before the native parse walks it.

A client's event data reached every JS plugin through one native JSON.parse: a 62 KB frame of
4,800 keys in one bucket ran ~170-200 ms of that one call (4 ms for other keys), no deadline
polled. And the guest's own JSON.parse guard counted keys of one whole hash: 4-character keys
have few hashes, so 4,800 keys of 58 hashes (83 each, under its 128) crowded one bucket for
~230 ms and passed it (measured on the 2-core dev machine, Dec 2026).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from typing import Iterator

import pytest

from execapp.engine import HandlerError
from plugins.runtimes.js_atoms import COLLIDING, FEW_KEYS, atom_bucket, crowded_keys
from tests.plugins.test_js_containment import Worker, make

CODE = ("function keys(e) { return 'ok ' + Object.keys(e.data).length; }"
        " function parsed(e) { return 'ok ' + Object.keys(JSON.parse(e.text)).length; }"
        " function ok(e) { return 'fine'; }")
_PRINTABLE = [chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"\\:']  # (no colon: counted as a key's)


def crowding_keys(n: int) -> list[str]:
    """``n`` distinct 4-character keys whose QuickJS atom hashes share their low 16 bits (one
    bucket of any table up to 65,536), of a few dozen whole hashes (fewer than 128 keys each)."""
    out = []
    for c0 in _PRINTABLE:
        for c1 in _PRINTABLE:
            for c2 in _PRINTABLE:
                h = 1
                for c in (c0, c1, c2):
                    h = (h * 263 + ord(c)) & 0xFFFFFFFF
                last = (0x1234 - h * 263) & 0xFFFF
                if last < 0x100 or 0xD800 <= last <= 0xDFFF:
                    continue
                out.append(c0 + c1 + c2 + chr(last))
                if len(out) == n:
                    return out
    raise AssertionError("not enough keys")


def whole_hash(key: str) -> int:
    h = 1
    for c in key:
        h = (h * 263 + ord(c)) & 0xFFFFFFFF
    return h & 0x3FFFFFFF


def engine_event(data: dict, text: str = "/x") -> dict:
    """An event as the engine hands it to a runtime (Event.to_dict() and args)."""
    return {"id": "e1", "type": "message", "text": text, "args": "", "data": data, "session": None, "tenant": "t"}


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


def test_the_crowding_keys_share_a_bucket_and_no_whole_hash_past_the_old_guard() -> None:
    keys = crowding_keys(4800)
    assert len({atom_bucket(k) for k in keys}) == 1
    assert max(Counter(whole_hash(k) for k in keys).values()) <= COLLIDING  # what the whole-hash count let through
    frame = json.dumps({"text": "/upper hi", "data": dict.fromkeys(keys, 0)}, ensure_ascii=False, separators=(",", ":"))
    assert len(frame.encode()) <= 64 * 1024  # one frame within MAX_FRAME_BYTES


@pytest.mark.parametrize("shape", ["engine", "other"])
def test_event_data_crowding_one_bucket_is_refused_before_it_crosses(worker: Worker, shape: str) -> None:
    plugin = make("pooled", code=CODE, timeout=5.0)
    data = dict.fromkeys(crowding_keys(4800), 0)
    event = engine_event(data)
    if shape == "other":  # an event of another shape crosses whole, as one JSON text
        del event["tenant"]
    try:
        def call() -> tuple[object, float]:
            started = time.thread_time()
            try:
                outcome: object = plugin.call("keys", event)
            except HandlerError as exc:
                outcome = exc
            return outcome, time.thread_time() - started

        outcome, cpu = worker.run(call, 5.0)
        # Unrefused, the one native parse took ~170-200 ms of this thread and answered "ok 4800".
        assert isinstance(outcome, HandlerError), outcome
        assert "share one bucket" in str(outcome) and "send other keys" in str(outcome)
        assert cpu < 0.1, cpu
        assert plugin.call("ok", engine_event({})) == "fine"  # the plugin serves on
    finally:
        plugin.close()


def test_ordinary_keys_cross_as_before(worker: Worker) -> None:
    plugin = make("pooled", code=CODE, timeout=5.0)
    try:
        for keys in ([f"k{i}" for i in range(10_000)], [f"user_{i:05d}" for i in range(5_000)],
                     [str(i) for i in range(10_000)]):
            assert worker.run(lambda keys=keys: plugin.call("keys", engine_event(dict.fromkeys(keys, 0))),
                              5.0) == f"ok {len(keys)}"
    finally:
        plugin.close()


def test_the_guest_s_json_parse_counts_keys_by_bucket(worker: Worker) -> None:
    plugin = make("pooled", code=CODE, timeout=5.0)
    text = json.dumps(dict.fromkeys(crowding_keys(4800), 0), ensure_ascii=False, separators=(",", ":"))
    try:
        def call() -> object:
            try:
                return plugin.call("parsed", engine_event({}, text))
            except HandlerError as exc:
                return exc

        outcome = worker.run(call, 5.0)
        assert isinstance(outcome, HandlerError) and "distinct keys in one bucket" in str(outcome), outcome
    finally:
        plugin.close()


def test_what_is_not_counted() -> None:
    keys = crowding_keys(FEW_KEYS + 1)
    few = dict.fromkeys(keys[:FEW_KEYS], 0)  # at most FEW_KEYS keys: not walked, however they crowd
    assert crowded_keys(few, json.dumps(few)) is None
    nested = {"a": [{k: 0} for k in keys]}  # nested objects count, each distinct key once
    assert crowded_keys(nested, json.dumps(nested)) is not None
    plain = dict.fromkeys([f"k{i}" for i in range(FEW_KEYS)], 0)
    # (a few plain keys may share the bucket: 16 short of the limit)
    repeated = {"a": [{**plain, **dict.fromkeys(keys[:COLLIDING - 16], 0)} for _ in range(3)]}
    assert crowded_keys(repeated, json.dumps(repeated)) is None
