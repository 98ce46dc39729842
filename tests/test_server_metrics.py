"""The server's view of a run from /metrics: parsing, runtime names, histogram quantiles, and the
sampler against httpx mock transports and against a real `pdscope serve`."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from pdscope.analysis.server_metrics import (
    build_report,
    dipped,
    histogram_quantile,
    quantile_edge,
    report_of,
)
from pdscope.client.server_metrics import (
    COUNTER_ROLES,
    HISTOGRAM_ROLES,
    RUNTIME_NAMES,
    MetricsSampler,
    detect_runtime,
    parse_metrics,
    timeline_point,
)
from tests.conftest import Server

INF = math.inf

# --- histogram_quantile: hand-computed values ---------------------------------------------------

# 10 observations: 2 in (0, 0.1], 4 in (0.1, 0.2], 2 in (0.2, 0.4], 2 above 0.4.
BUCKETS = [(0.1, 2.0), (0.2, 6.0), (0.4, 8.0), (INF, 10.0)]


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.1, 0.05),  # rank 1 of 2 in the first bucket, whose lower bound is 0
        (0.5, 0.175),  # rank 5: 3rd of 4 in (0.1, 0.2] -> 0.1 + 0.1 * 3/4
        (0.75, 0.35),  # rank 7.5: 1.5th of 2 in (0.2, 0.4] -> 0.2 + 0.2 * 1.5/2
        (0.8, 0.4),  # rank 8: exactly the top of (0.2, 0.4]
        (0.9, 0.4),  # rank 9 lies in +Inf: the largest finite bound
        (1.0, 0.4),
    ],
)
def test_histogram_quantile_hand_computed(q: float, expected: float) -> None:
    assert histogram_quantile(q, BUCKETS) == pytest.approx(expected)


def test_histogram_quantile_orders_merges_and_forces_monotonic() -> None:
    shuffled = [(INF, 10.0), (0.4, 8.0), (0.1, 1.0), (0.2, 6.0), (0.1, 1.0)]  # 0.1 split in two
    assert histogram_quantile(0.5, shuffled) == pytest.approx(0.175)
    # A dip in cumulative counts (non-atomic scrape) is lifted to the running maximum: 3, 3, 4.
    assert histogram_quantile(0.5, [(0.1, 3.0), (0.2, 2.0), (INF, 4.0)]) == pytest.approx(0.2 / 3)


def test_histogram_quantile_empty_and_degenerate() -> None:
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(0.1, 0.0), (0.2, 0.0), (INF, 0.0)]) is None  # no data
    assert histogram_quantile(0.5, [(0.1, 1.0), (0.2, 2.0)]) is None  # no +Inf bucket
    assert histogram_quantile(0.5, [(INF, 5.0)]) is None  # fewer than two buckets
    # All observations above the last finite bound: that bound, as Prometheus answers.
    assert histogram_quantile(0.5, [(0.1, 0.0), (0.2, 0.0), (INF, 3.0)]) == 0.2
    # A first bound <= 0 is returned as is; q = 0 with an empty first bucket gives its start.
    assert histogram_quantile(0.25, [(0.0, 2.0), (1.0, 4.0), (INF, 4.0)]) == 0.0
    assert histogram_quantile(0.0, [(0.1, 0.0), (0.2, 4.0), (INF, 4.0)]) == 0.0
    with pytest.raises(ValueError):
        histogram_quantile(1.5, BUCKETS)


def test_a_quantile_in_the_first_or_the_last_bucket_is_known_only_by_its_bound() -> None:
    # Rank 1 of 10 lies in (0, 0.1]: Prometheus interpolates 0.05; all that is known is < 0.1.
    assert quantile_edge(0.1, BUCKETS) == ("below", 0.1)
    assert quantile_edge(0.5, BUCKETS) is None  # between two bounds: interpolated as usual
    assert quantile_edge(0.9, BUCKETS) == ("above", 0.4)  # rank 9 in +Inf
    assert quantile_edge(0.5, [(0.0, 2.0), (1.0, 4.0), (INF, 4.0)]) is None  # a bound of 0
    assert quantile_edge(0.5, []) is None


# The gauges of a server with nothing to do.
IDLE = {
    "vllm:num_requests_running": 0,
    "vllm:num_requests_waiting": 0,
    "vllm:kv_cache_usage_perc": 0.0,
}


def test_impossible_gauge_readings_are_left_out_with_a_warning() -> None:
    first = parse_metrics(VLLM_TEXT)
    last = parse_metrics(
        vllm_text(**{"vllm:num_requests_waiting": -5, "vllm:kv_cache_usage_perc": 7.0})
    )
    first.t_s, last.t_s = 0.0, 1.0
    runtime = detect_runtime(first)
    assert runtime is not None
    idle = parse_metrics(vllm_text(**IDLE))
    # Two scrapes inside the load, between the idle ones before and after it.
    timeline = [timeline_point(s, runtime, 0.0) for s in (idle, first, last, idle)]
    report = build_report(idle, idle, timeline, runtime)
    assert (report.max_waiting, report.max_kv_usage) == (1.0, 0.25)  # the good scrape's
    text = " ".join(report.warnings)
    assert "vllm:num_requests_waiting read -5: a count of requests is never negative" in text
    assert "vllm:kv_cache_usage_perc read 7: KV usage is a fraction within 0-1" in text
    assert "1 of 2 scrapes left out of its maximum" in text


def test_gauges_are_read_inside_the_load_and_a_short_run_has_none() -> None:
    """The first scrape comes before the first request and the final one after the last
    response: a run shorter than the scrape interval has only those two, idle, and showed
    "running 0  waiting 0  KV use 0%" as its view; its gauges are None now (too short to
    sample) while its counters still cover it. A busy scrape before the load (a previous run
    still draining) is no figure of this run; a failed final scrape leaves the last point
    one taken during the load."""
    idle = parse_metrics(vllm_text(**IDLE))
    done = parse_metrics(vllm_text(**IDLE, **{"vllm:generation_tokens_total": 756}))
    idle.t_s, done.t_s = 0.0, 0.3
    runtime = detect_runtime(idle)
    assert runtime is not None
    short = build_report(
        idle, done, [timeline_point(s, runtime, 0.0) for s in (idle, done)], runtime
    )
    assert short.load_scrapes == 0
    assert (short.max_running, short.max_waiting, short.max_kv_usage) == (None, None, None)
    assert short.deltas["generation_tokens"] == 256.0
    assert short.to_dict()["load_scrapes"] == 0

    busy = parse_metrics(VLLM_TEXT)  # running 3, waiting 1, KV 25%
    leftover = parse_metrics(vllm_text(**{**IDLE, "vllm:num_requests_running": 7}))
    points = [timeline_point(s, runtime, 0.0) for s in (leftover, busy, idle)]
    report = build_report(leftover, idle, points, runtime)
    assert report.load_scrapes == 1
    assert (report.max_running, report.max_waiting, report.max_kv_usage) == (3.0, 1.0, 0.25)

    cut = [timeline_point(s, runtime, 0.0) for s in (idle, busy)]
    failed = build_report(
        idle, busy, cut, runtime, errors=["final scrape: GET x: HTTP 503"], final_failed=True
    )
    assert failed.load_scrapes == 1 and failed.max_running == 3.0
    # No timeline at all: nothing known of the load.
    assert build_report(idle, done, [], runtime).load_scrapes is None


# --- parsing and names --------------------------------------------------------------------------

# A recorded sample of vLLM's /metrics format, cut down (vLLM itself is not run in these tests):
# model_name and engine labels, counters with _total, histograms with _bucket/_sum/_count.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 400.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 1000.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 500.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-0.6B"} 6.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="Qwen/Qwen3-0.6B"} 4.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="Qwen/Qwen3-0.6B"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="Qwen/Qwen3-0.6B"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-0.6B"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.8
"""


