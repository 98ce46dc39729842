"""Scheduler and block pool, pure Python: budgets, chunking, prefix hits, preemption, aborts."""

import itertools
import random

import pytest

from pdscope.engine.block_pool import BlockPool
from pdscope.engine.request import Request, Status
from pdscope.engine.sampling_params import SamplingParams
from pdscope.engine.scheduler import Scheduler, SchedulerConfig
from pdscope.engine.timeline import RequestTimeline


def make_request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0),
        RequestTimeline(0.0, len(prompt)),
    )


def run_step(s: Scheduler, token: int = 7):
    """One step without a model: every caught-up request gets ``token``; finish at max_tokens."""
    out = s.schedule()
    s.update(out)
    for entry in out.scheduled:
        request = entry.request
        if request.status is Status.RUNNING and request.num_computed_tokens == request.num_tokens:
            assert entry.samples
            request.append_output(token)
            if len(request.output_token_ids) >= request.params.max_tokens:
                s.finish(request, "length")
    s.pool.check_invariants()
    return out


def shares(out) -> dict[str, int]:
    return {e.request.request_id: e.num_new_tokens for e in out.scheduled}


def make(
    blocks: int = 64,
    budget: int = 32,
    seqs: int = 8,
    chunked: bool = True,
    caching: bool = True,
    max_len: int = 256,
) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, seqs, max_len, chunked), BlockPool(blocks, 4, caching))


def test_long_prompt_is_chunked_and_mixed_with_decodes() -> None:
    s = make(budget=16)
    short = make_request("short", list(range(3)), max_tokens=10)
    s.add(short)
    run_step(s)  # short prefilled, has its first token
    long = make_request("long", list(range(100, 140)))  # 40 tokens > budget 16
    s.add(long)
    out = run_step(s)
    assert shares(out) == {"short": 1, "long": 15}
    out = run_step(s)
    assert shares(out) == {"short": 1, "long": 15}
    out = run_step(s)
    assert shares(out) == {"short": 1, "long": 10}
    assert long.output_token_ids == [7]


def test_no_chunking_waits_for_a_whole_budget() -> None:
    s = make(blocks=128, budget=256, chunked=False)
    s.add(make_request("a", list(range(200))))
    s.add(make_request("b", list(range(300, 400))))
    out = run_step(s)
    assert shares(out) == {"a": 200}  # b does not fit the rest of the budget
    out = run_step(s)
    assert sorted(e.num_new_tokens for e in out.scheduled) == [1, 100]
    with pytest.raises(ValueError, match="chunked"):
        SchedulerConfig(100, 8, 256, enable_chunked_prefill=False)


def test_budget_and_max_num_seqs() -> None:
    s = make(budget=10, seqs=3)
    for i in range(6):
        s.add(make_request(f"r{i}", [i] * 5, max_tokens=50))
    for _ in range(10):
        out = run_step(s)
        assert out.num_tokens <= 10
        assert len(s.running) <= 3


def test_prefix_cache_hit_skips_full_blocks_but_never_the_last_token() -> None:
    s = make()
    prefix = list(range(1, 13))  # 12 tokens = 3 full blocks of 4
    first = make_request("a", prefix + [50, 51], max_tokens=1)
    s.add(first)
    run_step(s)
    assert first.is_finished
    second = make_request("b", prefix + [60, 61, 62])
    s.add(second)
    out = run_step(s)
    assert shares(out) == {"b": 3}
    assert out.num_prefix_hit_tokens == 12 and out.scheduled[0].start == 12
    assert second.timeline.num_cached_tokens == 12
    assert s.pool.prefix_cache_hits == 12
    assert s.pool.prefix_cache_queries == 14 + 15
    # A prompt made only of cached full blocks still computes its last token.
    third = make_request("c", prefix)
    s.add(third)
    out = run_step(s)
    assert shares(out)["c"] == 4  # the last block recomputed: hits are whole blocks


