"""A Llama-family decoder in plain PyTorch with paged attention.

Covers LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias) and Qwen3ForCausalLM
(per-head q/k RMSNorm). Projections are fused (qkv, gate_up) so a decode step launches few ops.

Tokens of one step arrive flattened: first one token per decoding sequence, then the chunks of
the prefilling sequences. K/V for every token is written into the paged cache first; attention
then reads keys and values from the cache through each sequence's block table.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import operator
import os
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pdscope.engine.kernels import OPTIONS, PAIRS_LINEAR, packed_unread, stored_past_one
from pdscope.engine.malloc import MAP_FROM_BYTES
from pdscope.engine.native import DecodeLayer, DecodeStep
from pdscope.specs import architectures as registry

if TYPE_CHECKING:
    from pdscope.engine.kernels import KernelChoice
    from pdscope.engine.native import NativeOps

# Decode batches of 2 up to this many sequences may do attention math in float32 on CPU (see
# _decode; the kernel choice's decode_math says whether they do).
_FLOAT32_DECODE_MAX_SEQS = 4
# RMSNorm inputs up to this many elements take the LayerNorm form (see RMSNorm).
_SMALL_NORM_ELEMENTS = 64 * 1024
# Queries per block in CPU prefill attention (see _prefill_cpu); 64 was fastest at 2k tokens.
_PREFILL_BLOCK = 64
# A single decoding sequence whose context lies in at most this many runs of consecutive cache
# slots, of at least MIN_KEYS_PER_RUN keys a run on average, attends to them in place (see
# _decode_in_place); more fragmented ones are gathered. Each run is one flash call (32-69 us
# a layer), the gather one copy of every key. bench/decode_runs_ab.py on the AMD EPYC Zen 4,
# the 3B's shapes only (8 KV heads of 128: a key is 4 KiB of K and V a layer), 28 layers,
# gather over in place in two runs: 0.41-0.42 at 256 keys in 8 runs, 0.72-1.03 at 128 keys
# a run, 0.85-1.32 at 250-256 keys a run (the short contexts lower), 1.31-1.37 at 4,000 keys
# in 8 runs and 1.17-1.20 in 16. At the small's shapes (1 KiB a key) par is near 500 keys a
# run (docs/performance.md): the bound belongs in bytes of K and V a run.
MAX_DECODE_RUNS = 32
MIN_KEYS_PER_RUN = 192
# The C path hands a sequence of NATIVE_SDPA_FROM_KEYS keys or more to the torch in-place
# path in at most this many runs (its limit before MAX_DECODE_RUNS rose; past 8 runs at such
# lengths, flash a run against the C kernel over the table is unmeasured).
C_PATH_MAX_RUNS = 8
# Matmuls of at most this many rows take the C kernel when the choice is linear=c; larger ones
# the packed (or plain) oneDNN path. Measured on the AMX Xeon (the small model's weights,
# interleaved): C 1.19x packed at one row, par at two, 0.9x at four, where oneDNN's AMX
# tiles start to pay and the C kernel's vdpbf16ps turns compute-bound.
NATIVE_LINEAR_MAX_ROWS = 1
# Matmuls of 2 to this many rows take the many-row C kernel when the choice is batch_linear=c
# (AMX tiles: a weight block is read once for up to 32 rows of x). Measured on the AMX Xeon,
# one thread, the small model's 49 weights interleaved with oneDNN packed for many rows: 1.4x
# at 16 rows, 1.15x at 32, 0.9x at 48 and 0.85x at 64 (the block is swept again per 32 rows,
# and a tile multiply takes ~24 ns here, so the tiles turn compute-bound).
NATIVE_MANY_MAX_ROWS = 32
# Matmuls of NATIVE_MANY_MAX_ROWS + 1 to this many rows take the pairs copies' row tiles when
# the choice is big_batch_linear=pairs (a decode batch of 33 up to the default max_num_seqs).
# AMD EPYC Zen 4, the small model's 49 weights (bench/linear_ab.py): the copies 1.08-1.18x
# oneDNN's packed weights at 40-64 rows, 1.04x at 96, 0.97-1.00x at 128-512, where both run
# near the cores' vdpbf16ps rate and oneDNN's fixed costs no longer show.
BIG_BATCH_MAX_ROWS = 64
# With linear=c the packed weights serve only matmuls of several rows (batched decode,
# prefill), so they are laid out for many rows: on the AMX Xeon, one thread, interleaved over
# the small model's 49 weights, packing for 2,048 rows instead of 1 took 2,000-row matmuls
# 1.18x and 32-row ones 1.21x faster (medians of 6 and 9 rounds).
PACKED_ROWS_WITH_C = 2048
# Matmuls of at least this many rows (a prefill chunk) take prefill_linear=transposed or rows
# when chosen: torch.mm on a transposed copy of the weight, whole or with x's rows split over
# the OpenMP team (see Linear). A decode batch stays below it, on linear's path.
ROWS_SPLIT_MIN_ROWS = 512
# Steps of PAD_MIN_ROWS rows or more (more than the C kernels take: steps with prefill chunks,
# and decode batches of 33-64 unless big_batch_linear=pairs takes them) run their matmuls
# through oneDNN, which builds a primitive for every new row count: on the AMX Xeon 3-14 ms
# for each of a layer's four weight shapes, 24-31 ms in the first prefill of each new length
# (docs/performance.md). Under step_rows=padded (the rule for a bf16 model there; torch's
# float32 matmuls are MKL's, built per call) such steps are padded to a multiple of
# ROW_BUCKET rows, so that a server meets at most one row count per ROW_BUCKET tokens of its
# budget; the padding rows (token 0) go through the norms and matmuls and are dropped before
# the attention and from the result. Under big_batch_linear=pairs padding starts past
# BIG_BATCH_MAX_ROWS: the copies' tiles build nothing, and padding rows would only cost them
# work; with prefill_linear=pairs too, steps are not padded (step_rows=exact).
# (Decodes-only steps on the C kernels take decode_logits, never padded.) A padded
# count can cross a row threshold its exact one is under (ROWS_SPLIT_MIN_ROWS,
# _SMALL_NORM_ELEMENTS): the real rows then take that path.
PAD_MIN_ROWS = NATIVE_MANY_MAX_ROWS + 1
ROW_BUCKET = 16
# Under matmul_math=float32, bf16 matmuls of at least this many rows (that no C kernel takes)
# widen to float32. AVX2-only AMD EPYC, one layer of the small model, bf16 F.linear against
# widened: 11.4 / 12.5 ms at 8 rows, 14.0 / 11.2 at 12, 19.0 / 12.8 at 16, 35.2 / 14.5 at 32
# (interleaved in bench/widen_rows.py another time: level at 16, 16.7 / 18.6 at 12).
WIDEN_MIN_ROWS = 12
# ... each weight widened at most this many elements at a time (64 MiB of float32)
WIDEN_SLICE_ELEMENTS = 1 << 24
# prefill_linear=transposed's copy of the layer weights, and linear=pairs' copy of every
# weight, are each offered to the trial only while it takes at most this share of the memory
# free at start-up.
TRANSPOSED_COPY_MAX_SHARE = 0.25
# Returns the log-sum-exp beside the output, which merging runs needs; absent on old torch.
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        found = registry.architecture_of(config)
        if found is None:
            archs = config.get("architectures") or []
            raise ValueError(
                f"unsupported architecture {archs or config.get('model_type')!r}; "
                f"supported: {', '.join(registry.supported_names())}"
            )
        arch = found.name
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if not config.get(key):
                raise ValueError(f"config.json lacks '{key}'")
        heads = config["num_attention_heads"]
        window = registry.engine_window(config)  # refuses windows on some layers only
        return cls(
            architecture=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=registry.num_kv_heads(config),
            head_dim=registry.head_dim(config),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta", 10000.0),
            rope_scaling=config.get("rope_scaling"),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=registry.has_qkv_bias(config),
            qk_norm=found.qk_norm,
            sliding_window=window,
        )

    @property
    def kv_bytes_per_token_per_element(self) -> int:
        """KV elements one token adds across all layers (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama 3's frequency-dependent scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


@dataclass
class AttentionBatch:
    """Where one step's tokens go in the cache and which keys each one sees.

    ``slot_mapping[t]`` is the flat cache slot (block * block_size + offset) for token ``t``.
    The first ``num_decode`` tokens are decodes (one per sequence): ``decode_rows`` holds the
    cache rows (:func:`block_rows`) of each one's block table padded to B blocks, of which the
    key positions ``decode_keys`` = [lo, hi) are attended; ``decode_mask`` [D, hi - lo] is True
    for real keys (None when no key in the range is padding or outside a window).
    ``prefills`` lists, per prefilling sequence, (first token index, chunk length, tokens cached
    before the chunk, cache rows of the whole context's blocks, or None when nothing was cached).
    ``decode_runs``, for a single decoding sequence, lists its attended keys as runs of
    consecutive cache slots (first slot, length), in position order; ``decode_rows`` may then
    be None. ``decode_tables`` is set on the C kernels only: the decodes' attention reads
    the cache in place through it, and the PyTorch path's decode fields are unused. With it
    and no prefill chunk the step is decodes only, and takes the C kernels' decode step.
    """

    slot_mapping: torch.Tensor
    block_size: int
    num_decode: int
    decode_rows: torch.Tensor | None
    decode_keys: tuple[int, int]
    decode_mask: torch.Tensor | None
    prefills: list[tuple[int, int, int, torch.Tensor | None]]
    decode_runs: list[tuple[int, int]] | None = None
    # The decodes of a step on the C kernels (engine/native.py): each sequence's block table
    # [D, width] and attended key positions [D, 2] (lo, hi), read in place; in a decodes-only
    # step the token positions index the model's float32 rope tables there.
    decode_tables: torch.Tensor | None = None
    decode_bounds: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def slot_runs(table: list[int], lo: int, hi: int, block_size: int) -> list[tuple[int, int]]:
    """Key positions [lo, hi) of a sequence with block table ``table`` as runs of consecutive
    cache slots: (first slot, length), merged across blocks that follow each other in the pool."""
    runs: list[tuple[int, int]] = []
    pos = lo
    while pos < hi:
        index, offset = divmod(pos, block_size)
        slot, n = table[index] * block_size + offset, min(hi - pos, block_size - offset)
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((slot, n))
        pos += n
    return runs


def can_decode_in_place(
    runs: list[tuple[int, int]], device: torch.device, max_runs: int = MAX_DECODE_RUNS
) -> bool:
    """Whether :meth:`Attention._decode_in_place` takes a context in ``runs``: one run
    anywhere; up to ``max_runs`` of :data:`MIN_KEYS_PER_RUN` keys on average on CPU, where
    torch's flash kernel returns the log-sum-exps that merging runs needs."""
    if len(runs) == 1:
        return True
    keys = sum(n for _, n in runs)
    return (
        device.type == "cpu"
        and _flash_cpu is not None
        and len(runs) <= max_runs
        and keys >= MIN_KEYS_PER_RUN * len(runs)
    )


def _gather_blocks(kv_cache: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Whole cache blocks of keys and values by row id: [2, kv_heads, blocks * block_size, dim].

    ``rows`` indexes the cache [2, kv_heads, slots, dim] viewed as
    [2 * kv_heads * num_blocks, block_size, dim] (see :func:`block_rows`). One index_select over
    dim 0 moves each block as one contiguous copy, keys and values together: on CPU that is ~5x
    faster than selecting blocks along the slot dim, and per-slot gathers or 2-D advanced
    indexing are slower still (profiled).
    """
    _, kvh, _, dim = kv_cache.shape
    return kv_cache.view(-1, block_size, dim).index_select(0, rows).view(2, kvh, -1, dim)


def block_rows(blocks: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Row ids of ``blocks`` in every K and V head plane (2 * kv_heads of them), plane-major,
    for :func:`_gather_blocks`."""
    planes = torch.arange(2 * kv_heads, device=blocks.device)[:, None] * num_blocks
    return (planes + blocks.reshape(1, -1)).reshape(-1)


# The op overload itself: calling it skips the overload-packet lookup on every decode matmul.
_packed_linear = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)


def version_of(t: torch.Tensor) -> int:
    """The tensor's version counter, which each in-place write bumps; -1 for a tensor that keeps
    none (an inference tensor, made under ``torch.inference_mode`` as the engine's copies are;
    a parameter whose ``.data`` was set to one keeps its own and reads as usual)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def versions_of(tensors: list[torch.Tensor]) -> list[int]:
    """``[version_of(t) for t in tensors]``, without a Python frame per tensor where none is an
    inference tensor."""
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:
        return [version_of(t) for t in tensors]


_VERSION = operator.attrgetter("_version")


# Bumped whenever any module in this process registers a parameter or buffer through
# setattr or register_*: a new nn.Parameter assigned to a module, load_state_dict(assign=True),
# register_buffer. (Module._apply writing _parameters directly, under
# torch.__future__.set_overwrite_module_params_on_conversion(True), goes around it.) The
# one-call decode step's per-step check reads this one count where re-reading every module's
# weight each step would cost ~1 us a weight (its lines cold after the step).
_registrations = 0


def _count_registration(module: nn.Module, name: str, value: object) -> None:
    global _registrations
    _registrations += 1


nn.modules.module.register_module_parameter_registration_hook(_count_registration)
nn.modules.module.register_module_buffer_registration_hook(_count_registration)

# Linear.weight_key while the weight is held once: no stored weight has address 0 and
# version -2 (an inference tensor's counter reads -1).
_HELD_ONCE_KEY = (0, -2)

# Linear.hold_source's storages, by module: while a module lives and its copies stand.
_COPIED_FROM: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.UntypedStorage]] = (
    weakref.WeakKeyDictionary()
)


class Linear(nn.Linear):
    """nn.Linear that can hold its weight pre-packed in oneDNN's blocked layout on CPU, and
    hand single-row inputs to the C kernel (``linear=c``).

    Plain ``F.linear`` on a bf16 CPU tensor re-lays the weight out on every call, which halves
    the bandwidth a decode step gets (profiled: 25 GB/s plain vs 33 GB/s packed on 2 cores).
    A batch-1 decode step is 49 single-row matmuls, each one stream over its weight; torch's
    oneDNN op pays ~10 us of set-up per call and streams below the machine's read rate, where
    the C kernel reads the weight as stored (AMX Xeon, the small model's 49 weights at one row,
    interleaved: C 13.9 ms, packed 16.2, plain 21.9, a plain read of the same bytes 11.7).
    """

    packed: torch.Tensor | None = None
    packed_rows: int = 0  # the row count oneDNN laid the packed weight out for
    native: NativeOps | None = None  # set by apply_kernels when the choice is linear=c or amx
    one_row_amx: bool = False  # linear=amx: single rows through the tile kernel
    native_many: NativeOps | None = None  # set by apply_kernels when batch_linear=c
    # the most rows native_many takes: NATIVE_MANY_MAX_ROWS, or under matmul_math=float32 with
    # batch_linear=packed, the rows below WIDEN_MIN_ROWS (neither widened nor oneDNN's there)
    many_max_rows: int = NATIVE_MANY_MAX_ROWS
    huge_pages: bool = False  # the weight was moved onto transparent huge pages
    team: NativeOps | None = None  # set by apply_kernels when prefill_linear=rows
    widen: bool = False  # matmul_math=float32: bf16 matmuls of WIDEN_MIN_ROWS rows or more
    # [in, out] contiguous, what prefill matmuls multiply by under prefill_linear=transposed or
    # rows: oneDNN's matmul on it beat the packed weights at 2,000 rows on the AMX Xeon
    weight_t: torch.Tensor | None = None
    # linear=pairs (or batch_linear, big_batch_linear or prefill_linear=pairs): the weight's
    # pack_pairs copy [out / 16, in / 2, 16, 2], what the rows of those paths multiply by
    # (NativeOps.linear_pairs); None where the shape does not allow it.
    pairs: torch.Tensor | None = None
    one_row_pairs: bool = False  # linear=pairs/pairs2: single rows read the copy where it is
    pair_streams: int = 8  # ... as 8 streams a thread (linear=pairs) or 2 (pairs2)
    # batch_linear=pairs: matmuls of 2 to NATIVE_MANY_MAX_ROWS rows read it (native_many set)
    many_pairs: bool = False
    # set by apply_kernels when big_batch_linear=pairs or c: matmuls of NATIVE_MANY_MAX_ROWS + 1
    # to BIG_BATCH_MAX_ROWS rows read the copy (pairs; a weight without one, and every weight
    # under c, through the many-row kernel as stored)
    big_batch: NativeOps | None = None
    big_batch_pairs: bool = False  # big_batch_linear=pairs: big_batch reads the copy
    # set by apply_kernels when prefill_linear=pairs: matmuls past BIG_BATCH_MAX_ROWS rows read
    # the copy (a weight without one, the packed weights)
    many_rows: NativeOps | None = None
    # set by apply_kernels when prefill_linear=plain: matmuls past BIG_BATCH_MAX_ROWS rows run
    # F.linear on the weight as stored (oneDNN's primitive lays it out per call)
    plain_rows: bool = False
    # The weight_key() each copy (packed, weight_t, pairs) was made from: a copy whose key
    # differs from the weight's is made anew before a matmul reads it.
    packed_source: tuple[int, int] = (0, -1)
    weight_t_source: tuple[int, int] = (0, -1)
    pairs_source: tuple[int, int] = (0, -1)
    # Set by apply_kernels where no matmul of any row count reads the weight as stored (each
    # reads the pairs copy, or it and the packed one: :meth:`weight_unread`): the weight is let
    # go and the copy holds its values, once. ``.weight`` makes it again from the copy on
    # first access and holds it from then on (:meth:`restore_weight`).
    held_once: bool = False
    held_requires_grad: bool = False  # the let-go weight's flag, for the one made again

    @property
    def weight(self) -> nn.Parameter:  # type: ignore[override]
        """The weight [out, in]; where it is held once (only its pairs copy kept), made again
        from the copy first."""
        weight = self._parameters.get("weight")
        if weight is None:
            if not self.held_once:
                raise AttributeError("weight")  # nn.Linear.__init__ has not registered it yet
            weight = self.restore_weight()
        return weight

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight" and self.__dict__.get("held_once"):
            self.held_once = False  # a new weight replaces the one the copy holds: not made
            try:
                super().__setattr__(name, value)
            except BaseException:
                self.held_once = True  # refused (not a Parameter): the copy still holds it
                raise
            return
        super().__setattr__(name, value)

    def stored_weight(self) -> torch.Tensor | None:
        """The weight as stored, or None where it is held once (nothing made again)."""
        return self._parameters.get("weight")

    def weight_nbytes(self) -> int:
        """The weight's bytes, stored or held once in its copy (nothing made again)."""
        weight = self.pairs if self.held_once else self.weight
        assert weight is not None
        return weight.numel() * weight.element_size()

    def weight_unread(self) -> bool:
        """Whether no matmul of any row count reads the weight as stored under the paths
        apply_kernels set (:meth:`forward`'s order): one row and 2 to 32 rows read the pairs
        copy, and each larger count the copy too or the packed weights (which a 3-D input or
        a weight the copy cannot take would read as well); never under big_batch_linear=c or
        prefill_linear=plain, which read the weight as stored."""
        if self.pairs is None or not self.one_row_pairs or self.native is None:
            return False
        if self.plain_rows or (self.big_batch is not None and not self.big_batch_pairs):
            return False  # prefill_linear=plain or big_batch_linear=c read the weight
        many = self.native_many is not None
        if many and not (self.many_pairs and self.many_max_rows >= NATIVE_MANY_MAX_ROWS):
            return False  # batch_linear=c: the many-row kernel reads the weight
        every_count = many and self.big_batch_pairs and self.many_rows is not None
        # matmul_math=float32 widens the weight for a matmul no copy takes: none then
        return every_count or (self.packed is not None and not self.widen)

    def hold_once(self) -> None:
        """Let the weight go where the copies read in its place hold its values
        (:meth:`weight_unread`): its storage is freed unless something else holds it. The
        copies are keyed to :data:`_HELD_ONCE_KEY`, which :meth:`weight_key` reads while
        held once and no stored weight can have, so a weight set later is copied anew."""
        assert self.weight_unread() and self.pairs is not None
        key = self.weight_key()
        weight = self._parameters.pop("weight")
        self.held_requires_grad = weight.requires_grad
        for copy in ("packed", "weight_t", "pairs"):
            if getattr(self, copy) is not None:
                assert getattr(self, f"{copy}_source") == key, f"{copy} is stale"
                setattr(self, f"{copy}_source", _HELD_ONCE_KEY)
            # nothing pairs a later weight with these copies now: the storage may go
            self.hold_source(copy, made=False)
        self.held_once = True

    def held_values(self) -> torch.Tensor:
        """A held weight's values [out, in], made from its pairs copy ([out / 16, in / 2, 16,
        2]: a permute, the same bits)."""
        assert self.pairs is not None
        return self.pairs.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)

    def restore_weight(self) -> nn.Parameter:
        """The weight made again from the pairs copy and stored (no longer held once), its
        copies keyed to it (they hold its very values)."""
        assert self.held_once and self.pairs is not None
        # outside inference mode: a normal tensor, whose in-place writes bump its counter
        with torch.inference_mode(False):
            weight = nn.Parameter(self.held_values(), requires_grad=self.held_requires_grad)
        self.weight = weight  # clears held_once; counted as a registration
        self.huge_pages = False  # made on ordinary pages: a path that streams it moves it
        key = self.weight_key()
        for copy in ("packed", "weight_t", "pairs"):
            if getattr(self, copy) is not None:
                setattr(self, f"{copy}_source", key)
                self.hold_source(copy)
        return weight

    def _apply(self, fn: Any, recurse: bool = True) -> Linear:
        """``.to()``, ``.float()``, ``.cuda()`` and the rest reach a held weight too: where
        ``fn`` would change a tensor of the copy's dtype and device, the weight is made again
        first and converted as a stored one is (its copies, stale, made anew before a matmul
        reads them); where it would not (``.to()`` the dtype and device it has), the weight
        stays held once rather than be made again for nothing. Asked of an empty stand-in:
        ``fn`` on the copy itself would convert all of it to answer."""
        if self.held_once:
            assert self.pairs is not None
            stand_in = self.pairs.new_empty(0)
            if fn(stand_in) is not stand_in:
                self.restore_weight()
        return super()._apply(fn, recurse)

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        if self.held_once:  # the values, made from the copy; the module still holds them once
            destination[prefix + "weight"] = self.held_values()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        if self.held_once and prefix + "weight" in state_dict:
            self.restore_weight()  # written in place (or assigned) as any stored weight
        super()._load_from_state_dict(state_dict, prefix, *args)

    def hold_source(self, copy: str, made: bool = True) -> None:
        """Hold the weight storage ``copy`` (packed, weight_t, pairs) was made from while the
        copy stands (``made``), or let it go: freed, its address could go to a later weight
        whose counter reads the same, which would then pass for the weight the copy was made
        from. Held outside the module (_COPIED_FROM), so saving or copying a module carries
        no storage of its own."""
        held = _COPIED_FROM.setdefault(self, {})
        if made:
            held[copy] = self.weight.untyped_storage()
        else:
            held.pop(copy, None)

    def weight_key(self) -> tuple[int, int]:
        """The weight's storage address and version counter. Replacing ``.data`` changes the
        first; an in-place write through the parameter (``load_state_dict``, ``copy_`` under
        ``no_grad``) the second. A write through ``.data`` bypasses the counter: a copy made
        before it is not remade. :data:`_HELD_ONCE_KEY` while the weight is held once."""
        if self.held_once:
            return _HELD_ONCE_KEY
        return self.weight.data_ptr(), version_of(self.weight)

    def pack(self, rows: int = 1) -> None:
        """Pre-pack the weight for matmuls of about ``rows`` rows (oneDNN's batch hint)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows)
        self.packed_rows = rows
        self.packed_source = self.weight_key()
        self.hold_source("packed")

    def make_weight_t(self) -> None:
        """Hold the weight transposed, [in, out] contiguous (prefill_linear=transposed, rows)."""
        self.weight_t = self.weight.detach().t().contiguous()
        self.weight_t_source = self.weight_key()
        self.hold_source("weight_t")

    def make_pairs(self, native: NativeOps) -> None:
        """Hold the weight's pack_pairs copy (:func:`pairs_copy`), for linear=pairs,
        batch_linear=pairs, big_batch_linear=pairs or prefill_linear=pairs."""
        self.pairs = pairs_copy(self.weight, native)
        self.pairs_source = self.weight_key()
        self.hold_source("pairs", self.pairs is not None)

    def current_pairs(self) -> torch.Tensor | None:
        """Under linear=pairs, batch_linear=pairs, big_batch_linear=pairs or
        prefill_linear=pairs, the pairs copy, made anew first if the weight changed since (a
        replacing weight whose shape allows one gets one even where the weight before could
        not); None where the weight takes none or the paths are others."""
        big_batch = self.big_batch if self.big_batch_pairs else None
        paths = (
            self.one_row_pairs
            or self.many_pairs
            or any(n is not None for n in (big_batch, self.many_rows))
        )
        if paths and self.pairs_source != self.weight_key():
            native = (
                self.native
                if self.one_row_pairs
                else self.native_many or big_batch or self.many_rows
            )
            assert native is not None  # apply_kernels sets it with the path
            self.make_pairs(native)
        return self.pairs

    def current_packed(self) -> torch.Tensor | None:
        """The packed weight, packed anew first if the weight changed since; dropped (None)
        when the weight changed to one oneDNN's packing does not take. (Where every path
        past one row reads the pairs copy, apply_kernels kept none: a weight replaced then by
        one of a shape the copy cannot take runs ``F.linear``, slower but the same result.)"""
        if self.packed is not None and self.packed_source != self.weight_key():
            if can_pack(self.weight.dtype, self.weight.device):
                self.pack(self.packed_rows)
            else:
                self.packed, self.packed_rows = None, 0
                self.hold_source("packed", made=False)
        return self.packed

    def current_weight_t(self) -> torch.Tensor | None:
        """The transposed weight, made anew first if the weight changed since; dropped (None)
        when the weight changed to a dtype the path does not take (bf16 only, as
        apply_kernels offers it)."""
        if self.weight_t is not None and self.weight_t_source != self.weight_key():
            if self.weight.dtype == torch.bfloat16:
                self.make_weight_t()
            else:
                self.weight_t = None
                self.hold_source("weight_t", made=False)
        return self.weight_t

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias). ``out`` (2-D x of more than BIG_BATCH_MAX_ROWS rows only):
        where the path can, the result is written there and ``out`` returned; oneDNN's packed
        path cannot, and returns a new tensor (:class:`Scratch` says why)."""
        assert out is None or (x.dim() == 2 and x.shape[0] > BIG_BATCH_MAX_ROWS)
        if self.one_row_pairs and self.native is not None and x.dim() == 2 and x.shape[0] == 1:
            pairs = self.current_pairs()  # None: a weight the copy cannot take
            if pairs is not None:
                return self.native.linear_pairs(
                    x.contiguous(), pairs, self.bias, streams=self.pair_streams
                )
        if self.native is not None and x.dim() == 2 and x.shape[0] <= NATIVE_LINEAR_MAX_ROWS:
            run = self.native.linear_many if self.one_row_amx else self.native.linear
            return run(x.contiguous(), self.weight, self.bias)
        if (
            self.native_many is not None
            and x.dim() == 2
            and NATIVE_LINEAR_MAX_ROWS < x.shape[0] <= self.many_max_rows
        ):
            # batch_linear=pairs: the copy where the weight has one, else the many-row kernel
            pairs = self.current_pairs() if self.many_pairs else None
            if pairs is not None:
                return self.native_many.linear_pairs(x.contiguous(), pairs, self.bias)
            return self.native_many.linear_many(x.contiguous(), self.weight, self.bias)
        if (
            self.big_batch is not None
            and x.dim() == 2
            and NATIVE_MANY_MAX_ROWS < x.shape[0] <= BIG_BATCH_MAX_ROWS
        ):
            pairs = self.current_pairs() if self.big_batch_pairs else None
            if pairs is not None:
                return self.big_batch.linear_pairs(x.contiguous(), pairs, self.bias)
            return self.big_batch.linear_many(x.contiguous(), self.weight, self.bias)
        if self.many_rows is not None and x.dim() == 2 and x.shape[0] > BIG_BATCH_MAX_ROWS:
            pairs = self.current_pairs()
            if pairs is not None:
                return self.many_rows.linear_pairs(x.contiguous(), pairs, self.bias, out=out)
        if self.weight_t is not None and x.dim() == 2 and x.shape[0] >= ROWS_SPLIT_MIN_ROWS:
            weight_t = self.current_weight_t()  # None: a weight the path does not take
            if weight_t is not None and self.team is not None:
                return linear_by_rows(x, weight_t, self.bias, self.team, out)
            if weight_t is not None:
                return linear_transposed(x, weight_t, self.bias, out)
        if self.widen and x.numel() >= WIDEN_MIN_ROWS * x.shape[-1]:
            return linear_widened(x, self.weight, self.bias, out)
        if self.plain_rows and x.numel() > BIG_BATCH_MAX_ROWS * x.shape[-1]:
            return linear_plain(x, self.weight, self.bias, out)
        packed = self.current_packed()
        if packed is not None:
            return _packed_linear(x, packed, self.bias, "none", [], "")
        return linear_plain(x, self.weight, self.bias, out)

    def fresh_output(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` on ``x`` (2-D, more than BIG_BATCH_MAX_ROWS rows) takes
        oneDNN's packed path, which makes its own output where every other path there writes
        into ``out``: the same tests in the same order (a test pins the two together)."""
        assert x.dim() == 2 and x.shape[0] > BIG_BATCH_MAX_ROWS
        assert self.many_max_rows <= BIG_BATCH_MAX_ROWS  # forward's many-row kernels: none here
        if self.many_rows is not None and self.current_pairs() is not None:
            return False
        if (
            self.weight_t is not None
            and x.shape[0] >= ROWS_SPLIT_MIN_ROWS
            and self.current_weight_t() is not None
        ):
            return False
        if self.widen and x.numel() >= WIDEN_MIN_ROWS * x.shape[-1]:
            return False
        return not self.plain_rows and self.current_packed() is not None


def linear_plain(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear``, into ``out`` where given (x 2-D): the same oneDNN matmul on the weight as
    stored."""
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def linear_widened(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) in float32, the result back in x's dtype (``matmul_math=float32``):
    float32 accumulation and one rounding, as a bf16 matmul's. Into ``out`` where given."""
    if out is None:
        out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    wide_x = x.float()
    # The weight widened a slice of output rows at a time: a whole LM head (152k x 896) would
    # be a 545 MB float32 copy a step, beside a KV budget that does not count it.
    step = max(1, WIDEN_SLICE_ELEMENTS // weight.shape[1])
    for lo in range(0, weight.shape[0], step):
        hi = min(lo + step, weight.shape[0])
        wide_bias = None if bias is None else bias[lo:hi].float()
        out[..., lo:hi] = F.linear(wide_x, weight[lo:hi].float(), wide_bias)
    return out


def linear_transposed(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight_t (+ bias), ``weight_t`` [in, out] contiguous (``prefill_linear=transposed``):
    oneDNN's matmul primitive on the plain layout, its threads splitting the work. Into
    ``out`` where given."""
    if bias is None:
        return torch.mm(x, weight_t, out=out)
    return torch.addmm(bias, x, weight_t, out=out)


def linear_by_rows(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None,
    team: NativeOps,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight_t (+ bias) for a 2-D ``x``, its rows split evenly over the OpenMP team
    (``prefill_linear=rows``): thread i of n multiplies rows [i r / n, (i + 1) r / n) by
    ``weight_t`` ([in, out], contiguous) into those rows of one output, as a one-thread oneDNN
    matmul (a nested region is serial). oneDNN's own threading splits each matmul of a prefill
    too, but syncs its threads per call; two one-thread matmuls side by side need none
    (the gain is measured per machine by the kernel trial, see docs/performance.md). Into
    ``out`` where given."""
    x = x.contiguous()
    rows = x.shape[0]
    if out is None:
        out = torch.empty(rows, weight_t.shape[1], dtype=x.dtype, device=x.device)

    def share(i: int, n: int) -> None:
        lo, hi = rows * i // n, rows * (i + 1) // n
        if lo == hi:
            return
        # inference mode is per thread, and the team's other threads are not the engine's:
        # writing into an output made under it needs it here too
        with torch.inference_mode():
            if bias is None:
                torch.mm(x[lo:hi], weight_t, out=out[lo:hi])
            else:
                torch.addmm(bias, x[lo:hi], weight_t, out=out[lo:hi])

    team.run_on_team(share)
    return out


# Linux's transparent huge pages: 2 MiB. A weight the C kernels stream every decode step reads
# 1.06-1.14x faster from memory backed by them (bench/gemv_micro.c's amx_rows_huge; the small
# model's 49 weights at one row through linear_many, 1 and 2 threads: docs/performance.md),
# fewer TLB misses across its 16-32 row streams. Smaller weights cannot fill one.
_HUGE_PAGE_BYTES = 1 << 21
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_setting() -> str | None:
    """Linux's transparent huge page setting (``always``, ``madvise`` or ``never``); None where
    it is absent (not Linux) or unreadable."""
    try:
        with open(_THP_SETTING) as f:
            setting = f.read()
    except OSError:
        return None
    start, end = setting.find("["), setting.find("]")
    return setting[start + 1 : end] if 0 <= start < end else None


def huge_pages_offered() -> bool:
    """Whether Linux backs memory with transparent huge pages on request (``madvise``) or
    always; False where the setting is ``never``, absent (not Linux) or unreadable."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    return huge_pages_setting() in ("always", "madvise")


def empty_on_huge_pages(numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialized 1-D CPU tensor in private anonymous memory that Linux is asked, before
    anything touches it, to back with transparent huge pages; the tensor keeps the mapping
    alive. None when it would be under one huge page or huge pages are not offered."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < _HUGE_PAGE_BYTES or not huge_pages_offered():
        return None
    area = mmap.mmap(-1, nbytes + _HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    start = torch.frombuffer(area, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % _HUGE_PAGE_BYTES  # the tensor starts on a huge-page boundary
    return torch.frombuffer(area, dtype=dtype, count=numel, offset=offset)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor | None:
    """A copy of contiguous CPU tensor ``t`` on transparent huge pages
    (:func:`empty_on_huge_pages`); None when ``t`` is under one huge page or huge pages are
    not offered."""
    if t.device.type != "cpu":
        return None
    copy = empty_on_huge_pages(t.numel(), t.dtype)
    return None if copy is None else copy.view(t.shape).copy_(t)


def takes_pairs(weight: torch.Tensor) -> bool:
    """Whether ``weight`` has a pack_pairs copy: bf16 on CPU, rows a multiple of 16, columns
    of 2."""
    rows, cols = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and not (rows % 16 or cols % 2)
    )


def pairs_copy(weight: torch.Tensor, native: NativeOps) -> torch.Tensor | None:
    """``weight``'s pack_pairs copy for linear=pairs (on huge pages where Linux offers them:
    the C kernel streams it every batch-1 step), or None where its dtype or shape does not
    allow one (bf16, rows a multiple of 16, columns of 2)."""
    if not takes_pairs(weight):
        return None
    return native.pack_pairs(weight.detach(), empty_on_huge_pages(weight.numel(), weight.dtype))


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and onednn_bf16()


def widen_bf16(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a bf16 model here computes its matmuls in float32 (``matmul_math=float32``): on
    a CPU without oneDNN's bf16 path."""
    return device.type == "cpu" and dtype == torch.bfloat16 and not onednn_bf16()


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN packs and runs a bf16 linear on this CPU. Its bf16 path needs AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT: on an AVX2-only AMD EPYC the reorder raises. So one tiny
    weight is packed and run once, rather than reading ISA flags a torch release may change."""
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _packed_linear is not None
    ):
        return False
    weight = torch.ones(16, 32, dtype=torch.bfloat16, device="cpu")
    x = torch.ones(1, 32, dtype=torch.bfloat16, device="cpu")
    try:
        out = _packed_linear(
            x, torch.ops.mkldnn._reorder_linear_weight(weight, 1), None, "none", [], ""
        )
    except Exception:  # RuntimeError here; whatever a torch build raises, no packed path
        return False
    return bool(torch.all(out == 32))


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight.

    Small inputs (decode steps) run it as a LayerNorm of [x, -x]: that has mean exactly 0 and
    variance mean(x^2), so LayerNorm over it, cut back to the first half, is RMSNorm of x, in
    one native kernel where ``F.rms_norm`` runs as ~8 ops on CPU (profiled: 5 us vs 10 us a
    call). Large inputs (prefill) are bound by memory traffic instead, which the doubled copy
    would add to, so they take ``F.rms_norm`` (profiled: ~9% faster prefill at 2,000 tokens).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.doubled: torch.Tensor | None = None  # [weight, weight], built on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = x.shape[-1]
        if x.numel() > _SMALL_NORM_ELEMENTS:
            return F.rms_norm(x, (dim,), self.weight, self.eps)
        if self.doubled is None:  # weights are fixed once loaded; only the first half is used
            self.doubled = torch.cat((self.weight, self.weight)).detach()
        out = F.layer_norm(torch.cat((x, -x), dim=-1), (2 * dim,), self.doubled, None, self.eps)
        return out[..., :dim]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (the Hugging Face layout): x [T, heads, dim], cos/sin [T, 1, dim].

    With ``cos`` = [c, c] and ``sin`` = [-s, s] over the two halves, HF's
    ``x * cos + rotate_half(x) * sin`` is ``x * cos + roll(x, dim / 2) * sin``: three ops.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias)
        self.o_proj = Linear(self.q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.window = c.sliding_window
        self.scale = c.head_dim**-0.5
        # Set by apply_kernels from the machine's kernel choice (see kernels.py).
        self.prefill_sdpa = False
        self.decode_float32 = True
        self.native: NativeOps | None = None
        # prefill_attention=amx or c: the C kernels whose causal attention takes bf16 chunks,
        # its products on AMX tiles (prefill_tiles) or in AVX-512 BF16.
        self.prefill_native: NativeOps | None = None
        self.prefill_tiles = True
        # with prefill_native: read K/V through the block table (False: gather them first,
        # the A/B reference in bench/prefill_ab.py)
        self.prefill_paged = True

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        padded, tokens = x.shape[0], batch.slot_mapping.shape[0]
        assert padded >= tokens, "every token has a cache slot; rows past them are padding"
        qkv = self.qkv_proj(x)[:tokens]  # the first rows of a contiguous tensor: a view
        if batch.decode_tables is not None and not batch.prefills:
            out = self._native_decode(qkv, cos, sin, kv_cache, batch)
        elif self.native is not None:
            out = self._native_rope_attention(qkv, cos, sin, kv_cache, batch, padded)
        else:
            out = self._attention(qkv, cos, sin, kv_cache, batch)
        # o_proj takes the padded row count, as qkv_proj did
        return self.o_proj(padded_to(out.reshape(tokens, self.q_size), padded))

    def _native_rope_store(
        self,
        qkv: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: AttentionBatch,
        heads_major: bool = False,
    ) -> torch.Tensor:
        """The C call both native paths start with: q/k norms, rope by position and the K/V
        write into the cache slots; returns the rotated queries [tokens, heads, dim], laid out
        head-major in memory with ``heads_major`` (see NativeOps.qkv_rope_store)."""
        assert self.native is not None and batch.positions is not None
        q_norm, k_norm = self.q_norm, self.k_norm
        return self.native.qkv_rope_store(
            qkv,
            kv_cache,
            batch.positions,
            batch.slot_mapping,
            cos_table,
            sin_table,
            self.num_heads,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            q_norm.eps if q_norm is not None else 0.0,
            heads_major,
        )

    def _native_decode(
        self,
        qkv: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """A decodes-only step through the C kernels: q/k norms, rope and the K/V write in one
        call, then paged attention over each block table in place. ``cos_table``/``sin_table``
        are the model's whole float32 tables, indexed by ``batch.positions`` inside the call."""
        assert self.native is not None
        assert batch.positions is not None and batch.decode_bounds is not None
        q = self._native_rope_store(qkv, cos_table, sin_table, kv_cache, batch)
        if batch.decode_runs is not None:  # one long context: SDPA in place (runner.py)
            return self._decode_in_place(q, kv_cache, batch.decode_runs)
        return self.native.decode_attention(
            q, kv_cache, batch.decode_tables, batch.decode_bounds, batch.block_size, self.scale
        )

    def _native_rope_attention(
        self,
        qkv: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: AttentionBatch,
        room: int = 0,
    ) -> torch.Tensor:
        """A step with prefill chunks under the C kernels: q/k norms, rope and the K/V write of
        every token in one threaded call (where the PyTorch path runs ~10 ops over the whole
        chunk), then the decodes' attention through their block tables (the C kernel, as in a
        decodes-only step) and each chunk's (the prefill path chosen). Each chunk reads its keys
        back from the cache (the runner gives every chunk its block rows here), so the rotated
        K never needs a tensor of its own. The output [tokens, heads, dim] lies, where it can,
        in storage with ``room`` rows (:func:`padded_to` then pads it without a copy)."""
        assert self.native is not None and batch.positions is not None
        # A step of one chunk (a long prompt's usual step) gets its queries head-major, the
        # layout SDPA reads fastest; steps with decodes or several chunks slice q by token.
        one_chunk = not batch.num_decode and len(batch.prefills) == 1
        q = self._native_rope_store(qkv, cos_table, sin_table, kv_cache, batch, one_chunk)
        parts = []
        if batch.decode_tables is not None:
            assert batch.decode_bounds is not None
            parts.append(
                self.native.decode_attention(
                    q[: batch.num_decode],
                    kv_cache,
                    batch.decode_tables,
                    batch.decode_bounds,
                    batch.block_size,
                    self.scale,
                )
            )
        elif batch.num_decode:  # one long context: SDPA in place (runner.py)
            parts.append(self._decode(q[: batch.num_decode], kv_cache, batch))
        for start, length, cached, rows in batch.prefills:
            assert rows is not None, "the runner gives every chunk its rows on the C path"
            end = start + length
            one_room = room if one_chunk else 0
            parts.append(
                self._prefill(q[start:end], None, None, cached, rows, kv_cache, batch, one_room)
            )
        if len(parts) == 1:
            return parts[0]
        tokens, heads, dim = q.shape
        return torch.cat(parts, out=q.new_empty(max(room, tokens), heads, dim)[:tokens])

    def _attention(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """The PyTorch path (the reference): [tokens, heads, dim] attention outputs."""
        tokens = qkv.shape[0]
        qk_width = self.q_size + self.kv_size
        v = qkv[:, qk_width:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : qk_width].view(tokens, -1, self.head_dim))
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, :qk_width].view(tokens, self.num_heads + self.num_kv_heads, -1)
        # Queries and keys rotate together: one pass of the elementwise ops instead of two.
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]

        # kv_cache: [2, kv_heads, num_slots, head_dim]. Heads outermost, so a gather of slots is
        # already [kv_heads, tokens, dim]: the layout attention's batched matmuls take as is.
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, batch.slot_mapping, v.transpose(0, 1))

        # Decodes and each prefill chunk attend separately; one cat joins them when mixed.
        parts = []
        if batch.num_decode:
            parts.append(self._decode(q[: batch.num_decode], kv_cache, batch))
        for start, length, cached, rows in batch.prefills:
            end = start + length
            parts.append(
                self._prefill(
                    q[start:end], k[start:end], v[start:end], cached, rows, kv_cache, batch
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """All decoding sequences at once: one query each against its padded context.

        Queries are grouped by KV head ([kv_heads, D, group, dim]) so each KV head serves its
        whole query group in one matmul, never repeated in memory.
        """
        d, group, dim = q.shape[0], self.num_heads // self.num_kv_heads, self.head_dim
        if batch.decode_runs is not None:
            return self._decode_in_place(q, kv_cache, batch.decode_runs)
        lo, hi = batch.decode_keys
        assert batch.decode_rows is not None
        kv = _gather_blocks(kv_cache, batch.decode_rows, batch.block_size)
        kv = kv.view(2, self.num_kv_heads, d, -1, dim)[:, :, :, lo:hi]
        if d == 1:
            # One sequence, its keys cut to exactly what it sees: no mask. Each KV head's query
            # group is SDPA's query length, so GQA costs no repeat, and the fused kernel is
            # 2-3x fewer ops than the matmul path (profiled: ~20 us vs ~55 us a layer).
            out = F.scaled_dot_product_attention(
                q.view(1, self.num_kv_heads, group, dim),
                kv[0].transpose(0, 1),
                kv[1].transpose(0, 1),
                scale=self.scale,
            )
            return out.view(1, self.num_heads, dim)
        # On CPU, bf16 batched matmuls this small cost more in fixed overhead than converting a
        # few sequences' context to float32; past a few sequences the conversion costs more.
        dtype = kv_cache.dtype
        if self.decode_float32 and kv_cache.device.type == "cpu" and d <= _FLOAT32_DECODE_MAX_SEQS:
            dtype = torch.float32
        keys, values = kv[0].to(dtype), kv[1].to(dtype)  # [kvh, D, S, dim]
        q = q.to(dtype).view(d, self.num_kv_heads, group, dim).transpose(0, 1)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale  # [kvh, D, g, S]
        if batch.decode_mask is not None:
            scores.masked_fill_(~batch.decode_mask[None, :, None, :], float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1).to(dtype), values)  # [kvh, D, group, dim]
        return out.transpose(0, 1).reshape(d, self.num_heads, dim).to(kv_cache.dtype)

    def _decode_in_place(
        self, q: torch.Tensor, kv_cache: torch.Tensor, runs: list[tuple[int, int]]
    ) -> torch.Tensor:
        """One sequence's attention read straight from the cache: no gather copy, so a decode
        step reads its KV bytes once, as the bytes arithmetic assumes (profiled at 4,000 tokens
        of context: ~40% less attention time than gather + SDPA). Each run of consecutive slots
        is a strided view; several runs (see :func:`can_decode_in_place`) are attended apart
        and merged by their log-sum-exps."""
        kvh, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        query = q.view(1, kvh, group, dim)  # each KV head's query group as SDPA's query length
        if len(runs) == 1:
            start, n = runs[0]
            kv = kv_cache[:, :, start : start + n].unsqueeze(1)  # [2, 1, kvh, n, dim], a view
            out = F.scaled_dot_product_attention(query, kv[0], kv[1], scale=self.scale)
            return out.view(1, self.num_heads, dim)
        assert _flash_cpu is not None
        outs, lses = [], []
        for start, n in runs:
            kv = kv_cache[:, :, start : start + n].unsqueeze(1)
            out, lse = _flash_cpu(query, kv[0], kv[1], scale=self.scale)
            outs.append(out.float())
            lses.append(lse)
        weights = torch.stack(lses).softmax(dim=0).unsqueeze(-1)  # [runs, 1, kvh, group, 1]
        merged = (torch.stack(outs) * weights).sum(dim=0)
        return merged.to(q.dtype).view(1, self.num_heads, dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        cached: int,
        rows: torch.Tensor | None,
        kv_cache: torch.Tensor,
        batch: AttentionBatch,
        room: int = 0,
    ) -> torch.Tensor:
        """One sequence's chunk: queries at positions cached..cached+n-1 see keys 0..own position.
        The C kernels' output lies in storage with ``room`` rows (see :func:`padded_to`).

        With no cached prefix the chunk's own K/V are the whole context and the causal mask is
        the usual one. With a prefix, a query at row i may see keys up to cached + i: a
        bottom-right aligned mask, which a plain ``is_causal`` (top-left) would get wrong.
        """
        if rows is None:
            assert k is not None and v is not None
            keys, values = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
        elif (out := self._prefill_amx_paged(q, cached, rows, kv_cache, batch, room)) is not None:
            return out
        else:
            kv = _gather_blocks(kv_cache, rows, batch.block_size)[:, :, : cached + q.shape[0]]
            keys, values = kv[0], kv[1]
        if self.prefill_native is not None:
            return self._prefill_amx(q, keys, values, cached, room)
        if q.device.type == "cpu" and not self.prefill_sdpa:
            return self._prefill_cpu(q, keys, values, cached)
        return self._prefill_sdpa(q, keys, values, cached)

    def _prefill_amx_paged(
        self,
        q: torch.Tensor,
        cached: int,
        rows: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: AttentionBatch,
        room: int = 0,
    ) -> torch.Tensor | None:
        """The C kernel reading the chunk's keys and values where they lie in the cache (no
        gather copy: at two threads under a busy neighbour the gather's parallel region cost
        ~15x its one-thread time, docs/performance.md); None where it does not apply."""
        native = self.prefill_native
        if (
            native is None
            or not native.paged_prefill
            or not self.prefill_paged
            or self.window is not None
            or q.dtype != torch.bfloat16
        ):
            return None
        # rows lists each K/V plane's blocks in turn (block_rows); the first plane's are the
        # block ids themselves
        blocks = rows[: rows.numel() // (2 * self.num_kv_heads)]
        return native.prefill_attention_paged(
            q, kv_cache, blocks, batch.block_size, cached, self.scale, self.prefill_tiles, room
        )

    def _prefill_amx(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int, room: int = 0
    ) -> torch.Tensor:
        """The C kernel's causal attention (csrc/decode_ops.c: on AMX tiles, or in AVX-512
        BF16) for a bf16 chunk without a sliding window; SDPA for anything it does not take (a
        float32 model, a window, a head size that is not a multiple of 32)."""
        native = self.prefill_native
        if native is not None and self.window is None and q.dtype == torch.bfloat16:
            out = native.prefill_attention(
                q, keys, values, cached, self.scale, self.prefill_tiles, room
            )
            if out is not None:
                return out
        return self._prefill_sdpa(q, keys, values, cached)

    def _prefill_sdpa(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int
    ) -> torch.Tensor:
        """Torch's fused attention; a cached prefix or a window needs an explicit mask."""
        n, total = q.shape[0], keys.shape[1]
        mask = None
        if cached or self.window is not None:
            q_pos = torch.arange(cached, cached + n, device=q.device).unsqueeze(1)
            k_pos = torch.arange(total, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if self.window is not None:
                mask &= k_pos > q_pos - self.window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def _prefill_cpu(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int
    ) -> torch.Tensor:
        """Causal attention in blocks of queries, each against only the keys it can see.

        On 2 CPU cores this is ~2x faster than torch's flash kernel (profiled at 2,000 tokens):
        a block's scores are small enough to stay in cache through mask, softmax and the value
        matmul, and the keys past the block are never scored. Only the block's own key columns
        need the causal mask. Scores are in the model dtype, softmax accumulates in float32
        internally, as Hugging Face's eager attention does.
        """
        n, kvh, dim = q.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // kvh
        qg = (q * self.scale).transpose(0, 1).reshape(kvh, group, n, dim)
        out = torch.empty(kvh, group, n, dim, dtype=q.dtype)
        # Keys transposed once: each block's bmm then reads [dim, end] rows in place, ~20% faster
        # than handing bmm a transposed view (profiled).
        keys_t = keys.transpose(1, 2).contiguous()
        causal = torch.ones(_PREFILL_BLOCK, _PREFILL_BLOCK, dtype=torch.bool).triu(1)
        for s0 in range(0, n, _PREFILL_BLOCK):
            s1 = min(n, s0 + _PREFILL_BLOCK)
            c, end = s1 - s0, cached + s1
            scores = torch.bmm(
                qg[:, :, s0:s1].reshape(kvh, group * c, dim), keys_t[:, :, :end]
            ).view(kvh, group, c, end)
            scores[..., cached + s0 :].masked_fill_(causal[:c, :c], float("-inf"))
            if self.window is not None:
                q_pos = torch.arange(cached + s0, cached + s1).unsqueeze(1)
                too_old = torch.arange(end).unsqueeze(0) <= q_pos - self.window
                scores.masked_fill_(too_old, float("-inf"))
            probs = scores.softmax(dim=-1).view(kvh, group * c, end)
            out[:, :, s0:s1] = torch.bmm(probs, values[:, :end]).view(kvh, group, c, dim)
        return out.view(self.num_heads, n, dim).transpose(0, 1)


# Bytes a row block of oneDNN's gate/up output stays under glibc's line by (MLP.forward): torch
# asks for 64-byte aligned memory, which malloc serves with a header and the alignment's slack
# on top. (torch's THP_MEM_ALLOC_ENABLE aligns to 2 MiB: past this margin, mapped afresh.)
_BLOCK_MARGIN_BYTES = 64 << 10


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.intermediate = c.intermediate_size
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.native: NativeOps | None = None  # decode_ops=c: silu and the product in one call
        self.scratch: Scratch | None = None  # the model's, shared by its layers (CausalLM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, width = x.shape[0], 2 * self.intermediate
        scratch = self.scratch if x.dim() == 2 and x.shape[0] > BIG_BATCH_MAX_ROWS else None
        # (a forward recording gradients keeps fresh outputs: out= takes no tensor that needs
        # them; the engine's steps record none)
        if scratch is None or x.device.type != "cpu" or torch.is_grad_enabled():
            return self.down_proj(self.silu_mul(self.gate_up_proj(x)))
        # A prefill's widest tensors (gate/up, unless in blocks, and the SiLU product), each
        # consumed before the next layer makes its own
        if not self.gate_up_proj.fresh_output(x):
            # (gate/up's buffer taken before act's, as before the blocks: the heap's layout)
            gate_up = self.gate_up_proj(x, out=scratch.take("gate_up", rows, width, x))
            act = scratch.take("act", rows, self.intermediate, x)
            return self.down_proj(self.silu_mul(gate_up, act))
        act = scratch.take("act", rows, self.intermediate, x)
        # oneDNN's packed matmul makes its own output, mapped afresh past glibc's line;
        # glibc's heap serves row blocks under the line (where heap=settled holds it
        # there, or glibc's sliding line has reached them), the margin for what torch's
        # aligned request and malloc's header add
        block_rows = max(1, (MAP_FROM_BYTES - _BLOCK_MARGIN_BYTES) // (width * x.element_size()))
        # every block past BIG_BATCH_MAX_ROWS rows, so the packed path still takes it
        blocks = min(-(-rows // block_rows), rows // (BIG_BATCH_MAX_ROWS + 1))
        parts = zip(x.tensor_split(blocks), act.tensor_split(blocks), strict=True)
        for part, act_part in parts:
            self.silu_mul(self.gate_up_proj(part), act_part)
        return self.down_proj(act)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up, gate and up the halves of ``gate_up``'s last dim: into ``out``
        where given, else a new tensor."""
        if self.native is not None:
            return self.native.silu_mul(gate_up, out=out)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        if out is None:
            return F.silu(gate).mul_(up)
        return torch.mul(F.silu(gate), up, out=out)


class Scratch:
    """The MLP's outputs at prefill sizes, one buffer each for the whole model, reused layer
    after layer and step after step. glibc, left as it is, maps a request of 32 MiB or more
    afresh each time and unmaps it when freed: a 2,000-token prefill's fused gate/up output
    (65.5 MB on models with an intermediate size of 8,192) was faulted in and zeroed again at
    every layer, 16,000 pages a layer (engine/malloc.py; docs/performance.md). Each buffer
    grows to the most rows a step has had and stays: memory the step needed at its peak
    anyway. oneDNN's packed path (``prefill_linear=onednn``) writes only into memory of its
    own, so the MLP runs it in row blocks whose outputs stay under glibc's line (32 MiB),
    which glibc's heap serves again in most prefills (measured under ``heap=settled``; as
    glibc starts, its sliding line passes them once one is freed): at 2,000 rows of the 1.1B
    model, two blocks of 1,000, 257,000 faults a prefill down to ~9 and the prefill 1.156x as
    fast (AMX Xeon; docs/performance.md). On an AMD EPYC (Zen 4) a block's pages came afresh
    in 1-3 of 8 prefills, without growing the process more than the buffered path."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, width] view of buffer ``name`` with ``like``'s dtype and device (contents
        undefined), grown if short."""
        buf = self.buffers.get(name)
        if (
            buf is None
            or (buf.dtype, buf.device) != (like.dtype, like.device)
            or buf.numel() < rows * width
        ):
            # made outside inference mode: a step under it may write here, and so may a
            # forward outside it (an inference tensor takes no writes there)
            with torch.inference_mode(False):
                buf = torch.empty(rows * width, dtype=like.dtype, device=like.device)
            self.buffers[name] = buf
        return buf[: rows * width].view(rows, width)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, kv_cache, batch):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, c: ModelConfig, max_positions: int):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.scratch = Scratch()
        for layer in self.layers:
            layer.mlp.scratch = self.scratch
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.init_rope(max_positions, torch.get_default_device())
        self.native: NativeOps | None = None  # the C decode kernels, when the choice says so
        # Steps of at least pad_min_rows rows are padded to a multiple of row_bucket (ROW_BUCKET
        # under step_rows=padded; 1: never padded). pad_min_rows is PAD_MIN_ROWS, or past
        # BIG_BATCH_MAX_ROWS under big_batch_linear=pairs (apply_kernels).
        self.row_bucket = 1
        self.pad_min_rows = PAD_MIN_ROWS
        # Decodes-only steps run every layer in one C call (NativeOps.decode_layers) where
        # their matmuls take the C kernels; False keeps the per-kernel calls (benches, tests).
        self.fuse_decode = True
        # ... and the LM head in that call too (NativeOps.decode_logits, decode_logits);
        # False keeps it a call of its own after it (benches, tests).
        self.fuse_logits = True
        # (the registration count when built, the tensors pointed into but the weight copies,
        # their addresses when built, the weights with a pairs copy and their version counters
        # when built, what is held only to stay alive, what was built from them)
        self._decode_layers: (
            tuple[
                int,
                list[torch.Tensor],
                list[int],
                list[torch.Tensor],
                list[int],
                list[object],
                tuple[ctypes.Array[DecodeLayer], DecodeStep, Linear, bool],
            ]
            | None
        ) = None

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        """Rotary cos/sin tables for positions 0..max_positions-1, float32 like Hugging Face."""
        positions = torch.arange(max_positions, dtype=torch.float64)
        angles = torch.outer(positions, rope_inv_freq(self.config))
        cos, sin = angles.cos().float(), angles.sin().float()
        # Laid out for apply_rope: cos over both halves, sin negated over the first.
        self.register_buffer("rope_cos", torch.cat((cos, cos), -1).to(device), persistent=False)
        self.register_buffer("rope_sin", torch.cat((-sin, sin), -1).to(device), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden] after the final norm (logits are the caller's choice)."""
        tokens = input_ids.shape[0]
        padded = padded_rows(tokens, self.row_bucket, self.pad_min_rows)
        if padded > tokens:
            input_ids = F.pad(input_ids, (0, padded - tokens))
        if self.native is not None:
            if batch.positions is None:
                batch = replace(batch, positions=positions)
            return self._native_decode(input_ids, kv_caches, batch)[:tokens]
        x = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, batch)
        return self.norm(x[:tokens])

    def _native_decode(
        self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], batch: AttentionBatch
    ) -> torch.Tensor:
        """The same layers with the C kernels' glue: each residual add is fused into the norm
        that follows it (``residual += h; h = norm(residual)``), as one call. Every step under
        ``decode_ops=c`` runs here; a step's prefill chunks take the prefill attention chosen."""
        residual = self.embed_tokens(input_ids)  # a fresh tensor: updated in place below
        fused = (
            self._fused_decode(input_ids.shape[0], kv_caches, batch) if self.fuse_decode else None
        )
        return self._native_layers(residual, kv_caches, batch, fused)

    def decode_logits(
        self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], batch: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 logits [rows, vocab] of a decodes-only step under the C kernels (every row
        samples; ``batch.positions`` set) and, where the embedding, the layers and the LM head
        run in one C call (:meth:`_fused_decode` allows it), each row's argmax [rows] from that
        call; else :meth:`forward`'s layers and then :meth:`logits` (the same bits) and None."""
        native = self.native
        assert native is not None and batch.positions is not None
        rows = input_ids.shape[0]
        fused = self._fused_decode(rows, kv_caches, batch) if self.fuse_decode else None
        if fused is not None and self.fuse_logits and native.one_call_logits:
            # no module runs: no inference mode to enter (~10 us a step, cold)
            return native.decode_logits(*fused, input_ids, self.embed_tokens.weight)
        with torch.inference_mode():
            residual = self.embed_tokens(input_ids)  # a fresh tensor: updated in place below
            return self.logits(self._native_layers(residual, kv_caches, batch, fused)), None

    def _native_layers(
        self,
        residual: torch.Tensor,
        kv_caches: list[torch.Tensor],
        batch: AttentionBatch,
        fused: tuple[ctypes.Array[DecodeLayer], DecodeStep] | None,
    ) -> torch.Tensor:
        """:meth:`_native_decode` from the embedded tokens: one C call when ``fused`` (from
        :meth:`_fused_decode`), else one per kernel."""
        native = self.native
        assert native is not None
        if fused is not None:
            return native.decode_layers(*fused, residual)
        first = self.layers[0].input_layernorm
        h = native.rms_norm(residual, first.weight, first.eps)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, kv_cache, next_norm in zip(self.layers, kv_caches, norms, strict=True):
            h = layer.self_attn(h, self.rope_cos, self.rope_sin, kv_cache, batch)
            post = layer.post_attention_layernorm
            h = native.rms_norm(h, post.weight, post.eps, residual=residual)
            h = layer.mlp(h)
            h = native.rms_norm(h, next_norm.weight, next_norm.eps, residual=residual)
        return h

    def _fused_decode(
        self, rows: int, kv_caches: list[torch.Tensor], batch: AttentionBatch
    ) -> tuple[ctypes.Array[DecodeLayer], DecodeStep] | None:
        """The layers and step for NativeOps.decode_layers / decode_logits, or None where a part
        of this step would leave the C kernels: a long context read in place by SDPA, or
        matmuls of a row count that takes oneDNN. Both are built once per set of weights and
        caches (:meth:`_decode_layer_array`); the step's batch fields are set here."""
        if (
            self.native is None
            or not self.native.one_call
            or batch.decode_runs is not None
            or batch.prefills
            or batch.decode_tables is None
            or batch.decode_tables.shape[0] != rows
        ):
            return None
        built = self._decode_layer_array(kv_caches)
        if built is None:
            return None
        layers, step, first, held_once = built
        # apply_kernels points every Linear at the same paths: the first one speaks for all.
        one_row = rows <= NATIVE_LINEAR_MAX_ROWS
        many = first.native_many is not None and not one_row and rows <= first.many_max_rows
        big = first.big_batch is not None and NATIVE_MANY_MAX_ROWS < rows <= BIG_BATCH_MAX_ROWS
        if first.native is not None and one_row:
            step.many_rows = first.one_row_amx
        elif many or big:
            step.many_rows = True
        else:
            return None
        assert batch.positions is not None and batch.decode_bounds is not None
        # per weight, C reads the copy where there is one and the weight as stored where not,
        # as Linear.forward does, which takes one-row matmuls by `linear`, 2 to 32 rows by
        # `batch_linear`, and more by `big_batch_linear`
        step.pairs = (
            (one_row and first.native is not None and first.one_row_pairs)
            or (many and first.many_pairs)
            or (big and first.big_batch_pairs)
        )
        if held_once and not step.pairs:
            return None  # a weight held once has only its copy, which these rows do not read
        step.pair_streams = first.pair_streams
        step.rows = rows
        step.block_size = batch.block_size
        step.table_width = batch.decode_tables.shape[1]
        step.positions = batch.positions.data_ptr()
        step.slot_mapping = batch.slot_mapping.data_ptr()
        step.tables = batch.decode_tables.data_ptr()
        step.bounds = batch.decode_bounds.data_ptr()
        step.threads = torch.get_num_threads()
        return layers, step

    def _decode_layer_array(
        self, kv_caches: list[torch.Tensor]
    ) -> tuple[ctypes.Array[DecodeLayer], DecodeStep, Linear, bool] | None:
        """Every layer's weight and cache pointers, and a step holding the model's own (final
        norm, rope tables, LM head, embedding; the batch fields are the caller's), built again
        when any of them moves or a copied weight is written in place (new caches, a weight's
        ``.data`` replaced, ``load_state_dict``; apply_kernels drops them too): checked on the
        held tensors' addresses and the copied weights' version counters each step, where
        walking the modules for them took 0.4 ms. The first Linear comes with them (it names
        the matmul paths). None when a tensor is not one the C kernels can read as given (the
        per-kernel path then checks and says which)."""
        if self._decode_layers is not None:
            registrations, held, ptrs, copied, versions, _, built = self._decode_layers
            # map() over the methods: no Python frame per tensor (~100 addresses, ~50 counters)
            if (
                registrations == _registrations
                and len(kv_caches) == self.config.num_layers
                and all(map(operator.is_, kv_caches, held[-len(kv_caches) :]))
                and list(map(torch.Tensor.data_ptr, held)) == ptrs
                and versions_of(copied) == versions
            ):
                return built
        return self._build_decode_layers(kv_caches)

    @torch.inference_mode()  # copies made here (Linear.current_pairs) are inference tensors
    def _build_decode_layers(
        self, kv_caches: list[torch.Tensor]
    ) -> tuple[ctypes.Array[DecodeLayer], DecodeStep, Linear, bool] | None:
        """:meth:`_decode_layer_array`'s build, and what its check reads, kept."""
        rows = []
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            rows.append(
                (
                    layer.input_layernorm.weight,
                    attn.qkv_proj.stored_weight(),  # None where held once: C reads the copy
                    attn.qkv_proj.bias,
                    None if attn.q_norm is None else attn.q_norm.weight,
                    None if attn.k_norm is None else attn.k_norm.weight,
                    attn.o_proj.stored_weight(),
                    layer.post_attention_layernorm.weight,
                    mlp.gate_up_proj.stored_weight(),
                    mlp.down_proj.stored_weight(),
                    cache,
                    attn.qkv_proj.current_pairs(),
                    attn.o_proj.current_pairs(),
                    mlp.gate_up_proj.current_pairs(),
                    mlp.down_proj.current_pairs(),
                )
            )
        norms = [self.norm] + [
            n
            for layer in self.layers
            for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        qk_norms = [
            n for layer in self.layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)
        ]
        lm_head = self.lm_head.stored_weight()
        weights = [
            *(t for row in rows for t in row[:9] if t is not None),  # not the cache
            self.norm.weight,
            *([] if lm_head is None else [lm_head]),  # read by decode_logits, as the embedding
            self.embed_tokens.weight,
        ]
        copies = [
            *(t for row in rows for t in row[10:] if t is not None),
            *([] if self.lm_head.current_pairs() is None else [self.lm_head.pairs]),
        ]
        dtype = self.embed_tokens.weight.dtype
        c, attn = self.config, self.layers[0].self_attn
        if (
            len({n.eps for n in norms}) > 1
            or len({None if n is None else n.eps for n in qk_norms}) > 1
            or any(
                not t.is_contiguous() or t.device.type != "cpu" or t.dtype != dtype
                for t in weights + copies + kv_caches
            )
            or self.embed_tokens.weight.shape
            != (self.lm_head.out_features, self.lm_head.in_features)
        ):
            return None
        array = (DecodeLayer * len(rows))(
            *(DecodeLayer(*(None if t is None else t.data_ptr() for t in row)) for row in rows)
        )
        step = DecodeStep(
            layers=c.num_layers,
            hidden=c.hidden_size,
            heads=c.num_heads,
            kv_heads=c.num_kv_heads,
            dim=c.head_dim,
            inter=c.intermediate_size,
            slots=kv_caches[0].shape[2],
            cos_table=self.rope_cos.data_ptr(),
            sin_table=self.rope_sin.data_ptr(),
            final_norm=self.norm.weight.data_ptr(),
            eps=self.norm.eps,
            qk_eps=attn.q_norm.eps if attn.q_norm is not None else 0.0,
            scale=attn.scale,
            bf=dtype == torch.bfloat16,
            wide_glue=self.native is not None and self.native.wide_glue,
            lm_head=None if lm_head is None else lm_head.data_ptr(),
            vocab=self.lm_head.out_features,
            lm_head_p=None if self.lm_head.pairs is None else self.lm_head.pairs.data_ptr(),
        )
        held = [*weights, self.rope_cos, self.rope_sin, *kv_caches]
        # a weight held once (Linear.hold_once) is read through its copy only
        weighted = (1, 5, 7, 8)  # qkv, o, gate_up, down
        held_once = lm_head is None or any(row[i] is None for row in rows for i in weighted)
        built = (array, step, attn.qkv_proj, held_once)
        # A pairs copy changes only with its weight (Linear.current_pairs) or under
        # apply_kernels, which drops all this: its weight's address (in held) and version
        # counter (an in-place write, as load_state_dict's, leaves the address) say when to
        # build again. The copies are held, not checked: each tensor checked costs ~1 us a
        # step, its lines cold after the step streamed the weights (measured: the check took
        # ~0.2 ms a step over all 138 tensors and their 124 counters, 37 us warm).
        linears = [self.lm_head] + [
            m
            for layer in self.layers
            for m in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        ]
        copied = [
            w for m in linears if m.pairs is not None and (w := m.stored_weight()) is not None
        ]
        self._decode_layers = (
            _registrations,  # a weight's Parameter replaced: held no longer holds the weight
            held,
            [t.data_ptr() for t in held],
            copied,
            versions_of(copied),
            # the copies, and the storages pointed into (held as Linear.hold_source holds
            # them, so that no later tensor takes a checked address)
            copies + [t.untyped_storage() for t in held],
            built,
        )
        return built

    def parameter_count(self) -> int:
        """The model's parameters, a tied LM head's once, a weight held once
        (:meth:`Linear.hold_once`) counted from its copy."""
        held = sum(
            m.in_features * m.out_features
            for m in self.modules()
            if isinstance(m, Linear) and m.held_once
        )
        return held + sum(p.numel() for p in self.parameters())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def padded_rows(tokens: int, bucket: int, min_rows: int = PAD_MIN_ROWS) -> int:
    """The row count a step of ``tokens`` tokens runs its matmuls at: ``tokens`` rounded up
    to a multiple of ``bucket`` from ``min_rows`` on, else ``tokens``."""
    if bucket <= 1 or tokens < min_rows:
        return tokens
    return -(-tokens // bucket) * bucket


def padded_to(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` [n, width] with zero rows after it up to ``rows``: a view of its own storage where
    that storage was made for exactly [rows, width] with ``t`` its first rows (the C
    attention's outputs, a step's parts joined: Attention's ``room``), else a copy. The rows
    past ``t`` are overwritten, so a slice of any other buffer, which code may still read, is
    copied."""
    n, width = t.shape
    if rows <= n:
        return t
    made_for_it = t.untyped_storage().nbytes() == rows * width * t.element_size()
    fits = t.is_contiguous() and t.storage_offset() == 0 and made_for_it
    if not fits:
        return torch.cat((t, t.new_zeros(rows - n, width)))
    padded = t.as_strided((rows, width), (width, 1), t.storage_offset())
    padded[n:].zero_()
    return padded


def apply_kernels(model: CausalLM, choice: KernelChoice, native: NativeOps | None = None) -> None:
    """Point every module at the paths ``choice`` names (packing or unpacking linears);
    ``native`` is the loaded C kernels, used when ``choice.decode_ops`` is ``c``."""
    for path in ("linear", "batch_linear", "big_batch_linear", "decode_ops"):
        if getattr(choice, path) == "c" and native is None:
            raise ValueError(f"{path}=c needs the C kernels, which did not load")
    if choice.linear == "amx" and (native is None or native.linear_many_isa != "amx"):
        raise ValueError(
            "linear=amx needs the C kernels and AMX tiles, which this CPU, compiler or kernel "
            "does not give"
        )
    if choice.prefill_attention == "amx" and (native is None or not native.prefill_amx):
        raise ValueError(
            "prefill_attention=amx needs the C kernels and AMX tiles, which this CPU, compiler "
            "or kernel does not give"
        )
    if choice.prefill_attention == "c" and (native is None or not native.prefill_vec):
        raise ValueError(
            "prefill_attention=c needs the C kernels built with AVX-512 BF16, which this CPU "
            "or compiler does not give"
        )
    if choice.linear in PAIRS_LINEAR and (native is None or not native.pairs):
        raise ValueError(
            f"linear={choice.linear} needs the C kernels built with AVX-512 BF16 or AVX2, which "
            "this CPU or compiler does not give"
        )
    if choice.batch_linear == "pairs" and (native is None or not native.pairs_rows):
        raise ValueError(
            "batch_linear=pairs needs the C kernels built with AVX-512 BF16 or AVX2, which this "
            "CPU or compiler does not give"
        )
    for path in ("big_batch_linear", "prefill_linear"):
        if getattr(choice, path) == "pairs" and (native is None or not native.pairs_rows):
            raise ValueError(
                f"{path}=pairs needs the C kernels built with AVX-512 BF16 or AVX2, which this "
                "CPU or compiler does not give"
            )
    if choice.prefill_linear == "rows" and (native is None or not native.team):
        raise ValueError("prefill_linear=rows needs the C kernels, which did not load")
    if choice.decode_prefetch == "every" and (native is None or not native.has_decode_prefetch):
        raise ValueError(
            "decode_prefetch=every needs the C kernels built with AVX-512 BF16, which this CPU "
            "or compiler does not give"
        )
    # One setting per process: an engine whose attention does not take it (how "fixed") leaves
    # the setting another engine's trial chose.
    if native is not None and choice.how.get("decode_prefetch") != "fixed":
        native.set_decode_prefetch(choice.decode_prefetch)
    model.native = native if choice.decode_ops == "c" else None
    model._decode_layers = None
    unread = packed_unread(asdict(choice))  # a weight with a pairs copy then keeps no packed one
    # ... and no weight, where every matmul past 64 rows reads it as stored (prefill_linear=plain)
    stored = stored_past_one(asdict(choice))
    for module in model.modules():
        if isinstance(module, Linear):
            if module.held_once:  # its copy holds its values: made again before any is freed
                module.restore_weight()
            # linear=c, amx or pairs: single rows through C, larger matmuls through packed weights.
            one_row_c = choice.linear in ("c", "amx", *PAIRS_LINEAR)
            module.native = native if one_row_c else None
            module.one_row_amx = choice.linear == "amx" and module.weight.dtype == torch.bfloat16
            module.one_row_pairs = choice.linear in PAIRS_LINEAR
            module.pair_streams = PAIRS_LINEAR.get(choice.linear, 8)
            module.many_pairs = choice.batch_linear == "pairs"
            # batch_linear=pairs: weights without a copy take the many-row kernel
            module.native_many = native if choice.batch_linear in ("c", "pairs") else None
            module.big_batch = native if choice.big_batch_linear in ("pairs", "c") else None
            module.big_batch_pairs = choice.big_batch_linear == "pairs"
            module.many_rows = native if choice.prefill_linear == "pairs" else None
            module.plain_rows = choice.prefill_linear == "plain"
            module.widen = choice.matmul_math == "float32" and module.weight.dtype == torch.bfloat16
            module.many_max_rows = NATIVE_MANY_MAX_ROWS
            if module.widen and module.native_many is None and native is not None:
                # torch's bf16 matmul is the slow fallback here, and widening pays only from
                # WIDEN_MIN_ROWS: fewer rows take C (the small model at 8 rows on an AVX2-only
                # EPYC: C 47 ms, bf16 F.linear 127, widened 163)
                module.native_many = native
                module.many_max_rows = WIDEN_MIN_ROWS - 1
            # a C kernel reads the weight as stored where no pairs copy stands in for it
            copied = takes_pairs(module.weight)
            streamed = (
                (module.native is not None and not (module.one_row_pairs and copied))
                or (module.native_many is not None and not (module.many_pairs and copied))
                or (module.big_batch is not None and not (module.big_batch_pairs and copied))
            )
            if streamed and not module.huge_pages:
                # The C kernels stream this weight every decode step: moved, not copied (the
                # old storage is freed; a tied embedding shares the parameter, so it follows),
                # and before any copy below is made, so each copy's weight_key is current.
                moved = on_huge_pages(module.weight.detach())
                if moved is not None:
                    module.weight.data = moved
                    module.huge_pages = True
            # not the LM head: a prefill runs it on its last row only
            transposed = (
                choice.prefill_linear in ("transposed", "rows")
                and module.weight.dtype == torch.bfloat16
                and module is not model.lm_head
            )
            module.team = native if transposed and choice.prefill_linear == "rows" else None
            if not transposed:
                module.weight_t = None
                module.hold_source("weight_t", made=False)
            elif module.weight_t is None or module.weight_t_source != module.weight_key():
                module.make_weight_t()
            if (
                choice.linear not in PAIRS_LINEAR
                and choice.batch_linear != "pairs"
                and choice.big_batch_linear != "pairs"
                and choice.prefill_linear != "pairs"
            ):
                module.pairs = None
                module.hold_source("pairs", made=False)
            elif module.pairs is None or module.pairs_source != module.weight_key():
                assert native is not None  # checked above
                module.make_pairs(native)  # (a stale one too: held once, it stands alone)
            if (module.pairs is not None and unread) or stored:
                module.packed, module.packed_rows = None, 0
                module.hold_source("packed", made=False)
            elif choice.linear != "plain" and module.weight.dtype == torch.bfloat16:
                rows = PACKED_ROWS_WITH_C if one_row_c else 1
                stale = module.packed_source != module.weight_key()  # e.g. moved just above
                if (module.packed_rows != rows or stale) and can_pack(
                    module.weight.dtype, module.weight.device
                ):
                    module.pack(rows)
            else:
                module.packed, module.packed_rows = None, 0  # frees the packed copy too
                module.hold_source("packed", made=False)
            # a tied LM head's weight is the embedding's, which reads it as stored
            tied = module.stored_weight() is model.embed_tokens.weight
            if module.weight_unread() and not tied:
                module.hold_once()
        elif isinstance(module, MLP):
            module.native = model.native
        elif isinstance(module, Attention):
            module.prefill_sdpa = choice.prefill_attention == "sdpa"
            module.prefill_native = native if choice.prefill_attention in ("amx", "c") else None
            module.prefill_tiles = choice.prefill_attention == "amx"
            module.decode_float32 = choice.decode_math == "float32"
            module.native = model.native
    model.row_bucket = ROW_BUCKET if choice.step_rows == "padded" else 1
    model.pad_min_rows = (
        BIG_BATCH_MAX_ROWS + 1 if choice.big_batch_linear in ("pairs", "c") else PAD_MIN_ROWS
    )


def kernel_trials(
    model: CausalLM, prefill_tokens: int, native: NativeOps | None = None
) -> dict[str, Callable[[], dict[str, Callable[[], object]]]]:
    """For each machine-dependent path of ``model`` on this device, a factory of timed
    stand-ins for its candidates, built from the model's own weights and shapes (only when a
    trial runs: a cached or forced choice allocates nothing). Paths with one candidate here
    are left out.

    * linear: one decode step's worth of matmuls (each weight read once, at one row; on a large
      model its first layers up to ``_TRIAL_STREAM_BYTES`` and the LM head in their share:
      :func:`_trial_linears`), so the trial streams from memory as a real step does; the
      three decode-linear trials share their copies (:class:`_TrialWeights`): oneDNN packed
      (bf16 only), plain
      ``F.linear``, the C kernel (when ``native`` loaded), the many-row kernel's AMX tiles
      at one row (bf16, where Linux grants the tiles; 1.08x the C kernel on the AMX Xeon), and
      the pair-interleaved copies as 8 or 2 streams a thread (bf16 with AVX-512 BF16 or AVX2,
      offered only while that copy fits: ``pairs_copy_fits``);
    * batch linear (bf16 with the C kernels): one step's matmuls at ``_BATCH_TRIAL_ROWS`` rows
      (a batched decode), through the weights as ``linear`` would run them (packed), the
      many-row C kernel, or the pair-interleaved copies (bf16 with AVX-512 BF16 or AVX2,
      while the copy fits). The packed candidate is always laid out for many rows (as under
      ``linear=c``), the fastest packed form at these rows, whatever ``linear`` chooses: C
      must beat the best oneDNN can do to be chosen. Where oneDNN has no bf16 path, that
      candidate is the float32-widened matmul several rows take there (``matmul_math``);
    * big batch linear (bf16 with the pairs kernels while the copy fits, or with AMX tiles):
      the same matmuls at ``_BIG_BATCH_TRIAL_ROWS`` rows, through the packed weights (or
      widened) as above, through the pair-interleaved copies (while they fit) and through the
      many-row kernel on the weights as stored (AMX tiles: :func:`stored_offered`);
    * prefill linear (bf16, chunks of at least ``ROWS_SPLIT_MIN_ROWS``): layer 0's matmuls
      (cut to ``_PREFILL_TRIAL_BYTES``: :func:`_prefill_trial_linears`) at ``prefill_tokens``
      rows, through the weights packed for many rows, through a transposed copy (offered only
      while that copy fits: ``transposed_copy_fits``), through the pairs copies (with the
      pairs kernels for several rows, while that copy fits) and through ``F.linear`` on the
      weights as stored (AMX tiles: :func:`stored_offered`);
    * prefill attention: layer 0's attention over a fresh chunk of ``prefill_tokens``;
    * decode math: every layer's attention for a batch of the largest size that may take the
      float32 path, each with 256 tokens of context;
    * decode ops (when ``native``, the C kernels, loaded): one decode step's glue at batch 1
      with 256 tokens of context, every layer: norms, residual adds, rope, the K/V write and
      attention, through PyTorch or through the C kernels (the linears, the same in both, are
      left out so that their time does not drown the difference).
    * decode prefetch (``prefetch_applies``): the C decode attention at batch 1 over
      ``_PREFETCH_TRIAL_KEYS`` of random keys, one synthetic cache per layer up to
      ``_PREFETCH_TRIAL_BYTES``, with each prefetch setting.

    ``threads`` has no trial: ``bound`` runs only when forced. Chosen by a trial, it stalled a
    live server's stream 170-218 ms while the event loop parsed a 4 MB request
    (tests/test_server_hardening.py, AMX Xeon, 2 cores), and its gain in the trial was small.
    """
    weight = model.embed_tokens.weight
    dtype, device = weight.dtype, weight.device
    if device.type != "cpu":
        return {}
    trials: dict[str, Callable[[], dict[str, Callable[[], object]]]] = {
        "prefill_attention": lambda: _prefill_trial(model, max(1, prefill_tokens), native)
    }
    shared = _TrialWeights(model, native)
    if can_pack(dtype, device) or native is not None:
        trials["linear"] = lambda: _linear_trial(shared)
    if dtype != torch.float32:
        trials["decode_math"] = lambda: _decode_math_trial(model)
    if native is not None and (can_pack(dtype, device) or widen_bf16(dtype, device)):
        many = native
        trials["batch_linear"] = lambda: _batch_linear_trial(shared, many)
        copies = dtype == torch.bfloat16 and native.pairs_rows and pairs_copy_fits(model)
        if copies or stored_offered(model, native):
            trials["big_batch_linear"] = lambda: _big_batch_linear_trial(shared, many)
    if can_pack(dtype, device) and prefill_tokens >= ROWS_SPLIT_MIN_ROWS:
        transposed = transposed_copy_fits(model)
        pairs = native is not None and bool(native.pairs_rows) and pairs_copy_fits(model)
        stored = stored_offered(model, native)
        if transposed or pairs or stored:
            with_pairs = native if pairs else None
            trials["prefill_linear"] = lambda: _prefill_linear_trial(
                model, prefill_tokens, with_pairs, transposed, stored
            )
    if native is not None:
        ops = native
        trials["decode_ops"] = lambda: _decode_ops_trial(model, ops)
        if prefetch_applies(model, ops):
            trials["decode_prefetch"] = lambda: _decode_prefetch_trial(model, ops)
    return trials


# The CPUs this process may run on, read once: a pinned thread's own mask is narrower.
_ALLOWED_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def thread_cpus(bound: bool = True) -> list[int]:
    """The CPUs ``threads=bound`` pins torch's threads to: the first of this process's
    allowed CPUs, one per thread (empty when there are fewer CPUs than threads, or one);
    with ``bound`` False, every allowed CPU (what a freed thread may run on)."""
    threads = torch.get_num_threads()
    if threads < 2 or len(_ALLOWED_CPUS) < threads:
        return []
    return _ALLOWED_CPUS[:threads] if bound else list(_ALLOWED_CPUS)


def _random(shape: tuple[int, ...], like: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device=like.device).manual_seed(0)
    return (torch.randn(shape, generator=gen, device=like.device) * scale).to(like.dtype)


# The decode-linear trials (linear, batch_linear, big_batch_linear) read whole layers from the
# first until their weights reach this many bytes, and the LM head's rows in the share those
# layers are of all of them: ten times the AMD EPYC hosts' 32 MB last-level cache, so a trial
# streams from memory as a step does, and takes about as long on a model of any size (on a
# 1.1B-parameter model every weight made the trial 20 s, and its copies gigabytes). The
# embedded small model's 304 MB are all read.
_TRIAL_STREAM_BYTES = 320 << 20
# prefill_linear's trial reads the first rows of each of layer 0's weights, in one share, up
# to this many bytes (the small model's layer 0 whole: 22.5 MB).
_PREFILL_TRIAL_BYTES = 24 << 20
# A weight's share is rounded up to whole tiles of this many rows (the pairs copies' and the
# many-row kernels' tiles divide it).
_TRIAL_ROW_TILE = 64


def _first_rows(m: Linear, share: float) -> Linear:
    """A stand-in for ``m`` (nothing copied) holding ``share`` of its weight's output rows,
    the first ones: whole tiles of ``_TRIAL_ROW_TILE`` and the weight's own part tile (a
    shape that takes no pairs copy or ends in a part tile does so in the trial too); ``m``
    itself where that is every row."""
    tile = _TRIAL_ROW_TILE
    tiles = math.ceil(m.out_features * share / tile)
    rows = min(m.out_features, tiles * tile + m.out_features % tile)
    if rows == m.out_features:
        return m
    part = Linear(m.in_features, rows, bias=m.bias is not None, device="meta")
    part.weight = nn.Parameter(m.weight.detach()[:rows], requires_grad=False)
    part.huge_pages = m.huge_pages  # a view: on huge pages where the weight is
    if m.bias is not None:
        part.bias = nn.Parameter(m.bias.detach()[:rows], requires_grad=False)
    return part


def _trial_linears(model: CausalLM) -> list[Linear]:
    """The matmuls a decode-linear trial times, one step's worth in the step's proportions:
    the layers' Linears from the first until their weights reach ``_TRIAL_STREAM_BYTES`` (all
    of them on a small model), then the other Linears (the LM head) cut to the same share of
    their rows (:func:`_first_rows`). Whole layers keep every matmul's size, so each call's
    fixed cost weighs as in a step."""
    layers = list(model.layers)
    taken, read = 0, 0
    while taken < len(layers) and read < _TRIAL_STREAM_BYTES:
        read += sum(m.weight_nbytes() for m in layers[taken].modules() if isinstance(m, Linear))
        taken += 1
    in_layers = {id(m) for layer in layers for m in layer.modules()}
    share = taken / max(1, len(layers))
    return [m for layer in layers[:taken] for m in layer.modules() if isinstance(m, Linear)] + [
        _first_rows(m, share)
        for m in model.modules()
        if isinstance(m, Linear) and id(m) not in in_layers
    ]


class _TrialWeights:
    """What the decode-linear trials read, each made on first use and then shared by the
    three (a cached or forced choice makes none of it): the matmuls (:func:`_trial_linears`),
    their pairs copies, their weights packed for many rows and a copy of each weight on huge
    pages (:attr:`streamed`), all held until the engine drops the trials."""

    def __init__(self, model: CausalLM, native: NativeOps | None):
        self.model, self.native = model, native

    @functools.cached_property
    def linears(self) -> list[Linear]:
        return _trial_linears(self.model)

    @functools.cached_property
    def pairs(self) -> dict[Linear, torch.Tensor | None]:
        assert self.native is not None
        return _pairs_copies(self.linears, self.native)

    @functools.cached_property
    def packed_many(self) -> dict[Linear, torch.Tensor]:
        return _packed_for_many_rows(self.linears)

    @functools.cached_property
    def streamed(self) -> dict[Linear, torch.Tensor]:
        """Each weight as the C kernels stream it in the engine: apply_kernels moves a weight
        they read as stored onto huge pages (where Linux offers them), as the pairs copies are
        made there, so the trials read a copy there too (the trials' bytes once more, until
        they are dropped): on ordinary pages the many-row kernel's one row took 1.11x the time
        (bench/linear_ab.py, c_many / c_many_huge, AMX Xeon model 207)."""
        out = {}
        for m in self.linears:
            weight = m.weight.detach()
            moved = None if m.huge_pages else on_huge_pages(weight)
            out[m] = weight if moved is None else moved
        return out

    def inputs(self, rows: int) -> dict[int, torch.Tensor]:
        """Random inputs of ``rows`` rows for the matmuls, by input width."""
        weight = self.model.embed_tokens.weight
        return {m.in_features: _random((rows, m.in_features), weight) for m in self.linears}


def _pairs_copies(linears: list[Linear], ops: NativeOps) -> dict[Linear, torch.Tensor | None]:
    """Each Linear's pack_pairs copy for a trial: the one it holds, else one made here (None
    where the weight's shape takes none)."""
    return {m: m.pairs if m.pairs is not None else pairs_copy(m.weight, ops) for m in linears}


