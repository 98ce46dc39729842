"""The engine's scheduler on a roofline clock: the cost model against plan's own arithmetic, and
the simulated server against the article's claims. No model, no torch."""

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from pdscope.analysis.bench import summarize
from pdscope.client.trace import trace_from_timeline
from pdscope.engine.scheduler import SchedulerConfig
from pdscope.engine.simulator import SimRequest, Simulator
from pdscope.roofline import arithmetic as rf
from pdscope.roofline.step_cost import CostModel, CostParams
from pdscope.specs import get_kv_precision, get_weight_precision, load_model, resolve_device

BF16 = get_weight_precision("bf16")
KV16 = get_kv_precision("bf16")


def h100_cost(model: str = "llama-3.1-8b", **overheads: float) -> CostModel:
    device = resolve_device("h100-sxm")
    params = CostParams(device.bandwidth_gb_s, device.tflops_bf16, **overheads)
    return CostModel(load_model(model), BF16, KV16, params)


def simulator(cost: CostModel, budget: int = 2048, seqs: int = 64, blocks: int = 4096):
    return Simulator(
        SchedulerConfig(budget, seqs, max_model_len=8192),
        num_blocks=blocks,
        block_size=16,
        step_seconds=lambda out: cost.step(out.scheduled).seconds,
    )


@dataclass(frozen=True)
class Entry:
    """A scheduled entry as the cost model reads it, built by hand."""

    start: int
    num_new_tokens: int
    samples: bool = True


def unique_prompt(index: int, tokens: int) -> list[int]:
    return [index * 100_000 + i for i in range(tokens)]


