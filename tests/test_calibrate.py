"""`simulate --calibrate`: the cost parameters fitted to a probe file. The probe here is made by
the simulator itself with known parameters, so the fit has a right answer to recover; the real
engine's calibration is checked end to end by bench/validate_simulator.py."""

import copy
import gzip
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pdscope.analysis.calibrate import (
    StepJitter,
    WorkEntry,
    fit,
    observations,
    prefill_steps,
    step_jitter,
)
from pdscope.analysis.probe import JOIN_LABEL, JOIN_NEW_LABEL
from pdscope.cli import app
from pdscope.client.trace import Trace, trace_from_timeline
from pdscope.engine.scheduler import SchedulerConfig
from pdscope.engine.simulator import SimRequest, Simulator
from pdscope.roofline.step_cost import CostModel, CostParams, StepCost
from pdscope.specs import SpecError, get_kv_precision, get_weight_precision, load_model

MODEL = "llama-3.2-1b"
TRUE = CostParams(
    30.0,
    0.5,
    step_overhead_s=0.003,
    prefill_step_overhead_s=0.006,
    seq_overhead_s=0.0005,
    request_overhead_s=0.004,
)
BUDGET = 2048


def cost(params: CostParams = TRUE) -> CostModel:
    return CostModel(
        load_model(MODEL), get_weight_precision("bf16"), get_kv_precision("bf16"), params
    )


def simulated_probe(
    batch_streams: int = 8,
    params: CostParams = TRUE,
    sweep: tuple[int, ...] = (),
    join: bool = True,
) -> dict:
    """A probe's requests (sweep, prefix, context, batched decode, the batch sweep's sizes)
    run on a simulated server with ``params``, saved as probe writes them."""
    model = cost(params)
    sim = Simulator(
        SchedulerConfig(BUDGET, 64, 8192),
        num_blocks=8192,
        block_size=16,
        step_seconds=lambda out: model.step(out.scheduled).seconds,
        admission_delay_s=params.request_overhead_s,
    )
    traces: list[Trace] = []
    counter = iter(range(10**6))

    def send(
        prompts: list[list[int]], label: str, output: int = 64, joining: Sequence[int] = ()
    ) -> None:
        """``joining``: prompts of these lengths sent 4 s apart among the others (whose
        prefill takes ~2.5 s here), from 5 s on, labelled as probe's join check labels them
        (2 tokens out)."""
        start = sim.now_s + 0.5  # the server is idle between the probe's requests
        specs = [SimRequest(p, output, arrival_s=start) for p in prompts]
        specs += [
            SimRequest(fresh(n), 2, arrival_s=start + 5.0 + 4.0 * k, label=JOIN_NEW_LABEL)
            for k, n in enumerate(joining)
        ]
        result = sim.run(specs)
        for spec, request in zip(specs, result.requests, strict=True):  # in arrival order
            trace = trace_from_timeline(
                request.timeline,
                api="openai-completions",
                url="sim",
                model=MODEL,
                label=spec.label or label,
            )
            trace.prompt_tokens_asked = len(request.prompt_token_ids)
            traces.append(trace)

    def fresh(n: int) -> list[int]:
        base = next(counter) * 100_000
        return list(range(base, base + n))

    send([fresh(200)], "cold")
    for n in (200, 500, 1000, 2000):
        for _ in range(3):
            send([fresh(n)], "sweep")
    shared = fresh(2000)
    send([shared + fresh(16)], "prefix-cold")
    send([shared + fresh(16)], "prefix-warm")
    for label, n in (("context-short", 64), ("context-long", 3000)):
        for _ in range(2):
            send([fresh(n)], label)
    if batch_streams:
        send([fresh(64) for _ in range(batch_streams)], "batch-decode")
        # Long prompts sent together: the first ones decode while the rest still prefill.
        send([fresh(1024) for _ in range(batch_streams)], "batch-decode-long")
        for n in sweep:
            send([fresh(64) for _ in range(n)], f"batch-decode x{n}")
        if join:
            streams = [fresh(64) for _ in range(batch_streams)]
            send(streams, JOIN_LABEL, output=200, joining=(128, 1024))
    return {
        "runtime": {"name": "pdscope", "max_model_len": 8192},
        "served_model": {"name": MODEL},
        "traces": [t.to_dict() for t in traces],
    }


