"""`pdscope probe`: the client adapters and the whole procedure over real HTTP.

The embedded server (`pdscope serve`) answers in both dialects. What cannot run here is replaced
by recorded-response fakes, each labelled as such: a server that sends multi-token chunks,
malformed streams and a stream that stops mid-way; and llama.cpp's `timings`, detection and
/v1/models meta, recorded so they run on every machine. A real llama-server runs in
tests/test_llamacpp_peer.py where `make llamacpp` has built one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from typer.testing import CliRunner

from pdscope.cli import app as cli
from pdscope.client.adapters import (
    CHUNKS_ONLY,
    _finishing_token,
    _openai_event,
    openai_body,
    run_ollama,
    run_openai,
    session,
)
from pdscope.client.trace import UNREAD, Chunk, Trace
from pdscope.commands.probe import ProbeSettings, carried_fewer, probe
from pdscope.server.launch import free_port
from tests.conftest import Server, start_server

LOADED_PROBE = "probe-tiny-epyc-loaded-client.json.gz"  # a real probe whose client was loaded

pytestmark = pytest.mark.slow


def settings(url: str, **kw) -> ProbeSettings:
    base = {
        # 100 to 1,400 tokens: with the AMX prefill a 1,000-token prompt costs ~20 ms over the
        # ~10 ms every request pays, too close to 2x the shortest for a disturbed host.
        "prompt_tokens": [100, 400, 1400],
        "output_tokens": 24,
        "repeats": 2,
        "context_tokens": 1500,
        "batch_context_tokens": 256,
    }
    return ProbeSettings(url=url, **{**base, **kw})


def unsteady(point: dict) -> int:
    """A batch point's streams whose gaps time the client: read in bursts or whole."""
    return point["bursty_streams"] + point["one_read_streams"]


def output_asked(trace: dict) -> int:
    """The output a probe trace asked for: the checks' 24 tokens (settings()), the join check's
    new prompts 2, its streams what they needed to decode for a second (24 or more)."""
    if trace["label"] == "prefill-join-new":
        return 2
    if trace["label"] == "prefill-join":
        assert trace["max_tokens"] >= 24
        return trace["max_tokens"]
    return 24


def test_probe_openai_dialect(medium_server: Server) -> None:
    from tests.test_server import metrics

    def small_steps(m: dict[str, float]) -> float:
        """Steps the server ran carrying 2 to 8 tokens: decodes of several streams."""
        return (
            m["vllm:iteration_tokens_total_bucket{le=8.0}"]
            - m["vllm:iteration_tokens_total_bucket{le=1.0}"]
        )

    before = metrics(medium_server.url)
    totals: list[int] = []
    lefts: list[float | None] = []
    r = asyncio.run(probe(settings(medium_server.url), totals.append, on_left=lefts.append))
    after = metrics(medium_server.url)
    assert r["runtime"]["name"] == "pdscope" and r["runtime"]["api"] == "openai-completions"
    # The progress line's plan is what was sent, and its time left is told after each answer:
    # nothing after the cold request alone (no rate read), nothing left after the last.
    assert totals[-1] == len(lefts) == len(r["traces"])
    assert lefts[0] is None and all(left is not None for left in lefts[1:]) and lefts[-1] == 0
    assert r["settings"]["exact_prompt_tokens"]
    sweep = r["sweep"]
    assert [p["prompt_tokens"] for p in sweep] == [100, 400, 1400]  # exact, via /tokenize
    # Fastest repeats: on a shared 2-core machine one contended repeat can double a TTFT.
    assert sweep[-1]["ttft_ms_min"] > 2 * sweep[0]["ttft_ms_min"]  # prefill grows with the prompt
    # Decode barely moves with the prompt: the longest prompt's best repeat is within 4x of
    # the shortest prompt's worst. (Bounds, not medians: on a shared 2-core machine one
    # contended repeat can halve a rate, and a client that falls behind and reads a whole
    # stream at once can multiply one. Four runs alone read 0.56-1.18; one in a loaded suite
    # read over 2.5, both 1,400-token repeats at 386 tok/s. Decode that recomputed the whole
    # context each step would do ~14x the work at 1,400 tokens as at 100.)
    assert sweep[-1]["decode_tok_s_max"] > sweep[0]["decode_tok_s_min"] / 4
    pc = r["prefix_cache"]
    assert pc["pairs"] == 3 and pc["cached_tokens"] >= 1392
    # Fastest warm over fastest cold, as for the sweep: alone on the AMD EPYC the medians' ratio
    # read 0.17-0.21 in six runs, but one CI run read 0.72 (two of three warm sends slowed by
    # the host). Without the cache the fastest warm send prefills as much as a cold one (~1.0).
    assert pc["best_warm_over_cold"] < 0.5
    kinds = {f["finding"] for f in r["findings"]}
    assert "Prefix caching works" in kinds
    assert not r["failures"] and r["partial"] is None
    # The batched-decode check: 8 short prompts at once, decoding together (most of the time),
    # and the server's own step histogram agrees that its steps carried several decodes (the
    # only steps of 2 to 8 tokens in this probe: every prompt is 64 tokens or more). A step's
    # cost over one stream's is not bounded here: with this model a step costs ~0.2-0.3 ms,
    # about what the server's HTTP loop spends on a token of one stream, so 8 streams' ITL
    # is mostly that per-token work and read 2.4-8.7x one stream's (AMD EPYC, three probes in
    # a row, alone); the bound of 6 failed a clean-clone CI run (7.5) and a local run (11.2).
    batch = r["batch_decode"]
    assert batch["streams"] == 8 and batch["concurrency"] > 4
    # (no step where a loaded client read every stream in bursts: then it says so)
    assert batch["step_over_one_stream"] or unsteady(batch) == batch["streams"]
    assert small_steps(after) - small_steps(before) >= 10, small_steps(after) - small_steps(before)
    # The same 8 at long context: the steps where most of them decode together (their prefills
    # are staggered by the server's token budget), at the prompt plus the decode's middle.
    long = r["batch_decode_long"]
    # (a stream that came whole has no window, one read in bursts a late one: fewer counted)
    together = long["decoding_together"] or 0
    assert 2 <= together <= 8 and together + unsteady(long) >= 4 and long["prompt_tokens"] == 256
    assert long["context_tokens"] is None or 256 < long["context_tokens"] < 256 + 24
    assert long["itl_ms"] or unsteady(long) == long["streams"]
    for t in r["traces"]:
        assert t["token_source"] == "server-usage"
        assert (
            t["output_tokens"] == output_asked(t) and t["prompt_tokens"] == t["prompt_tokens_asked"]
        )
        # a chunk a token at most: some of empty text where the server held a token's text
        assert 0 < len(t["chunks"]) <= t["output_tokens"]
    # The TTFT fit never has a negative cost a token (it is None rather). Whether it
    # rises over this sweep is not asserted: it is fitted to medians of two repeats, and with
    # the AMX prefill the 100-to-1,400-token difference (tens of ms) is within one disturbed
    # repeat on a shared host (CI: fitted 38 ms at 100 tokens, 36 at 1,000, while the fastest
    # repeats above still grew more than 2x); the fastest-repeat check above is that claim.
    fit = r["ttft_fit"]
    assert fit is None or (fit["ms_per_token"] >= 0 and fit["ms_per_token2"] >= 0)


def test_probe_chat_ignores_the_role_chunk(medium_server: Server) -> None:
    async def one() -> Trace:
        async with session() as c:
            body = openai_body("openai-chat", "medium", "Say something", 8)
            return await run_openai(c, medium_server.url, "openai-chat", body)

    t = asyncio.run(one())
    assert t.ok and t.output_tokens == 8
    assert t.chunks[0].text  # the role-only first chunk is not content
    assert len(t.chunks) <= 8


def feed(trace: Trace, events: list[tuple[float, dict]]) -> Trace:
    """``events`` through run_openai's handling of each SSE event, then its end ([DONE])."""
    finishing_s = [t for t, event in events if _openai_event(trace, event, trace.api, t)]
    _finishing_token(trace, finishing_s)
    trace.end_s = events[-1][0] + 0.001
    return trace


def test_completions_tokens_whose_text_is_held_back_are_timed() -> None:
    """vLLM streams a completions chunk of empty text for each token whose text it holds back
    (part of a UTF-8 character); its bench times them. The events below are as vLLM 0.32.0's
    CPU build sent them serving the ``medium`` model a reply of 24 such tokens, which the
    client called "no generated content" before (tests/test_vllm_peer.py runs the real one):
    22 chunks, then a finishing one, then the usage."""
    api = "openai-completions"
    piece = {"index": 0, "text": "", "logprobs": None, "finish_reason": None, "stop_reason": None}
    usage = {"choices": [], "usage": {"prompt_tokens": 64, "completion_tokens": 24}}
    events = [(0.1 + 0.01 * i, {"choices": [piece]}) for i in range(22)]
    events += [(0.33, {"choices": [{**piece, "finish_reason": "length"}]}), (0.331, usage)]
    t = feed(Trace(api, "u", "m", start_s=0.0), events)
    # the finishing chunk carried a token no other chunk did (24 counted, 22 chunks before it)
    assert t.ok and len(t.chunks) == 23 and t.output_tokens == 24 and t.finish_reason == "length"
    assert t.ttft_s == pytest.approx(0.1) and t.n_output == 24 and t.token_source == "server-usage"
    assert t.e2e_s == pytest.approx(0.33) and t.tpot_s == pytest.approx(0.23 / 23)


def test_a_finishing_chunk_without_text_counts_only_as_a_token_no_chunk_carried() -> None:
    """llama.cpp's final chunk carries no token (16 chunks of text for 16 tokens): it ends
    nothing. vLLM's EOS has empty text: its finishing chunk is the last token. A reply with
    no other chunk is no first token at its end. Chat's role-only chunk is no token."""
    api = "openai-completions"

    def piece(text: str, finish: str | None = None) -> dict:
        return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    def usage(n: int) -> dict:
        return {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n}}

    text = [(0.1 + 0.01 * i, piece("ab")) for i in range(16)]
    every = feed(
        Trace(api, "u", "m", start_s=0.0), [*text, (0.3, piece("", "length")), (0.31, usage(16))]
    )
    assert len(every.chunks) == 16 and every.e2e_s == pytest.approx(0.25)
    eos = feed(
        Trace(api, "u", "m", start_s=0.0), [*text, (0.3, piece("", "stop")), (0.31, usage(17))]
    )
    assert len(eos.chunks) == 17 and eos.e2e_s == pytest.approx(0.3)
    assert eos.tpot_s == pytest.approx(0.2 / 16)
    bare = feed(Trace(api, "u", "m", start_s=0.0), [(0.3, piece("", "length")), (0.31, usage(16))])
    assert not bare.chunks and not bare.ok
    # llama.cpp's last event: the finish with the counts, after its last token; here 2 tokens
    # held back mid-stream came in one chunk, so the count exceeds the chunks, yet it is none
    summary = {**piece("", "length"), "usage": {"prompt_tokens": 8, "completion_tokens": 17}}
    held = feed(Trace(api, "u", "m", start_s=0.0), [*text, (0.3, summary)])
    assert len(held.chunks) == 16 and held.e2e_s == pytest.approx(0.25)
    chat = Trace("openai-chat", "u", "m", start_s=0.0)
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    assert not _openai_event(chat, {"choices": [role]}, "openai-chat", 0.1) and not chat.chunks


def test_probe_ollama_dialect(medium_server: Server) -> None:
    r = asyncio.run(probe(settings(medium_server.url, api="ollama")))
    assert r["runtime"]["api"] == "ollama" and not r["settings"]["exact_prompt_tokens"]
    # still pdscope, with its context (it was named "ollama", its findings Ollama's knobs)
    assert r["runtime"]["name"] == "pdscope" and r["runtime"]["max_model_len"] == 2048
    sweep = r["sweep"]
    assert sweep[-1]["ttft_ms_min"] > 2 * sweep[0]["ttft_ms_min"]
    for t in r["traces"]:
        assert t["token_source"] == "ollama-counters"
        assert t["server"]["ollama"]["eval_count"] == t["output_tokens"]
    assert "server_prompt_eval_ms" in sweep[0]  # the server's own view, shown beside ours
    # The prefix check reports the TTFT drop even without a cached-token count.
    assert r["prefix_cache"]["best_warm_over_cold"] < 0.5


def test_server_decode_rates_count_the_gaps_between_tokens() -> None:
    """Ollama starts eval_duration at its first token: 32 tokens 50 ms apart are 31 gaps,
    20 tok/s, as the client's decode rate counts them; count/duration read 20.6 (32/31 fast)."""
    from pdscope.analysis.probe import point

    t = Trace("ollama", "u", "m", start_s=0.0, end_s=2.0, output_tokens=32, prompt_tokens=64)
    t.chunks = [Chunk(0.4 + 0.05 * i, "x") for i in range(32)]
    t.server["ollama"] = {"eval_count": 32, "eval_duration": round(31 * 0.05e9)}
    p = point([t])
    assert p["server_eval_tok_s"] == pytest.approx(20.0)
    assert p["decode_tok_s"] == pytest.approx(20.0)  # the client's own, the same definition
    # llama.cpp's clock starts at its first token too (predicted_per_second 20.6 here)
    del t.server["ollama"]
    t.server["llamacpp"] = {"predicted_n": 32, "predicted_ms": 1550.0, "predicted_per_second": 20.6}
    assert point([t])["server_predicted_tok_s"] == pytest.approx(20.0)


def test_every_check_fits_a_short_context(tiny_model: Path, tmp_path: Path) -> None:
    """A server of 64 tokens: the context and batched checks' fixed 64-token prompts were sent
    anyway and failed (10 HTTP 400s); every check now fits what the server can hold."""
    srv = start_server(tiny_model, tmp_path, "--kv-cache-memory", "8MiB", "--max-model-len", "64")
    try:
        r = asyncio.run(probe(settings(srv.url, output_tokens=8, repeats=1, context_tokens=None)))
    finally:
        srv.stop()
    assert not r["failures"] and r["partial"] is None and not r["unmeasured"]
    assert all(t["prompt_tokens"] + t["output_tokens"] <= 64 for t in r["traces"])


