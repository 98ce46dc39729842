"""The bad-input matrix of docs/reliability.md: what `pdscope serve` does with what a careless
client, a web page and an attacker send.

Starts `pdscope serve --model tiny` on a free loopback port and sends every case once: malformed
and mistyped bodies on every JSON route, lone surrogates, oversized bodies and prompts, wrong
content types, cross-site origins, rebinding Host names, wrong methods, and clients that leave
mid-request. Per case it records the status and how long the answer took; a case that gets no
answer within its timeout counts as a hang. After each case /health must answer. At the end the
engine must hold nothing (running, waiting, KV use all 0) or the run counts a leak; RSS is read
from /proc before and after. One stream runs through the cases that send bodies, read by a
separate process (a thread here would share this process's GIL with the sender of a 100 MB
body); each case's worst inter-chunk gap of that stream is reported with it.

    .venv/bin/python bench/bad_input_matrix.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pdscope.server.launch import ServerProcess, start_server  # noqa: E402

JSON = {"Content-Type": "application/json"}
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/api/generate", "/api/chat"]


@dataclass
class Case:
    name: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    expect: str = "4xx"  # "4xx", "2xx" or "abort" (the client leaves; the request must end)
    timeout_s: float = 30.0


@dataclass
class Outcome:
    name: str
    path: str
    status: int | None
    seconds: float
    verdict: str  # "4xx", "2xx", "5xx", "hang", "abort-ok", "abort-leak", "error"
    detail: str = ""
    started_s: float = 0.0  # perf_counter: CLOCK_MONOTONIC, the same clock in every process
    stream_gap_ms: float | None = None


STREAMER = r"""
import sys, time, httpx
url = sys.argv[1]
body = {"prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
while True:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        last = time.perf_counter()
        for _ in r.iter_lines():
            now = time.perf_counter()
            print(f"{now:.6f} {now - last:.6f}", flush=True)
            last = now
"""


def _raw(obj: Any) -> bytes:
    return obj if isinstance(obj, bytes) else json.dumps(obj).encode()


def cases() -> list[Case]:
    out: list[Case] = []
    malformed: list[tuple[str, bytes]] = [
        ("not JSON", b"{not json"),
        ("empty body", b""),
        ("JSON array", b"[]"),
        ("JSON string", b'"hi"'),
        ("JSON null", b"null"),
        ("deep nesting", b"[" * 10_000 + b"]" * 10_000),
        ("NaN literal", b'{"prompt": NaN, "messages": NaN, "model": NaN}'),
        ("invalid UTF-8", b'{"prompt": "\xff\xfe"}'),
        ("lone surrogate", b'{"prompt": "a\\ud800b", "model": "tiny", "messages": "x"}'),
    ]
    for path in ROUTES:
        for name, body in malformed:
            out.append(Case(f"{name}", "POST", path, body))
    typed: list[tuple[str, str, Any]] = [
        ("/v1/completions", "prompt missing", {"max_tokens": 3}),
        ("/v1/completions", "prompt empty", {"prompt": ""}),
        ("/v1/completions", "prompt number", {"prompt": 5}),
        ("/v1/completions", "prompt ids negative", {"prompt": [1, -1]}),
        ("/v1/completions", "prompt ids beyond vocab", {"prompt": [10**9]}),
        ("/v1/completions", "two prompts", {"prompt": ["a", "b"]}),
        ("/v1/completions", "max_tokens string", {"prompt": "x", "max_tokens": "5"}),
        ("/v1/completions", "max_tokens 0", {"prompt": "x", "max_tokens": 0}),
        ("/v1/completions", "max_tokens huge", {"prompt": "x", "max_tokens": 10**12}),
        ("/v1/completions", "temperature -1", {"prompt": "x", "temperature": -1}),
        ("/v1/completions", "top_p 0", {"prompt": "x", "top_p": 0}),
        ("/v1/completions", "top_k -5", {"prompt": "x", "top_k": -5}),
        ("/v1/completions", "seed 2^64", {"prompt": "x", "seed": 2**64}),
        ("/v1/completions", "seed 1e300", {"prompt": "x", "seed": 1e300}),
        ("/v1/completions", "n 2", {"prompt": "x", "n": 2}),
        ("/v1/completions", "stop empty", {"prompt": "x", "stop": ""}),
        ("/v1/completions", "stop surrogate", {"prompt": "x", "stop": ["\ud800"]}),
        (
            "/v1/completions",
            "stop_token_ids beyond vocab",
            {"prompt": "x", "stop_token_ids": [10**9]},
        ),
        ("/v1/completions", "logprobs", {"prompt": "x", "logprobs": 5}),
        ("/v1/completions", "penalty", {"prompt": "x", "presence_penalty": 1}),
        ("/v1/completions", "stream string", {"prompt": "x", "stream": "yes"}),
        ("/v1/completions", "unknown model", {"prompt": "x", "model": "gpt-4"}),
        ("/v1/completions", "model surrogate", {"prompt": "x", "model": "\udc00"}),
        ("/v1/completions", "over context", {"prompt": "word " * 5000}),
        ("/v1/chat/completions", "messages empty", {"messages": []}),
        ("/v1/chat/completions", "messages string", {"messages": "hi"}),
        (
            "/v1/chat/completions",
            "role unknown",
            {"messages": [{"role": "wizard", "content": "x"}]},
        ),
        ("/v1/chat/completions", "content number", {"messages": [{"role": "user", "content": 5}]}),
        (
            "/v1/chat/completions",
            "text part 5",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        ),
        (
            "/v1/chat/completions",
            "text part null",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
        ),
        (
            "/v1/chat/completions",
            "image part",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
        ),
        (
            "/v1/chat/completions",
            "content surrogate",
            {"messages": [{"role": "user", "content": "\ud83d"}]},
        ),
        (
            "/v1/chat/completions",
            "max_tokens over context",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
        ),
        ("/tokenize", "empty object", {}),
        ("/tokenize", "prompt null", {"prompt": None}),
        ("/detokenize", "ids beyond vocab", {"tokens": [10**9]}),
        ("/detokenize", "ids negative", {"tokens": [-1]}),
        ("/detokenize", "ids strings", {"tokens": ["a"]}),
        ("/api/generate", "model missing", {"prompt": "hi"}),
        ("/api/generate", "unknown model", {"model": "llama3", "prompt": "hi"}),
        ("/api/generate", "options string", {"model": "tiny", "prompt": "hi", "options": "x"}),
        (
            "/api/generate",
            "num_predict string",
            {"model": "tiny", "prompt": "hi", "options": {"num_predict": "5"}},
        ),
        (
            "/api/generate",
            "seed 2^70",
            {"model": "tiny", "prompt": "hi", "options": {"seed": 2**70}},
        ),
        ("/api/chat", "messages empty", {"model": "tiny", "messages": []}),
        (
            "/api/chat",
            "text part",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}],
            },
        ),
        ("/api/show", "model number", {"model": 5}),
    ]
    for path, name, body in typed:
        out.append(Case(name, "POST", path, _raw(body)))
    ok = _raw({"prompt": "hi", "max_tokens": 2})
    gen = _raw({"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""):
        for path, body in (("/v1/completions", ok), ("/api/generate", gen)):
            out.append(
                Case(
                    f"content-type {ctype or 'none'}",
                    "POST",
                    path,
                    body,
                    {"Content-Type": ctype} if ctype else {},
                )
            )
    out += [
        Case(
            "cross-site origin",
            "POST",
            "/api/generate",
            gen,
            {**JSON, "Origin": "http://evil.example"},
        ),
        Case(
            "cross-site text/plain",
            "POST",
            "/api/generate",
            gen,
            {"Origin": "http://evil.example", "Content-Type": "text/plain"},
        ),
        Case("origin null", "POST", "/v1/completions", ok, {**JSON, "Origin": "null"}),
        Case(
            "rebinding Host",
            "POST",
            "/api/generate",
            gen,
            {**JSON, "Host": "rebind.attacker.example"},
        ),
        Case(
            "rebinding Host, GET",
            "GET",
            "/v1/models",
            None,
            {"Host": "rebind.attacker.example:8000"},
        ),
        Case(
            "evil preflight",
            "OPTIONS",
            "/v1/completions",
            None,
            {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        ),
        Case(
            "local preflight",
            "OPTIONS",
            "/v1/completions",
            None,
            {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
            expect="2xx",
        ),
        Case(
            "local origin",
            "POST",
            "/v1/completions",
            ok,
            {**JSON, "Origin": "http://127.0.0.1:5173"},
            expect="2xx",
        ),
        Case("GET on POST route", "GET", "/v1/completions", None, {}),
        Case("DELETE on GET route", "DELETE", "/api/tags", None, {}),
        Case("PUT", "PUT", "/v1/chat/completions", ok),
        Case("unknown route", "POST", "/v1/nothing", ok),
        Case("unknown Ollama route", "GET", "/api/nothing", None, {}),
    ]
    for size_mb in (1, 4, 9, 20, 100):
        body = b'{"prompt": "' + b"x" * (size_mb * 1_000_000) + b'"}'
        out.append(Case(f"{size_mb} MB prompt", "POST", "/v1/completions", body, timeout_s=60))
    big_chat = _raw({"messages": [{"role": "user", "content": "x " * 2_000_000}]})
    out.append(Case("4 MB chat", "POST", "/v1/chat/completions", big_chat, timeout_s=60))
    big_ids = _raw({"prompt": list(range(1000)) * 1000})
    out.append(Case("1M token ids", "POST", "/v1/completions", big_ids, timeout_s=60))
    long_ok = {"max_tokens": 1500, "ignore_eos": True}
    for path, body in (
        ("/v1/completions", {"prompt": "hi", **long_ok}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **long_ok}),
        (
            "/api/generate",
            {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 1500}},
        ),
        ("/v1/completions", {"prompt": "hi", "stream": True, **long_ok}),
        (
            "/api/chat",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "options": {"num_predict": 1500},
            },
        ),
    ):
        out.append(Case("client leaves", "POST", path, _raw(body), expect="abort"))
    return out


def metrics(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:") and " " in line:
            name = line.split("{")[0]
            if 'finished_reason="abort"' in line:
                name = "aborted"
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def _finished(m: dict[str, float]) -> float:
    return m.get("vllm:request_success_total", 0.0) + m.get("aborted", 0.0)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_idle(url: str, timeout_s: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(url)
        idle = m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def run_case(srv: ServerProcess, case: Case) -> Outcome:
    port = int(srv.url.rsplit(":", 1)[1])
    if case.expect == "abort":
        before = _finished(metrics(srv.url))
        head = f"{case.method} {case.path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in case.headers.items())
        head += f"Content-Length: {len(case.body or b'')}\r\n\r\n"
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head.encode() + (case.body or b""))
            deadline = time.monotonic() + 10
            while metrics(srv.url)["vllm:num_requests_running"] < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
        m = wait_idle(srv.url, 10)
        seconds = time.perf_counter() - t0
        # Ended and freed, and (as vLLM does with a request its client aborted) counted in no
        # finished-request series.
        idle = m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
        ok = idle and _finished(m) == before
        return Outcome(case.name, case.path, None, seconds, "abort-ok" if ok else "abort-leak")
    headers = dict(case.headers)
    t0 = time.perf_counter()
    try:
        r = httpx.request(
            case.method,
            f"{srv.url}{case.path}",
            content=case.body,
            headers=headers,
            timeout=case.timeout_s,
        )
    except httpx.TimeoutException:
        return Outcome(case.name, case.path, None, time.perf_counter() - t0, "hang")
    except httpx.HTTPError as exc:
        return Outcome(case.name, case.path, None, time.perf_counter() - t0, "error", repr(exc))
    seconds = time.perf_counter() - t0
    verdict = f"{r.status_code // 100}xx"
    detail = r.text[:160].replace("\n", " ")
    try:
        r.json()
    except ValueError:
        if r.status_code >= 400:
            detail = "NOT JSON: " + detail
    return Outcome(case.name, case.path, r.status_code, seconds, verdict, detail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every outcome here")
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp(prefix="pdscope-matrix-")) / "server.log"
    srv = start_server(
        "tiny", log, "--max-model-len", "2048", "--kv-cache-memory", "64MiB", name="tiny"
    )
    try:
        httpx.post(f"{srv.url}/v1/completions", json={"prompt": "warm", "max_tokens": 2})
        rss_before = rss_bytes(srv.process.pid)
        # One stream runs through the body cases, read in its own process.
        gap_log = log.with_name("stream_gaps.txt")
        with gap_log.open("w") as sink:
            streamer = subprocess.Popen([sys.executable, "-c", STREAMER, srv.url], stdout=sink)
        outcomes: list[Outcome] = []
        health_failures = 0
        for i, case in enumerate(cases()):
            if case.expect == "abort" and streamer.poll() is None:
                streamer.terminate()  # the abort cases count running requests: stream alone
                wait_idle(srv.url)
            t0 = time.perf_counter()
            outcome = run_case(srv, case)
            outcome.started_s = t0
            expected = {"4xx": "4xx", "2xx": "2xx", "abort": "abort-ok"}[case.expect]
            if outcome.verdict != expected:
                outcome.detail = f"EXPECTED {expected}; " + outcome.detail
            outcomes.append(outcome)
            if httpx.get(f"{srv.url}/health", timeout=10).status_code != 200:
                health_failures += 1
            print(
                f"{i + 1:3d} {outcome.verdict:10s} {outcome.status or '-':>4} "
                f"{outcome.seconds * 1e3:8.1f} ms  {case.path:22s} {case.name}",
                flush=True,
            )
        streamer.terminate()
        gaps = [tuple(map(float, line.split())) for line in gap_log.read_text().splitlines()]
        for o in outcomes:
            inside = [g for at, g in gaps if o.started_s <= at <= o.started_s + o.seconds + 0.1]
            o.stream_gap_ms = max(inside) * 1e3 if inside else None
        end = wait_idle(srv.url)
        time.sleep(1.0)
        rss_after = rss_bytes(srv.process.pid)
        leaked = (
            end["vllm:num_requests_running"]
            + end["vllm:num_requests_waiting"]
            + end["vllm:kv_cache_usage_perc"]
        )
        counts: dict[str, int] = {}
        for o in outcomes:
            counts[o.verdict] = counts.get(o.verdict, 0) + 1
        summary = {
            "cases": len(outcomes),
            "by_verdict": counts,
            "unexpected": [asdict(o) for o in outcomes if o.detail.startswith("EXPECTED")],
            "non_json_errors": sum(o.detail.startswith("NOT JSON") for o in outcomes),
            "health_failures": health_failures,
            "engine_left_holding": leaked,
            "rss_before_mib": rss_before / 2**20,
            "rss_after_mib": rss_after / 2**20,
            "stream_chunks": len(gaps),
            "stream_gap_ms_before_cases": max(g for at, g in gaps[5:20]) * 1e3,
            "worst_stream_gaps_ms": sorted(
                ((round(o.stream_gap_ms), o.path, o.name) for o in outcomes if o.stream_gap_ms),
                reverse=True,
            )[:6],
            "slowest_refusal_ms": max(o.seconds for o in outcomes if o.verdict == "4xx") * 1e3,
        }
        print(json.dumps(summary, indent=2))
        if args.json:
            args.json.write_text(
                json.dumps(
                    {"summary": summary, "outcomes": [asdict(o) for o in outcomes]}, indent=2
                )
            )
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