def test_prefill_steps_follow_the_budget_and_never_cover_the_last_token() -> None:
    steps = prefill_steps(5000, 0, 2048)
    assert [(s[0].start, s[0].num_new_tokens, s[0].samples) for s in steps] == [
        (0, 2048, False),
        (2048, 2048, False),
        (4096, 904, True),
    ]
    (only,) = prefill_steps(100, 100, 2048)  # a whole-prompt hit still computes the last token
    assert (only[0].start, only[0].num_new_tokens) == (99, 1)


def test_the_fit_recovers_the_parameters_a_probe_was_made_with() -> None:
    probe = json.loads(json.dumps(simulated_probe()))  # through JSON, as a saved file is
    obs = observations(probe, BUDGET)
    kinds = [o.kind for o in obs]
    assert kinds.count("batch-decode") == 2
    # Each prompt sent among the 8 decoding streams: one step carrying it and them.
    joins = [o for o in obs if o.kind == "mixed"]
    assert [o.label for o in joins] == [
        "prefill 128 tok joining x8 decodes",
        "prefill 1024 tok joining x8 decodes",
    ]
    assert all(len(o.steps) == 1 and len(o.steps[0]) == 9 for o in joins)
    # The long batch's steps with all 8 decoding, not its early steps beside others' prefills.
    (long,) = (o for o in obs if o.label.startswith("batch-decode-long"))
    assert long.label == "batch-decode-long x8 at 1056 tok"
    assert not any(o.label.startswith("cold ") for o in obs)  # the cold request is left out
    assert any(o.label == "prefix-warm 2016 tok (2000 cached)" for o in obs)
    start = CostParams(100.0, 10.0)  # far from the truth
    calibration = fit(cost(start), obs)
    p = calibration.params
    assert p.bandwidth_gb_s == pytest.approx(TRUE.bandwidth_gb_s, rel=0.02)
    assert p.tflops == pytest.approx(TRUE.tflops, rel=0.02)
    # 3 ms of an 86 ms decode step: the rates' 0.2% moves it by 6%
    assert p.step_overhead_s == pytest.approx(TRUE.step_overhead_s, rel=0.1)
    assert p.prefill_step_overhead_s == pytest.approx(TRUE.prefill_step_overhead_s, rel=0.1)
    assert p.seq_overhead_s == pytest.approx(TRUE.seq_overhead_s, rel=0.1)
    assert p.request_overhead_s == pytest.approx(TRUE.request_overhead_s, rel=0.1)
    assert max(abs(r.error) for r in calibration.residuals) < 0.01
    assert not calibration.notes


# A server whose step switches kernels: one row is cheap, a batch pays a fixed jump, then
# little per row until a third kernel at 8 rows (the shape of the engine's decode step).
CURVED = replace(TRUE, seq_overhead_s=0.0015, seq_overhead_above=((2, 0.0001), (8, 0.0006)))


def test_a_per_sequence_cost_that_changes_at_batch_sizes() -> None:
    """Each sequence past the n-th costs the pair's seconds: 1.5 ms for the first two, 0.1 ms
    for the 3rd to the 8th, 0.6 ms past the 8th."""
    p = CURVED
    assert [p.seqs_overhead_s(n) * 1e3 for n in (0, 1, 2, 3, 8, 9, 20)] == pytest.approx(
        [0.0, 1.5, 3.0, 3.1, 3.6, 4.2, 10.8]
    )
    assert TRUE.seqs_overhead_s(20) == pytest.approx(20 * TRUE.seq_overhead_s)
    for bad in (((8, 1e-4), (2, 1e-4)), ((2, 1e-4), (2, 1e-4)), ((0, 1e-4),), ((2, -1e-4),)):
        with pytest.raises(SpecError):
            replace(TRUE, seq_overhead_above=bad)


def decode_step(model: CostModel, seqs: int, context: int = 100) -> StepCost:
    return model.step([WorkEntry(context - 1, 1) for _ in range(seqs)])


