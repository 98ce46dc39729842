"""`pdscope serve`'s /metrics against vLLM 0.32's own, for every series the article and vLLM's
Grafana dashboards read: same names, types, labels and bucket edges, so such a dashboard (and
`pdscope watch`) reads pdscope serve as it reads vLLM.

vLLM takes minutes to start here, so its page is a recorded fixture
(tests/fixtures/vllm-0.32.0-cpu-metrics.txt, from vLLM 0.32.0's CPU build); pdscope serve runs
for real. The values are checked against the engine's own counts in tests/test_server.py and
below for the series added for the dashboards.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdscope.server.metrics import one_two_five_buckets
from tests.conftest import Server, start_server

FIXTURE = Path(__file__).parent / "fixtures" / "vllm-0.32.0-cpu-metrics.txt"

# Families (base names) that the article's five and vLLM's example Grafana dashboards read.
DASHBOARD_FAMILIES = (
    # the article's five
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    # latency panels
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_time_per_output_token_seconds",
    # throughput, lengths, outcomes
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_success",
    # cache and preemption
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens_cached",
    "vllm:num_preemptions",
    "vllm:request_num_preemptions",
)
# What vLLM's default Prometheus registry adds about the process: its start (a restart), its
# memory and CPU, the garbage collector's runs by generation, and the Python it runs on.
PROCESS_FAMILIES = (
    "process_start_time_seconds",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_cpu_seconds",
    "process_open_fds",
    "process_max_fds",
    "python_gc_collections",
    "python_gc_objects_collected",
    "python_gc_objects_uncollectable",
    "python_info",
)
# vLLM labels every series with its engine index; pdscope has one engine and no such label.
# Dashboards select by model_name, which both export.
NOT_EXPORTED_LABELS = {"engine"}


@dataclass(frozen=True)
class Family:
    type: str
    labels: frozenset[str]
    buckets: tuple[float, ...]  # finite upper bounds; empty for non-histograms
    samples: dict[str, float]  # sample name (+ non-le labels) -> value, summed over models


def families(text: str) -> dict[str, Family]:
    out = {}
    for f in text_string_to_metric_families(text):
        labels = {k for s in f.samples for k in s.labels} - {"le"}
        buckets = sorted(
            {float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket")}
            - {float("inf")}
        )
        samples: dict[str, float] = {}
        for s in f.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            key = f"{s.name}{{{extra}}}" if extra else s.name
            samples[key] = samples.get(key, 0.0) + s.value
        out[f.name] = Family(f.type, frozenset(labels), tuple(buckets), samples)
    return out


@pytest.fixture(scope="module")
def vllm_shaped_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    # max_model_len 2048 as in the recording: the token-length buckets are derived from it.
    srv = start_server(
        tiny_model, tmp_path_factory.mktemp("logs"), "--max-model-len", "2048", name="llama"
    )
    yield srv
    srv.stop()


def test_fixture_is_vllm_0_32() -> None:
    text = FIXTURE.read_text()
    assert "vLLM 0.32.0" in text.splitlines()[0]
    vllm = families(text)
    assert len(vllm) >= 90
    for name in DASHBOARD_FAMILIES + PROCESS_FAMILIES:
        assert name in vllm, name


def test_pdscope_serve_exports_vllms_dashboard_series(vllm_shaped_server: Server) -> None:
    srv = vllm_shaped_server
    body = {"model": srv.model, "prompt": "Prefill, then decode.", "max_tokens": 12}
    for _ in range(2):
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).raise_for_status()
    ours = families(httpx.get(f"{srv.url}/metrics", timeout=10).text)
    vllm = families(FIXTURE.read_text())
    problems = []
    for name in DASHBOARD_FAMILIES + PROCESS_FAMILIES:
        theirs = vllm[name]
        mine = ours.get(name)
        if mine is None:
            problems.append(f"{name}: missing")
            continue
        if mine.type != theirs.type:
            problems.append(f"{name}: type {mine.type}, vLLM's is {theirs.type}")
        if mine.labels != theirs.labels - NOT_EXPORTED_LABELS:
            problems.append(f"{name}: labels {sorted(mine.labels)}, vLLM's {sorted(theirs.labels)}")
        if mine.buckets != theirs.buckets:
            problems.append(f"{name}: buckets {mine.buckets}, vLLM's {theirs.buckets}")
        # Sample names too: counters end in _total, histograms carry _bucket/_sum/_count.
        if {k.split("{")[0] for k in mine.samples} - {k.split("{")[0] for k in theirs.samples}:
            problems.append(f"{name}: sample names {sorted(mine.samples)}")
    assert not problems, "\n".join(problems)


def test_added_series_carry_what_the_engine_measured(vllm_shaped_server: Server) -> None:
    srv = vllm_shaped_server
    before = families(httpx.get(f"{srv.url}/metrics", timeout=10).text)
    body = {"model": srv.model, "prompt": "Count the tokens.", "max_tokens": 9, "ignore_eos": True}
    usage = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["usage"]
    after = families(httpx.get(f"{srv.url}/metrics", timeout=10).text)

    def delta(family: str, sample: str) -> float:
        a = before[family].samples.get(sample, 0.0)
        return after[family].samples[sample] - a

    fam = "vllm:request_generation_tokens"
    assert delta(fam, f"{fam}_count") == 1
    assert delta(fam, f"{fam}_sum") == usage["completion_tokens"] == 9
    fam = "vllm:request_prompt_tokens"
    assert delta(fam, f"{fam}_sum") == usage["prompt_tokens"]
    assert delta("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 9
    fam = "vllm:request_inference_time_seconds"
    inference_s = delta(fam, f"{fam}_sum")
    prefill_s = delta("vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds_sum")
    decode_s = delta("vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_sum")
    # Inference = prefill + decode + the finishing step's bookkeeping after the last token.
    assert inference_s >= prefill_s + decode_s - 1e-6
    fam = "vllm:request_time_per_output_token_seconds"
    assert delta(fam, f"{fam}_sum") == pytest.approx(decode_s / 8)
    fam = "vllm:iteration_tokens_total"
    # Every computed token is in some step: the prompt once (no cache hit: a new prompt) and
    # one decode token per output token after the first.
    assert delta(fam, f"{fam}_sum") == usage["prompt_tokens"] + 8
    assert delta("vllm:request_num_preemptions", "vllm:request_num_preemptions_count") == 1


def test_length_buckets_follow_max_model_len() -> None:
    assert one_two_five_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert one_two_five_buckets(1) == (1,)
    assert one_two_five_buckets(4096)[-1] == 2000
