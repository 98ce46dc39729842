"""The model runner: one scheduled step in, one sampled token per finished sequence out.

It owns the model, the paged KV cache tensors and the per-request random generators; it turns a
:class:`SchedulerOutput` into flat tensors, runs the model, and samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdscope.engine.model import (
    C_PATH_MAX_RUNS,
    AttentionBatch,
    CausalLM,
    block_rows,
    can_decode_in_place,
    empty_on_huge_pages,
    slot_runs,
)
from pdscope.engine.request import Request
from pdscope.engine.scheduler import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from pdscope.engine.native import NativeOps

# A single sequence attending to at least this many keys takes torch's SDPA over its cache in
# place inside the C path (rope, K/V write and norms stay C). On the AMX Xeon, 12 layers at
# 4,000 keys: with the C kernel's scores as vdpbf16ps over the bf16 rows it takes 12.5 ms at
# one thread vs SDPA's 15.7 (before that, 18.4 vs 15.5, when the hand-off sat at 1,024 keys);
# at two threads the kernel before that change was at par (7.85 vs 8.18 ms). Contexts past
# what was measured keep SDPA, whose bf16 matmuls run on AMX.
NATIVE_SDPA_FROM_KEYS = 16384


def kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's KV cache, zeroed; on a CPU on transparent huge pages where Linux offers them
    (empty_on_huge_pages). The decode attention walks each KV head's K and V planes: on 4 KiB
    pages a plane crosses a page every 32 keys (head size 64, bf16). On the AMD EPYC at 4,000
    keys, 12 layers' decode attention over caches on huge pages took 0.85-0.86x the time over
    the same caches on ordinary pages, at 1 and 2 threads (bench/decode_attention_ab.py
    --huge-cache); in the whole engine the host's noise hid it (bench/decode_ops_ab.py
    --plain-cache, batch 1 at 4,000 keys, huge over plain in tokens/s: 0.99x and 1.11x in
    two runs, each over 0.84-1.64).
    Zeroed here, as torch.zeros would, so the memory is committed at start rather than when
    the cache fills."""
    if device.type == "cpu":
        numel = 1
        for n in shape:
            numel *= n
        huge = empty_on_huge_pages(numel, dtype)
        if huge is not None:
            return huge.view(shape).zero_()
    return torch.zeros(shape, dtype=dtype, device=device)