def vllm_text(**values: float) -> str:
    """VLLM_TEXT with some sample values replaced: key 'name' or 'name|le' -> value."""
    lines = []
    for line in VLLM_TEXT.splitlines():
        if not line.startswith("#"):
            name = line.split("{")[0]
            le = line.split('le="')[1].split('"')[0] if 'le="' in line else None
            key = f"{name}|{le}" if le else name
            if key in values:
                line = f"{line.rsplit(' ', 1)[0]} {values[key]}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_two_engines_kv_use_is_their_mean_and_their_requests_add_up() -> None:
    """vLLM with data parallelism exports a gauge per engine: the requests add up, but two
    pools each 60% full are 60% full, not 120% (which the plausibility check would then take
    for a broken server)."""
    text = VLLM_TEXT + "".join(
        f'vllm:{name}{{engine="1",model_name="m"}} {value}\n'
        for name, value in (("num_requests_running", 2), ("kv_cache_usage_perc", 0.25))
    )
    snap = parse_metrics(text)
    runtime = detect_runtime(snap)
    assert runtime is not None
    point = timeline_point(snap, runtime, 0.0)
    assert point.running == 5.0  # 3 on engine 0, 2 on engine 1
    assert point.kv_usage == pytest.approx(0.25)  # both at 0.25
    # Two models on one engine: their samples merge into one key (model_name is dropped), and
    # KV use is still their mean, not 0.6 + 0.6.
    two = parse_metrics(
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="a",engine="0"} 0.6\n'
        'vllm:kv_cache_usage_perc{model_name="b",engine="0"} 0.6\n'
    )
    assert two.mean("vllm:kv_cache_usage_perc") == pytest.approx(0.6)