def test_importing_the_simulator_does_not_import_torch() -> None:
    code = (
        "import sys, pdscope.engine.simulator, pdscope.roofline.step_cost;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_batch_one_decode_runs_at_plans_bandwidth_ceiling() -> None:
    cost = h100_cost()
    result = simulator(cost).run([SimRequest(unique_prompt(0, 1000), 101)])
    trace = trace_from_timeline(result.requests[0].timeline, api="sim", url="sim", model="8b")
    # With no overheads, a decode step is memory-bound: weights plus the context's KV, at the
    # mid-point context of the decode, must give plan's ceiling (within the KV growth).
    device = resolve_device("h100-sxm")
    ceiling = rf.decode_ceiling_tok_s(cost.model, device, BF16, KV16, context_tokens=1050)
    assert trace.tpot_s is not None
    assert 1 / trace.tpot_s == pytest.approx(ceiling, rel=0.005)


def test_prefill_takes_plans_compute_floor() -> None:
    cost = h100_cost()
    result = simulator(cost, budget=4096).run([SimRequest(unique_prompt(0, 2000), 1)])
    timeline = result.requests[0].timeline
    floor = rf.prefill_step(cost.model, resolve_device("h100-sxm"), BF16, KV16, 2000)
    assert floor.bound == "compute"
    # Plan takes one roofline over the whole pass; the simulator charges the LM head as its own
    # memory-bound matmul (1 GB read for one row), so it may only add that much.
    lm_head_read_s = cost.model.lm_head_params * 2 / (3350 * 1e9)
    assert floor.seconds <= timeline.ttft_s <= floor.seconds + lm_head_read_s * 1.01


def test_decode_batches_are_nearly_free_until_compute_bound() -> None:
    cost = h100_cost()

    def tpot_ms(concurrency: int) -> float:
        specs = [SimRequest(unique_prompt(i, 200), 64) for i in range(concurrency)]
        result = simulator(cost).run(specs)
        traces = [
            trace_from_timeline(r.timeline, api="sim", url="sim", model="8b")
            for r in result.requests
        ]
        return summarize(traces, result.end_s)["median_tpot_ms"]

    one, sixteen = tpot_ms(1), tpot_ms(16)
    # 16x the tokens per step for < 25% more time per step, but not for free: 16 contexts' KV.
    assert one < sixteen < 1.25 * one


def test_small_budget_removes_decode_stalls_from_a_long_prompt() -> None:
    """The article's chunked-prefill claim, on the simulated clock: a 8,000-token prompt
    arriving among 8 streams stalls them for one long step at a large budget, and by far less
    at a small one."""
    cost = h100_cost(step_overhead_s=0.002)

    def worst_itl_ms(budget: int) -> float:
        specs = [SimRequest(unique_prompt(i, 100), 200) for i in range(8)]
        specs.append(SimRequest(unique_prompt(99, 8000), 1, arrival_s=0.2))
        result = simulator(cost, budget=budget).run(specs)
        streams = result.requests[:8]
        return max(max(r.timeline.itl_s) for r in streams) * 1e3

    assert worst_itl_ms(512) < 0.5 * worst_itl_ms(8192)


def test_prefix_cache_hit_skips_the_shared_prompt() -> None:
    cost = h100_cost()
    shared = unique_prompt(7, 4000)
    specs = [SimRequest(shared + [1, 2, 3], 4), SimRequest(shared + [4, 5, 6], 4, arrival_s=1.0)]
    result = simulator(cost, budget=8192).run(specs)
    first, second = (r.timeline for r in result.requests)
    assert second.num_cached_tokens == 4000
    assert second.ttft_s < 0.1 * first.ttft_s
    assert sum(s.prefix_hit_tokens for s in result.steps) == 4000


def test_a_small_pool_preempts_and_conserves_every_token() -> None:
    cost = h100_cost()
    specs = [SimRequest(unique_prompt(i, 64), 200) for i in range(12)]
    sim = simulator(cost, budget=512, blocks=100)  # 1,600 token slots for 12 x 264 tokens
    result = sim.run(specs)
    assert result.num_preemptions > 0
    assert max(s.num_waiting for s in result.steps) > 0
    assert all(len(r.output_token_ids) == 200 for r in result.requests)
    assert all(r.timeline.finish_reason == "length" for r in result.requests)
    assert sim.pool.num_used_blocks == 0
    sim.pool.check_invariants()


def test_requests_that_cannot_run_fail_with_a_reason_and_are_not_figures() -> None:
    cost = h100_cost()
    specs = [SimRequest(unique_prompt(0, 100), 10), SimRequest(unique_prompt(1, 9000), 10)]
    result = simulator(cost).run(specs)
    ok, too_long = result.requests
    assert too_long.finish_reason is not None and "max_model_len" in too_long.finish_reason
    traces = [trace_from_timeline(r.timeline, api="sim", url="sim", model="8b") for r in [ok]]
    traces.append(trace_from_timeline(too_long.timeline, api="sim", url="sim", model="8b"))
    summary = summarize(traces, result.end_s)
    assert summary["completed"] == 1 and summary["failed"] == 1


def test_overheads_add_per_step_and_per_sequence() -> None:
    bare = h100_cost()
    loaded = h100_cost(step_overhead_s=0.001, seq_overhead_s=0.0002)
    batch = [Entry(500, 1) for _ in range(4)]
    assert loaded.step(batch).seconds == pytest.approx(
        bare.step(batch).seconds + 0.001 + 4 * 0.0002
    )


def test_bad_cost_parameters_are_refused() -> None:
    from pdscope.specs import SpecError

    with pytest.raises(SpecError, match="bandwidth"):
        CostParams(0, 100)
    with pytest.raises(SpecError, match="FLOP"):
        CostParams(100, -1)


@pytest.mark.parametrize("model", ["llama-3.1-8b", "mistral-7b", "gpt-oss-20b", "deepseek-v3"])
@pytest.mark.parametrize(("start", "new"), [(0, 1), (0, 700), (300, 1), (5000, 1), (4000, 900)])
def test_grouped_attention_cost_sums_the_same_terms_as_roofline(model, start, new) -> None:
    """The cost model folds equal layers together for speed; it must still charge exactly
    roofline's attention FLOPs and KV bytes (windows, MLA's decode shape included)."""
    cost = CostModel(load_model(model), BF16, KV16, CostParams(1, 1))  # 1 GB/s, 1 TFLOP/s
    flops = rf.attention_flops(cost.model, start, new)
    kv_bytes = rf.kv_bytes_at_context(cost.model, KV16, start + new)
    assert cost.attention_s(start, new) == pytest.approx(max(flops / 1e12, kv_bytes / 1e9))


@pytest.mark.parametrize(
    "model", ["llama-3.1-8b", "qwen3-8b", "deepseek-v3", "mistral-7b", "gpt-oss-20b"]
)
def test_a_step_of_decodes_costs_the_sum_of_its_entries(model) -> None:
    """The fast path for a step's decodes must equal pricing each entry on its own."""

    cost = CostModel(load_model(model), BF16, KV16, CostParams(3350, 989))
    entries = [Entry(start, 1) for start in (10, 900, 5000, 20_000)] + [Entry(3000, 500)]
    expected = sum(cost.attention_s(e.start, e.num_new_tokens) for e in entries)
    assert cost.step(entries).attention_s == pytest.approx(expected, rel=1e-9)


def test_a_concurrency_cap_holds_requests_until_a_slot_frees() -> None:
    cost = h100_cost()
    specs = [SimRequest(unique_prompt(i, 100), 50) for i in range(6)]
    result = simulator(cost).run(specs, max_concurrency=2)
    assert max(s.num_running + s.num_waiting for s in result.steps) <= 2
    sent = sorted(r.timeline.arrival_s for r in result.requests)
    finished = sorted(r.timeline.finished_s for r in result.requests)
    assert sent[:2] == [0.0, 0.0]
    # Each later request is sent exactly when an earlier one finished.
    assert sent[2:] == pytest.approx(finished[:4])
    assert all(len(r.output_token_ids) == 50 for r in result.requests)


def test_without_a_cap_requests_arrive_when_scheduled_even_mid_step() -> None:
    """A request arriving while a step runs waits for the next step; that wait is part of its
    TTFT, so its arrival time must stay when it was sent, not move to the step's end."""
    cost = h100_cost()
    specs = [SimRequest(unique_prompt(0, 4000), 100), SimRequest(unique_prompt(1, 100), 10, 0.001)]
    result = simulator(cost, budget=8192).run(specs)
    late = result.requests[1].timeline
    assert late.arrival_s == 0.001
    assert late.queue_s is not None and late.queue_s > 0


def test_simulate_cli_writes_bench_shaped_json_that_bench_compare_reads(tmp_path) -> None:
    from typer.testing import CliRunner

    from pdscope.cli import app

    runner = CliRunner()
    files = []
    for budget in (512, 8192):
        path = tmp_path / f"sim-{budget}.json"
        html = tmp_path / f"sim-{budget}.html"
        result = runner.invoke(
            app,
            [
                "simulate", "--workload", "long-prompt", "--long-len", "8000", "--long-rate",
                "2", "--duration", "5", "--stream-output", "400",
                "--max-num-batched-tokens", str(budget), "--save-result", str(path),
                "--report", str(html),
            ],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        # no client, network or /metrics page in a simulation: bench's lines about them (0 ms
        # connection setup, client lag, the server's histograms) are left out
        text = " ".join(result.output.split())
        assert "connection setup" not in text and "client lag" not in text
        assert "/metrics" not in text and "The simulated engine's gauges" in text
        data = json.loads(path.read_text())
        assert data["simulated"] is True and data["metadata"]["device"] == "h100-sxm"
        assert data["failed"] == 0 and data["completed"] > 8
        # vllm bench serve's keys, per request, as bench writes them
        assert data["num_prompts"] == len(data["ttfts"]) == len(data["input_lens"])
        assert "simulated://h100-sxm" in html.read_text() and "<img" in html.read_text()
        files.append(path)
    small, large = (json.loads(f.read_text()) for f in files)
    decode = [r["runs"][0]["by_kind"]["decode"]["p99_itl_ms"] for r in (small, large)]
    assert decode[0] < decode[1]  # small budgets protect the streams from long prefills
    compared = runner.invoke(app, ["bench", "compare", str(files[0]), str(files[1])])
    assert compared.exit_code == 0, compared.output
    row = next(line for line in compared.output.splitlines() if "p99_itl_ms" in line)
    assert f"{small['p99_itl_ms']:,.2f}" in row and f"{large['p99_itl_ms']:,.2f}" in row


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "nonsense"], "nonsense"),
        (["--model", "llama-3.1-70b", "--device", "l4"], "does not fit"),
        (["--workload", "nope"], "--workload"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--bandwidth-efficiency", "1.5"], "--bandwidth-efficiency"),
        (["--input-len", "ten"], "--input-len"),
        # Output files are checked before the run, not after it.
        (["--save-result", "/nonexistent/x.json"], "does not exist"),
        (["--report", "."], "is a directory"),
        (["--plan-capacity", "--plot", "plan.txt"], ".png"),
    ],
)
def test_simulate_cli_refuses_bad_input_with_exit_2(args, message) -> None:
    from typer.testing import CliRunner

    from pdscope.cli import app

    result = CliRunner().invoke(app, ["simulate", "--num-prompts", "4", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_a_run_with_every_request_failed_exits_1_with_the_first_reason(tmp_path) -> None:
    from typer.testing import CliRunner

    from pdscope.cli import app

    saved = tmp_path / "sim.json"
    args = ["simulate", "--num-prompts", "4", "--input-len", "100", "--max-model-len", "50"]
    result = CliRunner().invoke(app, [*args, "--save-result", str(saved)])
    assert result.exit_code == 1, result.output
    assert "every simulated request" in result.output and "max_model_len 50" in result.output
    assert json.loads(saved.read_text())["failed"] == 4  # what was measured is kept


def test_a_request_over_max_model_len_is_a_counted_failure_with_its_reason() -> None:
    from pdscope.commands.simulate import SimulateSettings, simulate

    r = simulate(SimulateSettings(num_prompts=10, input_len="100-3000", max_model_len=2048))
    assert r["failed"] > 0 and r["completed"] + r["failed"] == 10
    assert all("max_model_len" in f["error"] for f in r["failures"])


def test_a_request_that_exactly_fills_the_pool_runs() -> None:
    """The last sampled token needs no KV slot: 10 prompt + 7 output tokens fit 4 blocks of 4."""
    cost = h100_cost()
    sim = Simulator(SchedulerConfig(64, 4, 64), 4, 4, lambda out: cost.step(out.scheduled).seconds)
    result = sim.run([SimRequest(unique_prompt(0, 10), 7)])
    assert result.requests[0].timeline.finish_reason == "length"
    assert len(result.requests[0].output_token_ids) == 7


def test_simulate_duration_stops_sending_and_throughput_counts_from_zero() -> None:
    from pdscope.commands.simulate import SimulateSettings, simulate

    r = simulate(SimulateSettings(num_prompts=100, request_rate=10, duration_s=2.0))
    sent = r["completed"] + r["failed"]
    assert 10 <= sent <= 35  # ~20 arrivals in 2 s at 10/s
    assert r["duration"] >= 2.0 * 0.9  # the clock starts at 0, not at the first arrival
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])


