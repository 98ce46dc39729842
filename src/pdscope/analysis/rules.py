"""The article's reading rules and the knob each one points at, per runtime: one table.

`probe`'s findings and `watch`'s live lines both take their advice from here, so a knob is named
in one place. `KNOBS` maps a kind of finding to the setting that changes it on each runtime (vLLM
flags, SGLang flags, llama.cpp options, Ollama environment variables or request options, pdscope
serve's flags). `RULES` lists the live rules `watch` evaluates over `/metrics`: when each holds
and what it means (BRIEF.md section 1, "What to change"); `live_findings` evaluates them.
"""

from __future__ import annotations

from dataclasses import dataclass

KNOBS: dict[str, dict[str, str]] = {
    "prefill_batch": {
        "vllm": "raise --max-num-batched-tokens (bigger prefill chunks per step)",
        "pdscope": "raise --max-num-batched-tokens (bigger prefill chunks per step)",
        "sglang": "raise --chunked-prefill-size",
        "llama.cpp": "raise -b/--batch-size and -ub/--ubatch-size",
        "ollama": "raise options.num_batch",
    },
    "prefix_cache": {
        "vllm": "--enable-prefix-caching (on by default in the V1 engine); keep the shared "
        "prefix byte-identical and at the start",
        "pdscope": "--enable-prefix-caching (on by default); keep the shared prefix identical",
        "sglang": "RadixAttention is on unless --disable-radix-cache",
        "llama.cpp": "cache_prompt: true per request and --cache-reuse N",
        "ollama": "keep the system prompt identical; OLLAMA_NUM_PARALLEL=1 keeps one slot's cache",
    },
    "cold": {
        "ollama": "OLLAMA_KEEP_ALIVE=-1 (or keep_alive per request) keeps the model loaded",
        "vllm": "warm up after start-up (torch.compile and CUDA graphs are built lazily)",
        "pdscope": "send a warm-up request after start-up",
        "llama.cpp": "--mlock keeps the weights resident",
    },
    "quantize": {
        "vllm": "serve a quantized checkpoint (--quantization fp8 / AWQ / GPTQ) or --kv-cache-"
        "dtype fp8",
        # no "a smaller model" here: probe's advice adds it beside this for every runtime
        "pdscope": "fewer bytes per weight (pdscope plan --dtype int8 shows the gain)",
        "ollama": "pull a smaller quantization tag (q4_K_M instead of q8_0 or fp16)",
        "llama.cpp": "use a Q4_K_M / Q5_K_M GGUF",
        "sglang": "--quantization fp8 or a quantized checkpoint",
    },
    "stack": {
        "vllm": "check --max-num-seqs, CPU threads (VLLM_CPU_OMP_THREADS_BIND) or the attention "
        "backend",
        "pdscope": "on a small machine shared with its clients, serve --threads leaves them a "
        "core; docs/performance.md says where the rest goes",
        "ollama": "check num_thread and that no layers spill to the CPU (ollama ps)",
        "llama.cpp": "check -t threads and -ngl (all layers offloaded)",
        "sglang": "check --mem-fraction-static and the attention backend",
    },
    # Waiting requests have not started: more room for running ones, or more servers.
    "capacity": {
        "vllm": "more KV room (--gpu-memory-utilization, VLLM_CPU_KVCACHE_SPACE on CPU) and "
        "--max-num-seqs, or another replica",
        "pdscope": "a bigger --kv-cache-memory and --max-num-seqs, or another replica",
        "sglang": "raise --mem-fraction-static and --max-running-requests, or another replica",
        "tgi": "raise --max-batch-total-tokens (or --max-batch-size), or another replica",
        "llama.cpp": "more slots: -np/--parallel with a larger -c/--ctx-size (shared by slots)",
        "ollama": "OLLAMA_NUM_PARALLEL (and memory for it), or another server",
    },
    # The KV pool is full: fewer bytes per cached token, or a bigger pool.
    "kv_pool": {
        "vllm": "raise --gpu-memory-utilization, --kv-cache-dtype fp8, or a smaller "
        "--max-model-len",
        "pdscope": "raise --kv-cache-memory, or a smaller --max-model-len",
        "sglang": "raise --mem-fraction-static, or --kv-cache-dtype fp8_e5m2",
        "tgi": "raise --cuda-memory-fraction, or lower --max-total-tokens",
        "llama.cpp": "raise -c/--ctx-size, or -ctk q8_0 -ctv q8_0 (needs -fa)",
        "ollama": "OLLAMA_KV_CACHE_TYPE=q8_0 (with OLLAMA_FLASH_ATTENTION=1), or a smaller "
        "OLLAMA_CONTEXT_LENGTH",
    },
    # Prefill steps stall decode: smaller prefill chunks mixed into decode batches.
    "chunked_prefill": {
        "vllm": "lower --max-num-batched-tokens (e.g. 2048): smaller prefill chunks per step",
        "pdscope": "lower --max-num-batched-tokens (and keep --enable-chunked-prefill)",
        "sglang": "lower --chunked-prefill-size",
        "tgi": "lower --max-batch-prefill-tokens",
        "llama.cpp": "lower -ub/--ubatch-size",
        "ollama": "lower options.num_batch",
    },
    # TTFT grows while the batch is at its cap: requests queue behind it.
    "queueing": {
        "vllm": "raise --max-num-seqs if the KV pool has room, else add replicas",
        "pdscope": "raise --max-num-seqs if the KV pool has room, else add replicas",
        "sglang": "raise --max-running-requests if the KV pool has room, else add replicas",
        "tgi": "raise --max-concurrent-requests and --max-batch-size, or add replicas",
        "llama.cpp": "raise -np/--parallel, or add servers",
        "ollama": "raise OLLAMA_NUM_PARALLEL, or add servers",
    },
}