def _packed_for_many_rows(linears: list[Linear]) -> dict[Linear, torch.Tensor]:
    """Each weight packed as the engine lays it out for several rows (under linear=c, amx or
    pairs): the packing it holds, else one made here."""
    return {
        m: m.packed
        if m.packed is not None and m.packed_rows == PACKED_ROWS_WITH_C
        else torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACKED_ROWS_WITH_C)
        for m in linears
    }


def _linear_trial(shared: _TrialWeights) -> dict[str, Callable[[], object]]:
    linears, native = shared.linears, shared.native
    weight = shared.model.embed_tokens.weight
    inputs = shared.inputs(1)
    candidates: dict[str, Callable[[], object]] = {}
    if can_pack(weight.dtype, weight.device):
        packed = {
            m: m.packed
            if m.packed is not None
            else torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 1)
            for m in linears
        }

        def run_packed() -> None:
            for m in linears:
                _packed_linear(inputs[m.in_features], packed[m], m.bias, "none", [], "")

        candidates["packed"] = run_packed

    def run_plain() -> None:
        for m in linears:
            F.linear(inputs[m.in_features], m.weight, m.bias)

    candidates["plain"] = run_plain
    if native is not None:
        # asked before the copy below is made: it sees the memory the engine will have
        copies_fit = (
            weight.dtype == torch.bfloat16 and native.pairs and pairs_copy_fits(shared.model)
        )
        ops, streamed = native, shared.streamed

        def run_c() -> None:
            for m in linears:
                ops.linear(inputs[m.in_features], streamed[m], m.bias)

        candidates["c"] = run_c
        if weight.dtype == torch.bfloat16 and ops.linear_many_isa == "amx":

            def run_amx() -> None:
                for m in linears:
                    ops.linear_many(inputs[m.in_features], streamed[m], m.bias)

            candidates["amx"] = run_amx
        if copies_fit:
            # weights without a copy take the C kernel; one set of copies for both counts
            copies = shared.pairs
            # both stream counts in AVX2 too: with one accumulator an output (two a block) 8
            # streams gave 1.07x 2's batch-1 tokens/s on an AMD EPYC Zen 2
            # (bench/decode_ops_ab.py --path linear --candidates pairs2 pairs); with two an
            # output they took 1.26-1.37x 2's time (bench/linear_ab.py --march x86-64-v3)
            for name, streams in PAIRS_LINEAR.items():
                candidates[name] = _pairs_candidate(
                    copies, inputs, ops, ops.linear, streamed, streams
                )
    return candidates