def test_simulate_refuses_a_kv_pool_that_does_not_fit_beside_the_weights() -> None:
    from pdscope.commands.simulate import SimulateSettings, simulate
    from pdscope.specs import SpecError

    with pytest.raises(SpecError, match="need more than"):
        simulate(SimulateSettings(model="llama-3.1-8b", device="l4", kv_cache_memory_bytes=20e9))
    with pytest.raises(SpecError, match="max_position_embeddings"):
        simulate(SimulateSettings(model="llama-3.1-8b", max_model_len=10**6))


def test_max_model_len_not_given_is_the_models_own_or_the_probed_servers(tiny_model) -> None:
    """A model of 2,048 positions simulated without --max-model-len runs at 2,048 (the default
    8,192 was refused with an error naming a flag the user never gave); with --calibrate, the
    probed server's length."""
    from pdscope.commands.simulate import SimulateSettings, simulate

    config = json.loads((tiny_model / "config.json").read_text())
    pool = 2**26  # a GPU's whole memory would hold millions of the tiny model's KV blocks
    settings = SimulateSettings(
        model=str(tiny_model), num_prompts=2, output_len="4", kv_cache_memory_bytes=pool
    )
    r = simulate(settings)
    assert r["metadata"]["settings"]["max_model_len"] == config["max_position_embeddings"] < 8192
    probe = "tests/data/probe-small-xeon-1thread.json"  # a server of 4,096 tokens
    r = simulate(SimulateSettings(model="llama-3.2-1b", calibrate=probe, num_prompts=2))
    assert r["metadata"]["settings"]["max_model_len"] == 4096