def knob(kind: str, runtime: str) -> str:
    """The setting for `kind` on `runtime` (vLLM's when the runtime has no entry)."""
    table = KNOBS[kind]
    return table.get(runtime) or table.get("vllm", "")


# --- live rules (watch) -------------------------------------------------------------------------

# Thresholds, named so docs/metrics.md and the tests can cite them.
KV_FULL_FRACTION = 0.9  # KV use at or above this with requests waiting: the pool is full
ITL_JUMP_RATIO = 3.0  # ITL p99 / p50 at or above this while prompts arrive: prefill stalls decode
TTFT_GROWTH_RATIO = 1.5  # TTFT p50, second half of the window over the first half
RUNNING_FLAT_RATIO = 1.2  # running in the second half at most this times the first half's


@dataclass(frozen=True)
class Rule:
    """One of the article's reading rules: when it holds, what it means, which knob."""

    id: str
    holds_when: str  # the condition, in words (README, docs/metrics.md)
    finding: str  # the line shown while it holds
    knob_kind: str  # key into KNOBS


RULES: tuple[Rule, ...] = (
    Rule(
        "capacity",
        "waiting > 0",
        "Requests are waiting: they have not started (a capacity problem, not the model)",
        "capacity",
    ),
    Rule(
        "kv_full",
        f"KV use ≥ {KV_FULL_FRACTION:.0%} and waiting > 0",
        "The KV pool is full: new requests wait for blocks to free",
        "kv_pool",
    ),
    Rule(
        "prefill_interrupts",
        f"ITL p99 ≥ {ITL_JUMP_RATIO:g}× ITL p50 while prompt tokens arrive",
        "ITL p99 jumps while prompts arrive: prefill is interrupting decode",
        "chunked_prefill",
    ),
    Rule(
        "queueing",
        f"TTFT p50 grows ≥ {TTFT_GROWTH_RATIO:g}× across the window while running stays flat",
        "TTFT grows with load while the batch stays flat: requests are queueing",
        "queueing",
    ),
)
RULES_BY_ID = {r.id: r for r in RULES}


@dataclass(frozen=True)
class LiveFigures:
    """What the live rules read, over one window; None where the server does not say."""

    running: float | None
    waiting: float | None
    kv_usage: float | None  # 0-1
    ttft_p50_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    prompt_tok_s: float | None
    # TTFT p50 over the first and the second half of the window, and the most requests running
    # in each half (the queueing rule compares them).
    ttft_p50_first_half_ms: float | None = None
    ttft_p50_second_half_ms: float | None = None
    running_max_first_half: float | None = None
    running_max_second_half: float | None = None


def live_findings(f: LiveFigures, runtime: str) -> list[dict[str, str]]:
    """The rules that hold now, each as {kind, finding, evidence, action} (probe's shape)."""
    out: list[dict[str, str]] = []

    def add(rule_id: str, evidence: str) -> None:
        rule = RULES_BY_ID[rule_id]
        out.append(
            {
                "kind": rule.id,
                "finding": rule.finding,
                "evidence": evidence,
                "action": knob(rule.knob_kind, runtime),
            }
        )

    kv = "" if f.kv_usage is None else f", KV use {f.kv_usage:.0%}"
    if f.waiting is not None and f.waiting > 0:
        running = "" if f.running is None else f", {f.running:g} running"
        add("capacity", f"{f.waiting:g} waiting{running}{kv}")
        if f.kv_usage is not None and f.kv_usage >= KV_FULL_FRACTION:
            add("kv_full", f"KV use {f.kv_usage:.0%} with {f.waiting:g} waiting")
    if (
        f.itl_p50_ms
        and f.itl_p99_ms is not None
        and f.itl_p99_ms >= ITL_JUMP_RATIO * f.itl_p50_ms
        and f.prompt_tok_s
    ):
        add(
            "prefill_interrupts",
            f"ITL p99 {f.itl_p99_ms:.0f} ms vs p50 {f.itl_p50_ms:.0f} ms while "
            f"{f.prompt_tok_s:,.0f} prompt tok/s arrive",
        )
    a, b = f.ttft_p50_first_half_ms, f.ttft_p50_second_half_ms
    ra, rb = f.running_max_first_half, f.running_max_second_half
    if (
        a
        and b is not None
        and b >= TTFT_GROWTH_RATIO * a
        and ra is not None
        and rb is not None
        and rb <= RUNNING_FLAT_RATIO * ra
        and ra > 0
    ):
        add(
            "queueing",
            f"TTFT p50 {a:.0f} → {b:.0f} ms from the first half of the window to the second, "
            f"while at most {ra:g}, then {rb:g} requests ran",
        )
    return out