def _takes_argmax(request: Request) -> bool:
    """Whether ``request``'s next token is its logits' argmax as given (:meth:`ModelRunner.sample`
    would change nothing: greedy, and no stop token held back by ``min_tokens``)."""
    p = request.params
    held = request.stop_token_ids and len(request.output_token_ids) < p.min_tokens
    return p.greedy and not held


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device):
        c = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = model.embed_tokens.weight.dtype
        # One tensor per layer: [K/V, kv_heads, slots, head_dim], slot = block * block_size + i.
        shape = (2, c.num_kv_heads, num_blocks * block_size, c.head_dim)
        self.kv_caches = [kv_cache(shape, self.dtype, device) for _ in range(c.num_layers)]
        self.generators: dict[str, torch.Generator] = {}
        # decodes-only steps under the C kernels write their indices here (_index_views), and
        # the views of the last step's shape, (rows, width) -> views
        self._index_buf = torch.zeros(1024, dtype=torch.long)
        self._index_np = self._index_buf.numpy()
        self._index_last: tuple[tuple[int, int], tuple[torch.Tensor, ...]] | None = None
        # threads=bound (engine/kernels.py): the C kernels, the CPUs that pin the OpenMP team
        # of the thread running a step for the step's duration, and the CPUs it is freed to
        # after it (so nothing outside the steps, e.g. a process started between them,
        # inherits a pin).
        self.pin: tuple[NativeOps, list[int], list[int]] | None = None
        # Tests compare logits with a reference implementation; off in normal runs.
        self.capture_logits = False
        self.captured: list[torch.Tensor] = []

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return model_config.kv_bytes_per_token_per_element * block_size * itemsize

    def _rows(self, blocks: torch.Tensor) -> torch.Tensor:
        c = self.model.config
        return block_rows(blocks, c.num_kv_heads, self.num_blocks)

    def _slots(self, request: Request, start: int, end: int) -> list[int]:
        bs, table = self.block_size, request.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def execute(self, out: SchedulerOutput) -> dict[Request, int]:
        """Run one step; returns the sampled token for every request whose computed tokens
        caught up with its tokens in this step."""
        if self.pin is None:
            return self._execute(out)
        ops, cpus, allowed = self.pin
        ops.place_threads(cpus, bind=True)  # a few microseconds; a step is milliseconds
        try:
            return self._execute(out)
        finally:
            ops.place_threads(allowed, bind=False)

    def _execute(self, out: SchedulerOutput) -> dict[Request, int]:
        # Decodes first (one token each), then prefill chunks, matching AttentionBatch's layout.
        # The phase is the scheduler's call (ScheduledRequest.is_prefill), never decided here.
        decodes = [e for e in out.scheduled if not e.is_prefill]
        if decodes and len(decodes) == len(out.scheduled) and self.model.native is not None:
            assert all(e.samples for e in decodes)  # a decode's token is always due
            batch, token_ids = self._native_decode_batch(decodes)
            # (CausalLM.decode_logits enters inference mode itself where it runs modules)
            logits, greedy = self.model.decode_logits(token_ids, self.kv_caches, batch)
            due = [e.request for e in decodes]
            if greedy is not None and not self.capture_logits and all(map(_takes_argmax, due)):
                return dict(zip(due, greedy.tolist(), strict=True))
            with torch.inference_mode():  # the logits may be an inference tensor, edited here
                return self._sampled(logits, due, greedy)
        with torch.inference_mode():
            return self._forward(decodes, [e for e in out.scheduled if e.is_prefill])

    def _forward(
        self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]
    ) -> dict[Request, int]:
        """A step with prefill chunks, or any step off the C kernels: the model's forward over
        the step's tokens, then the logits of the rows whose token is due."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for e in decodes + prefills:
            ids.extend(e.request.token_ids[e.start : e.end])
            positions.extend(range(e.start, e.end))
            slots.extend(self._slots(e.request, e.start, e.end))
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)

        window = self.model.config.sliding_window
        batch = self._batch(decodes, prefills, slot_mapping, window)
        hidden = self.model(
            torch.tensor(ids, device=dev),
            torch.tensor(positions, device=dev) if batch.positions is None else batch.positions,
            self.kv_caches,
            batch,
        )
        # Logits only where a token is due: the last position of each caught-up request.
        due: list[Request] = []
        rows: list[int] = []
        offset = 0
        for e in decodes + prefills:
            offset += e.num_new_tokens
            if e.samples:
                due.append(e.request)
                rows.append(offset - 1)
        if not due:
            return {}
        return self._sampled(self.model.logits(hidden[torch.tensor(rows, device=dev)]), due)

    def _sampled(
        self, logits: torch.Tensor, due: list[Request], greedy: torch.Tensor | None = None
    ) -> dict[Request, int]:
        """The token sampled for each request of ``due`` from its row of float32 ``logits``
        (``greedy``: the rows' argmax, where the model gave it)."""
        if self.capture_logits:
            self.captured.append(logits.clone())
        return dict(zip(due, self.sample(logits, due, greedy), strict=True))

    def _native_decode_batch(
        self, decodes: list[ScheduledRequest]
    ) -> tuple[AttentionBatch, torch.Tensor]:
        """A decodes-only step for the C kernels and its token ids: block tables and key
        bounds, nothing gathered, no mask (each sequence's keys are cut to its own context and
        window). The indices are written into one int64 buffer the runner keeps and handed out
        as views of it (:meth:`_index_views`), valid until the next step: five ``torch.tensor``
        calls took ~95 us of a batch-1 step (~35 now), their lines cold after the step streamed
        the weights."""
        bs = self.block_size
        rows = len(decodes)
        ids, positions, slots = [], [], []
        for e in decodes:
            n, table = e.end, e.request.block_table  # its last token, at position end - 1
            ids.append(e.request.token_ids[n - 1])
            positions.append(n - 1)
            slots.append(table[(n - 1) // bs] * bs + (n - 1) % bs)
        width, bounds, tables, runs = self._decode_tables(decodes)
        views = self._index_views(rows, width)
        self._index_np[: rows * (5 + width)] = ids + positions + slots + bounds + tables
        id_view, position_view, slot_view, bound_view, table_view = views
        batch = AttentionBatch(
            slot_view,
            bs,
            rows,
            None,
            (bounds[0], bounds[1]) if runs else (0, 0),
            None,
            [],
            runs,
            decode_tables=table_view,
            decode_bounds=bound_view,
            positions=position_view,
        )
        return batch, id_view

    def _decode_tables(
        self, decodes: list[ScheduledRequest]
    ) -> tuple[int, list[int], list[int], list[tuple[int, int]] | None]:
        """The C kernels' paged decode attention for these decodes: the block tables' width,
        each sequence's attended key positions (lo, hi) and its block table padded to the
        width, both flat, row after row; or, for one sequence of NATIVE_SDPA_FROM_KEYS keys
        or more, its keys as runs of the cache for SDPA in place (None otherwise)."""
        bs, window = self.block_size, self.model.config.sliding_window
        lengths = [e.end for e in decodes]
        width = -(-max(lengths) // bs)
        bounds: list[int] = []
        tables: list[int] = []
        for e, n in zip(decodes, lengths, strict=True):
            bounds += (max(0, n - window) if window else 0, n)
            row = e.request.block_table[:width]
            tables += row
            if len(row) < width:
                tables += [0] * (width - len(row))
        runs = None
        if len(decodes) == 1 and lengths[0] - bounds[0] >= NATIVE_SDPA_FROM_KEYS:
            runs = slot_runs(decodes[0].request.block_table, bounds[0], bounds[1], bs)
            runs = runs if can_decode_in_place(runs, self.device, C_PATH_MAX_RUNS) else None
        return width, bounds, tables, runs

    def _index_views(self, rows: int, width: int) -> tuple[torch.Tensor, ...]:
        """Views of the index buffer for a decodes-only step of ``rows`` sequences and block
        tables ``width`` wide: ids [rows], positions [rows], slots [rows], key bounds [rows, 2]
        and tables [rows, width], in this order, one after another. Kept for the last shape only
        (steps in a row mostly share it; the width grows a block at a time); the buffer grows
        when a step needs more, views of the old one then go with it."""
        if self._index_last is not None and self._index_last[0] == (rows, width):
            return self._index_last[1]
        need = rows * (5 + width)
        if need > self._index_buf.numel():
            self._index_buf = torch.zeros(max(need, 2 * self._index_buf.numel()), dtype=torch.long)
            self._index_np = self._index_buf.numpy()
        buf = self._index_buf
        views = (
            buf[:rows],
            buf[rows : 2 * rows],
            buf[2 * rows : 3 * rows],
            buf[3 * rows : 5 * rows].view(rows, 2),
            buf[5 * rows : need].view(rows, width),
        )
        self._index_last = ((rows, width), views)
        return views

    def _batch(
        self,
        decodes: list[ScheduledRequest],
        prefills: list[ScheduledRequest],
        slot_mapping: torch.Tensor,
        window: int | None,
    ) -> AttentionBatch:
        """The batch of a step with prefill chunks, or of any step off the C kernels: each
        prefill chunk's cached-prefix rows, and for the decodes gathered rows or in-place runs
        and a mask where padded; on the C kernels, their block tables read in place, as in a
        decodes-only step (a gather of 15 decodes' contexts of up to 2,000 tokens is 61 MB a
        layer of the 1.1B model, faulted in afresh: glibc maps a request over 32 MiB)."""
        dev, bs = self.device, self.block_size
        decode_rows = decode_mask = decode_runs = decode_tables = decode_bounds = None
        decode_keys = (0, 0)
        if decodes and self.model.native is not None:
            assert all(e.num_new_tokens == 1 for e in decodes)
            width, bounds, tables, decode_runs = self._decode_tables(decodes)
            if decode_runs is not None:
                decode_keys = (bounds[0], bounds[1])
            else:
                rows = len(decodes)
                decode_tables = torch.tensor(tables, dtype=torch.long).view(rows, width)
                decode_bounds = torch.tensor(bounds, dtype=torch.long).view(rows, 2)
        elif decodes:
            assert all(e.num_new_tokens == 1 for e in decodes)
            lengths = [e.end for e in decodes]
            num_blocks = [-(-length // bs) for length in lengths]
            widest = max(num_blocks)
            if len(decodes) == 1:
                # One sequence: cut the keys to exactly its context, so nothing needs masking,
                # and read them in place when they lie in few runs of the pool.
                decode_keys = (max(0, lengths[0] - window) if window else 0, lengths[0])
                decode_runs = slot_runs(decodes[0].request.block_table, *decode_keys, bs)
                if not can_decode_in_place(decode_runs, dev):
                    decode_runs = None
            if decode_runs is None:
                table = [
                    e.request.block_table[:nb] + [0] * (widest - nb)
                    for e, nb in zip(decodes, num_blocks, strict=True)
                ]
                decode_rows = self._rows(torch.tensor(table, dtype=torch.long, device=dev))
            if len(decodes) > 1:
                decode_keys = (0, widest * bs)  # whole blocks: the gather stays contiguous
                key_pos = torch.arange(decode_keys[1], device=dev)
                lens = torch.tensor(lengths, device=dev)[:, None]
                decode_mask = key_pos[None, :] < lens
                if window is not None:
                    decode_mask &= key_pos[None, :] >= lens - window
                elif min(lengths) == decode_keys[1]:
                    decode_mask = None  # equal lengths, no window: every key counts
        prefill_meta = []
        offset = len(decodes)
        # Under the C kernels every chunk reads its keys back from the cache (the rotated K
        # exists nowhere else), so every chunk gets its block rows.
        every_chunk_rows = self.model.native is not None
        for e in prefills:
            cached, n = e.start, e.num_new_tokens
            blocks = None
            if cached or every_chunk_rows:
                table = e.request.block_table[: -(-e.end // bs)]
                blocks = self._rows(torch.tensor(table, dtype=torch.long, device=dev))
            prefill_meta.append((offset, n, cached, blocks))
            offset += n
        return AttentionBatch(
            slot_mapping,
            bs,
            len(decodes),
            decode_rows,
            decode_keys,
            decode_mask,
            prefill_meta,
            decode_runs,
            decode_tables=decode_tables,
            decode_bounds=decode_bounds,
        )

    def sample(
        self, logits: torch.Tensor, requests: list[Request], greedy: torch.Tensor | None = None
    ) -> list[int]:
        """Greedy rows take the argmax (``greedy``, where the caller has it: the C kernels'
        one call gives it, ~40 us sooner than torch's over a 16k vocabulary); others
        temperature, top-k, top-p, then an exponential race (argmax of p / E, E ~ Exp(1)),
        drawn from the request's own generator when it has a seed so its tokens do not depend
        on what else shares the batch."""
        for i, request in enumerate(requests):
            p = request.params
            if len(request.output_token_ids) < p.min_tokens:  # no stop token before min_tokens
                for stop_id in request.stop_token_ids:
                    logits[i, stop_id] = float("-inf")
                    greedy = None  # a row changed: its argmax may have
        tokens = logits.argmax(dim=-1) if greedy is None else greedy
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not sampled:
            return tokens.tolist()
        rows = logits[sampled]
        temps = torch.tensor([requests[i].params.temperature for i in sampled], device=rows.device)[
            :, None
        ]
        rows = rows / temps
        top_ks = [requests[i].params.top_k for i in sampled]
        if any(k > 0 for k in top_ks):
            k_max = max(top_ks)
            kth = rows.topk(min(k_max, rows.shape[-1]), dim=-1).values
            for row, k in enumerate(top_ks):
                if k > 0:
                    rows[row][rows[row] < kth[row, min(k, rows.shape[-1]) - 1]] = float("-inf")
        probs = rows.softmax(dim=-1)
        top_ps = torch.tensor([requests[i].params.top_p for i in sampled], device=rows.device)
        if bool((top_ps < 1).any()):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass ranked above each token
            sorted_probs[before > top_ps[:, None]] = 0
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        noise = torch.empty_like(probs)
        for row, i in enumerate(sampled):
            request = requests[i]
            noise[row].exponential_(generator=self._generator(request))
        choice = (probs / noise).argmax(dim=-1)
        tokens[sampled] = choice
        return tokens.tolist()

    def _generator(self, request: Request) -> torch.Generator | None:
        if request.params.seed is None:
            return None
        gen = self.generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(request.params.seed)
            self.generators[request.request_id] = gen
        return gen

    def release(self, request: Request) -> None:
        self.generators.pop(request.request_id, None)