def test_simulate_file_workload_counts_prompts_with_the_models_tokenizer(
    tiny_model, tmp_path
) -> None:
    """A JSONL file as bench takes it: text prompts are counted by the checkpoint's tokenizer
    (so repeated text shares its prefix in the cache, as on a server); chat messages go through
    the chat template. Without a tokenizer, a clear error and exit 2."""
    import json

    from typer.testing import CliRunner

    from pdscope.cli import app
    from pdscope.engine.tokenizer import Tokenizer

    shared = " ".join(f"word{i}" for i in range(150))
    lines = [
        {"prompt": shared + " first question", "output_tokens": 5},
        {"prompt": shared + " second question", "output_tokens": 7},
        {"messages": [{"role": "user", "content": "hello there"}], "output_tokens": 3},
    ]
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps(x) for x in lines))
    saved = tmp_path / "sim.json"
    runner = CliRunner()
    args = ["simulate", "--workload", f"file:{workload}", "--num-prompts", "3"]
    args += ["--kv-cache-memory", "64MiB"]  # not an H100's pool of a tiny model's blocks
    result = runner.invoke(
        app, [*args, "--model", str(tiny_model), "--max-model-len", "1024",
              "--max-concurrency", "1", "--save-result", str(saved)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(saved.read_text())
    tok = Tokenizer(tiny_model)
    chat = tok.apply_chat_template(lines[2]["messages"])  # type: ignore[arg-type]
    expected = [len(tok.encode(lines[0]["prompt"])), len(tok.encode(lines[1]["prompt"]))]
    expected.append(len(tok.encode(chat, add_special_tokens=False)))
    assert data["input_lens"] == expected and data["output_lens"] == [5, 7, 3]
    assert data["runs"][0]["server"]["deltas"]["prefix_hits"] > 0  # the shared text hit
    assert data["metadata"]["prompt_mode"].startswith("exact (counted by the tokenizer")

    missing = runner.invoke(app, [*args, "--model", "8b"])
    assert missing.exit_code == 2
    assert "--tokenizer" in " ".join(missing.output.split())


def test_simulate_find_capacity_uses_bench_search_and_brackets_the_slo(tmp_path) -> None:
    """bench's capacity search over simulated runs: the concurrency it reports meets the SLO,
    the next one it tried does not."""
    import json

    from typer.testing import CliRunner

    from pdscope.cli import app

    saved = tmp_path / "cap.json"
    args = [
        "simulate", "--num-prompts", "64", "--input-len", "2000", "--output-len", "50",
        "--find-capacity", "--slo", "p99_ttft=400ms", "--save-result", str(saved),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "capacity under" in result.output
    data = json.loads(saved.read_text())
    cap = data["capacity"]
    best, broke = cap["max_concurrency_meeting_slo"], cap["first_failing_concurrency"]
    assert best is not None and broke is not None and broke == best + 1
    by_level = {r["max_concurrency"]: r for r in data["runs"]}
    assert (
        by_level[best]["summary"]["p99_ttft_ms"] <= 400 < by_level[broke]["summary"]["p99_ttft_ms"]
    )
    refused = CliRunner().invoke(app, ["simulate", "--find-capacity", "--num-prompts", "4"])
    assert refused.exit_code == 2 and "--slo" in refused.output


def test_simulate_draws_workload_and_arrivals_from_benchs_seeds() -> None:
    """A bench run and a simulation given one --seed see the same load: bench's first run draws
    its workload from the seed and its arrivals from seed + 1."""
    import asyncio

    from pdscope.client.load import LoadPlan
    from pdscope.client.workloads import Lengths, random_workload
    from pdscope.commands.simulate import SimulateSettings, _SyntheticPrompts, simulate

    s = SimulateSettings(
        input_len="50-500", output_len="10-40", num_prompts=6, request_rate=4.0, seed=7
    )
    result = simulate(s)
    arrivals = LoadPlan(request_rate=4.0, seed=8).schedule(6)
    # vllm bench serve's field: send times from the first send
    sent = sorted(result["start_times"])
    assert sent == pytest.approx([a - min(arrivals) for a in sorted(arrivals)])
    specs = asyncio.run(
        random_workload(
            _SyntheticPrompts(7, 1000),
            6,
            Lengths.parse("50-500", "in"),
            Lengths.parse("10-40", "out"),
            7,
        )
    )
    assert result["input_lens"] == [len(x.prompt) for x in specs]
    assert result["output_lens"] == [x.output_tokens for x in specs]


def test_admission_delay_adds_to_ttft_and_queue_time_not_to_decode() -> None:
    """A request overhead (HTTP, hand-off to the engine) delays when the scheduler sees a
    request: its TTFT grows by exactly that much, its token gaps not at all."""
    cost = h100_cost(step_overhead_s=0.002)
    timelines = []
    for delay in (0.0, 0.05):
        sim = Simulator(
            SchedulerConfig(2048, 64, 8192),
            num_blocks=4096,
            block_size=16,
            step_seconds=lambda out: cost.step(out.scheduled).seconds,
            admission_delay_s=delay,
        )
        specs = [SimRequest(unique_prompt(i, 500), 20, arrival_s=0.3 * i) for i in range(3)]
        timelines.append([r.timeline for r in sim.run(specs, max_concurrency=1).requests])
    for plain, delayed in zip(*timelines, strict=True):
        assert delayed.ttft_s == pytest.approx(plain.ttft_s + 0.05)
        assert delayed.queue_s == pytest.approx(plain.queue_s + 0.05)
        assert delayed.itl_s == pytest.approx(plain.itl_s)