def test_prefix_caching_off() -> None:
    s = make(caching=False)
    s.add(make_request("a", list(range(12)), max_tokens=1))
    run_step(s)
    b = make_request("b", list(range(12)))
    s.add(b)
    out = run_step(s)
    assert shares(out) == {"b": 12} and out.num_prefix_hit_tokens == 0
    assert s.pool.prefix_cache_queries == 0


def test_the_scheduler_decides_each_entry_phase_once() -> None:
    """A 17-token prompt with a budget of 16: step 2 computes the last prompt token alone.

    It is prefill (it is a prompt token, and it produces the first output token), although it
    is one token over a cached context just as a decode is; the step counts say so too.
    """
    s = make(budget=16)
    r = make_request("r", list(range(17)), max_tokens=3)
    s.add(r)
    out = run_step(s)
    assert [(e.start, e.num_new_tokens, e.is_prefill, e.samples) for e in out.scheduled] == [
        (0, 16, True, False)
    ]
    out = run_step(s)
    assert [(e.start, e.num_new_tokens, e.is_prefill, e.samples) for e in out.scheduled] == [
        (16, 1, True, True)
    ]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (1, 0)
    out = run_step(s)  # now the sampled token: a decode
    assert [(e.start, e.num_new_tokens, e.is_prefill) for e in out.scheduled] == [(17, 1, False)]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 1)


def test_step_counts_cover_preemption_and_recomputation() -> None:
    s = make(blocks=6, budget=64)  # two requests outgrow 6 blocks at 13 tokens each
    a = make_request("a", list(range(6)), max_tokens=10)
    b = make_request("b", list(range(50, 56)), max_tokens=10)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert out.num_prefill_tokens == 12 and out.num_preemptions == 0
    for _ in range(20):
        out = run_step(s)
        if out.preempted:
            break
    assert out.preempted == [b]  # the newest
    assert out.num_preemptions == 1
    for _ in range(20):
        out = run_step(s)
        if b.status is Status.RUNNING:
            break
    # Re-admitted: what it had is recomputed as prefill (cached blocks may be reused), and the
    # reuse is not counted as a prefix-cache hit (recomputation is not demand).
    (entry,) = [e for e in out.scheduled if e.request is b]
    assert entry.is_prefill and entry.samples
    assert entry.num_cached_tokens == 0 and out.num_prefix_hit_tokens == 0


def test_each_full_block_is_hashed_once(monkeypatch) -> None:
    """A waiting prompt is not re-hashed each step it waits, and a running request hashes only
    the blocks its new tokens fill."""
    from pdscope.engine import block_pool

    calls = []
    real = block_pool.block_hash
    monkeypatch.setattr(block_pool, "block_hash", lambda p, t: calls.append(1) or real(p, t))
    s = make(blocks=6, budget=64, seqs=1)  # one running at a time: the second waits
    first = make_request("first", list(range(8)), max_tokens=9)  # grows to 16 tokens, 4 blocks
    waiting = make_request("waiting", list(range(100, 108)), max_tokens=1)
    s.add(first)
    s.add(waiting)
    for _ in range(20):
        run_step(s)
        if waiting.is_finished:
            break
    assert first.is_finished and waiting.is_finished
    # first: 4 full blocks over its life; waiting: 2 full blocks. Each hashed exactly once.
    assert len(first.block_hashes) == 4 and len(waiting.block_hashes) == 2
    assert len(calls) == 6


def test_block_hashes_grow_with_tokens_and_survive_preemption() -> None:
    s = make(budget=64)
    r = make_request("r", list(range(10)), max_tokens=8)
    s.add(r)
    run_step(s)
    first_two = list(r.block_hashes)
    assert len(first_two) == 2  # 10 prompt tokens: 2 full blocks of 4
    for _ in range(6):
        run_step(s)
    assert len(r.block_hashes) == r.num_computed_tokens // 4
    assert r.block_hashes[:2] == first_two
    assert r.token_ids == r.prompt_token_ids + r.output_token_ids