def test_the_batch_sweep_fits_a_step_that_is_not_linear_in_its_sequences() -> None:
    probe = json.loads(json.dumps(simulated_probe(params=CURVED, sweep=(2, 32))))
    obs = observations(probe, BUDGET)
    sizes = sorted(len(o.steps[0]) for o in obs if o.kind == "batch-decode")
    assert sizes == [2, 8, 8, 32]  # the sweep's two, the batched check's short and long
    assert "batch-decode x32 at 96 tok" in [o.label for o in obs]
    calibration = fit(cost(CostParams(100.0, 10.0)), obs)
    p = calibration.params
    assert [n for n, _ in p.seq_overhead_above] == [2, 8]
    assert max(abs(r.error) for r in calibration.residuals) < 0.01
    fitted, truth = cost(p), cost(CURVED)
    for seqs in (1, 2, 4, 8, 16, 32, 48):  # 4 and 16 lie between measured sizes, 48 past them
        got, want = decode_step(fitted, seqs), decode_step(truth, seqs)
        assert got.seconds == pytest.approx(want.seconds, rel=0.01)
        assert got.overhead_s == pytest.approx(want.overhead_s, rel=0.05)
    assert calibration.to_dict()["seq_overhead_above_ms"] == [
        [n, pytest.approx(ms * 1e3)] for n, ms in p.seq_overhead_above
    ]
    # The same server probed at 8 streams only: one cost per sequence through 1 and 8, which
    # misses the steps between and past them (the reason for the sweep).
    alone = fit(cost(CostParams(100.0, 10.0)), observations(simulated_probe(params=CURVED), BUDGET))
    assert not alone.params.seq_overhead_above
    line = cost(alone.params)
    assert decode_step(line, 4).overhead_s < 0.9 * decode_step(truth, 4).overhead_s
    assert decode_step(line, 32).overhead_s < 0.8 * decode_step(truth, 32).overhead_s


def test_without_a_batched_decode_the_per_sequence_cost_is_held_at_zero_and_said() -> None:
    obs = observations(simulated_probe(batch_streams=0), BUDGET)
    calibration = fit(cost(CostParams(100.0, 10.0)), obs)
    assert calibration.params.seq_overhead_s == 0.0
    assert "--batch-streams" in calibration.notes[0]
    # one stream cannot split the overheads, but it still prices a step: the sum is recovered
    one = calibration.params.step_overhead_s
    assert one == pytest.approx(TRUE.step_overhead_s + TRUE.seq_overhead_s, rel=0.05)


def test_without_a_prompt_joining_a_batch_the_request_carries_the_prefill_steps_cost() -> None:
    """A prompt timed alone holds its step's extra cost and the time outside any step
    together: without the join check the fit holds the first at 0, says so, and the
    per-request cost carries both (what every probe before the check gave)."""
    obs = observations(simulated_probe(join=False), BUDGET)
    assert "mixed" not in {o.kind for o in obs}
    calibration = fit(cost(CostParams(100.0, 10.0)), obs)
    p = calibration.params
    assert p.prefill_step_overhead_s == 0.0
    assert any("join check" in note for note in calibration.notes)
    both = TRUE.request_overhead_s + TRUE.prefill_step_overhead_s
    assert p.request_overhead_s == pytest.approx(both, rel=0.15)


def _disturbed(obs: list, label: str, factor: float) -> list:
    return [replace(o, seconds=o.seconds * factor) if o.label == label else o for o in obs]


def test_a_batch_that_costs_no_more_than_one_stream_gets_no_per_sequence_cost() -> None:
    """The probe of a real 2-core server: 8 streams stepped as fast as one, and a host that
    slowed one prefill by half. The batch point is the only one that tells a per-sequence cost
    from a per-step one, and it says none; a fit that priced one anyway (5.8 ms a sequence on
    such a probe, so 16 streams cost 87 ms more than one) mispredicts every batched decode."""
    obs = observations(simulated_probe(), BUDGET)
    single = next(o for o in obs if o.label.startswith("context-short decode"))
    obs = [
        replace(o, seconds=single.seconds * 0.95) if o.kind == "batch-decode" else o for o in obs
    ]
    obs = _disturbed(obs, "sweep 1000 tok", 1.5)
    calibration = fit(cost(CostParams(100.0, 10.0)), obs)
    p = calibration.params
    assert p.seq_overhead_s == 0.0
    batch = next(r for r in calibration.residuals if r.kind == "batch-decode")
    assert abs(batch.error) < 0.08
    # one disturbed point moves the rates little: the loss is absolute, not squared, error
    assert p.tflops == pytest.approx(TRUE.tflops, rel=0.05)