def _pairs_candidate(
    copies: dict[Linear, torch.Tensor | None],
    inputs: dict[int, torch.Tensor],
    ops: NativeOps,
    without_copy: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    streamed: dict[Linear, torch.Tensor],
    streams: int = 8,
) -> Callable[[], None]:
    """A trial's pairs candidate, run as apply_kernels would: each Linear's matmul through its
    copy (:attr:`_TrialWeights.pairs`; one row read as ``streams`` a thread), a weight the copy
    cannot take through ``without_copy`` (on ``streamed``, :attr:`_TrialWeights.streamed`)."""

    def run() -> None:
        for m, p in copies.items():
            x = inputs[m.in_features]
            if p is None:
                without_copy(x, streamed[m], m.bias)
            else:
                ops.linear_pairs(x, p, m.bias, streams=streams)

    return run


# Rows of x in the batch_linear trial: the batch the engine's batched-decode figures use.
_BATCH_TRIAL_ROWS = 32


def _batch_linear_trial(
    shared: _TrialWeights, native: NativeOps
) -> dict[str, Callable[[], object]]:
    linears, inputs = shared.linears, shared.inputs(_BATCH_TRIAL_ROWS)
    several = _several_rows_candidates(shared, native, inputs)
    streamed = shared.streamed

    def run_c() -> None:
        for m in linears:
            native.linear_many(inputs[m.in_features], streamed[m], m.bias)

    candidates = {"packed": several.pop("onednn"), "c": run_c}
    return candidates | several