def test_a_block_skipped_for_its_twin_is_published_later() -> None:
    """Two requests compute the same prefix in one step: only one copy can hold each hash. When
    that copy is evicted, the other request's identical block must still become findable."""
    pool = BlockPool(12, 4)
    s = Scheduler(SchedulerConfig(64, 8, 64), pool)
    prompt = list(range(9))
    a, b = make_request("a", prompt, max_tokens=1), make_request("b", prompt, max_tokens=30)
    s.add(a)
    s.add(b)
    run_step(s)  # a finishes; its two full blocks hold the hashes, b's twins do not
    assert a.is_finished and [pool.blocks[x].hash is None for x in b.block_table[:2]] == [
        True,
        True,
    ]
    taken = pool.allocate(pool.num_free_blocks)  # pressure evicts a's cached blocks
    pool.free(taken)
    for _ in range(4):  # b fills another block: every full block of b is offered again
        run_step(s)
    c = make_request("c", prompt, max_tokens=1)
    s.add(c)
    out = run_step(s)
    (entry,) = [e for e in out.scheduled if e.request is c]
    assert entry.num_cached_tokens == 8  # b's copy of the prefix serves c


def test_a_recomputation_that_ends_on_the_last_sampled_token_is_a_decode() -> None:
    """Preempted after it sampled, re-admitted with every block but its tail cached: the one
    token left is the last sampled one, so the entry is a decode (one query over a cached
    context), and it is not counted as a prefix-cache hit."""
    s = make(blocks=8, budget=64)
    r = make_request("r", list(range(7)), max_tokens=5)
    s.add(r)
    run_step(s)  # 7 prompt tokens computed, 1 sampled: 8 tokens, 2 full blocks once computed
    run_step(s)  # the sampled token is computed: blocks 0-1 full and published
    assert r.num_tokens == 9 and r.num_computed_tokens == 8
    s.running.remove(r)
    s._preempt(r)  # as the scheduler does when the pool runs short
    out = run_step(s)
    (entry,) = out.scheduled
    assert (entry.start, entry.num_new_tokens) == (8, 1)
    assert not entry.is_prefill and entry.samples and entry.num_cached_tokens == 0


def test_blocks_are_handed_out_ascending_once_the_pool_has_wrapped() -> None:
    """A pool that has handed out and taken back every block holds freed tables reversed (a
    prefix's tail is evicted before its head): an allocation still takes the blocks the queue
    offers first, least recently freed first, but lays them out ascending, so a prompt's keys
    lie forwards in memory (the decode attention reads descending blocks at less than half
    the rate: bench/decode_ops_ab.py --block-order)."""
    pool = BlockPool(16, 4)
    for size in (6, 10):  # two tables, freed as finished requests free them
        pool.free(pool.allocate(size))
    offered = list(pool.free_queue)[:9]
    assert offered[:6] == [5, 4, 3, 2, 1, 0]  # the first table's blocks, reversed
    taken = pool.allocate(9)
    assert taken == sorted(offered) == [0, 1, 2, 3, 4, 5, 13, 14, 15]
    assert list(pool.free_queue) == [12, 11, 10, 9, 8, 7, 6]
    pool.check_invariants()


def test_a_table_that_grows_takes_the_free_block_after_its_last() -> None:
    """Once the pool has wrapped, a table that grows a block at a time (a decode) takes the
    block right after its last where that block is free and holds no hash, so it stays one
    ascending run; a neighbour that holds a hash is left to the LRU order (taking it would
    evict a cached prefix early)."""
    pool = BlockPool(16, 4, enable_prefix_caching=False)
    for size in (6, 10):
        pool.free(pool.allocate(size))  # the queue: 5 .. 0, then 15 .. 6
    table = pool.allocate(2)
    assert table == [4, 5]
    for _ in range(3):
        table += pool.allocate(1, table[-1])
    assert table == [4, 5, 6, 7, 8]  # in queue order: 4, 5, 3, 2, 1
    table += pool.allocate(3, table[-1])
    assert table == [4, 5, 6, 7, 8, 9, 10, 11]
    pool.check_invariants()

    cached = BlockPool(16, 4)
    for size in (6, 10):
        ids = cached.allocate(size)
        cached.register_full_blocks(ids, [bytes([i]) * 16 for i in ids])
        cached.free(ids)
    table = cached.allocate(2)
    assert table == [4, 5] and cached.blocks[6].hash is not None
    table += cached.allocate(1, table[-1])
    assert table == [4, 5, 3]  # 6 holds a hash: the least recently freed block instead
    cached.check_invariants()


