"""The KV block pool with automatic prefix caching. Pure Python: block ids, not tensors.

Every block is in exactly one of three states:
* in use: ``ref_count > 0`` (held by one or more requests' block tables);
* cached-free: ``ref_count == 0`` and registered under a hash, reusable by a later prefix hit
  until evicted;
* free: ``ref_count == 0``, no hash.
Both kinds of unreferenced block sit in one LRU queue; allocation takes from its least recently
freed and evicts their hashes, choosing among the queue's older half so that a table's blocks
form long runs of consecutive ids (``allocate``): LRU within that bound.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Identity of a full block: its tokens chained with its parent block's hash.

    Chaining makes a hash stand for the whole prefix up to this block, so equal hashes mean
    equal prefixes (up to a 128-bit collision).
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))  # 4-byte little-endian ids
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        grow_runs: bool = True,
    ):
        """``grow_runs=False``: :meth:`allocate` as before it grew runs, the least recently
        freed blocks in order, sorted (the reference bench/decode_ops_ab.py --block-runs and
        the tests compare with)."""
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.grow_runs = grow_runs
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # --- accounting ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free and cached-free)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0-1 (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_blocks

    def counts(self) -> tuple[int, int, int]:
        """(free, cached-free, in use). Their sum is always ``num_blocks``."""
        cached_free = sum(1 for i in self.free_queue if self.blocks[i].hash is not None)
        return len(self.free_queue) - cached_free, cached_free, self.num_used_blocks

    def check_invariants(self) -> None:
        free, cached_free, used = self.counts()
        assert free + cached_free + used == self.num_blocks
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} freed twice"
            assert (block.ref_count == 0) == (block.block_id in self.free_queue)
            if block.hash is not None:
                assert self.cached.get(block.hash) == block.block_id
        assert len(self.cached) == sum(1 for b in self.blocks if b.hash is not None)

    # --- prefix cache -------------------------------------------------------------------

    def extend_hashes(self, hashes: list[bytes], token_ids: Sequence[int]) -> list[bytes]:
        """Append to ``hashes`` the chained hash of every full block of ``token_ids`` it does
        not cover yet, and return it. Blocks already hashed are never hashed again."""
        size = self.block_size
        for start in range(len(hashes) * size, len(token_ids) - size + 1, size):
            parent = hashes[-1] if hashes else None
            hashes.append(block_hash(parent, token_ids[start : start + size]))
        return hashes

    def find_cached_prefix(self, hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        """Blocks holding the longest cached prefix of a sequence of ``num_tokens`` tokens whose
        full blocks hash to ``hashes``.

        The hit never covers the last token: it must still be computed to produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        hit: list[int] = []
        for h in hashes[: (num_tokens - 1) // self.block_size]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, so no later request reuses KV computed before now (as
        after new weights are loaded). Only while no block is held: False, and nothing
        forgotten, while a request holds blocks (vLLM's reset_prefix_cache refuses alike)."""
        if self.num_used_blocks:
            return False
        for block_id in self.cached.values():
            self.blocks[block_id].hash = None
        self.cached.clear()
        return True

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's lookup (vLLM's prefix_cache_queries / _hits, in tokens)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += queried_tokens
            self.prefix_cache_hits += hit_tokens

    def register_full_blocks(
        self,
        block_table: list[int],
        hashes: list[bytes],
        start: int = 0,
        stop: int | None = None,
    ) -> int:
        """Publish full, computed blocks so later requests can reuse them: indexes ``start`` to
        ``stop`` (default: as far as both lists go; blocks before ``start`` are known to be
        published). Returns how many leading blocks of the table are now published: the
        caller's next ``start``."""
        if not self.enable_prefix_caching:
            return 0
        published = start
        blocks, cached = self.blocks, self.cached
        end = min(len(block_table), len(hashes))
        if stop is not None:
            end = min(end, stop)
        for index in range(start, end):
            block = blocks[block_table[index]]
            h = hashes[index]
            if block.hash is None and h not in cached:
                block.hash = h
                cached[h] = block.block_id
            if block.hash == h and published == index:
                published += 1
        return published

    # --- allocation ---------------------------------------------------------------------

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks found by :meth:`find_cached_prefix`."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """Take ``count`` blocks from the least recently freed, evicting their hashes, laid out
        greedily in long ascending runs of consecutive blocks.

        Apart from the ``after`` run's blocks that hold no hash, the blocks come from the
        queue's oldest ``max(count, min(8 * count, queued // 2))`` (the window): never from its
        younger half unless ``count`` needs more, so a prefix freed or hit lately survives as
        under strict LRU. Each run starts at the least recently freed block left and grows by
        the older of the window's blocks at its two ends. A freed table's blocks join the queue
        tail first, so the blocks of ascending tables come in the order strict LRU would take
        them. Why: after engine_bench's batches, strict LRU order (sorted) laid a 4,000-token
        prompt in ~160 runs, which the decode attention at head size 128 read in 1.34-1.38x
        one run's time; grown, ~11 runs in 1.09-1.12x (AMD EPYC Zen 4;
        bench/decode_attention_ab.py --scattered, docs/performance.md).

        ``after``: the last block of the table the blocks extend. The blocks right after it
        are taken first while they are free and hold no hash (which costs the cache nothing)
        or lie in the window, so that a table growing by chunks or while it decodes stays one
        ascending run. Under ``grow_runs=False``: the free blocks with no hash after it, then
        the least recently freed, sorted."""
        queue = self.free_queue
        assert count <= len(queue), "allocate() without a capacity check"
        width = max(count, min(8 * count, len(queue) // 2)) if self.grow_runs else count
        oldest = list(islice(queue, width))
        age = {block_id: rank for rank, block_id in enumerate(oldest)}
        taken: list[int] = []
        if after is not None:
            block_id = after + 1
            while len(taken) < count and block_id in queue:
                if self.blocks[block_id].hash is not None and not (
                    self.grow_runs and block_id in age
                ):
                    break
                self._take(block_id, age, taken)
                block_id += 1
        grown = len(taken)
        anchors = iter(oldest)
        while len(taken) < count and not self.grow_runs:  # the queue's order, no runs
            self._take(next(b for b in anchors if b in age), age, taken)
        while len(taken) < count:
            lo = hi = next(b for b in anchors if b in age)  # the least recently freed left
            self._take(lo, age, taken)
            while len(taken) < count and (lo - 1 in age or hi + 1 in age):
                # grow the run by the older of the blocks at its two ends
                if age.get(lo - 1, width) < age.get(hi + 1, width):
                    lo -= 1
                    self._take(lo, age, taken)
                else:
                    hi += 1
                    self._take(hi, age, taken)
        return taken[:grown] + sorted(taken[grown:])

    def _take(self, block_id: int, window: dict[int, int], taken: list[int]) -> None:
        """Move a queued block to ``taken`` with one reference, its hash evicted."""
        del self.free_queue[block_id]
        window.pop(block_id, None)
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        taken.append(block_id)

    def extend(self, block_table: list[int], count: int) -> None:
        """Append ``count`` blocks to ``block_table``, the run after its last block first."""
        block_table += self.allocate(count, block_table[-1] if block_table else None)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; unreferenced blocks join the LRU queue.

        Given in reverse order of the block table, so a prefix's tail is evicted before its head
        (a head block is shared by more future prompts than a tail block).
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