@pytest.mark.parametrize("factor", [0.7, 1.5])
def test_one_disturbed_point_moves_the_fit_little(factor: float) -> None:
    """A host that sped up or slowed one prefill of the probe: the fit must still price what
    the probe did not measure (32 streams at 1,000 tokens of context, a 4,000-token prompt)
    as the undisturbed fit does. A least-squares fit took such a point as a reason to trade
    bandwidth for a 38 ms per-step overhead."""
    start = cost(CostParams(100.0, 10.0))
    clean = fit(start, observations(simulated_probe(), BUDGET)).params
    obs = _disturbed(observations(simulated_probe(), BUDGET), "sweep 1000 tok", factor)
    noisy = fit(start, obs).params
    assert noisy.bandwidth_gb_s == pytest.approx(clean.bandwidth_gb_s, rel=0.1)
    batch = [WorkEntry(1000, 1) for _ in range(32)]
    prompt = [WorkEntry(0, 4000)]
    for step in (batch, prompt):
        want = cost(clean).step(step).seconds
        assert cost(noisy).step(step).seconds == pytest.approx(want, rel=0.1)


DATA = Path(__file__).parent / "data"


def test_a_recorded_probe_of_the_real_engine_is_fitted_without_a_per_sequence_cost() -> None:
    """A real probe (recorded: the server it measured ran on another session's host) of the
    embedded server at one thread, whose 8 streams stepped in 55 ms against 61 ms for one.
    The previous fit, alternating least squares, settled in a local minimum that priced 5.8 ms
    per sequence per step: the batch point +92%, and simulated TPOT +64% at 16 streams."""
    probe = json.loads((DATA / "probe-small-xeon-1thread.json").read_text())
    calibration = fit(recorded_fit_start(), observations(probe, 2048))
    assert calibration.params.seq_overhead_s == 0.0
    errors = {r.label: r.error for r in calibration.residuals}
    assert abs(errors["batch-decode x8 at 80 tok"]) < 0.15
    assert sum(abs(e) for e in errors.values()) / len(errors) < 0.15


def recorded_fit_start(config: str = "small-config.json") -> CostModel:
    spec = load_model(str(DATA / config))
    return CostModel(
        spec, get_weight_precision("bf16"), get_kv_precision("bf16"), CostParams(100.0, 10.0)
    )


def test_a_batch_read_in_bursts_is_left_out_and_a_zero_second_point_too() -> None:
    """Every stream of the recorded probe's batch reaches the client in bursts of three
    tokens (as a loaded client reads them): the batch point is left out, as a single stream
    read so is (its gaps time the client). Kept, bursts of three happened to read within 5%
    of the clean step; a loaded client's real bursts did not (see
    test_a_loaded_clients_batches_do_not_sink_the_decode_step). On a tiny model's probe
    beside a busy core the median of both batch points was 0 s, which the fit divided by: a
    point measured at 0 s is left out, with a note that names it."""
    probe = json.loads((DATA / "probe-small-xeon-1thread.json").read_text())
    clean = {o.label: o for o in observations(probe, BUDGET)}
    label = "batch-decode x8 at 80 tok"
    assert label in clean
    for t in probe["traces"]:
        if t["label"] == "batch-decode":
            chunks = t["chunks"]
            for i, chunk in enumerate(chunks[1:], start=1):
                if i % 3:
                    chunk["t_s"] = chunks[i - 1]["t_s"] + 1e-5
    bursts = {o.label for o in observations(probe, BUDGET)}
    assert bursts == set(clean) - {label}

    zero = [replace(o, seconds=0.0) if o.label == label else o for o in clean.values()]
    calibration = fit(recorded_fit_start(), zero)
    assert any(label in note and "not a positive time" in note for note in calibration.notes)
    assert label not in {r.label for r in calibration.residuals}
    assert 0 < calibration.params.bandwidth_gb_s < float("inf")
    assert all(0 < r.fitted_s < float("inf") for r in calibration.residuals)