def test_a_decode_in_a_wrapped_pool_keeps_its_blocks_in_one_ascending_run() -> None:
    """The scheduler passes a table's last block when it grows: a request that decodes many
    blocks' worth of tokens in a wrapped pool (prefix caching off) holds consecutive blocks,
    where the queue's order would have handed it 47, 46, 45, ..."""
    pool = BlockPool(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(256, 8, 256), pool)
    for rid, prompt_len in (("a", 200), ("b", 56)):  # blocks 0-49, then 50-63
        done = make_request(rid, list(range(100, 100 + prompt_len)), max_tokens=1)
        s.add(done)
        while not done.is_finished:
            run_step(s)
    assert list(pool.free_queue)[:3] == [49, 48, 47]
    r = make_request("r", list(range(8)), max_tokens=56)
    s.add(r)
    longest = 0
    while not r.is_finished:
        run_step(s)
        table = r.block_table  # emptied once the request finishes
        assert table == list(range(table[0], table[0] + len(table))) if table else r.is_finished
        longest = max(longest, len(table))
    assert longest == 16  # 48 .. 63


def two_finished_requests() -> tuple[BlockPool, list[bytes], list[bytes]]:
    """A pool of exactly 4 blocks holding two finished 2-block prompts, a's freed before b's.

    Free queue afterwards, least recently freed first: a's tail, a's head, b's tail, b's head.
    """
    pool = BlockPool(4, 4)
    s = Scheduler(SchedulerConfig(64, 8, 64), pool)
    hashes = []
    for rid, first in (("a", 0), ("b", 100)):
        r = make_request(rid, list(range(first, first + 8)), max_tokens=1)
        s.add(r)
        run_step(s)
        assert r.is_finished
        hashes.append(r.block_hashes[:2])
    assert pool.counts() == (0, 4, 0)
    return pool, hashes[0], hashes[1]


def test_lru_evicts_the_least_recently_freed_cached_block_first() -> None:
    pool, a, b = two_finished_requests()
    pool.allocate(2)
    assert pool.find_cached_prefix(a, 9) == []
    assert len(pool.find_cached_prefix(b, 9)) == 2


def test_a_freed_request_loses_its_tail_block_before_its_head() -> None:
    pool, a, b = two_finished_requests()
    pool.allocate(1)
    # The head survives (it serves more future prompts); a's chain now stops after one block.
    assert len(pool.find_cached_prefix(a, 9)) == 1
    assert len(pool.find_cached_prefix(b, 9)) == 2


def test_reset_prefix_cache_forgets_every_block_but_only_while_none_is_held() -> None:
    pool, a, b = two_finished_requests()
    held = pool.allocate(1)
    assert not pool.reset_prefix_cache()  # a request holds a block: nothing forgotten
    assert len(pool.find_cached_prefix(b, 9)) == 2
    pool.free(held)
    assert pool.reset_prefix_cache()
    assert pool.find_cached_prefix(a, 9) == pool.find_cached_prefix(b, 9) == []
    assert pool.counts() == (pool.num_blocks, 0, 0)
    pool.check_invariants()


def test_cached_blocks_are_evicted_lru() -> None:
    s = make(blocks=8)
    s.add(make_request("a", list(range(8)), max_tokens=1))  # 2 full blocks cached
    run_step(s)
    assert s.pool.counts() == (6, 2, 0)
    big = make_request("b", list(range(100, 128)), max_tokens=1)  # needs 7+ blocks
    s.add(big)
    run_step(s)
    assert len(s.pool.cached) <= 8
    s.pool.check_invariants()