# Rows of x in the big_batch_linear trial: the middle of the rows that path takes.
_BIG_BATCH_TRIAL_ROWS = 48


def _big_batch_linear_trial(
    shared: _TrialWeights, native: NativeOps
) -> dict[str, Callable[[], object]]:
    inputs = shared.inputs(_BIG_BATCH_TRIAL_ROWS)
    return _several_rows_candidates(
        shared, native, inputs, stored=stored_offered(shared.model, native)
    )


def _several_rows_candidates(
    shared: _TrialWeights,
    native: NativeOps,
    inputs: dict[int, torch.Tensor],
    stored: bool = False,
) -> dict[str, Callable[[], object]]:
    """One step's matmuls (the shared ones, on ``inputs`` by input width) through oneDNN
    (``onednn``: the weights packed as the engine lays them out for several rows, the fastest
    packed form there, whatever ``linear`` chooses: C must beat the best oneDNN can do to be
    chosen; where oneDNN has no bf16 path, the float32-widened matmul several rows take there)
    and, where the copies are offered, through the pairs copies (``pairs``); with ``stored``,
    through the many-row kernel on the weights as stored (``c``)."""
    model, linears = shared.model, shared.linears
    weight = model.embed_tokens.weight
    if can_pack(weight.dtype, weight.device):
        packed = shared.packed_many

        def run_onednn() -> None:
            for m in linears:
                _packed_linear(inputs[m.in_features], packed[m], m.bias, "none", [], "")

    else:  # no oneDNN bf16 here: what several rows then run, widened to float32 (matmul_math)

        def run_onednn() -> None:
            for m in linears:
                linear_widened(inputs[m.in_features], m.weight, m.bias)

    candidates: dict[str, Callable[[], object]] = {"onednn": run_onednn}
    if weight.dtype == torch.bfloat16 and native.pairs_rows and pairs_copy_fits(model):
        # weights without a copy take the many-row kernel
        candidates["pairs"] = _pairs_candidate(
            shared.pairs, inputs, native, native.linear_many, shared.streamed
        )
    if stored:
        streamed = shared.streamed

        def run_c() -> None:
            for m in linears:
                native.linear_many(inputs[m.in_features], streamed[m], m.bias)

        candidates["c"] = run_c
    return candidates


