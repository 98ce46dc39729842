"""Cluster-scale simulation: replicas and routers, tensor parallelism against hand arithmetic,
prefill/decode disaggregation over a queued KV link, conservation, and the CLI. No torch."""

import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from pdscope.cli import app
from pdscope.commands.cluster import ClusterSettings, PoolArgs, simulate_cluster
from pdscope.commands.simulate import SimulateSettings, simulate
from pdscope.engine.cluster import Cluster, ConservationError, KVLink, WorkerSpec
from pdscope.engine.scheduler import SchedulerConfig
from pdscope.engine.simulator import SimRequest, Simulator
from pdscope.roofline import arithmetic as rf
from pdscope.roofline.parallel import LINKS, Link, ring_allreduce_s, tensor_parallel
from pdscope.roofline.step_cost import CostModel, CostParams
from pdscope.specs import SpecError, get_kv_precision, get_weight_precision, load_model
from pdscope.specs.devices import GIB, resolve_device

BF16 = get_weight_precision("bf16")
KV16 = get_kv_precision("bf16")
H100 = resolve_device("h100-sxm")
LLAMA8B = load_model("llama-3.1-8b")


def cost(model=LLAMA8B, tp_size: int = 1, link: Link | None = None) -> CostModel:
    params = CostParams(H100.bandwidth_gb_s, H100.tflops_bf16, step_overhead_s=0.002)
    return CostModel(model, BF16, KV16, params, tensor_parallel(model, tp_size, link))


def worker(blocks: int = 4096, budget: int = 2048, seqs: int = 64, model=LLAMA8B) -> WorkerSpec:
    c = cost(model)
    return WorkerSpec(
        SchedulerConfig(budget, seqs, 8192), blocks, 16, lambda out: c.step(out.scheduled).seconds
    )


def prompt(index: int, tokens: int) -> list[int]:
    return [index * 100_000 + i for i in range(tokens)]


def poisson(n: int, rate: float, seed: int = 1) -> list[SimRequest]:
    import random

    rng = random.Random(seed)
    at, specs = 0.0, []
    for i in range(n):
        at += rng.expovariate(rate)
        specs.append(SimRequest(prompt(i, rng.randint(50, 1500)), rng.randint(5, 200), at))
    return specs


def kv_bytes(tokens: int) -> float:
    return rf.kv_bytes_at_context(LLAMA8B, KV16, tokens)


