"""Shared fixtures: a tiny checkpoint, and real `pdscope serve` processes on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdscope.server.launch import ServerProcess
from pdscope.server.launch import start_server as _start

Server = ServerProcess


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdscope.engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", dtype="bfloat16")


def start_server(model: Path, log_dir: Path, *args: str, name: str = "tiny") -> Server:
    return _start(model, log_dir / "server.log", *args, name=name, timeout_s=90)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tiny_model,
        tmp_path_factory.mktemp("logs"),
        "--kv-cache-memory",
        "32MiB",
        "--max-model-len",
        "1024",
    )
    yield srv
    srv.stop()
