"""Start `pdscope serve` as a child process on a free loopback port and wait until healthy.

A separate process, not a thread: the client that measures it must not share its GIL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    model: str
    log: Path

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM, as a service manager would; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return self.process.wait()
        return self.process.returncode


def start_server(
    model: str | Path, log: Path, *args: str, name: str | None = None, timeout_s: float = 300
) -> ServerProcess:
    """Launch and wait for /health. The first start of `small` builds the model (seconds)."""
    port = free_port()
    name = name or str(model)
    cmd = [
        sys.executable,
        "-m",
        "pdscope.cli",
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
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"pdscope serve exited with {process.returncode}:\n{log.read_text()[-2000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return ServerProcess(process, url, name, log)
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(
        f"pdscope serve did not become healthy in {timeout_s:.0f} s:\n{log.read_text()[-2000:]}"
    )
