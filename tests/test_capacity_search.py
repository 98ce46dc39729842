"""The capacity plan's shortcuts against the search they shorten, on small real simulations:
the floor a configuration must beat, the KV link's bound on a split, one replica standing in
for R behind a round-robin router. No torch."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from pdscope.cli import app
from pdscope.commands.capacity import (
    POOL_BOUND_SLACK,
    Candidate,
    candidates,
    link_bound_req_s,
    parse_plan_slo,
    plan_capacity,
    render_plan,
    search,
    split_bound_req_s,
)
from pdscope.commands.cluster import ClusterSettings, simulate_cluster
from pdscope.commands.simulate import SimulateSettings
from pdscope.roofline import arithmetic as rf
from pdscope.specs import SpecError, get_kv_precision, load_model

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
    # 2 colocated; 1:3, 2:2 and 3:1, less what the pools' bound leaves out of the fast plan.
    left_out = [p for p in fast["pruned"] if p["by"] == "pools"]
    assert full["searched"] == 5 and fast["searched"] == 5 - len(left_out)
    assert not full["not_bisected"] and not full["pruned"] and not full["confirmed_whole"]
    searched = {f["label"]: f for f in full["configurations"]}
    for p in left_out:
        assert searched[p["label"]]["req_s_per_gpu"] <= p["bound_req_s_per_gpu"]
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


def test_a_split_with_a_common_divisor_is_searched_as_copies_of_its_unit() -> None:
    cands = candidates(ClusterSettings(TINY), 8, (2048,), (1, 2))
    split = {x.label: x for x in cands if x.kind == "disaggregated"}
    four = split["4P x TP1 : 4D x TP1"]
    assert (four.scale, four.settings.disaggregate, four.gpus) == (4, "1:1", 8)
    six = split["6P x TP1 : 2D x TP1"]
    assert (six.scale, six.settings.disaggregate) == (2, "3:1")
    mixed = split["4P x TP1 : 2D x TP2"]
    assert (mixed.scale, mixed.settings.disaggregate) == (2, "2:1")
    # No common divisor: the split runs whole.
    whole = split["3P x TP1 : 5D x TP1"]
    assert (whole.scale, whole.settings.disaggregate) == (1, "3:5")
    # Every unit times its copies uses the GPUs of the split it stands for.
    for x in split.values():
        p, d = x.settings.split()  # type: ignore[misc]
        tp_p = x.settings.prefill.tensor_parallel_size
        tp_d = x.settings.decode.tensor_parallel_size
        assert x.scale * (p * tp_p + d * tp_d) == 8


# A link slow enough to be most of a split's limit: 2 GB/s carries ~76 requests/s of these
# prompts' KV (200 tokens on average, 26 MB), so at 55 requests/s it is ~70% busy.
SLOW_LINK_GB_S = 2.0


def _link_run(split: str, rate: float, copies: int = 1, seconds: float = 8.0) -> dict:
    base = replace(TINY, request_rate=rate, num_prompts=int(rate * seconds))
    c = ClusterSettings(base, disaggregate=split, kv_link_gb_s=SLOW_LINK_GB_S)
    return simulate_cluster(c, link_copies=copies)


def test_one_unit_with_the_other_copies_traffic_sees_the_whole_splits_link() -> None:
    """4P:4D at 55 requests/s against one 1P:1D unit at 55/4 with the other three units'
    transfers on its link. The link's utilization agrees within 10%, its mean queueing within
    40% (about 440 transfers of an M/G/1-like queue at 70% load: the copies' arrivals are
    fresh draws, not the full run's, so the mean wait differs by sampling alone by ~20%);
    the request throughput of the four copies within 5%. Without the others' traffic the unit's
    link is a quarter as busy and its queue nearly empty: that is the error the cross traffic
    removes."""
    full = _link_run("4:4", 55)
    unit = _link_run("1:1", 55 / 4, copies=4)
    bare = _link_run("1:1", 55 / 4)
    lf, lu, lb = (r["cluster"]["link"] for r in (full, unit, bare))
    assert lu["shared_with_copies"] == 3 and "shared_with_copies" not in lb
    assert lu["cross_traffic_transfers"] > 2 * lu["transfers"]
    assert lu["utilization"] == pytest.approx(lf["utilization"], rel=0.10)
    assert lu["queue_ms"]["mean"] == pytest.approx(lf["queue_ms"]["mean"], rel=0.40)
    assert 4 * unit["request_throughput"] == pytest.approx(full["request_throughput"], rel=0.05)
    assert lb["utilization"] < 0.4 * lf["utilization"]
    assert lb["queue_ms"]["mean"] < 0.25 * lf["queue_ms"]["mean"]
    # The unit's own bytes still balance (conservation is checked inside the run), and the
    # others' are counted apart.
    assert lu["cross_traffic_bytes"] > 0 and lu["bytes"] < lu["cross_traffic_bytes"]


@pytest.mark.slow  # three capacity searches of a 4P:4D split: ~15 s on 2 shared cores
def test_a_splits_unit_finds_the_capacity_of_the_whole_split() -> None:
    """Where the shared link limits the split, one unit with the others' traffic finds the
    whole split's capacity within 25% (the resolution of 1/8 plus sampling: each search's
    runs draw their own requests, and at capacity the p99 ITL moves steeply with the link's
    load); the unit alone, with the link to itself, finds about four times as much."""
    slo = parse_plan_slo("p99_ttft=150ms,p99_itl=60ms")
    c = ClusterSettings(TINY, kv_link_gb_s=SLOW_LINK_GB_S)
    (unit,) = [x for x in candidates(c, 8, (2048,), (1,)) if x.label == "4P x TP1 : 4D x TP1"]
    whole = replace(unit, settings=replace(unit.settings, disaggregate="4:4"), scale=1)
    a, b = search(unit, slo, 4.0), search(whole, slo, 4.0)
    assert b["capacity_req_s"] > 0
    assert a["capacity_req_s"] == pytest.approx(b["capacity_req_s"], rel=0.25)
    alone = simulate_cluster(
        replace(unit.settings, base=replace(TINY, request_rate=3 * b["capacity_req_s"] / 4,
                                            num_prompts=int(3 * b["capacity_req_s"]))),
    )  # fmt: skip
    # At three times the whole split's capacity, the unit alone still meets the SLO.
    assert slo.met_by_run(alone)


def test_the_best_split_run_as_units_is_confirmed_whole() -> None:
    """At 6 GPUs the best split, 4P:2D, runs as two copies of a 2:1 unit; the plan then
    searches it whole from the unit's capacity up, and what it reports (capacity, winner,
    margin) is that whole search's figure, the same as a search that never stops a run early
    gives from the same start; the unit's estimate is kept beside it. 3P:3D (three 1:1
    units) is within 25% of the best per-GPU goodput, so it is confirmed too."""
    kwargs = dict(budgets=(2048,), tp_sizes=(1,), processes=1, horizon_s=HORIZON_S)
    c = ClusterSettings(TINY)
    plan = plan_capacity(c, 6, SLO_TEXT, **kwargs)  # type: ignore[arg-type]
    confirmed = {w["label"]: w for w in plan["confirmed_whole"]}
    assert set(confirmed) == {"4P x TP1 : 2D x TP1", "3P x TP1 : 3D x TP1"}
    assert confirmed["4P x TP1 : 2D x TP1"]["copies"] == 2
    wholes = {x.label: x for x in candidates(c, 6, (2048,), (1,), whole_splits=True)}
    slo = parse_plan_slo(SLO_TEXT)
    by_label = {f["label"]: f for f in plan["configurations"]}
    for label, w in confirmed.items():
        whole = wholes[label]
        p, d = (side.split("P")[0].split("D")[0] for side in label.split(" x TP1 : "))
        assert whole.scale == 1 and whole.settings.disaggregate == f"{p}:{d}"
        f = by_label[label]
        assert f["confirmed_whole"] and f["capacity_req_s"] == w["capacity_req_s"] > 0
        assert f["unit_capacity_req_s"] == w["unit_capacity_req_s"] > 0
        # The whole search starts at the unit's capacity: the unit errs low, so it meets it.
        assert f["runs"][0]["rate"] == w["unit_capacity_req_s"] and f["runs"][0]["meets"]
        assert f["unit_runs"] and all(r["rate"] != 0 for r in f["unit_runs"])
    # The same whole split searched from the same start without early stops (as
    # --plan-exhaustive runs it): the same runs, so the same capacity.
    best_split = plan["top"]["disaggregated"][0]
    w = confirmed[best_split["label"]]
    whole = wholes[best_split["label"]]
    ref = search(whole, slo, HORIZON_S, floor_rate=w["unit_capacity_req_s"], exhaustive=True)
    assert best_split["capacity_req_s"] == ref["capacity_req_s"] > w["unit_capacity_req_s"]
    assert best_split["req_s_per_gpu"] == pytest.approx(ref["req_s_per_gpu"])
    # The verdict reads the confirmed figures.
    assert best_split["label"] == "4P x TP1 : 2D x TP1" and best_split.get("confirmed_whole")
    rival = plan["top"]["colocated"][0]
    assert plan["winner"]["label"] == best_split["label"]
    assert plan["margin_over_other_kind"] == pytest.approx(
        best_split["req_s_per_gpu"] / rival["req_s_per_gpu"]
    )
    assert any(p["run"].startswith(best_split["label"]) for p in plan["frontier"])
    assert "confirmed whole: 4P x TP1 : 2D x TP1" in "\n".join(render_plan(plan))


@pytest.mark.parametrize(
    ("input_len", "output_len", "prompts", "limit"),
    [("1500-2500", "2-4", 80, "prefill"), ("50-100", "200-300", 500, "decode")],
)
def test_the_pools_bound_holds_for_a_saturated_split(
    input_len: str, output_len: str, prompts: int, limit: str
) -> None:
    """Offered three times the bound, a real 1P:1D run completes no more requests per second
    than the pools' bound and most of it: a prefill-heavy workload is held by its prefill
    worker, a decode-heavy one by its decode worker (enough requests to fill its 256 slots
    for most of the run)."""
    base = replace(TINY, input_len=input_len, output_len=output_len, num_prompts=prompts)
    c = ClusterSettings(base, disaggregate="1:1", kv_link_gb_s=1e4)
    cand = Candidate("disaggregated", "1P x TP1 : 1D x TP1", c, 1, 2)
    bound = split_bound_req_s(c, cand, {})
    assert bound is not None and bound[1] == f"1 {limit} workers"
    r = simulate_cluster(replace(c, base=replace(base, request_rate=3 * bound[0])))
    assert 0.6 * bound[0] < r["request_throughput"] <= bound[0] / POOL_BOUND_SLACK * 1.05
    # Lengths drawn from a normal distribution take no bound.
    normal = replace(c, base=replace(base, output_len="normal:100:10"))
    assert split_bound_req_s(normal, replace(cand, settings=normal), {}) is None


@pytest.mark.slow  # two plans of 4 configurations: ~45 s on 2 shared cores
def test_the_pools_bound_never_drops_the_winner_of_an_exhaustive_search() -> None:
    """On a small grid where the bound leaves splits out, the plan with it finds the same
    winner, the same best split at the same capacity, so the same margin, as the exhaustive
    search; every split left out meets, searched, less than its bound and less than the best
    split."""
    base = replace(TINY, input_len="1000-2000", output_len="2-8")
    kwargs = dict(budgets=(2048,), tp_sizes=(1,), processes=1, horizon_s=HORIZON_S)
    c = ClusterSettings(base)
    slo = "p99_ttft=400ms,p99_itl=30ms"
    fast = plan_capacity(c, 4, slo, **kwargs)  # type: ignore[arg-type]
    full = plan_capacity(c, 4, slo, exhaustive=True, **kwargs)  # type: ignore[arg-type]
    left_out = [p for p in fast["pruned"] if p["by"] == "pools"]
    assert left_out, "the grid must exercise the bound"
    assert full["searched"] == 4 and not full["pruned"]
    assert fast["winner"]["label"] == full["winner"]["label"]
    for kind in ("colocated", "disaggregated"):
        assert fast["top"][kind][0]["label"] == full["top"][kind][0]["label"]
    assert fast["margin_over_other_kind"] == pytest.approx(
        full["margin_over_other_kind"], rel=RESOLUTION
    )
    searched = {f["label"]: f for f in full["configurations"]}
    best_split = full["top"]["disaggregated"][0]["req_s_per_gpu"]
    for p in left_out:
        f = searched[p["label"]]
        assert f["req_s_per_gpu"] <= p["bound_req_s_per_gpu"] < p["best_req_s_per_gpu"]
        assert f["req_s_per_gpu"] < best_split
    text = "\n".join(render_plan(fast))
    assert f"not simulated: {len(left_out)} splits whose pools" in text


def test_a_search_below_a_known_failure_ends_where_the_search_from_the_bottom_does() -> None:
    """Told a rate it fails at (a whole split that missed its unit's capacity), the search
    starts at the grid rate below it instead of the bottom: the same bracket, so the same
    capacity, from a subset of its runs."""
    slo = parse_plan_slo(SLO_TEXT)
    cand = colocated(2)
    full = search(cand, slo, HORIZON_S)
    failing = [r["rate"] for r in full["runs"] if not r["meets"]]
    assert failing and full["capacity_req_s"] > 0
    for fails_at in (min(failing), max(failing)):
        short = search(cand, slo, HORIZON_S, fails_at=fails_at)
        assert short["capacity_req_s"] == full["capacity_req_s"]
        assert short["req_s_per_gpu"] == pytest.approx(full["req_s_per_gpu"])
        # The same path's tail: every rate it runs, the search from the bottom ran too.
        assert {r["rate"] for r in short["runs"]} < {r["rate"] for r in full["runs"]}


def test_a_split_whose_pool_does_not_fit_takes_no_bound() -> None:
    """The bound is skipped, not raised: the split's own search reports why it cannot run."""
    base = replace(TINY, model="llama-3.1-70b")
    c = ClusterSettings(base, disaggregate="1:1")
    assert split_bound_req_s(c, Candidate("disaggregated", "1:1", c, 1, 2), {}) is None
    with pytest.raises(SpecError, match="does not fit"):
        simulate_cluster(c)