def test_a_loaded_clients_batches_do_not_sink_the_decode_step() -> None:
    """A real probe of the tiny model (AMD EPYC, 2 cores; the probing process pinned to a core
    shared with a busy loop, as a full test suite's client is): the client read most streams
    in bursts. Grouped by the midpoint rule, the bursts' ~0 gaps and their long ones fell in
    different groups: the 2-stream point read 0.112 ms a step and the batched check 0.023 ms
    over 3 streams, where one stream's step took 0.28-0.49 ms. A relative error punishes
    overshooting a tiny time without bound, so the fit gave those two points their way and
    every single-stream decode a fitted step 71-85% short; a CI run's simulated TPOT came out
    0.021 ms against a measured 0.38 (Intel Xeon). Gaps of streams read in bursts are left
    out now: what is left fits the single-stream decodes within 30%."""
    probe = json.loads(
        gzip.decompress((DATA / "probe-tiny-epyc-loaded-client.json.gz").read_bytes())
    )
    obs = observations(probe, BUDGET)
    batch = {o.label for o in obs if o.kind == "batch-decode"}
    assert batch == {"batch-decode x32 at 73 tok", "batch-decode-long x4 at 1033 tok"}
    calibration = fit(recorded_fit_start("tiny-config.json"), obs)
    decodes = [r for r in calibration.residuals if r.kind == "decode"]
    assert len(decodes) == 7
    assert all(abs(r.error) < 0.3 for r in decodes), [(r.label, r.error) for r in decodes]


def test_the_step_scatter_keeps_the_mean_and_the_probed_tail() -> None:
    """The recorded engine's decode gaps scatter (p99 1.26 of the mean); a steady server's
    (the simulated probe) do not, so calibrating from it changes nothing."""
    jitter = step_jitter(json.loads((DATA / "probe-small-xeon-1thread.json").read_text()))
    assert jitter is not None and jitter.samples > 400
    draws = [jitter.draw(i / 10_000) for i in range(10_000)]
    assert sum(draws) / len(draws) == pytest.approx(1.0, abs=0.005)
    assert jitter.quantiles[99] > 1.2
    steady = step_jitter(simulated_probe())
    # (a steady step still grows with its context: 0.08% over one decode)
    assert steady is not None and max(steady.quantiles) / min(steady.quantiles) < 1.002


def test_a_step_longer_than_a_decode_gets_a_decodes_disturbance_in_seconds() -> None:
    """The recorded probe's decode step (~56 ms at one thread) is the scale: a step up to it
    is multiplied by the draw, a longer one gets the seconds the draw gives that step, so a
    long prefill's spread is a decode's in seconds (not 10x it), and every mean stays put."""
    jitter = step_jitter(json.loads((DATA / "probe-small-xeon-1thread.json").read_text()))
    assert jitter is not None and 0.04 < jitter.scale_s < 0.08
    us = [i / 10_000 for i in range(10_000)]
    for cost_s in (0.01, jitter.scale_s, 10 * jitter.scale_s):
        steps = [jitter.apply(cost_s, u) for u in us]
        assert sum(steps) / len(steps) == pytest.approx(cost_s, rel=0.005)
        spread = np.percentile(steps, 99) - np.percentile(steps, 50)
        base = min(cost_s, jitter.scale_s)
        want = (jitter.quantiles[99] - jitter.quantiles[50]) * base
        assert spread == pytest.approx(want, rel=0.02)
    assert StepJitter((0.5, 1.5)).apply(1.0, 0.9) == 1.5  # no scale: multiplied, as before


