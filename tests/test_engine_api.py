"""The engine's public surfaces: sampling options, stops, timelines, async streaming, errors."""

import asyncio
import math
import os
from pathlib import Path

import pytest

from pdscope import LLM, SamplingParams
from pdscope.checkpoint.make_model import make_model
from pdscope.engine.async_engine import AsyncEngine
from pdscope.engine.llm_engine import EngineArgs, LLMEngine, parse_bytes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "m", "tiny", dtype="float32")


# The kernels as the trial picks them, and decode steps forced through the C kernels' one
# call, whose greedy rows take the argmax it returns unless a request needs the sampler
# (temperature, a seed, a stop id held back by min_tokens).
@pytest.fixture(scope="module", params=["auto", "linear=c,decode_ops=c"])
def llm(tiny: Path, request: pytest.FixtureRequest) -> LLM:
    if request.param != "auto":
        from pdscope.checkpoint.make_model import default_cache_dir
        from pdscope.engine import native

        if native.load(default_cache_dir() / "native") is None:
            pytest.skip("the C kernels did not build here")
    return LLM(model=str(tiny), kv_cache_memory="8MiB", max_model_len=512, kernels=request.param)


PROMPT = "Prefill reads the prompt and decode writes one token per step."


def test_greedy_is_deterministic_and_top_k_1_is_greedy(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    a, b = llm.generate([PROMPT, PROMPT], greedy)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 10
    top1 = llm.generate(
        PROMPT, SamplingParams(max_tokens=10, temperature=0.8, top_k=1, ignore_eos=True)
    )[0]
    assert top1.token_ids == a.token_ids


def test_seeded_sampling_is_reproducible_in_any_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].token_ids
    noisy = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    batched = llm.generate([PROMPT, "other text", PROMPT], [params, noisy, params])
    assert batched[0].token_ids == alone and batched[2].token_ids == alone
    other = llm.generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True)
    )[0].token_ids
    assert other != alone


def test_stop_strings_and_stop_tokens(llm: LLM) -> None:
    free = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    cut = llm.generate(
        PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    token = free.token_ids[4]
    by_id = llm.generate(
        PROMPT,
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[token]),
    )[0]
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(token) + 1]
    held = llm.generate(
        PROMPT,
        SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[token], min_tokens=8
        ),
    )[0]
    assert len(held.token_ids) >= 8
    # A stop string completed before min_tokens is ignored, as a stop id is: the text keeps it
    # (a stream has already sent it). Here the 5th token completes it and min_tokens is 6, so
    # the first token that may stop sees it just behind its own text (which cut it before).
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    five = llm.generate(PROMPT, SamplingParams(**{**vars(greedy), "max_tokens": 5}))[0].text
    early = five[-3:]
    assert len(five) >= 3 and five.index(early) == len(five) - 3
    late = llm.generate(
        PROMPT, SamplingParams(**{**vars(greedy), "stop": [early], "min_tokens": 6})
    )[0]
    assert late.text.startswith(five)
    assert free.text.startswith(late.text) and len(late.token_ids) >= 6


