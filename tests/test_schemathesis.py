"""Schemathesis against a real `pdscope serve`: every documented operation fuzzed, every check.

Bounded in time (--max-time) so the slow suite stays predictable. One substitution, explained in
tests/schemathesis_hooks.py: the positive-data check accepts the 400 for prompts over the
context, a rule no schema can state.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Server, start_server

pytestmark = pytest.mark.slow
ST = Path(sys.executable).with_name("st")
BUDGET_S = 75


@pytest.fixture(scope="module")
def short_context(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A short context keeps every generated request's output short.
    srv = start_server(
        tiny_model,
        tmp_path_factory.mktemp("st"),
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "256",
    )
    yield srv
    srv.stop()


@pytest.mark.skipif(not ST.exists() and not shutil.which("st"), reason="schemathesis not installed")
def test_schemathesis_all_checks(short_context: Server, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    cmd = [
        str(ST) if ST.exists() else "st",
        "run",
        f"{short_context.url}/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",  # replaced by positive_data_acceptance_within_context
        "--max-examples",
        "10",
        "--max-time",
        str(BUDGET_S),
        "--request-timeout",
        "20",
        "--seed",
        "11",
        "--no-color",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
    }
    done = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BUDGET_S + 60
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "Tested: 15" in out, out[-3000:]  # every operation, GET / among them
