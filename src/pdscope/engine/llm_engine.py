"""The engine loop: schedule, run, sample, detokenize, stop; and the offline ``LLM`` API."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from pdscope.engine import malloc
from pdscope.engine.args import EngineArgs
from pdscope.engine.block_pool import BlockPool
from pdscope.engine.kernels import (
    HELD_ONCE_TIE,
    ON_C,
    PAIRS_LINEAR,
    KernelChoice,
    Liked,
    TrialShapes,
    choose,
    packed_unread,
    pairs_preferred,
    parse_kernels,
    stored_past_one,
)
from pdscope.engine.loader import load_model, read_config, resolve_dtype
from pdscope.engine.malloc import release_freed_memory
from pdscope.engine.model import (
    Linear,
    ModelConfig,
    apply_kernels,
    available_memory_bytes,
    can_pack,
    kernel_trials,
    pairs_copy_fits,
    prefetch_applies,
    stored_offered,
    thread_cpus,
    widen_bf16,
)
from pdscope.engine.native import NativeOps
from pdscope.engine.request import Request
from pdscope.engine.runner import ModelRunner
from pdscope.engine.sampling_params import SamplingParams
from pdscope.engine.scheduler import Scheduler, SchedulerConfig
from pdscope.engine.step_check import check_one_call
from pdscope.engine.timeline import RequestTimeline, StepLog, StepRecord
from pdscope.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdscope.specs.local import cpu_model
from pdscope.specs.sizes import parse_bytes

log = logging.getLogger(__name__)

#: How a decodes-only step on the C kernels runs (LLMEngine.decode_step, /metrics' build_info).
DecodeStep = Literal["one_call", "per_kernel", "per_kernel_mismatch"]


@dataclass
class RequestOutput:
    """What a step did for one request: the new tokens, the text so far, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    request: Request = field(repr=False)
    error: str | None = None  # set when this request alone failed (finish_reason "abort")

    @property
    def token_ids(self) -> list[int]:
        return self.request.output_token_ids

    @property
    def timeline(self) -> RequestTimeline:
        return self.request.timeline


def fastest(choice: KernelChoice, path: str) -> str:
    """``path``'s fastest option by the times ``choice`` holds for it (cached ones too); its
    pick where it was not timed (forced, fixed, or taken by the memory rule)."""
    prefix = f"{path}="
    times = {k[len(prefix) :]: s for k, s in choice.trial_s.items() if k.startswith(prefix)}
    if choice.how.get(path) not in ("measured", "cached") or len(times) < 2:
        return getattr(choice, path)
    return min(times, key=times.__getitem__)