def test_probe_cli_json_and_plot(medium_server: Server, medium: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "probe.json", tmp_path / "probe.png"
    result = CliRunner().invoke(
        cli,
        [
            "probe",
            medium_server.url,
            "--prompt-tokens",
            "64,256",
            "--repeats",
            "1",
            "--output-tokens",
            "16",
            "--batch-context",
            "128",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--device",
            "a10g",
            "--plan-model",
            str(medium),  # the served checkpoint's config.json
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    for key in ("runtime", "model", "sweep", "prefill_tok_s", "decode_tok_s", "prefix_cache"):
        assert key in data
    assert {"prompt_tokens", "ttft_ms", "decode_tok_s"} <= set(data["sweep"][0])
    assert {"cold_ttft_ms", "warm_ttft_ms"} <= set(data["prefix_cache"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Findings" in result.output
    assert data["settings"]["batch_streams"] == 8 and data["batch_decode"]["streams"] == 8
    assert data["settings"]["batch_context_tokens"] == 128
    text = " ".join(result.output.split())
    assert "batched decode: 8 streams of 64 prompt tokens" in text
    assert "batched decode: 8 streams of 128 prompt tokens" in text
    # The batch sweep's default sizes, each carried whole by a server of 64 sequences (a
    # loaded client that read the batch's streams late may count fewer and stop at 32).
    skipped = data["settings"]["batch_sweep_skipped"]
    assert data["settings"]["batch_sweep"] == [2, 32]
    # (streams that came whole count as carried: only late windows of bursty ones stop it)
    assert not skipped or (skipped == [32] and data["batch_decode"]["bursty_streams"] > 0)
    sweep = data["batch_sweep"]
    assert [p["streams"] for p in sweep] == [2, 32][: 2 - len(skipped)]
    assert sweep[0]["decoding_together"] == 2 or unsteady(sweep[0]) > 0
    assert skipped or (sweep[1]["decoding_together"] or 0) + unsteady(sweep[1]) > 8
    assert "decode step by streams decoding together (short prompts): 1:" in text
    # The join check: prompts sent among 8 decoding streams, each timed inside their step.
    # (none where the client read all but one of the streams in bursts: a note says so)
    joins = data["prefill_join"]
    assert joins or any(n.startswith("join check: the client read") for n in data["notes"])
    assert {j["prompt_tokens"] for j in joins} <= {128, 1024}
    assert all(2 <= j["decoding_together"] <= 8 and j["step_ms"] > 0 for j in joins)
    assert not joins or f"a {joins[0]['prompt_tokens']:,}-token prompt joining" in text
    assert_joined_on_progress(data["traces"])


def assert_joined_on_progress(traces: list[dict]) -> None:
    """The join check's new prompts went out once its streams had delivered a quarter, then
    a half, of the tokens they asked (counted in chunks the client had read before it began
    the request), or after every stream had ended: never at a planned time."""
    streams = [t for t in traces if t["label"] == "prefill-join"]
    news = [t for t in traces if t["label"] == "prefill-join-new"]
    news.sort(key=lambda t: t["start_s"])
    assert len(news) == 2 and streams
    out = streams[0]["max_tokens"]
    for k, new in enumerate(news):
        begun = new["start_s"]
        read = max(sum(c["t_s"] <= begun for c in t["chunks"]) for t in streams)
        ended = all(t["end_s"] is None or t["end_s"] <= begun for t in streams)
        assert read >= out * (k + 1) / 4 or ended, (k, read, out)


def test_the_join_check_sends_on_the_streams_progress(medium_server: Server) -> None:
    """The batched check's step sizes the join check's window, but no longer times its
    sends: against llama.cpp beside a busy process its mean gap once read 3.6x the join
    streams' own step, and both prompts went out after the streams had ended. Here
    the reference says 100 ms a step, many times this server's: a plan from it would send
    the first prompt 5 s in, long after the streams' 200 tokens; sent on the streams'
    count, it joins them."""
    from pdscope.analysis.probe import JOIN_LABEL, JOIN_NEW_LABEL, join_steps
    from pdscope.client.detect import detect
    from pdscope.commands.probe import Prober

    async def run() -> list[Trace]:
        s = settings(medium_server.url, output_tokens=200)
        async with httpx.AsyncClient() as client, session(fresh_connections=True) as streams:
            runtime = await detect(client, s.url, s.api, None)
            model = runtime.pick_model(None)
            prober = Prober(s, client, runtime, model, lambda label: None, streams)
            ref = Trace("openai-completions", s.url, "m", label="batch-decode", start_s=0.0)
            ref.chunks = [Chunk(0.1 * (k + 1), "x") for k in range(20)]
            ref.end_s, ref.output_tokens = 2.0, 20
            prober.traces.append(ref)
            await prober.join(3)
            return prober.traces[1:]

    traces = asyncio.run(run())
    assert_joined_on_progress([t.to_dict() for t in traces])
    assert sum(t.label == JOIN_LABEL for t in traces) == 3 and all(t.ok for t in traces)
    first = min((t for t in traces if t.label == JOIN_NEW_LABEL), key=lambda t: t.start_s)
    streams = [t for t in traces if t.label == JOIN_LABEL]
    assert all(t.chunks[0].t_s < first.chunks[0].t_s < t.chunks[-1].t_s for t in streams)
    if sum(not t.read_in_bursts for t in streams) >= 2:  # else the client read in bursts
        assert join_steps(traces)


def test_the_batch_sweep_stops_where_the_server_carries_fewer(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A server of 4 sequences decodes 4 of the 8 streams sent together: the sweep's 2 is sent,
    its 16 is not (the server would carry 4 of them too), and the result says so. The join
    check sends 3 streams, not 8: the progress total follows both, and ends at the requests
    sent."""
    srv = start_server(tiny_model, tmp_path, "--kv-cache-memory", "16MiB", "--max-num-seqs", "4")
    totals: list[int] = []
    sent: list[str] = []
    try:
        kw = {"prompt_tokens": [32], "repeats": 1, "output_tokens": 16, "batch_context_tokens": 0}
        r = asyncio.run(
            probe(settings(srv.url, batch_sweep=[2, 16], **kw), totals.append, sent.append)
        )
    finally:
        srv.stop()
    assert totals[0] > totals[-1] == len(sent) == len(r["traces"])
    assert 2 <= r["batch_decode"]["decoding_together"] <= 4  # 4, but for a loaded client
    # Streams the client got whole count as carried (nothing tells when they decoded): the
    # 16 is held back exactly where the count so made is clearly under 8.
    batch = r["batch_decode"]
    carried = min(8, batch["decoding_together"] + batch["one_read_streams"])
    if not carried_fewer(carried, 8):
        assert batch["one_read_streams"] > 0 and not r["settings"]["batch_sweep_skipped"]
        assert [p["streams"] for p in r["batch_sweep"]] == [2, 16]
        return
    assert r["settings"]["batch_sweep_skipped"] == [16]
    assert [p["streams"] for p in r["batch_sweep"]] == [2]
    # The join check's streams: fewer than the most seen decoding at once, so each new
    # prompt finds a free sequence (3 where the client read the batch well; none, with a
    # note, where it saw 2 at most)
    together = max(p["decoding_together"] or 0 for p in [batch, *r["batch_sweep"]])
    joined = sum(t["label"] == "prefill-join" for t in r["traces"])
    assert joined == (together - 1 if together >= 3 else 0)
    assert joined or any(n.startswith("join check: not run") for n in r["notes"])
    assert not any(t["label"] == "batch-decode x16" for t in r["traces"])
    assert any("batch sweep: 16 streams not sent" in note for note in r["notes"])


def test_ctrl_c_keeps_what_was_measured(medium_server: Server, tmp_path: Path) -> None:
    """Ctrl-C mid-probe: the requests that finished are analysed and written to --json, marked
    partial, and the command exits 1 (it used to exit with a traceback and write nothing)."""
    import signal
    import subprocess
    import sys

    from tests.test_server import wait_for

    out = tmp_path / "partial.json"
    done = "vllm:e2e_request_latency_seconds_count"
    before = wait_for(medium_server.url, lambda m: True)[done]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdscope.cli", "probe", medium_server.url,
         "--prompt-tokens", "64,256", "--output-tokens", "600", "--repeats", "3",
         "--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # see test_bench
    )  # fmt: skip
    # Stop once three requests have finished: ~24 of 600 tokens each are planned, minutes.
    m = wait_for(medium_server.url, lambda m: m[done] >= before + 3 or proc.poll() is not None, 90)
    assert m[done] >= before + 3, proc.communicate(timeout=60)[0] if proc.poll() is not None else m
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    data = json.loads(out.read_text())
    assert data["partial"] == "interrupted (Ctrl-C)"
    finished = [t for t in data["traces"] if t["error"] is None]
    assert 3 <= len(finished) < 20, len(finished)
    assert data["sweep"] and data["sweep"][0]["ttft_ms"] > 0  # analysed, not only stored
    assert "partial results" in output


def test_probe_errors(medium_server: Server) -> None:
    runner = CliRunner()
    port = free_port()  # nothing listens there
    r = runner.invoke(cli, ["probe", f"http://127.0.0.1:{port}"])
    assert r.exit_code == 1 and "cannot connect" in r.output
    r = runner.invoke(cli, ["probe", medium_server.url, "--model", "gpt-4"])
    assert r.exit_code == 1 and "does not serve model 'gpt-4'" in r.output
    r = runner.invoke(cli, ["probe", medium_server.url, "--api", "grpc"])
    assert r.exit_code == 2 and "--api" in r.output
    r = runner.invoke(cli, ["probe", medium_server.url, "--prompt-tokens", "a,b"])
    assert r.exit_code == 2


# --- recorded-response fakes (behaviours no real server here shows on demand) -------------

LLAMACPP_FINAL = {
    "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
    "timings": {
        "cache_n": 12,
        "prompt_n": 88,
        "prompt_ms": 41.5,
        "prompt_per_second": 2120.5,
        "predicted_n": 6,
        "predicted_ms": 60.2,
        "predicted_per_second": 99.7,
    },
}


def fake_app() -> FastAPI:
    """Replays recorded response shapes, with timing controlled by the test."""
    app = FastAPI()

    def sse(events: list, gap_s: float = 0.02) -> StreamingResponse:
        async def gen():
            for e in events:
                await asyncio.sleep(gap_s)
                yield e if isinstance(e, str) else f"data: {json.dumps(e)}\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/llamacpp/v1/completions")
    async def llamacpp() -> StreamingResponse:
        # Recorded shape of llama.cpp's server: no usage, `timings` on the last event.
        words = [
            {"choices": [{"index": 0, "text": w, "finish_reason": None}]}
            for w in ["a", " b", " c", " d", " e", " f"]
        ]
        return sse([*words, LLAMACPP_FINAL, "data: [DONE]\n\n"])

    @app.post("/vllmeos/v1/completions")
    async def vllm_eos() -> StreamingResponse:
        # The shape of vLLM's stream ending on the EOS token: its text is empty, it comes in
        # the finishing chunk, and the usage counts it (vLLM runs here only in `make
        # test-vllm`, and ends on EOS only by chance with a random-weight model).
        words = [
            {"choices": [{"index": 0, "text": w, "finish_reason": None}]} for w in ["a", " b", " c"]
        ]
        eos = {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4}}
        return sse([*words, eos, usage, "data: [DONE]\n\n"], gap_s=0.03)

    @app.get("/nocounts/v1/models")
    async def nocounts_models() -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/nocounts/v1/completions")
    async def nocounts() -> StreamingResponse:
        # A server that sends no usage and no timings: the tokens are the content chunks.
        words = [
            {"choices": [{"index": 0, "text": w, "finish_reason": None}]} for w in ["a", " b", " c"]
        ]
        return sse([*words, "data: [DONE]\n\n"], gap_s=0.005)

    @app.post("/multi/v1/completions")
    async def multi() -> StreamingResponse:
        # Three chunks carrying 2, 3 and 1 tokens; usage says 6.
        chunks = [
            {"choices": [{"index": 0, "text": t, "finish_reason": None}]}
            for t in ["ab", "cde", "f"]
        ]
        final = {
            "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16},
        }
        return sse([*chunks, final, "data: [DONE]\n\n"], gap_s=0.03)

    @app.post("/malformed/v1/completions")
    async def malformed() -> StreamingResponse:
        return sse(
            [{"choices": [{"index": 0, "text": "x", "finish_reason": None}]}, "data: {not json\n\n"]
        )

    @app.post("/cut/v1/completions")
    async def cut() -> StreamingResponse:
        return sse([{"choices": [{"index": 0, "text": "x", "finish_reason": None}]}])

    @app.get("/nomodels/v1/models")
    async def nomodels() -> dict:
        return {"object": "list", "data": []}

    @app.post("/nomodels/tokenize")
    async def nomodels_tokenize() -> dict:
        return {"tokens": [1, 2], "count": 2}

    @app.post("/toknokey/tokenize")
    async def toknokey() -> dict:
        return {"count": 3}  # a 200 without the token ids

    @app.get("/hitsinf/metrics")
    async def hitsinf() -> PlainTextResponse:
        return PlainTextResponse(
            "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total +Inf\n"
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
        )

    @app.post("/aborted/v1/completions")
    async def aborted() -> StreamingResponse:
        # A server shutting down (vLLM, pdscope serve): a clean end, finish_reason "abort".
        x = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
        end = {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}
        return sse([x, x, end, "data: [DONE]\n\n"])

    @app.get("/lc/v1/models")
    async def lc_models() -> dict:
        # meta as a real llama-server (make llamacpp) describes the GGUF it loaded
        meta = {"n_ctx": 4096, "n_params": 168846336, "size": 337743872, "ftype": "BF16"}
        return {"data": [{"id": "m", "owned_by": "llamacpp", "meta": meta}]}

    @app.post("/lc/tokenize")
    async def lc_tokenize() -> dict:
        return {"tokens": []}  # llama.cpp reads "content"; a "prompt" gets nothing back

    @app.get("/lc/props")
    async def lc_props() -> dict:
        return {"default_generation_settings": {"n_ctx": 4096}}

    @app.post("/reasoning/v1/chat/completions")
    async def reasoning() -> StreamingResponse:
        # Recorded shape of a vLLM reasoning parser: reasoning_content first, then content.
        think = [{"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}] * 4
        say = [{"choices": [{"index": 0, "delta": {"content": "ok"}}]}] * 2
        final = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}}
        return sse(["event: message\n", *think, *say, final, "data: [DONE]\n\n"])

    @app.post("/odd/v1/completions")
    async def odd() -> StreamingResponse:
        return sse(["data: 1\n\n"])

    @app.post("/onechunk/v1/completions")
    async def onechunk() -> StreamingResponse:
        body = "".join(
            f"data: {json.dumps({'choices': [{'index': 0, 'text': t}]})}\n\n" for t in "abc"
        )
        return sse(
            [
                body
                + 'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\n'
                + "data: [DONE]\n\n"
            ]
        )

    @app.post("/ollama-cut/api/generate")
    async def ollama_cut() -> StreamingResponse:
        async def gen():
            yield json.dumps({"model": "m", "response": "x", "done": False}) + "\n"

        return StreamingResponse(gen(), media_type="application/x-ndjson")

    @app.get("/lcc/v1/models")
    async def lcc_models() -> dict:
        return {"data": [{"id": "m", "owned_by": "llamacpp"}]}

    @app.post("/lcc/tokenize")
    async def lcc_tokenize(body: dict) -> dict:
        # Recorded shape of llama.cpp's /tokenize: it reads "content" only.
        return {"tokens": list(range(len(str(body.get("content", "")).split())))}

    @app.get("/lcc/props")
    async def lcc_props() -> dict:
        return {"default_generation_settings": {"n_ctx": 4096}}

    add_vllm_fake(app, "/vllm")
    add_ollama_fake(app, "/ollama2k")
    return app


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def add_vllm_fake(app: FastAPI, base: str) -> None:
    """A recorded-behaviour fake of vLLM 0.32 (a real one needs a 3.4 GB install): prefix-cache
    hits go to `vllm:prefix_cache_hits_total` on /metrics and never into `usage` (vLLM's
    default without --enable-prompt-tokens-details). One word is one token; a prompt whose
    leading 16-word blocks were seen before counts those blocks as hits (capped at n - 1) and
    skips their prefill time."""
    seen: list[list[str]] = []
    counters = {"hits": 0, "queries": 0}

    @app.get(f"{base}/v1/models")
    async def models() -> dict:
        return {"data": [{"id": "m", "owned_by": "vllm", "root": "m", "max_model_len": 4096}]}

    @app.get(f"{base}/metrics")
    async def metrics() -> StreamingResponse:
        text = (
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f'vllm:prefix_cache_hits_total{{model_name="m"}} {counters["hits"]}.0\n'
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f'vllm:prefix_cache_queries_total{{model_name="m"}} {counters["queries"]}.0\n'
        )
        return StreamingResponse(iter([text]), media_type="text/plain")

    @app.post(f"{base}/v1/completions")
    async def complete(body: dict) -> StreamingResponse:
        words = str(body["prompt"]).split()
        common = max((_common_prefix(w, words) for w in seen), default=0)
        hits = min(common // 16 * 16, len(words) - 1)
        seen.append(words)
        counters["hits"] += hits
        counters["queries"] += len(words)
        n = int(body["max_tokens"])

        async def gen():
            await asyncio.sleep(0.02 + 2e-5 * (len(words) - hits))  # prefill of uncached words
            for _ in range(n):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': ' x'}]})}\n\n"
                await asyncio.sleep(0.004)
            usage = {"prompt_tokens": len(words), "completion_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")


def add_ollama_fake(app: FastAPI, base: str) -> None:
    """A recorded-behaviour fake of an Ollama serving with num_ctx 2048: /api/ps says so, and a
    prompt longer than the context gets HTTP 400 (one word is one token)."""

    @app.get(f"{base}/api/tags")
    async def tags() -> dict:
        return {"models": [{"name": "m:latest", "model": "m:latest"}]}

    @app.get(f"{base}/api/ps")
    async def ps() -> dict:
        return {"models": [{"name": "m:latest", "model": "m:latest", "context_length": 2048}]}

    @app.post(f"{base}/api/generate")
    async def generate(body: dict):
        from fastapi.responses import JSONResponse

        words = len(str(body["prompt"]).split())
        n = int(body["options"]["num_predict"])
        if words + n > 2048:
            return JSONResponse({"error": "prompt too long; exceeded context length"}, 400)

        async def gen():
            await asyncio.sleep(0.01 + 2e-5 * words)
            for _ in range(n):
                yield json.dumps({"model": "m", "response": " x", "done": False}) + "\n"
                await asyncio.sleep(0.003)
            final = {
                "model": "m",
                "response": "",
                "done": True,
                "done_reason": "length",
                "prompt_eval_count": words,
                "eval_count": n,
                "prompt_eval_duration": 1000,
                "eval_duration": 3_000_000 * n,
            }
            yield json.dumps(final) + "\n"

        return StreamingResponse(gen(), media_type="application/x-ndjson")


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """``app`` on a free loopback port, served from a thread; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def fake() -> Iterator[str]:
    with serving(fake_app()) as url:
        yield url


def run(url: str) -> Trace:
    async def go() -> Trace:
        async with session(timeout_s=10) as c:
            body = openai_body("openai-completions", "m", "hi", 6)
            return await run_openai(c, url, "openai-completions", body)

    return asyncio.run(go())


def test_llamacpp_timings_fake(fake: str) -> None:
    t = run(f"{fake}/llamacpp")
    assert t.ok and t.token_source == "llamacpp-timings"
    assert t.output_tokens == 6 and t.prompt_tokens == 100 and t.cached_tokens == 12
    assert len(t.chunks) == 6  # its final chunk carries no token: every token had its chunk
    assert t.server["llamacpp"]["prompt_ms"] == 41.5


def test_an_eos_in_the_finishing_chunk_is_the_last_token_fake(fake: str) -> None:
    """E2E and TPOT end at the finishing chunk that carried vLLM's EOS (empty text, counted in
    the usage), as vLLM's bench ends them, not at the token before it."""
    t = run(f"{fake}/vllmeos")
    assert t.ok and t.output_tokens == 4 and len(t.chunks) == 4 and t.finish_reason == "stop"
    assert [c.text for c in t.chunks] == ["a", " b", " c", ""]
    assert t.e2e_s > t.chunks[2].t_s - t.request_start_s  # past the last text
    assert t.tpot_s == pytest.approx((t.chunks[3].t_s - t.chunks[0].t_s) / 3)


def test_bench_says_its_output_counts_are_the_chunks_fake(fake: str, tmp_path: Path) -> None:
    """A server that sends no token counts: bench counts one token a content chunk, and says
    so in its table's notes and its JSON (it said nothing; probe did, per request)."""
    saved = tmp_path / "r.json"
    result = CliRunner().invoke(
        cli,
        ["bench", f"{fake}/nocounts", "--num-prompts", "4", "--input-len", "8",
         "--output-len", "3", "--warmup", "0", "--save-result", str(saved)],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "4 of 4 requests counted one a content chunk (server sent no token counts: 4)" in (
        " ".join(result.output.split())
    )
    run = json.loads(saved.read_text())
    summary = run["runs"][0]["summary"] if "runs" in run else run["summary"]
    assert summary["output_tokens_source"] == {CHUNKS_ONLY: 4}
    assert summary["total_output_tokens"] == 12


def test_multi_token_chunks_fake(fake: str) -> None:
    t = run(f"{fake}/multi")
    assert t.ok and t.output_tokens == 6 and len(t.chunks) == 3
    samples = t.itl_samples_s()
    # 5 inter-token gaps for 6 tokens, spread over the 2 chunk gaps as 3 + 2.
    assert len(samples) == 5
    assert sum(samples) == pytest.approx(t.chunks[-1].t_s - t.chunks[0].t_s)
    assert t.tpot_s == pytest.approx((t.chunks[-1].t_s - t.chunks[0].t_s) / 5)


def test_odd_answers_are_one_line_or_no_value_fake(fake: str) -> None:
    """A /tokenize 200 without token ids is one line (it was a KeyError traceback that lost a
    probe's measurements); a prefix-hit counter at +Inf is no count (it crashed probe on
    round(NaN)); a server's completion count under its content chunks is replaced by the
    chunks (0 tokens for 16 chunks had bench report 0 tok/s)."""
    import httpx

    from pdscope.client.counters import PrefixHitCounter
    from pdscope.client.detect import ProbeError, Runtime, detect
    from pdscope.client.prompts import PromptBuilder

    async def main() -> tuple[str, float | None]:
        async with httpx.AsyncClient() as client:
            builder = PromptBuilder(client, f"{fake}/toknokey", "m", use_tokenize=True)
            with pytest.raises(ValueError, match="without a list of 'tokens'") as caught:
                await builder.ids(16)
            counter = PrefixHitCounter(client, f"{fake}/hitsinf")
            return str(caught.value), await counter.read()

    message, hits = asyncio.run(main())
    assert "\n" not in message and hits is None

    async def listing() -> Runtime:
        async with httpx.AsyncClient() as client:
            return await detect(client, f"{fake}/nomodels")

    # An empty model list is an OpenAI server that lists nothing, so --model gets past it (it
    # was "no OpenAI-compatible API", which no flag could get past).
    runtime = asyncio.run(listing())
    with pytest.raises(ProbeError, match="lists no models; pass --model"):
        runtime.pick_model(None)
    assert runtime.pick_model("m") == "m"
    assert runtime.has_tokenize  # and its /tokenize is used (it was not tried: estimated prompts)
    trace = Trace("openai-completions", "u", "m", output_tokens=0, start_s=0.0, end_s=1.0)
    trace.chunks = [Chunk(0.1 * i, "x") for i in range(1, 4)]
    assert trace.n_output == 3
    trace.output_tokens = 9  # more than the chunks: multi-token chunks, the server's count
    assert trace.n_output == 9
    from pdscope.client.adapters import _error_text

    page = b"<html>\n<body>\n  <h1>500 Internal Server Error</h1>\n</body></html>"
    assert _error_text(page) == "<html> <body> <h1>500 Internal Server Error</h1> </body></html>"


def test_a_prompt_count_no_tokenizer_gives_is_not_learned() -> None:
    """A server that reports 1 prompt token for 25 words: learning from it grew a bench's
    32-token prompts to 9 MB of text; such a count is left out, and counted."""
    from pdscope.client.prompts import PromptBuilder

    builder = PromptBuilder(None, "u", "m", use_tokenize=False)  # type: ignore[arg-type]
    builder.calibrate(25, 1)
    assert builder.tokens_per_word == 1.3 and builder.implausible == 1
    builder.calibrate(25, 34)
    assert builder.tokens_per_word == pytest.approx(34 / 25) and builder.calibrations == 1


def test_prompts_drawn_aside_leave_the_seeded_sequence_as_it_was() -> None:
    """A probe's resends draw aside: a seeded run's own prompts stay the seed's, whether or
    not a response came whole and was sent again (what a repeated --seed relies on)."""
    from pdscope.client.prompts import PromptBuilder

    plain, resent = (PromptBuilder(None, "u", "m", False, seed=7) for _ in range(2))  # type: ignore[arg-type]
    first = [plain.text(40) for _ in range(3)]
    assert resent.text(40) == first[0]
    with resent.aside():
        extra = resent.text(40)
        resent.tokens_per_word = 2.5  # as ids() learns from /tokenize
    assert extra not in first and resent.tokens_per_word == 1.3
    assert [resent.text(40) for _ in range(2)] == first[1:]


def test_itl_with_known_chunk_sizes() -> None:
    t = Trace(
        "openai-completions",
        "u",
        "m",
        start_s=0.0,
        end_s=1.0,
        output_tokens=4,
        chunks=[Chunk(0.1, "a", 1), Chunk(0.3, "bc", 2), Chunk(0.4, "d", 1)],
    )
    assert t.itl_samples_s() == pytest.approx([0.1, 0.1, 0.1])  # 0.2 / 2 twice, then 0.1
    assert t.ttft_s == pytest.approx(0.1) and t.tpot_s == pytest.approx(0.1)


def test_malformed_and_cut_streams_fake(fake: str) -> None:
    bad = run(f"{fake}/malformed")
    assert not bad.ok and "malformed" in bad.error and bad.ttft_s is None
    cut = run(f"{fake}/cut")
    assert not cut.ok and "before data: [DONE]" in cut.error and cut.e2e_s is None
    aborted = run(f"{fake}/aborted")  # cut short by the server: a failure, not a short success
    assert not aborted.ok and "finish_reason abort" in aborted.error

    async def ollama() -> Trace:
        async with session(timeout_s=10) as c:
            return await run_ollama(c, f"{fake}/ollama-cut", "m", "hi", 4)

    t = asyncio.run(ollama())
    assert not t.ok and "done" in t.error


def test_failed_requests_never_become_numbers() -> None:
    from pdscope.analysis.probe import analyze

    good = Trace(
        "openai-completions",
        "u",
        "m",
        label="sweep",
        prompt_tokens_asked=100,
        start_s=0.0,
        end_s=0.5,
        output_tokens=3,
        prompt_tokens=100,
        chunks=[Chunk(0.1, "a"), Chunk(0.2, "b"), Chunk(0.3, "c")],
    )
    failed = Trace(
        "openai-completions",
        "u",
        "m",
        label="sweep",
        prompt_tokens_asked=100,
        start_s=0.0,
        error="HTTP 500: boom",
    )
    r = analyze([good, failed], "vllm")
    point = r["sweep"][0]
    assert point["failed"] == 1 and point["ttft_ms"] == pytest.approx(100)
    assert r["failures"] == [{"label": "sweep", "prompt_tokens": 100, "error": "HTTP 500: boom"}]


def test_llamacpp_detection_fake(fake: str) -> None:
    from pdscope.client.detect import detect

    async def go():
        async with httpx.AsyncClient() as c:
            return await detect(c, f"{fake}/lc")

    rt = asyncio.run(go())
    assert rt.name == "llama.cpp" and not rt.has_tokenize and rt.max_model_len == 4096


def test_llamacpp_describes_the_gguf_it_serves_fake(fake: str) -> None:
    """probe showed "- parameters" for a llama.cpp server, which states its model's
    parameters, the tensors' bytes and their type in /v1/models' meta."""
    from pdscope.client.detect import detect
    from pdscope.commands.probe import _served_model

    async def go() -> dict:
        async with httpx.AsyncClient() as c:
            return await _served_model(c, await detect(c, f"{fake}/lc"), "m", None)

    assert asyncio.run(go()) == {
        "name": "m",
        "max_model_len": 4096,
        "params": 168846336.0,
        "weight_bytes": 337743872.0,
        "weights_type": "BF16",
    }


def test_llamacpp_tokenize_content_field_fake(fake: str) -> None:
    """llama.cpp's /tokenize reads "content": detection finds it, so bench and probe cut
    prompts to exact token counts there too (item 7)."""
    from pdscope.client.detect import detect
    from pdscope.client.prompts import PromptBuilder

    async def go() -> tuple:
        async with httpx.AsyncClient() as c:
            rt = await detect(c, f"{fake}/lcc")
            builder = PromptBuilder(c, rt.url, "m", rt.has_tokenize, None, 1, rt.tokenize_key)
            return rt, await builder.ids(128)

    rt, ids = asyncio.run(go())
    assert rt.name == "llama.cpp" and rt.has_tokenize and rt.tokenize_key == "content"
    assert len(ids) == 128


def test_reasoning_tokens_count_for_timing_fake(fake: str) -> None:
    async def go() -> Trace:
        async with session(timeout_s=10) as c:
            body = openai_body("openai-chat", "m", "hi", 6)
            return await run_openai(c, f"{fake}/reasoning", "openai-chat", body)

    t = asyncio.run(go())
    assert t.ok and len(t.chunks) == 6 and t.output_tokens == 6
    assert t.tpot_s == pytest.approx((t.chunks[-1].t_s - t.chunks[0].t_s) / 5)


def test_odd_events_and_single_read_fake(fake: str) -> None:
    bad = run(f"{fake}/odd")
    assert not bad.ok and "malformed" in bad.error  # an error trace, not an exception
    one = run(f"{fake}/onechunk")
    assert one.ok and one.output_tokens == 3
    assert one.tpot_s is None and one.itl_samples_s() == []  # no timing in a single read


def test_duration_bounds_a_closed_loop(fake: str) -> None:
    from pdscope.client.load import LoadPlan, run_load
    from pdscope.client.workloads import RequestSpec

    async def go():
        async with session(timeout_s=10) as c:
            specs = [RequestSpec("x", 3) for _ in range(40)]
            plan = LoadPlan(max_concurrency=1, duration_s=0.2)
            return await run_load(c, f"{fake}/multi", "openai-completions", "m", specs, plan)

    result = asyncio.run(go())
    assert len(result.traces) <= 3 and result.duration_s < 1.0


def fast_settings(url: str, **kw) -> ProbeSettings:
    base = {"prompt_tokens": [64, 256], "output_tokens": 6, "repeats": 2, "timeout_s": 20}
    return ProbeSettings(url=url, **{**base, **kw})


def test_a_max_model_len_above_the_servers_is_said_fake(fake: str) -> None:
    """--max-model-len 100000 over a server that reports 2,048 sized 8,192-token prompts to the
    flag with no word, and they came back 400."""
    r = asyncio.run(probe(fast_settings(f"{fake}/vllm", max_model_len=8192, prompt_tokens=[64])))
    assert any("--max-model-len 8,192 is above the 4,096 tokens" in n for n in r["notes"])
    r = asyncio.run(probe(fast_settings(f"{fake}/vllm", max_model_len=2048, prompt_tokens=[64])))
    assert not any("--max-model-len" in n for n in r["notes"])


def test_vllm_hits_read_from_its_counter_fake(fake: str) -> None:
    """vLLM leaves cached tokens out of usage: probe reads vllm:prefix_cache_hits around each
    request instead (issue 10, item 2)."""
    r = asyncio.run(probe(fast_settings(f"{fake}/vllm")))
    assert r["prefix_counter"] == "vllm:prefix_cache_hits"
    pc = r["prefix_cache"]
    assert pc["cached_source"] == "metrics-counter" and pc["cached_tokens"] >= 240
    assert "Prefix caching works" in {f["finding"] for f in r["findings"]}
    evidence = next(f["evidence"] for f in r["findings"] if f["finding"] == "Prefix caching works")
    assert "None" not in evidence and "hit counter" in evidence
    assert all(p["cache_hits"] == 0 and p["cache_known"] for p in r["sweep"])


def test_second_probe_with_a_seed_is_flagged_fake(fake: str) -> None:
    """A repeated seed repeats the prompts: the sweep then hits the cache, and those points are
    flagged, left out of the fit and reported as not measured (item 1). Without a seed every
    probe draws fresh prompts."""
    first = asyncio.run(probe(fast_settings(f"{fake}/vllm", seed=1234)))
    assert first["settings"]["seed"] == 1234 and not first["unmeasured"]
    again = asyncio.run(probe(fast_settings(f"{fake}/vllm", seed=1234)))
    assert all(p["cache_hit"] and p["ttft_ms"] is None for p in again["sweep"])
    assert again["ttft_fit"] is None and again["prefill_tok_s"] is None
    assert any("hit the prefix cache" in f["finding"] for f in again["findings"])
    assert any("hit the prefix cache" in u for u in again["unmeasured"])
    fresh = [asyncio.run(probe(fast_settings(f"{fake}/vllm"))) for _ in range(2)]
    assert fresh[0]["settings"]["seed"] != fresh[1]["settings"]["seed"]
    for r in fresh:
        assert all(p["cache_hits"] == 0 for p in r["sweep"]) and not r["unmeasured"]


def test_llamacpp_tokens_cached_is_read() -> None:
    from pdscope.client.adapters import _openai_event

    t = Trace("openai-completions", "u", "m")
    final = {"choices": [], "tokens_cached": 40, "timings": {"prompt_n": 10, "predicted_n": 2}}
    _openai_event(t, final, "openai-completions", 0.0)
    assert t.cached_tokens == 40 and t.prompt_tokens == 50 and t.cached_source == "llamacpp-timings"


def test_checks_sized_to_ollamas_context_fake(fake: str) -> None:
    """An Ollama at num_ctx 2048: the context check fits it (it used to send 3,072 tokens and
    get 400 twice, exiting 0); asked beyond it, every failure is listed and the CLI exits 1
    (item 6)."""
    r = asyncio.run(probe(fast_settings(f"{fake}/ollama2k")))
    assert r["runtime"]["max_model_len"] == 2048
    assert r["settings"]["context_tokens"] <= 2048 - 6 and not r["failures"]
    assert r["context"]["long"]["prompt_tokens"] > 1000 and not r["unmeasured"]
    result = CliRunner().invoke(
        cli,
        [
            "probe",
            f"{fake}/ollama2k",
            "--prompt-tokens",
            "64",
            "--repeats",
            "1",
            "--output-tokens",
            "6",
            "--max-model-len",
            "8192",
        ],
    )
    assert result.exit_code == 1, result.output
    assert "not measured" in result.output and "HTTP 400" in result.output


def test_repeated_seed_on_the_embedded_server(medium_server: Server) -> None:
    """The real server: a repeated seed hits its prefix cache and is flagged; the hit counter
    read around each request agrees with the count in usage."""
    kw = {"prompt_tokens": [64, 200], "repeats": 1, "output_tokens": 4, "context_tokens": 300}
    first = asyncio.run(probe(settings(medium_server.url, seed=99, device="local", **kw)))
    assert all(p["cache_hits"] == 0 for p in first["sweep"]) and not first["unmeasured"]
    # Before, before each of the two sweep sizes, after the sweep, after; each point is held
    # against the two around it.
    readings = first["ceiling"]["bandwidth_readings_gb_s"]
    assert len(readings) == 5
    # the context check interleaved: a drift in the host's speed moves short and long alike
    context = [t["label"] for t in first["traces"] if t["label"].startswith("context-")]
    assert [x for x in context if x in ("context-short", "context-long")] == [
        "context-short",
        "context-long",
    ] * 2
    assert [p["bandwidth_readings_gb_s"] for p in first["ceiling"]["points"]] == [
        readings[1:3],
        readings[2:4],
    ]
    # a bf16 or fp32 checkpoint: the floor's peak is the faster of the two readings
    tflops = first["ceiling"]["tflops_readings"]
    assert len(tflops) == 2 and first["ceiling"]["peak_tflops"] == pytest.approx(max(tflops))
    assert first["served_model"]["params"] > 1e6 and first["context"]["bytes"]["weight_bytes"]
    warm = next(t for t in first["traces"] if t["label"] == "prefix-warm")
    assert warm["cached_source"] == "server-usage"
    assert warm["server"]["prefix_cache_hits_delta"] == {
        "vllm:prefix_cache_hits": warm["cached_tokens"]
    }
    again = asyncio.run(probe(settings(medium_server.url, seed=99, **kw)))
    assert all(p["cache_hit"] for p in again["sweep"]) and again["unmeasured"]
    # The cold request and the context check were served from the cache too, and say so (the
    # cold one read as a cold start; the check as "no decode rate").
    assert again["cold"]["cache_hit"] and not first["cold"]["cache_hit"]
    context = next(u for u in again["unmeasured"] if u.startswith("context check"))
    assert "hit the prefix cache" in context, again["unmeasured"]


def _trace(label: str, prompt: int, ttft_s: float, tok_s: float, n: int = 9) -> Trace:
    chunks = [Chunk(ttft_s + i / tok_s, "x") for i in range(n)]
    return Trace(
        "openai-completions",
        "u",
        "m",
        label=label,
        prompt_tokens_asked=prompt,
        prompt_tokens=prompt,
        output_tokens=n,
        max_tokens=n,
        start_s=0.0,
        end_s=chunks[-1].t_s,
        chunks=chunks,
        cached_tokens=0,
    )


def test_a_short_response_read_in_bursts_is_told_from_a_steady_one() -> None:
    """A short answer's gaps tell a burst from steps from 4 gaps on: tokens that waited and
    came one after another in reads microseconds apart (an 8-token answer at 113,670 tok/s
    in a CI run, where no gap stood out from a mean they all share), or the first tokens held
    back with the rest of a 6-token answer. Steady steps of a tiny model (0.2 ms) are not a
    burst, nor is one slow step among them, nor two tokens in one read mid-stream (the span
    from first to last token, which TPOT reads, is whole), and 3 gaps are too few to judge."""

    def answer(gaps_s: list[float]) -> Trace:
        t = _trace("context-short", 64, 0.05, 1000.0, n=len(gaps_s) + 1)
        t.chunks = [Chunk(0.05 + sum(gaps_s[:i]), "x") for i in range(len(gaps_s) + 1)]
        t.end_s = t.chunks[-1].t_s
        return t

    assert answer([61e-6 / 7] * 7).read_in_bursts  # 113,636 tok/s
    assert answer([0.0, 0.0, 0.0, 0.0, 4e-3]).read_in_bursts  # tokens 1-5 held back
    assert answer([3e-3, 0.0, 0.0, 0.0, 0.0]).read_in_bursts  # the last 5 in one read
    assert not answer([2e-4] * 7).read_in_bursts
    assert not answer([2e-4, 2e-4, 6e-4, 2e-4, 2e-4]).read_in_bursts
    assert not answer([5e-3, 0.0, 5e-3, 5e-3]).read_in_bursts
    assert not answer([1e-6] * 3).read_in_bursts


def _probe_traces(tok_s: list[float], long_tok_s: float = 0.0) -> list[Trace]:
    out = [_trace("sweep", 100, 0.05, r) for r in tok_s]
    out += [_trace("sweep", 1000, 0.4, r) for r in tok_s]
    if long_tok_s:
        out += [_trace("context-short", 64, 0.03, 43.0), _trace("context-long", 3068, 1.0, 15.2)]
    return out


def test_a_cold_request_read_in_bursts_shows_no_decode_rate() -> None:
    """An audit's cold request printed "decode 11,247.8 tok/s" beside ~2,500 for the rest: its
    first chunks reached the client in one read. Its decode is unread now (a resend would not
    be cold)."""
    import io

    from rich.console import Console

    from pdscope.analysis.probe import analyze
    from pdscope.report.probe import render_probe

    cold = _trace("cold", 100, 0.05, 400.0)
    cold.chunks = [Chunk(0.2, "x")] * 5 + [Chunk(0.2004 + i * 0.0025, "y") for i in range(4)]
    assert cold.read_in_bursts
    r = analyze([cold, *_probe_traces([40.0, 41.0])], "vllm")
    assert r["cold"]["decode_tok_s"] is None and r["cold"]["read_in_bursts"]
    r |= {
        "runtime": {"url": "u", "name": "vllm", "evidence": ["e"], "api": "openai"},
        "model": "m",
        "settings": {"repeats": 2, "output_tokens": 9, "exact_prompt_tokens": True},
    }
    out = io.StringIO()
    render_probe(r, Console(file=out, width=200))
    assert "decode unread (the client read it in bursts)" in out.getvalue()
    steady = analyze([_trace("cold", 100, 0.05, 400.0), *_probe_traces([40.0])], "vllm")
    assert steady["cold"]["decode_tok_s"] == pytest.approx(400.0)


def test_a_tiny_models_ttft_keeps_its_figures() -> None:
    """A tiny model's sweep read "TTFT 1 ms" (0.8 ms in whole ms) beside "0" for its range."""
    import io

    from rich.console import Console

    from pdscope.analysis.probe import analyze
    from pdscope.report.probe import render_probe

    traces = [_trace("sweep", n, t, 400.0) for n, t in ((100, 0.0008), (100, 0.0009))]
    traces += [_trace("sweep", n, t, 400.0) for n, t in ((1000, 0.012), (1000, 0.013))]
    r = analyze(traces, "pdscope") | {
        "runtime": {"url": "u", "name": "pdscope", "evidence": ["e"], "api": "openai"},
        "model": "m",
        "settings": {"repeats": 2, "output_tokens": 9, "exact_prompt_tokens": True},
    }
    out = io.StringIO()
    render_probe(r, Console(file=out, width=200))
    text = out.getvalue()
    assert "0.85" in text and "0.80–0.90" in text and "12.5" in text, text
    # a server that stopped answering before saying its size read "- parameters"
    r["served_model"] = {"name": "tiny", "max_model_len": 2048}
    out = io.StringIO()
    render_probe(r, Console(file=out, width=200))
    assert "served model tiny: parameters not reported, context 2,048 tokens" in out.getvalue()


def test_prefix_check_survives_one_disturbed_send() -> None:
    """Three prefixes, each cold then warm; one warm send stalled by the host (2.15x its cold,
    as one CI run read with a single pair) does not turn a working cache into "not reused"."""
    from pdscope.analysis.probe import analyze

    def sends(label: str, ttfts_s: list[float], cached: int) -> list[Trace]:
        out = [_trace(label, 1016, t, 40.0) for t in ttfts_s]
        for t in out:
            t.cached_tokens = cached
        return out

    traces = _probe_traces([40.0, 41.0])
    traces += sends("prefix-cold", [0.030, 0.034, 0.036], 0)
    traces += sends("prefix-warm", [0.011, 0.074, 0.012], 992)
    pc = analyze(traces, "pdscope")["prefix_cache"]
    assert pc["pairs"] == 3 and pc["cached_tokens"] == 992 and pc["cold_cached_tokens"] == 0
    assert pc["cold_ttft_ms"] == pytest.approx(34) and pc["warm_ttft_ms"] == pytest.approx(12)
    assert pc["warm_over_cold"] == pytest.approx(12 / 34)
    assert pc["best_warm_over_cold"] == pytest.approx(11 / 30)
    # 1,016-token prompts are a 1,000-token prefix and a fresh 16: the prefix is named (it
    # read "a repeated 1016-token prefix").
    assert pc["prefix_tokens"] == 1000 and pc["prompt_tokens"] == 1016
    works = next(
        f for f in analyze(traces, "pdscope")["findings"] if f["finding"] == "Prefix caching works"
    )
    assert "a repeated 1000-token prefix" in works["evidence"]
    # One warm send that missed the cache shows in the count: the fewest, not the median.
    traces[-1].cached_tokens = 0
    assert analyze(traces, "pdscope")["prefix_cache"]["cached_tokens"] == 0

    # An 18-token prefix (under two 16-token blocks) that no send reused gets no verdict: a
    # server cannot cache what does not fill a block.
    def short(label: str) -> list[Trace]:
        out = [_trace(label, 18, t, 40.0) for t in (0.030, 0.031, 0.032)]
        for t in out:
            t.cached_tokens = 0
        return out

    traces = [*_probe_traces([40.0, 41.0]), *short("prefix-cold"), *short("prefix-warm")]
    findings = analyze(traces, "pdscope")
    assert not [f for f in findings["findings"] if "not being reused" in f["finding"]]


def test_the_ttft_fit_never_has_a_negative_cost_and_needs_a_span() -> None:
    from pdscope.analysis.probe import _spans, _ttft_fit

    # 1 and 2 tokens fitted "7.6 ms + -1.156 ms x N": too close to fit a cost per token.
    assert not _spans([1, 2]) and not _spans([100, 150]) and _spans([100, 400, 1400])
    # A sweep whose quadratic tilts the line down (Ollama: -0.042 ms x N + 1,076 ms x (N/1k)^2).
    xs, ys = [200, 500, 1000, 2000], [30.0, 29.0, 60.0, 4300.0]
    fit = _ttft_fit(xs, ys)
    assert fit is not None and fit[1] >= 0 and fit[2] >= 0
    # Falling TTFT (a disturbed host) fits nothing rather than a negative cost.
    assert _ttft_fit([100, 1000], [50.0, 40.0]) is None
    assert _ttft_fit(xs, [10.0, 20.0, 40.0, 80.0]) is not None  # a clean rise still fits
    # Two lengths from llama.cpp, bent up by attention's square: a line through them started
    # at -19.9 ms. No cost is negative, the fixed one included, and both points still fit.
    fit = _ttft_fit([200, 1000], [132.0, 738.0])
    assert fit is not None and min(fit) >= 0
    for x, y in ((200, 132.0), (1000, 738.0)):
        assert fit[0] + fit[1] * x + fit[2] * x * x == pytest.approx(y)


def test_impossible_results_get_no_verdict() -> None:
    """Decode at 2x the ceiling of a plan model 50x bigger than the served one: the result
    names the mismatch and gives no hardware verdict (item 3)."""
    from pdscope.analysis.probe import Ceilings, analyze

    c = Ceilings("NVIDIA H100 SXM", lambda n: 50.0, lambda n: None, "llama-3.1-8b", 8.03e9)
    r = analyze(
        _probe_traces([100.0, 101.0]), "vllm", c, served_model={"name": "m", "params": 1.7e8}
    )
    assert r["ceiling"]["decode_pct_of_ceiling"] == pytest.approx(200, rel=0.02)
    (text,) = r["ceiling"]["impossible"]
    assert "impossible" in text and "llama-3.1-8b" in text and "170.00 M" in text
    assert "(8.03 G parameters)" in text  # a tiny served model read "0.00B" before
    titles = [f["finding"] for f in r["findings"]]
    assert "Faster than the hardware allows: no verdict on the ceiling" in titles
    assert not any("bandwidth ceiling" in t for t in titles)


def test_a_decode_over_the_ceiling_in_some_repeats_only_is_noise_not_impossible() -> None:
    """`make demo` (AMD EPYC Zen 4, bandwidth read 38.1 and 37.8 GB/s before and after):
    decode at 133% of the ceiling, margin 87-136%, was called impossible, its likely cause
    "the wrong device" for this very machine. One repeat of three sat under the ceiling: the
    host's speed moved between the readings and the requests. That is no verdict for noise;
    every repeat past the ceiling is still impossible."""
    from pdscope.analysis.probe import Ceilings, analyze

    c = Ceilings("this machine", lambda n: 100.0, lambda n: None, "m", 1.7e8, [38.1, 37.8])
    served = {"name": "m", "params": 1.7e8}
    r = analyze(_probe_traces([87.0, 133.0, 136.0]), "pdscope", c, served_model=served)
    assert r["ceiling"]["decode_pct_of_ceiling"] == pytest.approx(133)
    assert r["ceiling"]["decode_pct_range"][0] < 100 and not r["ceiling"]["impossible"]
    titles = [f["finding"] for f in r["findings"]]
    assert "The machine is noisy: no verdict on decode against the ceiling" in titles, titles
    r = analyze(_probe_traces([120.0, 133.0, 136.0]), "pdscope", c, served_model=served)
    assert r["ceiling"]["impossible"]
    assert "Faster than the hardware allows: no verdict on the ceiling" in [
        f["finding"] for f in r["findings"]
    ]


def _at(traces: list[Trace], start_s: float) -> list[Trace]:
    """The traces moved on the client clock to start at ``start_s``."""
    for t in traces:
        t.start_s += start_s
        t.end_s = (t.end_s or 0.0) + start_s
        for c in t.chunks:
            c.t_s += start_s
    return traces


def test_each_sweep_point_is_held_against_the_bandwidth_read_around_it() -> None:
    """Issue 12: a shared Xeon's bandwidth read 3-18 GB/s minutes apart. Read only before and
    after the whole probe, a swing mid-run set every point against the run's mean: here a
    decode at 91% of its own seconds' ceiling would read 114%, and its verdict be withheld for a
    swing that came after it. Each sweep point is held against the readings just before and
    after its requests, the decode verdict noisy only where those two disagree, and the context
    check's slack is the spread of the two around it."""
    from pdscope.analysis.probe import Ceilings, analyze

    token_bytes = 304.5e6
    readings = [30.0, 30.0, 30.0, 15.0, 15.0]  # before, before each size, after the sweep, after

    def ceilings(readings: list[float], times_s: list[float]) -> Ceilings:
        mean_gb_s = sum(readings) / len(readings)
        return Ceilings(
            "this machine", lambda n: mean_gb_s * 1e9 / token_bytes, lambda n: None, "small",
            1.7e8, readings, bandwidth_times_s=times_s,
        )  # fmt: skip

    def traces() -> list[Trace]:  # 100 tokens from t=10 s at 90 tok/s, 1,000 from t=20 at 45,
        # the context check from t=32
        return (
            _at([_trace("sweep", 100, 0.05, r) for r in (89.0, 90.0, 91.0)], 10.0)
            + _at([_trace("sweep", 1000, 0.4, r) for r in (44.0, 45.0, 46.0)], 20.0)
            + _at([_trace("context-short", 64, 0.03, 43.0)], 32.0)
            + _at([_trace("context-long", 3068, 1.0, 15.2)], 33.0)
        )

    served = {"name": "small", "params": 1.7e8}
    r = analyze(traces(), "pdscope", ceilings(readings, [0, 5, 15, 30, 40]), served_model=served)
    c = r["ceiling"]
    first, second = c["points"]
    assert first["bandwidth_readings_gb_s"] == [30.0, 30.0]
    assert second["bandwidth_readings_gb_s"] == [30.0, 15.0]
    assert first["decode_ceiling_tok_s"] == pytest.approx(30e9 / token_bytes)
    assert second["decode_ceiling_tok_s"] == pytest.approx(22.5e9 / token_bytes)
    assert c["decode_pct_of_ceiling"] == pytest.approx(100 * 90 / (30e9 / token_bytes))  # 91%
    assert c["decode_pct_range"] == pytest.approx([100 * 89 / 98.52, 100 * 91 / 98.52], rel=1e-3)
    assert c["bandwidth_spread"] == pytest.approx(1.0) and c["decode_bandwidth_spread"] == 0
    assert c["context_bandwidth_spread"] == 0  # read at 30 and 40 s, around the context check
    assert c["bandwidth_reading_times_s"] == [0, 5, 15, 30, 40]
    assert not c["noisy"] and not c["impossible"]
    titles = [f["finding"] for f in r["findings"]]
    assert not any("noisy" in t for t in titles), titles
    # The swing between the first point's readings: no verdict, and the words say where.
    swung = [30.0, 30.0, 15.0, 15.0, 15.0]
    c = analyze(traces(), "pdscope", ceilings(swung, [0, 5, 15, 30, 40]), served_model=served)[
        "ceiling"
    ]
    assert c["noisy"] == ["bandwidth read 30.0 and 15.0 GB/s around the decode at 100 tokens "
                          "(100% apart)"]  # fmt: skip
    # Without the readings' times, or with none after a point, every point takes them all.
    c = analyze(traces(), "pdscope", ceilings(readings, []), served_model=served)["ceiling"]
    assert c["points"][0]["bandwidth_readings_gb_s"] == readings
    late = analyze(traces(), "pdscope", ceilings(readings, [0, 1, 2, 3, 4]), served_model=served)
    assert late["ceiling"]["points"][0]["bandwidth_readings_gb_s"] == readings
    assert c["decode_pct_of_ceiling"] == pytest.approx(100 * 90 / (24e9 / token_bytes))


def test_a_decode_past_the_ceiling_that_the_cpus_cache_explains_is_not_impossible() -> None:
    """A Xeon with 300 MiB of L3 (family 6 model 207): the engine decoded the 304 MB small
    model at 1.24-1.37x the bandwidth ceiling, every repeat past it, because the L3 holds most
    of the weights between steps; "impossible; likely the wrong device" was wrong for the very
    machine measured. Where the cache's share of a token's bytes explains the excess it is a
    finding naming the cache; a model 25x the cache's size past it is still impossible."""
    from pdscope.analysis.probe import Ceilings, analyze

    cache_bytes = 300 * 2**20
    readings = [29.5, 30.2]  # GB/s before and after; a token reads 304.5 MB: 98 tok/s
    ceiling_tok_s = sum(readings) / 2 * 1e9 / 304.5e6
    small = Ceilings(
        "this machine", lambda n: ceiling_tok_s, lambda n: None, "small", 1.7e8, readings,
        cache_bytes=cache_bytes,
    )  # fmt: skip
    served = {"name": "small", "params": 1.7e8}
    r = analyze(_probe_traces([120.0, 124.0, 126.0]), "pdscope", small, served_model=served)
    ceiling = r["ceiling"]
    assert ceiling["decode_pct_range"][0] > 100  # every repeat past the ceiling
    assert not ceiling["impossible"]
    assert (
        "last-level cache (314.57 MB, against the 304.50 MB a token reads)"
        in (ceiling["decode_from_cache"])
    )
    assert "up to 150% of the ceiling explained" in ceiling["decode_from_cache"]
    assert ceiling["cache_bytes"] == cache_bytes
    (finding,) = [f for f in r["findings"] if "cache" in f["finding"]]
    assert finding["finding"] == (
        "Decode beats memory's ceiling: the CPU's cache holds part of the model"
    )
    assert "126% of the bandwidth ceiling" in finding["evidence"]  # 124 tok/s of 98
    assert not any("near the bandwidth ceiling" in f["finding"] for f in r["findings"])
    # Without the cache's size (a catalog device, or no sysfs) it stays impossible.
    bare = Ceilings(
        "this machine", lambda n: ceiling_tok_s, lambda n: None, "small", 1.7e8, readings
    )
    assert analyze(_probe_traces([120.0, 124.0, 126.0]), "pdscope", bare, served_model=served)[
        "ceiling"
    ]["impossible"]
    # Some repeats under the ceiling: noise, not the cache.
    r = analyze(_probe_traces([90.0, 124.0, 126.0]), "pdscope", small, served_model=served)
    assert r["ceiling"]["decode_from_cache"] is None and not r["ceiling"]["impossible"]
    # 3x the ceiling (a GPU's server probed with --device local), or a served model of another
    # size than the arithmetic's: past what a cache explains, impossible as before.
    for tok_s, params in (([300.0, 301.0, 302.0], 1.7e8), ([120.0, 124.0, 126.0], 7e9)):
        r = analyze(
            _probe_traces(tok_s), "pdscope", small, served_model={"name": "x", "params": params}
        )
        assert r["ceiling"]["decode_from_cache"] is None and r["ceiling"]["impossible"]
    # A 7B-shaped model reads 13.2 GB a token, 42x the cache: it can explain 2.4% over the
    # ceiling, not 25%.
    big_tok_s = sum(readings) / 2 * 1e9 / 13.2e9
    big = Ceilings(
        "this machine", lambda n: big_tok_s, lambda n: None, "m7b", 6.7e9, readings,
        cache_bytes=cache_bytes,
    )  # fmt: skip
    over = [big_tok_s * 1.25, big_tok_s * 1.26, big_tok_s * 1.27]
    r = analyze(_probe_traces(over), "pdscope", big, served_model={"name": "m7b", "params": 6.7e9})
    assert r["ceiling"]["decode_from_cache"] is None and r["ceiling"]["impossible"]


def test_the_last_level_cache_is_read_from_sysfs(tmp_path: Path) -> None:
    """The largest data or unified cache sysfs lists (an instruction cache never counts); a
    malformed size is skipped; no listing gives None."""
    from pdscope.specs.local import last_level_cache_bytes

    for index, kind, size in (
        ("index0", "Data", "48K"),
        ("index1", "Instruction", "4096K"),
        ("index2", "Unified", "2048K"),
        ("index3", "Unified", "307200K"),
        ("index4", "Unified", "lots"),
    ):
        (tmp_path / index).mkdir()
        (tmp_path / index / "type").write_text(kind + "\n")
        (tmp_path / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 307200 * 1024
    (tmp_path / "index3" / "size").write_text("1M\n")
    assert last_level_cache_bytes(tmp_path) == 2048 * 1024
    assert last_level_cache_bytes(tmp_path / "absent") is None


def test_the_cache_counts_only_for_a_server_on_this_machine() -> None:
    """--device local measures this machine: its cache can explain a decode past the ceiling
    only where the URL names this machine."""
    from pdscope.commands.probe import _loopback

    here = ("http://127.0.0.1:8000", "http://localhost:11434", "http://[::1]:8080/v1")
    for url in (*here, "http://0.0.0.0:8000"):
        assert _loopback(url), url
    for url in ("http://10.0.0.5:8000", "https://gpu.example.com", "http://192.168.1.20"):
        assert not _loopback(url), url


def test_a_matmul_rate_that_moved_withholds_the_prefill_verdict() -> None:
    """Another tenant halved the machine's matmul rate between readings (0.215 then 0.40
    TFLOP/s): a floor from the slow one put a real 400 ms prefill at 132% of it, "impossible;
    likely the wrong device". Readings apart by more than the noise limit give no verdict on
    prefill; steady ones keep the impossible verdict."""
    from pdscope.analysis.probe import Ceilings, analyze

    def ceilings(tflops: list[float]) -> Ceilings:
        return Ceilings(
            "this machine", lambda n: 1000.0, lambda n: 0.528 if n == 1000 else 0.01, "m", 1e8,
            [20.0, 20.2], tflops, max(tflops),
        )  # fmt: skip

    moved = analyze(_probe_traces([40.0, 41.0]), "pdscope", ceilings([0.215, 0.40]))["ceiling"]
    assert moved["prefill_pct_of_floor"] == pytest.approx(132, rel=0.01)
    assert not moved["impossible"] and "0.215 and 0.400 TFLOP/s" in moved["compute_noisy"]
    assert moved["tflops_readings"] == [0.215, 0.40] and moved["peak_tflops"] == 0.40
    r = analyze(_probe_traces([40.0, 41.0]), "pdscope", ceilings([0.215, 0.40]))
    titles = [f["finding"] for f in r["findings"]]
    assert "The machine is noisy: no verdict on prefill against the compute floor" in titles
    steady = analyze(_probe_traces([40.0, 41.0]), "pdscope", ceilings([0.39, 0.40]))["ceiling"]
    assert steady["impossible"] and "132% of the compute floor" in steady["impossible"][0]
    # Readings 20% apart cannot explain 132% at the faster one: still impossible.
    over = analyze(_probe_traces([40.0, 41.0]), "pdscope", ceilings([0.35, 0.42]))["ceiling"]
    assert over["compute_noisy"] and over["impossible"]


def test_noisy_machine_withholds_the_verdict() -> None:
    """Bandwidth read 17 then 24 GB/s: the 73%-or-43% verdict is withheld; steady readings and
    repeats give a verdict with its margin (item 4)."""
    from pdscope.analysis.probe import Ceilings, analyze

    def ceilings(readings: list[float]) -> Ceilings:
        mean = sum(readings) / len(readings)
        return Ceilings("this machine", lambda n: mean * 3, lambda n: None, "m", 1e8, readings)

    noisy = analyze(_probe_traces([40.0, 41.0]), "pdscope", ceilings([17.0, 24.0]))
    assert noisy["ceiling"]["noisy"] and "17.0 and 24.0" in noisy["ceiling"]["noisy"][0]
    titles = [f["finding"] for f in noisy["findings"]]
    assert "The machine is noisy: no verdict on decode against the ceiling" in titles
    assert not any("Decode is" in t or "Decode reaches" in t for t in titles)
    # Just over the 15% limit: shown as 15.1%, not as "15%" beside "(more than 15%)".
    edge = analyze(_probe_traces([40.0, 41.0]), "pdscope", ceilings([20.0, 23.02]))
    assert "(15.1% apart)" in edge["ceiling"]["noisy"][0], edge["ceiling"]["noisy"]
    jumpy = analyze(_probe_traces([30.0, 45.0]), "pdscope", ceilings([20.0, 20.5]))
    assert any("ranged 30.0–45.0" in n for n in jumpy["ceiling"]["noisy"])
    steady = analyze(_probe_traces([40.0, 41.0]), "pdscope", ceilings([20.0, 20.6]))
    assert not steady["ceiling"]["noisy"]
    low, high = steady["ceiling"]["decode_pct_range"]
    assert low < steady["ceiling"]["decode_pct_of_ceiling"] < high
    verdict = next(
        f for f in steady["findings"] if f["kind"] == "decode" and "ceiling" in f["finding"]
    )
    assert f"margin {low:.0f}–{high:.0f}%" in verdict["evidence"]


def test_a_context_slowdown_past_the_bytes_names_a_cache_that_holds_the_weights() -> None:
    """On a Xeon with 300 MiB of L3 the small model's decode fell from 64 to 4,000 tokens to
    0.771 where the bytes predict 0.863, and a plain read of the same bytes fell as far: the
    KV took the cache from the weights. Where decode read past memory's ceiling by what the
    cache explains, the finding names the cache beside attention compute; where decode sat
    under the ceiling (the cache not what sped it), or no cache is known, the attention
    verdict stands."""
    from pdscope.analysis.probe import Ceilings, ModelBytes, analyze

    def context_finding(cache_bytes: float | None, sweep_tok_s: float) -> dict[str, str]:
        traces = _probe_traces([sweep_tok_s, sweep_tok_s + 1])
        traces += [
            _trace("context-short", 64, 0.03, 125.0),
            _trace("context-long", 3068, 1.0, 92.0),
        ]
        c = Ceilings(
            "this machine", lambda n: 98.0, lambda n: None, "small", 1.69e8, [29.5, 30.2],
            cache_bytes=cache_bytes,
        )  # fmt: skip
        model = ModelBytes("small", 1.69e8, 304e6, lambda n: 12_288.0 * n)
        r = analyze(traces, "pdscope", c, model_bytes=model)
        return next(f for f in r["findings"] if "context" in f["finding"])

    f = context_finding(300 * 2**20, sweep_tok_s=124.0)  # 127% of the ceiling
    assert f["finding"] == (
        "Decode slows with context more than its KV bytes explain: the CPU's cache, or "
        "attention compute"
    )
    assert "last-level cache (314.57 MB, against 304.00 MB of weights)" in f["evidence"], f
    assert "decode-attention kernel" in f["action"]
    attention = "Decode slows with context far more than its KV bytes explain: attention compute"
    assert context_finding(None, sweep_tok_s=124.0)["finding"].startswith(attention)
    assert context_finding(300 * 2**20, sweep_tok_s=60.0)["finding"].startswith(attention)


def test_context_slowdown_split_into_bytes_and_the_rest() -> None:
    """43.0 -> 15.2 tok/s at 3,068 tokens where the KV is ~38 MB against 338 MB of weights: the
    bytes explain ~10%, the rest is attention compute or the kernel, not bandwidth (item 5)."""
    from pdscope.analysis.probe import ModelBytes, analyze

    mb = ModelBytes("168m", 1.69e8, 338e6, lambda n: 12_288.0 * n)
    r = analyze(_probe_traces([40.0, 41.0], long_tok_s=15.2), "llama.cpp", model_bytes=mb)
    split = r["context"]["bytes"]
    assert 0.88 < split["explained_long_over_short"] < 0.92
    f = next(f for f in r["findings"] if "context" in f["finding"])
    assert f["finding"].startswith("Decode slows with context far more than its KV bytes explain")
    assert "not bandwidth" in f["evidence"] and "re-reads" not in f["finding"]
    plain = analyze(_probe_traces([40.0, 41.0], long_tok_s=15.2), "llama.cpp")
    g = next(f for f in plain["findings"] if "context" in f["finding"])
    assert "pass --plan-model" in g["evidence"]
    # Long-context repeats at 15 and 40 tok/s: the remainder could be 0.39 or 1.03, so the
    # split is no verdict (make demo printed "far more than its KV bytes explain" from two
    # repeats on a host whose bandwidth moved 15%).
    spread = _probe_traces([40.0, 41.0], long_tok_s=15.2)
    spread.append(_trace("context-long", 3068, 1.0, 40.0))
    h = next(
        f
        for f in analyze(spread, "llama.cpp", model_bytes=mb)["findings"]
        if "context" in f["finding"]
    )
    assert h["finding"] == "Decode slows as context fills: no verdict on why", h
    assert "0.39–1.03" in h["evidence"]
    from pdscope.analysis.probe import Ceilings

    # The host's bandwidth moved 41% (17 then 24 GB/s): a remainder of 0.88 could be 1.24, so
    # no verdict; 0.39 stays under 0.9 however the host moved, so the verdict stands.
    moved = Ceilings("this machine", lambda n: 60.0, lambda n: None, "m", 1e8, [17.0, 24.0])
    near = _probe_traces([40.0, 41.0])
    near += [_trace("context-short", 64, 0.03, 43.0), _trace("context-long", 3068, 1.0, 34.0)]
    k = next(
        f
        for f in analyze(near, "pdscope", moved, model_bytes=mb)["findings"]
        if "context" in f["finding"]
    )
    assert k["finding"].endswith("no verdict on why") and "the host moving 41%" in k["evidence"]
    far = analyze(_probe_traces([40.0, 41.0], 15.2), "pdscope", moved, model_bytes=mb)
    j = next(f for f in far["findings"] if "context" in f["finding"])
    assert j["finding"].startswith("Decode slows with context far more than")


def test_a_context_slowdown_the_bytes_over_predict_is_not_called_explained() -> None:
    """A tiny model (316,160 bytes of weights, KV large beside them) kept 67% of its decode
    rate where the KV bytes alone predict a fall to 47%: the bytes over-predict the slowdown,
    and the finding said "the extra KV bytes explain it ... what remains (factor 1.43) is
    small" against "0 MB of weights". It says the decode slowed less than the bytes predict
    (not bandwidth-bound), with the weights in a unit that shows them; a spread that reaches
    past the tolerance above is no verdict, and a slowdown within it stays the bytes'."""
    from pdscope.analysis.probe import ModelBytes, analyze

    mb = ModelBytes("tiny", 7.9e4, 316_160, lambda n: 122.0 * n)

    def context(*long_tok_s: float) -> dict:
        traces = _probe_traces([40.0, 41.0]) + [_trace("context-short", 64, 0.03, 43.0)]
        traces += [_trace("context-long", 3068, 1.0, r) for r in long_tok_s]
        r = analyze(traces, "pdscope", model_bytes=mb)
        return next(f for f in r["findings"] if "ontext" in f["finding"])

    f = context(28.8)
    assert f["finding"].startswith("Decode slows with context less than its KV bytes predict")
    assert "not bandwidth-bound" in f["finding"] and "explain it" not in f["finding"]
    assert "predict a fall to 47%" in f["evidence"] and "kept 67%" in f["evidence"], f
    assert "1.43x the rate the bytes predict" in f["evidence"]
    assert "316.16 KB of weights" in f["evidence"] and " 0 MB" not in f["evidence"]
    # Repeats at 21.0 and 28.8 tok/s: the remaining factor lies at 1.04–1.43, across the
    # tolerance above 1 and never under 0.9: no verdict, and not attention compute.
    g = context(21.0, 28.8)
    assert g["finding"] == "Decode slows as context fills: no verdict on why", g
    assert "1.04–1.43" in g["evidence"] and "fixed per-step costs" in g["evidence"]
    assert "attention compute" not in g["evidence"]
    # Within 10% of the prediction either way: the bytes explain it, as before.
    h = context(20.5)
    assert h["finding"] == "Decode slows as context fills: the extra KV bytes explain it", h
    assert "what remains (factor 1.02) is small" in h["evidence"]


def test_a_context_verdict_the_sweep_contradicts_is_withheld() -> None:
    """Two probes of a 7B-shaped model on 2 CPU cores (13.21 GB of weights, 512 KiB of KV a
    token), the host's speed moving by the minute: one read 2.7 tok/s at 64 tokens and 2.8 at
    1,536 ("barely moves") while its sweep fell from 3.7 at 200 tokens to 2.6 at 1,952; the
    other 3.5 and 2.5 ("far more than its KV bytes explain") while its sweep read 2.5 and 2.14.
    A step's time grows in a line with its context, so the check's fall predicts the sweep's
    at its own lengths: where the two are more than 15% apart there is no verdict. Where they
    agree (a clean run whose attention costs more than its bytes, read over other lengths),
    or the sweep's longest point is far from the check's, the verdict stands."""
    from pdscope.analysis.probe import ModelBytes, analyze

    mb = ModelBytes("7b", 6.74e9, 13.21e9, lambda n: 524_288.0 * n)

    def context(sweep: tuple[float, float], check: tuple[float, float], long: int = 1952):
        traces = [_trace("sweep", 200, 6.0, sweep[0]), _trace("sweep", long, 60.0, sweep[1])]
        traces += [_trace("context-short", 64, 2.0, check[0])]
        traces += [_trace("context-long", 1536, 49.0, check[1])]
        r = analyze(traces, "pdscope", model_bytes=mb)
        return next(f for f in r["findings"] if "ontext" in f["finding"])

    no_verdict = "Decode against context length: no verdict"
    f = context((3.7, 2.6), (2.7, 2.8))
    assert f["finding"] == no_verdict, f
    assert (
        "at 200 and 1,952 tokens, read at another moment, kept 70% where this fall "
        in f["evidence"]
    )
    assert "predicts 104% there (49% apart, more than 15%)" in f["evidence"], f
    assert context((2.6, 2.5), (2.7, 2.8))["finding"] == "Decode barely moves with context length"
    g = context((2.5, 2.14), (3.5, 2.5))
    assert g["finding"] == no_verdict and "kept 86% where this fall predicts 69%" in g["evidence"]
    far = context((2.5, 2.14), (3.5, 2.5), long=2600)  # 1.7x the check's 1,536 tokens
    assert far["finding"].startswith("Decode slows with context far more than"), far
    # A clean run: the check's 72% over 64-1,536 tokens predicts 69% over 200-1,952.
    agree = context((3.6, 2.5), (3.5, 2.5))
    assert agree["finding"].startswith("Decode slows with context far more than"), agree
    # A fall steeper than a line through the two contexts allows (40 to 1 tok/s): no slope,
    # no second reading, and no division by zero on the way.
    steep = context((3.6, 2.5), (40.0, 1.0))
    assert steep["finding"].startswith("Decode slows with context far more than"), steep


def test_a_server_carried_fewer_only_when_clearly_fewer() -> None:
    """A server's slots show as clearly fewer streams decoding together than were sent; one
    fewer (a loaded client reading a fast server: CI read 7 of 8 and skipped the sweep's 32)
    and none read (failed) say nothing."""
    from pdscope.commands.probe import carried_fewer

    assert [carried_fewer(c, n) for c, n in ((4, 8), (6, 8), (24, 32), (1, 4))] == [True] * 4
    assert [carried_fewer(c, n) for c, n in ((7, 8), (8, 8), (0, 8), (1, 2))] == [False] * 4


def _prober(**kw: Any) -> Any:
    """A Prober over nothing: its limits read only its traces and settings."""
    from pdscope.client.detect import Runtime
    from pdscope.commands.probe import Prober

    runtime = Runtime("http://u", "vllm", "openai-completions", ["m"])
    s = ProbeSettings(url="http://u", **kw)
    return Prober(s, None, runtime, "m", lambda label: None, None)  # type: ignore[arg-type]


def test_a_request_the_servers_rates_predict_long_is_allowed_for_it() -> None:
    """The figures of a 7B-shaped model served on 2 CPU cores (Zen 4): prefill ~31 tok/s (a
    1,952-token prompt's first token at 63 s), one stream's step 0.37 s, 8 streams' 0.41 s.
    Under the old 120 s limit all 32 streams of the batch sweep's 32 timed out, and 6 of the 8
    streams of 1,024-token prompts. Each request is allowed 3x what the rates read predict
    where that is over 120 s: the prompts of every stream sent with it at the median prefill
    rate of requests sent alone (of 128 tokens or more), then a step a token, the tightest
    bound the steps read give (8 streams' step x 32 / 8); before anything is read, 120 s;
    --timeout is one limit for all."""
    from pdscope.commands.probe import TIMEOUT_MARGIN, TIMEOUT_S

    def limit(predicted_s: float) -> float:
        return max(TIMEOUT_S, math.ceil(TIMEOUT_MARGIN * predicted_s))

    prober = _prober()
    assert prober.allowed_s(1952, 64) == TIMEOUT_S  # nothing read yet
    hit = _trace("sweep", 1952, 0.5, 1 / 0.37)
    hit.cached_tokens = 1936  # a prefix-cache hit: no prefill rate
    prober.traces += [
        _trace("sweep", 200, 6.2, 1 / 0.27),
        _trace("sweep", 1000, 31.0, 1 / 0.30),
        _trace("sweep", 1952, 63.0, 1 / 0.37),
        _trace("context-short", 64, 20.0, 1 / 0.30),  # a short prompt: not a rate
        _trace("cold", 200, 60.0, 0.1),  # a cold start (a model loaded): not a rate
        _trace("batch-decode", 64, 30.0, 0.1),  # behind other streams' prompts: not a rate
        hit,
    ]
    per_token, one_s = 31.0 / 1000, 0.37  # the median of 31, 31 and 32.3 ms a token
    assert prober.allowed_s(200, 4) == TIMEOUT_S  # 7.7 s predicted: the default stands
    assert prober.allowed_s(1952, 64) == limit(1952 * per_token + 64 * one_s) > TIMEOUT_S
    batch_s = prober.allowed_s(64, 64, together=8)  # no batch read: one stream's step x 8
    assert batch_s == limit(8 * 64 * per_token + 64 * 8 * one_s)
    prober.batch_step_s[8] = 0.41
    sweep_s = prober.allowed_s(64, 64, together=32)
    assert sweep_s == limit(32 * 64 * per_token + 64 * 0.41 * 4) > 2 * 130  # it needed ~130 s
    # the tighter bound: 8 streams' step, not one stream's x 2
    assert prober.allowed_s(64, 256, together=2) == limit(2 * 64 * per_token + 256 * 0.41)
    joined = prober.allowed_s(64, 64, together=8, more_prefill=1152)
    assert joined == limit((8 * 64 + 1152) * per_token + 64 * 0.41)
    fixed = _prober(timeout_s=45.0)
    fixed.traces, fixed.batch_step_s = prober.traces, prober.batch_step_s
    assert fixed.allowed_s(64, 64, together=32) == fixed.allowed_s(1, 1) == 45.0
    # Every answer came whole (a buffering proxy): no step read, the prefill still predicts.
    whole = _prober()
    whole.traces = [_trace("sweep", 1952, 63.0, 1.0, n=1), _trace("sweep", 1000, 31.0, 1.0, n=1)]
    assert whole.allowed_s(8192, 64) == limit(8192 * (31.0 / 1000 + 63.0 / 1952) / 2)


def test_the_time_left_is_what_is_planned_and_unanswered_at_the_rates_read() -> None:
    """A probe of a slow server can run an hour: after each answer the progress line says
    what the rates read so far predict for the rest. Each check not yet answered at the rate
    its limit reads (a group sent together once, its unanswered share), the warm prefix
    requests as hits (their tail alone to prefill); nothing before a prefill rate is read.
    The plan is the one the progress total counts."""
    from pdscope.commands.probe import PREFIX_PAIRS, PREFIX_TAIL_TOKENS

    prober = _prober(prompt_tokens=[1000], repeats=1, batch_streams=0)
    assert prober.planned_requests() == 1 + 1 + 2 * PREFIX_PAIRS + 4
    assert prober.left_s() is None
    prober.traces.append(_trace("cold", 1000, 60.0, 10.0))  # a cold start: not a rate
    assert prober.left_s() is None
    prober.traces.append(_trace("sweep", 1000, 10.0, 10.0))  # 10 ms a prompt token, 0.1 s a step
    out_s, tail = 64 * 0.1, PREFIX_TAIL_TOKENS
    prefix_s = PREFIX_PAIRS * ((1000 + tail) * 0.01 + out_s + tail * 0.01 + out_s)
    context_s = 2 * (64 * 0.01 + out_s) + 2 * (3072 * 0.01 + out_s)
    assert prober.left_s() == pytest.approx(prefix_s + context_s)
    for label in ("prefix-cold", "prefix-warm") * PREFIX_PAIRS + ("context-short",):
        prober.traces.append(_trace(label, 1000 if label == "prefix-cold" else 64, 10.0, 10.0))
    assert prober.left_s() == pytest.approx(context_s - (64 * 0.01 + out_s))
    # a resend's first answer is not an answer of its check: while the resend runs, nor once
    # it is relabelled
    first = _trace("context-long", 3072, 30.72, 10.0)
    prober.traces.append(first)
    prober.resending.add(id(first))
    assert prober.left_s() == pytest.approx(context_s - (64 * 0.01 + out_s))
    prober.resending.clear()
    first.label += UNREAD
    assert prober.left_s() == pytest.approx(context_s - (64 * 0.01 + out_s))
    for label in ("context-long", "context-short", "context-long"):
        prober.traces.append(_trace(label, 3072, 30.72, 10.0))
    assert prober.left_s() == 0.0

    # Sent together: a batch of 8 once, and of it the share not answered.
    batched = _prober(prompt_tokens=[1000], repeats=1, batch_sweep=[2])
    done = ["cold", "sweep"] + ["prefix-cold", "prefix-warm"] * PREFIX_PAIRS
    done += ["context-short", "context-long"] * 2
    batched.traces = [_trace(label, 1000, 10.0, 10.0) for label in done]
    assert batched.planned_requests() == len(done) + 8 + 8 + 2 + 8 + 2  # short, long, x2, join
    before = batched.left_s()
    batched.traces += [_trace("batch-decode", 64, 2.0, 10.0) for _ in range(4)]
    half = batched.predicted_s(64, 64, together=8) / 2
    assert before is not None and batched.left_s() == pytest.approx(before - half)

    from pdscope.report.units import fmt_left

    assert fmt_left(None) == fmt_left(0.0) == ""
    assert fmt_left(30) == "under a minute left" and fmt_left(725) == "up to about 12 min left"
    assert fmt_left(7200) == "up to about 2 h left"
    assert fmt_left(7800) == "up to about 2 h 10 min left"


def test_a_batch_a_server_ran_in_turns_bounds_a_step_by_its_turns() -> None:
    """8 short prompts a server decoded 4 at a time, each stream at 0.1 s a token: a token of
    every stream took 2 steps, so the bound for 8 streams is 0.2 s, not the streams' own
    0.1 s (which leaves their wait out); a batch of long prompts is not recorded beside them
    (its steps read its KV too)."""
    prober = _prober()

    def waves(prompt: int) -> list[Trace]:
        first = [_trace("batch-decode", prompt, 1.0, 10.0) for _ in range(4)]
        second = [_trace("batch-decode", prompt, 2.0, 10.0) for _ in range(4)]
        return first + second

    async def send(prompt: Any, asked: int, label: str, **kw: Any) -> Trace:
        return sent.pop()

    prober.prompt = lambda n: asyncio.sleep(0, result="p")
    prober.send = send
    sent = waves(64)
    assert asyncio.run(prober.batch(64, "batch-decode", 8)) == 4
    assert prober.batch_step_s == {8: pytest.approx(0.2)}
    sent = [_trace("batch-decode-long", 1024, 1.0, 1.0) for _ in range(8)]
    asyncio.run(prober.batch(1024, "batch-decode-long", 8))
    assert prober.batch_step_s == {8: pytest.approx(0.2)}


def test_a_slow_servers_batch_is_allowed_what_its_rates_predict(medium_server: Server) -> None:
    """On the embedded server, with the default limit set below what a batch of 8 streams of
    1,024 tokens needs (as 120 s was for the 7B-shaped model's batch of 32 on 2 cores): a
    limit fixed by --timeout fails every stream and says which limit, and the default, which
    allows what the rates read from a request sent alone predict, reads them all."""
    from pdscope.client.detect import detect
    from pdscope.commands import probe as probe_module
    from pdscope.commands.probe import Prober

    async def run(timeout_s: float | None, seed: int) -> list[Trace]:
        s = settings(medium_server.url, output_tokens=1024, timeout_s=60.0)
        async with httpx.AsyncClient() as client, session(fresh_connections=True) as streams:
            runtime = await detect(client, s.url, s.api, None)
            model = runtime.pick_model(None)
            prober = Prober(s, client, runtime, model, lambda _: None, streams, seed)
            solo = await prober.send(await prober.prompt(200), 200, "sweep")  # given 60 s
            assert solo.ok and solo.decode_tok_s, solo.error
            s.timeout_s = timeout_s
            await prober.batch(64, "batch-decode", 8)
            return prober.traces[1:]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(probe_module, "TIMEOUT_S", 0.3)
        fixed = asyncio.run(run(0.3, seed=1))
        allowed = asyncio.run(run(None, seed=2))  # fresh prompts: no cache hit to read
    # no whole answer, or on a host that stalled them, no connection, within 0.3 s
    assert all((t.error or "").startswith("timeout: no ") for t in fixed), [t.error for t in fixed]
    assert all("within 0.3 s" in (t.error or "") for t in fixed)
    assert len(allowed) == 8 and all(t.ok for t in allowed), [t.error for t in allowed]
    assert max(t.e2e_s for t in allowed) > 0.3  # each needed more than the default


def join_trace(label: str, times: list[float], prompt: int, start_s: float = 0.0) -> Trace:
    """A join check's trace: one token a chunk at ``times``, the request begun at ``start_s``."""
    return Trace(
        "openai-completions", "u", "m", label=label, prompt_tokens_asked=prompt,
        prompt_tokens=prompt, output_tokens=len(times), max_tokens=len(times),
        start_s=start_s, end_s=times[-1], chunks=[Chunk(t, "x") for t in times],
        cached_tokens=0,
    )  # fmt: skip


def test_a_prompt_joining_decoding_streams_is_timed_in_their_step() -> None:
    """Streams decoding at 10 ms a step; a 128-token prompt's first token comes at the end of
    a 40 ms step they shared. The join step is the longest gap near it (a stream read 1 ms
    late still finds it), every stream decoding then counts, one that had ended does not, and
    two prompts whose first tokens came in one step are left out."""
    from pdscope.analysis.probe import JOIN_LABEL, JOIN_NEW_LABEL, join_steps

    trace = join_trace

    def stream(late_s: float = 0.0, until: int = 30) -> Trace:
        times = [0.1 + 0.01 * k for k in range(11)]  # tokens 0..10, the 10th at 0.2 s
        times += [0.24 + 0.01 * k for k in range(until - 10)]  # the joint step ends at 0.24
        return trace(JOIN_LABEL, [t + (late_s if i == 11 else 0) for i, t in enumerate(times)], 64)

    ended = trace(JOIN_LABEL, [0.05, 0.06, 0.07], 64)
    streams = [stream(), stream(), stream(late_s=0.001), ended]
    new = trace(JOIN_NEW_LABEL, [0.2405, 0.25], 128)
    (step,) = join_steps([*streams, new])
    assert step.prompt_tokens == 128 and step.contexts == [75, 75, 75]  # token 11: 64 + 11
    assert step.step_s == pytest.approx(0.04)
    assert step.decode_step_s == pytest.approx(0.01)
    other = trace(JOIN_NEW_LABEL, [0.2407, 0.25], 1024)
    assert join_steps([*streams, new, other]) == []
    # A stream the client read in bursts (its tokens 1-10 came in one read, at 0.2 s) was
    # decoding in that step, but its gaps time the client: it counts and gives no gap.
    bursty = stream()
    for chunk in bursty.chunks[1:11]:
        chunk.t_s = 0.2 - 1e-6
    assert bursty.read_in_bursts
    (step,) = join_steps([*streams, bursty, new])
    assert step.contexts == [75] * 4 and step.step_s == pytest.approx(0.04)
    assert step.decode_step_s == pytest.approx(0.01) and step.steady_streams == 3
    assert join_steps([stream(), bursty, new]) == []  # one stream read steadily: no median


def test_the_join_step_is_the_gap_that_can_hold_the_prefill() -> None:
    """Streams decoding at 10 ms a step; the client read their token at 0.2 s and began a
    128-token prompt's request 12 ms later (a loaded client's delay, over a step), and the
    server, which had waited, ran its prefill in the very next step (token 11 at 0.24 s, the
    prompt's first token with it, its second a step later). That step is the join step, not
    the one after (a rule on when the request began would have left it out). A stream whose
    text was held back around the join has no gap that can hold the prefill: it gives none,
    whether its hold began long before the request or just before it."""
    from pdscope.analysis.probe import JOIN_LABEL, JOIN_NEW_LABEL, join_steps

    trace = join_trace
    before = [0.1 + 0.01 * k for k in range(11)]  # tokens 0..10, the 10th at 0.2 s
    times = before + [0.24 + 0.01 * k for k in range(20)]
    streams = [trace(JOIN_LABEL, times, 64) for _ in range(3)]
    new = trace(JOIN_NEW_LABEL, [0.2405, 0.2502], 128, start_s=0.212)
    (step,) = join_steps([*streams, new])
    assert step.step_s == pytest.approx(0.04) and step.contexts == [75] * 3  # token 11
    # The first token read 4 ms late, the second with the streams' next token: the same step.
    late = trace(JOIN_NEW_LABEL, [0.244, 0.2502], 128, start_s=0.212)
    assert join_steps([*streams, late])[0].step_s == pytest.approx(0.04)
    after = [0.5 + 0.01 * k for k in range(10)]
    for held in (before[:6] + after, before + after):  # held from 0.15 s, or from 0.2 s
        (step,) = join_steps([*streams, trace(JOIN_LABEL, held, 64), new])
        assert step.step_s == pytest.approx(0.04) and step.steady_streams == 3
        assert join_steps([streams[0], trace(JOIN_LABEL, held, 64), new]) == []  # one gap
    # The server counted 2 tokens and the client got 1 chunk: the first token's text may
    # have been held back, and the chunk be the second's, a step late. No step is read.
    ambiguous = trace(JOIN_NEW_LABEL, [0.2505], 128, start_s=0.212)
    ambiguous.output_tokens = 2
    assert join_steps([*streams, ambiguous]) == []
    # One token, one chunk: nothing bounds the join step's end; no step is read.
    single = trace(JOIN_NEW_LABEL, [0.2405], 128, start_s=0.212)
    assert join_steps([*streams, single]) == []


def test_a_batched_step_that_reads_faster_than_one_stream_says_why() -> None:
    """Two streams decoding together at 0.228 ms a step printed "0 ms" and "0.69x one
    stream's" bare: a batched step is never cheaper than one stream's. The median gap shows
    in a unit that keeps its digits, a ratio under 1 carries the caveat of how it is computed
    (the batch's median gap against one stream's mean step, measured alone at another
    moment), and streams the client read in bursts are counted and named."""
    import io

    from rich.console import Console

    from pdscope.analysis.probe import batch_decode
    from pdscope.report.probe import _against_one_stream, render_probe

    def stream(gaps_s: list[float]) -> Trace:
        chunks = [Chunk(0.01, "x")]
        for gap in gaps_s:
            chunks.append(Chunk(chunks[-1].t_s + gap, "x"))
        n = len(chunks)
        return Trace(
            "openai-completions", "u", "m", label="batch-decode", prompt_tokens_asked=64,
            prompt_tokens=64, output_tokens=n, max_tokens=n, start_s=0.0,
            end_s=chunks[-1].t_s, chunks=chunks, cached_tokens=0,
        )  # fmt: skip

    steady = [stream([0.000228] * 16) for _ in range(2)]
    # One stream at 0.33 ms a step alone: 3,030 tok/s.
    batch = batch_decode(steady, {"decode_tok_s": 1 / 0.00033})
    assert batch is not None and batch["itl_ms"] == pytest.approx(0.228)
    assert batch["bursty_streams"] == 0 and batch["step_over_one_stream"] == pytest.approx(
        0.69, abs=0.01
    )
    caveat = _against_one_stream(batch)
    assert caveat.startswith(", 0.69x one stream's") and "another moment" in caveat
    assert "median gap" in caveat and "bursts" not in caveat
    slower = {**batch, "step_over_one_stream": 1.4}
    assert _against_one_stream(slower) == ", 1.40x one stream's"
    # Streams read in bursts: their tokens came microseconds apart after a wait. Their gaps
    # (45 of 80 here) would make the median; they are left out of it, and counted.
    bursty = [stream([0.003] + [0.000002] * 15) for _ in range(3)]
    mixed = batch_decode([*steady, *bursty], {"decode_tok_s": 1 / 0.00033})
    assert mixed is not None and mixed["bursty_streams"] == 3
    assert mixed["itl_ms"] == pytest.approx(0.228) and mixed["tpot_ms"] == pytest.approx(0.228)
    assert mixed["decoding_together"] == 5  # their windows still count
    unread = batch_decode(bursty, {"decode_tok_s": 1 / 0.00033})
    assert unread is not None and unread["bursty_streams"] == 3
    assert unread["itl_ms"] is None and unread["step_over_one_stream"] is None
    # A stream whose whole response came in one read has no gaps: left out too. A CI run's
    # batch of 128-token prompts had only such streams and bursty ones, and printed no line.
    one_read = stream([0.0] * 15)
    assert not one_read.streamed and not one_read.read_in_bursts
    none_steady = batch_decode([*bursty, one_read], {"decode_tok_s": 1 / 0.00033})
    assert none_steady is not None and none_steady["itl_ms"] is None
    assert none_steady["bursty_streams"] == 3 and none_steady["one_read_streams"] == 1
    assert none_steady["tpot_ms"] is None
    # Streams each in a few reads of several tokens (too few gaps to call bursts): a median
    # gap of 0 is no step.
    few_reads = [stream([0.0, 0.0, 0.003]) for _ in range(2)]
    assert not any(t.read_in_bursts for t in few_reads)
    zero = batch_decode(few_reads, {"decode_tok_s": 1 / 0.00033})
    assert zero is not None and zero["itl_ms"] is None and zero["step_over_one_stream"] is None
    also = batch_decode([*steady, one_read], {"decode_tok_s": 1 / 0.00033})
    assert also is not None and also["itl_ms"] == pytest.approx(0.228)
    assert also["one_read_streams"] == 1 and also["bursty_streams"] == 0

    result = {
        "runtime": {"url": "u", "name": "pdscope", "evidence": ["e"], "api": "openai"},
        "model": "m",
        "settings": {"repeats": 1, "output_tokens": 16, "exact_prompt_tokens": True},
        "sweep": [],
        "prefill_tok_s": None,
        "decode_tok_s": None,
        "prefill_to_decode_ratio": None,
        "decode_slope_tok_s_per_1k_prompt": None,
        "batch_decode": batch,
        "findings": [],
        "failures": [],
    }
    out = io.StringIO()
    render_probe(result, Console(file=out, width=200))
    line = next(x for x in out.getvalue().splitlines() if x.startswith("batched decode"))
    assert "tokens of context 228.0 µs, 0.69x one stream's" in line, line
    assert " 0 ms" not in line and "bursts" not in line
    for batch, said in (
        (
            mixed,
            "228.0 µs (left out: 3 of 5 streams read in bursts), 0.69x one stream's",
        ),
        (unread, "step unread (no stream read steadily: 3 of 3 streams read in bursts: their"),
        (
            none_steady,
            "(no stream read steadily: 3 of 4 streams read in bursts, 1 of 4 came whole: their",
        ),
        (also, "(left out: 1 of 3 streams came whole)"),
        (zero, "step unread (the steady streams' median gap was 0: their timing is the client's"),
    ):
        out = io.StringIO()
        render_probe({**result, "batch_decode": batch}, Console(file=out, width=200))
        text = " ".join(out.getvalue().split())  # the caveat may wrap the line
        assert said in text, text


def test_a_loaded_clients_batched_steps_are_read_from_its_steady_streams() -> None:
    """A real probe of the tiny model (AMD EPYC, 2 cores; the probing process pinned to a core
    shared with a busy loop): one stream's step took 0.27-0.34 ms alone, and the batched
    check read 0.050 ms a step over its 4 streams, the 2-stream point 0.0 ms: every one of
    their streams was read in bursts, whose gaps of microseconds measure the client. Those
    points now read no step; the others read theirs from the streams read steadily, and none
    reads a batched step faster than one stream's."""
    import gzip

    from pdscope.analysis.probe import analyze
    from pdscope.report.probe import _batch_curve

    probe = json.loads(
        gzip.decompress((Path(__file__).parent / "data" / LOADED_PROBE).read_bytes())
    )
    r = analyze([Trace.from_dict(t) for t in probe["traces"]], "pdscope")
    points = [r["batch_decode"], r["batch_decode_long"], *r["batch_sweep"]]
    unread = [p for p in points if p["itl_ms"] is None]
    assert [(p["streams"], p["bursty_streams"]) for p in unread] == [(4, 4), (2, 2)]
    read = [p for p in points if p["itl_ms"] is not None]
    assert len(read) == 2 and all(0 < p["bursty_streams"] < p["streams"] for p in read)
    one_step_ms = 1e3 / r["context"]["short"]["decode_tok_s"]
    assert all(p["itl_ms"] > one_step_ms for p in read), (one_step_ms, read)
    # The report's line of steps by streams decoding together says the same.
    line = _batch_curve(r)
    assert line is not None, r
    assert "2: unread (no stream read steadily: 2 of 2 streams read in bursts)" in line, line
    assert "streams read in bursts)" in line.split("32: ")[1], line


def test_a_batch_curve_point_under_one_streams_step_carries_the_caveat() -> None:
    """The 7B-shaped model on 2 CPU cores: one stream 365.98 ms (the context check's), 2
    streams 234.99 ms, 8 streams 411.98 ms, read minutes apart while the host's speed moved.
    "2: 234.99 ms (0.64x)" printed bare; it carries the caveat now, and a curve at or over
    1x does not."""
    from pdscope.report.probe import _batch_curve

    def curve(two_ms: float) -> str:
        point = {"streams": 2, "bursty_streams": 0, "one_read_streams": 0}
        r = {
            "context": {"short": {"decode_tok_s": 1e3 / 365.98}},
            "batch_decode": {**point, "streams": 8, "decoding_together": 8, "itl_ms": 411.98},
            "batch_sweep": [{**point, "decoding_together": 2, "itl_ms": two_ms}],
        }
        line = _batch_curve(r)
        assert line is not None
        return line

    low = curve(234.99)
    assert "2: 234.99 ms (0.64x), 8: 411.98 ms (1.13x)" in low
    assert "no batched step cheaper than one stream's" in low
    assert "cheaper" not in curve(380.0)


def test_probe_cli_records_the_seed_fake(fake: str, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    args = ["probe", f"{fake}/vllm", "--prompt-tokens", "48", "--repeats", "1"]
    args += ["--output-tokens", "4", "--seed", "31337", "--json", str(out)]
    result = CliRunner().invoke(cli, args, env={"COLUMNS": "200"})
    data = json.loads(out.read_text())
    assert data["settings"]["seed"] == 31337 and data["settings"]["seed_given"]
    # The CLI's console keeps the width it was created with (another test may have set 80
    # columns first), so the line may wrap: compare with whitespace folded.
    assert "seed 31337 (given)" in " ".join(result.output.split())


def test_weights_already_at_four_bits_are_not_told_to_quantize() -> None:
    """A Q4_K_M GGUF at 55% of the bandwidth ceiling was told "more needs fewer bytes per
    token: use a Q4_K_M / Q5_K_M GGUF". Weights at a 4-bit format's width get no advice to
    quantize (near the ceiling: a smaller model or more bandwidth; below it: unpacking them is
    compute, so the threads), and the evidence says their width; wider ones still get it."""
    from pdscope.analysis.probe import Ceilings, analyze

    def decode_advice(bits: float, ceiling_tok_s: float) -> tuple[str, str]:
        c = Ceilings(
            "this machine", lambda n: ceiling_tok_s, lambda n: None, "m", 1e8, [40.0, 40.4],
            weight_bits=bits,
        )  # fmt: skip
        r = analyze(_probe_traces([40.0, 41.0]), "llama.cpp", c)
        (f,) = [f for f in r["findings"] if "bandwidth ceiling" in f["finding"]]
        return f["evidence"], f["action"]

    for ceiling_tok_s in (50.0, 70.0):  # 80% and 57% of it
        evidence, advice = decode_advice(4.9, ceiling_tok_s)
        assert "already 4.9 bits each" in evidence and "Q4_K_M" not in advice
        evidence, advice = decode_advice(16.0, ceiling_tok_s)
        assert "bits each" not in evidence and "use a Q4_K_M / Q5_K_M GGUF" in advice
    assert "-t threads" in decode_advice(4.9, 70.0)[1]
    assert decode_advice(4.9, 50.0)[1] == "a smaller model, or more memory bandwidth"
    # a Q5_K_M (5.7 bits) is as light; a Q6_K (6.56) is still told of Q4_K_M
    assert "Q4_K_M" not in decode_advice(5.7, 70.0)[1]
    assert "use a Q4_K_M / Q5_K_M GGUF" in decode_advice(6.56, 70.0)[1]


def buffering_proxy(upstream: str, whole: int) -> FastAPI:
    """A reverse proxy in front of a real server that hands its first ``whole`` streamed
    generations to the client in one piece, as nginx does with proxy_buffering on; the rest
    it relays as they come. Everything else it forwards as it is."""
    app = FastAPI()
    left = [whole]

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(request: Request, path: str) -> Response:
        body = await request.body()
        url = f"{upstream}/{path}" + (f"?{request.url.query}" if request.url.query else "")
        headers = {
            k: v for k, v in request.headers.items() if k in ("content-type", "authorization")
        }
        streamed = request.method == "POST" and path.endswith(("completions", "generate", "chat"))
        streamed = streamed and json.loads(body).get("stream", path.startswith("api/")) is True
        if streamed and left[0] == 0:

            async def relay() -> AsyncIterator[bytes]:
                async with (
                    httpx.AsyncClient(timeout=60) as client,
                    client.stream("POST", url, content=body, headers=headers) as r,
                ):
                    async for piece in r.aiter_raw():
                        yield piece

            return StreamingResponse(relay(), media_type="text/event-stream")
        if streamed:
            left[0] -= 1
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.request(request.method, url, content=body, headers=headers)
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    return app


def test_a_decode_read_whole_is_sent_again_fresh(
    medium_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind a proxy that buffers the first two streams (the cold request and the first
    decode check), that check is sent again with a fresh prompt and every figure is measured;
    the unread response is kept, labelled, and named in a note. Behind one that buffers every
    stream, the resends stop at RESENDS and the decode checks are left unmeasured."""
    from pdscope.client.trace import UNREAD
    from pdscope.commands.probe import RESENDS

    kw = {"prompt_tokens": [100, 400], "repeats": 1, "output_tokens": 32, "batch_streams": 0}
    # Room for more resends than the one by design: the relay shares this process's GIL and
    # two busy cores, and can hand over a later stream in bursts now and then.
    monkeypatch.setattr("pdscope.commands.probe.RESENDS", 20)
    with serving(buffering_proxy(medium_server.url, whole=2)) as url:
        r = asyncio.run(probe(settings(url, **kw)))
    traces = [Trace.from_dict(t) for t in r["traces"]]
    assert traces[0].label == "cold" and not traces[0].streamed  # reported apart, not resent
    unread = [t for t in traces if t.label.endswith(UNREAD)]
    first = unread[0]  # the buffered one; any later are streams the relay handed in bursts
    assert first.label == "sweep" + UNREAD and first.prompt_tokens == 100
    assert first.ok and not first.streamed
    assert all(not t.streamed or t.read_in_bursts for t in unread)
    assert all(
        t.label.removesuffix(UNREAD) in ("sweep", "context-short", "context-long") for t in unread
    )
    assert not r["unmeasured"], r["unmeasured"]
    assert all(p["decode_tok_s"] for p in r["sweep"]) and r["context"]["long_over_short"]
    assert any(n.startswith(f"{len(unread)} response(s) whose decode") for n in r["notes"])
    assert [t.prompt_tokens for t in traces if t.label == "sweep"] == [100, 400]

    monkeypatch.setattr("pdscope.commands.probe.RESENDS", RESENDS)
    with serving(buffering_proxy(medium_server.url, whole=10_000)) as url:
        r = asyncio.run(probe(settings(url, **kw)))
    traces = [Trace.from_dict(t) for t in r["traces"]]
    assert sum(t.label.endswith(UNREAD) for t in traces) == RESENDS
    # past the resends, each decode check's one answer is kept as it came, and counted
    kept = [t for t in traces if t.label in ("sweep", "context-short", "context-long")]
    assert len(kept) == 6 and not any(t.streamed for t in kept)
    assert any(n.startswith("6 more response(s)") for n in r["notes"]), r["notes"]
    assert any(u.startswith("context check") for u in r["unmeasured"]), r["unmeasured"]


def test_a_prompt_that_stalls_the_streams_it_joins_is_a_finding() -> None:
    """The 7B-shaped model on 2 CPU cores: a 1,024-token prompt joining 8 decoding streams held
    their step 31.65 s against 337 ms, printed but not a finding. It is one, with the knob
    that splits a prefill over steps, where the step is 3x the streams' and a pause a reader
    sees; a 30 ms step beside 10 ms ones is neither. A timed-out failure names --timeout."""
    from pdscope.analysis.probe import findings

    def titles(*joins: tuple[int, float, float], failures: list | None = None) -> dict:
        r = {
            "sweep": [],
            "failures": failures or [],
            "prefill_join": [
                {"prompt_tokens": n, "decoding_together": 8, "step_ms": step, "decode_step_ms": d}
                for n, step, d in joins
            ],
        }
        return {f["finding"]: f for f in findings(r, "vllm")}

    stall = "A prompt joining running streams stalls them: prefill interrupts decode"
    found = titles((128, 4149.8, 337.0), (1024, 31649.7, 337.0))
    assert found[stall]["evidence"] == (
        "a 1,024-token prompt joining 8 decoding streams: their step 31.65 s against 337.00 ms "
        "without it (93.9x)"
    )
    assert "--max-num-batched-tokens" in found[stall]["action"]
    assert stall not in titles((1024, 30.0, 10.0))  # 3x, but no pause a reader sees
    assert stall not in titles((1024, 500.0, 250.0))  # a pause, but 2x the streams' own
    assert stall not in titles((128, 900.0, 100.0), (1024, 250.0, 100.0))  # the longest's
    timeout = "timeout: no whole answer within 120 s (--timeout)"
    failed = titles(failures=[{"error": timeout}])["1 request(s) failed and were left out"]
    assert failed["evidence"] == timeout and "--timeout SECONDS" in failed["action"]
    failed = titles(failures=[{"error": "HTTP 500: boom"}])["1 request(s) failed and were left out"]
    assert failed["action"] == "see the failures list"
