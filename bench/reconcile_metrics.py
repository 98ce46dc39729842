"""pdscope's client figures against the embedded server's own /metrics, for probe and bench.

    .venv/bin/python bench/reconcile_metrics.py           # prints a markdown table

Starts `pdscope serve` with the built-in small model, scrapes /metrics before and after a probe
and before and after a bench run, and sets each client figure beside the server's: mean TTFT
(client: connection ready to first content chunk; server: HTTP receipt to the engine's first
token), mean ITL (per output token after the first, both sides), mean E2E (client: to the last
content chunk; server: receipt to finish), and token and prefix-hit totals. The server's means
are Δsum / Δcount of its histograms, exact (no bucket interpolation). Both sides see exactly
the same requests: the bench runs without warm-up or calibration requests.
"""

from __future__ import annotations

import asyncio
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx

from pdscope.client.server_metrics import Snapshot, parse_metrics


def scrape(url: str) -> Snapshot:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def server_view(before: Snapshot, after: Snapshot) -> dict[str, float | None]:
    def delta(name: str) -> float:
        return (after.total(name) or 0.0) - (before.total(name) or 0.0)

    def mean_ms(base: str) -> float | None:
        count = delta(f"{base}_count")
        return delta(f"{base}_sum") / count * 1e3 if count else None

    return {
        "requests": delta("vllm:e2e_request_latency_seconds_count"),
        "ttft_ms": mean_ms("vllm:time_to_first_token_seconds"),
        "itl_ms": mean_ms("vllm:inter_token_latency_seconds"),
        "e2e_ms": mean_ms("vllm:e2e_request_latency_seconds"),
        "prompt_tokens": delta("vllm:prompt_tokens_total"),
        "generation_tokens": delta("vllm:generation_tokens_total"),
        "prefix_hits": delta("vllm:prefix_cache_hits_total"),
    }


def client_view(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Records: ttft_ms, e2e_ms, output_tokens, prompt_tokens, cached_tokens per request."""
    ok = [r for r in records if r["ttft_ms"] is not None]
    decode_ms = sum(r["e2e_ms"] - r["ttft_ms"] for r in ok)
    gaps = sum(max((r["output_tokens"] or 0) - 1, 0) for r in ok)
    return {
        "requests": float(len(records)),
        "ttft_ms": sum(r["ttft_ms"] for r in ok) / len(ok) if ok else None,
        "itl_ms": decode_ms / gaps if gaps else None,
        "e2e_ms": sum(r["e2e_ms"] for r in ok) / len(ok) if ok else None,
        "prompt_tokens": float(sum(r["prompt_tokens"] or 0 for r in records)),
        "generation_tokens": float(sum(r["output_tokens"] or 0 for r in ok)),
        "prefix_hits": float(sum(r["cached_tokens"] or 0 for r in records)),
    }


def run_probe(url: str) -> list[dict[str, Any]]:
    from pdscope.commands.probe import ProbeSettings, probe

    r = asyncio.run(
        probe(ProbeSettings(url=url, prompt_tokens=[200, 500, 1000], output_tokens=32, repeats=2))
    )
    return [
        {
            "ttft_ms": t["derived"]["ttft_ms"],
            "e2e_ms": t["derived"]["e2e_ms"],
            "output_tokens": t["derived"]["output_tokens"],
            "prompt_tokens": t["prompt_tokens"],
            "cached_tokens": t["cached_tokens"],
        }
        for t in r["traces"]
    ]


def run_bench(url: str) -> list[dict[str, Any]]:
    from pdscope.commands.bench import BenchSettings, BenchState, bench

    s = BenchSettings(
        url=url,
        num_prompts=32,
        input_len="128",
        output_len="64",
        concurrencies=[8],
        warmup=0,
        metrics_interval_s=5.0,
    )
    r = asyncio.run(bench(s, BenchState()))
    return [
        {
            "ttft_ms": q["ttft_ms"],
            "e2e_ms": q["e2el_ms"],
            "output_tokens": q["output_tokens"],
            "prompt_tokens": q["prompt_tokens"],
            "cached_tokens": q["cached_tokens"],
        }
        for q in r["runs"][0]["requests"]
    ]


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    name, cpus = fields.get("Model name", "?").strip(), fields.get("CPU(s)", "?").strip()
    return f"{name}, {cpus} CPUs, {' '.join(isa)}"


def main() -> None:
    from pdscope.server.launch import start_server

    log = Path(tempfile.mkdtemp(prefix="pdscope-reconcile-")) / "server.log"
    server = start_server("small", log, name="small")
    rows = []
    try:
        for name, fn in (("probe", run_probe), ("bench c=8", run_bench)):
            before = scrape(server.url)
            records = fn(server.url)
            after = scrape(server.url)
            rows.append((name, client_view(records), server_view(before, after)))
    finally:
        server.stop()
    print(f"CPU: {cpu()}\n")
    print("| run | figure | pdscope (client) | server /metrics | client / server |")
    print("|---|---|---|---|---|")
    for name, c, s in rows:
        for key in (
            "requests",
            "ttft_ms",
            "itl_ms",
            "e2e_ms",
            "prompt_tokens",
            "generation_tokens",
            "prefix_hits",
        ):
            a, b = c[key], s[key]
            ratio = f"{a / b:.3f}" if a is not None and b else "-"
            fmt = (
                "{:,.0f}"
                if key in ("requests",) or key.endswith("tokens") or key == "prefix_hits"
                else "{:,.2f}"
            )
            print(
                f"| {name} | {key} | {fmt.format(a) if a is not None else '-'} | "
                f"{fmt.format(b) if b is not None else '-'} | {ratio} |"
            )


if __name__ == "__main__":
    main()
