"""Can one pdscope process hold 500 concurrent streams and still timestamp every chunk right?

A trivial SSE server (raw asyncio, its own process) streams completions whose every chunk
carries the server's `time.perf_counter()` at the moment it was written. perf_counter is
CLOCK_MONOTONIC on Linux, one clock for every process on the machine, so the client's receive
time minus the server's send time is the delivery delay our client adds (loopback + event loop).
The client is pdscope's own load generator and SSE adapter, as `pdscope bench` uses them.

    .venv/bin/python bench/client_capacity.py [--streams 500] [--chunks 50] [--gap-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

SERVER = r"""
import asyncio, json, sys, time
CHUNKS, GAP = int(sys.argv[2]), float(sys.argv[3])

async def handle(reader, writer):
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
    start = time.perf_counter()
    for i in range(CHUNKS):
        # Sleep to an absolute schedule so the server's own lateness does not accumulate.
        await asyncio.sleep(max(0.0, start + (i + 1) * GAP - time.perf_counter()))
        event = {"choices": [{"index": 0, "text": repr(time.perf_counter()),
                              "finish_reason": "length" if i == CHUNKS - 1 else None}]}
        writer.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await writer.drain()
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": CHUNKS}}
    writer.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    await writer.drain()
    writer.close()

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), backlog=2048)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


async def load(url: str, streams: int) -> tuple[list, float]:
    from pdscope.client.adapters import session
    from pdscope.client.load import LoadPlan, run_load
    from pdscope.client.workloads import RequestSpec

    async with session(timeout_s=120) as client:
        specs = [RequestSpec("x", 1) for _ in range(streams)]
        result = await run_load(client, url, "openai-completions", "m", specs, LoadPlan())
    return result.traces, result.duration_s


async def load_httpx(url: str, streams: int) -> list[list[tuple[float, float]]]:
    """The same streams through httpx (what pdscope used before): (received, sent) per chunk."""
    import httpx

    async def one(client: httpx.AsyncClient) -> list[tuple[float, float]]:
        chunks, pending = [], b""
        async with client.stream("POST", url + "/v1/completions", json={"prompt": "x"}) as r:
            async for data in r.aiter_raw():
                now = time.perf_counter()
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if line.startswith(b"data: {"):
                        for c in json.loads(line[6:]).get("choices") or []:
                            chunks.append((now, float(c["text"])))
        return chunks

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        return await asyncio.gather(*(one(client) for _ in range(streams)))


def _delays(pairs: list[tuple[float, float]]) -> dict[str, float]:
    d = [(recv - sent) * 1e3 for recv, sent in pairs]
    q = statistics.quantiles(d, n=100)
    return {"p50": round(q[49], 3), "p99": round(q[98], 3), "max": round(max(d), 3)}


def main() -> None:
    from pdscope.server.launch import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--chunks", type=int, default=50)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--uvloop", action="store_true", help="needs `pip install uvloop`")
    parser.add_argument(
        "--compare-httpx",
        action="store_true",
        help="also run the same streams through httpx, before ours",
    )
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port), str(args.chunks), str(args.gap_ms / 1e3)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        httpx_pairs = []
        if args.compare_httpx:
            runs = asyncio.run(load_httpx(f"http://127.0.0.1:{port}", args.streams))
            httpx_pairs = [pair for run in runs for pair in run]
        if args.uvloop:
            import uvloop

            traces, duration = uvloop.run(load(f"http://127.0.0.1:{port}", args.streams))
        else:
            traces, duration = asyncio.run(load(f"http://127.0.0.1:{port}", args.streams))
    finally:
        server.terminate()
    ok = [t for t in traces if t.ok]
    delays = [(c.t_s - float(c.text)) * 1e3 for t in ok for c in t.chunks]
    gaps = [(b.t_s - a.t_s) * 1e3 for t in ok for a, b in zip(t.chunks, t.chunks[1:], strict=False)]
    q = statistics.quantiles(delays, n=100)
    g = statistics.quantiles(gaps, n=100)
    print(
        json.dumps(
            {
                "streams": args.streams,
                "completed": len(ok),
                "failed": len(traces) - len(ok),
                "chunks_per_stream": args.chunks,
                "server_gap_ms": args.gap_ms,
                "chunks_received": len(delays),
                "duration_s": round(duration, 2),
                "delivery_delay_ms": {
                    "p50": round(q[49], 3),
                    "p99": round(q[98], 3),
                    "max": round(max(delays), 3),
                },
                "measured_gap_ms": {
                    "p50": round(g[49], 3),
                    "p1": round(g[0], 3),
                    "p99": round(g[98], 3),
                },
                "usage_tokens_read": sum(t.output_tokens or 0 for t in ok),
                **(
                    {
                        "httpx_delivery_delay_ms": _delays(httpx_pairs),
                        "httpx_p99_over_ours": round(_delays(httpx_pairs)["p99"] / q[98], 1),
                    }
                    if httpx_pairs
                    else {}
                ),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
