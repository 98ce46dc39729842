"""The commands' settings objects: `serve`'s flags come from EngineArgs' and ServeSettings'
fields; bad flags are refused before anything starts (one line naming the flag, exit 2);
bench's default load applies to the embedded server alone."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from pdscope.cli import app
from pdscope.commands.bench import BenchSettings
from pdscope.commands.embedded import EmbeddedServerError, embedded_server
from pdscope.commands.probe import ProbeSettings
from pdscope.commands.serve import ServeSettings
from pdscope.engine.args import EngineArgs


def test_every_engine_knob_with_help_is_a_serve_flag() -> None:
    params = {p.name: p for p in typer.main.get_command(app).commands["serve"].params}
    knobs = [f for f in dataclasses.fields(EngineArgs) if "help" in f.metadata]
    assert {f.name for f in knobs} | {f.name for f in dataclasses.fields(ServeSettings)} == set(
        params
    )
    assert "device" not in params  # no help text: not offered on the command line
    for f in knobs:
        assert params[f.name].default == f.default, f.name
        assert params[f.name].help == f.metadata["help"], f.name
    assert params["enable_chunked_prefill"].secondary_opts == ["--no-chunked-prefill"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--port", "70000"], "--port must be 0-65535"),
        # a 64-character label fails in the resolver's own checks, asking no DNS server
        (["--host", "a" * 64], f"--host {'a' * 64}: no address to bind"),
        (["--max-queue", "-1"], "--max-queue must be >= 0"),
        (["--max-request-bytes", "100"], "--max-request-bytes must be at least 1KiB"),
        (["--max-request-bytes", "lots"], "--max-request-bytes:"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be >= 1"),
        (["--max-model-len", "0"], "max_model_len must be >= 1"),
        (["--block-size", "0"], "block_size must be >= 1"),
    ],
)
def test_bad_serve_flags_exit_2_before_loading(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, ["serve", "--model", "/nonexistent/checkpoint", *args])
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split())  # the console wraps at 80 columns


def test_serve_settings_refuse_in_python_too() -> None:
    with pytest.raises(ValueError, match="--threads"):
        ServeSettings(threads=0)
    assert ServeSettings(max_request_bytes="8MiB").max_request_body_bytes == 8 * 2**20


def _bench(url: str | None, **flags: object) -> BenchSettings:
    defaults = {"request_rate": "inf", "max_concurrency": None, "percentiles": "50,90,95,99"}
    defaults |= {"slo": None, "find_capacity": False, "sweep": None}
    return BenchSettings.from_flags(url, **{**defaults, **flags})  # type: ignore[arg-type]


def test_bench_allows_a_request_what_vllm_bench_serve_allows() -> None:
    """300 s would fail a request a slow server keeps queued (a 7B-shaped model on 2 CPU cores
    prefills ~31 tokens a second: the default 100 prompts of 128 tokens, ~410 s), which vllm
    bench serve (aiohttp's total of 6 h) counts as served with its wait: `completed` would
    disagree for one load. --timeout still sets it."""
    import inspect

    from pdscope import cli

    assert _bench("http://x").timeout_s == _bench(None).timeout_s == 6 * 60 * 60
    assert _bench("http://x", timeout_s=30.0).timeout_s == 30.0
    # the default users meet is the CLI's, which passes it on
    assert inspect.signature(cli.bench).parameters["timeout"].default == 6 * 60 * 60


def test_bench_default_load_is_for_the_embedded_server_only() -> None:
    embedded = _bench(None)
    assert (embedded.num_prompts, embedded.concurrencies, embedded.output_len) == (32, [8], "64")
    given = _bench("http://127.0.0.1:9")
    assert (given.num_prompts, given.concurrencies, given.output_len) == (100, [None], "128")
    asked = _bench(None, max_concurrency="4,2,4", request_rate="inf")
    assert (asked.num_prompts, asked.concurrencies) == (100, [2, 4])
    capacity = _bench(None, slo="p99_ttft=2s", find_capacity=True, percentiles="50")
    assert capacity.capacity_slo == "p99_ttft=2s" and capacity.goodput_slo is None
    assert 99.0 in capacity.percentiles and 50.0 in capacity.percentiles


def test_probe_settings_check_flags_and_default_to_the_local_ceiling() -> None:
    s = ProbeSettings.from_flags(None, "500,200,500")
    assert s.prompt_tokens == [200, 500] and s.device == "local"
    assert ProbeSettings.from_flags("http://x", "200").device is None
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        ProbeSettings.from_flags("http://x", "200", repeats=0)
    with pytest.raises(ValueError, match="--prompt-tokens"):
        ProbeSettings.from_flags("http://x", "a,b")
    # The ceiling's facts are checked before the run (read, or ignored, after it before).
    for flags, needle in (
        ({"device": "nosuch"}, "nosuch"),
        ({"device": "h100", "dtype": "foo"}, "foo"),
        ({"plan_model": "llama-3.1-8b"}, "needs --device"),
        # before: refused only after the whole run, as a traceback with no --json written
        ({"device": "h100", "plan_model": "llama-3.1-8b", "dtype": "mxfp4"}, "has no experts"),
    ):
        with pytest.raises(ValueError, match=needle):
            ProbeSettings.from_flags("http://x", "200", **flags)
    with pytest.raises(ValueError, match="--prompt-tokens has an empty item"):
        ProbeSettings.from_flags("http://x", "1,,2")  # a typo, not 1,2
    with pytest.raises(ValueError, match="--request-rate has an empty item"):
        _bench("http://x", request_rate="1,,2")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"timeout_s": 0}, "--timeout must be > 0"),
        ({"duration_s": -1}, "--duration must be > 0"),
        ({"warmup": -1}, "--warmup must be >= 0"),
        ({"ramp_up_s": -2}, "--ramp-up must be >= 0"),
        ({"long_len": 0}, "--long-len must be >= 1"),
        ({"burstiness": 0}, "--burstiness must be > 0"),
        # read before the run, so a bad length exits 2 as a bad flag (it was a failed run, 1)
        ({"input_len": "0"}, "--input-len must be at least 1"),
        ({"output_len": "-1"}, "--output-len: cannot read '-1'"),
    ],
)
def test_bench_refuses_flags_that_would_run_something_else(flags: dict, needle: str) -> None:
    """Each was taken before: no timeout, no load, a 1-token request for 0."""
    with pytest.raises(ValueError, match=needle):
        _bench("http://x", **flags)


def test_bench_refuses_a_workload_whose_every_prompt_is_past_the_context() -> None:
    """10^8 tokens ran minutes building one prompt, then printed 'error: ' and nothing else."""
    from pdscope.commands.bench import _refuse_what_cannot_fit

    with pytest.raises(ValueError, match="server's context is 2,048"):
        _refuse_what_cannot_fit(_bench("http://x", input_len="99999999"), 2048)
    _refuse_what_cannot_fit(_bench("http://x", input_len="1000-100000"), 2048)  # some fit
    _refuse_what_cannot_fit(_bench("http://x", input_len="99999999"), None)  # unknown context


@pytest.mark.parametrize("runtime", ["vllm", "pdscope", "ollama"])
def test_bench_refuses_requests_whose_output_cannot_fit_where_the_runtime_refuses_them(
    runtime: str,
) -> None:
    """--output-len 5000 on a 2,048-token vLLM or pdscope server: every request came back 400
    (Ollama and llama.cpp shift the context or stop at it, so there the output does not
    count); a --long-len past the context failed every long prompt."""
    from pdscope.commands.bench import _refuse_what_cannot_fit

    refuses = runtime != "ollama"
    cases = [
        ({"input_len": "100", "output_len": "5000"}, "100 + 5,000 tokens", refuses),
        ({"input_len": "1000", "output_len": "1000-2100"}, "", False),  # some fit
        ({"input_len": "1500", "output_len": "normal:600:10"}, "", False),  # clipped at 1
        ({"workload": "long-prompt", "long_len": 5000, "duration_s": 1}, "--long-len 5000", True),
        ({"workload": "long-prompt", "stream_output": 2100, "duration_s": 1},
         "--stream-output 2100", refuses),
    ]  # fmt: skip
    for flags, needle, refused in cases:
        settings = _bench("http://x", **flags)
        if refused:
            with pytest.raises(ValueError, match=re.escape(needle)):
                _refuse_what_cannot_fit(settings, 2048, runtime)
        else:
            _refuse_what_cannot_fit(settings, 2048, runtime)


def test_a_length_of_zero_tokens_is_refused() -> None:
    from pdscope.client.workloads import Lengths, WorkloadError

    for text in ("0", "0-8"):
        with pytest.raises(WorkloadError, match="--input-len must be at least 1"):
            Lengths.parse(text, "--input-len")


def test_embedded_server_passes_a_url_through_and_refuses_bad_args() -> None:
    with embedded_server("http://127.0.0.1:9", "test") as url:
        assert url == "http://127.0.0.1:9"
    # shlex: "No closing quotation"; refused before any process or folder is made
    with pytest.raises(EmbeddedServerError, match="quotation"), embedded_server(None, "t", "'1"):
        pass


@pytest.mark.parametrize(
    "args",
    [
        ["probe", "--json", "/nonexistent/p.json"],
        ["probe", "--plot", "probe.txt"],
        ["bench", "--save-result", "/nonexistent/b.json"],
        ["bench", "--report", "/"],
    ],
)
def test_unwritable_outputs_exit_2_before_any_run(args: list[str]) -> None:
    """No URL: these would start the embedded server and run for minutes, then fail to write."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert args[1] in result.output


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("truncate the weights", "cannot read"),
        ("garble tokenizer.json", "cannot read"),
        ("change intermediate_size", "does not match the weights"),
        ("ask for 1,024 TiB of KV cache", "more than the"),
    ],
)
def test_a_checkpoint_or_pool_that_cannot_load_is_one_error_line(
    tmp_path: Path, damage: str, needle: str
) -> None:
    """A corrupt checkpoint gave a safetensors, tokenizers or torch traceback; a KV pool larger
    than the machine's memory grew until the host ran out."""
    from pdscope.checkpoint.make_model import make_model

    model = make_model(tmp_path / "m", "tiny")
    extra: list[str] = []
    if damage == "truncate the weights":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "garble tokenizer.json":
        (model / "tokenizer.json").write_text("{not json")
    elif damage == "change intermediate_size":
        config = json.loads((model / "config.json").read_text())
        config["intermediate_size"] += 32
        (model / "config.json").write_text(json.dumps(config))
    else:
        extra = ["--kv-cache-memory", "1024TiB"]
    result = CliRunner().invoke(app, ["serve", "--model", str(model), *extra])
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split()) and "Traceback" not in result.output


