"""Two `pdscope serve` processes side by side, A and B, measured by interleaved `pdscope bench`
runs: the HTTP A/B of a server setting (a flag, or an environment variable read at start).

Both servers load at once and stay up; each round runs the same bench (same seed) against A
and B, in an order that alternates between rounds, with a new seed each round, so a noisy host
hits both alike and no prompt repeats across rounds. It prints each round's figures, the
median of the per-round B / A ratios, and each server's own mean TTFT and mean inter-token
latency from its `/metrics` (`vllm:time_to_first_token_seconds` and
`vllm:inter_token_latency_seconds`, sum over count, warm-up requests included): a second
source beside the client's. Each round also prints each server process's minor page faults
per completed request and its resident size after the round, read from `/proc` (Linux).

    # padded steps against exact ones (engine/model.py's ROW_BUCKET)
    .venv/bin/python bench/serve_ab.py --b-args "--kernels step_rows=exact" \\
        --bench-args "--input-len 300-1500 --output-len 8 --num-prompts 24 --max-concurrency 1"
    # decode batches of 33-64 on oneDNN (B) against the trial's pick (A)
    .venv/bin/python bench/serve_ab.py --b-args "--kernels big_batch_linear=onednn" \\
        --bench-args "--input-len 16 --output-len 256 --num-prompts 96 --max-concurrency 48"
    # libgomp's spin count: serve's rule (A) against 1,000 (B)
    .venv/bin/python bench/serve_ab.py --b-env GOMP_SPINCOUNT=1000 --rounds 4 \\
        --bench-args "--input-len 16-128 --output-len 32 --num-prompts 16 --max-concurrency 1"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdscope.client.server_metrics import parse_metrics
from pdscope.specs.local import cpu_model

BIN = Path(sys.executable).parent
FIGURES = ("mean_ttft_ms", "median_ttft_ms", "median_tpot_ms", "output_throughput")


def start(
    name: str, port: int, model: str, flags: str, env: list[str], logs: Path
) -> subprocess.Popen:
    extra = dict(item.split("=", 1) for item in env)
    command = [str(BIN / "pdscope"), "serve", "--model", model, "--port", str(port)]
    log = (logs / f"{name}.log").open("w")
    return subprocess.Popen(
        command + shlex.split(flags), env={**os.environ, **extra}, stdout=log, stderr=log
    )


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server on port {port} exited ({proc.returncode}); see its log")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"server on port {port} not ready in {timeout_s:.0f} s")


def server_mean_ms(port: int, histogram: str) -> float | None:
    """A histogram's mean from the server's own ``/metrics``: sum over count, in ms."""
    snapshot = parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    total = snapshot.total(f"{histogram}_sum")
    count = snapshot.total(f"{histogram}_count")
    return None if not total or not count else total / count * 1e3


def faults_and_rss(pid: int) -> tuple[int, int] | None:
    """A process's minor page faults so far and its resident bytes, from ``/proc/PID/stat``;
    None where there is no such file (not Linux, or the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # fields after the command name's closing parenthesis, from field 3 (state) on
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[7]), int(fields[21]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--a-args", default="", help="serve flags for A")
    parser.add_argument("--b-args", default="", help="serve flags for B")
    parser.add_argument("--a-env", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--b-env", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--bench-args", required=True, help="pdscope bench flags (no URL)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--ports", type=int, nargs=2, default=[8171, 8172])
    args = parser.parse_args()

    for item in args.a_env + args.b_env:
        if "=" not in item:
            parser.error(f"--a-env/--b-env take KEY=VALUE, got {item!r}")
    logs = Path(tempfile.mkdtemp(prefix="serve_ab-"))
    sides = {
        "A": (args.ports[0], args.a_args, args.a_env),
        "B": (args.ports[1], args.b_args, args.b_env),
    }
    procs = {n: start(n, p, args.model, f, e, logs) for n, (p, f, e) in sides.items()}
    try:
        for name, (port, _, _) in sides.items():
            wait_ready(port, procs[name])
        print(f"CPU: {cpu_model()}")
        print(
            f"A: {args.a_args or '-'} {' '.join(args.a_env)}; B: {args.b_args or '-'} "
            f"{' '.join(args.b_env)}; bench: {args.bench_args}; logs in {logs}"
        )
        ratios: dict[str, list[float]] = {f: [] for f in FIGURES}
        for seed in range(1, args.rounds + 1):
            order = ["A", "B"] if seed % 2 else ["B", "A"]
            got: dict[str, dict] = {}
            memory: dict[str, str] = {}
            for name in order:
                port = sides[name][0]
                before = faults_and_rss(procs[name].pid)
                out = logs / f"{name}_{seed}.json"
                command = [str(BIN / "pdscope"), "bench", f"http://127.0.0.1:{port}"]
                command += shlex.split(args.bench_args)
                command += ["--seed", str(seed), "--save-result", str(out)]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0 or not out.is_file():
                    raise SystemExit(f"bench against {name} failed:\n{done.stderr[-2000:]}")
                got[name] = json.loads(out.read_text())
                after = faults_and_rss(procs[name].pid)
                if before and after and got[name].get("completed"):
                    per_request = (after[0] - before[0]) / got[name]["completed"]
                    memory[name] = f"{per_request:,.0f} faults/request, {after[1] / 2**30:.2f} GiB"
            a, b = got["A"], got["B"]
            if a.get("failed") or b.get("failed"):
                raise SystemExit(
                    f"round {seed}: failed requests (A {a.get('failed')}, "
                    f"B {b.get('failed')}): not averaged in"
                )
            for f in FIGURES:
                ratios[f].append(b[f] / a[f])
            print(f"round {seed}: " + "; ".join(f"{f} {a[f]:.1f} / {b[f]:.1f}" for f in FIGURES))
            if memory:
                print("  " + "; ".join(f"{n} {memory[n]}" for n in sorted(memory)))
        print("B / A, median of rounds (min-max):")
        for f, values in ratios.items():
            print(f"  {f}: {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
        for what, histogram in (
            ("TTFT", "vllm:time_to_first_token_seconds"),
            ("inter-token latency", "vllm:inter_token_latency_seconds"),
        ):
            means = {n: server_mean_ms(sides[n][0], histogram) for n in sides}
            print(
                f"servers' own /metrics mean {what} (warm-ups included): "
                + ", ".join(f"{n} {v:.1f} ms" if v else f"{n} none" for n, v in means.items())
            )
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
