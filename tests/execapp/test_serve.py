"""The server's own configuration (execapp.serve.make_config)."""
from __future__ import annotations

from typing import Any

import pytest

from execapp import conf, serve


def test_the_server_reads_no_websocket_message_far_past_the_apps_frame_limit(settings: Any) -> None:
    # uvicorn's default (16 MiB) let a client that never reads park 16 MiB frames in the worker;
    # then a 1 MiB floor let one owner's 1000 connections park ~1 GiB of half-received frames.
    settings.EXECAPP = {"MAX_FRAME_BYTES": 300_000}
    assert serve.make_config(serve.build_parser().parse_args([])).ws_max_size == 600_000
    settings.EXECAPP = {}  # the default 64 KiB: twice that, no floor
    config = serve.make_config(serve.build_parser().parse_args([]))
    assert config.ws_max_size == 128 * 1024
    # One owner's connections on one worker, each with a message half received.
    assert config.ws_max_size * conf.DEFAULTS["MAX_CONNECTIONS_PER_OWNER"] <= 128 * 1024 * 1024


def test_the_server_runs_the_protocol_with_the_header_deadline_and_refuses_unusable_limits(settings: Any) -> None:
    from execapp.handshake import HandshakeDeadlineProtocol

    args = serve.build_parser().parse_args([])
    assert serve.make_config(args).http is HandshakeDeadlineProtocol
    for bad in ({"HANDSHAKE_TIMEOUT_SECONDS": 0}, {"MAX_PENDING_CONNECTIONS": "many"}):
        settings.EXECAPP = bad
        with pytest.raises(SystemExit, match=next(iter(bad))):
            serve.make_config(args)