NOWHERE = "http://127.0.0.1:9"  # no server listens on port 9


def test_a_load_flag_typed_at_its_default_is_still_the_load_asked_for() -> None:
    """`bench --num-prompts 100` (the default's value, typed) on the embedded server runs 100
    prompts: the short default load gives way to any load flag the user set, not only to one
    off its default (it used to run 32 at concurrency 8). A typed --output-len 128 stays 128;
    untyped, the short load's output is 64 tokens."""
    flags = (None, "inf", None, "50,99", None, False, None)
    asked = BenchSettings.from_flags(*flags, typed=frozenset({"num_prompts"}))
    assert (asked.num_prompts, asked.concurrencies, asked.output_len) == (100, [None], "128")
    short = BenchSettings.from_flags(*flags, typed=frozenset({"output_len"}))
    assert (short.num_prompts, short.concurrencies, short.output_len) == (32, [8], "128")
    none = BenchSettings.from_flags(*flags, typed=frozenset())
    assert (none.num_prompts, none.concurrencies, none.output_len) == (32, [8], "64")
    capacity = BenchSettings.from_flags(
        None, "inf", None, "50,99", "p99_ttft=2s", True, None, typed=frozenset({"find_capacity"})
    )
    assert capacity.num_prompts == 100  # the search is a load asked for
    long = BenchSettings.from_flags(*flags, typed=frozenset({"workload"}), workload="long-prompt")
    assert long.concurrencies == [None]  # its streams and long prompts run at once, uncapped


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plan", "--all"], "--all has no effect without --compare"),
        (["plan", "--compare", "--bandwidth", "5"], "--bandwidth has no effect with --compare"),
        (["plan", "--list-models", "--model", "70b"], "--model has no effect with --list-devices"),
        (["plan", "--list-models", "--list-devices"], "not both"),
        (["plan", "--compare", "--device", "a10g"], "takes only 'local'"),
        (["simulate", "--plot", "p.png"], "--plot has no effect without --plan-capacity"),
        (["simulate", "--plan-tp", "3"], "--plan-tp has no effect without --plan-capacity"),
        (["simulate", "--tp-link", "nvlink3"], "without a pool at a tensor-parallel size above 1"),
        (["simulate", "--burstiness", "2"], "--burstiness has no effect without a finite"),
        (
            ["simulate", "--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "0.5"],
            "--gpu-memory-utilization has no effect with --kv-cache-memory",
        ),
        (
            # -tp 2 overridden by both pools' own tp=1: no pool uses the link
            [
                "simulate",
                "-tp",
                "2",
                "--disaggregate",
                "1:1",
                "--prefill-args",
                "tp=1",
                "--decode-args",
                "tp=1",
                "--tp-link",
                "nvlink3",
            ],
            "without a pool at a tensor-parallel size above 1",
        ),
        (
            ["simulate", "--kv-link-gb-s", "1"],
            "--kv-link-gb-s has no effect without --disaggregate",
        ),
        (["simulate", "--router", "least-loaded"], "--router has no effect without more than one"),
        (["simulate", "--no-step-jitter"], "--no-step-jitter has no effect without --calibrate"),
        (["simulate", "--max-runs", "2"], "--max-runs has no effect without --find-capacity"),
        (["simulate", "--tokenizer", "x"], "--tokenizer has no effect without a file: workload"),
        (
            [
                "simulate",
                "--plan-capacity",
                "--gpus",
                "2",
                "--slo",
                "p99_ttft=2s",
                "--replicas",
                "2",
            ],
            "--replicas has no effect with --plan-capacity",
        ),
        (
            ["simulate", "--find-capacity", "--slo", "p99_ttft=2s", "--max-concurrency", "3"],
            "--max-concurrency has no effect with --find-capacity",
        ),
        (["simulate", "--workload", "long-prompt", "--num-prompts", "5"], "--num-prompts has no"),
        (["simulate", "--groups", "2"], "--groups has no effect without --workload shared-prefix"),
        (["bench", "compare", "a.json", "b.json", "--num-prompts", "5"], "drop --num-prompts"),
        (["bench", NOWHERE, "--sweep", "auto", "--max-concurrency", "3"], "--sweep auto"),
        (["bench", NOWHERE, "--burstiness", "0.5"], "without a finite --request-rate"),
        (["bench", NOWHERE, "--ramp-up", "5"], "--ramp-up has no effect without a"),
        (["bench", NOWHERE, "--server-args", "--block-size 8"], "with a URL"),
        (["bench", NOWHERE, "--input-len", "9", "--workload", "shared-prefix"], "--input-len"),
        (["bench", NOWHERE, "--stream-output", "9"], "without --workload long-prompt"),
        (
            ["bench", NOWHERE, "--find-capacity", "--slo", "p99_ttft=2s", "--request-rate", "1,2"],
            "searches from one --request-rate",
        ),
        (
            ["probe", NOWHERE, "--batch-streams", "0", "--batch-context", "9"],
            "--batch-context has no",
        ),
        (["probe", NOWHERE, "--batch-streams", "1"], "2 or more, or 0"),
        (["probe", NOWHERE, "--batch-sweep", "1,4"], "--batch-sweep takes counts of 2 or more"),
        (["probe", NOWHERE, "--batch-sweep", "two"], "--batch-sweep takes comma-separated"),
        (
            ["probe", NOWHERE, "--batch-streams", "0", "--batch-sweep", "4"],
            "--batch-sweep has no effect without --batch-streams",
        ),
        (["watch", "--export", "grafana", "g"], "--export needs the server's URL"),
        (["watch", NOWHERE, "--runtime", "sglang"], "--runtime has no effect without --export"),
        (
            ["watch", NOWHERE, "--export", "grafana", "g", "--once"],
            "--once has no effect with --export",
        ),
        (["watch", "--report", "r.jsonl", "--window", "5"], "--window has no effect with --report"),
        (["watch", NOWHERE, "--server-args", "--block-size 8"], "with a URL"),
    ],
)
def test_an_option_that_would_have_no_effect_is_refused(args: list[str], needle: str) -> None:
    """Each of these ran and exited 0 with the option ignored (nothing said so); none reaches
    a server (port 9 has none) or writes a file."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split()), result.output


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--compare", "--all", "--json"],
        ["plan", "--list-devices", "--json"],
        ["simulate", "--num-prompts", "4", "--request-rate", "8", "--burstiness", "0.5"],
        ["simulate", "--num-prompts", "4", "--replicas", "2", "--router", "least-loaded"],
        ["simulate", "--num-prompts", "4", "--workload", "shared-prefix", "--groups", "2"],
        # a pool's own tp= puts the TP link to use
        [
            "simulate",
            "--num-prompts",
            "4",
            "--disaggregate",
            "1:1",
            "--prefill-args",
            "tp=2",
            "--tp-link",
            "pcie4",
        ],
        [
            "simulate",
            "--num-prompts",
            "4",
            "--find-capacity",
            "--slo",
            "p99_ttft=2s",
            "--max-runs",
            "2",
        ],
    ],
)
def test_the_same_options_where_they_take_effect_are_accepted(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command", ["bench", "probe", "watch"])
@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("http://127.0.0.1:99999", "port 99999 is outside 1-65535"),
        ("http://256.1.1.1:80", "Invalid IPv4 address"),
        ("http://[::1", "is not a server URL"),
        ("notaurl", "give http://HOST:PORT"),
        ("ftp://127.0.0.1", "give http://HOST:PORT"),
    ],
)
def test_a_url_no_request_could_reach_is_refused_at_once(
    command: str, url: str, needle: str
) -> None:
    """These raised a traceback from the HTTP client (a port past 65535, an impossible IPv4
    address, an unclosed bracket), or, for watch, waited out its whole window."""
    res = CliRunner().invoke(app, [command, url, *(["--once"] if command == "watch" else [])])
    assert res.exit_code == 2 and needle in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_what_the_user_typed_is_printed_as_typed() -> None:
    """Brackets and colons in a name are text: '[/]' crashed rich's markup parser, '[v2]' was
    dropped from the message, and ':100:' printed as an emoji."""
    from pdscope.cli import err_console

    for name in ("x[/]", "my[v2]/config.json"):
        res = CliRunner().invoke(app, ["plan", "--model", name])
        assert res.exit_code == 2 and f"unknown model '{name}'" in res.output, res.output
    with err_console.capture() as seen:
        err_console.print("asked normal:100:5")
    assert seen.get().strip() == "asked normal:100:5"


def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path) -> None:
    """A folder's mode bits do not say whether a file can be made in it (/proc, as root);
    a folder that is a file was called missing."""
    (tmp_path / "a_file").write_text("")
    cases = [([tmp_path / "a_file" / "x.json"], "is not a folder")]
    if Path("/proc/self").is_dir():
        cases.append(([Path("/proc/x.json")], "cannot be written"))
    for (path,), needle in cases:
        res = CliRunner().invoke(app, ["bench", "http://127.0.0.1:9", "--save-result", str(path)])
        assert res.exit_code == 2 and needle.replace(" ", "") in "".join(res.output.split())
    kept = tmp_path / "kept.json"
    kept.write_text("the last run")
    fifo, link = tmp_path / "fifo", tmp_path / "link.json"
    os.mkfifo(fifo)  # opened and closed, it would end its reader; with none, block for ever
    link.symlink_to(tmp_path / "target.json")  # dangling: made and removed, it was lost
    for path in (kept, fifo, link, tmp_path / "new.json"):
        res = CliRunner().invoke(app, ["bench", "http://127.0.0.1:9", "--save-result", str(path)])
        assert res.exit_code == 1 and "cannot connect" in res.output  # checked, then the run
    assert kept.read_text() == "the last run"  # the check appends nothing, truncates nothing
    assert link.is_symlink() and not link.exists()
    names = ["a_file", "fifo", "kept.json", "link.json"]  # no scratch file, no new.json
    assert sorted(p.name for p in tmp_path.iterdir()) == names


def test_a_write_that_fails_after_the_run_names_its_option_and_loses_only_itself(
    tmp_path: Path,
) -> None:
    from pdscope.cli import err_console, write_outputs

    def refused(path: Path) -> None:
        raise OSError(28, "No space left on device")

    with err_console.capture() as seen:
        written = write_outputs(
            ("--json", tmp_path / "a.json", refused),
            ("--plot", tmp_path / "b.txt", lambda p: p.write_text("b")),
            ("--report", None, refused),
        )
    said = "".join(seen.get().split())  # the console folds long paths, mid-word too
    assert not written
    assert f"cannotwrite--json{tmp_path / 'a.json'}:[Errno28]Nospaceleft" in said
    assert (tmp_path / "b.txt").read_text() == "b"


def test_probes_long_context_check_leaves_room_for_its_output() -> None:
    """With --output-tokens 600 on a 2,048-token server the long check sent 1,536-token prompts
    asking for 600 more: HTTP 400 twice, the check unmeasured, exit 1."""
    from pdscope.client.detect import Runtime
    from pdscope.commands.probe import Prober

    prober = Prober.__new__(Prober)  # the property reads the settings and the runtime alone
    prober.runtime = Runtime("http://x", "vllm", "openai-completions", ["m"], max_model_len=2048)
    for output in (6, 600, 1500):
        prober.s = ProbeSettings.from_flags("http://x", "64", output_tokens=output)
        assert 0 < prober.context_tokens <= 2048 - output
    assert prober.context_tokens < 1536  # the 0.75 of the context it took before


@pytest.mark.parametrize("value", [0, -1])
def test_probe_refuses_a_max_model_len_below_one(value: int) -> None:
    """0 was taken as unset, and -1 printed as 'the server's context of -1 tokens'."""
    res = CliRunner().invoke(app, ["probe", "http://127.0.0.1:9", "--max-model-len", str(value)])
    assert res.exit_code == 2 and f"--max-model-len must be >= 1, got {value}" in res.output


def test_watch_exports_for_a_bare_host_port(tmp_path: Path) -> None:
    """A Prometheus target in docker compose reads vllm:8000; --export sends no request, so
    the URL check that refuses what no request could reach does not apply to it."""
    res = CliRunner().invoke(app, ["watch", "vllm:8000", "--export", "grafana", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "vllm:8000" in (tmp_path / "prometheus.yml").read_text()
