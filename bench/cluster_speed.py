"""How fast a simulated cluster runs: simulated requests per wall second for R replicas behind a
router (issue 15's floor: 16 replicas x 50,000 requests in <= 2 minutes), beside one replica
with 1/R of the requests at 1/R of the rate in the same process, so the ratio shows what the
cluster's event queue and router add to the single simulator's cost per request.

    python bench/cluster_speed.py [--replicas 16] [--requests 50000] [--rate-per-replica 30]
"""

from __future__ import annotations

import argparse
import os
import random
import time

from pdscope.engine.cluster import Cluster, WorkerSpec
from pdscope.engine.scheduler import SchedulerConfig
from pdscope.engine.simulator import SimRequest, Simulator
from pdscope.roofline.step_cost import CostModel, CostParams
from pdscope.specs import get_kv_precision, get_weight_precision, load_model, resolve_device
from pdscope.specs.local import cpu_model


def workload(n: int, rate: float, seed: int) -> list[SimRequest]:
    """Poisson arrivals, input 1,000 +/- 50%, output 200 +/- 50% (issue 14's speed workload)."""
    rng = random.Random(seed)
    t, specs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = [i * 10_000 + j for j in range(rng.randint(500, 1500))]
        specs.append(SimRequest(prompt, rng.randint(100, 300), arrival_s=t))
    return specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--rate-per-replica", type=float, default=30.0)
    parser.add_argument("--router", default="least-loaded")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = resolve_device("h100-sxm")
    params = CostParams(device.bandwidth_gb_s, device.tflops_bf16, step_overhead_s=0.002)
    cost = CostModel(
        load_model("llama-3.1-8b"), get_weight_precision("bf16"), get_kv_precision("bf16"), params
    )
    spec = WorkerSpec(
        SchedulerConfig(8192, 256, max_model_len=4096),
        num_blocks=25_000,
        block_size=16,
        step_seconds=lambda out: cost.step(out.scheduled).seconds,
    )
    r = args.replicas
    one_n = max(1, args.requests // r)
    print(f"cpu: {cpu_model()}; load average before: {os.getloadavg()[0]:.2f}")

    single = workload(one_n, args.rate_per_replica, args.seed)
    wall = time.perf_counter()
    Simulator(spec.config, spec.num_blocks, spec.block_size, spec.step_seconds).run(single)
    single_s = time.perf_counter() - wall
    print(
        f"1 replica, {one_n} requests at {args.rate_per_replica}/s: {single_s:.1f} s wall, "
        f"{one_n / single_s:,.0f} requests/s"
    )

    specs = workload(args.requests, args.rate_per_replica * r, args.seed)
    wall = time.perf_counter()
    result = Cluster([spec] * r, args.router).run(specs)
    cluster_s = time.perf_counter() - wall
    steps = sum(len(w.steps) for w in result.workers)
    print(
        f"{r} replicas ({args.router}), {args.requests} requests at "
        f"{args.rate_per_replica * r:g}/s: {cluster_s:.1f} s wall, "
        f"{args.requests / cluster_s:,.0f} requests/s, {steps:,} steps, "
        f"simulated {result.end_s:.0f} s"
    )
    ratio = (cluster_s / args.requests) / (single_s / one_n)
    print(
        f"wall per request, cluster / single replica: {ratio:.2f}x; "
        f"load average after: {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
