"""The capacity plan's shortcuts against the search they shorten, on small real simulations:
the floor a configuration must beat, the KV link's bound on a split, one replica standing in
for R behind a round-robin router. No torch."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from pdscope.cli import app
from pdscope.commands.capacity import (
    Candidate,
    candidates,
    link_bound_req_s,
    parse_plan_slo,
    plan_capacity,
    search,
)
from pdscope.commands.cluster import ClusterSettings, simulate_cluster
from pdscope.commands.simulate import SimulateSettings
from pdscope.roofline import arithmetic as rf
from pdscope.specs import get_kv_precision, load_model

# Short prompts and outputs, a short horizon: each run simulates tens to a few hundred requests.
TINY = SimulateSettings(
    model="llama-3.1-8b", device="h100-sxm", input_len="100-300", output_len="10-30",
    num_prompts=10,
)  # fmt: skip
SLO_TEXT = "p99_ttft=150ms,p99_itl=30ms"
HORIZON_S = 0.5
# Bisection's resolution: the last bracket is 1/16 of a doubling, so two searches of the same
# configuration that start from different rates agree within about 1/8 of the capacity.
RESOLUTION = 1 / 8


def colocated(gpus: int, budget: int = 2048) -> Candidate:
    (cand,) = [x for x in candidates(ClusterSettings(TINY), gpus, (budget,), (1,))
               if x.kind == "colocated"]  # fmt: skip
    return cand


def test_a_configuration_that_fails_below_the_floor_is_not_bisected() -> None:
    slo = parse_plan_slo(SLO_TEXT)
    cand = colocated(1)
    full = search(cand, slo, HORIZON_S)
    capacity = full["capacity_req_s"]
    assert capacity > 0 and full["below_floor"] is None
    # A floor it cannot reach: the search stops at the first failure, never above the floor.
    floor = capacity * 1.5
    short = search(cand, slo, HORIZON_S, floor_rate=floor)
    assert short["below_floor"] is not None and short["below_floor"] <= floor
    assert max(r["rate"] for r in short["runs"]) <= floor
    assert not any(r["meets"] for r in short["runs"] if r["rate"] == short["below_floor"])
    assert short["capacity_req_s"] <= capacity
    assert len(short["runs"]) < len(full["runs"])
    # A floor it beats: tested on the way up, then searched in full to the same capacity.
    low = search(cand, slo, HORIZON_S, floor_rate=capacity / 3)
    assert low["below_floor"] is None
    assert any(r["rate"] == capacity / 3 and r["meets"] for r in low["runs"])
    assert low["capacity_req_s"] == pytest.approx(capacity, rel=RESOLUTION)


@pytest.mark.slow  # two plans of 5 configurations: ~35 s on 2 shared cores
def test_the_shortcuts_keep_the_winner_of_an_exhaustive_search() -> None:
    kwargs = dict(budgets=(256, 4096), tp_sizes=(1,), processes=1, horizon_s=HORIZON_S)
    c = ClusterSettings(TINY)
    fast = plan_capacity(c, 4, SLO_TEXT, **kwargs)  # type: ignore[arg-type]
    full = plan_capacity(c, 4, SLO_TEXT, exhaustive=True, **kwargs)  # type: ignore[arg-type]
    assert full["searched"] == fast["searched"] == 5  # 2 colocated; 1:3, 2:2 and 3:1
    assert not full["not_bisected"] and not full["pruned"]
    assert fast["simulated_requests"] < full["simulated_requests"]
    assert fast["winner"]["label"] == full["winner"]["label"]
    assert fast["winner"]["capacity_req_s"] == pytest.approx(
        full["winner"]["capacity_req_s"], rel=RESOLUTION
    )
    # The best of each kind is the same configuration, so the margin is read off the same pair.
    for kind in ("colocated", "disaggregated"):
        assert fast["top"][kind][0]["label"] == full["top"][kind][0]["label"]
    # Whatever was not bisected failed at a rate the best of its kind had met.
    best = {k: rows[0]["capacity_req_s"] for k, rows in fast["top"].items()}
    for f in fast["configurations"]:
        if f["below_floor"] is not None:
            assert f["below_floor"] <= best[f["kind"]]


def test_the_link_bound_holds_and_prunes_splits_it_rules_out() -> None:
    base = replace(TINY, input_len="100-150")
    slow = ClusterSettings(base, disaggregate="1:1", kv_link_gb_s=0.05)
    bound = link_bound_req_s(slow)
    assert bound is not None
    kv_100 = rf.kv_bytes_at_context(load_model("llama-3.1-8b"), get_kv_precision("bf16"), 100)
    assert bound == (pytest.approx(0.05e9 / kv_100), 100)
    # Offered three times the bound, a real run completes no more than the bound, and nearly
    # that much (the link is the bottleneck; prompts average 125 tokens, not 100).
    r = simulate_cluster(
        replace(slow, base=replace(base, request_rate=3 * bound[0], num_prompts=60))
    )
    assert 0.6 * bound[0] < r["request_throughput"] <= bound[0]

    kwargs = dict(budgets=(2048,), tp_sizes=(1,), processes=1, horizon_s=HORIZON_S)
    plan_c = ClusterSettings(base, kv_link_gb_s=0.05)
    plan = plan_capacity(plan_c, 2, SLO_TEXT, **kwargs)  # type: ignore[arg-type]
    assert [p["label"] for p in plan["pruned"]] == ["1P x TP1 : 1D x TP1"]
    assert "KV link carries at most" in plan["pruned"][0]["reason"]
    assert plan["searched"] == 1 and plan["winner"]["kind"] == "colocated"
    full = plan_capacity(plan_c, 2, SLO_TEXT, exhaustive=True, **kwargs)  # type: ignore[arg-type]
    (split,) = full["top"]["disaggregated"]
    assert split["req_s_per_gpu"] <= bound[0] / 2 < full["winner"]["req_s_per_gpu"]


def test_one_replica_at_a_quarter_of_the_rate_stands_in_for_four_behind_round_robin() -> None:
    slo = parse_plan_slo(SLO_TEXT)
    scaled = colocated(4)
    assert scaled.scale == 4 and scaled.settings.replicas == 1
    whole = replace(scaled, settings=replace(scaled.settings, replicas=4), scale=1)
    a, b = search(scaled, slo, HORIZON_S), search(whole, slo, HORIZON_S)
    assert a["capacity_req_s"] == pytest.approx(b["capacity_req_s"], rel=RESOLUTION)
    assert a["req_s_per_gpu"] == pytest.approx(b["req_s_per_gpu"], rel=RESOLUTION)


def test_plan_exhaustive_flag_reaches_the_search() -> None:
    args = [
        "simulate", "--plan-capacity", "--gpus", "1", "--plan-tp", "1", "--plan-budgets", "2048",
        "--slo", SLO_TEXT, "--input-len", "100-300", "--output-len", "10-30",
        "--num-prompts", "10", "--json",
    ]  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--plan-exhaustive"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["exhaustive"] is True and plan["simulated_runs"] > 0 and not plan["pruned"]


def test_percentile_exceeds_agrees_with_numpy_whatever_the_unknown_values() -> None:
    import random

    import numpy as np

    from pdscope.commands.capacity import _percentile_exceeds

    rng = random.Random(0)
    for _ in range(300):
        n, pct, limit = rng.randint(1, 60), rng.choice((50.0, 90.0, 99.0)), 1.0
        above = rng.randint(0, n)
        if not _percentile_exceeds(above, n, pct):
            continue
        # Certain: with the other values as high as they may be without crossing the limit,
        # and the ones above it barely above, numpy still puts the percentile above the limit.
        values = [limit] * (n - above) + [limit + 1e-9] * above
        assert float(np.percentile(values, pct)) > limit
    # And not claimed early: with one fewer value above the limit, the rest can sit low
    # enough to keep the percentile within it.
    for n in (1, 2, 10, 100, 101, 1000):
        need = next(k for k in range(n + 1) if _percentile_exceeds(k, n, 99))
        assert need >= 1
        values = [0.0] * (n - need + 1) + [1.0 + 1e-9] * (need - 1)
        assert float(np.percentile(values, 99)) <= 1.0


@pytest.mark.parametrize(
    "kind", ["colocated", "split, first token from prefill", "split, from decode"]
)
def test_runs_stopped_early_reach_the_verdicts_full_runs_reach(kind: str) -> None:
    slo = parse_plan_slo(SLO_TEXT)
    if kind == "colocated":
        cand = colocated(1)
    else:
        first = "prefill" if "prefill" in kind else "decode"
        c = ClusterSettings(TINY, first_token=first)
        (cand,) = [x for x in candidates(c, 2, (2048,), (1,)) if x.kind == "disaggregated"]
    full = search(cand, slo, HORIZON_S, exhaustive=True)
    quick = search(cand, slo, HORIZON_S)
    assert [(r["rate"], r["meets"]) for r in quick["runs"]] == [
        (r["rate"], r["meets"]) for r in full["runs"]
    ]
    assert quick["capacity_req_s"] == full["capacity_req_s"]
    stopped = [r for r in quick["runs"] if r.get("stopped")]
    assert stopped and all(not r["meets"] for r in stopped)
    assert not any(r.get("stopped") for r in full["runs"])
