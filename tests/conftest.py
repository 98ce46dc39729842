"""Shared fixtures: a tiny checkpoint, and real `pdscope serve` processes on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdscope.server.launch import ServerProcess
from pdscope.server.launch import start_server as _start

Server = ServerProcess


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The CPU under the results (shown with -q too): timing-sensitive tests fail differently
    on different CPUs, and the kernel trial picks different paths on them."""
    import os

    from pdscope.engine.kernels import cpu_flags
    from pdscope.specs.local import cpu_model

    flags = ", ".join(cpu_flags()) or "none of the listed ISA flags"
    terminalreporter.write_line(f"cpu: {cpu_model()} ({flags}), {os.cpu_count()} cores")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdscope.checkpoint.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", dtype="bfloat16")


def start_server(model: Path, log_dir: Path, *args: str, name: str = "tiny") -> Server:
    return _start(model, log_dir / "server.log", *args, name=name, timeout_s=90)


@pytest.fixture(scope="session")
def medium(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Big enough that prefill time clearly grows with the prompt, small enough to be quick;
    head_dim 64, a shape vLLM's CPU attention takes too."""
    from pdscope.checkpoint.make_model import make_model

    return make_model(
        tmp_path_factory.mktemp("m") / "medium",
        "tiny",
        num_hidden_layers=4,
        hidden_size=256,
        intermediate_size=704,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture(scope="module")
def medium_server(medium: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        medium, tmp_path_factory.mktemp("logs"), "--kv-cache-memory", "64MiB", name="medium"
    )
    yield srv
    srv.stop()


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
