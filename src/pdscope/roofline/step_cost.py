"""The time of one scheduled engine step, from roofline arithmetic: the simulator's clock.

A stand-in for the model runner. Each term is a roofline time, max(FLOPs / achieved FLOP/s,
bytes / achieved bandwidth), over what the step actually does:

* ``linear_s``: the decoder layers' matmuls for every token of the step. Their weights are read
  once per step however many tokens share it (MoE: the experts the batch touches), so a decode
  batch costs about what one decode costs until its FLOPs catch up with its bytes.
* ``attention_s``: per scheduled entry, a prefill chunk's scores and weighted sums over the
  context it sees (grows with the square of the chunk) and the KV it reads; a decode entry's KV
  read over its whole context (grows with context, one sequence at a time).
* ``lm_head_s``: the output projection, only for entries that sample a token.
* ``comm_s``: with tensor parallelism (``roofline/parallel.py``), the two all-reduces per layer
  of the step's activations; the other terms then run on each GPU's 1/T share.
* ``overhead_s``: what no roofline sees (kernel launches, the scheduler, sampling, Python): a
  fixed cost per step plus a cost per scheduled sequence, which may change at batch sizes where
  a server switches kernels (``CostParams.seq_overhead_above``).

Every figure is per step; see docs/simulation.md for what each term stands for and how the
parameters are calibrated.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from pdscope.roofline.arithmetic import attention_pairs, head_width, read_bytes
from pdscope.roofline.parallel import NO_TP, TensorParallel
from pdscope.specs import KVPrecision, ModelSpec, SpecError, WeightPrecision


class ScheduledWork(Protocol):
    """What the cost model needs of one scheduled entry (the engine's ScheduledRequest)."""

    @property
    def start(self) -> int: ...  # tokens already in the KV cache before this step

    @property
    def num_new_tokens(self) -> int: ...

    @property
    def samples(self) -> bool: ...  # the step produces a token for this entry


@dataclass(frozen=True)
class CostParams:
    """Achieved (not peak) rates of the machine being modelled, and the costs no roofline sees."""

    bandwidth_gb_s: float  # achieved memory bandwidth, 1e9 bytes/s
    tflops: float  # achieved dense matmul rate at the weights' compute type, 1e12 FLOP/s
    step_overhead_s: float = 0.0  # fixed cost of every step
    # Extra fixed cost of a step that carries a prefill chunk: a server whose decode-only steps
    # take a faster path (CUDA graphs in vLLM, the one-call C step in pdscope's engine) pays
    # it once per step with any prompt tokens, however many chunks.
    prefill_step_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0  # extra cost of every sequence scheduled in a step
    # (n, seconds): each sequence of a step past the n-th costs this in place of seq_overhead_s
    # (or of an earlier pair's cost), n ascending and >= 1. A server's step is not
    # linear in its sequences where it switches kernels (one row against a batch); a probe's
    # batch points measure where. Empty: one cost per sequence, however many.
    seq_overhead_above: tuple[tuple[int, float], ...] = ()
    # Time a request spends outside any step before the scheduler sees it (HTTP handling,
    # hand-off to the engine loop): part of its TTFT, never of a step. The simulator delays
    # admission by it.
    request_overhead_s: float = 0.0
    source: str = ""  # where the figures came from (a probe file, a measurement, the catalog)

    def __post_init__(self) -> None:
        if not self.bandwidth_gb_s > 0:
            raise SpecError(f"bandwidth must be > 0 GB/s, got {self.bandwidth_gb_s}")
        if not self.tflops > 0:
            raise SpecError(f"FLOP rate must be > 0 TFLOP/s, got {self.tflops}")
        overheads = (self.step_overhead_s, self.prefill_step_overhead_s, self.seq_overhead_s)
        if min(*overheads, self.request_overhead_s) < 0:
            raise SpecError("overheads must be >= 0 seconds")
        counts = [n for n, _ in self.seq_overhead_above]
        if counts != sorted(set(counts)) or (counts and counts[0] < 1):
            raise SpecError(f"seq_overhead_above: counts must rise from 1 or more, got {counts}")
        if any(cost < 0 for _, cost in self.seq_overhead_above):
            raise SpecError("overheads must be >= 0 seconds")

    def seqs_overhead_s(self, seqs: int) -> float:
        """The per-sequence overhead of a step carrying ``seqs`` sequences, summed."""
        total, counted, rate = 0.0, 0, self.seq_overhead_s
        for n, cost in self.seq_overhead_above:
            if seqs <= n:
                break
            total += rate * (n - counted)
            counted, rate = n, cost
        return total + rate * (seqs - counted)

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_gb_s * 1e9

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12


@dataclass(frozen=True)
class StepCost:
    """One step's time, split into the terms of the module docstring (seconds)."""

    linear_s: float
    attention_s: float
    lm_head_s: float
    overhead_s: float
    comm_s: float = 0.0  # tensor-parallel all-reduces (0 on one GPU)

    @property
    def seconds(self) -> float:
        return self.linear_s + self.attention_s + self.lm_head_s + self.overhead_s + self.comm_s


@dataclass(frozen=True)
class _LayerGroup:
    """Layers that cost the same: one window, one attention width (summed over the group)."""

    window: int | None
    prefill_flops_per_pair: int  # 2 x heads x (qk + v) x layers
    decode_flops_per_pair: int  # the same with the layer's decode shape (MLA absorbs)
    kv_values_per_token: int  # summed over the group's layers


@dataclass(frozen=True)
class CostModel:
    model: ModelSpec
    weights: WeightPrecision
    kv: KVPrecision
    params: CostParams
    # Tensor parallelism: each GPU does 1/T of the FLOPs and reads 1/T of the weights and
    # 1/kv_split of the KV, which is the same as T (kv_split) times the rates. T = 1: unchanged.
    tp: TensorParallel = NO_TP

    @cached_property
    def _flops_s(self) -> float:
        return self.params.flops_per_s * self.tp.size

    @cached_property
    def _bytes_s(self) -> float:
        return self.params.bandwidth_bytes_s * self.tp.size

    @cached_property
    def _kv_bytes_s(self) -> float:
        return self.params.bandwidth_bytes_s * self.tp.kv_split

    @cached_property
    def _groups(self) -> tuple[_LayerGroup, ...]:
        """The model's layers folded into groups of equal cost, so a step costs a few operations
        per entry instead of a loop over every layer (the simulator's hot path). Sums the same
        terms as roofline's attention_flops and kv_bytes_at_context."""
        counts: Counter[tuple[int | None, int, int, int]] = Counter()
        for layer in self.model.layers:
            full = layer.attention
            dec = layer.decode_attention or full
            counts[
                (
                    layer.window,
                    2 * full.num_heads * (full.qk_head_dim + full.v_head_dim),
                    2 * dec.num_heads * (dec.qk_head_dim + dec.v_head_dim),
                    layer.kv_values_per_token,
                )
            ] += 1
        return tuple(
            _LayerGroup(window, n * prefill, n * decode, n * kv)
            for (window, prefill, decode, kv), n in counts.items()
        )

    @cached_property
    def _linear_cache(self) -> dict[int, float]:
        """linear_s by the step's token count: it depends on nothing else, and summing the
        model's layers for every step was a visible share of a simulation's time."""
        return {}

    def _roofline_s(self, flops: float, bytes_moved: float) -> float:
        return max(flops / self._flops_s, bytes_moved / self._bytes_s)

    def attention_work(self, start: int, new_tokens: int) -> tuple[float, float]:
        """One entry's attention as (FLOPs, bytes): ``new_tokens`` queries over ``start``
        cached tokens plus their own, and the KV of that whole context read."""
        flops = 0.0
        kv_values = 0
        end = start + new_tokens
        for g in self._groups:
            per_pair = g.decode_flops_per_pair if new_tokens == 1 else g.prefill_flops_per_pair
            flops += per_pair * attention_pairs(start, new_tokens, g.window)
            kv_values += g.kv_values_per_token * (end if g.window is None else min(end, g.window))
        return flops, kv_values * self.kv.bytes_per_element

    def attention_s(self, start: int, new_tokens: int) -> float:
        """One entry's attention time (see :meth:`attention_work`)."""
        flops, kv_bytes = self.attention_work(start, new_tokens)
        # Under TP the KV is split kv_split ways (fewer KV heads than GPUs are copied).
        return max(flops / self._flops_s, kv_bytes / self._kv_bytes_s)

    def linear_work(self, tokens: int) -> tuple[float, float]:
        """The decoder layers' matmuls for a step of ``tokens`` tokens as (FLOPs, bytes): the
        weights are read once per step. read_bytes counts the LM head (decode reads it);
        it is charged to the LM head's own term."""
        model = self.model
        layer_bytes = read_bytes(model, self.weights, tokens) - self.lm_head_work(0)[1]
        return 2 * tokens * model.matmul_params_per_token, layer_bytes

    def lm_head_work(self, sampled: int) -> tuple[float, float]:
        """The output projection for ``sampled`` entries as (FLOPs, bytes): weights read once."""
        head = self.model.lm_head_params
        return 2 * sampled * head, head * head_width(self.model, self.weights)

    def linear_s(self, tokens: int) -> float:
        """The linear layers' time for a step of ``tokens`` tokens (as :meth:`step` prices it)."""
        return self._roofline_s(*self.linear_work(tokens))

    def lm_head_s(self, sampled: int) -> float:
        """The LM head's time for a step that samples ``sampled`` entries."""
        return self._roofline_s(*self.lm_head_work(sampled)) if sampled else 0.0

    @property
    def flops_per_s(self) -> float:
        """FLOP/s of the whole TP group (the achieved rate times the GPUs)."""
        return self._flops_s

    @property
    def windowed(self) -> bool:
        """Whether any layer attends over a sliding window (a decode's attention is then not
        proportional to its context)."""
        return any(g.window is not None for g in self._groups)

    def roofline_terms(self, entries: Sequence[ScheduledWork]) -> list[tuple[float, float]]:
        """Every roofline term of a step as (FLOPs, bytes): the linear layers, each entry's
        attention, the LM head when anything samples. ``step`` prices the same terms (faster);
        calibration fits the achieved rates to them."""
        if not entries:
            return []
        tokens = sum(e.num_new_tokens for e in entries)
        sampled = sum(1 for e in entries if e.samples)
        terms = [self.linear_work(tokens)]
        terms += [self.attention_work(e.start, e.num_new_tokens) for e in entries]
        if sampled:
            terms.append(self.lm_head_work(sampled))
        return terms

    @cached_property
    def _decode_s_per_context_token(self) -> float | None:
        """For a model whose layers all cost the same with no window, a decode's attention is
        max(a x context, b x context) = max(a, b) x context: the time per token of context, so
        a step's decodes cost one sum. None where windows or mixed layers break the proportion."""
        if len(self._groups) != 1 or self._groups[0].window is not None:
            return None
        g = self._groups[0]
        return max(
            g.decode_flops_per_pair / self._flops_s,
            g.kv_values_per_token * self.kv.bytes_per_element / self._kv_bytes_s,
        )

    def step(self, entries: Sequence[ScheduledWork]) -> StepCost:
        """Seconds one step takes to compute ``entries`` (an empty step costs nothing)."""
        if not entries:
            return StepCost(0.0, 0.0, 0.0, 0.0)
        per_context = self._decode_s_per_context_token
        tokens = sampled = decode_context = 0
        attention_s = 0.0
        prefill = False
        for e in entries:
            n = e.num_new_tokens
            prefill = prefill or n > 1
            tokens += n
            sampled += e.samples
            if n == 1 and per_context is not None:
                decode_context += e.start + 1  # one query over its whole context
            else:
                attention_s += self.attention_s(e.start, n)
        if decode_context:
            attention_s += per_context * decode_context  # type: ignore[operator]
        assert tokens > 0
        linear_s = self._linear_cache.get(tokens)
        if linear_s is None:
            linear_s = self._linear_cache[tokens] = self._roofline_s(*self.linear_work(tokens))
        lm_head_s = self._roofline_s(*self.lm_head_work(sampled)) if sampled else 0.0
        overhead_s = self.params.step_overhead_s + self.params.seqs_overhead_s(len(entries))
        if prefill:
            overhead_s += self.params.prefill_step_overhead_s
        comm_s = self.tp.comm_s(self.model, tokens) if self.tp.size > 1 else 0.0
        return StepCost(linear_s, attention_s, lm_head_s, overhead_s, comm_s)