def test_parse_vllm_drops_model_name_and_sums_label_sets() -> None:
    snap = parse_metrics(VLLM_TEXT)
    key = ("vllm:num_requests_running", frozenset({("engine", "0")}))
    assert snap[key] == 3.0  # model_name is not part of the key; other labels are
    assert snap.total("vllm:request_success_total") == 10.0  # stop + length + abort
    assert snap.total("vllm:generation_tokens_total") == 500.0
    assert snap.total("vllm:nonexistent") is None
    assert snap.buckets("vllm:time_to_first_token_seconds") == [
        (0.02, 0.0),
        (0.04, 4.0),
        (0.1, 8.0),
        (INF, 10.0),
    ]
    assert detect_runtime(snap) == "vllm"
    point = timeline_point(snap, "vllm", t0_s=0.0)
    assert (point.running, point.waiting, point.kv_usage) == (3.0, 1.0, 0.25)


def test_samples_of_two_models_add_up() -> None:
    text = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 2
vllm:num_requests_running{model_name="b"} 5
"""
    snap = parse_metrics(text)
    assert len(snap) == 1
    assert snap[("vllm:num_requests_running", frozenset())] == 7.0


def test_report_from_two_recorded_snapshots() -> None:
    first = parse_metrics(VLLM_TEXT)
    first.t_s = 100.0
    # During the run: 8 more TTFT samples, 2 in (0.02, 0.04], 6 in (0.04, 0.1]; more tokens.
    last = parse_metrics(
        vllm_text(
            **{
                "vllm:time_to_first_token_seconds_bucket|0.04": 6,
                "vllm:time_to_first_token_seconds_bucket|0.1": 16,
                "vllm:time_to_first_token_seconds_bucket|+Inf": 18,
                "vllm:time_to_first_token_seconds_count": 18,
                "vllm:time_to_first_token_seconds_sum": 1.2,
                "vllm:prompt_tokens_total": 1800,
                "vllm:prefix_cache_queries_total": 1800,
                "vllm:prefix_cache_hits_total": 600,
                "vllm:generation_tokens_total": 756,
                "vllm:num_requests_running": 0,
                "vllm:num_requests_waiting": 0,
                "vllm:kv_cache_usage_perc": 0.0,
            }
        )
    )
    last.t_s = 102.5
    runtime = detect_runtime(first)
    assert runtime is not None
    during = parse_metrics(VLLM_TEXT)  # a scrape inside the load
    during.t_s = 101.0
    timeline = [timeline_point(s, runtime, first.t_s) for s in (first, during, last)]
    report = build_report(first, last, timeline, runtime)
    assert report.duration_s == 2.5
    assert [p.t_s for p in timeline] == [0.0, 1.0, 2.5]
    assert report.load_scrapes == 1
    assert report.deltas == {
        "prefix_hits": 200.0,
        "prefix_queries": 800.0,
        "preemptions": 0.0,
        "prompt_tokens": 800.0,
        "generation_tokens": 256.0,
    }
    assert report.prefix_hit_rate == 0.25
    assert (report.max_running, report.max_waiting, report.max_kv_usage) == (3.0, 1.0, 0.25)
    ttft = report.histograms["ttft"]
    assert ttft is not None and ttft.count == 8
    assert ttft.mean_ms == pytest.approx(400 / 8)  # Δsum 0.4 s over 8
    # Run-only buckets: 2 in (0.02, 0.04], 6 in (0.04, 0.1]. p50: rank 4 -> 0.04 + 0.06 * 2/6.
    assert ttft.p50_ms == pytest.approx(60.0)
    assert ttft.p90_ms == pytest.approx(40 + 60 * 5.2 / 6)  # rank 7.2
    assert ttft.p99_ms == pytest.approx(40 + 60 * 5.92 / 6)
    assert ttft.max_bound_ms == pytest.approx(100.0)
    # Not in the recorded text: absent roles read None, not 0.
    assert report.histograms["itl"] is None and report.histograms["e2e"] is None
    json.dumps(report.to_dict())  # JSON-ready


def test_a_restart_between_scrapes_shows_no_delta_and_a_dipping_histogram_is_named() -> None:
    """A server restarted between the first and last scrape whose counters have passed their
    old values gave deltas of two processes as the run's (nothing read backwards); its process
    start time now shows it. Buckets that dip below a lower bucket are named (Prometheus fixes
    them silently)."""
    start = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}\n"
    first = parse_metrics(VLLM_TEXT + start.format(1.7e9))
    grown = vllm_text(**{"vllm:generation_tokens_total": 5000, "vllm:prompt_tokens_total": 9000})
    runtime = detect_runtime(first)
    assert runtime is not None
    same = build_report(first, parse_metrics(grown + start.format(1.7e9)), [], runtime)
    assert same.deltas["generation_tokens"] is not None and not same.warnings
    after = parse_metrics(grown + start.format(1.7e9 + 60))
    timeline = [timeline_point(x, runtime, first.t_s) for x in (first, after, after)]
    moved = build_report(first, after, timeline, runtime)
    assert all(v is None for v in moved.deltas.values())
    assert all(v is None for v in moved.histograms.values())
    assert moved.max_running == 3.0  # gauges are read scrape by scrape: still figures
    assert moved.warnings == [
        "the server restarted (process_start_time_seconds moved by +60 s): no counter or "
        "histogram of the run is shown"
    ]
    # 0.04's count below 0.02's: a dip of 3, and the report says so.
    assert dipped([(0.02, 5.0), (0.04, 2.0), (0.1, 9.0), (math.inf, 9.0)]) == 3.0
    assert dipped([(0.02, 5.0), (math.inf, 9.0)]) == 0.0
    ttft = "vllm:time_to_first_token_seconds_bucket|"
    dips = vllm_text(**{f"{ttft}0.04": 0, f"{ttft}0.1": 20, f"{ttft}+Inf": 20})
    bad = build_report(first, parse_metrics(dips), [], runtime)
    assert any("buckets are not cumulative" in w for w in bad.warnings), bad.warnings


def test_older_vllm_names_are_used_and_newer_preferred() -> None:
    old = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="m"} 1.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 1.0
vllm:time_per_output_token_seconds_count{model_name="m"} 1.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.005
"""
    snap = parse_metrics(old)
    assert timeline_point(snap, "vllm", 0.0).kv_usage == 0.5
    report = build_report(parse_metrics(""), snap, [], "vllm")
    assert report.names["itl"] == "vllm:time_per_output_token_seconds"
    assert report.histograms["itl"] is not None and report.histograms["itl"].count == 1
    both = (
        old
        + '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
    )
    assert timeline_point(parse_metrics(both), "vllm", 0.0).kv_usage == 0.1  # not summed


