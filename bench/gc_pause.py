"""The garbage collector's pauses inside `pdscope serve`, with its start-up heap frozen (what
serve does, pdscope/heap.py) and without.

Each round starts one server of each variant in turn (the order alternating), sends it
``--runs`` short `pdscope bench` runs one after another (the calibration test's workload: 12
prompts of 64 tokens, 32 out, 4 at a time; a run takes ~0.1 s on the tiny model), and
records, through a ``gc.callbacks`` hook in the server, every collection that held the GIL
longer than 5 ms while those runs went on. The table gives, per variant, the pauses per
server, the longest, and the runs whose output throughput fell under half the server's
median run (a stall of a few hundred milliseconds in a 0.1 s run does that).

    .venv/bin/python bench/gc_pause.py --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

VARIANTS = ("frozen", "not frozen")
PAUSE_MIN_S = 0.005
WORKLOAD = ["--input-len", "64", "--output-len", "32", "--num-prompts", "12", "--seed", "3"]


def server(variant: str, serve_args: list[str]) -> None:
    """Run `pdscope serve`, printing each collection over PAUSE_MIN_S as a JSON line on
    stderr: its end (wall clock), its length and generation."""
    started: dict[str, float] = {}

    def hook(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
            return
        took_s = time.perf_counter() - started.pop("t", time.perf_counter())
        if took_s > PAUSE_MIN_S:
            pause = {"pause_s": took_s, "at": time.time(), "generation": info["generation"]}
            print(json.dumps(pause), file=sys.stderr, flush=True)

    gc.callbacks.append(hook)
    import pdscope.server.run
    from pdscope.cli import app

    if variant == "not frozen":
        pdscope.server.run.freeze_startup_heap = lambda: (0, 0.0)  # type: ignore[assignment]
    app(["serve", *serve_args], standalone_mode=True)


def one_server(variant: str, model: str, port: int, runs: int, out: Path) -> dict[str, object]:
    args = ["--model", model, "--port", str(port), "--kv-cache-memory", "256MiB"]
    log = (out / f"{variant.replace(' ', '-')}.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--server", variant, "--", *args],
        stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                log.seek(0)
                tail = "".join(log.readlines()[-5:])
                raise RuntimeError(f"server exited {proc.returncode}:\n{tail}")
            time.sleep(0.2)
        else:
            raise RuntimeError(f"server did not start: see {log.name}")
        begin = time.time()
        throughput, p99_ttft_ms = [], []
        for i in range(runs):
            result = out / f"run-{i}.json"
            subprocess.run(
                [sys.executable, "-m", "pdscope.cli", "bench", url, *WORKLOAD,
                 "--max-concurrency", "4", "--save-result", str(result)],
                check=True, capture_output=True,
            )  # fmt: skip
            summary = json.loads(result.read_text())
            throughput.append(summary["output_throughput"])
            p99_ttft_ms.append(summary["p99_ttft_ms"])
        end = time.time()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log.seek(0)
    pauses = []
    for line in log:
        if line.startswith("{"):
            pause = json.loads(line)
            if begin <= pause["at"] <= end:
                pauses.append(pause["pause_s"])
    middle = statistics.median(throughput)
    return {
        "pauses": len(pauses),
        "longest_ms": max(pauses, default=0.0) * 1e3,
        "slow_runs": sum(t < middle / 2 for t in throughput),
        "worst_p99_ttft_ms": max(p99_ttft_ms),
        "median_tok_s": middle,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=8, help="bench runs against each server")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--server", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("serve_args", nargs="*", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.server:
        server(a.server, a.serve_args)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_bench import machine_line

    print(machine_line())
    print(f"model {a.model}, {a.runs} bench runs a server, pauses over {PAUSE_MIN_S * 1e3:.0f} ms")
    rows: dict[str, list[dict[str, object]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="gc-pause-") as tmp:
        for r in range(a.rounds):
            order = list(VARIANTS)[:: 1 if r % 2 else -1]  # ABBA: neither always goes first
            for variant in order:
                row = one_server(variant, a.model, a.port, a.runs, Path(tmp))
                rows[variant].append(row)
                print(f"round {r + 1} {variant:10s} {json.dumps(row)}", flush=True)
    print("per server, median over rounds (min-max):")
    for variant in VARIANTS:
        parts = []
        for key in ("pauses", "longest_ms", "slow_runs", "worst_p99_ttft_ms", "median_tok_s"):
            values = [float(row[key]) for row in rows[variant]]  # type: ignore[arg-type]
            parts.append(
                f"{key} {statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"
            )
        print(f"  {variant:10s} " + ", ".join(parts))


if __name__ == "__main__":
    main()