def stored_offered(model: CausalLM, native: NativeOps | None) -> bool:
    """Whether the trials offer the weights as stored past 32 rows (``big_batch_linear=c``,
    ``prefill_linear=plain``): a bf16 model on CPU whose C kernels have AMX tiles, where
    those paths hold no copy at 0.87x the packed weights' rate or better, and the pairs
    copies run at a tenth of it (docs/performance.md)."""
    weight = model.embed_tokens.weight
    return (
        native is not None
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and native.linear_many_isa == "amx"
    )


def transposed_copy_bytes(model: CausalLM) -> int:
    """Bytes of the transposed copy prefill_linear=transposed keeps: every layer weight once
    more (the LM head excepted), beside the weight and its oneDNN-packed copy."""
    return sum(m.weight_nbytes() for m in model.layers.modules() if isinstance(m, Linear))


_MEMINFO = "/proc/meminfo"
# A cgroup's memory limit, use, and the statistics whose inactive file pages (counted in the use,
# dropped before the limit bites) are left out of it: v2's files, then v1's (whose "no limit"
# reads 2^63 less a page). The checkpoint just read sits in that page cache.
_CGROUP_MEMORY = (
    (
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory.current",
        "/sys/fs/cgroup/memory.stat",
        "inactive_file",
    ),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
        "total_inactive_file",
    ),
)


