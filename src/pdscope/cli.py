"""The `pdscope` command line: parses flags, calls a command module, prints.

Errors in facts or flags (:class:`SpecError`) print one line naming the problem and exit 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from pdscope.specs import SpecError

app = typer.Typer(
    name="pdscope",
    help="See the two phases of LLM serving: prefill (time to first token, compute-bound) and "
    "decode (tokens per second, memory-bandwidth-bound).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's plain help: rich's option table cut long flags to "--max-num-batched-t…" on an
    # 80-column terminal; this one wraps the help text and never shortens a flag.
    rich_markup_mode=None,
)
console = Console()
err_console = Console(stderr=True)


# Workload flags that bench and simulate share: one definition, one help text.
OutputLen = Annotated[str, typer.Option(help="Output tokens: N, LOW-HIGH or normal:MEAN:STD.")]
Groups = Annotated[int, typer.Option(help="shared-prefix: prefix groups.")]
PrefixLen = Annotated[int, typer.Option(help="shared-prefix: prefix tokens.")]
SuffixLen = Annotated[int, typer.Option(help="shared-prefix: unique suffix tokens.")]
Streams = Annotated[int, typer.Option(help="long-prompt: decode streams.")]
StreamOutput = Annotated[int, typer.Option(help="long-prompt: tokens per stream.")]
LongLen = Annotated[int, typer.Option(help="long-prompt: tokens per long prompt.")]
LongRate = Annotated[float, typer.Option(help="long-prompt: long prompts per second.")]


def fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.callback()
def main() -> None:
    """pdscope: plan, serve, probe and bench LLM prefill and decode."""


@app.command()
def plan(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Preset name (see --list-models), a config.json, or a checkpoint directory.",
        ),
    ] = "8b",
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            "-d",
            help="Catalog device (see --list-devices), or 'local' to measure this machine. "
            "Omit with --bandwidth to describe your own device.",
        ),
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            help="Weight precision: fp32, bf16, fp16, fp8, int8, int4, q8_0, q6_k, q5_k_m, q4_k_m, "
            "q4_0.",
        ),
    ] = "bf16",
    kv_dtype: Annotated[
        str | None,
        typer.Option(
            help="KV cache precision: fp32, bf16, fp16, fp8 (default: follows --dtype, else bf16).",
        ),
    ] = None,
    context: Annotated[
        int | None,
        typer.Option(
            help="Tokens already in the KV cache during decode (default 4096; 0 for --compare).",
        ),
    ] = None,
    prompt_tokens: Annotated[
        int, typer.Option(help="Prompt length for the prefill figures.")
    ] = 2000,
    gpu_memory_utilization: Annotated[
        float,
        typer.Option(
            help="Fraction of device memory the server may use (vLLM's flag), 0-1.",
        ),
    ] = 0.9,
    bandwidth: Annotated[
        float | None,
        typer.Option(
            help="Memory bandwidth in GB/s: a custom device, or override the named one.",
        ),
    ] = None,
    tflops: Annotated[
        float | None,
        typer.Option(
            help="Dense peak TFLOP/s: a custom device, or override the named one.",
        ),
    ] = None,
    memory: Annotated[
        float | None,
        typer.Option(
            help="Device memory in GB (read as GiB, like the catalog).",
        ),
    ] = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare",
            help="The seed article's table: the decode ceiling on each device.",
        ),
    ] = False,
    all_devices: Annotated[
        bool,
        typer.Option(
            "--all",
            help="With --compare: every catalog device, not just the article's six.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    list_devices: Annotated[
        bool,
        typer.Option(
            "--list-devices",
            help="List the device catalog and exit.",
        ),
    ] = False,
    list_models: Annotated[
        bool,
        typer.Option(
            "--list-models",
            help="List the model presets and exit.",
        ),
    ] = False,
) -> None:
    """The paper arithmetic: weight bytes, decode ceilings, KV sizes, pool capacity, prefill
    FLOPs and the TTFT floor, and batched decode, for a model on a device."""
    from pdscope.commands import plan as cmd
    from pdscope.report.plan import render_compare, render_plan

    try:
        if list_devices:
            _list_devices(as_json)
            return
        if list_models:
            _list_models(as_json)
            return
        if compare:
            if device is not None and device.lower() != "local":
                raise SpecError("--compare runs over the catalog; drop --device (or use --all)")
            inputs = cmd.resolve(
                model=model,
                device=cmd.DEFAULT_DEVICE,
                dtype=dtype,
                kv_dtype=kv_dtype,
                context_tokens=max(context or 1, 1),
                prompt_tokens=prompt_tokens,
            )
            if context is not None and context < 0:
                raise SpecError(f"--context must be >= 0, got {context}")
            from pdscope.specs import catalog

            devices = list(catalog()) if all_devices else None
            if device is not None:  # --compare --device local: the article's six plus this one
                devices = [
                    *(devices or [d for d in catalog() if d.name in cmd.SEED_DEVICES]),
                    cmd.resolve(model=model, device="local", dtype=dtype).device,
                ]
            rows = cmd.compare(inputs.model, inputs.weights, inputs.kv, context or 0, devices)
            if as_json:
                print_json(rows)
            else:
                title = (
                    f"Decode ceiling for one stream: {inputs.model.name} at "
                    f"{inputs.weights.name}, context {context or 0}"
                )
                render_compare(rows, title, console)
            return
        if device is None and bandwidth is None:
            device = cmd.DEFAULT_DEVICE
        inputs = cmd.resolve(
            model=model,
            device=device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            context_tokens=cmd.DEFAULT_CONTEXT if context is None else context,
            prompt_tokens=prompt_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            bandwidth_gb_s=bandwidth,
            tflops=tflops,
            memory_gb=memory,
        )
        result = cmd.plan(inputs)
    except SpecError as exc:
        raise fail(str(exc)) from None
    if as_json:
        print_json(result)
    else:
        render_plan(result, console)


@app.command("make-model")
def make_model_cmd(
    directory: Annotated[Path, typer.Argument(help="Where to write the checkpoint.")],
    preset: Annotated[
        str, typer.Option(help="tiny (tests, a few MB) or small (168M, the embedded default).")
    ] = "tiny",
    arch: Annotated[str, typer.Option(help="llama, mistral, qwen2 or qwen3.")] = "llama",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "bfloat16",
    seed: Annotated[int, typer.Option(help="Weights are a pure function of the seed.")] = 0,
    layers: Annotated[int | None, typer.Option(help="num_hidden_layers.")] = None,
    hidden: Annotated[int | None, typer.Option(help="hidden_size.")] = None,
    intermediate: Annotated[int | None, typer.Option(help="intermediate_size.")] = None,
    heads: Annotated[int | None, typer.Option(help="num_attention_heads.")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="num_key_value_heads.")] = None,
    vocab: Annotated[int | None, typer.Option(help="vocab_size (tokenizer trained to it).")] = None,
    max_len: Annotated[int | None, typer.Option(help="max_position_embeddings.")] = None,
) -> None:
    """Write a random-weight Hugging Face checkpoint with a real BPE tokenizer.

    Random weights produce meaningless text but cost exactly what a real model of the same
    shape costs, which is all that latency needs. No download, ever."""
    from pdscope.engine.make_model import make_model, num_parameters

    overrides = {
        k: v
        for k, v in {
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "vocab_size": vocab,
            "max_position_embeddings": max_len,
        }.items()
        if v is not None
    }
    try:
        path = make_model(directory, preset=preset, arch=arch, dtype=dtype, seed=seed, **overrides)
    except ValueError as exc:
        raise fail(str(exc)) from None
    config = json.loads((path / "config.json").read_text())
    size = (path / "model.safetensors").stat().st_size
    console.print(
        f"wrote {path}: {config['architectures'][0]}, "
        f"{num_parameters(config) / 1e6:,.1f}M parameters, {config['torch_dtype']}, "
        f"{size / 1e6:,.1f} MB of weights, vocabulary {config['vocab_size']:,}"
    )


@app.command()
def serve(
    model: Annotated[
        str,
        typer.Option(
            help="Checkpoint directory, or a built-in model: tiny, small (created on first use)."
        ),
    ] = "small",
    host: Annotated[
        str, typer.Option(help="Address to bind (loopback unless told).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name clients send (default: --model).")
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="Prompt + output tokens per request.")
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Most requests running at once.")] = 64,
    max_num_batched_tokens: Annotated[
        int, typer.Option(help="Token budget of one engine step.")
    ] = 2048,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    kv_cache_memory: Annotated[str, typer.Option(help="KV pool size on CPU, e.g. 2GiB.")] = "1GiB",
    gpu_memory_utilization: Annotated[
        float, typer.Option(help="Fraction of GPU memory for weights + KV pool (CUDA).")
    ] = 0.9,
    enable_prefix_caching: Annotated[
        bool,
        typer.Option(
            "--enable-prefix-caching/--no-enable-prefix-caching",
            help="Reuse KV of shared prefixes.",
        ),
    ] = True,
    enable_chunked_prefill: Annotated[
        bool,
        typer.Option(
            "--enable-chunked-prefill/--no-chunked-prefill",
            help="Split long prompts across steps, mixed with decodes.",
        ),
    ] = True,
    dtype: Annotated[str, typer.Option(help="auto, float32 or bfloat16.")] = "auto",
    api_key: Annotated[
        str | None,
        typer.Option(
            help="Require 'Authorization: Bearer KEY' (all routes but /health, /metrics)."
        ),
    ] = None,
    max_queue: Annotated[
        int | None, typer.Option(help="Refuse (503) new requests while this many wait.")
    ] = None,
    max_request_bytes: Annotated[
        str, typer.Option(help="Refuse (413) request bodies larger than this, e.g. 8MiB.")
    ] = "8MiB",
    allowed_origins: Annotated[
        str,
        typer.Option(
            help="Comma-separated browser origins allowed besides loopback ones, e.g. "
            "'https://app.example,http://*.lan:*'; '*' allows any."
        ),
    ] = "",
    allowed_hosts: Annotated[
        str,
        typer.Option(
            help="Comma-separated Host names accepted besides loopback names and IP "
            "addresses (checked when bound to loopback, against DNS rebinding)."
        ),
    ] = "",
    seed: Annotated[int, typer.Option(help="Engine seed.")] = 0,
    kernels: Annotated[
        str,
        typer.Option(
            help="auto (timed at start-up, cached per CPU), or force paths, e.g. "
            "linear=plain,prefill_attention=sdpa,decode_math=native,decode_ops=c."
        ),
    ] = "auto",
    threads: Annotated[
        int | None,
        typer.Option(
            help="CPU threads for the engine's math "
            "(default: all cores). Fewer leaves cores to "
            "HTTP clients on the same machine."
        ),
    ] = None,
) -> None:
    """Serve the engine over HTTP: OpenAI (/v1) and Ollama (/api) routes, vLLM-named
    Prometheus metrics on /metrics."""
    from pdscope.engine.llm_engine import EngineArgs, parse_bytes
    from pdscope.server.run import serve as run_server

    if not 0 <= port <= 65535:
        raise fail(f"--port must be 0-65535, got {port}")
    if max_queue is not None and max_queue < 0:
        raise fail(f"--max-queue must be >= 0, got {max_queue}")
    try:
        body_limit_bytes = parse_bytes(max_request_bytes)
    except ValueError as exc:
        raise fail(f"--max-request-bytes: {exc}") from None
    if body_limit_bytes < 1024:
        raise fail(f"--max-request-bytes must be at least 1KiB, got {max_request_bytes}")
    if threads is not None:
        if threads < 1:
            raise fail(f"--threads must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)
    args = EngineArgs(
        model=model,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
        dtype=dtype,
        kv_cache_memory=kv_cache_memory,
        gpu_memory_utilization=gpu_memory_utilization,
        seed=seed,
        kernels=kernels,
    )
    try:
        run_server(
            args,
            host=host,
            port=port,
            served_model_name=served_model_name,
            api_key=api_key,
            max_queue=max_queue,
            allowed_origins=_names(allowed_origins),
            allowed_hosts=_names(allowed_hosts),
            max_request_bytes=body_limit_bytes,
        )
    except (ValueError, FileNotFoundError) as exc:
        raise fail(str(exc)) from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise fail(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise fail(f"{flag} needs positive integers, got {text!r}")
    return sorted(set(values))


@app.command()
def probe(
    url: Annotated[
        str | None,
        typer.Argument(
            help="Server to probe, e.g. "
            "http://127.0.0.1:8000. Omit to start the "
            "embedded server with the built-in model."
        ),
    ] = None,
    api: Annotated[
        str, typer.Option(help="auto, openai-completions, openai-chat or ollama.")
    ] = "auto",
    model: Annotated[
        str | None, typer.Option(help="Model to probe (optional when the server has one).")
    ] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer token for the server.")] = None,
    prompt_tokens: Annotated[
        str, typer.Option(help="Sweep of prompt lengths in tokens.")
    ] = "200,500,1000,2000",
    output_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 64,
    repeats: Annotated[int, typer.Option(help="Requests per sweep point.")] = 3,
    timeout: Annotated[float, typer.Option(help="Seconds allowed per request.")] = 120.0,
    max_model_len: Annotated[
        int | None,
        typer.Option(help="Cap for prompt + output when the server does not report one."),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            help="Device for the ceiling: catalog name or "
            "'local' (default for the embedded server)."
        ),
    ] = None,
    plan_model: Annotated[
        str | None,
        typer.Option(
            help="Model for the ceiling: preset or "
            "config.json (default: the server's "
            "checkpoint when local)."
        ),
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="Weight precision for the ceiling.")] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            help="Repeat an earlier run's prompts (its seed is in the result). Default: fresh "
            "random prompts, so no run meets an earlier one's in the prefix cache."
        ),
    ] = None,
    json_file: Annotated[
        Path | None, typer.Option("--json", help="Write every trace and figure here.")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="Write TTFT and decode plots (PNG).")] = None,
) -> None:
    """Measure one server's prefill and decode apart: a prompt-length sweep, a prefix-cache
    check, a context check; fit, ceilings and findings."""
    import asyncio
    import tempfile

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from pdscope.client.adapters import APIS
    from pdscope.client.detect import ProbeError
    from pdscope.commands.probe import ProbeSettings
    from pdscope.commands.probe import probe as run_probe
    from pdscope.report.probe import plot_probe, render_probe

    if api != "auto" and api not in APIS:
        raise fail(f"--api must be auto or one of {', '.join(APIS)}, got {api!r}")
    for flag, value in (("--output-tokens", output_tokens), ("--repeats", repeats)):
        if value < 1:
            raise fail(f"{flag} must be >= 1, got {value}")
    if timeout <= 0:
        raise fail(f"--timeout must be positive, got {timeout}")
    settings = ProbeSettings(
        url=url or "",
        api=api,
        model=model,
        api_key=api_key,
        prompt_tokens=_int_list(prompt_tokens, "--prompt-tokens"),
        output_tokens=output_tokens,
        repeats=repeats,
        timeout_s=timeout,
        max_model_len=max_model_len,
        device=device,
        plan_model=plan_model,
        dtype=dtype,
        seed=seed,
    )
    embedded = None
    if url is None:
        from pdscope.server.launch import start_server

        settings.device = settings.device or "local"
        err_console.print(
            "starting the embedded server (pdscope serve, built-in small model; "
            "built on first use) ..."
        )
        log = Path(tempfile.mkdtemp(prefix="pdscope-probe-")) / "server.log"
        try:
            embedded = start_server("small", log, name="small")
        except RuntimeError as exc:
            raise fail(str(exc), 1) from None
        settings.url = embedded.url
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=err_console,
        transient=True,
    )
    task = progress.add_task("probing", total=None)
    try:
        with progress:
            result = asyncio.run(
                run_probe(
                    settings,
                    on_start=lambda n: progress.update(task, total=n),
                    tick=lambda label: progress.update(task, advance=1, description=label),
                )
            )
    except ProbeError as exc:
        raise fail(str(exc), 1) from None
    finally:
        if embedded is not None:
            embedded.stop()
    if json_file:
        json_file.write_text(json.dumps(result, indent=2))
    if plot:
        plot_probe(result, plot)
    render_probe(result, console)
    if json_file:
        console.print(f"wrote {json_file}")
    if plot:
        console.print(f"wrote {plot}")
    # Any failed request or part left unmeasured fails the command: a script reading only the
    # exit code must not take a half-made measurement for a whole one.
    if result["partial"] or result["failures"] or result["unmeasured"]:
        raise typer.Exit(1)


def _float_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise fail(f"{flag} takes comma-separated numbers (or inf), got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise fail(f"{flag} needs positive numbers, got {text!r}")
    return values


@app.command()
def bench(
    url: Annotated[
        str | None,
        typer.Argument(
            help="Server to load; omit to start the embedded "
            "server. 'compare A.json B.json' compares two "
            "saved runs."
        ),
    ] = None,
    files: Annotated[
        list[Path] | None,
        typer.Argument(help="With 'compare': two result files.", show_default=False),
    ] = None,
    api: Annotated[
        str, typer.Option(help="auto, openai-completions, openai-chat or ollama.")
    ] = "auto",
    model: Annotated[
        str | None, typer.Option(help="Model (optional when the server has one).")
    ] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer token for the server.")] = None,
    workload: Annotated[
        str,
        typer.Option(
            help="random, shared-prefix, long-prompt or file:PATH (JSONL or ShareGPT JSON)."
        ),
    ] = "random",
    num_prompts: Annotated[int, typer.Option(help="Requests per run.")] = 100,
    input_len: Annotated[
        str, typer.Option(help="random: N, LOW-HIGH or normal:MEAN:STD tokens.")
    ] = "128",
    output_len: OutputLen = "128",
    groups: Groups = 4,
    prefix_len: PrefixLen = 1024,
    suffix_len: SuffixLen = 64,
    streams: Streams = 8,
    stream_output: StreamOutput = 256,
    long_len: LongLen = 2000,
    long_rate: LongRate = 0.5,
    request_rate: Annotated[
        str, typer.Option(help="Requests/s, or a series: 1,2,4,8 (inf = all at once).")
    ] = "inf",
    max_concurrency: Annotated[
        str | None, typer.Option(help="Cap on requests in flight, or a series: 1,4,16,64.")
    ] = None,
    burstiness: Annotated[
        float, typer.Option(help="Gamma shape of arrival gaps (1 = Poisson).")
    ] = 1.0,
    duration: Annotated[
        float | None, typer.Option(help="Stop sending after this many seconds.")
    ] = None,
    warmup: Annotated[int, typer.Option(help="Warm-up requests, excluded.")] = 1,
    ramp_up: Annotated[float, typer.Option(help="Seconds over which the rate ramps up.")] = 0.0,
    seed: Annotated[
        int | None,
        typer.Option(
            help="Seed for lengths, prompts and arrivals, to repeat a run exactly (its seed is "
            "in the result). Default: fresh prompts every run."
        ),
    ] = None,
    percentiles: Annotated[str, typer.Option(help="Percentiles to report.")] = "50,90,95,99",
    slo: Annotated[
        str | None,
        typer.Option(
            help="Goodput SLOs per request: "
            "ttft=2s,tpot=100ms,e2e=10s; with "
            "--find-capacity: p99_ttft=2s,p99_itl=100ms."
        ),
    ] = None,
    find_capacity: Annotated[
        bool, typer.Option("--find-capacity", help="Search the highest concurrency meeting --slo.")
    ] = False,
    sweep: Annotated[
        str | None, typer.Option(help="'auto': double concurrency until throughput saturates.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds allowed per request.")] = 300.0,
    save_result: Annotated[
        Path | None,
        typer.Option(help="Write the result JSON (vllm bench serve's field names) here."),
    ] = None,
    server_args: Annotated[
        str,
        typer.Option(help="Flags for the embedded server, e.g. '--max-num-batched-tokens 256'."),
    ] = "",
    report: Annotated[
        Path | None, typer.Option(help="Write a self-contained HTML report with plots here.")
    ] = None,
) -> None:
    """Load a server: arrivals, workloads, latency percentiles, goodput, the server's own
    metrics, and the capacity where p99 breaks."""
    import asyncio
    import math
    import shlex
    import tempfile

    import httpx
    from rich.progress import Progress as Bar
    from rich.progress import TextColumn

    from pdscope.analysis.bench import SLO, SLOError
    from pdscope.client.adapters import APIS
    from pdscope.client.detect import ProbeError
    from pdscope.client.load import Progress as LoadProgress
    from pdscope.commands.bench import WORKLOADS, BenchSettings, BenchState
    from pdscope.commands.bench import bench as run_bench
    from pdscope.report.bench import render_bench, render_compare, runs_of

    if url == "compare":
        if not files or len(files) != 2:
            raise fail("usage: pdscope bench compare A.json B.json")
        try:
            a, b = (runs_of(json.loads(f.read_text())) for f in files)
            render_compare(a, b, (files[0].name, files[1].name), console)
        except (OSError, ValueError) as exc:
            raise fail(f"cannot compare the saved runs: {exc}") from None
        return
    if files:
        raise fail(f"unexpected arguments: {' '.join(map(str, files))}")
    if api != "auto" and api not in APIS:
        raise fail(f"--api must be auto or one of {', '.join(APIS)}, got {api!r}")
    if workload not in WORKLOADS[:3] and not workload.startswith("file:"):
        raise fail(f"--workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    if sweep not in (None, "auto"):
        raise fail(f"--sweep takes 'auto', got {sweep!r}")
    for flag, value in (
        ("--num-prompts", num_prompts),
        ("--groups", groups),
        ("--streams", streams),
        ("--prefix-len", prefix_len),
    ):
        if value < 1:
            raise fail(f"{flag} must be >= 1, got {value}")
    rates = _float_list(request_rate, "--request-rate")
    concurrencies: list[int | None] = (
        [int(c) for c in _int_list(max_concurrency, "--max-concurrency")]
        if max_concurrency
        else [None]
    )
    if len(rates) > 1 and len(concurrencies) > 1:
        raise fail("give a series of --request-rate or of --max-concurrency, not both")
    try:
        pcts = tuple(float(p) for p in percentiles.split(","))
        if any(not 0 < p < 100 for p in pcts):
            raise ValueError
    except ValueError:
        raise fail(f"--percentiles takes numbers in (0, 100), got {percentiles!r}") from None
    try:
        if find_capacity:
            if not slo:
                raise fail("--find-capacity needs --slo, e.g. p99_ttft=2s,p99_itl=100ms")
            pcts = tuple(sorted({*pcts, *SLO.parse(slo, aggregate=True).percentiles}))
        else:
            SLO.parse(slo)
    except SLOError as exc:
        raise fail(str(exc)) from None
    settings = BenchSettings(
        url=url or "",
        api=api,
        model=model,
        api_key=api_key,
        workload=workload,
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        groups=groups,
        prefix_len=prefix_len,
        suffix_len=suffix_len,
        streams=streams,
        stream_output=stream_output,
        long_len=long_len,
        long_rate=long_rate,
        request_rates=[math.inf if math.isinf(r) else r for r in rates],
        concurrencies=concurrencies,
        burstiness=burstiness,
        duration_s=duration,
        warmup=warmup,
        ramp_up_s=ramp_up,
        seed=seed,
        percentiles=pcts,
        goodput_slo=None if find_capacity else slo,
        capacity_slo=slo if find_capacity else None,
        sweep_auto=sweep == "auto",
        timeout_s=timeout,
    )
    embedded = None
    if url is None:
        from pdscope.server.launch import start_server

        if not max_concurrency and rates == [math.inf] and num_prompts == 100:
            settings.num_prompts, settings.concurrencies = 32, [8]  # a short default load
            settings.output_len = "64" if output_len == "128" else output_len
        err_console.print("starting the embedded server (built-in small model) ...")
        log = Path(tempfile.mkdtemp(prefix="pdscope-bench-")) / "server.log"
        try:
            embedded = start_server("small", log, *shlex.split(server_args), name="small")
        except RuntimeError as exc:
            raise fail(str(exc), 1) from None
        settings.url = embedded.url
    state = BenchState()
    bar = Bar(TextColumn("{task.description}"), console=err_console, transient=True)
    task = bar.add_task("starting", total=None)

    def progress(level: str, p: LoadProgress) -> None:
        bar.update(
            task,
            description=f"{level}: {p.completed} done, {p.in_flight} in flight, "
            f"{p.failed} failed, {p.output_tok_s:,.0f} output tok/s",
        )

    try:
        with bar:
            result = asyncio.run(run_bench(settings, state, progress))
    except KeyboardInterrupt:
        state.partial = state.partial or "interrupted (Ctrl-C)"
        result = state.result()
    except (ProbeError, ValueError, httpx.HTTPError) as exc:
        raise fail(str(exc), 1) from None
    finally:
        if embedded is not None:
            embedded.stop()
    if save_result:
        save_result.write_text(json.dumps(result, indent=2))
    if report and result["runs"]:
        from pdscope.report.bench_html import render_html

        report.write_text(render_html(result))
    if result["runs"]:
        render_bench(result, console)
    for path in (save_result, report):
        if path:
            console.print(f"wrote {path}")
    if result["partial"] or not result["runs"]:
        raise typer.Exit(1)


@app.command()
def simulate(
    model: Annotated[
        str, typer.Option("--model", "-m", help="As plan: preset, config.json or checkpoint.")
    ] = "8b",
    device: Annotated[
        str | None, typer.Option("--device", "-d", help="As plan: catalog device or 'local'.")
    ] = "h100-sxm",
    dtype: Annotated[str, typer.Option(help="Weight precision, as plan.")] = "bf16",
    kv_dtype: Annotated[str | None, typer.Option(help="KV cache precision, as plan.")] = None,
    bandwidth: Annotated[
        float | None, typer.Option(help="Peak GB/s (overrides the device's).")
    ] = None,
    tflops: Annotated[float | None, typer.Option(help="Peak dense TFLOP/s (overrides).")] = None,
    memory: Annotated[float | None, typer.Option(help="Device memory in GB (read as GiB).")] = None,
    gpu_memory_utilization: Annotated[
        float, typer.Option(help="Memory fraction for weights + KV.")
    ] = 0.9,
    kv_cache_memory: Annotated[
        str | None, typer.Option(help="KV pool size instead, e.g. 50MiB.")
    ] = None,
    bandwidth_efficiency: Annotated[
        float | None, typer.Option(help="Achieved / peak bandwidth.")
    ] = None,
    flops_efficiency: Annotated[float | None, typer.Option(help="Achieved / peak FLOP/s.")] = None,
    step_overhead_ms: Annotated[
        float | None, typer.Option(help="Fixed cost of every step.")
    ] = None,
    seq_overhead_ms: Annotated[
        float | None, typer.Option(help="Cost per sequence per step.")
    ] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Token budget of one step.")] = 2048,
    max_num_seqs: Annotated[int, typer.Option(help="Most requests running at once.")] = 256,
    max_model_len: Annotated[int, typer.Option(help="Prompt + output tokens per request.")] = 8192,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    enable_prefix_caching: Annotated[
        bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching")
    ] = True,
    enable_chunked_prefill: Annotated[
        bool, typer.Option("--enable-chunked-prefill/--no-chunked-prefill")
    ] = True,
    workload: Annotated[str, typer.Option(help="random, shared-prefix or long-prompt.")] = "random",
    num_prompts: Annotated[int, typer.Option(help="Requests.")] = 100,
    input_len: Annotated[str, typer.Option(help="random: N, LOW-HIGH or normal:MEAN:STD.")] = "128",
    output_len: OutputLen = "128",
    groups: Groups = 4,
    prefix_len: PrefixLen = 1024,
    suffix_len: SuffixLen = 64,
    streams: Streams = 8,
    stream_output: StreamOutput = 256,
    long_len: LongLen = 2000,
    long_rate: LongRate = 0.5,
    duration: Annotated[
        float | None,
        typer.Option(help="Stop sending after this many seconds (long-prompt: default 30)."),
    ] = None,
    request_rate: Annotated[float, typer.Option(help="Requests/s (inf = all at once).")] = math.inf,
    burstiness: Annotated[
        float, typer.Option(help="Gamma shape of arrival gaps (1 = Poisson).")
    ] = 1.0,
    max_concurrency: Annotated[int | None, typer.Option(help="Cap on requests in flight.")] = None,
    seed: Annotated[int, typer.Option(help="Workload and arrival seed.")] = 0,
    slo: Annotated[
        str | None, typer.Option(help="Goodput SLO, as bench: ttft=2s,tpot=50ms.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    save_result: Annotated[Path | None, typer.Option(help="Write the result JSON here.")] = None,
    report: Annotated[
        Path | None, typer.Option(help="Write bench's HTML report (with the server timeline) here.")
    ] = None,
) -> None:
    """Bench's workloads through pdscope's own scheduler on a roofline clock: latency and
    throughput for hardware you do not have. Not yet validated against the real engine (see
    docs/simulation.md)."""
    from pdscope.commands.simulate import SimulateSettings
    from pdscope.commands.simulate import simulate as run_simulation
    from pdscope.report.bench import render_bench
    from pdscope.specs.sizes import parse_bytes

    try:
        settings = SimulateSettings(
            model=model, device=device, dtype=dtype, kv_dtype=kv_dtype, bandwidth_gb_s=bandwidth,
            tflops=tflops, memory_gb=memory, gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=None if kv_cache_memory is None else parse_bytes(kv_cache_memory),
            bandwidth_efficiency=bandwidth_efficiency, flops_efficiency=flops_efficiency,
            step_overhead_ms=step_overhead_ms, seq_overhead_ms=seq_overhead_ms,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill, workload=workload,
            input_len=input_len, output_len=output_len, num_prompts=num_prompts, groups=groups,
            prefix_len=prefix_len, suffix_len=suffix_len, streams=streams,
            stream_output=stream_output, long_len=long_len, long_rate=long_rate,
            duration_s=duration, request_rate=request_rate, burstiness=burstiness,
            max_concurrency=max_concurrency, seed=seed, slo=slo,
        )  # fmt: skip
        result = run_simulation(settings)
    except (SpecError, ValueError) as exc:
        raise fail(str(exc)) from None
    if save_result is not None:
        save_result.write_text(json.dumps(result, indent=2))
    if report is not None:
        from pdscope.report.bench_html import render_html

        report.write_text(render_html(result))
    if as_json:
        print_json(result)
    else:
        render_bench(result, console)
        c = result["metadata"]["cost_params"]
        console.print(
            f"simulated: {c['bandwidth_gb_s']:g} GB/s, {c['tflops']:g} TFLOP/s, step overhead "
            f"{c['step_overhead_s'] * 1e3:g} ms, per sequence {c['seq_overhead_s'] * 1e3:g} ms "
            f"({c['source']}); KV pool {result['metadata']['kv_pool_tokens']:,} tokens"
        )


@app.command()
def watch(
    url: Annotated[
        str | None,
        typer.Argument(
            help="Server to watch, e.g. http://127.0.0.1:8000 (or its /metrics URL). Omit to "
            "start the embedded server with the built-in model."
        ),
    ] = None,
    window: Annotated[
        float | None,
        typer.Option(help="Seconds the quantiles and rates cover (default 60; 5 with --once)."),
    ] = None,
    interval: Annotated[float, typer.Option(help="Seconds between scrapes.")] = 1.0,
    history: Annotated[float, typer.Option(help="Seconds the sparklines reach back.")] = 300.0,
    once: Annotated[
        bool, typer.Option("--once", help="Watch for one window, print one snapshot, exit.")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="JSON instead of the live view (one line per snapshot)."),
    ] = False,
    record: Annotated[
        Path | None, typer.Option(help="Append every snapshot to this file as a JSON line.")
    ] = None,
    export: Annotated[
        tuple[str, Path] | None,
        typer.Option(
            help="'grafana DIR': write a Grafana dashboard and a prometheus.yml for URL, exit.",
            show_default=False,
        ),
    ] = None,
    runtime: Annotated[
        str, typer.Option(help="With --export: the dashboard's runtime (vllm, sglang, tgi).")
    ] = "vllm",
    report: Annotated[
        Path | None,
        typer.Option(help="Draw a --record file as an HTML page (written beside it, .html), exit."),
    ] = None,
    api_key: Annotated[str | None, typer.Option(help="Bearer token for the server.")] = None,
    server_args: Annotated[
        str, typer.Option(help="Flags for the embedded server, e.g. '--kv-cache-memory 64MiB'.")
    ] = "",
) -> None:
    """The article's five metrics of a live server (TTFT and ITL p50/p99, running, waiting,
    KV use) with throughput, preemptions and prefix-cache hits, over a sliding window, and the
    reading rules that hold."""
    import asyncio
    import shlex
    import tempfile

    from rich.live import Live

    from pdscope.commands import watch as cmd
    from pdscope.report.watch import render_watch

    if report is not None:
        from pdscope.report.watch_html import read_recording, render_watch_html

        out = report.with_suffix(".html")
        if out == report:
            raise fail(f"--report takes the --record file (JSON lines), got {report}")
        try:
            page = render_watch_html(read_recording(report))
            out.write_text(page, encoding="utf-8")
        except (ValueError, OSError) as exc:
            raise fail(str(exc)) from None
        console.print(f"wrote {out}")
        return
    if export is not None:
        from pdscope.commands.grafana import export_grafana

        kind, directory = export
        if kind != "grafana":
            raise fail(f"--export takes 'grafana DIR', got {kind!r}")
        try:
            paths = export_grafana(directory, url or "http://127.0.0.1:8000", runtime)
        except (ValueError, OSError) as exc:
            raise fail(str(exc)) from None
        for path in paths:
            console.print(f"wrote {path}")
        return
    try:
        settings = cmd.WatchSettings(
            url=url or "",
            window_s=window if window is not None else (5.0 if once else 60.0),
            interval_s=interval,
            history_s=history,
            api_key=api_key,
        )
    except ValueError as exc:
        raise fail(str(exc)) from None
    record_file = None
    if record is not None:
        try:
            record_file = record.open("a", encoding="utf-8")
        except OSError as exc:
            raise fail(f"cannot write --record {record}: {exc}") from None
    embedded = None
    if url is None:
        from pdscope.server.launch import start_server

        err_console.print("starting the embedded server (built-in small model) ...")
        log = Path(tempfile.mkdtemp(prefix="pdscope-watch-")) / "server.log"
        try:
            embedded = start_server("small", log, *shlex.split(server_args), name="small")
        except RuntimeError as exc:
            raise fail(str(exc), 1) from None
        settings.url = embedded.url
    live = None if (as_json or once) else Live(console=console, auto_refresh=False)
    last: dict[str, Any] = {}
    watchers: list[cmd.Watcher] = []

    def show(snapshot: cmd.WatchSnapshot, watcher: cmd.Watcher) -> None:
        data = snapshot.to_dict()
        last.clear()
        last.update(data)
        watchers[:] = [watcher]
        if record_file is not None:
            # One line per snapshot, flushed at once: Ctrl-C or a crash keeps every line.
            record_file.write(json.dumps(data) + "\n")
            record_file.flush()
        if live is not None:
            live.update(
                render_watch(
                    data,
                    watcher.history,
                    history_s=settings.history_s,
                    recent_events=watcher.recent_events,
                ),
                refresh=True,
            )
        elif as_json and not once:
            sys.stdout.write(json.dumps(data) + "\n")
            sys.stdout.flush()

    code = 0
    try:
        if live is not None:
            live.start()
        asyncio.run(cmd.run(settings, show, once=once))
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a live watch ends; the record is already on disk
    except cmd.NotPrometheusError as exc:
        if live is not None:
            live.stop()
            live = None
        raise fail(str(exc)) from None
    finally:
        if live is not None:
            live.stop()
        if record_file is not None:
            record_file.close()
        if embedded is not None:
            embedded.stop()
    if once and not last:  # interrupted before the first scrape answered
        raise typer.Exit(1)
    if once:
        if as_json:
            print_json(last)
        else:
            history = watchers[0].history if watchers else ()
            console.print(render_watch(last, history, history_s=settings.history_s))
        code = 0 if last.get("reachable") else 1
    if record is not None:
        err_console.print(f"recorded to {record}")
    if code:
        raise typer.Exit(code)


def _list_devices(as_json: bool) -> None:
    from rich.table import Table

    from pdscope.specs import catalog

    devices = catalog()
    if as_json:
        print_json([d.__dict__ | {"aliases": list(d.aliases)} for d in devices])
        return
    table = Table(title="Device catalog (dense peaks)", title_justify="left")
    for col in ("name", "device", "GB", "GB/s", "bf16 TFLOPS", "fp8 TFLOPS"):
        table.add_column(col, justify="left" if col in ("name", "device") else "right")
    for d in devices:
        table.add_row(
            d.name,
            d.label,
            _g(d.memory_gb),
            _g(d.bandwidth_gb_s),
            _g(d.tflops_bf16),
            _g(d.tflops_fp8),
        )
    console.print(table)


def _list_models(as_json: bool) -> None:
    from rich.table import Table

    from pdscope.specs import load_model, preset_names

    specs = [load_model(name) for name in preset_names()]
    if as_json:
        print_json(
            [
                {
                    "name": s.name,
                    "description": s.description,
                    "total_params": s.total_params,
                    "active_params": s.active_params,
                    "kv_values_per_token": s.kv_values_per_token,
                }
                for s in specs
            ]
        )
        return
    table = Table(title="Model presets", title_justify="left")
    for col in ("name", "params", "active", "layers", "description"):
        table.add_column(col, justify="right" if col in ("params", "active", "layers") else "left")
    for s in specs:
        table.add_row(
            s.name,
            f"{s.total_params / 1e9:.2f}B",
            f"{s.active_params / 1e9:.2f}B",
            str(s.num_layers),
            s.description,
        )
    console.print(table)


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:,g}"


if __name__ == "__main__":
    app()