SGLANG_TEXT = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 4.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 2.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.28
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 70.0
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{model_name="m"} 7.0
"""
TGI_TEXT = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 3
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 5
# TYPE tgi_request_duration histogram
tgi_request_duration_bucket{le="0.5"} 1
tgi_request_duration_bucket{le="+Inf"} 2
tgi_request_duration_sum 1.5
tgi_request_duration_count 2
"""
LLAMACPP_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 33065
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 7801
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def llamacpp_page(computed: int, cached: int, predicted: int) -> str:
    """The counters of a current llama-server's /metrics (recorded from the build `make
    llamacpp` makes: prompt tokens computed and reused from the slots' cache apart)."""
    return (
        "# TYPE llamacpp:prompt_tokens_total counter\n"
        f"llamacpp:prompt_tokens_total {computed}\n"
        "# TYPE llamacpp:prompt_tokens_cached_total counter\n"
        f"llamacpp:prompt_tokens_cached_total {cached}\n"
        "# TYPE llamacpp:tokens_predicted_total counter\n"
        f"llamacpp:tokens_predicted_total {predicted}\n"
        "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 1\n"
        "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 0\n"
    )


def test_llamacpp_prompt_tokens_and_hit_rate_count_its_cached_tokens_too() -> None:
    """llama.cpp's prompt_tokens_total leaves out the prompt tokens its slots reused from their
    cache: read alone it said a run of 4,096 prompt tokens, 1,000 of them cached, was 3,096,
    and there was no hit rate. Current builds count the cached ones apart, and the two add up
    to the prompt; builds without that counter read the computed ones, as before."""
    first, last = (
        parse_metrics(llamacpp_page(33119, 5899, 3832)),
        parse_metrics(llamacpp_page(33119 + 3096, 5899 + 1000, 3832 + 1024)),
    )
    report = build_report(first, last, [], "llama.cpp")
    assert report.deltas["prompt_tokens"] == 4096 and report.deltas["generation_tokens"] == 1024
    assert report.prefix_hit_rate == pytest.approx(1000 / 4096)
    assert report.names["prompt_tokens"] == (
        "llamacpp:prompt_tokens_total + llamacpp:prompt_tokens_cached_total"
    )
    # a part absent at the first scrape started at 0: the sum's delta is not the whole total
    fresh = build_report(parse_metrics(LLAMACPP_TEXT), last, [], "llama.cpp")
    assert fresh.deltas["prompt_tokens"] == (33119 + 3096 - 33065) + (5899 + 1000)
    older = build_report(
        parse_metrics(LLAMACPP_TEXT), parse_metrics(LLAMACPP_TEXT), [], "llama.cpp"
    )
    assert older.names["prompt_tokens"] == "llamacpp:prompt_tokens_total"
    assert older.deltas["prompt_tokens"] == 0 and older.prefix_hit_rate is None
    assert "prefix_hits" not in older.names  # absent there, not 0