def available_memory_bytes() -> int | None:
    """Memory a new allocation can have now: Linux's MemAvailable (free memory plus the page
    cache it can drop, e.g. the checkpoint's file pages just read), capped by this process's
    cgroup limit (v2, or v1) less its use where one is set; None where neither can be
    read."""
    available = None
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024  # kB
                    break
    except (OSError, ValueError):
        pass
    for limit_file, used_file, stat_file, inactive in _CGROUP_MEMORY:
        try:
            with open(limit_file) as f:
                text = f.read().strip()
            with open(used_file) as f:
                used = int(f.read())
            limit = None if text == "max" else int(text)
        except (OSError, ValueError):
            continue
        try:
            with open(stat_file) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == inactive:  # (read apart from the use: it may exceed it)
                        used = max(0, used - int(value))
                        break
        except (OSError, ValueError):
            pass
        if limit is not None and limit < 1 << 62:
            left = max(0, limit - used)
            available = left if available is None else min(available, left)
        break
    return available


def copy_fits(nbytes: int) -> bool:
    """Whether a copy of ``nbytes`` is at most TRANSPOSED_COPY_MAX_SHARE of the memory
    available now: a model that would need most of the machine's memory for another copy of
    its weights is not measured into one (the paths that keep no second copy are then taken
    untimed: llm_engine's _held_once_paths). False where the available memory
    cannot be read."""
    available = available_memory_bytes()
    return available is not None and nbytes <= TRANSPOSED_COPY_MAX_SHARE * available


