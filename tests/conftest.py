"""Shared fixtures: a tiny checkpoint, and real `pdscope serve` processes on free loopback ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

BIN = Path(sys.executable).parent / "pdscope"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdscope.engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", dtype="bfloat16")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    model: str
    log: Path

    def stop(self) -> int:
        """SIGTERM, as a service manager would; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return self.process.wait()
        return self.process.returncode


def start_server(model: Path, log_dir: Path, *args: str, name: str = "tiny") -> Server:
    port = free_port()
    log = log_dir / f"server-{port}.log"
    cmd = [
        str(BIN),
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        name,
        *args,
    ]
    with log.open("w") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited {process.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return Server(process, url, name, log)
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


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