@pytest.mark.parametrize(
    ("text", "runtime", "gauges"),
    [
        (SGLANG_TEXT, "sglang", (4.0, 2.0, 0.28)),
        (TGI_TEXT, "tgi", (5.0, 3.0, None)),
        (LLAMACPP_TEXT, "llama.cpp", (1.0, 0.0, None)),
    ],
)
def test_detect_and_read_other_runtimes(
    text: str, runtime: str, gauges: tuple[float | None, ...]
) -> None:
    snap = parse_metrics(text)
    assert detect_runtime(snap) == runtime
    point = timeline_point(snap, runtime, 0.0)
    assert (point.running, point.waiting, point.kv_usage) == gauges


def test_unknown_metrics_detect_nothing() -> None:
    assert detect_runtime(parse_metrics("# TYPE up gauge\nup 1\n")) is None
    assert detect_runtime(parse_metrics("")) is None


def test_every_runtime_names_only_known_roles() -> None:
    roles = {"running", "waiting", "kv_usage", *COUNTER_ROLES, *HISTOGRAM_ROLES}
    for runtime, names in RUNTIME_NAMES.items():
        assert set(names) <= roles, runtime
        # Counters (not histogram sums) carry _total in the text format.
        for role in set(names) & set(COUNTER_ROLES):
            assert names[role].endswith(("_total", "_sum")), (runtime, role)
    assert RUNTIME_NAMES["pdscope"] is RUNTIME_NAMES["vllm"]


# --- the sampler against mock transports --------------------------------------------------------


def run_sampler(handler, interval_s: float = 0.01, run_s: float = 0.1):
    async def main():
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport) as client:
            sampler = MetricsSampler(client, "http://srv", interval_s=interval_s)
            await sampler.start()
            await asyncio.sleep(run_s)
            return report_of(await sampler.stop())

    return asyncio.run(main())


def test_sampler_disabled_on_404() -> None:
    report = run_sampler(lambda request: httpx.Response(404, text="Not Found"))
    assert not report.available
    assert "404" in (report.reason or "")
    assert report.timeline == [] and report.to_dict()["available"] is False


