"""How fast the simulator runs: simulated requests per wall second (issue floor: 10,000 requests
of input 1,000 +/- 50% and output 200 +/- 50% on one replica near saturation in <= 20 s).

    python bench/simulate_speed.py [--requests 10000] [--rate 30]
"""

from __future__ import annotations

import argparse
import random
import time

from pdscope.engine.scheduler import SchedulerConfig
from pdscope.engine.simulator import SimRequest, Simulator
from pdscope.roofline.step_cost import CostModel, CostParams
from pdscope.specs import get_kv_precision, get_weight_precision, load_model, resolve_device
from pdscope.specs.local import cpu_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=30.0, help="Poisson arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    device = resolve_device("h100-sxm")
    # Default-efficiency-free figures: the peak rates, plus a small fixed step cost.
    params = CostParams(device.bandwidth_gb_s, device.tflops_bf16, step_overhead_s=0.002)
    cost = CostModel(
        load_model("llama-3.1-8b"), get_weight_precision("bf16"), get_kv_precision("bf16"), params
    )
    t, specs = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        prompt = [i * 10_000 + j for j in range(rng.randint(500, 1500))]
        specs.append(SimRequest(prompt, rng.randint(100, 300), arrival_s=t))
    sim = Simulator(
        SchedulerConfig(8192, 256, max_model_len=4096),
        num_blocks=25_000,  # ~400k tokens of KV, about what 80 GB leaves for an 8B model
        block_size=16,
        step_seconds=lambda out: cost.step(out.scheduled).seconds,
    )
    wall = time.perf_counter()
    result = sim.run(specs)
    wall = time.perf_counter() - wall
    done = sum(1 for r in result.requests if r.timeline.finish_reason == "length")
    steps = result.steps
    mean_running = sum(x.num_running for x in steps) / max(len(steps), 1)
    print(f"cpu: {cpu_model()}")
    print(
        f"{args.requests} requests at {args.rate}/s: {len(steps)} steps, "
        f"{result.end_s:.1f} simulated s, {done} finished, {result.num_preemptions} preemptions; "
        f"running {mean_running:.0f} on average, most waiting "
        f"{max((x.num_waiting for x in steps), default=0)}"
    )
    print(f"wall {wall:.2f} s: {args.requests / wall:,.0f} simulated requests per wall second")


if __name__ == "__main__":
    main()
