"""The garbage collector's pauses inside `pdscope serve`, with its start-up heap frozen (what
serve does, pdscope/heap.py) and without.

Each round starts one server of each variant in turn (the order alternating), sends it
``--runs`` short `pdscope bench` runs one after another (the calibration test's workload: 12
prompts of 64 tokens, 32 out, 4 at a time; a run takes ~0.1 s on the tiny model), and
records, through a ``gc.callbacks`` hook in the server, every collection that held the GIL
longer than 5 ms while those runs went on, and its generation. Variants: ``frozen`` (what
serve does), ``collected`` (the same full collection at the same moment, no freeze: the next
full collection waits until a quarter as many objects again have survived, and then walks
them all) and ``neither`` (serve before the freeze). The table gives, per variant, the pauses per
server, the longest, and the runs whose output throughput fell under half the server's
median run (a stall of a few hundred milliseconds in a 0.1 s run does that).

    .venv/bin/python bench/gc_pause.py --rounds 3
    .venv/bin/python bench/gc_pause.py --collect-cost --model small

``--collect-cost`` times one full collection in a process built as serve builds it, before and
after the freeze: what each full collection while serving costs, whenever one falls. When one
falls depends on how many objects have survived since the last, so whether a server's pause
lands inside a few short runs is a matter of phase.
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
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

VARIANTS = ("frozen", "collected", "neither")
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
            pause = {"pause_s": took_s, "at_unix_s": time.time(), "generation": info["generation"]}
            print(json.dumps(pause), file=sys.stderr, flush=True)

    gc.callbacks.append(hook)
    import pdscope.server.run
    from pdscope.cli import app

    if variant == "collected":

        def collect_only() -> tuple[int, float]:
            start = time.perf_counter()
            gc.collect()
            return 0, time.perf_counter() - start

        pdscope.server.run.freeze_startup_heap = collect_only  # type: ignore[assignment]
    elif variant == "neither":
        pdscope.server.run.freeze_startup_heap = lambda: (0, 0.0)  # type: ignore[assignment]
    app(["serve", *serve_args], standalone_mode=True)


def collect_cost(model: str, repeats: int = 3) -> None:
    """The price of one full collection in a server's process, with its start-up heap frozen
    and not: what every full collection while serving pays, whenever it falls. The engine and
    the app are built as serve builds them (uvicorn's loop is not started)."""
    import uvicorn

    from pdscope.engine.llm_engine import EngineArgs
    from pdscope.heap import freeze_startup_heap
    from pdscope.server.app import build_app
    from pdscope.server.common import ServerState
    from pdscope.server.run import start_engine

    engine = start_engine(EngineArgs(model=model, kv_cache_memory="256MiB"), None)
    app = build_app(ServerState(engine, model))
    uvicorn.Config(app).load()  # uvicorn's protocols, as serve has them before it listens

    def full_ms() -> float:
        start = time.perf_counter()
        gc.collect()
        return (time.perf_counter() - start) * 1e3

    full_ms()
    before = [full_ms() for _ in range(repeats)]
    tracked = len(gc.get_objects())
    frozen, _ = freeze_startup_heap()
    after = [full_ms() for _ in range(repeats)]
    engine.shutdown()
    print(
        f"full collection: {statistics.median(before):.1f} ms over {tracked:,} tracked objects "
        f"(min {min(before):.1f}); with {frozen:,} frozen {statistics.median(after):.2f} ms "
        f"over {len(gc.get_objects()):,} (min {min(after):.2f})"
    )


@dataclass
class ServerRow:
    pauses: int  # collections over PAUSE_MIN_S while the bench runs went on
    longest_ms: float
    generations: str  # of those pauses, e.g. "2"
    slow_runs: int  # runs under half the server's median output throughput
    worst_p99_ttft_ms: float
    median_tok_s: float


def one_server(variant: str, model: str, port: int, runs: int, out: Path) -> ServerRow:
    args = ["--model", model, "--port", str(port), "--kv-cache-memory", "256MiB"]
    with (out / f"{variant}.log").open("w+") as log:
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
                done = subprocess.run(
                    [sys.executable, "-m", "pdscope.cli", "bench", url, *WORKLOAD,
                     "--max-concurrency", "4", "--save-result", str(result)],
                    capture_output=True, text=True,
                )  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(f"bench exited {done.returncode}:\n{done.stderr[-2000:]}")
                summary = json.loads(result.read_text())
                throughput.append(summary["output_throughput"])
                p99_ttft_ms.append(summary["p99_ttft_ms"])
            end = time.time()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        log.seek(0)
        pauses = [json.loads(line) for line in log if line.startswith("{")]
    pauses = [p for p in pauses if begin <= p["at_unix_s"] <= end]
    middle = statistics.median(throughput)
    return ServerRow(
        pauses=len(pauses),
        longest_ms=max((p["pause_s"] for p in pauses), default=0.0) * 1e3,
        generations=",".join(sorted({str(p["generation"]) for p in pauses})) or "-",
        slow_runs=sum(t < middle / 2 for t in throughput),
        worst_p99_ttft_ms=max(p99_ttft_ms),
        median_tok_s=middle,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=8, help="bench runs against each server")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument(
        "--collect-cost", action="store_true", help="time one full collection, frozen and not"
    )
    parser.add_argument("--server", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("serve_args", nargs="*", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.server:
        server(a.server, a.serve_args)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_bench import machine_line

    print(machine_line())
    if a.collect_cost:
        collect_cost(a.model)
        return
    print(f"model {a.model}, {a.runs} bench runs a server, pauses over {PAUSE_MIN_S * 1e3:.0f} ms")
    rows: dict[str, list[ServerRow]] = {v: [] for v in a.variants}
    with tempfile.TemporaryDirectory(prefix="gc-pause-") as tmp:
        for r in range(a.rounds):
            order = a.variants[:: 1 if r % 2 else -1]  # ABBA: none always goes first
            for variant in order:
                row = one_server(variant, a.model, a.port, a.runs, Path(tmp))
                rows[variant].append(row)
                print(f"round {r + 1} {variant:10s} {asdict(row)}", flush=True)
    print("per server, median over rounds (min-max):")
    for variant in a.variants:
        parts = []
        for key in ("pauses", "longest_ms", "slow_runs", "worst_p99_ttft_ms", "median_tok_s"):
            values = [float(getattr(row, key)) for row in rows[variant]]
            parts.append(
                f"{key} {statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"
            )
        parts.append("generations " + " ".join(row.generations for row in rows[variant]))
        print(f"  {variant:10s} " + ", ".join(parts))


if __name__ == "__main__":
    main()