def engine_device(name: str) -> torch.device:
    """The device an engine asked for ``name`` (``auto``: CUDA where torch sees it) runs on."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def heap_rule(device: torch.device) -> bool:
    """Whether an engine on ``device`` settles glibc's heap unless told not to: on CPU, whose
    tensors are malloc's, where malloc is glibc's (engine/malloc.py); or where an engine did
    already (the process's settings stay)."""
    return malloc.heap_settled() or (device.type == "cpu" and malloc.is_glibc())


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs: object):
        from pdscope.checkpoint.make_model import resolve_model_path

        args = args or EngineArgs(**kwargs)  # type: ignore[arg-type]
        self.args = args
        self.path = Path(resolve_model_path(args.model))
        hf_config = read_config(self.path)
        self.device = engine_device(args.device)
        dtype_name = args.dtype
        if dtype_name == "auto":
            dtype_name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
            dtype_name = (
                "float32" if dtype_name == "float16" and self.device.type == "cpu" else dtype_name
            )
        self.dtype = resolve_dtype(dtype_name)
        forced_kernels = parse_kernels(args.kernels)  # bad input fails before the load
        self._check_heap_asked(forced_kernels.get("heap"))
        config = ModelConfig.from_hf(hf_config)
        self.max_model_len = args.max_model_len or config.max_position_embeddings
        if self.max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {config.max_position_embeddings}"
            )
        block_bytes = ModelRunner.kv_bytes_per_block(config, args.block_size, self.dtype)
        if self.device.type != "cuda":  # the pool's size is asked, not left over: check it now
            self._check_pool_holds_a_request(self._kv_asked_bytes(), block_bytes)
        torch.manual_seed(args.seed)
        self.model = load_model(self.path, self.dtype, self.device)
        self.tokenizer = Tokenizer(self.path)
        # before the trials (a minute on a 7B model): the kernels' copies only take more
        self._kv_budget_bytes()
        self.kernels = self._choose_kernels(forced_kernels)
        if self.kernels.heap == "settled" and not malloc.settle_heap():
            # glibc refuses the 32 MiB line where it caps it lower: heaps in huge pages
            # (GLIBC_TUNABLES=glibc.malloc.hugetlb=2: twice the huge page size), a 32-bit build
            log.warning("glibc refused the heap's settings: its malloc left as it is")
            how = {**self.kernels.how, "heap": "fixed"}
            self.kernels = replace(self.kernels, heap="default", how=how)
        # What this engine runs on besides the CPU: torch's dispatch level and the C kernels'
        # -march target ("none" without them). ATEN_CPU_CAPABILITY and $PDSCOPE_MARCH change
        # them (another CPU's paths, run here); /metrics' build_info says which.
        self.torch_isa: str = torch.backends.cpu.get_cpu_capability()
        self.c_march: str = self._native.march if self._native is not None else "none"
        log.info(
            "kernels on %s (torch %s, C kernels -march=%s): %s",
            cpu_model(),
            self.torch_isa,
            self.c_march,
            self.kernels.summary(),
        )
        self.decode_step: DecodeStep = self._check_decode_step()
        # what the trials and the check freed, before the pool meets the memory available
        release_freed_memory()
        self.kv_cache_bytes = self._kv_budget_bytes()
        num_blocks = self._check_pool_holds_a_request(self.kv_cache_bytes, block_bytes)
        self.pool = BlockPool(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                args.max_num_batched_tokens,
                args.max_num_seqs,
                self.max_model_len,
                args.enable_chunked_prefill,
            ),
            self.pool,
        )
        self.runner = ModelRunner(self.model, num_blocks, args.block_size, self.device)
        if self.kernels.threads == "bound" and self._native is not None:
            self.runner.pin = (self._native, thread_cpus(), thread_cpus(bound=False))
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.steps = StepLog(maxlen=100_000)
        self.step_listeners: list[Callable[[StepRecord, list[Request]], None]] = []
        self.finish_listeners: list[Callable[[Request], None]] = []  # any reason, abort too
        self._ids = itertools.count()

    def _check_heap_asked(self, asked: str | None) -> None:
        """Refuse, before the load, a heap setting this process cannot give."""
        if asked == "settled" and not heap_rule(self.device):
            raise ValueError(
                f"kernels: heap=settled sets glibc's malloc, for CPU tensors (here {self.device}"
                f"{'' if malloc.is_glibc() else ', and malloc is not glibc'})"
            )
        if asked == "default" and malloc.heap_settled():
            raise ValueError(
                "kernels: heap=default, but an engine before this one in this process has "
                "settled its heap (engine/malloc.py); start a fresh process"
            )

    def _choose_kernels(self, forced: dict[str, str]) -> KernelChoice:
        """Time each machine-dependent path on this model's shapes (or read the cached
        outcome), then point the model at the winners."""
        from pdscope.checkpoint.make_model import default_cache_dir
        from pdscope.engine import native

        c = self.model.config
        prefill_tokens = min(self.args.max_num_batched_tokens, self.max_model_len)
        ops = None
        # The C kernels serve several paths: built unless all are forced off them.
        wanted = (
            forced.get("decode_ops") != "torch"
            or forced.get("linear") in (None, *ON_C["linear"])
            or forced.get("batch_linear") in (None, *ON_C["batch_linear"])
            or forced.get("big_batch_linear") in (None, *ON_C["big_batch_linear"])
            or forced.get("threads") != "free"
            or forced.get("prefill_linear") in ON_C["prefill_linear"]  # C team, or copies
            or forced.get("prefill_attention") in ON_C["prefill_attention"]
            or forced.get("decode_prefetch") in ON_C["decode_prefetch"]
        )
        forced_on_c = [f"{p}={o}" for p, o in forced.items() if o in ON_C.get(p, ())]
        if native.supports(self.dtype, self.device) and wanted:
            ops = native.load(default_cache_dir() / "native")
            if ops is None and forced_on_c:
                raise ValueError(
                    f"kernels: {forced_on_c[0]} needs the C kernels, which could not be built "
                    "(see the warning above; a C compiler on PATH or in $CC)"
                )
        shapes = TrialShapes(
            dtype=str(self.dtype).removeprefix("torch."),
            hidden=c.hidden_size,
            intermediate=c.intermediate_size,
            vocab=c.vocab_size,
            layers=c.num_layers,
            heads=c.num_heads,
            kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            prefill_tokens=prefill_tokens,
        )
        cpu = self.device.type == "cpu"
        fixed = {  # what runs where a path has one candidate (CUDA, or float32 weights)
            "linear": "packed" if can_pack(self.dtype, self.device) else "plain",
            "batch_linear": "packed",  # as linear (float32, a GPU, or no C kernels)
            "big_batch_linear": "onednn",  # as linear (no pairs kernels, or none to spare)
            "prefill_linear": "onednn",  # as linear (float32, a GPU, or short chunks)
            # a rule, not a trial: torch's bf16 matmul without oneDNN's bf16 path is a slow
            # fallback (kernels.py says how slow)
            "matmul_math": "float32" if widen_bf16(self.dtype, self.device) else "native",
            "prefill_attention": "blocked" if cpu else "sdpa",
            "decode_math": "float32" if cpu or self.dtype == torch.float32 else "native",
            "decode_ops": "torch",  # no C kernels here (a GPU, or no compiler)
            "decode_prefetch": "jumps",  # as the C kernels' default (or none of them here)
            "threads": "free",  # no C kernels, or one thread: nothing to place
        }
        # a rule as well: steps padded where their matmuls are oneDNN's in bf16 (fp16 on a
        # CPU without AVX512-FP16 is not oneDNN's, and was not measured)
        onednn_bf16 = self.dtype == torch.bfloat16 and cpu
        widened = forced.get("matmul_math", fixed["matmul_math"]) == "float32"
        fixed["step_rows"] = "padded" if onednn_bf16 and not widened else "exact"
        # a rule too: on CPU the step's tensors are glibc's (engine/malloc.py); a process
        # an engine settled before stays so
        fixed["heap"] = "settled" if heap_rule(self.device) else "default"
        if forced_on_c and ops is None:
            raise ValueError(
                f"kernels: {forced_on_c[0]} runs on the C kernels, on CPU only "
                f"(device {self.device})"
            )
        if forced.get("decode_prefetch") == "every" and not prefetch_applies(self.model, ops):
            # refused before any trial runs, not after them in apply_kernels
            raise ValueError(
                "kernels: decode_prefetch=every needs the C kernels built with AVX-512 BF16 and "
                "a bf16 model of head size 64 with 1-4 query heads a KV head, or 128 with "
                "1-8 (the attention that has the prefetch)"
            )
        if forced.get("threads") == "bound" and (ops is None or not thread_cpus()):
            raise ValueError(
                "kernels: threads=bound needs the C kernels on CPU and at least two threads "
                f"with a CPU each (here {torch.get_num_threads()} threads)"
            )

        # prefill_linear=transposed keeps a copy of every layer weight: it must win by more
        # than a tie (on the AMD EPYC Zen 4, with a 1.1B-parameter model, a start's short
        # trial picked it once in three where longer ones time it 4-9% slower; on the AMX
        # Xeon the copy took 7-17% off a prefill). pairs, where the decode paths all read the
        # copies, lets the packed weights go, and where single rows read them too, the
        # weights themselves (held once): kept within a tie, or HELD_ONCE_TIE, then. plain
        # (offered with AMX tiles), where no smaller matmul reads the packed weights, lets
        # them go: within HELD_ONCE_TIE, else oneDNN's within a tie as before.
        stored = stored_offered(self.model, ops)

        def prefill_liked(picks: dict[str, str]) -> Liked:
            if packed_unread({**picks, "prefill_linear": "pairs"}):
                linear = picks.get("linear")
                return ("pairs", HELD_ONCE_TIE) if linear in PAIRS_LINEAR else "pairs"
            if stored and stored_past_one({**picks, "prefill_linear": "plain"}):
                return [("plain", HELD_ONCE_TIE), "onednn"]
            return "onednn"

        # batch_linear=pairs and big_batch_linear=pairs there are the way to it: each kept
        # within HELD_ONCE_TIE where the paths after it may take the copies (and undone below
        # where they do not)
        trials = kernel_trials(self.model, prefill_tokens, ops)
        offered = set(trials)

        def may_take(path: str, option: str = "pairs") -> bool:
            return forced.get(path, option) == option and (path in forced or path in offered)

        def batch_liked(picks: dict[str, str]) -> Liked | None:
            later = may_take("big_batch_linear") and may_take("prefill_linear")
            if later and picks.get("linear") in PAIRS_LINEAR:
                return ("pairs", HELD_ONCE_TIE)
            return None

        def big_batch_liked(picks: dict[str, str]) -> Liked | None:
            decode_on_copies = picks.get("linear") in PAIRS_LINEAR
            if (
                may_take("prefill_linear")
                and decode_on_copies
                and picks.get("batch_linear") == "pairs"
            ):
                return ("pairs", HELD_ONCE_TIE)
            # the way to prefill_linear=plain: every weight read as stored, no copy
            as_stored = picks.get("linear") in ("c", "amx") and picks.get("batch_linear") == "c"
            if stored and as_stored and may_take("prefill_linear", "plain"):
                return ("c", HELD_ONCE_TIE)
            return None

        prefer: dict[str, Liked | Callable[[dict[str, str]], Liked | None]] = {
            "batch_linear": batch_liked,
            "big_batch_linear": big_batch_liked,
            "prefill_linear": prefill_liked,
        }
        if ops is not None and ops.pairs:
            prefer["linear"] = pairs_preferred(ops.pairs_isa)
        if stored:
            # The tiles read the weight as stored, where the pairs copies at one row are a
            # copy more (and, with the paths after it on the weight too, the only one): kept
            # within HELD_ONCE_TIE of the copies (undone below where another path is the
            # fastest). On the AMX Xeon (family 6 model 207) the trial picked pairs2 in 3 of 6
            # uncached starts, whose batch-1 decode then ran 0.85x amx's (bench/kernels_ab.py;
            # docs/performance.md).
            copies = [pairs_preferred(ops.pairs_isa)] if ops is not None and ops.pairs else []
            prefer["linear"] = [("amx", HELD_ONCE_TIE), *copies]
        held_once = self._held_once_paths(ops, forced)
        for path, option in held_once.items():
            trials.pop(path, None)  # (offered only while a whole copy fits)
            fixed[path] = option
        choice = choose(
            trials, forced, shapes, default_cache_dir() / "kernels", fixed=fixed, prefer=prefer
        )
        del trials  # their copies let go before apply_kernels makes the chosen ones
        if held_once:
            choice = replace(choice, how={**choice.how, **dict.fromkeys(held_once, "memory")})
        # kept within HELD_ONCE_TIE for the paths after them, which did not follow: the
        # fastest (its trial's times, cached ones too). linear=amx is kept so against the
        # copies only: where neither is the fastest, the fastest.
        if choice.linear == "amx" and fastest(choice, "linear") not in PAIRS_LINEAR:
            choice = replace(choice, linear=fastest(choice, "linear"))
        followed = (choice.big_batch_linear, choice.prefill_linear)
        if followed not in (("pairs", "pairs"), ("c", "plain")):
            choice = replace(choice, big_batch_linear=fastest(choice, "big_batch_linear"))
        if not choice.big_batch_linear == choice.prefill_linear == "pairs":
            choice = replace(choice, batch_linear=fastest(choice, "batch_linear"))
        if choice.prefill_linear == "plain" and not stored_past_one(asdict(choice)):
            # the packed weights stay for a path that changed above: plain saves nothing
            choice = replace(
                choice,
                prefill_linear=fastest(choice, "prefill_linear"),
                big_batch_linear=fastest(choice, "big_batch_linear"),
            )
        copies_past_32 = choice.big_batch_linear == choice.prefill_linear == "pairs"
        if copies_past_32 and "step_rows" not in forced:
            # the rule above, for these paths: past 32 rows only a weight without a pairs copy
            # (rows not a multiple of 16) is oneDNN's, and padding would add rows to the
            # copies' work
            choice = replace(choice, step_rows="exact")
        apply_kernels(self.model, choice, ops)
        self._native = ops
        return choice

    def _held_once_paths(self, ops: NativeOps | None, forced: dict[str, str]) -> dict[str, str]:
        """Where another copy of every weight does not fit (model.pairs_copy_fits), the
        matmul paths, not forced, that keep no second copy, taken without a trial: where the
        C kernels have AMX tiles, the weight as stored (one row and up to BIG_BATCH_MAX_ROWS
        through the tiles, more through oneDNN's matmul on it: prefill_linear=plain); else
        the pairs copies alone, each weight held once in its copy (Linear.hold_once). The
        others keep a second copy (oneDNN's packed weights, or the copies beside the
        weight). On the AMX Xeon (family 6 model 207) a 1.1B model's 2,000-token prefill ran
        at 90 tok/s on the copies (their AVX-512 BF16 kernels: 158-181 GFLOP/s) against 586
        on the tiles and oneDNN (docs/performance.md). Empty where there is room, no C kernels
        for one row and several, or one of the four forced to another path (which would read
        the weight, or keep the packed copy)."""
        if (
            ops is None
            or self.dtype != torch.bfloat16
            or self.device.type != "cpu"
            or pairs_copy_fits(self.model)
        ):
            return {}
        # a path forced onto the copies takes the rest there too (each weight held once)
        on_copies = forced.get("linear") in PAIRS_LINEAR or "pairs" in {
            forced.get(p) for p in ("batch_linear", "big_batch_linear", "prefill_linear")
        }
        stored = stored_offered(self.model, ops) and not on_copies
        paths = (
            {
                "linear": "amx",
                "batch_linear": "c",
                "big_batch_linear": "c",
                "prefill_linear": "plain",
            }
            if stored
            else {
                "linear": pairs_preferred(ops.pairs_isa),
                "batch_linear": "pairs",
                "big_batch_linear": "pairs",
                "prefill_linear": "pairs",
            }
        )
        one_row = ("c", "amx") if stored else tuple(PAIRS_LINEAR)
        if (
            any(forced.get(p, o) != o for p, o in paths.items() if p != "linear")
            or forced.get("linear", paths["linear"]) not in one_row
            or not (stored or (ops.pairs and ops.pairs_rows))
        ):
            return {}
        held = {p: o for p, o in paths.items() if p not in forced}
        if not held:
            return {}
        weights_bytes = sum(
            m.weight_nbytes() for m in self.model.modules() if isinstance(m, Linear)
        )
        available = available_memory_bytes() or 0
        log.warning(
            "another copy of the weights (%.1f MiB) does not fit in a quarter of the %.1f MiB "
            "of memory available: each weight held once, %s (%s, not measured)",
            weights_bytes / 2**20,
            available / 2**20,
            "as stored" if stored else "in its pairs copy",
            ", ".join(f"{p}={o}" for p, o in held.items()),
        )
        return held

    def _check_decode_step(self) -> DecodeStep:
        """How a decodes-only step under the C kernels runs here: ``one_call`` where the one C
        call gave a call per kernel's bits at load (engine/step_check.py), ``per_kernel`` where
        no step takes the one call, ``per_kernel_mismatch`` where it did not agree and is off."""
        from pdscope.checkpoint.make_model import default_cache_dir

        # (the heap is not a kernel: the check's bits do not depend on it)
        skip = ("how", "trial_s", "heap")
        choice = {k: v for k, v in asdict(self.kernels).items() if k not in skip}
        start = time.perf_counter()
        check = check_one_call(
            self.model, self.args.block_size, {"kernels": choice, "dtype": str(self.dtype)},
            default_cache_dir() / "step_check",
        )  # fmt: skip
        ms = (time.perf_counter() - start) * 1e3
        threads = torch.get_num_threads()
        on = f"{threads} thread{'s' if threads != 1 else ''}"
        if check.unchecked:
            log.warning(
                "one-call decode step: not checked at %s, where the per-kernel path raised",
                "; ".join(f"{k} ({v})" for k, v in check.unchecked.items()),
            )
        if not check.agrees:
            return "one_call" if check.unchecked else "per_kernel"
        if check.passed:
            log.info(
                "one-call decode step: the per-kernel path's bits at %s, %s (%s)",
                ", ".join(check.agrees), on,
                "a pass cached" if check.cached else f"checked in {ms:.0f} ms",
            )  # fmt: skip
            return "one_call"
        self.model.fuse_decode = False
        log.warning(
            "one-call decode step: differs from the per-kernel path on %s, %s: %s; decode "
            "keeps a call per kernel (slower, the same results). Please report this CPU.",
            cpu_model(), on,
            "; ".join(f"{k}: {v}" for k, v in check.differences.items()),
        )  # fmt: skip
        return "per_kernel_mismatch"

    def _kv_asked_bytes(self) -> int:
        """kv_cache_memory: the pool's size off CUDA, where gpu_memory_utilization set away
        from its default would change nothing, so it is refused (as the CLI refuses such
        options)."""
        if self.args.gpu_memory_utilization != EngineArgs().gpu_memory_utilization:
            raise ValueError(
                f"gpu_memory_utilization applies on CUDA only; on {self.device.type} the KV pool "
                "is kv_cache_memory (--kv-cache-memory)"
            )
        return parse_bytes(self.args.kv_cache_memory)

    def _check_pool_holds_a_request(self, pool_bytes: int, block_bytes: int) -> int:
        """The pool's count of blocks; refused where one request of max_model_len needs more."""
        num_blocks = pool_bytes // block_bytes
        needed = -(-self.max_model_len // self.args.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"KV cache of {pool_bytes / 2**20:.1f} MiB holds {num_blocks} blocks "
                f"({num_blocks * self.args.block_size} tokens) but one request of max_model_len "
                f"{self.max_model_len} needs {needed} blocks: raise kv_cache_memory "
                f"(at least {needed * block_bytes / 2**20:.1f} MiB) or lower max_model_len"
            )
        return num_blocks

    def _kv_budget_bytes(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * self.args.gpu_memory_utilization - used)
            if budget <= 0:
                raise ValueError(
                    f"gpu_memory_utilization {self.args.gpu_memory_utilization} "
                    f"leaves no KV memory: {used / 2**30:.1f} GiB already in use"
                )
            return budget
        asked = self._kv_asked_bytes()
        free = available_memory_bytes()
        if free is not None and asked > free:
            raise ValueError(
                f"kv_cache_memory {asked / 2**30:.1f} GiB is more than the "
                f"{free / 2**30:.1f} GiB of memory available here (after the weights)"
            )
        return asked

    @property
    def pool_summary(self) -> str:
        blocks = self.pool.num_blocks
        return (
            f"KV cache: {blocks} blocks x {self.pool.block_size} tokens = "
            f"{blocks * self.pool.block_size} tokens, {self.kv_cache_bytes / 2**20:.1f} MiB"
        )

    # --- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_s: float | None = None,
    ) -> Request:
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt has token ids outside the vocabulary (0..{vocab - 1})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids outside the vocabulary (0..{vocab - 1})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len is "
                f"{self.max_model_len}, which must leave room for one output token"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        now = time.perf_counter() if arrival_s is None else arrival_s
        request = Request(
            request_id,
            ids,
            params,
            RequestTimeline(now, prompt_tokens=len(ids)),
            stop_token_ids=frozenset(params.stop_token_ids).union(
                () if params.ignore_eos else self.tokenizer.stop_token_ids
            ),
        )
        self.requests[request_id] = request
        self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, ids)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free what it holds. False if it is unknown."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        request.timeline.cancelled = True
        self._finish(request, "abort", time.perf_counter())
        return True

    def abort_all(self) -> list[RequestOutput]:
        """Stop every unfinished request (a server shutting down): a final output for each,
        finish reason "abort", its text as far as it got."""
        return self._abort_with_outputs(
            [r for r in self.requests.values() if not r.is_finished], None
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (after new weights are loaded: its KV was computed with the
        old). False, and nothing forgotten, while a request holds KV blocks."""
        return self.pool.reset_prefix_cache()

    # --- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and advance every scheduled request."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        self.scheduler.started(out, start)
        try:
            sampled = self.runner.execute(out)
        except Exception as exc:  # one bad step fails its requests; the engine keeps serving
            log.exception("step failed; aborting its %d requests", len(out.scheduled))
            failed = [e.request for e in out.scheduled]
            return self._abort_with_outputs(failed, f"{type(exc).__name__}: {exc}")
        self.scheduler.update(out)
        end = time.perf_counter()

        outputs = []
        for entry in out.scheduled:
            request = entry.request
            token = sampled.get(request)
            if token is None:
                continue
            request.append_output(token)
            request.timeline.token_s.append(end)
            error = None
            try:
                reason = self._check_stop(request, token)
            except Exception as exc:
                log.exception("request %s failed after its token", request.request_id)
                reason, error = "abort", f"{type(exc).__name__}: {exc}"
            if reason:
                self._finish(request, reason, end)
            outputs.append(
                RequestOutput(
                    request.request_id,
                    [token],
                    request.output_text,
                    request.is_finished,
                    request.finish_reason,
                    request,
                    error,
                )
            )
        record = self.scheduler.record(out, start, end)
        self.steps.append(record)
        for listener in self.step_listeners:
            listener(record, [o.request for o in outputs])
        return outputs

    def _abort_with_outputs(
        self, requests: list[Request], error: str | None
    ) -> list[RequestOutput]:
        now = time.perf_counter()
        outputs = []
        for request in requests:
            if not request.is_finished:
                self._finish(request, "abort", now)
            outputs.append(
                RequestOutput(
                    request.request_id, [], request.output_text, True, "abort", request, error
                )
            )
        return outputs

    def _check_stop(self, request: Request, token: int) -> str | None:
        p = request.params
        detokenizer = self.detokenizers[request.request_id]
        enough = len(request.output_token_ids) >= p.min_tokens
        if enough and token in request.stop_token_ids:
            request.output_text += detokenizer.flush()  # the stop token itself adds no text
            return "stop"
        delta = detokenizer.add(token)
        if delta:
            request.output_text += delta
            if enough and p.stop:
                # Only a stop string this token completes counts (it ends inside the delta): one
                # completed before min_tokens was ignored then, and a stream has already sent it.
                end = len(request.output_text) - len(delta)
                hits = [
                    i
                    for s in p.stop
                    if (i := request.output_text.find(s, max(0, end - len(s) + 1))) >= 0
                ]
                if hits:
                    request.output_text = request.output_text[: min(hits)]
                    return "stop"
        if len(request.output_token_ids) >= p.max_tokens or (
            request.num_tokens >= self.max_model_len
        ):
            request.output_text += detokenizer.flush()  # release a held-back partial character
            return "length"
        return None

    def _finish(self, request: Request, reason: str, now: float) -> None:
        self.scheduler.finish(request, reason)
        request.timeline.finished_s = now
        request.timeline.finish_reason = reason
        self.runner.release(request)
        self.detokenizers.pop(request.request_id, None)
        self.requests.pop(request.request_id, None)
        for listener in self.finish_listeners:
            listener(request)

    # --- stats ----------------------------------------------------------------------------

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions


@dataclass
class CompletionOutput:
    """One prompt's result from :meth:`LLM.generate`."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    timeline: RequestTimeline


class LLM:
    """Offline batch generation: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

    def __init__(self, model: str = "small", **engine_args: object):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))  # type: ignore[arg-type]

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """See :meth:`LLMEngine.reset_prefix_cache`."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion, all in one continuous batch; results in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        requests = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while self.engine.has_unfinished():
            self.engine.step()
        return [
            CompletionOutput(
                r.prompt_token_ids,
                list(r.output_token_ids),
                r.output_text,
                r.finish_reason or "",
                r.timeline,
            )
            for r in requests
        ]