@pytest.mark.parametrize("disturbance", ["stall", "bursts"])
def test_one_disturbed_request_does_not_rescale_every_step(disturbance: str) -> None:
    """One request of the recorded probe stalls for 2 s (~30 steps), or reaches a loaded
    client in bursts of three (two gaps of ~0 in every three): the scatter's median stays the
    clean probe's, and a request read in bursts is left out (it measures the client). Scaled
    by each request's median gap and rescaled to mean 1 over the probe, the bursts gave a
    median draw of 0.002 (a simulated TPOT a few hundredths of the real one, as one
    full-suite run of the end-to-end test below saw), and the stall 0.93."""
    probe = json.loads((DATA / "probe-small-xeon-1thread.json").read_text())
    clean = step_jitter(probe)
    chunks = next(t for t in probe["traces"] if t["label"] == "sweep")["chunks"]
    for i, chunk in enumerate(chunks[1:], start=1):
        if disturbance == "stall" and i >= 3:
            chunk["t_s"] += 2.0
        elif disturbance == "bursts" and i % 3:
            chunk["t_s"] = chunks[i - 1]["t_s"] + 1e-5
    disturbed = step_jitter(probe)
    assert clean is not None and disturbed is not None
    assert disturbed.quantiles[50] == pytest.approx(clean.quantiles[50], rel=0.02)
    if disturbance == "bursts":
        assert disturbed.bursty == 1 and clean.bursty == 0
        assert disturbed.quantiles[99] == pytest.approx(clean.quantiles[99], rel=0.02)
    draws = [disturbed.draw(i / 10_000) for i in range(10_000)]
    assert sum(draws) / len(draws) == pytest.approx(1.0, abs=0.005)


def test_simulate_scatters_steps_as_the_probed_server_did(tmp_path: Path) -> None:
    """With the recorded probe, a one-stream run's gaps spread as the probe's did (ITL p99 over
    p50 near the probe's p99 over p50), TPOT (a mean) stays the steady run's, a seed repeats a
    run exactly, and --no-step-jitter gives the steady steps."""
    probe = DATA / "probe-small-xeon-1thread.json"
    jitter = step_jitter(json.loads(probe.read_text()))
    assert jitter is not None

    def run(name: str, *extra: str) -> dict:
        out = tmp_path / f"{name}.json"
        result = CliRunner().invoke(
            app,
            [
                "simulate", "--calibrate", str(probe), "--model", str(DATA / "small-config.json"),
                "--input-len", "64", "--output-len", "200", "--num-prompts", "8",
                "--max-concurrency", "1", "--seed", "5", "--max-model-len", "4096",
                "--save-result", str(out), *extra,
            ],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text())

    steady, scattered, again = run("steady", "--no-step-jitter"), run("a"), run("b")
    assert steady["metadata"]["calibration"]["step_jitter"] is None
    assert steady["p99_itl_ms"] / steady["p50_itl_ms"] < 1.01
    spread = scattered["p99_itl_ms"] / scattered["p50_itl_ms"]
    assert spread == pytest.approx(jitter.quantiles[99] / jitter.quantiles[50], rel=0.1)
    assert scattered["mean_tpot_ms"] == pytest.approx(steady["mean_tpot_ms"], rel=0.03)
    assert scattered["itls"] == again["itls"]


def test_a_probe_with_no_answered_decode_cannot_be_fitted() -> None:
    probe = simulated_probe(batch_streams=0)
    probe["traces"] = [t for t in probe["traces"] if t["label"] == "sweep"][:1]
    for t in probe["traces"]:
        t["chunks"] = t["chunks"][:1]  # one chunk: a TTFT, no decode
    with pytest.raises(SpecError, match="prefill and decode"):
        fit(cost(), observations(probe, BUDGET))