def test_full_pool_makes_requests_wait_then_preempts_the_newest() -> None:
    s = make(blocks=6, budget=64)
    a = make_request("a", list(range(8)), max_tokens=30)
    b = make_request("b", list(range(20, 28)), max_tokens=30)
    c = make_request("c", list(range(40, 48)), max_tokens=30)
    for r in (a, b, c):
        s.add(r)
    run_step(s)
    # 2 blocks each for a and b leaves 2; c needs 2+ (8 tokens + growth) -> admitted or waits.
    assert a.status is Status.RUNNING and b.status is Status.RUNNING
    preempted = []
    for _ in range(20):
        out = run_step(s)
        preempted += out.preempted
    assert preempted, "growing requests must preempt when the pool is full"
    assert all(p is not a for p in preempted[:1])  # the oldest is not the first victim
    assert s.num_preemptions == len(preempted)
    assert preempted[0].timeline.preemptions >= 1


def test_abort_frees_everything() -> None:
    s = make()
    a = make_request("a", list(range(10)), max_tokens=50)
    s.add(a)
    run_step(s)
    held = len(a.block_table)
    assert held and s.pool.num_used_blocks == held
    s.finish(a, "abort")
    assert s.pool.num_used_blocks == 0 and not s.running
    waiting = make_request("w", [1, 2, 3])
    s.add(waiting)
    s.finish(waiting, "abort")
    assert not s.waiting
    s.pool.check_invariants()


def test_double_free_is_caught() -> None:
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(blocks)


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    s = make(
        blocks=40,
        budget=rng.choice([8, 16, 64]),
        seqs=rng.choice([2, 4, 16]),
        caching=rng.random() < 0.7,
    )
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    live: list[Request] = []
    for step in range(300):
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [
                rng.randrange(1000) for _ in range(rng.randrange(1, 30))
            ]
            r = make_request(f"r{step}", prompt, max_tokens=rng.randrange(1, 20))
            s.add(r)
            live.append(r)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            if not victim.is_finished:
                s.finish(victim, "abort")
        out = run_step(s, token=rng.randrange(1000))
        assert out.num_tokens <= s.config.max_num_batched_tokens
        for r in s.running:
            assert len(r.block_table) * 4 >= r.num_computed_tokens
    while s.has_work:
        run_step(s)
    assert s.pool.num_used_blocks == 0
    free, cached_free, used = s.pool.counts()
    assert free + cached_free == s.pool.num_blocks and used == 0
    assert all(r.is_finished for r in live)


def test_publishing_reports_the_leading_run_of_published_blocks() -> None:
    """register_full_blocks returns how many leading blocks are published, so the scheduler can
    start the next offer past them; a block whose twin holds its hash stops the run there."""
    pool = BlockPool(8, 4)
    hashes = pool.extend_hashes([], list(range(12)))
    first = pool.allocate(3)
    assert pool.register_full_blocks(first, hashes) == 3
    second = pool.allocate(3)
    # The twin copies: the hashes are taken, so none of these blocks is published.
    assert pool.register_full_blocks(second, hashes) == 0
    assert pool.register_full_blocks(second, hashes, 0, stop=1) == 0
    pool.free(first)
    pool.allocate(pool.num_free_blocks)  # evicts the first copy's hashes
    assert pool.register_full_blocks(second, hashes, 0, stop=2) == 2
    assert [pool.blocks[b].hash is not None for b in second] == [True, True, False]
    pool.check_invariants()


def runs(table: list[int]) -> int:
    """How many runs of consecutive block ids ``table`` is made of."""
    return 1 + sum(1 for a, b in itertools.pairwise(table) if b != a + 1)


def long_prompt_tables(pool: BlockPool, rounds: int = 4) -> list[list[int]]:
    """engine_bench's pattern in miniature: a batch of short prompts decoding together (their
    tables grow a block at a time, interleaved), then one long prompt, every round with fresh
    tokens, in a pool that wraps every round. Returns the long prompt's table each round."""
    s = Scheduler(SchedulerConfig(256, 64, 512), pool)
    tables = []
    for r in range(rounds):
        batch = [
            make_request(f"b{r}-{i}", [10_000 * r + 100 * i + t for t in range(9)], max_tokens=40)
            for i in range(32)
        ]
        for request in batch:
            s.add(request)
        while not all(request.is_finished for request in batch):
            run_step(s)
        long = make_request(f"l{r}", [10_000 * r + 5_000 + t for t in range(400)], max_tokens=8)
        s.add(long)
        table: list[int] = []
        while not long.is_finished:
            run_step(s)
            table = list(long.block_table) or table
        tables.append(table)
    assert s.num_preemptions == 0  # the batch fits: its tables grew side by side throughout
    return tables


