"""No number or flag is cut short on an 80-column terminal (issue 11, item 7): help wraps,
tables of figures drop whole columns, tables of prose wrap at spaces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from pdscope.cli import app
from pdscope.report.fit import fit_figures, fit_prose
from tests.conftest import Server

PDSCOPE = Path(sys.executable).with_name("pdscope")


@pytest.mark.parametrize("command", ["serve", "probe", "bench", "plan", "make-model"])
def test_help_shows_every_flag_whole_at_80_columns(command: str) -> None:
    out = subprocess.run(
        [PDSCOPE, command, "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "80"},
    ).stdout
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    group = typer.main.get_command(app)
    for param in group.commands[command].params:
        for flag in [*param.opts, *param.secondary_opts]:
            if flag.startswith("--"):
                assert flag in out, flag


def _runs_table() -> Table:
    table = Table(title="Runs")
    cols = ["load", "ok", "fail", "req/s", "tok/s", "TTFT50", "TTFT99", "TPOT50", "ITL50"]
    for col in [*cols, "ITL99", "E2E99", "good"]:
        table.add_column(col, justify="right")
    row = ["c=32", "200", "0", "14.51", "1,234", "2,345", "12,345", "55.3", "14.52"]
    table.add_row(*row, "119.41", "12,345", "100%")
    return table


def test_figures_drop_columns_instead_of_cutting_numbers() -> None:
    console = Console(width=80, record=True)
    console.print(fit_figures(_runs_table(), console))
    out = console.export_text()
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    for number in ("14.51", "1,234", "12,345", "55.3", "14.52", "TTFT99", "TPOT50"):
        assert number in out
    assert "left out to fit 80 columns" in out and "E2E99" in out  # named, not shown
    wide = Console(width=200, record=True)
    wide.print(fit_figures(_runs_table(), wide))
    assert "119.41" in wide.export_text() and "left out" not in wide.export_text()


def test_prose_keeps_flags_whole() -> None:
    table = Table(title="Findings", show_lines=True)
    for col in ("finding", "evidence", "what to change"):
        table.add_column(col)
    table.add_row(
        "TTFT grows fast with prompt length: prefill is the bottleneck",
        "TTFT 1,234.5 ms at 2,048 tokens, 14.53 ms per 100 tokens",
        "raise --max-num-batched-tokens (vLLM) or turn on --enable-prefix-caching",
    )
    console = Console(width=80, record=True)
    console.print(fit_prose(table, console))
    out = console.export_text()
    assert "…" not in out
    for word in ("--max-num-batched-tokens", "--enable-prefix-caching", "1,234.5", "14.53"):
        assert word in out


@pytest.mark.slow
def test_probe_and_bench_output_at_80_columns(
    medium_server: Server, medium: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdscope.cli

    monkeypatch.setattr(pdscope.cli.console, "width", 80)
    runner = CliRunner()
    probe = runner.invoke(
        app,
        [
            "probe",
            medium_server.url,
            "--prompt-tokens",
            "64,256",
            "--repeats",
            "1",
            "--output-tokens",
            "8",
            "--device",
            "a10g",
            "--plan-model",
            str(medium),  # the served checkpoint's config.json
        ],
    )
    assert probe.exit_code == 0, probe.output
    bench = runner.invoke(
        app,
        [
            "bench",
            medium_server.url,
            "--num-prompts",
            "4",
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--max-concurrency",
            "2",
        ],
    )
    assert bench.exit_code == 0, bench.output
    for out in (probe.output, bench.output):
        assert "…" not in out, out
        assert max(len(line) for line in out.splitlines()) <= 80, out