def transposed_copy_fits(model: CausalLM) -> bool:
    """Whether prefill_linear=transposed's copy fits (:func:`copy_fits`)."""
    return copy_fits(transposed_copy_bytes(model))


def pairs_copy_fits(model: CausalLM) -> bool:
    """Whether linear=pairs' copy (every weight once more, the LM head's too) fits
    (:func:`copy_fits`)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return copy_fits(sum(m.weight_nbytes() for m in linears))


def _prefill_trial_linears(model: CausalLM) -> list[Linear]:
    """The matmuls prefill_linear's trial times: layer 0's, each cut to the first rows of one
    share that keeps them within ``_PREFILL_TRIAL_BYTES`` (:func:`_first_rows`)."""
    layer = [m for m in model.layers[0].modules() if isinstance(m, Linear)]
    share = min(1.0, _PREFILL_TRIAL_BYTES / sum(m.weight_nbytes() for m in layer))
    return [_first_rows(m, share) for m in layer]


def _prefill_linear_trial(
    model: CausalLM,
    rows: int,
    pairs: NativeOps | None = None,
    transposed: bool = True,
    stored: bool = False,
) -> dict[str, Callable[[], object]]:
    """oneDNN's packed weights against the candidates offered: the transposed copy
    (``transposed``), the pairs copies (``pairs``, the C kernels to run them) and ``F.linear``
    on the weights as stored (``plain``, with ``stored``)."""
    linears = _prefill_trial_linears(model)
    weight = model.embed_tokens.weight
    rows = min(rows, PACKED_ROWS_WITH_C)  # a chunk of the size the weights are packed for
    inputs = {m.in_features: _random((rows, m.in_features), weight) for m in linears}
    # oneDNN's candidate as a prefill runs it under linear=c or amx (what the trial picks on
    # the CPUs where this path applies): laid out for many rows.
    packed = _packed_for_many_rows(linears)

    def run_onednn() -> None:
        for m in linears:
            _packed_linear(inputs[m.in_features], packed[m], m.bias, "none", [], "")

    # prefill_linear=rows is not a candidate (forced only): each of its shares takes the GIL
    # on its OpenMP thread, so a server's event loop holding it stalls a prefill's matmuls (up
    # to the 5 ms switch interval each, 96 takes per 2,000-token prefill of the small model);
    # quiet, it beat transposed by only 1.5-3% (docs/performance.md).
    candidates: dict[str, Callable[[], object]] = {"onednn": run_onednn}
    if transposed:
        weights_t = {
            m: m.weight_t if m.weight_t is not None else m.weight.detach().t().contiguous()
            for m in linears
        }

        def run_transposed() -> None:
            for m in linears:
                linear_transposed(inputs[m.in_features], weights_t[m], m.bias)

        candidates["transposed"] = run_transposed
    if pairs is not None:
        copies = _pairs_copies(linears, pairs)

        def run_pairs() -> None:  # a weight without a copy: the packed weights, as in a step
            for m, p in copies.items():
                x = inputs[m.in_features]
                if p is None:
                    _packed_linear(x, packed[m], m.bias, "none", [], "")
                else:
                    pairs.linear_pairs(x, p, m.bias)

        candidates["pairs"] = run_pairs
    if stored:

        def run_plain() -> None:
            for m in linears:
                F.linear(inputs[m.in_features], m.weight, m.bias)

        candidates["plain"] = run_plain
    return candidates


def _prefill_trial(
    model: CausalLM, n: int, native: NativeOps | None = None
) -> dict[str, Callable[[], object]]:
    c, weight = model.config, model.embed_tokens.weight
    attn = model.layers[0].self_attn
    # Laid out head-major, as the C path hands a one-chunk step's queries to attention.
    q = _random((c.num_heads, n, c.head_dim), weight, 0.1).transpose(0, 1)
    keys = _random((c.num_kv_heads, n, c.head_dim), weight, 0.1)
    values = _random((c.num_kv_heads, n, c.head_dim), weight)
    candidates: dict[str, Callable[[], object]] = {
        "blocked": lambda: attn._prefill_cpu(q, keys, values, 0),
        "sdpa": lambda: attn._prefill_sdpa(q, keys, values, 0),
    }
    if widen_bf16(weight.dtype, weight.device):
        # Its bmms run torch's slow bf16 fallback here: 74x SDPA's time on an AVX2-only AMD
        # EPYC (2.93 s against 0.040 s a trial run at 2,048 tokens, 4 heads of 64), seconds
        # of start-up for a choice already known.
        del candidates["blocked"]
    # The C kernel only where it would run in the model: bf16 chunks, no window, a head size
    # it takes, tiles granted (amx) or AVX-512 BF16 built (c). Elsewhere it would time SDPA
    # under another name.
    if (
        native is not None
        and weight.dtype == torch.bfloat16
        and attn.window is None
        and c.head_dim % 32 == 0
        and c.head_dim <= 256
        and c.num_heads // c.num_kv_heads <= 16
    ):
        ops = native

        def run_with(tiles: bool) -> Callable[[], object]:
            def run() -> None:
                if ops.prefill_attention(q, keys, values, 0, attn.scale, tiles) is None:
                    raise RuntimeError("prefill_attention refused a shape the trial offered")

            return run

        if native.prefill_amx:
            candidates["amx"] = run_with(True)
        if native.prefill_vec:
            candidates["c"] = run_with(False)
    return candidates


def _decode_math_trial(model: CausalLM) -> dict[str, Callable[[], object]]:
    c, weight = model.config, model.embed_tokens.weight
    seqs, context, block = _FLOAT32_DECODE_MAX_SEQS, 256, 16
    blocks_per_seq = context // block
    cache = _random((2, c.num_kv_heads, seqs * context, c.head_dim), weight)
    table = torch.arange(seqs * blocks_per_seq, device=weight.device).view(seqs, blocks_per_seq)
    batch = AttentionBatch(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=weight.device),
        block_size=block,
        num_decode=seqs,
        decode_rows=block_rows(table, c.num_kv_heads, seqs * blocks_per_seq),
        decode_keys=(0, context),
        decode_mask=None,
        prefills=[],
    )
    q = _random((seqs, c.num_heads, c.head_dim), weight)
    layers = [layer.self_attn for layer in model.layers]

    def decode_with(float32: bool) -> Callable[[], object]:
        def run() -> None:
            for a in layers:
                before, a.decode_float32 = a.decode_float32, float32
                try:
                    a._decode(q, cache, batch)
                finally:
                    a.decode_float32 = before

        return run

    return {"float32": decode_with(True), "native": decode_with(False)}


# The decode prefetch trial's context and the most cache bytes it reads: about one step's K
# and V at 4,000 tokens of context on the small model (49 MB), where decode's prefetch
# matters; fewer layers' caches than the model has where its layers are larger.
_PREFETCH_TRIAL_KEYS = 4096
_PREFETCH_TRIAL_BYTES = 64 << 20


def prefetch_applies(model: CausalLM, native: NativeOps | None) -> bool:
    """Whether ``decode_prefetch`` changes anything for ``model``: the C kernels' bf16 decode
    attention of head size 64 with 1-4 query heads a KV head (AVX-512 BF16, scores on AMX
    tiles where granted) and of head size 128 with 1-8 has the prefetch; other shapes take
    loops without it."""
    c, weight = model.config, model.embed_tokens.weight
    most = {64: 4, 128: 8}.get(c.head_dim, 0)  # query heads a KV head
    return (
        native is not None
        and native.has_decode_prefetch
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and c.num_heads // c.num_kv_heads <= most
    )


def _decode_prefetch_trial(model: CausalLM, native: NativeOps) -> dict[str, Callable[[], object]]:
    c, weight = model.config, model.embed_tokens.weight
    block = 16
    context = max(block, min(_PREFETCH_TRIAL_KEYS, model.rope_cos.shape[0]) // block * block)
    shape = (2, c.num_kv_heads, context, c.head_dim)
    layer_bytes = 2 * c.num_kv_heads * context * c.head_dim * weight.element_size()
    layers = max(1, min(c.num_layers, _PREFETCH_TRIAL_BYTES // layer_bytes))
    gen = torch.Generator(device=weight.device).manual_seed(0)
    caches = [
        torch.empty(shape, dtype=weight.dtype).uniform_(-1.0, 1.0, generator=gen)
        for _ in range(layers)
    ]
    q = _random((1, c.num_heads, c.head_dim), weight)
    tables = torch.arange(context // block).view(1, -1)
    bounds = torch.tensor([[0, context]])
    scale = c.head_dim**-0.5

    def run(mode: str) -> Callable[[], None]:
        def attend() -> None:
            native.set_decode_prefetch(mode)
            for cache in caches:
                native.decode_attention(q, cache, tables, bounds, block, scale)

        return attend

    return {mode: run(mode) for mode in OPTIONS["decode_prefetch"]}


def _decode_ops_trial(model: CausalLM, native: NativeOps) -> dict[str, Callable[[], object]]:
    c, weight = model.config, model.embed_tokens.weight
    # 256 tokens of context, or fewer where the model's rope table is shorter.
    block, positions = 16, model.rope_cos.shape[0]
    context = max(block, min(256, positions) // block * block)
    caches = [_random((2, c.num_kv_heads, context, c.head_dim), weight) for _ in model.layers]
    slot = torch.tensor([context - 1], device=weight.device)
    position = torch.tensor([min(context, positions) - 1], device=weight.device)
    torch_batch = AttentionBatch(slot, block, 1, None, (0, context), None, [], [(0, context)])
    native_batch = AttentionBatch(
        slot,
        block,
        1,
        None,
        (0, 0),
        None,
        [],
        decode_tables=torch.arange(context // block, device=weight.device).view(1, -1),
        decode_bounds=torch.tensor([[0, context]], device=weight.device),
        positions=position,
    )
    width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    qkv = _random((1, width), weight)
    hidden = _random((1, c.hidden_size), weight)  # stands in for o_proj's and the MLP's outputs
    residual = hidden.clone()

    def run_torch() -> None:
        cos = model.rope_cos[position].to(weight.dtype).unsqueeze(1)
        sin = model.rope_sin[position].to(weight.dtype).unsqueeze(1)
        for layer, cache in zip(model.layers, caches, strict=True):
            layer.input_layernorm(hidden)
            layer.self_attn._attention(qkv, cos, sin, cache, torch_batch)
            layer.post_attention_layernorm(hidden + hidden)

    def run_native() -> None:
        for layer, cache in zip(model.layers, caches, strict=True):
            norm = layer.input_layernorm
            native.rms_norm(hidden, norm.weight, norm.eps, residual=residual)
            layer.self_attn._native_decode(qkv, model.rope_cos, model.rope_sin, cache, native_batch)
            norm = layer.post_attention_layernorm
            native.rms_norm(hidden, norm.weight, norm.eps, residual=residual)

    def with_native(run: Callable[[], None]) -> Callable[[], None]:
        def wrapped() -> None:  # _native_decode needs the layers pointed at the kernels
            before = [layer.self_attn.native for layer in model.layers]
            for layer in model.layers:
                layer.self_attn.native = native
            try:
                run()
            finally:
                for layer, ops in zip(model.layers, before, strict=True):
                    layer.self_attn.native = ops

        return wrapped

    return {"torch": run_torch, "c": with_native(run_native)}