def test_a_long_prompt_after_interleaved_decodes_gets_few_runs() -> None:
    """A batch decoding together interleaves its tables' blocks; once they are freed, the
    least recently freed blocks are scattered, and a long prompt given them in order (sorted)
    lay in a run every 1.4-1.7 blocks here: the decode attention reads such a table at
    ~0.6-0.7x the rate of one run (docs/performance.md). Grown as runs from the queue's oldest
    blocks, the same prompt's table is half as many runs or fewer (in engine_bench's rounds,
    with larger chunks and a larger pool: 5-16 runs of ~250 blocks where strict LRU gave up
    to ~165)."""
    grown = [runs(t) for t in long_prompt_tables(BlockPool(420, 4))]
    strict = [runs(t) for t in long_prompt_tables(BlockPool(420, 4, grow_runs=False))]
    assert all(n >= 55 for n in strict[1:]), strict
    assert all(2 * g <= s for g, s in zip(grown[1:], strict[1:], strict=True)), (grown, strict)


def test_a_prefix_freed_lately_survives_a_run_grown_beside_it() -> None:
    """Runs grow only through the queue's older half: a prefix freed lately (one place past
    the half) beside the least recently freed block is not swept into its run, though it is
    that block's only free neighbour; strict LRU would not take it either."""
    pool = BlockPool(40, 4)
    held = pool.allocate(40)
    assert held == list(range(40))
    hashes = [bytes([i]) * 16 for i in range(2)]
    pool.register_full_blocks([11, 12], hashes)
    # The queue, least recently freed first: 10, 20-37 (the older half, 19 of 39), then the
    # prefix 11-12, then the rest; block 9 stays held, so 10's only free neighbour is 11.
    for block_id in [10, *range(20, 38), 11, 12, 38, 39, *range(9), *range(13, 20)]:
        pool.free([block_id])
    assert len(pool.free_queue) == 39 and list(pool.free_queue)[19] == 11
    taken = pool.allocate(3)
    assert taken == [10, 20, 21]  # as strict LRU takes them: the three least recently freed
    assert pool.find_cached_prefix(hashes, 9) == [11, 12]
    pool.check_invariants()


@pytest.mark.parametrize("seed", range(20))
def test_allocation_takes_only_from_the_window(seed: int) -> None:
    """Random allocations, extensions, publications and frees: every block taken is the run
    after ``after`` (free blocks with no hash, or the window's) or one of the queue's oldest
    max(count, min(8 x count, queued // 2)); the run comes first, the rest ascending."""
    rng = random.Random(seed)
    pool = BlockPool(64, 4)
    tables: list[list[int]] = []
    for _ in range(300):
        free = pool.num_free_blocks
        if tables and (free == 0 or rng.random() < 0.4):
            table = tables.pop(rng.randrange(len(tables)))
            if rng.random() < 0.7:
                pool.register_full_blocks(table, [rng.randbytes(16) for _ in table])
            pool.free(table)
        elif free:
            count = rng.randint(1, min(free, 20))
            extend = tables and rng.random() < 0.5
            table = tables.pop(rng.randrange(len(tables))) if extend else []
            queue = list(pool.free_queue)
            window = set(queue[: max(count, min(8 * count, len(queue) // 2))])
            no_hash = {b for b in queue if pool.blocks[b].hash is None}
            new = pool.allocate(count, table[-1] if table else None)
            assert len(new) == len(set(new)) == count
            grown = 0
            while table and grown < count and new[grown] == table[-1] + 1 + grown:
                assert new[grown] in window | no_hash
                grown += 1
            rest = new[grown:]
            assert rest == sorted(rest) and set(rest) <= window
            tables.append(table + new)
        pool.check_invariants()