def test_simulate_cli_calibrates_prints_the_fit_and_records_it(tmp_path: Path) -> None:
    probe_file = tmp_path / "probe.json"
    probe_file.write_text(json.dumps(simulated_probe()))
    saved = tmp_path / "sim.json"
    result = CliRunner().invoke(
        app,
        [
            "simulate", "--calibrate", str(probe_file), "--model", MODEL, "--num-prompts", "8",
            "--kv-cache-memory", "1GiB", "--save-result", str(saved),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "calibration residuals" in result.output and "batch-decode x8" in result.output
    data = json.loads(saved.read_text())
    cal = data["metadata"]["calibration"]
    assert cal["bandwidth_gb_s"] == pytest.approx(30.0, rel=0.02)
    assert data["metadata"]["device"] == "calibrated"
    assert data["metadata"]["cost_params"]["source"] == f"fitted to {probe_file}"
    assert data["completed"] == 8


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("not json", [], "cannot read"),
        ('{"runtime": {}}', [], "not a `pdscope probe --json` file"),
        ('{"traces": [], "served_model": {}}', [], "--model"),
        ('{"traces": []}', ["--model", MODEL], "prefill and decode"),
        ('{"traces": []}', ["--model", MODEL, "--step-overhead-ms", "1"], "--step-overhead-ms"),
    ],
)
def test_simulate_cli_refuses_a_bad_probe_file_with_exit_2(
    tmp_path: Path, content: str, extra: list[str], message: str
) -> None:
    probe_file = tmp_path / "probe.json"
    probe_file.write_text(content)
    result = CliRunner().invoke(
        app, ["simulate", "--calibrate", str(probe_file), "--num-prompts", "4", *extra]
    )
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())  # the error line may wrap


@pytest.mark.slow
def test_calibrated_simulation_tracks_the_real_engine_end_to_end(tiny_model, tmp_path) -> None:
    """One small validation case end to end (bench/validate_simulator.py runs the full set):
    probe a real server, calibrate from its JSON, then bench and simulate the same workload.
    On a shared 2-core host the bounds are loose (a factor of 2.5, 5 for decode): they catch a
    broken fit or a unit error, not a 10% drift, which the validation table records.

    The workload is benched twice, before and after the probe, and the simulation is held, on
    each figure, to the run it is nearer on that figure. This bench takes about 0.09 s (AMD
    EPYC, 2 cores), so a stall of the host under half a second cuts its output throughput
    five-fold: in session 22 the test failed now and then in full-suite runs with the
    simulated throughput 5-7x the measured while the medians held. A slow spell moves the
    median TTFT too, and not in the same run: one run here read 28.9 ms and 2,603 tok/s, the
    other 16.2 ms and 1,083 tok/s, against a simulated 9.6 ms and 5,695 (session 26; when the
    run nearest in throughput judged every figure, that TTFT failed at 0.33). A figure off in
    both runs, or a wrong fit, still fails."""
    from tests.conftest import start_server

    server = start_server(tiny_model, tmp_path, "--kv-cache-memory", "32MiB")
    probe_file, sim_file = tmp_path / "probe.json", tmp_path / "sim.json"
    real_files = [tmp_path / f"real-{n}.json" for n in (1, 2)]
    runner = CliRunner()
    load = ["--input-len", "64", "--output-len", "32", "--num-prompts", "12", "--seed", "3"]

    def run_bench(out: Path) -> None:
        benched = runner.invoke(
            app, ["bench", server.url, *load, "--max-concurrency", "4", "--save-result", str(out)]
        )
        assert benched.exit_code == 0, benched.output

    try:
        run_bench(real_files[0])
        probed = runner.invoke(
            app,
            [
                "probe", server.url, "--json", str(probe_file), "--prompt-tokens", "64,256,512",
                "--repeats", "2", "--output-tokens", "16", "--batch-streams", "4",
            ],
        )  # fmt: skip
        assert probe_file.is_file(), probed.output
        run_bench(real_files[1])
    finally:
        server.stop()
    max_len = json.loads(probe_file.read_text())["runtime"]["max_model_len"]
    simulated = runner.invoke(
        app,
        [
            "simulate", "--calibrate", str(probe_file), *load, "--max-concurrency", "4",
            "--kv-cache-memory", "32MiB", "--max-model-len", str(max_len),
            "--max-num-seqs", "64", "--save-result", str(sim_file),
        ],
    )  # fmt: skip
    assert simulated.exit_code == 0, simulated.output
    reals = [json.loads(f.read_text()) for f in real_files]
    sim = json.loads(sim_file.read_text())
    assert sim["completed"] == reals[0]["completed"] == reals[1]["completed"] == 12
    assert sim["metadata"]["calibration"]["residuals"]
    # The decode figures get a factor of 5: the tiny model's decode step is mostly per-step
    # overhead, and on the AMD EPYC four runs of this test alone fitted a simulated TPOT of
    # 0.56-1.18 ms against a real 1.19-1.75 (ratios 0.42-0.99), and 0.21 once in a full
    # suite (real 2.01 ms; the probe and the bench run one after the other on a host that changes
    # speed). A unit error is off by far more. In the fourteenth session one full-suite run
    # simulated 0.046 ms against a real 0.883 (0.05); its probe file was lost. The likely
    # cause, mended in the fifteenth: the step scatter's scale (see
    # test_one_disturbed_request_does_not_rescale_every_step), which one request read in
    # bursts by a loaded client could shrink to a few hundredths. A failure prints the fit,
    # the scatter and the probe's residuals.
    for key, factor in (("median_tpot_ms", 5), ("median_ttft_ms", 2.5), ("output_throughput", 5)):
        real = min(reals, key=lambda run: abs(math.log(sim[key] / run[key])))
        # a str, which pytest prints whole (a tuple's repr is cut at ~240 characters, and a
        # CI failure hid the residuals that way)
        assert 1 / factor < sim[key] / real[key] < factor, (
            f"{key}: simulated {sim[key]}, real {[r[key] for r in reals]}; calibration "
            + json.dumps(sim["metadata"]["calibration"])
        )