def test_max_tokens_and_max_model_len(tiny: Path) -> None:
    llm = LLM(model=str(tiny), kv_cache_memory="8MiB", max_model_len=64)
    prompt = list(range(10, 60))
    out = llm.generate(prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 64
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(list(range(10, 80)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([10**6], SamplingParams())


def test_timeline_records_every_phase(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    t = out.timeline
    assert t.prompt_tokens == len(out.prompt_token_ids)
    assert t.arrival_s <= t.first_scheduled_s <= t.first_token_s <= t.finished_s
    assert len(t.token_s) == 6 and t.token_s == sorted(t.token_s)
    assert sum(n for _, n in t.prefill_chunks) == t.prompt_tokens - t.num_cached_tokens
    assert t.finish_reason == "length" and len(t.itl_s) == 5
    assert t.ttft_s == pytest.approx(t.queue_s + t.prefill_s)
    steps = list(llm.engine.steps)
    assert steps and all(0 <= s.kv_cache_usage <= 1 and s.duration_s >= 0 for s in steps)
    assert sum(s.prefill_tokens for s in steps) >= t.prompt_tokens


def test_the_step_log_keeps_the_last_records_and_no_object_for_the_collector() -> None:
    import gc

    from pdscope.engine.timeline import StepLog, StepRecord

    log = StepLog(maxlen=3)
    assert len(log) == 0 and list(log) == []
    records = [StepRecord(0.5 + i, 0.75 + i, i, 2, i / 8, 64 * i, 3, i % 2, 7) for i in range(5)]
    for r in records:
        log.append(r)
    assert len(log) == 3 and list(log) == records[2:]  # oldest first, equal as appended
    assert log[0] == records[2] and log[-1] == records[4] and log[-3] == records[2]
    with pytest.raises(IndexError):
        log[3]
    with pytest.raises(IndexError):
        log[-4]
    log.clear()
    assert len(log) == 0 and list(log) == []
    log.append(records[0])
    assert list(log) == records[:1]

    # what the log holds is no tracked object: a full collection has nothing of it to walk
    def tracked_records() -> int:
        gc.collect()
        return sum(type(o) is StepRecord for o in gc.get_objects())

    before = tracked_records()
    big = StepLog(maxlen=10_000)
    for i in range(10_000):
        big.append(StepRecord(float(i), i + 1.0, 1, 0, 0.5, 0, 1, 0))
    assert tracked_records() <= before
    assert len(big) == 10_000 and big[-1].start_s == 9_999.0


def test_bad_engine_arguments(tiny: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(tiny), kv_cache_memory="64KiB", max_model_len=512)
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("1.5MB") == 1_500_000
    with pytest.raises(FileNotFoundError):
        LLM(model=str(tiny / "missing"))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    # on a CPU the pool is kv_cache_memory: a GPU share was accepted and changed nothing
    with pytest.raises(ValueError, match="gpu_memory_utilization applies on CUDA only"):
        LLM(model=str(tiny), gpu_memory_utilization=0.5, device="cpu")


def test_a_pool_that_cannot_serve_fails_before_the_weights_or_the_trials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 7B model's default pool (1 GiB: 2,048 of its 4,096 tokens) was refused only after the
    load and the kernel trials, a minute in. Its size is asked, so one request's blocks are
    counted before any weight is read (here the weights cannot be read at all); a pool larger
    than the memory left by the weights is refused before the trials build the C kernels or
    time a path (the cache they write stays empty)."""
    path = make_model(tmp_path / "m", "tiny", dtype="float32")
    (path / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ValueError, match=r"one request of max_model_len 512 needs 32 blocks"):
        LLM(model=str(path), kv_cache_memory="64KiB", max_model_len=512)
    with pytest.raises(ValueError, match="gpu_memory_utilization applies on CUDA only"):
        LLM(model=str(path), gpu_memory_utilization=0.5, device="cpu")
    from pdscope.engine.model import available_memory_bytes

    if available_memory_bytes() is None:
        return  # no reading of the memory available here: nothing to refuse against
    path = make_model(tmp_path / "m2", "tiny", dtype="float32")
    cache = tmp_path / "cache"
    monkeypatch.setenv("PDSCOPE_CACHE", str(cache))
    with pytest.raises(ValueError, match="more than the"):
        LLM(model=str(path), kv_cache_memory="1024TiB")
    assert not cache.exists() or not any(cache.iterdir()), list(cache.rglob("*"))


FREED = """
import torch
from pdscope.engine.malloc import release_freed_memory
def anon_mb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1e3
big = torch.ones(30 << 18)  # 30 MiB (under glibc's 32 MiB cap): mapped, and freed, it
del big  # raises glibc's mapping threshold past the chunks below
held = [torch.ones(5 << 18) for _ in range(60)]  # 300 MiB in heap chunks
before = anon_mb()
last = held[-1]  # the heap's top stays in use, so freeing the rest trims nothing by itself
del held
freed = anon_mb()
print(release_freed_memory(), before - freed, before - anon_mb())
"""


def test_freed_heap_memory_goes_back_to_the_system() -> None:
    """An uncached start of a 7B-shaped model left 1.25 GB its trials and one-call check had
    freed resident in glibc's heap (the engine built at 16.8-17.0 GB, 15.5 cached); the
    engine hands it back before sizing its pool."""
    import subprocess
    import sys

    if not Path("/proc/self/status").is_file():
        pytest.skip("no /proc/self/status (not Linux)")
    # glibc's own heap, its threshold moving: no other allocator preloaded, no malloc settings
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "LD_PRELOAD" and not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))
    }
    run = subprocess.run(
        [sys.executable, "-c", FREED], capture_output=True, text=True, check=True, env=env
    )
    released, by_free_mb, by_trim_mb = run.stdout.split()
    if released != "True":
        pytest.skip("the C library has no malloc_trim (not glibc)")
    assert float(by_free_mb) < 100 and float(by_trim_mb) > 250, run.stdout


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    import json
    import shutil

    path = make_model(tmp_path / "m", "tiny", dtype="float32")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(path))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    (path / "model.safetensors").unlink()
    config["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="safetensors"):
        LLM(model=str(path))


def test_async_streaming_concurrency_and_abort(tiny: Path) -> None:
    engine = LLMEngine(EngineArgs(model=str(tiny), kv_cache_memory="8MiB", max_model_len=512))
    aengine = AsyncEngine(engine)

    async def collect(max_tokens: int) -> tuple[list[int], str | None]:
        tokens: list[int] = []
        reason = None
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for out in aengine.generate(PROMPT, params):
            tokens += out.new_token_ids
            reason = out.finish_reason
        return tokens, reason

    async def main() -> None:
        (a, ra), (b, rb) = await asyncio.gather(collect(5), collect(9))
        assert len(a) == 5 and len(b) == 9 and ra == rb == "length"
        assert b[:5] == a  # same prompt, greedy: the streams agree
        stream = aengine.generate(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True))
        async for _ in stream:
            break  # a client that goes away
        await stream.aclose()
        with pytest.raises(ValueError, match="empty"):
            async for _ in aengine.generate([], SamplingParams()):
                pass
        state = await aengine.call(lambda: (engine.pool.num_used_blocks, engine.has_unfinished()))
        assert state == (0, False)
        engine.pool.check_invariants()

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()
    assert not aengine.is_running


def test_the_server_builds_its_engine_on_the_thread_that_steps_it(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GNU OpenMP gives each thread that starts a parallel region its own team; with two teams
    in a 2-core process (the engine loaded on the main thread, stepped on another) every
    barrier of a step slept in the kernel and served batch-1 decode took 1.1-1.3x the TPOT
    it has in process. The server's engine is built, warmed and stepped on one thread, and a
    build that fails raises its own error to the caller."""
    import threading

    from pdscope.server import run

    built: set[int] = set()
    stepped: set[int] = set()

    class Recorded(LLMEngine):
        def __init__(self, args: EngineArgs) -> None:
            built.add(threading.get_ident())
            super().__init__(args)

        def step(self):  # type: ignore[no-untyped-def]
            stepped.add(threading.get_ident())
            return super().step()

    monkeypatch.setattr(run, "LLMEngine", Recorded)
    args = EngineArgs(model=str(tiny), kv_cache_memory="8MiB", max_model_len=512)
    aengine = run.start_engine(args, None)
    try:

        async def one() -> None:
            async for _ in aengine.generate(PROMPT, SamplingParams(max_tokens=3)):
                pass

        asyncio.run(one())
    finally:
        aengine.shutdown()
    assert built == stepped == {aengine._thread.ident}
    assert threading.get_ident() not in built
    with pytest.raises(FileNotFoundError):
        run.start_engine(EngineArgs(model=str(tiny / "absent")), None)


def test_one_failing_request_fails_alone(tiny: Path) -> None:
    engine = LLMEngine(EngineArgs(model=str(tiny), kv_cache_memory="8MiB", max_model_len=512))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    bad = engine.add_request(PROMPT, params, "bad")
    good = engine.add_request(PROMPT + " more", params, "good")

    def explode(token: int) -> str:
        raise RuntimeError("detokenizer broke")

    engine.detokenizers["bad"].add = explode  # type: ignore[method-assign]
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    failed = [o for o in outputs if o.request_id == "bad"]
    assert failed[-1].finished and failed[-1].finish_reason == "abort"
    assert "detokenizer broke" in failed[-1].error
    assert bad.is_finished and len(good.output_token_ids) == 5
    assert good.finish_reason == "length" and engine.pool.num_used_blocks == 0


def test_sampler_and_request_validation(llm: LLM) -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    for t in (math.inf, math.nan):
        with pytest.raises(ValueError, match="finite"):
            SamplingParams(temperature=t)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(PROMPT, SamplingParams(stop_token_ids=[10**9], min_tokens=2))
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    tiny_t = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1e-9, ignore_eos=True))
    assert tiny_t[0].token_ids == greedy[0].token_ids  # no overflow into NaN


def test_min_tokens_masks_every_stop_id(llm: LLM) -> None:
    import torch

    from pdscope.engine.request import Request
    from pdscope.engine.timeline import RequestTimeline

    stop_ids = frozenset(llm.tokenizer.stop_token_ids)
    assert len(stop_ids) >= 2  # eos from tokenizer_config plus generation_config's list
    request = Request(
        "r",
        [5, 6],
        SamplingParams(max_tokens=5, temperature=0, min_tokens=3),
        RequestTimeline(0.0),
        stop_token_ids=stop_ids,
    )
    for stop in stop_ids:
        logits = torch.zeros(1, llm.tokenizer.vocab_size)
        logits[0, stop] = 10.0
        token = llm.engine.runner.sample(logits, [request])[0]
        assert token not in stop_ids


def test_a_reader_that_falls_behind_holds_a_bounded_backlog(tiny: Path) -> None:
    """A consumer that reads nothing while 300 tokens are made finds at most MAX_PENDING
    outputs, the last holding every token past them, and the whole text, not 300 queued
    outputs each carrying the text so far (memory that grew with the square of the output
    behind a stalled client); a consumer that reads as it goes sees one output per token."""
    from pdscope.engine.async_engine import OutputSlot

    engine = LLMEngine(EngineArgs(model=str(tiny), kv_cache_memory="8MiB", max_model_len=512))
    aengine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)

    async def main() -> None:
        stalled = await aengine.add(PROMPT, params)
        while await aengine.call(engine.has_unfinished):  # the whole output made, unread
            await asyncio.sleep(0.02)
        outs = [out async for out in stalled]
        assert len(outs) == OutputSlot.MAX_PENDING and outs[-1].finished
        assert len(outs[-1].new_token_ids) == 300 - (OutputSlot.MAX_PENDING - 1)
        tokens = [t for out in outs for t in out.new_token_ids]
        assert tokens == outs[-1].token_ids and len(tokens) == 300
        assert outs[-1].text == engine.tokenizer.decode(outs[-1].token_ids)
        read: list[int] = []
        async for out in aengine.generate(PROMPT, params):
            read += out.new_token_ids
        assert read == outs[-1].token_ids

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()


def test_abort_all_ends_every_stream_and_admits_nothing_after(tiny: Path) -> None:
    """A server shutting down: every request in flight ends with finish reason "abort" and the
    text it had, and a request that arrives afterwards (one still being tokenized) is refused
    instead of running to its max_tokens."""
    from pdscope.engine.async_engine import EngineDeadError, OutputSlot
    from pdscope.engine.llm_engine import RequestOutput

    engine = LLMEngine(EngineArgs(model=str(tiny), kv_cache_memory="8MiB", max_model_len=512))
    aengine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def main() -> None:
        streams = [await aengine.add(PROMPT, params) for _ in range(2)]
        first = await streams[0].__anext__()
        aengine.abort_all()
        last = [[out async for out in s][-1] for s in streams]
        assert all(out.finish_reason == "abort" and out.finished for out in last)
        assert len(last[0].token_ids) < 400 and last[0].text.startswith(first.text)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await aengine.add(PROMPT, params)
        assert await aengine.call(lambda: engine.pool.num_used_blocks) == 0

        # An error put behind an undelivered output comes after it, not in its place.
        slot = OutputSlot()
        request = last[0].request
        slot.put(RequestOutput("r", [1, 2], "ab", False, None, request))
        slot.put(EngineDeadError("engine shut down"))
        assert (await slot.get()).new_token_ids == [1, 2]
        assert isinstance(await slot.get(), EngineDeadError)

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()


def test_step_failure_fails_its_requests_and_the_engine_lives(tiny: Path) -> None:
    engine = LLMEngine(EngineArgs(model=str(tiny), kv_cache_memory="8MiB", max_model_len=512))
    aengine = AsyncEngine(engine)
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("kernel exploded")
        return real(out)

    engine.runner.execute = flaky  # type: ignore[method-assign]

    async def main() -> None:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        outs = [out async for out in aengine.generate(PROMPT, params)]
        assert outs[-1].finished and "kernel exploded" in outs[-1].error
        again = [out async for out in aengine.generate(PROMPT, params)]
        assert again[-1].finish_reason == "length" and len(again[-1].token_ids) == 4
        assert await aengine.call(lambda: engine.pool.num_used_blocks) == 0

    try:
        asyncio.run(main())
        assert aengine.is_running
    finally:
        aengine.shutdown()


def test_detokenizer_when_the_prompt_ends_mid_character(llm: LLM) -> None:
    from pdscope.engine.tokenizer import IncrementalDetokenizer

    tok = llm.tokenizer
    ids = tok.encode("naïve テキスト café ☕ ok")
    full = tok.decode(ids)
    for cut in range(1, len(ids)):
        det = IncrementalDetokenizer(tok, ids[:cut])
        text = "".join(det.add(t) for t in ids[cut:])
        assert tok.decode(ids[:cut]).rstrip("\ufffd") + text == full, cut


def test_qwen_sliding_window_is_refused(tmp_path: Path) -> None:
    path = make_model(tmp_path / "q", "tiny", arch="qwen2", dtype="float32", sliding_window=8)
    with pytest.raises(ValueError, match="sliding-window"):
        LLM(model=str(path))


def test_serve_sets_a_short_openmp_spin_before_torch_loads_unless_told(tiny: Path) -> None:
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: `pdscope serve` sets its count
    before anything imports torch (a fresh process, as the CLI starts), from the model's config:
    10,000 for the small model, 1,000 for a test model, whose steps are too short to spin
    through; and leaves a count or wait policy the user gave alone."""
    import os
    import subprocess
    import sys

    script = (
        "import os, sys, types\n"
        "import pdscope.commands.serve as s\n"
        "seen = {}\n"
        "def fake(*a, **k): seen['spin'] = os.environ.get('GOMP_SPINCOUNT'); "
        "seen['torch'] = 'torch' in sys.modules\n"
        "r = types.ModuleType('pdscope.server.run')  # the server, not loaded: no torch\n"
        "r.serve = fake\n"
        "sys.modules['pdscope.server.run'] = r\n"
        "s.serve(s.EngineArgs(model=sys.argv[1]), s.ServeSettings())\n"
        "print(seen['spin'], seen['torch'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    cases = (
        ("small", {}, "10000"),
        (str(tiny), {}, "1000"),
        ("small", {"GOMP_SPINCOUNT": "5"}, "5"),
        (str(tiny / "nowhere"), {}, "10000"),  # no config to read: the load will say why
    )
    for model, extra, expected in cases:
        done = subprocess.run(
            [sys.executable, "-c", script, model],
            env={**env, **extra},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        spin, torch_loaded = done.stdout.split()
        assert spin == expected and torch_loaded == "False", done.stdout
