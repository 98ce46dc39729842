"""The `pdscope` command line: parses flags, calls a command module, prints.

Errors in facts or flags (:class:`SpecError`) print one line naming the problem and exit 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import inspect
import json
import math
import os
import sys
import tempfile
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from pdscope.commands.serve import ServeSettings
from pdscope.engine.args import EngineArgs
from pdscope.heap import startup_heap_frozen
from pdscope.specs import SpecError

if TYPE_CHECKING:
    from pdscope.commands.bench import BenchSettings
    from pdscope.commands.watch import Watcher, WatchSettings

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
# No emoji codes: ":100:" in a user's "normal:100:5" is a number, not an emoji.
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)


# Workload flags that bench and simulate share: one definition, one help text.
OutputLen = Annotated[str, typer.Option(help="Output tokens: N, LOW-HIGH or normal:MEAN:STD.")]
Groups = Annotated[int, typer.Option(help="shared-prefix: prefix groups.")]
PrefixLen = Annotated[int, typer.Option(help="shared-prefix: prefix tokens.")]
SuffixLen = Annotated[int, typer.Option(help="shared-prefix: unique suffix tokens.")]
Streams = Annotated[int, typer.Option(help="long-prompt: decode streams.")]
StreamOutput = Annotated[int, typer.Option(help="long-prompt: tokens per stream.")]
LongLen = Annotated[int, typer.Option(help="long-prompt: tokens per long prompt.")]
LongRate = Annotated[float, typer.Option(help="long-prompt: long prompts per second.")]

# Each command's flags, declared once here so the command functions stay short; a flag that
# several commands share with the same help (--api, --api-key) has one alias.

# plan
PlanModel = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Preset name (see --list-models), a config.json, or a checkpoint directory.",
    ),
]
PlanDevice = Annotated[
    str | None,
    typer.Option(
        "--device",
        "-d",
        help="Catalog device (see --list-devices), or 'local' to measure this machine. "
        "Omit with --bandwidth to describe your own device.",
    ),
]
PlanDtype = Annotated[
    str | None,
    typer.Option(
        help="Weight precision: fp32, bf16, fp16, fp8, int8, int4, mxfp4 (MoE experts only, "
        "as gpt-oss ships), q8_0, q6_k, q5_k_m, q4_k_m, q4_0. Default: a GGUF model's own "
        "(its tensors' bytes), else bf16.",
    ),
]
KvDtype = Annotated[
    str | None,
    typer.Option(
        help="KV cache precision: fp32, bf16, fp16, fp8 (default: follows --dtype, else bf16).",
    ),
]
Context = Annotated[
    int | None,
    typer.Option(
        help="Tokens already in the KV cache during decode (default 4096; 0 for --compare).",
    ),
]
PlanPromptTokens = Annotated[int, typer.Option(help="Prompt length for the prefill figures.")]
GpuMemoryUtilization = Annotated[
    float,
    typer.Option(
        help="Fraction of device memory the server may use (vLLM's flag), 0-1.",
    ),
]
Bandwidth = Annotated[
    float | None,
    typer.Option(
        help="Memory bandwidth in GB/s: a custom device, or override the named one.",
    ),
]
Tflops = Annotated[
    float | None,
    typer.Option(
        help="Dense peak TFLOP/s: a custom device, or override the named one.",
    ),
]
Memory = Annotated[
    float | None,
    typer.Option(
        help="Device memory in GB (read as GiB, like the catalog).",
    ),
]
Compare = Annotated[
    bool,
    typer.Option(
        "--compare",
        help="The seed article's table: the decode ceiling on each device.",
    ),
]
AllDevices = Annotated[
    bool,
    typer.Option(
        "--all",
        help="With --compare: every catalog device, not just the article's six.",
    ),
]
PlanAsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
ListDevices = Annotated[
    bool,
    typer.Option(
        "--list-devices",
        help="List the device catalog and exit.",
    ),
]
ListModels = Annotated[
    bool,
    typer.Option(
        "--list-models",
        help="List the model presets and exit.",
    ),
]

# make-model
Directory = Annotated[Path, typer.Argument(help="Where to write the checkpoint.")]
Preset = Annotated[
    str, typer.Option(help="tiny (tests, a few hundred KB) or small (168M, the embedded default).")
]
Arch = Annotated[str, typer.Option(help="llama, mistral, qwen2 or qwen3.")]
MakeDtype = Annotated[str, typer.Option(help="float32, bfloat16 or float16.")]
MakeSeed = Annotated[int, typer.Option(help="Weights are a pure function of the seed.")]
Layers = Annotated[int | None, typer.Option(help="num_hidden_layers.")]
Hidden = Annotated[int | None, typer.Option(help="hidden_size.")]
Intermediate = Annotated[int | None, typer.Option(help="intermediate_size.")]
Heads = Annotated[int | None, typer.Option(help="num_attention_heads.")]
KvHeads = Annotated[int | None, typer.Option(help="num_key_value_heads.")]
Vocab = Annotated[int | None, typer.Option(help="vocab_size (tokenizer trained to it).")]
MaxLen = Annotated[int | None, typer.Option(help="max_position_embeddings.")]

# probe
ProbeUrl = Annotated[
    str | None,
    typer.Argument(
        help="Server to probe, e.g. "
        "http://127.0.0.1:8000. Omit to start the "
        "embedded server with the built-in model."
    ),
]
Api = Annotated[str, typer.Option(help="auto, openai-completions, openai-chat or ollama.")]
ProbeModel = Annotated[
    str | None, typer.Option(help="Model to probe (optional when the server has one).")
]
ApiKey = Annotated[str | None, typer.Option(help="Bearer token for the server.")]
ProbePromptTokens = Annotated[str, typer.Option(help="Sweep of prompt lengths in tokens.")]
OutputTokens = Annotated[int, typer.Option(help="Output tokens per request.")]
Repeats = Annotated[int, typer.Option(help="Requests per sweep point.")]
BatchStreams = Annotated[
    int,
    typer.Option(
        help="Streams sent at once for the batched-decode checks: 2 or more, or 0 to skip them."
    ),
]
BatchSweep = Annotated[
    str,
    typer.Option(
        help="More stream counts for the batched decode at short prompts, e.g. 2,32: the step's "
        "cost by batch size, which simulate --calibrate fits (0 skips them)."
    ),
]
BatchContext = Annotated[
    int,
    typer.Option(
        help="Prompt tokens of the second batched-decode check, the same streams at long "
        "context (0 skips it)."
    ),
]
BenchTimeout = Annotated[
    float,
    typer.Option(
        "--timeout",
        help="Seconds allowed per request: vllm bench serve's 6 h by default, so a request a "
        "slow server keeps queued counts as served, with its wait.",
    ),
]
ProbeTimeout = Annotated[
    float | None,
    typer.Option(
        "--timeout",
        help="Seconds allowed per request. Default: 120, or 3x what the rates the probe has "
        "read from the server predict for the request where that is longer.",
    ),
]
MaxModelLen = Annotated[
    int | None,
    typer.Option(
        help="Cap for prompt + output, in place of the server's own (needed where the server "
        "reports none)."
    ),
]
ProbeDevice = Annotated[
    str | None,
    typer.Option(
        help="Device for the ceiling: catalog name or 'local' (default for the embedded server)."
    ),
]
ProbePlanModel = Annotated[
    str | None,
    typer.Option(
        help="Model for the ceiling: preset or "
        "config.json (default: the server's "
        "checkpoint when local)."
    ),
]
ProbeDtype = Annotated[str | None, typer.Option(help="Weight precision for the ceiling.")]
ProbeSeed = Annotated[
    int | None,
    typer.Option(
        help="Repeat an earlier run's prompts (its seed is in the result). Default: fresh "
        "random prompts, so no run meets an earlier one's in the prefix cache."
    ),
]
JsonFile = Annotated[Path | None, typer.Option("--json", help="Write every trace and figure here.")]
Plot = Annotated[Path | None, typer.Option(help="Write TTFT and decode plots (PNG).")]

# bench
BenchUrl = Annotated[
    str | None,
    typer.Argument(
        help="Server to load; omit to start the embedded "
        "server. 'compare A.json B.json' compares two "
        "saved runs."
    ),
]
Files = Annotated[
    list[Path] | None,
    typer.Argument(help="With 'compare': two result files.", show_default=False),
]
BenchModel = Annotated[str | None, typer.Option(help="Model (optional when the server has one).")]
Workload = Annotated[
    str,
    typer.Option(help="random, shared-prefix, long-prompt or file:PATH (JSONL or ShareGPT JSON)."),
]
NumPrompts = Annotated[
    int,
    typer.Option(
        help="Requests per run. With no URL and no load flag, the embedded server's short "
        "default load: 32 requests, 8 at a time, 64 output tokens."
    ),
]
InputLen = Annotated[str, typer.Option(help="random: N, LOW-HIGH or normal:MEAN:STD tokens.")]
RequestRate = Annotated[
    str, typer.Option(help="Requests/s, or a series: 1,2,4,8 (inf = all at once).")
]
MaxConcurrency = Annotated[
    str | None, typer.Option(help="Cap on requests in flight, or a series: 1,4,16,64.")
]
Burstiness = Annotated[float, typer.Option(help="Gamma shape of arrival gaps (1 = Poisson).")]
Duration = Annotated[float | None, typer.Option(help="Stop sending after this many seconds.")]
Warmup = Annotated[int, typer.Option(help="Warm-up requests, excluded.")]
RampUp = Annotated[float, typer.Option(help="Seconds over which the rate ramps up.")]
BenchSeed = Annotated[
    int | None,
    typer.Option(
        help="Seed for lengths, prompts and arrivals, to repeat a run exactly (its seed is "
        "in the result). Default: fresh prompts every run."
    ),
]
Percentiles = Annotated[str, typer.Option(help="Percentiles to report.")]
Slo = Annotated[
    str | None,
    typer.Option(
        help="Goodput SLOs per request: "
        "ttft=2s,tpot=100ms,e2e=10s; with "
        "--find-capacity: p99_ttft=2s,p99_itl=100ms."
    ),
]
FindCapacity = Annotated[
    bool, typer.Option("--find-capacity", help="Search the highest concurrency meeting --slo.")
]
Sweep = Annotated[
    str | None, typer.Option(help="'auto': double concurrency until throughput saturates.")
]
SaveResult = Annotated[
    Path | None,
    typer.Option(help="Write the result JSON (vllm bench serve's field names) here."),
]
BenchServerArgs = Annotated[
    str,
    typer.Option(help="Flags for the embedded server, e.g. '--max-num-batched-tokens 256'."),
]
BenchReport = Annotated[
    Path | None, typer.Option(help="Write a self-contained HTML report with plots here.")
]

# watch
WatchUrl = Annotated[
    str | None,
    typer.Argument(
        help="Server to watch, e.g. http://127.0.0.1:8000 (or its /metrics URL). Omit to "
        "start the embedded server with the built-in model."
    ),
]
Window = Annotated[
    float | None,
    typer.Option(help="Seconds the quantiles and rates cover (default 60; 5 with --once)."),
]
Interval = Annotated[float, typer.Option(help="Seconds between scrapes.")]
History = Annotated[float, typer.Option(help="Seconds the sparklines reach back.")]
Once = Annotated[
    bool, typer.Option("--once", help="Watch for one window, print one snapshot, exit.")
]
WatchAsJson = Annotated[
    bool,
    typer.Option("--json", help="JSON instead of the live view (one line per snapshot)."),
]
Record = Annotated[
    Path | None, typer.Option(help="Append every snapshot to this file as a JSON line.")
]
Export = Annotated[
    tuple[str, Path] | None,
    typer.Option(
        help="'grafana DIR': write a Grafana dashboard and a prometheus.yml for URL, exit.",
        show_default=False,
    ),
]
Runtime = Annotated[
    str, typer.Option(help="With --export: the dashboard's runtime (vllm, sglang, tgi).")
]
WatchReport = Annotated[
    Path | None,
    typer.Option(help="Draw a --record file as an HTML page (written beside it, .html), exit."),
]
WatchServerArgs = Annotated[
    str, typer.Option(help="Flags for the embedded server, e.g. '--kv-cache-memory 64MiB'.")
]


# `pdscope simulate`: plan's device and model flags, serve's engine knobs, bench's load flags
# (the shared ones above), the cluster's shape.
SimModel = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="As plan: preset, config.json or checkpoint (default: 8b; with --calibrate, "
        "the probed server's checkpoint).",
    ),
]
SimDevice = Annotated[
    str | None,
    typer.Option(
        "--device",
        "-d",
        help="As plan: catalog device or 'local' (default: h100-sxm; with --calibrate, a "
        "device of the fitted rates whose KV pool is --kv-cache-memory, default 1GiB).",
    ),
]
SimCalibrate = Annotated[
    str | None,
    typer.Option(
        help="Fit bandwidth, FLOP/s and overheads to a saved `pdscope probe --json` of "
        "the server modelled (pass its engine args too)."
    ),
]
SimCalibrateBudget = Annotated[
    int,
    typer.Option(
        min=1,
        help="With --calibrate: the probed server's --max-num-batched-tokens (pdscope serve's "
        "default 2048), which may differ from the one simulated.",
    ),
]
SimStepJitter = Annotated[
    bool,
    typer.Option(
        help="With --calibrate: scatter each step's time as the probed server's decode gaps "
        "scattered (mean kept; seeded).",
    ),
]
SimDtype = Annotated[str | None, typer.Option(help="Weight precision, as plan.")]
SimKvDtype = Annotated[str | None, typer.Option(help="KV cache precision, as plan.")]
SimBandwidth = Annotated[float | None, typer.Option(help="Peak GB/s (overrides the device's).")]
SimTflops = Annotated[float | None, typer.Option(help="Peak dense TFLOP/s (overrides).")]
SimMemory = Annotated[float | None, typer.Option(help="Device memory in GB (read as GiB).")]
SimGpuMemoryUtilization = Annotated[float, typer.Option(help="Memory fraction for weights + KV.")]
SimKvCacheMemory = Annotated[str | None, typer.Option(help="KV pool size instead, e.g. 50MiB.")]
SimBandwidthEfficiency = Annotated[float | None, typer.Option(help="Achieved / peak bandwidth.")]
SimFlopsEfficiency = Annotated[float | None, typer.Option(help="Achieved / peak FLOP/s.")]
SimStepOverheadMs = Annotated[float | None, typer.Option(help="Fixed cost of every step.")]
SimSeqOverheadMs = Annotated[float | None, typer.Option(help="Cost per sequence per step.")]
SimMaxNumBatchedTokens = Annotated[int, typer.Option(help="Token budget of one step.")]
SimMaxNumSeqs = Annotated[int, typer.Option(help="Most requests running at once.")]
SimMaxModelLen = Annotated[
    int | None,
    typer.Option(
        help="Prompt + output tokens per request (default: the probed server's with "
        "--calibrate, else the model's own up to 8192)."
    ),
]
SimBlockSize = Annotated[int, typer.Option(help="Tokens per KV block.")]
SimEnablePrefixCaching = Annotated[
    bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching")
]
SimEnableChunkedPrefill = Annotated[
    bool, typer.Option("--enable-chunked-prefill/--no-chunked-prefill")
]
SimWorkload = Annotated[
    str, typer.Option(help="random, shared-prefix, long-prompt or file:PATH (as bench).")
]
SimTokenizer = Annotated[
    str | None,
    typer.Option(
        help="file: workloads: a directory with tokenizer.json that counts the prompts "
        "(default: the model's checkpoint)."
    ),
]
SimNumPrompts = Annotated[int, typer.Option(help="Requests.")]
SimInputLen = Annotated[str, typer.Option(help="random: N, LOW-HIGH or normal:MEAN:STD.")]
SimDuration = Annotated[
    float | None,
    typer.Option(help="Stop sending after this many seconds (long-prompt: default 30)."),
]
SimRequestRate = Annotated[float, typer.Option(help="Requests/s (inf = all at once).")]
SimMaxConcurrency = Annotated[int | None, typer.Option(help="Cap on requests in flight.")]
SimSeed = Annotated[int, typer.Option(help="Workload and arrival seed.")]
SimSlo = Annotated[
    str | None,
    typer.Option(
        help="Goodput SLO, as bench: ttft=2s,tpot=50ms; with --find-capacity: "
        "p99_ttft=2s,p99_itl=100ms."
    ),
]
SimFindCapacity = Annotated[
    bool,
    typer.Option(
        "--find-capacity",
        help="Search the highest concurrency (or, with a finite --request-rate, rate) "
        "meeting --slo: bench's search, one fresh simulated server per run.",
    ),
]
SimMaxRuns = Annotated[int, typer.Option(help="Most runs of the capacity search.")]
SimAsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
SimSaveResult = Annotated[Path | None, typer.Option(help="Write the result JSON here.")]
SimReport = Annotated[
    Path | None, typer.Option(help="Write bench's HTML report (with the server timeline) here.")
]
SimReplicas = Annotated[int | None, typer.Option(help="Replicas behind a router.")]
SimRouter = Annotated[str, typer.Option(help="round-robin, least-loaded or prefix-aware.")]
SimTensorParallelSize = Annotated[
    int, typer.Option("--tensor-parallel-size", "-tp", help="GPUs per replica (dense).")
]
SimTpLink = Annotated[
    str | None, typer.Option(help="GPU link: nvlink3/4/5, xgmi, pcie4/5 (default: device's).")
]
SimTpLinkGbS = Annotated[float | None, typer.Option(help="Link GB/s per direction.")]
SimTpLinkLatencyUs = Annotated[float | None, typer.Option(help="Fixed cost of one all-reduce.")]
SimGpus = Annotated[int | None, typer.Option(help="GPUs in all (checked against the split).")]
SimDisaggregate = Annotated[str | None, typer.Option(help="P:D prefill and decode workers.")]
SimPrefillDevice = Annotated[str | None, typer.Option(help="Prefill pool's device.")]
SimDecodeDevice = Annotated[str | None, typer.Option(help="Decode pool's device.")]
SimPrefillArgs = Annotated[
    str | None, typer.Option(help="Prefill pool: tp=2,max-num-batched-tokens=8192,...")
]
SimDecodeArgs = Annotated[str | None, typer.Option(help="Decode pool: tp=1,max-num-seqs=512,...")]
SimKvLinkGbS = Annotated[float, typer.Option(help="KV link between the pools, GB/s.")]
SimKvLinkLatencyMs = Annotated[float, typer.Option(help="KV link cost per transfer.")]
SimFirstToken = Annotated[
    str, typer.Option(help="Disaggregated: first token from the prefill or decode worker.")
]
SimPlanCapacity = Annotated[
    bool,
    typer.Option(
        "--plan-capacity", help="Search --gpus for the most goodput per GPU within --slo."
    ),
]
SimPlot = Annotated[Path | None, typer.Option(help="--plan-capacity: PNG of the frontier.")]
SimPlanBudgets = Annotated[str, typer.Option(help="--plan-capacity: budgets.")]
SimPlanTp = Annotated[str, typer.Option(help="--plan-capacity: TP sizes.")]
SimPlanExhaustive = Annotated[
    bool,
    typer.Option(
        "--plan-exhaustive",
        help=(
            "--plan-capacity: bisect every configuration, no link bound or early stop; "
            "splits run whole."
        ),
    ),
]


def error_line(message: str) -> None:
    # the message quotes what the user typed: brackets in it are text, not markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)


def fail(message: str, code: int = 2) -> typer.Exit:
    error_line(message)
    return typer.Exit(code)


def typed(ctx: typer.Context) -> frozenset[str]:
    """The parameters of the running command the user set (on the command line or through the
    environment), by name; the rest took their defaults."""
    out = []
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name) if p.name else None
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            out.append(p.name)
    return frozenset(out)


def given(ctx: typer.Context, *names: str) -> list[str]:
    """The options among parameter ``names`` that the user set, each as its flag."""
    out = []
    chosen = typed(ctx)
    for p in ctx.command.params:
        if p.name in names and p.name in chosen:
            off = getattr(p, "secondary_opts", None) and not ctx.params.get(p.name)
            out.append(max(p.secondary_opts if off else p.opts, key=len))  # --model, not -m
    return out


def given_except(ctx: typer.Context, *kept: str) -> list[str]:
    """The options the user set other than ``kept`` (parameter names)."""
    return given(ctx, *(p.name for p in ctx.command.params if p.name and p.name not in kept))


def _no_effect(flags: list[str], where: str) -> typer.Exit:
    verb = "has" if len(flags) == 1 else "have"
    return fail(f"{', '.join(flags)} {verb} no effect {where}")


def only_with(ctx: typer.Context, present: bool, needs: str, *names: str) -> None:
    """Refuse options that take effect only with ``needs`` when it is absent: an option
    ignored in silence lets its user believe it took effect."""
    if not present and (extra := given(ctx, *names)):
        raise _no_effect(extra, f"without {needs}")


def not_with(ctx: typer.Context, present: bool, what: str, *names: str) -> None:
    """Refuse options that ``what`` overrides or leaves unused, when it is present."""
    if present and (extra := given(ctx, *names)):
        raise _no_effect(extra, f"with {what}")


# The options of each built-in workload; another workload ignores them.
WORKLOAD_OPTIONS = {
    "random": ("input_len",),
    "shared-prefix": ("groups", "prefix_len", "suffix_len"),
    "long-prompt": ("streams", "stream_output", "long_len", "long_rate"),
}


def check_workload_options(ctx: typer.Context, workload: str) -> None:
    """bench's and simulate's workload options, refused where the workload ignores them."""
    for name, options in WORKLOAD_OPTIONS.items():
        only_with(ctx, workload == name, f"--workload {name}", *options)
    not_with(
        ctx,
        workload == "long-prompt",
        "--workload long-prompt (its streams and long prompts set their own lengths and "
        "arrivals)",
        "num_prompts", "output_len", "request_rate", "burstiness", "ramp_up",
    )  # fmt: skip


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@contextlib.contextmanager
def exit_on(code: int, *errors: type[Exception]) -> Iterator[None]:
    """Turn ``errors`` into one line on stderr and exit ``code``: 2 for bad flags or facts,
    1 for a run that failed. (Never RuntimeError itself: typer.Exit is one.)"""
    try:
        yield
    except errors as exc:
        raise fail(str(exc) or type(exc).__name__, code) from None


def check_url(url: str | None) -> None:
    """Refuse a server URL no request could reach, before anything runs: one line, exit 2."""
    if url is None:
        return
    import httpx

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise fail(f"{url!r} is not a server URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise fail(
            f"{url!r} is not a server URL: give http://HOST:PORT, e.g. http://127.0.0.1:8000"
        )
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise fail(f"{url!r}: port {parsed.port} is outside 1-65535")


def check_output(path: Path | None, option: str, figure: bool = False) -> None:
    """Refuse an output file that cannot be written before the run, not after it: a missing
    or unwritable folder, a directory, or (``figure``) a format matplotlib cannot save."""
    if path is None:
        return
    folder = path.parent  # Path("x.json").parent is Path(".")
    if path.is_dir():
        raise fail(f"{option} {path} is a directory, not a file")
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise fail(f"{option} {path}: {folder} {what}")
    # Tried as the run will write it: a folder's mode bits do not tell (/proc, or a read-only
    # mount, under root). A regular file is opened for appending (nothing written); a new one
    # is tried as a scratch file beside it, so the path itself (a dangling link) is not made
    # and removed; anything else (a FIFO, a device) is not opened: closing a FIFO would end
    # its reader.
    try:
        if path.exists() and not path.is_file():  # a FIFO, a device, /dev/stdout
            if not os.access(path, os.W_OK):
                raise PermissionError(errno.EACCES, "Permission denied")
        elif path.exists():
            with path.open("a"):
                pass
        else:  # a new file, or a dangling link's target: where the write will land
            where = (path.resolve() if path.is_symlink() else path).parent
            with tempfile.NamedTemporaryFile(dir=where, prefix=".pdscope-check-"):
                pass
    except OSError as exc:
        raise fail(f"{option} {path}: cannot be written ({exc.strerror or exc})") from None
    if figure:
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()
        if path.suffix.lstrip(".").lower() not in formats:
            raise fail(f"{option} {path}: the name must end in one of .{', .'.join(formats)}")


def note(message: str) -> None:
    err_console.print(message, highlight=False)


def write_outputs(
    *outputs: tuple[str, Path | None, Callable[[Path], object]], announce: bool = True
) -> bool:
    """Write each (option, path, writer) with a path, after the results are shown: a write
    that fails then loses a file, not the run. Says what it wrote (with ``announce``), and
    names the option of what it could not; False if any failed (the command then exits 1)."""
    written = True
    for option, path, write in outputs:
        if path is None:
            continue
        try:
            write(path)
        except (OSError, ValueError) as exc:
            error_line(f"cannot write {option} {path}: {exc}")
            written = False
        else:
            if announce:
                console.print(f"wrote {escape(str(path))}", highlight=False)
    return written


def json_writer(data: object) -> Callable[[Path], object]:
    return lambda path: path.write_text(json.dumps(data, indent=2))


def bench_outputs(result: dict[str, Any], save_result: Path | None, report: Path | None) -> bool:
    """bench's files: the result JSON, and the HTML page when there are runs."""
    from pdscope.report.bench_html import render_html

    return write_outputs(
        ("--save-result", save_result, json_writer(result)),
        ("--report", report if result["runs"] else None,
         lambda p: p.write_text(render_html(result))),
    )  # fmt: skip


