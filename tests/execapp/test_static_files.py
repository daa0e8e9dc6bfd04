"""Static files served by the app (execapp/static_files.py): a path out of the static directories
is a 404, not a 500 with a traceback in the log."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from channels.testing import HttpCommunicator

from config.asgi import application


def _get(path: str) -> dict[str, Any]:
    return asyncio.run(HttpCommunicator(application, "GET", path).get_response(timeout=10))


@pytest.mark.parametrize("path", ["/static/../config/settings.py", "/static/admin/../../../../etc/passwd",
                                  "/static/%2e%2e/config/settings.py"])
def test_a_path_out_of_the_static_directories_is_not_found(path: str, caplog: Any) -> None:
    with caplog.at_level(logging.DEBUG):
        response = _get(path)
    assert response["status"] == 404, response["status"]
    assert b"SECRET_KEY" not in response["body"] and b"root:" not in response["body"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]


def test_a_static_file_is_served() -> None:
    communicator = HttpCommunicator(application, "GET", "/static/execapp/dashboard.js")

    async def start() -> dict[str, Any]:
        await communicator.send_input({"type": "http.request", "body": b""})
        return await communicator.receive_output(10)  # the file follows in chunks

    response = asyncio.run(start())
    assert response["type"] == "http.response.start" and response["status"] == 200