def test_sampler_disabled_when_unreachable_or_foreign() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    report = run_sampler(refuse)
    assert not report.available and "ConnectError" in (report.reason or "")
    report = run_sampler(lambda request: httpx.Response(200, text="# TYPE up gauge\nup 1\n"))
    assert not report.available and "known runtime" in (report.reason or "")


def test_sampler_counts_errors_and_keeps_going() -> None:
    calls: list[str] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url))
        if len(calls) in (2, 3):  # two failures during the run
            return httpx.Response(503, text="busy")
        # The counter advances by 10 per good scrape.
        good = len(calls) - (2 if len(calls) > 3 else 0)
        return httpx.Response(200, text=vllm_text(**{"vllm:generation_tokens_total": 10 * good}))

    report = run_sampler(flaky, interval_s=0.01, run_s=0.5)
    assert report.available, report.reason
    assert calls[0] == "http://srv/metrics"
    assert report.scrape_errors == 2 and "503" in report.errors[0]
    assert report.scrapes == len(calls) - 2 >= 4  # first + some in the loop + final
    assert len(report.timeline) == report.scrapes
    assert report.deltas["generation_tokens"] == 10 * (report.scrapes - 1)
    ts = [p.t_s for p in report.timeline]
    assert ts[0] == 0.0 and ts == sorted(ts)


# --- end to end against `pdscope serve` ---------------------------------------------------------


@pytest.mark.slow
def test_sampler_against_real_server(server: Server) -> None:
    n_concurrent, max_tokens = 8, 256
    prefix = "A long shared system prompt about prefill and decode. " * 10

    async def complete(client: httpx.AsyncClient, prompt: str, tokens: int) -> dict:
        body = {"model": server.model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        r = await client.post(f"{server.url}/v1/completions", json=body, timeout=60)
        r.raise_for_status()
        return r.json()["usage"]

    async def main():
        async with httpx.AsyncClient() as client:
            sampler = MetricsSampler(client, server.url, interval_s=0.05)
            await sampler.start()
            usages = [await complete(client, "Warm up the engine.", 4)]
            usages += await asyncio.gather(
                *(
                    complete(client, f"Request {i}: tell a story.", max_tokens)
                    for i in range(n_concurrent)
                )
            )
            # Two sequential requests sharing a long prefix: the second hits the prefix cache.
            for suffix in ("one", "two"):
                usages.append(await complete(client, prefix + suffix, 4))
            return usages, report_of(await sampler.stop())

    usages, report = asyncio.run(main())
    n = len(usages)
    assert n == 1 + n_concurrent + 2
    assert report.available and report.runtime == "vllm", report.reason
    assert report.scrape_errors == 0, report.errors
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == 4 + n_concurrent * max_tokens + 2 * 4
    assert report.deltas["generation_tokens"] == generated
    assert report.deltas["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert report.deltas["prefix_hits"] >= 64  # the second prefixed request reused blocks
    assert report.prefix_hit_rate is not None and 0 < report.prefix_hit_rate < 1
    for role in ("ttft", "e2e", "queue"):
        h = report.histograms[role]
        assert h is not None and h.count == n, role
    itl = report.histograms["itl"]
    assert itl is not None and itl.count == generated - n  # one sample per token after the first
    for role in HISTOGRAM_ROLES:
        h = report.histograms[role]
        assert h is not None and h.max_bound_ms is not None and h.mean_ms is not None
        assert h.p50_ms is not None and h.p90_ms is not None and h.p99_ms is not None
        assert 0 <= h.p50_ms <= h.p90_ms <= h.p99_ms <= h.max_bound_ms, role
    # The 8 concurrent requests of 256 tokens run for about 0.6 s on an idle 2-core machine
    # (longer when it is busy), i.e. over ~10 scrape intervals of 50 ms: scrapes land while they
    # run, and a scrape answered then reads running = 8 (the gauge is read when scraped). With 64
    # tokens only ~2 intervals would, too few to rely on. The final scrape comes after every
    # response, when nothing runs.
    assert len(report.timeline) >= 3
    assert report.max_running is not None and 1 <= report.max_running <= n_concurrent
    assert sum(1 for p in report.timeline if p.running and p.running >= 1) >= 2
    assert report.max_kv_usage is not None and report.max_kv_usage > 0
    assert report.timeline[-1].running == 0 and report.timeline[-1].waiting == 0
    json.dumps(report.to_dict())
