"""The embedded default's channel layer (execapp/channel_layer.py): a session's fan-out costs O(members)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest
from channels.layers import InMemoryChannelLayer as ChannelsInMemoryChannelLayer

from execapp import channel_layer
from execapp.channel_layer import InMemoryChannelLayer


async def _members(layer: InMemoryChannelLayer, n: int, group: str = "room") -> list[str]:
    names = [await layer.new_channel() for _ in range(n)]
    for name in names:
        await layer.group_add(group, name)
    return names


def test_the_embedded_default_uses_it() -> None:
    # The project's settings without REDIS_URL (this run may have one): read in a process of their own.
    env = {**os.environ, "REDIS_URL": "", "DJANGO_SETTINGS_MODULE": "config.settings"}
    out = subprocess.run([sys.executable, "-c", "from django.conf import settings; "
                          "print(settings.CHANNEL_LAYERS['default']['BACKEND'])"],
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert out == "execapp.channel_layer.InMemoryChannelLayer"


async def test_a_group_send_reaches_every_member_once_each_with_its_own_copy() -> None:
    layer = InMemoryChannelLayer()
    names = await _members(layer, 100)
    await layer.group_send("room", {"type": "session.frame", "frame": "x"})
    got = [await asyncio.wait_for(layer.receive(name), 1) for name in names]
    assert all(m == {"type": "session.frame", "frame": "x"} for m in got)
    got[0]["frame"] = "changed"  # one member's copy is its own
    assert got[1]["frame"] == "x"
    assert all(layer.channels.get(name) is None or layer.channels[name].empty() for name in names)


async def test_a_full_member_misses_the_message_and_the_others_get_it() -> None:
    layer = InMemoryChannelLayer(capacity=1)
    full, other = await _members(layer, 2)
    await layer.send(full, {"type": "session.frame", "frame": "first"})
    await layer.group_send("room", {"type": "session.frame", "frame": "second"})
    assert (await layer.receive(full))["frame"] == "first" and layer.channels.get(full) is None
    assert (await layer.receive(other))["frame"] == "second"


@pytest.mark.parametrize("layer_class, most_sweeps", [(InMemoryChannelLayer, 1), (ChannelsInMemoryChannelLayer, None)])
async def test_receives_and_group_sends_sweep_the_layer_at_most_once_a_second(
        monkeypatch: pytest.MonkeyPatch, layer_class: type, most_sweeps: int | None) -> None:
    # Channels' layer swept every channel and membership on every receive and group send: one frame
    # to 300 members was 300 sweeps of 300, 41% of a worker's loop in a fan-out (a scratch script).
    sweeps = [0]
    real = ChannelsInMemoryChannelLayer._clean_expired

    def counted(self: Any) -> None:
        sweeps[0] += 1
        real(self)

    monkeypatch.setattr(ChannelsInMemoryChannelLayer, "_clean_expired", counted)
    layer = layer_class()
    names = await _members(layer, 50)
    await layer.group_send("room", {"type": "session.frame", "frame": "x"})
    for name in names:
        await layer.receive(name)
    if most_sweeps is None:  # the baseline, to show what is counted
        assert sweeps[0] >= 51
    else:
        assert sweeps[0] <= most_sweeps


async def test_a_group_send_to_many_members_lets_the_loop_run_other_work_between_slices() -> None:
    # All of one frame's deliveries ran in one loop turn: with 300 members another client's frame
    # waited behind ~20-40 ms of them (its /ping's median went from 1.3 to ~25 ms in a scratch run).
    layer = InMemoryChannelLayer()
    await _members(layer, 10 * channel_layer.DELIVERIES_PER_TURN)
    turns = [0]
    done = asyncio.Event()

    async def other_client() -> None:
        while not done.is_set():
            turns[0] += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_client())
    await asyncio.sleep(0)
    before = turns[0]
    await layer.group_send("room", {"type": "session.frame", "frame": "x"})
    done.set()
    await task
    assert turns[0] - before >= 9, "the other task did not run between the slices of one group send"