def flags_from(*classes: type) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a ``**flags`` command one option per field of ``classes`` that carries a ``help``
    (see ``engine/args.py``): a new engine knob is one field there, and a flag here."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        params = []
        for cls in classes:
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                if "help" in f.metadata:
                    option = typer.Option(*f.metadata.get("flags", ()), help=f.metadata["help"])
                    kind = f.metadata.get("cli_type", hints[f.name])
                    params.append(
                        inspect.Parameter(
                            f.name,
                            inspect.Parameter.KEYWORD_ONLY,
                            default=f.default,
                            annotation=Annotated[kind, option],
                        )
                    )
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        return command

    return decorate


def split_flags(flags: dict[str, Any], cls: type) -> dict[str, Any]:
    """Take the flags that are fields of ``cls`` out of ``flags``."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {name: flags.pop(name) for name in list(flags) if name in names}


@app.callback()
def main() -> None:
    """pdscope: plan, serve, probe and bench LLM prefill and decode."""


@app.command()
def plan(
    ctx: typer.Context,
    model: PlanModel = "8b",
    device: PlanDevice = None,
    dtype: PlanDtype = None,
    kv_dtype: KvDtype = None,
    context: Context = None,
    prompt_tokens: PlanPromptTokens = 2000,
    gpu_memory_utilization: GpuMemoryUtilization = 0.9,
    bandwidth: Bandwidth = None,
    tflops: Tflops = None,
    memory: Memory = None,
    compare: Compare = False,
    all_devices: AllDevices = False,
    as_json: PlanAsJson = False,
    list_devices: ListDevices = False,
    list_models: ListModels = False,
) -> None:
    """The paper arithmetic: weight bytes, decode ceilings, KV sizes, pool capacity, prefill
    FLOPs and the TTFT floor, and batched decode, for a model on a device."""
    from pdscope.commands import plan as cmd
    from pdscope.report import plan as view

    if list_devices and list_models:
        raise fail("give --list-devices or --list-models, not both")
    listing = list_devices or list_models
    if listing and (extra := given_except(ctx, "as_json", "list_devices", "list_models")):
        raise _no_effect(extra, "with --list-devices or --list-models (they list the catalog)")
    only_with(ctx, compare, "--compare", "all_devices")
    not_with(
        ctx,
        compare,
        "--compare (the article's table: each catalog device at its own figures)",
        "bandwidth", "tflops", "memory", "gpu_memory_utilization", "prompt_tokens",
    )  # fmt: skip
    with exit_on(2, SpecError):
        if list_devices or list_models:
            _list_catalog(list_devices, as_json)
            return
        if compare:
            rows, title = cmd.seed_table(
                model, device, dtype, kv_dtype, context, prompt_tokens, all_devices
            )
            if as_json:
                print_json(rows)
            else:
                view.render_compare(rows, title, console)
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
    if as_json:
        print_json(result)
    else:
        view.render_plan(result, console)


def _list_catalog(devices: bool, as_json: bool) -> None:
    """`plan --list-devices` (when ``devices``) or `plan --list-models`."""
    from pdscope.commands import plan as cmd
    from pdscope.report import plan as view
    from pdscope.specs import catalog, load_model, preset_names

    if devices:
        found = list(catalog())
        if as_json:
            print_json(cmd.device_rows(found))
        else:
            view.render_device_catalog(found, console)
        return
    specs = [load_model(name) for name in preset_names()]
    if as_json:
        print_json(cmd.model_rows(specs))
    else:
        view.render_model_presets(specs, console)


@app.command("make-model")
def make_model_cmd(
    directory: Directory,
    preset: Preset = "tiny",
    arch: Arch = "llama",
    dtype: MakeDtype = "bfloat16",
    seed: MakeSeed = 0,
    layers: Layers = None,
    hidden: Hidden = None,
    intermediate: Intermediate = None,
    heads: Heads = None,
    kv_heads: KvHeads = None,
    vocab: Vocab = None,
    max_len: MaxLen = None,
) -> None:
    """Write a random-weight Hugging Face checkpoint with a real BPE tokenizer.

    Random weights produce meaningless text but cost exactly what a real model of the same
    shape costs, which is all that latency needs. No download, ever."""
    from pdscope.checkpoint.make_model import make_model, num_parameters
    from pdscope.specs.models import read_config

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
    config = read_config(path)
    size = (path / "model.safetensors").stat().st_size
    console.print(
        f"wrote {path}: {config['architectures'][0]}, "
        f"{num_parameters(config) / 1e6:,.1f}M parameters, {config['torch_dtype']}, "
        f"{size / 1e6:,.1f} MB of weights, vocabulary {config['vocab_size']:,}"
    )


@app.command()
@flags_from(EngineArgs, ServeSettings)
def serve(**flags: Any) -> None:
    """Serve the engine over HTTP: OpenAI (/v1) and Ollama (/api) routes, vLLM-named
    Prometheus metrics on /metrics."""
    from pdscope.commands.serve import serve as run_server

    with exit_on(2, ValueError):
        args = EngineArgs(**split_flags(flags, EngineArgs))
        settings = ServeSettings(**flags)
    with exit_on(2, ValueError, FileNotFoundError):
        run_server(args, settings)


@app.command()
def probe(
    ctx: typer.Context,
    url: ProbeUrl = None,
    api: Api = "auto",
    model: ProbeModel = None,
    api_key: ApiKey = None,
    prompt_tokens: ProbePromptTokens = "200,500,1000,2000",
    output_tokens: OutputTokens = 64,
    repeats: Repeats = 3,
    batch_streams: BatchStreams = 8,
    batch_sweep: BatchSweep = "2,32",
    batch_context: BatchContext = 1024,
    timeout: ProbeTimeout = None,
    max_model_len: MaxModelLen = None,
    device: ProbeDevice = None,
    plan_model: ProbePlanModel = None,
    dtype: ProbeDtype = None,
    seed: ProbeSeed = None,
    json_file: JsonFile = None,
    plot: Plot = None,
) -> None:
    """Measure one server's prefill and decode apart: a prompt-length sweep, a prefix-cache
    check, a context check; fit, ceilings and findings."""
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from pdscope.client.detect import ProbeError
    from pdscope.commands.embedded import EmbeddedServerError, embedded_server
    from pdscope.commands.probe import ProbeSettings
    from pdscope.commands.probe import probe as run_probe
    from pdscope.report.probe import plot_probe, render_probe
    from pdscope.report.units import fmt_left

    check_url(url)
    check_output(json_file, "--json")
    check_output(plot, "--plot", figure=True)
    only_with(
        ctx, batch_streams >= 2, "--batch-streams of 2 or more", "batch_context", "batch_sweep"
    )
    with exit_on(2, ValueError):
        settings = ProbeSettings.from_flags(
            url, prompt_tokens, api=api, model=model, api_key=api_key,
            output_tokens=output_tokens, repeats=repeats, batch_streams=batch_streams,
            batch_sweep=batch_sweep, batch_context_tokens=batch_context, timeout_s=timeout,
            max_model_len=max_model_len, device=device, plan_model=plan_model, dtype=dtype,
            seed=seed,
        )  # fmt: skip
    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[left]}"), console=err_console, transient=True,
    )  # fmt: skip
    task = bar.add_task("probing", total=None, left="")
    with (
        exit_on(1, ProbeError, EmbeddedServerError),
        embedded_server(url, "probe", announce=note) as settings.url,
        bar,
        startup_heap_frozen(),  # a collector's pause here would read as server latency
    ):
        result = asyncio.run(
            run_probe(
                settings,
                on_start=lambda n: bar.update(task, total=n),
                tick=lambda label: bar.update(task, advance=1, description=label),
                on_left=lambda left_s: bar.update(task, left=fmt_left(left_s)),
            )
        )
    try:
        render_probe(result, console)
    finally:  # a fault in the printing still leaves the files
        written = write_outputs(
            ("--json", json_file, json_writer(result)),
            ("--plot", plot, lambda p: plot_probe(result, p)),
        )
    # Any failed request or part left unmeasured fails the command: a script reading only the
    # exit code must not take a half-made measurement for a whole one.
    if result["partial"] or result["failures"] or result["unmeasured"] or not written:
        raise typer.Exit(1)


@app.command()
def bench(
    ctx: typer.Context,
    url: BenchUrl = None,
    files: Files = None,
    api: Api = "auto",
    model: BenchModel = None,
    api_key: ApiKey = None,
    workload: Workload = "random",
    num_prompts: NumPrompts = 100,
    input_len: InputLen = "128",
    output_len: OutputLen = "128",
    groups: Groups = 4,
    prefix_len: PrefixLen = 1024,
    suffix_len: SuffixLen = 64,
    streams: Streams = 8,
    stream_output: StreamOutput = 256,
    long_len: LongLen = 2000,
    long_rate: LongRate = 0.5,
    request_rate: RequestRate = "inf",
    max_concurrency: MaxConcurrency = None,
    burstiness: Burstiness = 1.0,
    duration: Duration = None,
    warmup: Warmup = 1,
    ramp_up: RampUp = 0.0,
    seed: BenchSeed = None,
    percentiles: Percentiles = "50,90,95,99",
    slo: Slo = None,
    find_capacity: FindCapacity = False,
    sweep: Sweep = None,
    timeout: BenchTimeout = 21600.0,
    save_result: SaveResult = None,
    server_args: BenchServerArgs = "",
    report: BenchReport = None,
) -> None:
    """Load a server: arrivals, workloads, latency percentiles, goodput, the server's own
    metrics, and the capacity where p99 breaks."""
    from pdscope.analysis.bench import nothing_completed
    from pdscope.commands.bench import BenchSettings
    from pdscope.report.bench import render_bench

    if url == "compare":
        if extra := given_except(ctx, "url", "files"):
            raise fail(f"bench compare takes two result files and no options; drop {extra[0]}")
        _bench_compare(files)
        return
    if files:
        raise fail(f"unexpected arguments: {' '.join(map(str, files))}")
    check_url(url)
    check_output(save_result, "--save-result")
    check_output(report, "--report")
    not_with(ctx, url is not None, "a URL (they are the embedded server's flags)", "server_args")
    check_workload_options(ctx, workload)
    not_with(
        ctx,
        sweep == "auto",
        "--sweep auto (it doubles the concurrency at rate inf)",
        "request_rate", "max_concurrency", "find_capacity",
    )  # fmt: skip
    not_with(ctx, find_capacity, "--find-capacity (it chooses the concurrency)", "max_concurrency")
    with exit_on(2, ValueError):
        settings = BenchSettings.from_flags(
            url, request_rate, max_concurrency, percentiles, slo, find_capacity, sweep,
            typed=typed(ctx),
            api=api, model=model, api_key=api_key, workload=workload, num_prompts=num_prompts,
            input_len=input_len, output_len=output_len, groups=groups, prefix_len=prefix_len,
            suffix_len=suffix_len, streams=streams, stream_output=stream_output,
            long_len=long_len, long_rate=long_rate, burstiness=burstiness, duration_s=duration,
            warmup=warmup, ramp_up_s=ramp_up, seed=seed, timeout_s=timeout,
        )  # fmt: skip
        if find_capacity and len(settings.request_rates) > 1:
            raise ValueError(
                f"--find-capacity searches from one --request-rate, got {request_rate!r}"
            )
    finite = [r for r in settings.request_rates if math.isfinite(r)]
    only_with(
        ctx,
        bool(finite),
        "a finite --request-rate (inf sends all at once)",
        "burstiness",
        "ramp_up",
    )
    result = _run_bench(settings, url, server_args)
    try:
        if result["runs"]:
            render_bench(result, console)
    finally:  # a fault in the printing still leaves the files
        written = bench_outputs(result, save_result, report)
    if (error := nothing_completed(result)) is not None:
        raise fail(f"every request of a run failed; the first: {error}", 1)
    if result["partial"] or not result["runs"] or not written:
        raise typer.Exit(1)


def _bench_compare(files: list[Path] | None) -> None:
    """`pdscope bench compare A.json B.json`."""
    from pdscope.report.bench import render_compare, runs_of

    if not files or len(files) != 2:
        raise fail("usage: pdscope bench compare A.json B.json")
    runs = []
    for f in files:
        try:
            runs.append(runs_of(json.loads(f.read_text())))
        except (OSError, ValueError) as exc:
            raise fail(f"cannot compare the saved runs: {f}: {exc}") from None
    try:
        render_compare(runs[0], runs[1], (files[0].name, files[1].name), console)
    except ValueError as exc:
        raise fail(f"cannot compare the saved runs: {exc}") from None


def _run_bench(settings: BenchSettings, url: str | None, server_args: str) -> dict[str, Any]:
    """Run the load with a progress line; Ctrl-C keeps what was measured (marked partial)."""
    import asyncio

    import httpx
    from rich.progress import Progress, TextColumn

    from pdscope.client.detect import ProbeError
    from pdscope.client.load import Progress as LoadProgress
    from pdscope.commands.bench import BenchState
    from pdscope.commands.bench import bench as run_bench
    from pdscope.commands.embedded import EmbeddedServerError, embedded_server

    state = BenchState()
    bar = Progress(TextColumn("{task.description}"), console=err_console, transient=True)
    task = bar.add_task("starting", total=None)

    def progress(level: str, p: LoadProgress) -> None:
        bar.update(
            task,
            description=f"{level}: {p.completed} done, {p.in_flight} in flight, "
            f"{p.failed} failed, {p.output_tok_s:,.0f} output tok/s",
        )

    try:
        with (
            exit_on(1, ProbeError, ValueError, httpx.HTTPError, EmbeddedServerError),
            embedded_server(url, "bench", server_args, note) as settings.url,
            bar,
            startup_heap_frozen(),  # a collector's pause here would read as server latency
        ):
            return asyncio.run(run_bench(settings, state, progress))
    except KeyboardInterrupt:
        state.partial = state.partial or "interrupted (Ctrl-C)"
        return state.result()


@app.command()
def simulate(
    ctx: typer.Context,
    model: SimModel = None,
    device: SimDevice = None,
    calibrate: SimCalibrate = None,
    calibrate_budget: SimCalibrateBudget = 2048,
    step_jitter: SimStepJitter = True,
    dtype: SimDtype = None,
    kv_dtype: SimKvDtype = None,
    bandwidth: SimBandwidth = None,
    tflops: SimTflops = None,
    memory: SimMemory = None,
    gpu_memory_utilization: SimGpuMemoryUtilization = 0.9,
    kv_cache_memory: SimKvCacheMemory = None,
    bandwidth_efficiency: SimBandwidthEfficiency = None,
    flops_efficiency: SimFlopsEfficiency = None,
    step_overhead_ms: SimStepOverheadMs = None,
    seq_overhead_ms: SimSeqOverheadMs = None,
    max_num_batched_tokens: SimMaxNumBatchedTokens = 2048,
    max_num_seqs: SimMaxNumSeqs = 256,
    max_model_len: SimMaxModelLen = None,
    block_size: SimBlockSize = 16,
    enable_prefix_caching: SimEnablePrefixCaching = True,
    enable_chunked_prefill: SimEnableChunkedPrefill = True,
    workload: SimWorkload = "random",
    tokenizer: SimTokenizer = None,
    num_prompts: SimNumPrompts = 100,
    input_len: SimInputLen = "128",
    output_len: OutputLen = "128",
    groups: Groups = 4,
    prefix_len: PrefixLen = 1024,
    suffix_len: SuffixLen = 64,
    streams: Streams = 8,
    stream_output: StreamOutput = 256,
    long_len: LongLen = 2000,
    long_rate: LongRate = 0.5,
    duration: SimDuration = None,
    request_rate: SimRequestRate = math.inf,
    burstiness: Burstiness = 1.0,
    max_concurrency: SimMaxConcurrency = None,
    seed: SimSeed = 0,
    slo: SimSlo = None,
    find_capacity: SimFindCapacity = False,
    max_runs: SimMaxRuns = 10,
    as_json: SimAsJson = False,
    save_result: SimSaveResult = None,
    report: SimReport = None,
    replicas: SimReplicas = None,
    router: SimRouter = "round-robin",
    tensor_parallel_size: SimTensorParallelSize = 1,
    tp_link: SimTpLink = None,
    tp_link_gb_s: SimTpLinkGbS = None,
    tp_link_latency_us: SimTpLinkLatencyUs = None,
    gpus: SimGpus = None,
    disaggregate: SimDisaggregate = None,
    prefill_device: SimPrefillDevice = None,
    decode_device: SimDecodeDevice = None,
    prefill_args: SimPrefillArgs = None,
    decode_args: SimDecodeArgs = None,
    kv_link_gb_s: SimKvLinkGbS = 50.0,
    kv_link_latency_ms: SimKvLinkLatencyMs = 0.1,
    first_token: SimFirstToken = "prefill",
    plan_capacity: SimPlanCapacity = False,
    plot: SimPlot = None,
    plan_budgets: SimPlanBudgets = "512,2048,8192",
    plan_tp: SimPlanTp = "1,2,4,8",
    plan_exhaustive: SimPlanExhaustive = False,
) -> None:
    """Bench's workloads through pdscope's own scheduler on a roofline clock: latency and
    throughput for hardware you do not have, from one GPU to a disaggregated cluster. Against
    the real engine on this project's shared 2-core hosts it has not met its validation
    floors: decode medians and throughput within 10% in many cases, not all (at 4 streams a
    fit from probe read TPOT 15-24% low); TTFT and p99 not yet (docs/simulation.md)."""

    from pdscope.analysis.bench import nothing_completed
    from pdscope.commands import capacity
    from pdscope.commands.cluster import ClusterSettings, PoolArgs, simulate_any
    from pdscope.commands.simulate import SimulateSettings
    from pdscope.report.simulate import render_simulation, simulation_html

    check_output(save_result, "--save-result")
    check_output(report, "--report")
    check_output(plot, "--plot", figure=True)
    with exit_on(2, SpecError):
        pool_tp = [
            PoolArgs.parse(text, flag).tensor_parallel_size or tensor_parallel_size
            for text, flag in ((prefill_args, "--prefill-args"), (decode_args, "--decode-args"))
        ]
    # Disaggregated, each pool runs its own tp= or else -tp: `-tp 2` with both at tp=1 has none.
    largest_tp = max(pool_tp) if disaggregate is not None else tensor_parallel_size
    _check_simulate_options(
        ctx,
        workload, calibrate, find_capacity, plan_capacity, largest_tp, disaggregate, replicas, gpus,
    )  # fmt: skip
    with exit_on(2, SpecError, ValueError):
        settings = SimulateSettings.from_flags(
            kv_cache_memory, model=model, device=device, calibrate=calibrate,
            calibrate_budget=calibrate_budget, step_jitter=step_jitter, dtype=dtype,
            kv_dtype=kv_dtype, bandwidth_gb_s=bandwidth, tflops=tflops, memory_gb=memory,
            gpu_memory_utilization=gpu_memory_utilization,
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
            max_concurrency=max_concurrency, seed=seed, slo=slo, tokenizer=tokenizer,
            find_capacity=find_capacity, max_runs=max_runs,
        )  # fmt: skip
        only_with(
            ctx,
            math.isfinite(settings.request_rate) or find_capacity,
            "a finite --request-rate (inf sends all at once)",
            "burstiness",
        )
        not_with(
            ctx,
            kv_cache_memory is not None or calibrate is not None,
            "--kv-cache-memory or --calibrate (they size the KV pool)",
            "gpu_memory_utilization",
        )
        cs = ClusterSettings.from_flags(
            settings, prefill_args, decode_args, prefill_device, decode_device, plan_capacity,
            replicas=replicas, router=router, tensor_parallel_size=tensor_parallel_size,
            tp_link=tp_link, tp_link_gb_s=tp_link_gb_s, tp_link_latency_us=tp_link_latency_us,
            disaggregate=disaggregate, kv_link_gb_s=kv_link_gb_s,
            kv_link_latency_ms=kv_link_latency_ms, first_token=first_token, gpus=gpus,
        )  # fmt: skip
        if plan_capacity:
            out = capacity.plan_from_flags(
                cs,
                plan_budgets,
                plan_tp,
                lambda line: print(line, file=sys.stderr, flush=True),
                exhaustive=plan_exhaustive,
            )
        else:
            out = simulate_any(cs)
    if as_json:
        print_json(out)
    elif plan_capacity:
        for line in capacity.render_plan(out):
            console.print(line)
    else:
        render_simulation(out, console)
    written = write_outputs(
        ("--save-result", save_result, json_writer(out)),
        ("--plot", plot if plan_capacity else None, lambda p: capacity.plot_plan(out, p)),
        ("--report", report if not plan_capacity else None,
         lambda p: p.write_text(simulation_html(out))),
        announce=False,  # stdout may be the JSON itself
    )  # fmt: skip
    if not plan_capacity and (error := nothing_completed(out)) is not None:
        raise fail(f"every simulated request of a run failed; the first: {error}", 1)
    if not written:
        raise typer.Exit(1)


def _check_simulate_options(
    ctx: typer.Context,
    workload: str,
    calibrate: Path | None,
    find_capacity: bool,
    plan_capacity: bool,
    tp: int,
    disaggregate: str | None,
    replicas: int | None,
    gpus: int | None,
) -> None:
    """simulate's options that another option overrides or that need one absent (``tp``: the
    largest tensor-parallel size of any pool)."""
    check_workload_options(ctx, workload)
    only_with(ctx, workload.startswith("file:"), "a file: workload", "tokenizer")
    only_with(ctx, calibrate is not None, "--calibrate", "calibrate_budget", "step_jitter")
    not_with(
        ctx, calibrate is not None, "--calibrate (the probe's fitted rates)", "bandwidth", "tflops"
    )
    only_with(ctx, find_capacity, "--find-capacity", "max_runs")
    not_with(ctx, find_capacity, "--find-capacity (it chooses the concurrency)", "max_concurrency")
    only_with(
        ctx, plan_capacity, "--plan-capacity", "plot", "plan_budgets", "plan_tp", "plan_exhaustive"
    )
    not_with(
        ctx,
        plan_capacity,
        "--plan-capacity (it chooses the shape, the budget and the rate; --gpus sets the size)",
        "replicas", "tensor_parallel_size", "disaggregate", "prefill_args", "decode_args",
        "request_rate", "find_capacity", "report",
    )  # fmt: skip
    only_with(
        ctx,
        tp > 1 or plan_capacity,
        "a pool at a tensor-parallel size above 1 (-tp, or a pool's own tp=, which overrides -tp)",
        "tp_link", "tp_link_gb_s", "tp_link_latency_us",
    )  # fmt: skip
    only_with(
        ctx,
        disaggregate is not None or plan_capacity,
        "--disaggregate P:D",
        "kv_link_gb_s", "kv_link_latency_ms", "first_token",
    )  # fmt: skip
    several = (replicas or 1) > 1 or (gpus or 1) > tp or disaggregate is not None
    only_with(ctx, several or plan_capacity, "more than one replica", "router")


@app.command()
def watch(
    ctx: typer.Context,
    url: WatchUrl = None,
    window: Window = None,
    interval: Interval = 1.0,
    history: History = 300.0,
    once: Once = False,
    as_json: WatchAsJson = False,
    record: Record = None,
    export: Export = None,
    runtime: Runtime = "vllm",
    report: WatchReport = None,
    api_key: ApiKey = None,
    server_args: WatchServerArgs = "",
) -> None:
    """The article's five metrics of a live server (TTFT and ITL p50/p99, running, waiting,
    KV use) with throughput, preemptions and prefix-cache hits, over a sliding window, and the
    reading rules that hold."""
    from pdscope.commands import watch as cmd
    from pdscope.commands.embedded import EmbeddedServerError, embedded_server
    from pdscope.report.watch import render_watch

    if report is not None:
        if extra := given_except(ctx, "report"):
            raise _no_effect(extra, "with --report (it draws a --record file)")
        _watch_page(report)
        return
    only_with(ctx, export is not None, "--export", "runtime")
    if export is not None:
        if extra := given_except(ctx, "export", "url", "runtime"):
            raise _no_effect(extra, "with --export (it writes files for a Prometheus to scrape)")
        _watch_export(export, url, runtime)
        return
    check_url(url)  # after --export, whose Prometheus target may be a bare host:port
    not_with(ctx, url is not None, "a URL (they are the embedded server's flags)", "server_args")
    with exit_on(2, ValueError):
        settings = cmd.WatchSettings(
            url=url or "",
            window_s=window if window is not None else (5.0 if once else 60.0),
            interval_s=interval,
            history_s=history,
            api_key=api_key,
        )
    record_file = None
    if record is not None:
        try:
            record_file = record.open("a", encoding="utf-8")
        except OSError as exc:
            raise fail(f"cannot write --record {record}: {exc}") from None
    try:
        with (
            exit_on(1, EmbeddedServerError),
            embedded_server(url, "watch", server_args, note) as settings.url,
        ):
            last, watcher, interrupted = _watch_live(settings, once, as_json, record_file)
    finally:
        if record_file is not None:
            record_file.close()
    if once and not last:  # interrupted before the first scrape answered
        raise typer.Exit(1)
    if once and interrupted:
        # a window cut short: its figures cover covered_s, its events are those seen so far
        last["interrupted"] = True
        err_console.print(
            f"interrupted {last.get('t_s', 0.0):.1f} s into the {settings.window_s:g} s window; "
            f"the figures cover {last.get('covered_s', 0.0):.1f} s"
        )
    if once:
        if as_json:
            print_json(last)
        else:
            history_points = watcher.history if watcher is not None else ()
            console.print(render_watch(last, history_points, history_s=settings.history_s))
    if record is not None:
        err_console.print(f"recorded to {record}")
    if once and (interrupted or not last.get("reachable")):
        raise typer.Exit(1)


def _watch_page(report: Path) -> None:
    """`watch --report FILE`: a --record file drawn as an HTML page beside it."""
    from pdscope.report.watch_html import read_recording, render_watch_html

    out = report.with_suffix(".html")
    if out == report:
        raise fail(f"--report takes the --record file (JSON lines), got {report}")
    with exit_on(2, ValueError, OSError):
        page = render_watch_html(read_recording(report))
        out.write_text(page, encoding="utf-8")
    console.print(f"wrote {out}")


def _watch_export(export: tuple[str, Path], url: str | None, runtime: str) -> None:
    """`watch --export grafana DIR`: a dashboard and a prometheus.yml for URL."""
    from pdscope.commands.grafana import export_grafana

    kind, directory = export
    if kind != "grafana":
        raise fail(f"--export takes 'grafana DIR', got {kind!r}")
    if url is None:
        raise fail("--export needs the server's URL: the target Prometheus scrapes")
    with exit_on(2, ValueError, OSError):
        paths = export_grafana(directory, url, runtime)
    for path in paths:
        console.print(f"wrote {path}")


def _watch_live(
    settings: WatchSettings, once: bool, as_json: bool, record_file: typing.TextIO | None
) -> tuple[dict[str, Any], Watcher | None, bool]:
    """Scrape until Ctrl-C (or one window with ``once``), showing every snapshot: the live
    view, a JSON line, and a line in the record file. Returns the last snapshot, the watcher
    and whether Ctrl-C ended it."""
    import asyncio

    from rich.live import Live

    from pdscope.commands import watch as cmd
    from pdscope.report.watch import render_watch

    live = None if (as_json or once) else Live(console=console, auto_refresh=False)
    last: dict[str, Any] = {}
    watchers: list[Watcher] = []

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
            view = render_watch(
                data, watcher.history, history_s=settings.history_s,
                recent_events=watcher.recent_events,
            )  # fmt: skip
            live.update(view, refresh=True)
        elif as_json and not once:
            sys.stdout.write(json.dumps(data) + "\n")
            sys.stdout.flush()

    interrupted = False
    try:
        if live is not None:
            live.start()
        asyncio.run(cmd.run(settings, show, once=once))
    except KeyboardInterrupt:
        interrupted = True  # how a live watch ends; the record is already on disk
    except cmd.NotPrometheusError as exc:
        if live is not None:
            live.stop()
            live = None
        raise fail(str(exc)) from None
    finally:
        if live is not None:
            live.stop()
    return last, (watchers[0] if watchers else None), interrupted


if __name__ == "__main__":
    app()