def test_importing_the_cluster_does_not_import_torch() -> None:
    code = (
        "import sys, pdscope.engine.cluster, pdscope.roofline.parallel;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- one replica is the single simulator ---------------------------------------------------


@pytest.mark.parametrize("cap", [None, 6])
@pytest.mark.parametrize("router", ["round-robin", "least-loaded", "prefix-aware"])
def test_one_replica_reproduces_the_single_simulator_exactly(router, cap) -> None:
    specs = poisson(120, rate=25)
    single = Simulator(SchedulerConfig(2048, 64, 8192), 4096, 16, worker().step_seconds)
    alone = single.run(specs, cap)
    together = Cluster([worker()], router).run(specs, cap)
    for a, b in zip(alone.requests, together.requests, strict=True):
        assert a.timeline.token_s == b.timeline.token_s  # every token at the same instant
        assert a.timeline.arrival_s == b.timeline.arrival_s
        assert a.output_token_ids == b.output_token_ids
    assert together.end_s == alone.end_s
    assert [s.end_s for s in together.workers[0].steps] == [s.end_s for s in alone.steps]


def test_replicas_1_tp_1_on_the_command_gives_single_simulates_result() -> None:
    base = SimulateSettings(num_prompts=80, request_rate=20, input_len="100-2000", seed=3)
    one = simulate(base)
    cluster = simulate_cluster(ClusterSettings(base, replicas=1, tensor_parallel_size=1))
    for key in ("ttfts", "itls", "output_throughput", "completed", "duration", "p99_tpot_ms"):
        assert cluster[key] == one[key], key
    assert cluster["cluster"]["gpus"] == 1


# --- routers -------------------------------------------------------------------------------


def test_round_robin_deals_requests_in_turn() -> None:
    specs = [SimRequest(prompt(i, 100), 10, i * 0.01) for i in range(12)]
    result = Cluster([worker()] * 3, "round-robin").run(specs)
    assert [w.completed for w in result.workers] == [4, 4, 4]
    assert sorted(result.workers[0].sim.tags.values()) == [0, 3, 6, 9]


def test_least_loaded_balances_what_round_robin_piles_up() -> None:
    """Long and short requests alternate: round-robin gives every long one to replica 0;
    least-loaded (outstanding tokens) spreads them, so the busiest replica works less."""
    specs = []
    for i in range(40):
        long = i % 2 == 0
        specs.append(SimRequest(prompt(i, 4000 if long else 50), 300 if long else 5, i * 0.02))

    def busiest(router: str) -> float:
        result = Cluster([worker(budget=8192)] * 2, router).run(specs)
        return max(w.busy_s for w in result.workers)

    assert busiest("least-loaded") < 0.8 * busiest("round-robin")


def test_prefix_aware_sends_a_prompt_where_its_prefix_is_cached() -> None:
    groups = [prompt(g, 2048) for g in range(4)]
    specs = [SimRequest(groups[i % 4] + prompt(1000 + i, 32), 8, i * 0.05) for i in range(40)]

    def run(router: str) -> tuple[float, int]:
        result = Cluster([worker()] * 4, router).run(specs)
        hits = sum(w.sim.pool.prefix_cache_hits for w in result.workers)
        queries = sum(w.sim.pool.prefix_cache_queries for w in result.workers)
        prefilled = sum(s.prefill_tokens for w in result.workers for s in w.steps)
        return hits / queries, prefilled

    (aware, aware_prefilled), (_, loaded_prefilled) = run("prefix-aware"), run("least-loaded")
    # After each group's first request, every later one finds its whole 2,048-token prefix:
    # each prefix is computed once in the cluster, not once per replica.
    assert aware == pytest.approx(36 * 2048 / (40 * 2080))
    assert aware_prefilled == 4 * 2080 + 36 * 32
    assert loaded_prefilled > aware_prefilled + 2048
    # Each group lives on one replica: its requests all went there.
    result = Cluster([worker()] * 4, "prefix-aware").run(specs)
    homes = {}
    for w in result.workers:
        for tag in w.sim.tags.values():
            homes.setdefault(tag % 4, set()).add(w.index)
    assert all(len(h) == 1 for h in homes.values())


# --- tensor parallelism against hand arithmetic ---------------------------------------------


def test_ring_allreduce_time_by_hand() -> None:
    link = Link("x", 100.0, 5e-6)
    assert ring_allreduce_s(1e6, 1, link) == 0.0
    assert ring_allreduce_s(1e6, 4, link) == pytest.approx(5e-6 + 2 * 3 / 4 * 1e6 / 100e9)


def test_tp_step_time_is_each_gpus_share_plus_two_allreduces_per_layer() -> None:
    model = load_model("llama-3.1-70b")
    link = LINKS["nvlink4"]
    one, eight = cost(model), cost(model, 8, link)

    class E:
        def __init__(self, start, n):
            self.start, self.num_new_tokens, self.samples = start, n, True

    for batch in ([E(1000, 1)], [E(2000, 1) for _ in range(32)], [E(0, 2048)]):
        a, b = one.step(batch), eight.step(batch)
        tokens = sum(e.num_new_tokens for e in batch)
        # Linear layers and the LM head: 1/8 of the FLOPs and bytes on each GPU.
        assert b.linear_s == pytest.approx(a.linear_s / 8)
        assert b.lm_head_s == pytest.approx(a.lm_head_s / 8)
        # Attention: 8 KV heads split 8 ways, as are the query heads.
        assert b.attention_s == pytest.approx(a.attention_s / 8)
        nbytes = tokens * 8192 * 2
        expected = 2 * 80 * (10e-6 + 2 * 7 / 8 * nbytes / 450e9)
        assert b.comm_s == pytest.approx(expected)
        assert a.comm_s == 0.0 and b.overhead_s == a.overhead_s


def test_kv_heads_fewer_than_gpus_are_copied_not_split() -> None:
    qwen = load_model("qwen2.5-0.5b")  # 14 query heads, 2 KV heads
    tp = tensor_parallel(qwen, 2, LINKS["pcie4"])
    assert tp.kv_split == 2
    with pytest.raises(SpecError, match="does not divide"):
        tensor_parallel(qwen, 4, LINKS["pcie4"])
    llama1b = load_model("llama-3.2-1b")  # 32 heads, 8 KV heads
    tp16 = tensor_parallel(llama1b, 16, LINKS["nvlink4"])
    assert tp16.kv_split == 8
    one, split = cost(llama1b), cost(llama1b, 16, LINKS["nvlink4"])
    # A decode's KV read splits 8 ways (not 16); its attention FLOPs are tiny at this context.
    assert split.attention_s(100_000, 1) == pytest.approx(one.attention_s(100_000, 1) / 8)


def test_tp_memory_per_gpu_by_hand() -> None:
    """Llama-3.1-70B bf16 on 8 H100s: each GPU holds 1/8 of the weights and 1/8 of each
    token's KV; the replica's pool is what one GPU has left over its share per token."""
    base = SimulateSettings(model="llama-3.1-70b", num_prompts=4, input_len="100")
    r = simulate_cluster(ClusterSettings(base, tensor_parallel_size=8))
    model = load_model("llama-3.1-70b")
    weights_per_gpu = rf.weight_bytes(model, BF16) / 8
    kv_per_gpu_token = 2 * 80 * 8 * 128 * 2 / 8
    pool = 80 * GIB * 0.9 - weights_per_gpu
    expected = int(pool // (kv_per_gpu_token * 16)) * 16
    assert r["cluster"]["pools"]["replica"]["kv_pool_tokens"] == expected
    assert r["cluster"]["gpus"] == 8
    # On one GPU the same model does not fit at all.
    with pytest.raises(SpecError, match="does not fit"):
        simulate_cluster(ClusterSettings(base, replicas=2))


# --- disaggregation -------------------------------------------------------------------------


def _disagg(link: KVLink, first_token: str, specs, decode_blocks: int = 4096):
    cluster = Cluster(
        [worker()], "round-robin", [worker(decode_blocks)], link, kv_bytes, first_token
    )
    return cluster.run(specs)


@pytest.mark.parametrize("first_token", ["prefill", "decode"])
def test_the_token_that_waits_for_the_transfer_is_later_by_the_transfer_time(first_token):
    specs = [SimRequest(prompt(0, 3000), 20)]
    fast = _disagg(KVLink(math.inf), first_token, specs).requests[0].timeline
    slow_link = KVLink(2.0, 0.005)
    slow = _disagg(slow_link, first_token, specs).requests[0].timeline
    transfer_s = kv_bytes(3000) / 2e9 + 0.005
    waits = 0 if first_token == "decode" else 1  # which token waits for the KV
    assert slow.token_s[waits] - fast.token_s[waits] == pytest.approx(transfer_s)
    if waits:
        assert slow.token_s[0] == fast.token_s[0]  # the prefill's token is not delayed
    # Everything after moves by the same amount; every token arrives.
    assert slow.token_s[-1] - fast.token_s[-1] == pytest.approx(transfer_s)
    assert len(slow.token_s) == len(fast.token_s) == 20


def test_the_link_is_a_queue() -> None:
    """Two prefills that end in the same step: the second KV waits for the first to cross."""
    specs = [SimRequest(prompt(i, 1000), 10) for i in range(2)]
    result = _disagg(KVLink(1.0), "prefill", specs)
    first, second = result.transfers
    assert first.ready_s == second.ready_s and first.queue_s == 0
    assert second.queue_s == pytest.approx(kv_bytes(1000) / 1e9)
    assert result.link_bytes == pytest.approx(2 * kv_bytes(1000))


def test_a_one_token_request_never_crosses_the_link() -> None:
    result = _disagg(KVLink(10.0), "prefill", [SimRequest(prompt(0, 500), 1)])
    assert result.transfers == [] and result.requests[0].timeline.finish_reason == "length"


def test_a_small_decode_pool_preempts_and_still_conserves() -> None:
    specs = [SimRequest(prompt(i, 200), 300, i * 0.001) for i in range(16)]
    result = _disagg(KVLink(100.0), "decode", specs, decode_blocks=120)  # 1,920 slots
    decode = result.workers[1]
    assert sum(s.num_preempted for s in decode.steps) > 0
    assert all(len(r.output_token_ids) == 300 for r in result.requests)
    assert decode.sim.pool.num_used_blocks == 0


def test_conservation_catches_a_leaked_block() -> None:
    specs = [SimRequest(prompt(0, 100), 5)]
    cluster = Cluster([worker()], "round-robin")
    result = cluster.run(specs)
    leaked = result.workers[0].sim.pool.allocate(1)  # a block nobody will free
    with pytest.raises(ConservationError, match="blocks"):
        cluster.check_conservation(specs, result)
    result.workers[0].sim.pool.free(leaked)
    cluster.check_conservation(specs, result)
    result.requests[0].output_token_ids.pop()
    with pytest.raises(ConservationError, match="4 of 5"):
        cluster.check_conservation(specs, result)


def test_conservation_catches_unaccounted_link_bytes() -> None:
    specs = [SimRequest(prompt(0, 100), 5)]
    cluster = Cluster([worker()], "round-robin", [worker()], KVLink(10.0), kv_bytes)
    result = cluster.run(specs)
    result.link_bytes += 1
    with pytest.raises(ConservationError, match="link carried"):
        cluster.check_conservation(specs, result)


# --- the command ---------------------------------------------------------------------------


def test_disaggregated_run_writes_link_and_pool_figures(tmp_path) -> None:
    path, html = tmp_path / "d.json", tmp_path / "d.html"
    result = CliRunner().invoke(
        app,
        [
            "simulate", "--disaggregate", "1:2", "--num-prompts", "60", "--request-rate", "20",
            "--input-len", "500-1500", "--prefill-args", "max-num-batched-tokens=8192",
            "--decode-args", "tp=2,max-num-seqs=128", "--kv-link-gb-s", "20",
            "--save-result", str(path), "--report", str(html),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "KV link 20 GB/s" in result.output
    data = json.loads(path.read_text())
    cl = data["cluster"]
    assert cl["mode"] == "disaggregated" and cl["gpus"] == 1 + 2 * 2
    assert cl["pools"]["prefill"]["max_num_batched_tokens"] == 8192
    assert cl["pools"]["decode"]["tensor_parallel_size"] == 2
    assert cl["pools"]["decode"]["max_num_seqs"] == 128
    assert cl["link"]["transfers"] == data["completed"] == 60
    assert 0 < cl["link"]["utilization"] < 1
    assert cl["link"]["transfer_ms"]["p50"] >= cl["link"]["latency_ms"]
    assert "KV link" in html.read_text() and "<img" in html.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disaggregate", "3:2", "--gpus", "4"], "not --gpus 4"),
        (["--tensor-parallel-size", "3", "--gpus", "8"], "does not divide --gpus 8"),
        (["--tensor-parallel-size", "3"], "does not divide"),
        (["--disaggregate", "2"], "P:D"),
        (["--disaggregate", "1:1", "--kv-link-gb-s", "0"], "--kv-link-gb-s"),
        (
            [
                "--model",
                "llama-3.1-70b",
                "--disaggregate",
                "1:1",
                "--prefill-args",
                "tp=4",
                "--decode-args",
                "tp=1",
            ],
            "decode pool: llama-3.1-70b does not fit",
        ),
        (["--replicas", "2", "--router", "random"], "--router"),
        (["--prefill-device", "h100-sxm"], "need --disaggregate"),
        (["--disaggregate", "1:1", "--decode-args", "tp"], "key=value"),
        (["--disaggregate", "1:1", "--first-token", "proxy"], "--first-token"),
        (["--replicas", "2", "--calibrate", "probe.json"], "simulate one replica"),
        (["--replicas", "2", "--find-capacity", "--slo", "p99_ttft=1s"], "simulate one replica"),
    ],
)
def test_cluster_bad_input_exits_2_with_one_line(args, message) -> None:
    result = CliRunner().invoke(app, ["simulate", "--num-prompts", "4", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_pool_args_parse() -> None:
    args = PoolArgs.parse("device=h200,tp=2,max-num-seqs=512", "--decode-args")
    assert args == PoolArgs(device="h200", tensor_parallel_size=2, max_num_seqs=512)


# --- the capacity plan ---------------------------------------------------------------------


def test_pareto_keeps_only_points_nothing_beats_on_both_axes() -> None:
    from pdscope.commands.capacity import pareto

    points = [(10, 100, "a"), (20, 50, "b"), (15, 40, "c"), (5, 120, "d"), (20, 30, "e")]
    assert [p[2] for p in pareto(points)] == ["b", "a", "d"]


def test_candidates_cover_colocated_and_split_shapes_at_their_smallest() -> None:
    from pdscope.commands.capacity import candidates

    c = ClusterSettings(SimulateSettings(model="llama-3.1-8b"))
    cands = candidates(c, 8, (2048,), (1, 2))
    colocated = [x for x in cands if x.kind == "colocated"]
    assert [(x.label, x.scale) for x in colocated] == [
        ("8 x TP1, budget 2048", 8),
        ("4 x TP2, budget 2048", 4),
    ]
    split = {x.label: x for x in cands if x.kind == "disaggregated"}
    four_four = split["4P x TP1 : 4D x TP1"]
    # Four copies of a 1:1 unit, each run with the whole link (the others' KV queued on it).
    assert four_four.settings.disaggregate == "1:1" and four_four.scale == 4
    assert four_four.settings.kv_link_gb_s == c.kv_link_gb_s
    whole = {x.label: x for x in candidates(c, 8, (2048,), (1, 2), whole_splits=True)}
    assert whole["4P x TP1 : 4D x TP1"].settings.disaggregate == "4:4"
    assert whole["4P x TP1 : 4D x TP1"].scale == 1
    assert all(x.gpus == 8 for x in cands)


@pytest.mark.slow  # ~20 simulated runs: 15-35 s on 2 shared cores
def test_plan_capacity_finds_a_winner_within_the_slo(tmp_path) -> None:
    from pdscope.commands.capacity import plan_capacity, plot_plan

    base = SimulateSettings(num_prompts=20, input_len="200-600", output_len="10-30")
    plan = plan_capacity(
        ClusterSettings(base), 2, "ttft_p99=500ms,p99_itl=60ms", budgets=(2048,),
        tp_sizes=(1,), processes=1, horizon_s=1.0,
    )  # fmt: skip
    assert plan["searched"] == 2  # 2 x TP1, and 1P : 1D
    winner = plan["winner"]
    assert winner is not None and winner["req_s_per_gpu"] > 0
    # The capacity is a rate that met the SLO, and twice it... did not (or the search ran out).
    best = max((r for r in winner["runs"] if r["meets"]), key=lambda r: r["rate"])
    assert best["summary"]["p99_ttft_ms"] <= 500 and best["summary"]["p99_itl_ms"] <= 60
    assert any(not r["meets"] for r in winner["runs"])
    assert plan["frontier"] and plan["margin_over_other_kind"] is not None
    plot_plan(plan, tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 1000


def test_plan_capacity_needs_gpus_and_an_slo() -> None:
    result = CliRunner().invoke(app, ["simulate", "--plan-capacity", "--slo", "p99_ttft=1s"])
    assert result.exit_code == 2 and "--plan-capacity needs --gpus" in result.output
    result = CliRunner().invoke(app, ["simulate", "--plan-capacity", "--gpus", "2"])
    assert result.exit_code == 2 and "needs --slo" in result.output
    args = ["simulate", "--plan-capacity", "--gpus", "2", "--slo", "p99_ttft=1s"]
    result = CliRunner().invoke(app, [*args, "--plan-tp", "1,x"])
    assert result.exit_code == 2 and "--plan-tp takes comma-separated integers" in result.output


def test_plan_capacity_without_a_model_plans_simulates_default() -> None:
    from pdscope.commands.capacity import plan_capacity

    # TP 2 on one GPU leaves no configuration: the refusal names the model planned for.
    with pytest.raises(SpecError, match="no configuration of 8b fits 1 GPUs"):
        plan_capacity(ClusterSettings(SimulateSettings()), 1, "p99_ttft=1s", tp_sizes=(2,))


def test_pools_may_run_on_different_devices() -> None:
    base = SimulateSettings(num_prompts=20, request_rate=10, input_len="500")
    c = ClusterSettings(
        base,
        disaggregate="1:2",
        prefill=PoolArgs(device="h200"),
        decode=PoolArgs(device="a100-80gb-sxm", max_num_seqs=32),
    )
    r = simulate_cluster(c)
    pools = r["cluster"]["pools"]
    assert pools["prefill"]["device"] == "h200" and pools["decode"]["device"] == "a100-80gb-sxm"
    # Each pool prices its steps with its own device's figures.
    assert pools["prefill"]["cost_params"]["bandwidth_gb_s"] == pytest.approx(4800 * 0.8)
    assert pools["decode"]["cost_params"]["bandwidth_gb_s"] == pytest.approx(2039 * 0.8)
    assert r["completed"] == 20 and pools["decode"]["max_num_seqs"] == 32