def test_a_decode_read_in_bursts_is_left_out_of_the_fit() -> None:
    """A client too loaded to keep up read a stream's tokens together at its end: the span its
    gaps add up to shrank to nothing, so its TPOT read ~0.04 ms where the steps took 0.7, and
    the fit, taking the steps to cost nothing, simulated a TPOT a twentieth of the real one
    (a clean-clone CI run of the end-to-end test). Such a decode is left out of the fit."""
    probe = json.loads((DATA / "probe-small-xeon-1thread.json").read_text())
    budget = 2048
    before = {o.label for o in observations(probe, budget) if o.kind == "decode"}
    sweep = [t for t in probe["traces"] if t["label"] == "sweep" and t.get("chunks")]
    label = sweep[0]["label"]
    prompt = sweep[0]["prompt_tokens"] or sweep[0]["prompt_tokens_asked"]
    for t in (t for t in sweep if (t["prompt_tokens"] or t["prompt_tokens_asked"]) == prompt):
        chunks = t["chunks"]
        for chunk in chunks[1:]:  # every token after the first arrives with the last
            chunk["t_s"] = chunks[-1]["t_s"] - 1e-6
    traces = [Trace.from_dict(t) for t in probe["traces"]]

    assert sum(t.read_in_bursts for t in traces if t.label == label) >= 1
    after = {o.label for o in observations(probe, budget) if o.kind == "decode"}
    (gone,) = before - after  # that point's decode, and only it: the others still fit
    assert gone.startswith(f"{label} decode at ") and after < before


def test_a_response_probe_resent_is_left_out_of_the_fit() -> None:
    """A response probe could not read and sent again (`<label>-unread`) adds no observation:
    read whole, its TTFT is the whole response's time. The fit is the one its resend alone
    gives."""
    from pdscope.client.trace import UNREAD

    probe = json.loads((DATA / "probe-small-xeon-1thread.json").read_text())
    budget = 2048
    before = observations(probe, budget)
    sweep = next(t for t in probe["traces"] if t["label"] == "sweep" and t.get("chunks"))
    unread = copy.deepcopy(sweep)
    unread["label"] = "sweep" + UNREAD
    for chunk in unread["chunks"]:  # one network read: TTFT is the whole response's time
        chunk["t_s"] = unread["chunks"][-1]["t_s"]
    probe["traces"].append(unread)
    assert observations(probe, budget) == before
    # one read in bursts and resent counts among the bursty the step scatter left out
    jitter = step_jitter(probe)
    for chunk in unread["chunks"][1:-1]:  # the first token in time, the rest with the last
        chunk["t_s"] = unread["chunks"][-1]["t_s"] - 1e-6
    unread["chunks"][0]["t_s"] = sweep["chunks"][0]["t_s"]
    bursty = step_jitter(probe)
    assert jitter is not None and bursty is not None
    assert bursty.bursty == jitter.bursty + 1 and bursty.ratios == jitter.ratios
