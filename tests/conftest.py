"""Shared fixtures: a tiny checkpoint, and real `pdscope serve` processes on free loopback ports."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from pdscope.checkpoint.make_model import default_cache_dir
from pdscope.server.launch import ServerProcess
from pdscope.server.launch import start_server as _start

if TYPE_CHECKING:
    from pdscope.engine.native import NativeOps

Server = ServerProcess


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The CPU under the results (shown with -q too): timing-sensitive tests fail differently
    on different CPUs, and the kernel trial picks different paths on them."""
    import os

    from pdscope.engine.kernels import cpu_flags
    from pdscope.specs.local import cpu_model

    flags = ", ".join(cpu_flags()) or "none of the listed ISA flags"
    terminalreporter.write_line(f"cpu: {cpu_model()} ({flags}), {os.cpu_count()} cores")


# Where the session's own engine build lives: the cache in force as the tests start, read once
# here because fresh_cache points $PDSCOPE_CACHE at the test's own directory before it seeds.
_BUILDS = default_cache_dir() / "native"


@functools.cache
def _session_build() -> Path | None:
    """The session's ``-march=native`` build, made once where missing (its key costs a
    ``cc --version`` and a hash of the source, not to be paid per test); None where it cannot
    be made, as ``native.load`` would log."""
    from pdscope.engine import native

    try:
        return native.build(_BUILDS)
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None


def seed_native(cache_dir: Path) -> Path:
    """``cache_dir`` (returned) holding the engine's ``-march=native`` C build, copied from the
    session's cache (built there once where missing), as a machine's cache holds it after its
    first start: a test of what follows the build (the trial, the paths, the kernels) does not
    compile the library again, 4-7 s a test on the 2-core hosts. Without a C compiler, or
    where the build fails, nothing is copied and a load there fails as it would; a load under
    ``$PDSCOPE_MARCH`` builds its own target there, as before."""
    built = _session_build()
    if built is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        if not (cache_dir / built.name).is_file():
            shutil.copy(built, cache_dir / built.name)
    return cache_dir


def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$PDSCOPE_CACHE`` at ``tmp_path``: no kernel choice cached there, the C build seeded
    (:func:`seed_native`)."""
    monkeypatch.setenv("PDSCOPE_CACHE", str(tmp_path))
    seed_native(tmp_path / "native")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdscope.checkpoint.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", dtype="bfloat16")


def steady_host() -> float:
    """A host whose memory reads at one rate (GB/s): for tests of caching by shape and load
    that start twice on one kernel cache, kept apart from the host-speed rule (its own tests
    in tests/test_engine_kernels.py), which a swing of a noisy host between the starts would
    trip."""
    return 10.0


@pytest.fixture
def steady_gauge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines started in the test read memory at :func:`steady_host`'s rate, and the host's
    load as one figure: a busy neighbour that ends between two starts would otherwise make the
    second measure again (the quieter-host rule, tested on its own with ``load=``)."""
    monkeypatch.setattr("pdscope.engine.kernels.read_gauge_gb_s", steady_host)
    monkeypatch.setattr("pdscope.engine.kernels.load_per_core", lambda: 1.0)


def glibc_as_it_starts() -> dict[str, str]:
    """This process's environment for a child whose malloc is glibc's as it starts: no other
    allocator preloaded, no malloc settings (the tests of engine/malloc.py and the Scratch)."""
    return {
        k: v
        for k, v in os.environ.items()
        if k != "LD_PRELOAD" and not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))
    }


def prefill_faults(timed: int) -> str:
    """A child's code, once it has made ``llm`` (an engine LLM) and imported resource and
    SamplingParams: one 2,000-token prefill to warm up, then ``timed`` more, each one's minor
    page faults in ``faults`` (the tests of engine/malloc.py and the Scratch)."""
    return f"""
one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
llm.generate([[7] * 2000], one)
faults = []
for first in range(8, {8 + timed}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    llm.generate([[first] * 2000], one)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def start_server(model: Path, log_dir: Path, *args: str, name: str = "tiny") -> Server:
    return _start(model, log_dir / "server.log", *args, name=name, timeout_s=90)


# The builds an x86 CPU without AVX-512 makes of the engine's C kernels, by -march target:
# x86-64-v3 (AVX2 and FMA: an AVX2-only CPU's) and x86-64 (SSE2 alone: the portable loops,
# the same branches of decode_ops.c that a CPU of another architecture compiles). Built here
# and run on this machine's cores, they pin the branches its own build never takes.
OTHER_BUILDS = ("x86-64-v3", "x86-64")


_builds: dict[str, NativeOps] = {}


def build_for(march: str, tmp_path_factory: pytest.TempPathFactory) -> NativeOps:
    """The engine's C kernels compiled with ``-march=march`` in place of ``-march=native``,
    once a session."""
    from pdscope.engine import native

    if march in _builds:
        return _builds[march]
    if march not in OTHER_BUILDS:
        raise ValueError(f"no build named {march!r}: one of {', '.join(OTHER_BUILDS)}")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{march} is an x86 target")
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    if lacking := native.missing_features(march):
        pytest.skip(f"{march} needs {', '.join(lacking)}, which this CPU lacks")
    library = native.build(tmp_path_factory.mktemp(f"native_{march}"), march)
    _builds[march] = native.NativeOps(ctypes.CDLL(str(library)), march=march)
    return _builds[march]


@pytest.fixture(scope="session")
def v3_ops(tmp_path_factory: pytest.TempPathFactory) -> NativeOps:
    """The build an AVX2-only CPU makes: on an AVX-512 machine it runs the AVX2 paths."""
    return build_for("x86-64-v3", tmp_path_factory)


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


@contextlib.contextmanager
def peer_server(
    name: str,
    cmd: list[str],
    url: str,
    log: Path,
    timeout_s: float,
    env: dict | None = None,
    health: str = "/health",
) -> Iterator[str]:
    """Another program's server (vLLM, llama.cpp, Prometheus) as a child process: yields
    ``url`` once ``health`` answers 200, fails the test with its log's tail if it exits or
    never answers, and stops it after (SIGTERM, then SIGKILL)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}{health}", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        else:
            pytest.fail(f"{name} did not start:\n{log.read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def watch_once_under_load(
    url: str,
    body: dict[str, Any],
    window_s: float = 4,
    interval_s: float = 0.5,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`pdscope watch URL --once --json` (and ``extra`` flags) while a thread sends ``body`` to
    /v1/completions one request after another; the snapshot it printed."""
    from typer.testing import CliRunner

    from pdscope.cli import app

    stop = threading.Event()

    def load() -> None:
        for _ in range(200):
            if stop.is_set():
                return
            httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()

    thread = threading.Thread(target=load)
    thread.start()
    args = ["watch", url, "--once", "--json", "--window", f"{window_s:g}"]
    try:
        result = CliRunner().invoke(app, [*args, "--interval", f"{interval_s:g}", *extra])
    finally:
        stop.set()
        thread.join()
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)
