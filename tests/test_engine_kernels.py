"""Kernel choice by measurement (engine/kernels.py): parsing, the trial, its cache, the forced
paths, the decode math candidates against a float32 reference, and /metrics' build info.

The greedy-equality and logits tests of test_engine.py run over every forced path; these
check the machinery that picks one."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from pdscope import LLM, SamplingParams
from pdscope.checkpoint.make_model import make_model
from pdscope.engine import malloc, native
from pdscope.engine.kernels import (
    OPTIONS,
    TIE,
    KernelChoice,
    TrialShapes,
    choose,
    cpu_flags,
    pairs_preferred,
    parse_kernels,
    read_gauge_gb_s,
)
from pdscope.engine.model import (
    C_PATH_MAX_RUNS,
    MAX_DECODE_RUNS,
    MIN_KEYS_PER_RUN,
    Attention,
    AttentionBatch,
    Linear,
    ModelConfig,
    RMSNorm,
    _flash_cpu,
    apply_kernels,
    apply_rope,
    block_rows,
    can_decode_in_place,
    can_pack,
    slot_runs,
    thread_cpus,
)
from tests.conftest import OTHER_BUILDS, build_for, fresh_cache, seed_native, steady_host

SHAPES = TrialShapes("bfloat16", 64, 128, 256, 2, 4, 2, 16, 32)


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("k") / "tiny", "tiny", dtype="bfloat16")


def test_parse_kernels_names_the_bad_part() -> None:
    assert parse_kernels("auto") == {}
    assert parse_kernels(" linear=plain , decode_math=auto ") == {"linear": "plain"}
    with pytest.raises(ValueError, match="prefill_attention cannot be 'flash'"):
        parse_kernels("prefill_attention=flash")
    with pytest.raises(ValueError, match="'matmul=fast' is not path=option"):
        parse_kernels("matmul=fast")
    with pytest.raises(ValueError, match="'sdpa' is not path=option"):
        parse_kernels("sdpa")


def test_bad_kernels_fail_the_engine_and_the_cli(tiny_bf16: Path) -> None:
    with pytest.raises(ValueError, match="linear cannot be 'fast'"):
        LLM(model=str(tiny_bf16), kernels="linear=fast")
    proc = subprocess.run(
        [sys.executable, "-m", "pdscope.cli", "serve", "--model", str(tiny_bf16)]
        + ["--kernels", "linear=fast", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "linear cannot be 'fast'" in proc.stderr


def test_pdscope_march_builds_another_cpus_kernels_and_says_so(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """$PDSCOPE_MARCH=x86-64: the engine runs the portable loops (what a CPU without AVX2
    builds) and says so in its log and build_info; a target the compiler refuses, or a value
    that cannot be one, fails the load by the variable's name rather than quietly running the
    PyTorch path in its place."""
    from pdscope.server.metrics import EngineMetrics

    if platform.machine() not in ("x86_64", "AMD64") or native.compiler() is None:
        pytest.skip("x86-64 is an x86 target, built with a C compiler")
    monkeypatch.setenv("PDSCOPE_MARCH", "x86-64")
    forced = "linear=c,batch_linear=c,prefill_attention=sdpa,decode_ops=c"
    with caplog.at_level("INFO", logger="pdscope.engine"):
        llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels=forced)
    ops = llm.engine.runner.model.native
    assert ops is not None and ops.linear_isa == "portable" and not ops.pairs
    assert llm.engine.c_march == "x86-64"
    assert any("C kernels -march=x86-64" in r.getMessage() for r in caplog.records)
    text = generate_latest(EngineMetrics(llm.engine, "tiny").registry).decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("pdscope:build_info{"))
    assert 'c_march="x86-64"' in line
    assert f'torch_isa="{torch.backends.cpu.get_cpu_capability()}"' in line
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))[0].token_ids

    monkeypatch.setenv("PDSCOPE_MARCH", "no-such-cpu")
    with pytest.raises(ValueError, match=r"PDSCOPE_MARCH=no-such-cpu: .*could not build"):
        LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels=forced)
    monkeypatch.setenv("PDSCOPE_MARCH", "x86-64 -O0")
    with pytest.raises(ValueError, match="is not a -march target"):
        LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels=forced)
    # a target above this CPU would build and load, then stop the process at its first kernel
    above = next((t for t in ("x86-64-v4", "sapphirerapids") if native.missing_features(t)), None)
    if above is not None:
        monkeypatch.setenv("PDSCOPE_MARCH", above)
        lacking = ", ".join(native.missing_features(above))
        with pytest.raises(ValueError, match=f"needs {lacking}, which this CPU lacks"):
            LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels=forced)
    assert native.missing_features("x86-64") == []
    env = {**os.environ, "PDSCOPE_MARCH": "no-such-cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "pdscope.cli", "serve", "--model", str(tiny_bf16), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0 and "PDSCOPE_MARCH=no-such-cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_outcomes_measured_under_another_isa_are_cached_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trial's winners and a step check's pass depend on the ISAs torch, oneDNN and the C
    kernels keep to: each variable that narrows one gives another cache key."""
    from pdscope.engine.kernels import machine_key

    for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "PDSCOPE_MARCH"):
        monkeypatch.delenv(var, raising=False)
    keys = {machine_key(trial=1)}
    monkeypatch.setenv("PDSCOPE_MARCH", "x86-64-v3")
    keys.add(machine_key(trial=1))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    keys.add(machine_key(trial=1))
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    keys.add(machine_key(trial=1))
    assert len(keys) == 4
    assert machine_key(trial=1) == machine_key(trial=1)
    # "native", however written, is the unset variable's key
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "PDSCOPE_MARCH"):
        monkeypatch.delenv(var)
    unset = machine_key(trial=1)
    monkeypatch.setenv("PDSCOPE_MARCH", " native ")
    assert machine_key(trial=1) == unset


def test_trial_picks_the_faster_candidate_and_caches_it(tmp_path: Path) -> None:
    calls: list[str] = []

    def candidate(name: str, seconds: float):
        def run() -> None:
            calls.append(name)
            time.sleep(seconds)

        return run

    def trials():
        return {
            "prefill_attention": lambda: {
                "blocked": candidate("blocked", 0.02),
                "sdpa": candidate("sdpa", 0.0),
            }
        }

    first = choose(trials(), {}, SHAPES, tmp_path, read_memory=steady_host)
    assert first.prefill_attention == "sdpa"
    assert first.how == {
        "linear": "fixed",
        "batch_linear": "fixed",
        "big_batch_linear": "fixed",
        "prefill_linear": "fixed",
        "matmul_math": "fixed",
        "prefill_attention": "measured",
        "decode_math": "fixed",
        "decode_ops": "fixed",
        "decode_prefetch": "fixed",
        "threads": "fixed",
        "step_rows": "fixed",
        "heap": "fixed",
    }
    assert set(first.trial_s) == {"prefill_attention=blocked", "prefill_attention=sdpa"}
    # Interleaved: after the warm-ups, the candidates alternate.
    assert calls[2:6] == ["blocked", "sdpa", "blocked", "sdpa"]
    (cache_file,) = tmp_path.glob("*.json")
    record = json.loads(cache_file.read_text())
    assert record["prefill_attention"] == "sdpa" and record["flags"] == cpu_flags()

    calls.clear()
    second = choose(trials(), {}, SHAPES, tmp_path, read_memory=steady_host)
    assert second.prefill_attention == "sdpa" and second.how["prefill_attention"] == "cached"
    assert calls == []  # a cached choice runs no trial

    forced = choose(trials(), {"prefill_attention": "blocked"}, SHAPES, tmp_path)
    assert forced.prefill_attention == "blocked" and forced.how["prefill_attention"] == "forced"
    assert calls == []

    # Other shapes are another cache entry; a damaged entry is measured again and rewritten.
    other = TrialShapes(**{**SHAPES.__dict__, "prefill_tokens": 64})
    assert other.cache_key() != SHAPES.cache_key()
    cache_file.write_text("{not json")
    again = choose(trials(), {}, SHAPES, tmp_path)
    assert again.how["prefill_attention"] == "measured"
    assert json.loads(cache_file.read_text())["prefill_attention"] == "sdpa"


def test_a_tied_trial_keeps_the_preferred_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within TIE of the fastest, ``prefer``'s candidate is kept; further behind, or absent
    from the trial, it is not. The trial's medians are set here, so that the rule is tested
    and not the host's timer; the rule by ISA it serves: pairs2 in AVX-512 BF16, pairs in
    AVX2."""
    medians_s: dict[str, float] = {}
    monkeypatch.setattr(
        "pdscope.engine.kernels.median_times_s", lambda candidates, **_: dict(medians_s)
    )

    def pick(prefer: dict[str, str] | None) -> str:
        trials = {"linear": lambda: dict.fromkeys(medians_s, lambda: None)}
        choice = choose(trials, {}, SHAPES, None, prefer=prefer)
        assert choice.how["linear"] == "measured"
        return choice.linear

    medians_s.update(c=0.0130, pairs=0.0100, pairs2=0.0100 * (1 + TIE * 0.9))
    assert pick(None) == "pairs"
    assert pick({"linear": "pairs2"}) == "pairs2"  # a tie
    assert pick({"linear": "pairs"}) == "pairs"
    assert pick({"linear": "amx"}) == "pairs"  # not in this trial
    medians_s["pairs2"] = 0.0100 * (1 + TIE * 1.1)
    assert pick({"linear": "pairs2"}) == "pairs"  # behind by more than TIE
    medians_s.update(c=0.0100, pairs=0.0200, pairs2=0.0101)
    assert pick({"linear": "pairs2"}) == "pairs2"  # within TIE of whichever is fastest
    assert pairs_preferred("avx512_bf16") == "pairs2" and pairs_preferred("avx2") == "pairs"
    assert pairs_preferred("") == "pairs"


def test_a_path_with_a_preference_is_timed_more_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trial stops once its budget is spent, after two rounds, or after PREFERRED_ROUNDS
    where the path has a preferred candidate (decided by a few percent)."""
    from pdscope.engine.kernels import PREFERRED_ROUNDS

    calls = {"a": 0, "b": 0}

    def counted(name: str) -> Callable[[], None]:
        def run() -> None:
            calls[name] += 1

        return run

    trials = {"linear": lambda: {n: counted(n) for n in calls}}
    for prefer, rounds in ((None, 2), ({"linear": "b"}, PREFERRED_ROUNDS)):
        calls.update(a=0, b=0)
        choose(trials, {}, SHAPES, None, budget_s=0.0, prefer=prefer)
        assert calls == {"a": 1 + rounds, "b": 1 + rounds}  # one warm-up each


@pytest.mark.parametrize("behind", [0.9, 1.1])
def test_prefill_linear_keeps_onednn_unless_the_copy_wins_by_more_than_a_tie(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, behind: float
) -> None:
    """The engine's trial keeps prefill_linear=onednn (no copy) while it times within TIE of
    the transposed copy, and holds no copy then; further behind, the copy is chosen and
    held. The trial's medians are set here (onednn behind every other candidate by
    ``behind`` TIE, the pairs copies out of every path's margins, so that the decode paths
    keep the packed weights), so that the engine's preference is tested and not the host's
    timer."""
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN packed weights in this torch")
    from pdscope.engine import model as model_module

    fresh_cache(tmp_path, monkeypatch)
    monkeypatch.setattr(
        "pdscope.engine.kernels.median_times_s",
        lambda candidates, **_: {
            n: 1.0 + TIE * behind * (n == "onednn") + 0.5 * (n == "pairs") for n in candidates
        },
    )
    rows = model_module.ROWS_SPLIT_MIN_ROWS
    llm = LLM(
        model=str(tiny_bf16), kv_cache_memory="8MiB", max_model_len=2 * rows,
        max_num_batched_tokens=rows,
    )  # fmt: skip
    choice = llm.engine.kernels
    assert choice.how["prefill_linear"] == "measured"
    assert choice.prefill_linear == ("onednn" if behind < 1 else "transposed")
    layers = [m for m in llm.engine.runner.model.layers.modules() if isinstance(m, Linear)]
    assert all((m.weight_t is None) == (behind < 1) for m in layers)


def test_a_preference_may_follow_the_picks_before_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A callable ``prefer`` entry names its candidate from the picks of the paths before
    its own (in OPTIONS' order), and the tie rule then applies to that name; a cached pick
    is weighed again from the cached times, so a start whose earlier picks differ gets the
    pick it would have measured."""
    medians_s = {"onednn": 0.0100, "pairs": 0.0100 * (1 + TIE * 0.5)}
    monkeypatch.setattr(
        "pdscope.engine.kernels.median_times_s", lambda candidates, **_: dict(medians_s)
    )
    seen: list[dict[str, str]] = []

    def liked(picks: dict[str, str]) -> str:
        seen.append(picks)
        return "pairs" if picks.get("linear") == "pairs2" else "onednn"

    trials = {"prefill_linear": lambda: dict.fromkeys(medians_s, lambda: None)}
    prefer = {"prefill_linear": liked}
    for linear, pick in (("pairs2", "pairs"), ("packed", "onednn")):
        choice = choose(trials, {"linear": linear}, SHAPES, None, prefer=prefer)
        assert choice.prefill_linear == pick and seen[-1]["linear"] == linear
    # (one load throughout: a quieter start would measure again)
    steady = {"load": 1.0, "read_memory": steady_host, "prefer": prefer}
    choose(trials, {"linear": "pairs2"}, SHAPES, tmp_path, **steady)  # pairs
    for linear, pick in (("packed", "onednn"), ("pairs2", "pairs")):
        choice = choose(trials, {"linear": linear}, SHAPES, tmp_path, **steady)
        assert (choice.prefill_linear, choice.how["prefill_linear"]) == (pick, "cached")


def test_a_choice_made_on_a_busy_host_is_measured_again_when_quieter(tmp_path: Path) -> None:
    """Under load the slower candidate can win the trial; a quieter start measures again and
    replaces it, a start as busy or busier keeps the cache."""
    slow = {"blocked": 0.0, "sdpa": 0.02}  # the busy host's view: blocked wins

    def trials():
        return {
            "prefill_attention": lambda: {
                name: (lambda name=name: time.sleep(slow[name])) for name in slow
            }
        }

    def start(load: float) -> KernelChoice:
        return choose(trials(), {}, SHAPES, tmp_path, load=load, read_memory=steady_host)

    busy = start(2.5)
    assert busy.prefill_attention == "blocked"
    (cache_file,) = tmp_path.glob("*.json")
    assert json.loads(cache_file.read_text())["load_per_core"] == 2.5
    slow.update(blocked=0.02, sdpa=0.0)  # the truth, seen when quiet
    assert start(2.2).how["prefill_attention"] == "cached"
    quiet = start(0.4)
    assert quiet.prefill_attention == "sdpa" and quiet.how["prefill_attention"] == "measured"
    record = json.loads(cache_file.read_text())
    assert record["prefill_attention"] == "sdpa" and record["load_per_core"] == 0.4
    assert start(0.3).how["prefill_attention"] == "cached"


def test_a_choice_made_while_the_host_read_memory_slowly_is_measured_again(
    tmp_path: Path,
) -> None:
    """A neighbour on the physical host slows memory without raising this one's load: a
    trial records the slower of the readings around it, and a start that reads FASTER_BY
    times faster measures again; a slower or as fast start, or one whose gauge could not
    read, keeps the cache. A path measured beside cached ones keeps their reading where it
    is the slower."""
    from pdscope.engine.kernels import FASTER_BY

    slow = {"blocked": 0.0, "sdpa": 0.02}  # the slow stretch's view: blocked wins
    readings: list[float | None] = []

    def read() -> float | None:
        return readings.pop(0)

    def trials(paths: tuple[str, ...] = ("prefill_attention",)) -> dict:
        return {
            path: lambda: {name: (lambda name=name: time.sleep(slow[name])) for name in slow}
            for path in paths
        }

    def start(*gauge: float | None, paths: tuple[str, ...] = ("prefill_attention",)):
        readings[:] = gauge
        choice = choose(trials(paths), {}, SHAPES, tmp_path, load=1.0, read_memory=read)
        assert readings == []  # every reading given was taken, no more
        return choice, json.loads(next(tmp_path.glob("*.json")).read_text())

    # no cache yet: a reading before the trial and one after, the slower recorded
    choice, record = start(12.0, 10.0)
    assert (choice.prefill_attention, record["read_gb_s"]) == ("blocked", 10.0)
    slow.update(blocked=0.02, sdpa=0.0)  # the truth, seen at the host's usual speed
    # one reading per cached start; below FASTER_BY (or unread) the cache stands
    for now in (9.0, 10.0 * FASTER_BY * 0.98, None):
        choice, record = start(now)
        assert choice.how["prefill_attention"] == "cached" and record["read_gb_s"] == 10.0
    choice, record = start(10.0 * FASTER_BY, 13.0)
    assert (choice.prefill_attention, choice.how["prefill_attention"]) == ("sdpa", "measured")
    assert record["read_gb_s"] == 12.5
    # a new path measured beside the cached one: the slower of its readings and the cache's
    choice, record = start(14.0, 15.0, paths=("prefill_attention", "decode_math"))
    assert choice.how["prefill_attention"] == "cached"
    assert choice.how["decode_math"] == "measured" and record["read_gb_s"] == 12.5
    # every path forced: nothing to measure, no reading (read() pops from an empty list)
    readings.clear()
    choose(trials(), {"prefill_attention": "sdpa"}, SHAPES, tmp_path, load=1.0, read_memory=read)


def test_the_read_gauge_reads_this_host(tmp_path: Path) -> None:
    """The gauge a cached choice is held against reads this machine's memory (a positive,
    finite rate), and a trial with a cache records it."""
    gauge_gb_s = read_gauge_gb_s()
    assert gauge_gb_s is not None and 0.1 < gauge_gb_s < 10_000
    trials = {"prefill_attention": lambda: {"blocked": lambda: None, "sdpa": lambda: None}}
    choose(trials, {}, SHAPES, tmp_path, load=1.0)
    (cache_file,) = tmp_path.glob("*.json")
    assert 0.1 < json.loads(cache_file.read_text())["read_gb_s"] < 10_000


def test_engine_logs_applies_and_reports_its_choice(
    tiny_bf16: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from pdscope.server.metrics import EngineMetrics

    forced = (
        "linear=plain,batch_linear=packed,big_batch_linear=onednn,prefill_linear=onednn,"
        "matmul_math=float32,"
        "prefill_attention=sdpa,decode_math=native,decode_ops=torch,decode_prefetch=jumps,"
        f"threads=free,step_rows=exact,heap={'settled' if malloc.is_glibc() else 'default'}"
    )
    with caplog.at_level("INFO", logger="pdscope.engine"):
        llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels=forced)
    choice = llm.engine.kernels
    assert (choice.linear, choice.prefill_attention, choice.decode_math) == (
        "plain",
        "sdpa",
        "native",
    )
    assert all(how == "forced" for how in choice.how.values())
    assert any("prefill_attention=sdpa (forced)" in r.getMessage() for r in caplog.records)
    model = llm.engine.runner.model
    assert all(a.prefill_sdpa and not a.decode_float32 for a in _attentions(model))
    assert all(m.packed is None for m in model.modules() if hasattr(m, "packed"))

    text = generate_latest(EngineMetrics(llm.engine, "tiny").registry).decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("pdscope:build_info{"))
    assert 'linear="plain"' in line and 'prefill_attention="sdpa"' in line
    assert 'decode_math="native"' in line and 'decode_ops="torch"' in line
    assert 'threads="free"' in line and 'batch_linear="packed"' in line
    assert 'prefill_linear="onednn"' in line and 'matmul_math="float32"' in line
    assert 'decode_prefetch="jumps"' in line and 'step_rows="exact"' in line
    assert 'big_batch_linear="onednn"' in line
    assert f'heap="{choice.heap}"' in line
    assert 'decode_step="per_kernel"' in line  # decode_ops=torch: no one C call
    assert all(m.widen for m in model.modules() if hasattr(m, "widen"))
    assert all(m.team is None and m.weight_t is None for m in model.modules() if hasattr(m, "team"))
    assert all(m.native_many is None for m in model.modules() if hasattr(m, "native_many"))
    assert all(m.big_batch is None for m in model.modules() if hasattr(m, "big_batch"))
    assert line.endswith(" 1.0")


def test_auto_measures_every_path_that_has_two_candidates(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, steady_gauge: None
) -> None:
    fresh_cache(tmp_path, monkeypatch)
    llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", max_model_len=256)
    choice = llm.engine.kernels
    expected = {"prefill_attention", "decode_math"}
    if torch.backends.mkldnn.is_available() or native.compiler():
        expected.add("linear")
    if native.compiler():
        expected.add("decode_ops")
        # oneDNN's packed weights, or where it has no bf16 path the widened matmul, against C
        expected.add("batch_linear")
        ops = llm.engine._native
        if ops is not None and ops.pairs_rows:  # ... and against the copies from 33 rows
            expected.add("big_batch_linear")
    # threads=bound is never chosen by a trial (it stalled a live server's streams): only forced
    assert choice.threads == "free" and choice.how["threads"] == "fixed"
    assert {p for p, how in choice.how.items() if how == "measured"} == expected
    for path in OPTIONS:
        assert getattr(choice, path) in OPTIONS[path]
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 1
    again = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", max_model_len=256).engine.kernels
    assert {p for p, how in again.how.items() if how == "cached"} == expected
    assert again == choice


def test_the_trials_fit_a_model_of_few_positions(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The decode trial ran at 256 tokens of context: on a model whose rope table holds 64
    positions, start-up failed with an IndexError."""
    from pdscope.checkpoint.make_model import make_model

    fresh_cache(tmp_path, monkeypatch)
    short = make_model(tmp_path / "short", "tiny", max_position_embeddings=64)
    llm = LLM(model=str(short), kv_cache_memory="8MiB")
    assert llm.engine.kernels.how["decode_math"] == "measured"
    out = llm.generate("hi", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")
def test_prefill_linear_is_measured_at_prefill_size_with_two_threads(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """prefill_linear has a trial where chunks reach ROWS_SPLIT_MIN_ROWS rows and the weights
    can be packed: oneDNN's path, the transposed copy and, where the C kernels have the pairs
    kernels for several rows, the pairs copies timed (the split by rows never, even with the
    C kernels and two threads: forced only), the winner applied."""
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN packed weights in this torch")
    from pdscope.engine.model import ROWS_SPLIT_MIN_ROWS

    fresh_cache(tmp_path, monkeypatch)
    others = (
        "linear=c,batch_linear=packed,big_batch_linear=onednn,prefill_attention=sdpa,"
        "decode_math=native,decode_ops=c"
    )
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(
            model=str(tiny_bf16),
            kv_cache_memory="8MiB",
            max_model_len=2 * ROWS_SPLIT_MIN_ROWS,
            max_num_batched_tokens=ROWS_SPLIT_MIN_ROWS,
            kernels=others,
        )
    finally:
        torch.set_num_threads(saved)
    choice = llm.engine.kernels
    assert choice.how["prefill_linear"] == "measured"
    ops = native.load(tmp_path / "native")
    offered = (
        "onednn",
        "transposed",
        *(("pairs",) if ops and ops.pairs_rows else ()),
        *(("plain",) if ops and ops.linear_many_isa == "amx" else ()),  # the weight as stored
    )
    assert set(choice.trial_s) == {f"prefill_linear={o}" for o in offered}
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if hasattr(m, "team") and m is not model.lm_head]
    copied = choice.prefill_linear == "transposed"
    assert all(m.team is None for m in layers)
    assert all((m.weight_t is not None) == copied for m in layers)
    assert all((m.many_rows is not None) == (choice.prefill_linear == "pairs") for m in layers)


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")
def test_prefill_linear_rows_alone_loads_the_c_kernels(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """prefill_linear=rows runs its shares on the C kernels' team: forced with every other
    C path forced off, the kernels still load and every layer matmul gets the team."""
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN packed weights in this torch")
    fresh_cache(tmp_path, monkeypatch)
    llm = LLM(
        model=str(tiny_bf16),
        kv_cache_memory="8MiB",
        max_model_len=256,
        kernels="linear=packed,batch_linear=packed,big_batch_linear=onednn,decode_ops=torch,"
        "threads=free,prefill_linear=rows,prefill_attention=sdpa,decode_math=native",
    )
    model = llm.engine.runner.model
    layers = [m for m in model.layers.modules() if hasattr(m, "team")]
    assert layers and all(m.team is not None and m.weight_t is not None for m in layers)


def test_forcing_an_option_that_runs_on_c_loads_the_c_kernels(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An option that runs on the C kernels, forced with every other path off them, loads the
    kernels: batch_linear=pairs, linear=pairs and prefill_attention=c were refused as "not
    given by this CPU" on a CPU that gives them (big_batch_linear=pairs alike)."""
    fresh_cache(tmp_path, monkeypatch)
    ops = native.load(tmp_path / "native")
    if ops is None or not ops.pairs_rows or not ops.prefill_vec:
        pytest.skip("no AVX-512 BF16 in this build of the C kernels")
    off = {
        "decode_ops": "torch",
        "linear": "packed",
        "batch_linear": "packed",
        "big_batch_linear": "onednn",
        "threads": "free",
    }
    for path, option in (
        ("batch_linear", "pairs"),
        ("big_batch_linear", "pairs"),
        ("linear", "pairs"),
        ("linear", "pairs2"),
        ("prefill_attention", "c"),
    ):
        spec = ",".join(f"{p}={o}" for p, o in {**off, path: option}.items())
        llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels=spec)
        assert getattr(llm.engine.kernels, path) == option, spec


@pytest.mark.parametrize("build", [None, "x86-64"])
@pytest.mark.parametrize("option", ["pairs", "pairs2"])
def test_pairs_linear_without_the_c_kernels_is_refused_by_its_name(
    tiny_bf16: Path, option: str, build: str | None, request: pytest.FixtureRequest
) -> None:
    """Pointing a model at linear=pairs or pairs2 with no C kernels, or with a build that has
    neither AVX-512 BF16 nor AVX2, names the option asked for, and changes nothing."""
    ops = None if build is None else build_for(build, _factory(request))
    llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels="linear=packed")
    model = llm.engine.runner.model
    with pytest.raises(ValueError, match=f"linear={option} needs the C kernels built with AVX"):
        apply_kernels(model, KernelChoice(linear=option, decode_ops="torch"), ops)
    assert not any(getattr(m, "one_row_pairs", False) for m in model.modules())


def test_pairs_are_offered_to_the_linear_trial_only_while_their_copy_fits(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """linear=pairs, batch_linear=pairs and big_batch_linear=pairs keep a copy of every weight:
    the trials measure them beside the other single-row and many-row paths while that copy fits
    in TRANSPOSED_COPY_MAX_SHARE of the free memory, and leave them out (and allocate none) when
    it would not."""
    from pdscope.engine import model as model_module

    fresh_cache(tmp_path, monkeypatch)
    llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB")
    model = llm.engine.runner.model
    ops = native.load(tmp_path / "native")
    if ops is None or not ops.pairs_rows:
        pytest.skip("neither AVX-512 BF16 nor AVX2 in this build of the C kernels")
    trials = model_module.kernel_trials(model, 64, ops)
    linear = trials["linear"]()
    assert {"pairs", "pairs2"} <= set(linear) and "pairs" in trials["batch_linear"]()
    # with AMX tiles, the weight as stored too (no copy: offered whatever the memory)
    stored = {"c"} if ops.linear_many_isa == "amx" else set()
    assert set(trials["big_batch_linear"]()) == {"onednn", "pairs"} | stored
    made: list[object] = []
    monkeypatch.setattr(model_module, "pairs_copy", lambda *a: made.append(a))
    monkeypatch.setattr(model_module, "TRANSPOSED_COPY_MAX_SHARE", 0.0)
    assert not model_module.pairs_copy_fits(model)
    trials = model_module.kernel_trials(model, 64, ops)
    assert not {"pairs", "pairs2"} & set(trials["linear"]())
    assert "pairs" not in trials["batch_linear"]()
    if stored:
        assert set(trials["big_batch_linear"]()) == {"onednn", "c"}
    else:
        assert "big_batch_linear" not in trials  # its only other candidate is the copies
    assert not made


def test_the_linear_trials_read_whole_layers_up_to_a_bound_and_the_head_in_their_share(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A model whose weights pass _TRIAL_STREAM_BYTES is timed on its first layers, whole,
    until they pass it, and on the LM head's first rows in the share those layers are of all
    of them (a view of the head's weight, nothing copied); a model within it, on every weight
    as it stands. prefill_linear's trial cuts layer 0's weights alike. Every candidate of the
    cut trials runs."""
    from pdscope.engine import model as model_module

    fresh_cache(tmp_path, monkeypatch)
    llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB")
    model = llm.engine.runner.model
    every = [m for m in model.modules() if isinstance(m, Linear)]
    assert [id(m) for m in model_module._trial_linears(model)] == [id(m) for m in every]
    assert [id(m) for m in model_module._prefill_trial_linears(model)] == [
        id(m) for m in model.layers[0].modules() if isinstance(m, Linear)
    ]

    monkeypatch.setattr(model_module, "_TRIAL_STREAM_BYTES", 1)  # one layer passes it
    monkeypatch.setattr(model_module, "_PREFILL_TRIAL_BYTES", 1)
    linears = model_module._trial_linears(model)
    layer0 = [m for m in model.layers[0].modules() if isinstance(m, Linear)]
    assert [id(m) for m in linears[:-1]] == [id(m) for m in layer0]
    head, cut = model.lm_head, linears[-1]
    assert len(model.layers) == 2 and head.out_features == 1024
    assert cut is not head and tuple(cut.weight.shape) == (512, head.in_features)
    assert cut.weight.data_ptr() == head.weight.data_ptr()
    # the least share of each of layer 0's weights: a tile of rows and its part tile
    assert [tuple(m.weight.shape) for m in model_module._prefill_trial_linears(model)] == [
        (min(m.out_features, 64 + m.out_features % 64), m.in_features) for m in layer0
    ]
    ops = native.load(tmp_path / "native")
    for trial in model_module.kernel_trials(model, model_module.ROWS_SPLIT_MIN_ROWS, ops).values():
        for run in trial().values():
            run()


def test_first_rows_keeps_a_weights_part_tile_and_its_storage() -> None:
    """A cut weight ends in the part tile its weight ends in (so one whose rows take no pairs
    copy, not a multiple of 16, takes none in the trial either), and is the first rows of
    the weight itself."""
    from pdscope.engine import model as model_module

    m = Linear(64, 1000, bias=True).to(torch.bfloat16)
    cut = model_module._first_rows(m, 0.1)
    assert tuple(cut.weight.shape) == (2 * 64 + 1000 % 64, 64)  # 100 rows: two tiles, + 40
    assert cut.weight.shape[0] % 16 == m.out_features % 16 != 0
    assert cut.weight.data_ptr() == m.weight.data_ptr()
    assert torch.equal(cut.bias, m.bias[: cut.out_features])
    assert model_module._first_rows(m, 0.99) is m
    m.huge_pages = True  # a view of a weight on huge pages is on them too
    assert model_module._first_rows(m, 0.1).huge_pages


def test_the_decode_linear_trials_share_one_set_of_pairs_copies(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """linear, batch_linear and big_batch_linear time the same matmuls: the pairs copies a
    trial needs are made once, for the first of them, not once each."""
    from pdscope.engine import model as model_module

    fresh_cache(tmp_path, monkeypatch)
    # no copies held (prefill_linear=pairs would hold them)
    off = "linear=packed,batch_linear=packed,big_batch_linear=onednn,prefill_linear=onednn"
    llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels=off)
    model = llm.engine.runner.model
    ops = native.load(tmp_path / "native")
    if ops is None or not ops.pairs_rows:
        pytest.skip("neither AVX-512 BF16 nor AVX2 in this build of the C kernels")
    made: list[torch.Tensor] = []
    copy = model_module.pairs_copy

    def counted(weight: torch.Tensor, native_ops: object) -> torch.Tensor | None:
        made.append(weight)
        return copy(weight, native_ops)

    monkeypatch.setattr(model_module, "pairs_copy", counted)
    trials = model_module.kernel_trials(model, 64, ops)
    for path in ("linear", "batch_linear", "big_batch_linear"):
        assert "pairs" in trials[path]()
    assert len(made) == len(model_module._trial_linears(model)) > 0


def test_the_trials_c_kernels_read_the_weights_on_huge_pages_as_the_engine_streams_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """apply_kernels moves a weight the C kernels stream onto huge pages, and the pairs copies
    are made there: the trials' C-kernel candidates read a copy there too, never the weight
    on ordinary pages (where the AMX Xeon's one-row many-row kernel took 1.11x the time)."""
    from pdscope.engine import model as model_module

    if not model_module.huge_pages_offered():
        pytest.skip("Linux offers no transparent huge pages here")
    fresh_cache(tmp_path, monkeypatch)
    ops = native.load(tmp_path / "native")
    if ops is None:
        pytest.skip("the C kernels did not build here")
    # weights of 2 MiB and more (a huge page); kernels that stream none of them
    path = make_model(
        tmp_path / "m", "tiny", dtype="bfloat16", hidden_size=1024, intermediate_size=2048,
        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
    )  # fmt: skip
    off = "linear=packed,batch_linear=packed,big_batch_linear=onednn,prefill_linear=onednn"
    model = LLM(model=str(path), kv_cache_memory="8MiB", kernels=off).engine.runner.model
    linears = model_module._trial_linears(model)
    big = {m.weight.data_ptr() for m in linears if m.weight.nbytes >= 2 << 20}
    assert big and not any(m.huge_pages for m in linears)

    class Reading:  # the kernels, noting the weight each call reads
        def __init__(self) -> None:
            self.read: list[int] = []

        def __getattr__(self, name: str) -> object:
            return getattr(ops, name)

        def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
            self.read.append(w.data_ptr())
            return ops.linear(x, w, b)

        def linear_many(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
            self.read.append(w.data_ptr())
            return ops.linear_many(x, w, b)

    reading = Reading()
    trials = model_module.kernel_trials(model, 64, reading)  # type: ignore[arg-type]
    for path_name, names in (
        ("linear", ("c", "amx")),
        ("batch_linear", ("c",)),
        ("big_batch_linear", ("c",)),  # offered with AMX tiles
    ):
        if path_name not in trials:
            continue
        candidates = trials[path_name]()
        for name in names:
            if name not in candidates:
                continue
            reading.read.clear()
            candidates[name]()
            assert len(reading.read) == len(linears), (path_name, name)
            big_reads = [ptr for ptr in reading.read if ptr not in big]
            assert not set(reading.read) & big, (path_name, name)  # never the weight itself
            assert sum(ptr % (2 << 20) == 0 for ptr in big_reads) >= len(big)


@pytest.mark.parametrize("linear", ["packed", "c"])
def test_each_weight_is_packed_once_for_the_path_chosen(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, linear: str
) -> None:
    """The loader leaves the weights unpacked: apply_kernels packs each once, laid out for
    the rows its path gives oneDNN (one under linear=packed, many under linear=c), where a
    pack at load was redone under the C kernels (moved to huge pages, or another layout)."""
    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN packed weights in this torch")
    from pdscope.engine import model as model_module

    fresh_cache(tmp_path, monkeypatch)
    if linear == "c" and native.load(tmp_path / "native") is None:
        pytest.skip("the C kernels did not build here")
    packs: list[tuple[int, int]] = []
    pack = Linear.pack

    def counted(self: Linear, rows: int = 1) -> None:
        packs.append((id(self), rows))
        pack(self, rows)

    monkeypatch.setattr(Linear, "pack", counted)
    kernels = f"linear={linear},batch_linear=packed,big_batch_linear=onednn,prefill_linear=onednn"
    llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels=kernels)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    rows = model_module.PACKED_ROWS_WITH_C if linear == "c" else 1
    assert sorted(packs) == sorted((id(m), rows) for m in linears)
    assert all(m.packed is not None and m.packed_rows == rows for m in linears)


@pytest.mark.parametrize("batch_linear", ["auto", "packed"])
def test_prefill_linear_pairs_is_kept_in_a_tie_where_it_lets_the_packed_weights_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch_linear: str
) -> None:
    """Where linear, batch_linear and big_batch_linear all read the pairs copies, the engine
    keeps prefill_linear=pairs within TIE of the fastest: then no weight with a copy keeps a
    packed one (a weight whose rows take no copy, the LM head of a 1,000-word vocabulary,
    keeps its own), and steps are not padded. With batch_linear on the packed weights, the
    same trial keeps onednn. The trial's medians are set here (the copies 1.0, transposed
    0.99, the rest 1.01), so that the engine's preference is tested and not the host's timer.
    (Where the C kernels have AMX tiles single rows stay on them, the weight as stored, kept
    within HELD_ONCE_TIE of the copies: the rest as said.)"""
    from pdscope.engine import model as model_module

    fresh_cache(tmp_path, monkeypatch)
    ops = native.load(tmp_path / "native")
    if ops is None or not ops.pairs_rows or not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no pairs kernels for several rows, or no oneDNN bf16, here")
    monkeypatch.setattr(
        "pdscope.engine.kernels.median_times_s",
        lambda candidates, **_: {
            n: 1.0 if n in ("pairs", "pairs2") else 0.99 if n == "transposed" else 1.01
            for n in candidates
        },
    )
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16", vocab_size=1000)
    rows = model_module.ROWS_SPLIT_MIN_ROWS
    llm = LLM(
        model=str(path), kv_cache_memory="8MiB", max_model_len=2 * rows,
        max_num_batched_tokens=rows, kernels=f"batch_linear={batch_linear}",
    )  # fmt: skip
    choice, model = llm.engine.kernels, llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.lm_head.pairs is None and all(m.pairs is not None for m in linears[:-1])
    if batch_linear == "packed":
        assert choice.prefill_linear == "onednn" and choice.step_rows == "padded"
        assert all(m.packed is not None and m.many_rows is None for m in linears)
        return
    # with AMX tiles, single rows on them (the weight as stored, no copy) are kept within
    # HELD_ONCE_TIE: 1.01 against the copies' 1.0
    linear = "amx" if ops.linear_many_isa == "amx" else pairs_preferred(ops.pairs_isa)
    assert (choice.linear, choice.batch_linear, choice.big_batch_linear) == (
        linear, "pairs", "pairs"
    )  # fmt: skip
    assert choice.prefill_linear == "pairs" and choice.how["prefill_linear"] == "measured"
    assert choice.step_rows == "exact" and model.row_bucket == 1
    assert all(m.packed is None for m in linears[:-1]) and model.lm_head.packed is not None
    assert all(m.many_rows is ops for m in linears)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate([list(range(10, 10 + rows - 8))], greedy)[0]  # one chunk past 64 rows
    assert len(out.token_ids) == 4


def _engine_with_a_prefill_trial(tmp_path: Path, kernels: str) -> LLM:
    """A tiny bf16 model's engine whose prefill chunks (ROWS_SPLIT_MIN_ROWS) are long enough
    for prefill_linear's trial."""
    from pdscope.engine.model import ROWS_SPLIT_MIN_ROWS

    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    rows = ROWS_SPLIT_MIN_ROWS
    return LLM(
        model=str(path), kv_cache_memory="8MiB", max_model_len=2 * rows,
        max_num_batched_tokens=rows, kernels=kernels,
    )  # fmt: skip


def _copies_between_the_margins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every trial from here times the pairs copies 1.06x the fastest (between TIE and
    HELD_ONCE_TIE), the transposed copy 1.2x, the rest alike; skips where the pairs kernels
    for several rows or oneDNN's bf16 path are missing. A fresh kernel cache."""
    fresh_cache(tmp_path, monkeypatch)
    ops = native.load(tmp_path / "native")
    if ops is None or not ops.pairs_rows or not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no pairs kernels for several rows, or no oneDNN bf16, here")
    _between_the_margins(monkeypatch, ("pairs",), ("transposed",))


def _between_the_margins(
    monkeypatch: pytest.MonkeyPatch, between: tuple[str, ...], far: tuple[str, ...]
) -> None:
    """Every trial from here times the candidates named in ``between`` 1.06x the fastest
    (between TIE and HELD_ONCE_TIE), those in ``far`` 1.2x, the rest alike."""
    from pdscope.engine.kernels import HELD_ONCE_TIE, TIE

    slower = 1.06
    assert 1 + TIE < slower < 1 + HELD_ONCE_TIE
    monkeypatch.setattr(
        "pdscope.engine.kernels.median_times_s",
        lambda candidates, **_: {
            n: slower if n in between else 1.2 if n in far else 1.0 for n in candidates
        },
    )


@pytest.mark.parametrize(("linear", "kept"), [("pairs2", "pairs"), ("c", "onednn")])
def test_prefill_linear_pairs_that_holds_the_weights_once_is_kept_within_a_wider_tie(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linear: str, kept: str
) -> None:
    """Where single rows read the copies too, prefill_linear=pairs lets every weight be held
    once: kept while it times within HELD_ONCE_TIE of the fastest (set medians: 1.06x
    oneDNN's); under linear=c, which reads the weight, the plain TIE holds (oneDNN kept)."""
    from pdscope.engine import model as model_module

    _copies_between_the_margins(tmp_path, monkeypatch)
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    rows = model_module.ROWS_SPLIT_MIN_ROWS
    llm = LLM(
        model=str(path), kv_cache_memory="8MiB", max_model_len=2 * rows,
        max_num_batched_tokens=rows,
        kernels=f"linear={linear},batch_linear=pairs,big_batch_linear=pairs",
    )  # fmt: skip
    choice = llm.engine.kernels
    assert (choice.prefill_linear, choice.how["prefill_linear"]) == (kept, "measured")
    layers = [m for m in llm.engine.runner.model.layers.modules() if isinstance(m, Linear)]
    assert all(m.held_once == (kept == "pairs") for m in layers)


@pytest.mark.parametrize(
    ("others", "kept"),
    [
        ("batch_linear=pairs", "pairs"),
        ("batch_linear=packed", "onednn"),
        ("batch_linear=pairs,prefill_linear=onednn", "onednn"),
    ],
)
def test_big_batch_linear_pairs_on_the_way_to_holding_weights_once_is_kept_within_a_wider_tie(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, others: str, kept: str
) -> None:
    """With single rows and 2-32 rows on the copies, big_batch_linear=pairs (which, with
    prefill_linear=pairs, lets every weight be held once) is kept within HELD_ONCE_TIE (set
    medians: the copies 1.06x oneDNN's, in every trial); with batch_linear on the packed
    weights, or prefill_linear kept off the copies, the faster one."""

    _copies_between_the_margins(tmp_path, monkeypatch)
    choice = _engine_with_a_prefill_trial(tmp_path, f"linear=pairs2,{others}").engine.kernels
    assert (choice.big_batch_linear, choice.how["big_batch_linear"]) == (kept, "measured")
    if "prefill_linear" not in others:
        assert choice.prefill_linear == kept


@pytest.mark.parametrize(
    ("forced", "kept"),
    [
        ("linear=pairs2", "pairs"),
        ("linear=c", "packed"),
        ("linear=pairs2,big_batch_linear=onednn", "packed"),
        ("linear=pairs2,prefill_linear=onednn", "packed"),
    ],
)
def test_batch_linear_pairs_on_the_way_to_holding_weights_once_is_kept_within_a_wider_tie(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forced: str, kept: str
) -> None:
    """With single rows on the copies, batch_linear=pairs is the first of the three paths
    that let every weight be held once: kept within HELD_ONCE_TIE (set medians: the copies
    1.06x the others' time), and the two after it follow; where single rows read the weight
    (linear=c), or a later path is kept off the copies, the fastest (packed, first of equals).
    Uncached starts of a 1.1B-parameter model had picked packed by noise in 2 of 3, holding
    4.81-5.07 GB in place of 2.78."""
    from pdscope.engine.model import ROWS_SPLIT_MIN_ROWS

    _copies_between_the_margins(tmp_path, monkeypatch)
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    rows = ROWS_SPLIT_MIN_ROWS  # prefill chunks long enough for prefill_linear's trial
    llm = LLM(
        model=str(path), kv_cache_memory="8MiB", max_model_len=2 * rows,
        max_num_batched_tokens=rows, kernels=forced,
    )  # fmt: skip
    choice = llm.engine.kernels
    assert (choice.batch_linear, choice.how["batch_linear"]) == (kept, "measured")
    if kept == "pairs":
        assert (choice.big_batch_linear, choice.prefill_linear) == ("pairs", "pairs")
        layers = [m for m in llm.engine.runner.model.layers.modules() if isinstance(m, Linear)]
        assert all(m.held_once for m in layers)


def test_the_paths_kept_for_holding_once_go_to_the_fastest_where_prefill_does_not_follow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steady_gauge: None
) -> None:
    """batch_linear and big_batch_linear keep the copies within HELD_ONCE_TIE (timed here at
    1.06x the fastest) on the way to prefill_linear=pairs; where prefill_linear's own copies
    time past that margin (1.2x the fastest), no weight can be held once, and both go to their
    fastest: measured, and again from the cache on a second start."""
    from pdscope.engine.kernels import HELD_ONCE_TIE
    from pdscope.engine.model import ROWS_SPLIT_MIN_ROWS

    _copies_between_the_margins(tmp_path, monkeypatch)
    assert 1 + HELD_ONCE_TIE < 1.2
    monkeypatch.setattr(
        "pdscope.engine.kernels.median_times_s",
        lambda candidates, **_: {  # prefill_linear's trial: the one that offers transposed
            n: (1.2 if "transposed" in candidates else 1.06) if n == "pairs" else 1.0
            for n in candidates
        },
    )
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    rows = ROWS_SPLIT_MIN_ROWS
    for how in ("measured", "cached"):
        llm = LLM(
            model=str(path), kv_cache_memory="8MiB", max_model_len=2 * rows,
            max_num_batched_tokens=rows, kernels="linear=pairs2",
        )  # fmt: skip
        choice = llm.engine.kernels
        picks = (choice.batch_linear, choice.big_batch_linear, choice.prefill_linear)
        assert picks == ("packed", "onednn", "onednn"), how
        assert choice.how["batch_linear"] == choice.how["prefill_linear"] == how


def test_prefill_linear_pairs_without_the_pairs_kernels_is_refused_by_its_name(
    tiny_bf16: Path,
) -> None:
    """prefill_linear=pairs reads the pairs copies: without the C kernels the choice is
    refused naming it, and nothing is changed."""
    assert parse_kernels("prefill_linear=pairs") == {"prefill_linear": "pairs"}
    kernels = "linear=packed,prefill_linear=onednn"
    llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels=kernels)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    held = [(m.packed, m.pairs, m.many_rows) for m in linears]
    with pytest.raises(ValueError, match="prefill_linear=pairs needs the C kernels built with"):
        apply_kernels(model, KernelChoice(prefill_linear="pairs", decode_ops="torch"), None)
    assert all(
        m.packed is p and m.pairs is q and m.many_rows is r and r is None
        for m, (p, q, r) in zip(linears, held, strict=True)
    )


def test_prefill_linear_is_not_offered_when_its_copy_would_not_fit(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A model whose transposed copy would take more than TRANSPOSED_COPY_MAX_SHARE of the free
    memory is not measured into a third copy of its weights: no layer holds a transposed copy.
    (The pairs copy does not fit either: where the C kernels have AMX tiles, prefill_linear
    takes oneDNN's matmul on the weight as stored untimed; where the pairs kernels built, the
    copies, each weight held once; else it stays oneDNN's.)"""
    from pdscope.engine import model as model_module

    if not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN packed weights in this torch")
    fresh_cache(tmp_path, monkeypatch)
    rows = model_module.ROWS_SPLIT_MIN_ROWS
    sizes = {"kv_cache_memory": "8MiB", "max_model_len": 2 * rows, "max_num_batched_tokens": rows}
    llm = LLM(model=str(tiny_bf16), **sizes)
    model = llm.engine.runner.model
    assert model_module.transposed_copy_fits(model)  # a tiny model fits anywhere
    assert llm.engine.kernels.how["prefill_linear"] == "measured"
    monkeypatch.setattr(model_module, "TRANSPOSED_COPY_MAX_SHARE", 0.0)
    assert not model_module.transposed_copy_fits(model)
    assert "prefill_linear" not in model_module.kernel_trials(model, rows)
    llm = LLM(model=str(tiny_bf16), **sizes)
    choice = llm.engine.kernels
    ops = llm.engine._native
    held_once = ops is not None and ops.pairs and ops.pairs_rows
    stored = ops is not None and ops.linear_many_isa == "amx"
    expected = (
        ("plain", "memory") if stored else ("pairs", "memory") if held_once else ("onednn", "fixed")
    )
    assert (choice.prefill_linear, choice.how["prefill_linear"]) == expected
    model = llm.engine.runner.model
    assert all(m.weight_t is None for m in model.modules() if hasattr(m, "weight_t"))


@pytest.mark.parametrize(
    ("limit", "capped"),
    [("1000000000", True), ("max", False), ("9223372036854771712", False)],
    ids=["limit", "v2-none", "v1-none"],
)
def test_available_memory_is_capped_by_a_cgroup_limit_v2_or_v1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: str, capped: bool
) -> None:
    """A cgroup's limit less its use caps what MemAvailable says, read from v2's files or,
    where those are absent, v1's; its inactive file pages (the checkpoint just read) are not
    counted as used; "max" (v2) and 2^63 less a page (v1) set none."""
    from pdscope.engine import model as model_module

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000000 kB\nMemAvailable:  4000000 kB\n")
    monkeypatch.setattr(model_module, "_MEMINFO", str(meminfo))
    for version, inactive in (("v2", "inactive_file"), ("v1", "total_inactive_file")):
        folder = tmp_path / version
        folder.mkdir()
        (folder / "limit").write_text(limit + "\n")
        (folder / "used").write_text("500000000\n")
        (folder / "stat").write_text(f"anon 200000000\n{inactive} 300000000\nfile 1\n")
        files = (*(str(folder / n) for n in ("limit", "used", "stat")), inactive)
        missing = (*(str(tmp_path / "none") for _ in range(3)), inactive)
        cgroups = (files, missing) if version == "v2" else (missing, files)
        monkeypatch.setattr(model_module, "_CGROUP_MEMORY", cgroups)
        # the limit less 500 MB used, of which 300 MB inactive file pages
        expected = 800_000_000 if capped else 4_000_000 * 1024
        assert model_module.available_memory_bytes() == expected, version


def _attentions(model: torch.nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def one_layer_config() -> ModelConfig:
    """One small GQA layer (4 query heads over 2 KV heads) for the attention kernels' tests."""
    return ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )


@pytest.mark.parametrize("float32", [True, False])
def test_decode_math_candidates_match_a_float32_reference(float32: bool) -> None:
    """Both decode math paths over a padded, masked batch of 3 bf16 sequences."""
    cfg = one_layer_config()
    attn = Attention(cfg).to(torch.bfloat16)
    attn.decode_float32 = float32
    gen = torch.Generator().manual_seed(0)
    block, blocks, dim = 4, 12, cfg.head_dim
    cache = torch.randn(2, 2, blocks * block, dim, generator=gen).bfloat16()
    lengths = [5, 12, 9]
    table = torch.tensor([[3, 7, 0], [1, 2, 11], [4, 6, 9]])
    mask = torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]
    batch = AttentionBatch(
        torch.zeros(0, dtype=torch.long), block, 3, block_rows(table, 2, blocks), (0, 12), mask, []
    )
    q = torch.randn(3, 4, dim, generator=gen).bfloat16()
    out = attn._decode(q, cache, batch)
    for i, length in enumerate(lengths):
        slots = torch.cat([torch.arange(b * block, (b + 1) * block) for b in table[i]])[:length]
        k, v = cache[0][:, slots].float(), cache[1][:, slots].float()  # [kvh, S, dim]
        qi = q[i].float().view(2, 2, dim)  # query heads grouped by KV head
        probs = (qi @ k.transpose(-1, -2) * attn.scale).softmax(-1)
        ref = (probs @ v).reshape(4, dim)
        torch.testing.assert_close(out[i].float(), ref, atol=2e-2, rtol=2e-2)


def test_slot_runs_merge_adjacent_blocks() -> None:
    assert slot_runs([5, 6, 7], 0, 40, 16) == [(80, 40)]
    assert slot_runs([5, 2, 3, 9], 0, 60, 16) == [(80, 16), (32, 32), (144, 12)]
    assert slot_runs([5, 2, 3], 20, 40, 16) == [(36, 20)]  # a window starting mid-block


@pytest.mark.parametrize(
    "table",
    [[3, 4, 5, 6, 7], [3, 4, 9, 1, 2], list(range(20, 10, -2))[:5]],
    ids=["one-run", "three-runs", "five-runs"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_sequence_decode_in_place_matches_the_gather(
    table: list[int], dtype: torch.dtype
) -> None:
    """The in-place paths (one strided view; several merged by log-sum-exp) against the gather
    path and a float32 reference, for a context ending mid-block."""
    cfg = one_layer_config()
    attn = Attention(cfg).to(dtype)
    gen = torch.Generator().manual_seed(1)
    block, blocks, dim, length = 256, 24, cfg.head_dim, 1200  # runs of 192+ keys on average
    cache = torch.randn(2, 2, blocks * block, dim, generator=gen).to(dtype)
    q = torch.randn(1, 4, dim, generator=gen).to(dtype)
    runs = slot_runs(table, 0, length, block)
    assert can_decode_in_place(runs, torch.device("cpu"))
    rows = block_rows(torch.tensor([table]), 2, blocks)
    empty = torch.zeros(0, dtype=torch.long)
    in_place = attn._decode(
        q, cache, AttentionBatch(empty, block, 1, None, (0, length), None, [], runs)
    )
    gathered = attn._decode(q, cache, AttentionBatch(empty, block, 1, rows, (0, length), None, []))
    slots = torch.cat([torch.arange(b * block, (b + 1) * block) for b in table])[:length]
    k, v = cache[0][:, slots].double(), cache[1][:, slots].double()
    probs = (q[0].double().view(2, 2, dim) @ k.transpose(-1, -2) * attn.scale).softmax(-1)
    ref = (probs @ v).reshape(1, 4, dim)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(in_place.double(), ref, **tol)
    torch.testing.assert_close(gathered.double(), ref, **tol)


def test_fragmented_context_falls_back_to_the_gather() -> None:
    """Several runs go in place on CPU only, at most MAX_DECODE_RUNS of them (the C path's
    hand-off C_PATH_MAX_RUNS) and not too short (a flash call a run: many short ones lose to
    one gather); each case below fails its one bound only."""
    cpu = torch.device("cpu")
    flash = _flash_cpu is not None
    many = slot_runs(list(range(40, 0, -2)), 0, 80, 4)  # 20 blocks, none adjacent
    assert len(many) == 20 and not can_decode_in_place(many, cpu)  # 4 keys a run
    per = MIN_KEYS_PER_RUN // 16  # blocks a run of MIN_KEYS_PER_RUN keys

    def runs_of(count: int, keys: int) -> list[tuple[int, int]]:
        """``count`` runs, none adjacent, of ``keys`` keys in all (blocks of 16)."""
        apart = [b for i in range(count) for b in range(i * (per + 1), i * (per + 1) + per)]
        runs = slot_runs(apart, 0, keys, 16)
        assert len(runs) == count
        return runs

    long = MIN_KEYS_PER_RUN
    assert can_decode_in_place(runs_of(1, 40), torch.device("meta"))  # one run: anywhere
    assert not can_decode_in_place(runs_of(2, 2 * long), torch.device("meta"))
    assert can_decode_in_place(runs_of(MAX_DECODE_RUNS, MAX_DECODE_RUNS * long), cpu) == flash
    assert not can_decode_in_place(runs_of(MAX_DECODE_RUNS + 1, (MAX_DECODE_RUNS + 1) * long), cpu)
    assert not can_decode_in_place(runs_of(MAX_DECODE_RUNS, MAX_DECODE_RUNS * long - 1), cpu)
    c_path = runs_of(C_PATH_MAX_RUNS + 1, (C_PATH_MAX_RUNS + 1) * long)
    assert can_decode_in_place(c_path, cpu) == flash
    assert not can_decode_in_place(c_path, cpu, C_PATH_MAX_RUNS)
    assert can_decode_in_place(c_path[:-1], cpu, C_PATH_MAX_RUNS) == flash


def test_a_float32_model_reports_the_paths_it_really_runs(tmp_path: Path) -> None:
    path = make_model(tmp_path / "f32", "tiny", dtype="float32")
    forced = "prefill_attention=sdpa,decode_ops=torch"
    choice = LLM(model=str(path), kv_cache_memory="8MiB", kernels=forced)
    kernels = choice.engine.kernels
    # float32 has no packed form: plain or, with a compiler, the C kernel (timed, or read
    # from the machine's kernel cache)
    timed = {"measured", "cached"}
    assert {p: how in timed for p, how in kernels.how.items()} == {
        "linear": bool(native.compiler()),
        "batch_linear": False,  # bf16 only
        "big_batch_linear": False,  # bf16 only
        "prefill_linear": False,  # bf16 only
        "matmul_math": False,  # a rule: float32 only for bf16 where oneDNN has no bf16 path
        "prefill_attention": False,
        "decode_math": False,
        "decode_ops": False,
        "decode_prefetch": False,  # the bf16 head-64 decode attention only
        "threads": False,  # bound only when forced
        "step_rows": False,  # a rule: padded for 16-bit oneDNN matmuls only
        "heap": False,  # a rule: settled on CPU with glibc
    }
    assert kernels.step_rows == "exact"
    assert kernels.how["prefill_attention"] == kernels.how["decode_ops"] == "forced"
    assert kernels.linear in ("plain", "c") and kernels.decode_math == "float32"
    model = choice.engine.runner.model
    assert all(m.packed is None for m in model.modules() if hasattr(m, "packed"))


needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def c_ops(tmp_path_factory: pytest.TempPathFactory) -> native.NativeOps:
    ops = native.load(seed_native(tmp_path_factory.mktemp("native")))
    assert ops is not None, "a C compiler is here but the kernels did not build (see the log)"
    return ops


def _disassembly(c_ops: native.NativeOps) -> str:
    """``objdump -d`` of the built library; skips where binutils is absent."""
    import shutil

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump here (binutils) to read the library with")
    return subprocess.run(
        [objdump, "-d", c_ops.lib._name], capture_output=True, text=True, check=True
    ).stdout


@needs_cc
@pytest.mark.parametrize("build", ["engine", "x86-64-v3"])
def test_the_decode_attention_prefetches_are_in_the_built_library(
    request: pytest.FixtureRequest, build: str
) -> None:
    """gcc 12 may delete prefetches as code without side effects: for several sessions the
    engine's library held no prefetch of the tile after a block jump (shuffled tables were read
    at ~0.7x the time with it). Where the build has the AVX-512 BF16 kernels, the library holds
    that prefetcht1 and the prefetcht0 of a tile's K rows (which gcc had kept so far); the
    x86-64-v3 build, the AVX2 attention's prefetcht0 of the next tile (its only prefetch)."""
    if build == "engine":
        ops = request.getfixturevalue("c_ops")
        if ops.pairs_isa != "avx512_bf16":
            pytest.skip("this build has no AVX-512 BF16 kernels, where the prefetches are")
        text = _disassembly(ops)
        assert "prefetcht0" in text and "prefetcht1" in text
    else:
        assert "prefetcht0" in _disassembly(build_for(build, _factory(request)))


@needs_cc
def test_the_batched_pairs_kernel_prefetches_its_next_group(c_ops: native.NativeOps) -> None:
    """batch_linear=pairs' tiles after the first prefetch the next group of blocks (1.08-1.18x
    at 24-32 rows on an AMD EPYC): the function that runs the row tiles holds prefetcht1,
    which gcc could delete as code without side effects."""
    import re

    cc = native.compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout if cc else ""
    if "Free Software Foundation" not in version:
        pytest.skip("the function names read here are gcc's (clang outlines OpenMP otherwise)")
    if c_ops.pairs_isa != "avx512_bf16":
        pytest.skip("this build has no AVX-512 BF16 kernels, where the prefetch is")
    text = _disassembly(c_ops)
    # one function a chunk; pairs_rows' body is its OpenMP outline, or inlined into
    # linear_pairs_rows in a build without OpenMP
    bodies = [f for f in re.split(r"\n(?=[0-9a-f]+ <)", text) if "pairs_rows" in f.split("\n")[0]]
    assert any("prefetcht1" in body for body in bodies)


@needs_cc
def test_the_kernels_build_with_openmp_where_the_compiler_has_it(
    c_ops: native.NativeOps, tmp_path: Path
) -> None:
    """The build falls back to a library without -fopenmp (every kernel on one thread) only
    for a compiler that lacks it: a compile error in the source under -fopenmp once passed
    every test through that fallback at half the speed."""
    import subprocess

    probe = tmp_path / "omp.c"
    probe.write_text("#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n")
    cc = native.compiler()
    assert cc is not None
    has_openmp = (
        subprocess.run(
            [cc, "-fopenmp", "-fPIC", "-shared", "-o", str(tmp_path / "omp.so"), str(probe)],
            capture_output=True,
        ).returncode
        == 0
    )
    assert c_ops.openmp == has_openmp


@pytest.fixture(scope="module")
def avx512_ops(tmp_path_factory: pytest.TempPathFactory) -> native.NativeOps:
    """The library built with ``-DNEW_DECODE_ATTENTION=1``: the head-64 decode attention in
    AVX-512 only, as on a CPU (or under a Linux) without AMX tiles, where the engine's build
    scores keys on the tiles."""
    cc = native.compiler()
    assert cc is not None
    target = tmp_path_factory.mktemp("native_avx512") / "decode_ops.so"
    cmd = [cc, "-DNEW_DECODE_ATTENTION=1", *native.flag_sets()[0], "-o", str(target)]
    subprocess.run([*cmd, str(native.SOURCE), "-lm"], check=True)
    return native.NativeOps(ctypes.CDLL(str(target)))


@pytest.fixture(scope="module", params=["engine", *OTHER_BUILDS])
def any_ops(request: pytest.FixtureRequest, c_ops: native.NativeOps) -> native.NativeOps:
    """Each build a kernel's branches differ by: the engine's here (AVX-512 where the CPU has
    it), an AVX2-only CPU's and the portable one (conftest's OTHER_BUILDS)."""
    return c_ops if request.param == "engine" else build_for(request.param, _factory(request))


def _factory(request: pytest.FixtureRequest) -> pytest.TempPathFactory:
    return request.getfixturevalue("tmp_path_factory")


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"atol": 2e-6, "rtol": 2e-5}
    return {"atol": 2e-2, "rtol": 2e-2}  # one bf16 rounding of results of magnitude ~1


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 64 and 128 take the compiled-in sizes (and the AVX2 kernel in the x86-64-v3 build), 16 the
# generic loop
@pytest.mark.parametrize("head_dim", [16, 64, 128])
# query heads over 2 KV heads: groups of 1-4 take the bf16 head-64 kernel of 16 keys at a time
# (scores on AMX tiles where granted), 6 the per-key vdpbf16ps loop, 10 the generic loop; at
# head size 128 groups of 1-8 take the bf16 head-128 kernel, 10 the generic loop; in AVX2,
# groups of 5 and 7 take its head sets of 4 + 1 and 4 + 2 + 1
@pytest.mark.parametrize("heads", [8, 2, 4, 6, 10, 12, 14, 16, 20])
def test_c_paged_decode_attention_matches_a_float64_reference(
    any_ops: native.NativeOps, dtype: torch.dtype, head_dim: int, heads: int
) -> None:
    """Four sequences over scattered and adjacent blocks: a context ending mid-block, one of a
    single key, one with a window (keys from position 5), one long enough to be cut into parts
    attended in parallel and merged."""
    _check_decode_attention(any_ops, dtype, head_dim, heads)


@needs_cc
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [8, 2, 4, 6, 16])
def test_c_avx512_decode_attention_matches_a_float64_reference(
    avx512_ops: native.NativeOps, head_dim: int, heads: int
) -> None:
    """The same for the build without the AMX scores (bf16; groups of 1-4 at head size 64,
    where the two builds differ, and 1-8 at head size 128, the AVX-512 kernel of both)."""
    _check_decode_attention(avx512_ops, torch.bfloat16, head_dim, heads)


@needs_cc
@pytest.mark.parametrize("build", ["engine", "avx512"])
@pytest.mark.parametrize(("head_dim", "heads"), [(64, 8), (64, 2), (64, 4), (64, 6), (128, 6)])
def test_decode_prefetch_every_changes_no_bit(
    request: pytest.FixtureRequest, build: str, head_dim: int, heads: int
) -> None:
    """decode_prefetch=every asks memory for the keys after the next tile at every tile, where
    jumps asks only where the table jumps to another block: it changes what is read ahead,
    never a sum. Scattered, adjacent and windowed tables and a sequence cut into parts over
    the threads give the float64 reference's output under every, and the same bits as under
    jumps."""
    ops = _decode_attention_build(request, build)
    if not ops.has_decode_prefetch:
        pytest.skip("this build's decode attention has no such prefetch (no AVX-512 BF16)")
    before = ops.prefetch_mode
    try:
        ops.set_decode_prefetch("every")
        assert ops.prefetch_mode == "every"  # read back from the library
        every = _check_decode_attention(ops, torch.bfloat16, head_dim, heads)
        ops.set_decode_prefetch("jumps")
        assert ops.prefetch_mode == "jumps"
        jumps = _check_decode_attention(ops, torch.bfloat16, head_dim, heads)
        with pytest.raises(ValueError, match="decode_prefetch must be 'jumps' or 'every'"):
            ops.set_decode_prefetch("always")
        assert ops.prefetch_mode == "jumps"
    finally:
        ops.set_decode_prefetch(before)
    assert torch.equal(every, jumps)


@pytest.mark.parametrize("build", [None, "x86-64-v3"])
def test_decode_prefetch_every_without_its_kernels_is_refused_by_its_name(
    tiny_bf16: Path, build: str | None, request: pytest.FixtureRequest
) -> None:
    """decode_prefetch=every with no C kernels, or with an AVX2 build (whose attention has its
    own prefetch, not this one), names the option asked for, and changes nothing."""
    ops = None if build is None else build_for(build, _factory(request))
    if ops is not None:
        assert not ops.has_decode_prefetch and ops.prefetch_mode == "jumps"
        ops.set_decode_prefetch("jumps")  # nothing to set: no error
        with pytest.raises(ValueError, match="decode_prefetch=every: this build's decode"):
            ops.set_decode_prefetch("every")
    llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels="linear=packed")
    model = llm.engine.runner.model
    before = model.native
    with pytest.raises(ValueError, match="decode_prefetch=every needs the C kernels built with"):
        apply_kernels(model, KernelChoice(decode_prefetch="every", decode_ops="torch"), ops)
    assert model.native is before


def test_forced_decode_prefetch_every_is_refused_before_any_trial(
    tiny_bf16: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Forced on a model whose decode attention has no such prefetch (tiny's head size is 16),
    decode_prefetch=every is refused by name at load, before the trials run (none is cached)."""
    fresh_cache(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="decode_prefetch=every needs the C kernels built with"):
        LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels="decode_prefetch=every")
    assert not list(tmp_path.glob("kernels/*.json"))


def test_decode_prefetch_is_timed_where_the_attention_takes_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A bf16 model of head size 64 on a build with AVX-512 BF16: both settings timed at load,
    the faster kept and set in the library; at head size 128 too. Head size 16, 8 query heads
    a KV head at head size 64, or 16 at 128 (loops without the prefetch): jumps, fixed,
    nothing timed, and the library's setting, the first engine's, left as it was."""
    from pdscope.checkpoint.make_model import make_model

    fresh_cache(tmp_path, monkeypatch)
    ops = native.load(tmp_path / "native")
    if ops is None or not ops.has_decode_prefetch:
        pytest.skip("no AVX-512 BF16 in this build of the C kernels")
    head64 = make_model(tmp_path / "head64", "tiny", head_dim=64)
    kernels = LLM(model=str(head64), kv_cache_memory="8MiB").engine.kernels
    assert kernels.how["decode_prefetch"] == "measured"
    timed = {n: t for n, t in kernels.trial_s.items() if n.startswith("decode_prefetch=")}
    assert set(timed) == {"decode_prefetch=jumps", "decode_prefetch=every"}
    chosen = kernels.decode_prefetch
    assert chosen == min(timed, key=timed.__getitem__).split("=")[1]
    assert ops.prefetch_mode == chosen
    other = {"jumps": "every", "every": "jumps"}[chosen]
    head128 = make_model(tmp_path / "head128", "tiny", head_dim=128)
    kernels = LLM(model=str(head128), kv_cache_memory="8MiB").engine.kernels
    assert kernels.how["decode_prefetch"] == "measured"
    assert ops.prefetch_mode == kernels.decode_prefetch
    for name, overrides in (
        ("head16", {}),
        ("group8", {"head_dim": 64, "num_attention_heads": 8, "num_key_value_heads": 1}),
        ("group16", {"head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 1}),
    ):
        ops.set_decode_prefetch(other)  # as if another engine had chosen the other setting
        path = make_model(tmp_path / name, "tiny", **overrides)
        kernels = LLM(model=str(path), kv_cache_memory="8MiB").engine.kernels
        assert (kernels.decode_prefetch, kernels.how["decode_prefetch"]) == ("jumps", "fixed")
        assert ops.prefetch_mode == other, name
    ops.set_decode_prefetch("jumps")


def _decode_attention_build(request: pytest.FixtureRequest, build: str) -> native.NativeOps:
    if build in OTHER_BUILDS:
        return build_for(build, _factory(request))
    return request.getfixturevalue("c_ops" if build == "engine" else "avx512_ops")


def _check_decode_attention(
    c_ops: native.NativeOps, dtype: torch.dtype, head_dim: int, heads: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    kv_heads, block, blocks = 2, 4, 400
    cache = torch.randn(2, kv_heads, blocks * block, head_dim, generator=gen).to(dtype)
    order = torch.randperm(blocks, generator=gen).tolist()
    tables = [order[:5], [order[5]], order[6:10], list(range(10, 310))]  # the last: adjacent
    bounds = [(0, 18), (0, 1), (5, 15), (0, 1197)]
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    # every slot no sequence attends holds NaN: a read outside [lo, hi), or past an odd
    # tile's last key, that reaches a sum shows in the output (masked lanes do not)
    seen = torch.zeros(blocks * block, dtype=torch.bool)
    for table, (lo, hi) in zip(tables, bounds, strict=True):
        seen[[table[p // block] * block + p % block for p in range(lo, hi)]] = True
    cache[:, :, ~seen] = float("nan")
    q = torch.randn(4, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = c_ops.decode_attention(q, cache, table_t, torch.tensor(bounds), block, scale)
    for i, (lo, hi) in enumerate(bounds):
        slots = torch.tensor([tables[i][p // block] * block + p % block for p in range(lo, hi)])
        k, v = cache[0][:, slots].double(), cache[1][:, slots].double()
        qi = q[i].double().view(kv_heads, heads // kv_heads, head_dim)
        ref = ((qi @ k.transpose(-1, -2)) * scale).softmax(-1) @ v
        torch.testing.assert_close(
            out[i].double(), ref.reshape(heads, head_dim), **_tolerance(dtype)
        )
    return out


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("build", ["engine", "avx512", *OTHER_BUILDS])
@pytest.mark.parametrize("dim", [64, 128])
def test_c_decode_attention_split_across_threads_matches_a_float64_reference(
    request: pytest.FixtureRequest, dtype: torch.dtype, build: str, dim: int
) -> None:
    """One sequence of 4,503 keys over 2 KV heads at 2 threads: enough key rows for the
    parallel region, and fewer work items than twice the threads, so each head's keys are cut
    into parts attended on different threads (each configuring its own tiles) and merged; the
    last block is short."""
    c_ops = _decode_attention_build(request, build)
    gen = torch.Generator().manual_seed(9)
    kv_heads, heads, block, context = 2, 8, 16, 4503
    scale = dim**-0.5
    blocks = -(-context // block)
    cache = torch.randn(2, kv_heads, blocks * block, dim, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen)
    q = torch.randn(1, heads, dim, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = c_ops.decode_attention(
            q, cache, table[None], torch.tensor([[0, context]]), block, scale
        )
    finally:
        torch.set_num_threads(threads)
    slots = torch.tensor([table[p // block] * block + p % block for p in range(context)])
    k, v = cache[0][:, slots].double(), cache[1][:, slots].double()
    qg = q[0].double().view(kv_heads, heads // kv_heads, dim)
    ref = ((qg @ k.transpose(-1, -2)) * scale).softmax(-1) @ v
    torch.testing.assert_close(out[0].double(), ref.reshape(heads, dim), **_tolerance(dtype))


@needs_cc
@pytest.mark.parametrize("build", ["engine", "avx512", *OTHER_BUILDS])
def test_c_bf16_decode_attention_is_as_close_to_float64_as_sdpa(
    request: pytest.FixtureRequest, build: str
) -> None:
    """The small model's attention shape (16 query heads over 4 KV heads of 64, bf16) over
    2,000 keys in scattered blocks of 16: the kernel's error against a float64 reference is no
    larger than torch's SDPA's on the same bf16 inputs, called as transformers calls it (4-D,
    ``enable_gqa``: torch's flash kernel, which rounds the softmax weights to bf16 before P @ V,
    as this kernel does), and its mean at most 1.5x that of the reference rounded to bf16 once
    (the output's own rounding)."""
    c_ops = _decode_attention_build(request, build)
    gen = torch.Generator().manual_seed(5)
    kv_heads, heads, dim, block, context = 4, 16, 64, 16, 2000
    blocks = -(-context // block)
    cache = torch.randn(2, kv_heads, blocks * block, dim, generator=gen).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=gen)
    q = (2 * torch.randn(1, heads, dim, generator=gen)).to(torch.bfloat16)  # peaked softmax
    out = c_ops.decode_attention(q, cache, table[None], torch.tensor([[0, context]]), block, 0.125)
    slots = torch.tensor([table[p // block] * block + p % block for p in range(context)])
    k, v = cache[0][:, slots], cache[1][:, slots]  # [kv_heads, context, dim]
    qg = q[0].view(kv_heads, heads // kv_heads, dim)
    ref = ((qg.double() @ k.double().transpose(-1, -2)) * 0.125).softmax(-1) @ v.double()
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[0][None, :, None], k[None], v[None], scale=0.125, enable_gqa=True
    )[0, :, 0].view_as(ref)
    ours, theirs = (out[0].double().view_as(ref) - ref).abs(), (sdpa.double() - ref).abs()
    assert ours.max() <= theirs.max() * 1.05, (ours.max(), theirs.max())
    assert ours.mean() <= theirs.mean() * 1.05, (ours.mean(), theirs.mean())
    rounding = (ref.bfloat16().double() - ref).abs().mean()
    assert ours.mean() <= rounding * 1.5, (ours.mean(), rounding)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads_major", [False, True])
def test_c_rope_and_kv_write_match_the_pytorch_ops(
    any_ops: native.NativeOps, dtype: torch.dtype, qk_norm: bool, heads_major: bool
) -> None:
    """Three tokens at scattered positions and slots: q returned rotated, K rotated and V as is
    written into their slots, nothing else in the cache touched; Qwen3's per-head q/k norms.
    ``heads_major``: the same q laid out [heads, tokens, dim] in memory (a one-chunk step)."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, slots = 4, 2, 16, 40
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    positions, slot_mapping = torch.tensor([0, 17, 5]), torch.tensor([9, 30, 2])
    angles = torch.outer(torch.arange(32.0), torch.rand(dim // 2, generator=gen))
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    norms = [RMSNorm(dim, 1e-6).to(dtype) for _ in range(2)] if qk_norm else [None, None]
    for norm in norms:
        if norm is not None:
            norm.weight.data = (1 + torch.randn(dim, generator=gen)).to(dtype)
    cache = torch.randn(2, kv_heads, slots, dim, generator=gen).to(dtype)
    before = cache.clone()
    with torch.no_grad():
        q = any_ops.qkv_rope_store(
            qkv,
            cache,
            positions,
            slot_mapping,
            cos,
            sin,
            heads,
            None if norms[0] is None else norms[0].weight,
            None if norms[1] is None else norms[1].weight,
            1e-6,
            heads_major,
        )
        assert q.shape == (3, heads, dim)
        assert q.transpose(0, 1).is_contiguous() == heads_major
        x = qkv.double().view(3, heads + 2 * kv_heads, dim)
        qk = x[:, : heads + kv_heads]
        if qk_norm:
            weights = torch.cat(
                [norms[0].weight.double()[None].expand(heads, dim)]
                + [norms[1].weight.double()[None].expand(kv_heads, dim)]
            )
            qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + 1e-6) * weights
        qk = apply_rope(qk, cos[positions].double()[:, None], sin[positions].double()[:, None])
    tol = _tolerance(dtype)
    torch.testing.assert_close(q.double(), qk[:, :heads], **tol)
    torch.testing.assert_close(
        cache[0][:, slot_mapping].transpose(0, 1).double(), qk[:, heads:], **tol
    )
    assert torch.equal(cache[1][:, slot_mapping].transpose(0, 1), qkv.view(3, -1, dim)[:, -2:])
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert torch.equal(cache[:, :, untouched], before[:, :, untouched])


@pytest.fixture(params=["wide", "portable", *OTHER_BUILDS])
def glue_ops(request: pytest.FixtureRequest, c_ops: native.NativeOps) -> Iterator[native.NativeOps]:
    """The C kernels with the bf16 norms and silu_mul in each form this build has: the AVX-512
    BF16 one (rms_norm_bf16, silu_mul_bf16), where the CPU has it, and the portable one; and
    the portable one as the builds without AVX-512 compile it."""
    if request.param in OTHER_BUILDS:
        ops = build_for(request.param, _factory(request))
        assert not ops.wide_glue
        yield ops
        return
    wide = request.param == "wide"
    if wide and not c_ops.lib.prefill_glue_isa():
        pytest.skip("this CPU has no AVX-512 BF16")
    before, c_ops.wide_glue = c_ops.wide_glue, wide
    try:
        yield c_ops
    finally:
        c_ops.wide_glue = before


@pytest.fixture(scope="module", params=["native", *OTHER_BUILDS])
def argmax_ops(request: pytest.FixtureRequest, c_ops: native.NativeOps) -> native.NativeOps:
    """The engine's build (AVX-512 where the CPU has it) and the builds without AVX-512 (the
    scalar loops, as on a CPU without it)."""
    return c_ops if request.param == "native" else build_for(request.param, _factory(request))


@needs_cc
def test_c_argmax_is_torchs(argmax_ops: native.NativeOps) -> None:
    """The greedy token the one-call decode step hands the sampler: torch.argmax's index for
    every row, ties (the first), NaNs (the first), all -inf, and lengths off the 16 lanes."""
    if not argmax_ops.one_call_logits:
        pytest.skip("a build without decode_logits")
    gen = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 17, 1000, 16384):
        x = torch.randn(6, n, generator=gen)
        x[1] = x[1].round()  # many ties
        x[1, -1] = x[1].max()  # the maximum twice, at the end too
        x[2] = float("-inf")
        x[3, n // 2] = float("nan")
        x[3, -1] = float("nan")
        x[4, 0] = float("inf")
        x[5] = 0.0
        assert torch.equal(argmax_ops.argmax_rows(x), x.argmax(dim=-1)), n
    with pytest.raises(ValueError, match="float32"):
        argmax_ops.argmax_rows(torch.zeros(2, 3, dtype=torch.bfloat16))


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 96), (70, 1000)])  # 1000: a masked tail; 70 x 1000: threaded
def test_c_rms_norm_fuses_the_residual_add(
    glue_ops: native.NativeOps, dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    c_ops, (rows, n) = glue_ops, shape
    gen = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(rows, n, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + torch.randn(n, generator=gen)).to(dtype)
    plain = c_ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(plain, torch.nn.functional.rms_norm(x, (n,), weight, 1e-5))
    summed = residual + x  # rounded to the dtype, as the model's residual stream is
    fused = c_ops.rms_norm(x, weight, 1e-5, residual=residual)
    assert torch.equal(residual, summed)
    ref = torch.nn.functional.rms_norm(summed.double(), (n,), weight.double(), 1e-5)
    torch.testing.assert_close(fused.double(), ref, **_tolerance(dtype))
    with pytest.raises(ValueError, match="contiguous"):
        c_ops.rms_norm(x.t(), weight, 1e-5)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_silu_mul_matches_a_float64_reference(
    glue_ops: native.NativeOps, dtype: torch.dtype
) -> None:
    c_ops = glue_ops
    gen = torch.Generator().manual_seed(6)
    for rows, n in ((1, 40), (70, 1000)):  # the second takes the threaded path
        gate_up = (torch.randn(rows, 2 * n, generator=gen) * 4).to(dtype)
        gate_up[0, :4] = torch.tensor([-100.0, -0.0, 30.0, 0.0])  # tails and zeros
        out = c_ops.silu_mul(gate_up)
        g, u = gate_up.double().split(n, dim=-1)
        torch.testing.assert_close(
            out.double(), torch.nn.functional.silu(g) * u, **_tolerance(dtype)
        )
    with pytest.raises(ValueError, match="halves"):
        c_ops.silu_mul(torch.zeros(2, 5, dtype=dtype))
    # into a buffer of the caller's (the MLP's Scratch): the same values, written there
    given = torch.full((rows, n), 7.0, dtype=dtype)
    assert c_ops.silu_mul(gate_up, out=given) is given
    torch.testing.assert_close(given, out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="is not"):
        c_ops.silu_mul(gate_up, out=torch.empty(rows, n + 1, dtype=dtype))
    with pytest.raises(ValueError, match="overlaps"):
        c_ops.silu_mul(gate_up, out=gate_up.view(-1)[: rows * n].view(rows, n))  # in place


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 6: a full block of four x rows and a partial one (AVX2: two of three); 5: AVX2's three and
# two; 33: two full 16-row tile groups and one row
@pytest.mark.parametrize("rows", [1, 3, 5, 6, 33])
@pytest.mark.parametrize("kernel", ["linear", "linear_many"])  # batch_linear=c takes the second
# x86-64-v3: bf16 through AVX2 FMAs; x86-64: the portable loop
@pytest.mark.parametrize("build", ["engine", *OTHER_BUILDS])
def test_c_linear_matches_a_float64_reference(
    request: pytest.FixtureRequest, dtype: torch.dtype, rows: int, kernel: str, build: str
) -> None:
    """Shapes off every block size: 70 inputs (two full 32-wide steps and a masked tail), 86
    (a 16-wide step after them: AVX2's one-row loop), 37 outputs (nine blocks of four and a
    partial one), and for the AMX tiles of linear_many (bf16, inputs a multiple of 32, outputs
    of 16; the rest fall back to linear's kernel) 96 inputs and 48 outputs (a 32-row weight
    block and a 16-row one), with and without a bias; bf16 results within one rounding of the
    float64 product, and no further from it than F.linear."""
    ops = (
        request.getfixturevalue("c_ops")
        if build == "engine"
        else build_for(build, _factory(request))
    )
    if build in OTHER_BUILDS:
        assert ops.linear_isa == {"x86-64-v3": "avx2", "x86-64": "portable"}[build]
    linear = getattr(ops, kernel)
    gen = torch.Generator().manual_seed(5)
    for inputs, outputs in ((70, 37), (86, 37), (96, 48)):
        x = torch.randn(rows, inputs, generator=gen).to(dtype)
        weight = (torch.randn(outputs, inputs, generator=gen) / 8).to(dtype)
        bias = torch.randn(outputs, generator=gen).to(dtype)
        for b in (None, bias):
            out = linear(x, weight, b)
            ref = x.double() @ weight.double().T + (0 if b is None else b.double())
            assert out.shape == (rows, outputs) and out.dtype == dtype
            torch.testing.assert_close(out.double(), ref, **_tolerance(dtype))
            ours = (out.double() - ref).abs().max()
            theirs = (torch.nn.functional.linear(x, weight, b).double() - ref).abs().max()
            assert ours <= max(theirs * 1.01, 1e-5)  # float32 accumulation, one rounding
    big = torch.randn(rows, 1024, generator=gen).to(dtype)  # the threaded path
    wide = (torch.randn(304, 1024, generator=gen) / 32).to(dtype)
    ref = big.double() @ wide.double().T
    torch.testing.assert_close(linear(big, wide).double(), ref, **_tolerance(dtype))
    with pytest.raises(ValueError, match="does not fit"):
        linear(x, weight[:, :69].contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        linear(x, weight.t())


def _assert_as_close_as_f_linear(
    y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """``y``, a bf16 x @ weight^T (+ bias), is F.linear's result give or take one rounding
    step (both float32 sums rounded once to bf16), and no farther from the exact product."""
    ref = torch.nn.functional.linear(x, weight, bias)
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    torch.testing.assert_close(y, ref, atol=2e-2, rtol=1.6e-2)
    ours = (y.double() - exact).abs().max()
    theirs = (ref.double() - exact).abs().max()
    assert ours <= max(theirs * 1.01, 1e-5)


@needs_cc
@pytest.mark.parametrize("rows", [1, 2, 17, 33])  # 1 takes the one-row tile path, no x copy
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_linear_matches_f_linear_on_odd_shapes(
    c_ops: native.NativeOps, rows: int, threads: int
) -> None:
    """linear_many on its AMX tiles against F.linear over the same bf16 tensors: outputs not a
    multiple of 32 (a lone 16-row block last: 16, 48, 80, 304), inputs of one tile step (32)
    up to the small model's down projection (2,816), with and without a bias, and weights
    large enough that the second thread takes a share. Each call must report that it took the
    tiles, so a silent fallback to the AVX-512 kernel cannot pass for it."""
    if c_ops.linear_many_isa != "amx":
        pytest.skip("no AMX tiles on this CPU, compiler or kernel")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(7)
        for outputs, inputs in ((16, 32), (48, 96), (80, 64), (304, 1024), (1040, 2816)):
            x = torch.randn(rows, inputs, generator=gen).to(torch.bfloat16)
            weight = (torch.randn(outputs, inputs, generator=gen) / 8).to(torch.bfloat16)
            bias = torch.randn(outputs, generator=gen).to(torch.bfloat16)
            for b in (None, bias):
                y = torch.full((rows, outputs), float("nan"), dtype=torch.bfloat16)
                took_tiles = c_ops._run_linear(c_ops.lib.linear_many_rows, x, weight, b, y)
                assert took_tiles == 1
                _assert_as_close_as_f_linear(y, x, weight, b)
    finally:
        torch.set_num_threads(saved)


@needs_cc
@pytest.mark.parametrize("threads", [1, 2, 3])
# x86-64-v3: the AVX2 kernel; x86-64: none, refused by name
@pytest.mark.parametrize("build", ["engine", *OTHER_BUILDS])
def test_pairs_linear_matches_f_linear_whatever_the_threads(
    request: pytest.FixtureRequest, threads: int, build: str
) -> None:
    """linear_pairs on pack_pairs copies against F.linear over the same bf16 tensors: block
    counts that leave the eight-stream loop a remainder (1, 3, 9, 65 blocks of 16) or none
    (16, 1,024 at the small model's LM head), inputs of one pair up to the down projection's
    2,816, with and without a bias. Each block sums its pairs in one order whichever loop runs
    it, so the bits are the same at any thread count and either stream count (8, or 2 for
    linear=pairs2); and the copy is the documented layout. The x86-64-v3 build takes one row
    and several in AVX2; the x86-64 build has no pairs kernel to offer."""
    if build == "x86-64":
        ops = build_for(build, _factory(request))
        assert (ops.pairs, ops.pairs_rows, ops.pairs_isa) == (False, False, "")
        return
    c_ops = request.getfixturevalue("c_ops" if build == "engine" else "v3_ops")
    if build == "x86-64-v3":
        assert c_ops.pairs_isa == "avx2" and c_ops.pairs_rows
    if not c_ops.pairs:
        pytest.skip("this build of the C kernels lacks AVX-512 BF16 and AVX2")
    gen = torch.Generator().manual_seed(11)
    shapes = ((16, 2), (48, 96), (144, 64), (256, 1024), (1040, 2816), (16384, 128))
    saved = torch.get_num_threads()
    try:
        for outputs, inputs in shapes:
            x = torch.randn(1, inputs, generator=gen).to(torch.bfloat16)
            weight = (torch.randn(outputs, inputs, generator=gen) / 8).to(torch.bfloat16)
            bias = torch.randn(outputs, generator=gen).to(torch.bfloat16)
            pairs = c_ops.pack_pairs(weight)
            layout = weight.view(outputs // 16, 16, inputs // 2, 2).transpose(1, 2)
            assert torch.equal(pairs, layout)
            for b in (None, bias):
                torch.set_num_threads(1)
                alone = c_ops.linear_pairs(x, pairs, b)
                torch.set_num_threads(threads)
                for streams in native.PAIR_STREAMS:
                    y = c_ops.linear_pairs(x, pairs, b, streams=streams)
                    assert torch.equal(y, alone), (outputs, inputs, streams)
                _assert_as_close_as_f_linear(y, x, weight, b)
    finally:
        torch.set_num_threads(saved)
    with pytest.raises(ValueError, match="rows a multiple of 16"):
        c_ops.pack_pairs(torch.zeros(24, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        c_ops.linear_pairs(torch.zeros(1, 6, dtype=torch.bfloat16), c_ops.pack_pairs(weight))
    with pytest.raises(ValueError, match="streams must be one of"):
        c_ops.linear_pairs(x, pairs, streams=3)


@needs_cc
@pytest.mark.parametrize("threads", [1, 2, 3])
# x86-64-v3: AVX2's tiles (up to 5 rows against one block), on any x86 host
@pytest.mark.parametrize("build", ["engine", "x86-64-v3"])
def test_pairs_rows_are_each_row_alone_bit_for_bit(
    request: pytest.FixtureRequest, threads: int, build: str
) -> None:
    """linear_pairs at several rows (batch_linear=pairs: in AVX-512 BF16 tiles of up to 8
    rows against 3 blocks, in AVX2 of up to 5 rows against one) gives each row the bits
    linear_pairs gives it alone, whatever the rows around it and the threads: row counts that
    fill tiles of 8 or 5 and leave each tail (2-17, 23, 32), block counts that leave groups of
    3 a remainder (1, 2, 4, 65) or none (3, 96), with and without a bias; and every row as
    close to F.linear as the one-row kernel."""
    c_ops = request.getfixturevalue("c_ops" if build == "engine" else "v3_ops")
    if not c_ops.pairs_rows:
        pytest.skip("this build of the C kernels has neither AVX-512 BF16 nor AVX2")
    gen = torch.Generator().manual_seed(12)
    shapes = ((16, 2), (32, 96), (48, 64), (64, 1024), (1040, 2816), (1536, 128))
    saved = torch.get_num_threads()
    try:
        for outputs, inputs in shapes:
            weight = (torch.randn(outputs, inputs, generator=gen) / 8).to(torch.bfloat16)
            bias = torch.randn(outputs, generator=gen).to(torch.bfloat16)
            pairs = c_ops.pack_pairs(weight)
            for rows in (*range(2, 18), 23, 32):  # 16 rows on: the next group prefetched
                x = torch.randn(rows, inputs, generator=gen).to(torch.bfloat16)
                for b in (None, bias):
                    torch.set_num_threads(threads)
                    y = c_ops.linear_pairs(x, pairs, b)
                    torch.set_num_threads(1)
                    alone = [c_ops.linear_pairs(x[r : r + 1], pairs, b) for r in range(rows)]
                    assert torch.equal(y, torch.cat(alone)), (outputs, inputs, rows)
                    _assert_as_close_as_f_linear(y, x, weight, b)
    finally:
        torch.set_num_threads(saved)


@needs_cc
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_pairs_rows_of_a_long_prefill_are_the_bits_of_short_ones(
    c_ops: native.NativeOps, threads: int
) -> None:
    """From 1,024 rows (decode_ops.c's PAIRS_SPAN_MIN_ROWS) AVX-512 BF16 runs each row tile
    against spans of 4 groups of 3 blocks: every row keeps the bits it gets in calls of 32
    rows (the test above pins those to one row alone). Block counts whose thread shares are
    whole spans (48 blocks at 1 and 2 threads), spans and the groups and single blocks after
    them (48 at 3 threads, 65 at any) or no span at all (3); rows that fill tiles of 8 and that
    leave a tail of 7."""
    if c_ops.pairs_isa != "avx512_bf16":
        pytest.skip("spans are the AVX-512 BF16 tiles' (this build's pairs are not)")
    gen = torch.Generator().manual_seed(13)
    saved = torch.get_num_threads()
    try:
        for outputs, inputs in ((768, 256), (1040, 512), (48, 64)):
            weight = (torch.randn(outputs, inputs, generator=gen) / 8).to(torch.bfloat16)
            bias = torch.randn(outputs, generator=gen).to(torch.bfloat16)
            pairs = c_ops.pack_pairs(weight)
            for rows in (1024, 1031):
                x = torch.randn(rows, inputs, generator=gen).to(torch.bfloat16)
                for b in (None, bias):
                    torch.set_num_threads(threads)
                    y = c_ops.linear_pairs(x, pairs, b)
                    short = [
                        c_ops.linear_pairs(x[r : r + 32], pairs, b) for r in range(0, rows, 32)
                    ]
                    assert torch.equal(y, torch.cat(short)), (outputs, inputs, rows)
    finally:
        torch.set_num_threads(saved)


@needs_cc
def test_a_replacing_weight_gets_a_pairs_copy_where_the_one_before_took_none(
    c_ops: native.NativeOps,
) -> None:
    """Under linear=pairs a Linear whose weight took no copy (float32) reads the weight as
    stored; once its ``.data`` is replaced by one the copy takes (bf16), the next single row
    reads a new copy of it, and a replacement the copy cannot take drops it again."""
    from pdscope.engine.model import Linear

    if not c_ops.pairs:
        pytest.skip("this build of the C kernels lacks AVX-512 BF16 and AVX2")
    gen = torch.Generator().manual_seed(12)
    lin = Linear(64, 32, bias=False)
    lin.native, lin.one_row_pairs = c_ops, True
    lin.make_pairs(c_ops)
    assert lin.pairs is None
    lin.weight.data = (torch.randn(32, 64, generator=gen) / 8).to(torch.bfloat16)
    x = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
    y = lin(x)
    assert lin.pairs is not None and lin.pairs_source == lin.weight_key()
    assert torch.equal(y, c_ops.linear_pairs(x, c_ops.pack_pairs(lin.weight.detach())))
    _assert_as_close_as_f_linear(y, x, lin.weight.detach(), None)
    lin.weight.data = lin.weight.data.float()
    assert lin.current_pairs() is None


@needs_cc
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_run_on_team_calls_every_share_once_and_raises_a_shares_error(
    c_ops: native.NativeOps, threads: int
) -> None:
    """run_on_team: share(i, n) once for each thread i of the team of torch's thread count,
    on distinct OS threads where n > 1; an exception in any share reaches the caller."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seen: list[tuple[int, int, int]] = []
        lock = threading.Lock()

        def share(i: int, n: int) -> None:
            with lock:
                seen.append((i, n, threading.get_native_id()))

        assert c_ops.run_on_team(share) == threads
        assert sorted((i, n) for i, n, _ in seen) == [(i, threads) for i in range(threads)]
        assert len({tid for *_, tid in seen}) == threads

        def fails(i: int, n: int) -> None:
            if i == n - 1:
                raise ValueError(f"share {i} of {n}")

        with pytest.raises(ValueError, match=f"share {threads - 1} of {threads}"):
            c_ops.run_on_team(fails)
    finally:
        torch.set_num_threads(saved)


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "bias"), [(512, False), (1025, True), (3, False)])
def test_linear_by_rows_and_transposed_match_a_float64_reference_and_onednn(
    c_ops: native.NativeOps, threads: int, rows: int, bias: bool
) -> None:
    """prefill_linear=rows (x's rows split over the team, each share a one-thread matmul into
    its rows of one output) and =transposed (one matmul on the [in, out] copy): within a bf16
    rounding of the float64 product, and no further from it than F.linear on the same inputs."""
    from pdscope.engine.model import linear_by_rows, linear_transposed

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 320, generator=gen).bfloat16()
    w = (torch.randn(192, 320, generator=gen) * 0.05).bfloat16()
    b = torch.randn(192, generator=gen).bfloat16() if bias else None
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outs = [linear_by_rows(x, w.t().contiguous(), b, c_ops)]
        outs.append(linear_transposed(x, w.t().contiguous(), b))
        theirs = torch.nn.functional.linear(x, w, b)
    finally:
        torch.set_num_threads(saved)
    exact = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    ref = (theirs.double() - exact).abs()
    for out in outs:
        assert out.shape == (rows, 192) and out.dtype == torch.bfloat16 and out.is_contiguous()
        torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=8e-3)
        ours = (out.double() - exact).abs()
        assert ours.max() <= ref.max() * 1.25 + 1e-6
        assert ours.mean() <= ref.mean() * 1.05 + 1e-9


def _prefill_kernel_or_skip(c_ops: native.NativeOps, tiles: bool) -> None:
    if tiles and not c_ops.prefill_amx:
        pytest.skip("no AMX tiles on this CPU, compiler or kernel")
    if not tiles and not c_ops.prefill_vec:
        pytest.skip("the C kernels built without AVX-512 BF16 on this CPU or compiler")


def _causal_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int, scale: float
) -> torch.Tensor:
    """float64 causal attention with GQA: q [n, heads, dim] at positions cached.., keys and
    values [kv_heads, cached + n, dim] → [n, heads, dim]."""
    n, heads, _ = q.shape
    group = heads // keys.shape[0]
    k = keys.double().repeat_interleave(group, 0)
    v = values.double().repeat_interleave(group, 0)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale
    seen = torch.arange(cached + n)[None] <= torch.arange(cached, cached + n)[:, None]
    return (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v).transpose(0, 1)


@needs_cc
@pytest.mark.parametrize(
    ("n", "cached", "heads", "kv_heads", "head_dim"),
    [
        (1, 0, 4, 4, 64),  # one query, one key
        (37, 0, 16, 4, 64),  # the small model's heads; tails of 16-query and 32-key tiles
        (100, 523, 16, 4, 64),  # a chunk after a cached prefix, context past one 512-key chunk
        (600, 0, 8, 2, 128),  # two 512-key chunks for the later rows, head 128
        (33, 70, 6, 3, 32),  # group 2, head 32
        (20, 9, 4, 1, 64),  # all heads on one KV head
        (50, 17, 6, 2, 64),  # group 3: one pair of heads, then one alone
    ],
)
@pytest.mark.parametrize("heads_major", [False, True])
@pytest.mark.parametrize("tiles", [True, False], ids=["amx", "avx512"])
def test_c_prefill_attention_matches_a_float64_reference(
    c_ops: native.NativeOps,
    n: int,
    cached: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    heads_major: bool,
    tiles: bool,
) -> None:
    """The C prefill attention, its products on AMX tiles (prefill_attention=amx) or in
    AVX-512 BF16 (=c): causal, from a cached offset, GQA, every tail; within a bf16 rounding
    of float64 and no further from it than torch's SDPA. Keys and values are slices of a wider
    gather, as the engine hands them over."""
    _prefill_kernel_or_skip(c_ops, tiles)
    gen = torch.Generator().manual_seed(7)
    total = cached + n
    if heads_major:
        q = torch.randn(heads, n, head_dim, generator=gen).to(torch.bfloat16).transpose(0, 1)
    else:
        q = torch.randn(n, heads, head_dim, generator=gen).to(torch.bfloat16)
    kv = torch.randn(2, kv_heads, total + 5, head_dim, generator=gen).to(torch.bfloat16)
    keys, values = kv[0, :, :total], kv[1, :, :total]
    scale = head_dim**-0.5
    out = c_ops.prefill_attention(q, keys, values, cached, scale, tiles)
    assert out is not None and out.shape == (n, heads, head_dim) and out.is_contiguous()
    ref = _causal_reference(q, keys, values, cached, scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    seen = torch.arange(total)[None] <= torch.arange(cached, total)[:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=seen,
        scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)
    ours, theirs = (out.double() - ref).abs(), (sdpa.double() - ref).abs()
    assert ours.mean() <= theirs.mean() * 1.05 + 1e-6
    assert ours.max() <= theirs.max() * 1.25 + 1e-4


@needs_cc
@pytest.mark.parametrize(
    ("n", "cached", "heads", "kv_heads", "head_dim", "block_size"),
    [
        (37, 0, 16, 4, 64, 16),  # the small model's heads, the engine's default blocks
        (100, 523, 16, 4, 64, 16),  # after a cached prefix, past one 512-key chunk
        (33, 70, 6, 3, 32, 4),  # blocks smaller than a 16-key tile
        (50, 17, 6, 2, 64, 48),  # blocks larger than a 32-key V tile, not a power of two
        (1, 0, 4, 4, 64, 16),  # one query in a block of its own
    ],
)
@pytest.mark.parametrize("tiles", [True, False], ids=["amx", "avx512"])
def test_c_prefill_attention_paged_reads_the_cache_as_the_gather_does(
    c_ops: native.NativeOps,
    n: int,
    cached: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    tiles: bool,
) -> None:
    """The kernel reading K/V through a block table (scattered, out-of-order blocks of a paged
    cache) gives bit for bit what it gives on the gathered copy: only where it reads differs."""
    _prefill_kernel_or_skip(c_ops, tiles)
    from pdscope.engine.model import _gather_blocks, block_rows

    gen = torch.Generator().manual_seed(11)
    total = cached + n
    used = -(-total // block_size)
    num_blocks = used * 2 + 3
    cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=gen)
    cache = cache.to(torch.bfloat16)
    blocks = torch.randperm(num_blocks, generator=gen)[:used]
    q = torch.randn(n, heads, head_dim, generator=gen).to(torch.bfloat16)
    scale = head_dim**-0.5
    rows = block_rows(blocks, kv_heads, num_blocks)
    kv = _gather_blocks(cache, rows, block_size)[:, :, :total]
    gathered = c_ops.prefill_attention(q, kv[0], kv[1], cached, scale, tiles)
    paged = c_ops.prefill_attention_paged(q, cache, blocks, block_size, cached, scale, tiles)
    assert gathered is not None and paged is not None
    assert torch.equal(paged, gathered)
    ref = _causal_reference(q, kv[0], kv[1], cached, scale)
    torch.testing.assert_close(paged.double(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="cannot hold"):
        c_ops.prefill_attention_paged(q, cache, blocks[:-1], block_size, cached, scale)
    wild = blocks.clone()
    wild[-1] = num_blocks
    with pytest.raises(ValueError, match="outside the cache"):
        c_ops.prefill_attention_paged(q, cache, wild, block_size, cached, scale)


@needs_cc
@pytest.mark.parametrize("tiles", [True, False], ids=["amx", "avx512"])
def test_c_prefill_attention_refuses_what_it_cannot_take(
    c_ops: native.NativeOps, tiles: bool
) -> None:
    """A head size off its tiles returns None (the model then takes SDPA); bad inputs raise."""
    if not tiles and not c_ops.prefill_vec:
        with pytest.raises(RuntimeError, match="lacks AVX-512 BF16"):
            c_ops.prefill_attention(*torch.zeros(3, 1, 1, 32, dtype=torch.bfloat16), 0, 0.1, False)
        return
    q = torch.zeros(3, 4, 48, dtype=torch.bfloat16)
    kv = torch.zeros(2, 2, 3, 48, dtype=torch.bfloat16)
    assert c_ops.prefill_attention(q, kv[0], kv[1], 0, 0.1, tiles) is None
    with pytest.raises(ValueError, match="bf16 only"):
        c_ops.prefill_attention(q.float(), kv[0].float(), kv[1].float(), 0, 0.1)
    with pytest.raises(ValueError, match="does not fit"):
        c_ops.prefill_attention(q, kv[0], kv[1], 1, 0.1)
    strided = torch.zeros(2, 2, 3, 96, dtype=torch.bfloat16)[..., ::2]  # rows not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        c_ops.prefill_attention(q, strided[0], strided[1], 0, 0.1)


needs_two_cpus = pytest.mark.skipif(not thread_cpus(), reason="one thread or one CPU here")


def _in_a_thread(fn):
    """Run ``fn`` in a fresh thread (its own OpenMP team and placement, so nothing is left
    pinned on the test runner's thread) and return its result."""
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    worker.join()
    assert result, "the thread raised (see the output above)"
    return result[0]


@needs_cc
@needs_two_cpus
def test_place_threads_pins_and_frees_the_calling_team(c_ops: native.NativeOps) -> None:
    cpus, allowed = thread_cpus(), thread_cpus(bound=False)

    def pin_then_free() -> tuple[int, set[int], int, set[int]]:
        placed = c_ops.place_threads(cpus, bind=True)
        pinned = os.sched_getaffinity(0)  # the calling thread is thread 0 of its team
        freed = c_ops.place_threads(allowed, bind=False)
        return placed, pinned, freed, os.sched_getaffinity(0)

    placed, pinned, freed, after = _in_a_thread(pin_then_free)
    assert placed == freed == torch.get_num_threads()
    assert pinned == {cpus[0]} and after == set(allowed)
    with pytest.raises(ValueError, match="no CPUs"):
        c_ops.place_threads([], bind=True)


@needs_cc
@needs_two_cpus
def test_threads_bound_pins_each_step_and_only_the_step(tiny_bf16: Path) -> None:
    """Forced threads=bound: the model runs with the stepping thread on the first CPU, and
    between steps (and after generate) that thread may run anywhere again."""
    llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels="threads=bound")
    assert llm.engine.kernels.threads == "bound"
    seen: list[set[int]] = []
    runner = llm.engine.runner
    execute = runner._execute  # the model's work of a step (decode steps skip its forward)

    def spy(out: object) -> object:
        seen.append(os.sched_getaffinity(0))
        return execute(out)

    runner._execute = spy  # type: ignore[method-assign]

    def run() -> tuple[int, set[int]]:
        out = llm.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        return len(out[0].token_ids), os.sched_getaffinity(0)

    tokens, after = _in_a_thread(run)
    assert tokens == 4 and len(seen) == 4
    assert all(s == {thread_cpus()[0]} for s in seen)
    assert after == set(thread_cpus(bound=False))


@needs_cc
def test_the_c_build_is_cached_and_shared(tmp_path: Path) -> None:
    first = native.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    assert native.load(tmp_path) is native.load(tmp_path)  # loaded once per process


def test_without_a_compiler_the_engine_keeps_the_pytorch_path(
    tiny_bf16: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No compiler on PATH: a warning, decode_ops fixed at torch, generation still works, and
    forcing the C kernels is a clear error. A compiler that fails is the same."""
    failing = tmp_path / "bin" / "cc"
    failing.parent.mkdir()
    failing.write_text("#!/bin/sh\necho 'cc: error: no such thing' >&2\nexit 1\n")
    failing.chmod(0o755)
    others = "linear=plain,prefill_attention=sdpa,decode_math=native"  # only decode_ops open
    for path_env, cc in ((str(tmp_path / "empty"), ""), (str(failing.parent), str(failing))):
        cache = tmp_path / f"cache{len(cc)}"
        monkeypatch.setenv("PDSCOPE_CACHE", str(cache))
        monkeypatch.setenv("PATH", path_env)
        monkeypatch.setenv("CC", cc)
        with caplog.at_level("WARNING", logger="pdscope.engine"):
            llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels=others)
        assert any("C decode kernels unavailable" in r.getMessage() for r in caplog.records)
        assert (llm.engine.kernels.decode_ops, llm.engine.kernels.how["decode_ops"]) == (
            "torch",
            "fixed",
        )
        assert llm.engine.runner.model.native is None
        assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=4))[0].token_ids) == 4
        with pytest.raises(ValueError, match="decode_ops=c needs the C kernels"):
            LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels="decode_ops=c")
        with pytest.raises(ValueError, match="linear=c needs the C kernels"):
            LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels="linear=c")
        with pytest.raises(ValueError, match="threads=bound needs the C kernels"):
            LLM(model=str(tiny_bf16), kv_cache_memory="8MiB", kernels=f"{others},threads=bound")
        caplog.clear()


def test_bf16_matmuls_widen_to_float32_where_onednn_has_no_bf16(tiny_bf16: Path) -> None:
    """The rule, on whatever CPU runs this: matmul_math is float32 exactly where oneDNN cannot
    pack and run a bf16 linear (an AVX2-only CPU), and a float32 model never widens."""
    from pdscope.engine.model import onednn_bf16

    llm = LLM(model=str(tiny_bf16), kv_cache_memory="8MiB")
    assert llm.engine.kernels.matmul_math == ("native" if onednn_bf16() else "float32")
    assert llm.engine.kernels.how["matmul_math"] == "fixed"
    fp32 = LLM(model=str(tiny_bf16), dtype="float32", kv_cache_memory="8MiB")
    assert fp32.engine.kernels.matmul_math == "native"
    model = fp32.engine.runner.model
    assert not any(m.widen for m in model.modules() if hasattr(m, "widen"))


@pytest.mark.parametrize("rows", [1, 11, 12, 40])
def test_a_widened_linear_takes_float32_from_its_threshold(rows: int) -> None:
    """Under matmul_math=float32 a bf16 Linear widens from WIDEN_MIN_ROWS rows: the same
    function as F.linear, within one bf16 rounding, with float32 accumulation."""
    from pdscope.engine import model as model_module
    from pdscope.engine.model import WIDEN_MIN_ROWS, Linear

    gen = torch.Generator().manual_seed(3)
    layer = Linear(96, 40, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=gen) / 8)
    layer.widen = True
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    calls = []
    widened = model_module.linear_widened

    def counted(*args: torch.Tensor | None) -> torch.Tensor:
        calls.append(1)
        return widened(*args)  # type: ignore[arg-type]

    model_module.linear_widened = counted
    try:
        y = layer(x)
    finally:
        model_module.linear_widened = widened
    assert len(calls) == (1 if rows >= WIDEN_MIN_ROWS else 0)
    assert y.dtype == torch.bfloat16
    _assert_as_close_as_f_linear(y, x, layer.weight.detach(), layer.bias.detach())


def test_a_widened_weight_is_widened_a_slice_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """linear_widened widens at most WIDEN_SLICE_ELEMENTS of the weight at once (an LM head
    whole would be a float32 copy of hundreds of MB a step); the slices' outputs, bias and all,
    are the whole float32 matmul's, rounded once per output."""
    from pdscope.engine import model as model_module

    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(37, 96, generator=gen) / 8).to(torch.bfloat16)
    bias = torch.randn(37, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 13, 96, generator=gen).to(torch.bfloat16)
    whole = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).to(x.dtype)
    monkeypatch.setattr(model_module, "WIDEN_SLICE_ELEMENTS", 96 * 5)  # slices of 5 rows
    # within a bf16 rounding: a BLAS may block a 5-row product's sums unlike a 37-row one's
    tol = {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(model_module.linear_widened(x, weight, bias), whole, **tol)
    bare = torch.nn.functional.linear(x.float(), weight.float()).to(x.dtype)
    torch.testing.assert_close(model_module.linear_widened(x, weight, None), bare, **tol)


@needs_cc
def test_avx2_pairs_are_offered_and_the_one_call_step_reads_them(
    tiny_bf16: Path, v3_ops: native.NativeOps
) -> None:
    """The x86-64-v3 build's pairs kernels (AVX2; an AVX2-only CPU's): the linear trial offers
    one row as 8 and as 2 streams a thread, the batch_linear trial offers several rows (AVX2's
    tiles), and under linear=pairs2 the one-call decode step gives the per-kernel path's logits
    bit for bit, where the per-kernel path did read the copies (its calls are counted: in AVX2
    the two sums differ too rarely to tell them apart by the logits of a model this small)."""
    from dataclasses import replace

    from pdscope.engine import model as model_module

    llm = LLM(
        model=str(tiny_bf16),
        kv_cache_memory="8MiB",
        kernels="linear=c,batch_linear=packed,decode_ops=c",
        enable_prefix_caching=False,
    )
    model = llm.engine.runner.model
    trials = model_module.kernel_trials(model, 64, v3_ops)
    offered = set(trials["linear"]())
    assert {"pairs", "pairs2"} <= offered
    assert "pairs" in trials["batch_linear"]()

    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    runner = llm.engine.runner
    runner.capture_logits = True

    calls: list[int] = []
    pairs_call = v3_ops.linear_pairs

    def counted(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return pairs_call(x, *args, **kwargs)

    def logits(fused: bool) -> list[torch.Tensor]:
        apply_kernels(model, replace(llm.engine.kernels, linear="pairs2"), v3_ops)
        model.fuse_decode = model.fuse_logits = fused
        runner.captured = []
        llm.generate([5, 6, 7], greedy)
        return runner.captured

    v3_ops.linear_pairs = counted  # type: ignore[method-assign]
    try:
        per_kernel = logits(False)
    finally:
        del v3_ops.linear_pairs
    # the prefill's LM head on its last row, then 11 one-row steps of 4 matmuls a layer and the
    # LM head, all through the copies
    assert calls == [1] * (1 + 11 * (4 * len(model.layers) + 1))
    one_call = logits(True)
    assert model._decode_layers is not None and model._decode_layers[-1][1].pairs
    assert len(one_call) == len(per_kernel) == 12
    assert all(torch.equal(a, b) for a, b in zip(one_call, per_kernel, strict=True))


@pytest.mark.parametrize(
    ("others", "kept"),
    [("batch_linear=c", ("c", "plain")), ("batch_linear=packed", ("onednn", "onednn"))],
    ids=["as-stored", "packed"],
)
def test_the_weights_as_stored_past_32_rows_are_kept_within_a_wider_tie_on_amx(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, others: str, kept: tuple[str, str]
) -> None:
    """Where the C kernels have AMX tiles and single rows and 2-32 rows read the weight as
    stored, big_batch_linear=c and prefill_linear=plain let every weight be held once with no
    copy (no packed weights, no transposed or pairs copy): kept while they time within
    HELD_ONCE_TIE of the fastest (set medians: 1.06x; the pairs copies 1.2x, so as not to be
    on their own way); with batch_linear on the packed weights, oneDNN's (a packed copy is
    kept anyway)."""
    from pdscope.engine.model import ROWS_SPLIT_MIN_ROWS

    fresh_cache(tmp_path, monkeypatch)
    ops = native.load(tmp_path / "native")
    if ops is None or ops.linear_many_isa != "amx":
        pytest.skip("no AMX tiles in this build of the C kernels, CPU or kernel")
    _between_the_margins(monkeypatch, ("c", "plain"), ("pairs", "transposed"))
    llm = _engine_with_a_prefill_trial(tmp_path, f"linear=amx,{others}")
    rows = ROWS_SPLIT_MIN_ROWS
    choice = llm.engine.kernels
    assert (choice.big_batch_linear, choice.prefill_linear) == kept, choice.summary()
    assert choice.how["prefill_linear"] == choice.how["big_batch_linear"] == "measured"
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    stored = kept == ("c", "plain")
    assert all((m.packed is None) == stored for m in linears)
    assert all(m.pairs is None and m.weight_t is None and not m.held_once for m in linears)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate([list(range(10, 10 + rows - 8))], greedy)[0]  # one chunk past 64 rows
    assert len(out.token_ids) == 4


def test_prefill_linear_plain_is_undone_where_a_later_reset_keeps_the_packed_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prefill_linear=plain, kept within HELD_ONCE_TIE to let the packed weights go, saves
    nothing once a later step puts a smaller matmul back on them: batch_linear=pairs, kept
    within its own margin on the way to the copies (linear=pairs2), is reset to the fastest,
    packed, when the paths past 32 rows did not follow. Then plain and big_batch_linear take
    their fastest too (oneDNN, c). The trials' picks and times are set here (the real trials
    run for the other paths), as the engine's own trials cannot be steered to them per path."""
    from dataclasses import replace

    from pdscope.engine import llm_engine

    fresh_cache(tmp_path, monkeypatch)
    ops = native.load(tmp_path / "native")
    if ops is None or not ops.pairs or not can_pack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no pairs kernels, or no oneDNN bf16, here")
    real = llm_engine.choose
    paths = ("linear", "batch_linear", "big_batch_linear", "prefill_linear")

    def kept_within_margins(*args: object, **kwargs: object) -> KernelChoice:
        choice = real(*args, **kwargs)  # type: ignore[arg-type]
        times = {
            "batch_linear=packed": 1.0, "batch_linear=pairs": 1.06, "batch_linear=c": 1.2,
            "big_batch_linear=c": 1.0, "big_batch_linear=pairs": 1.2,
            "prefill_linear=onednn": 1.0, "prefill_linear=plain": 1.06,
        }  # fmt: skip
        others = {k: t for k, t in choice.trial_s.items() if k.split("=")[0] not in paths}
        return replace(
            choice, linear="pairs2", batch_linear="pairs", big_batch_linear="c",
            prefill_linear="plain", how={**choice.how, **dict.fromkeys(paths, "measured")},
            trial_s={**others, **times},
        )  # fmt: skip

    monkeypatch.setattr(llm_engine, "choose", kept_within_margins)
    llm = _engine_with_a_prefill_trial(tmp_path, "auto")
    choice = llm.engine.kernels
    assert [getattr(choice, p) for p in paths] == ["pairs2", "packed", "c", "onednn"], (
        choice.summary()
    )
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None and not m.plain_rows for m in linears)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate([list(range(10, 500))], greedy)[0]  # one chunk past 64 rows
    assert len(out.token_ids) == 4


def test_a_list_of_liked_candidates_keeps_the_first_within_its_own_margin() -> None:
    """prefer's list form (prefill_linear=plain within HELD_ONCE_TIE, else oneDNN within TIE):
    the first candidate within its margin of the fastest is kept, a name not timed is passed
    over, and none qualifying leaves the fastest."""
    from pdscope.engine.kernels import _tie_pick

    times = {"transposed": 1.0, "onednn": 1.02, "plain": 1.06}
    assert _tie_pick(times, [("plain", 0.10), "onednn"]) == "plain"
    assert _tie_pick(times, [("plain", 0.05), "onednn"]) == "onednn"
    assert _tie_pick(times, [("pairs", 0.50), ("plain", 0.05), ("onednn", 0.01)]) == "transposed"
    assert _tie_pick(times, None) == "transposed"


def test_linear_amx_is_kept_within_the_wider_tie_against_the_copies_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With AMX tiles linear=amx is kept within HELD_ONCE_TIE of the pairs copies (they are one
    copy more); where a path that reads the weight or the packed copy is the fastest, the
    fastest is taken (amx would save nothing against it). Set medians: the copies fastest,
    amx 1.06x; then amx 1.06x, the copies and c 1.2x, packed and plain alike."""
    from pdscope.engine.kernels import PAIRS_LINEAR

    fresh_cache(tmp_path, monkeypatch)
    ops = native.load(tmp_path / "native")
    if ops is None or ops.linear_many_isa != "amx" or not ops.pairs:
        pytest.skip(
            "no AMX tiles or no pairs kernels in this build of the C kernels, CPU or kernel"
        )
    path = make_model(tmp_path / "m", "tiny", dtype="bfloat16")
    # the copies the fastest at one row: amx kept (packed and plain 1.2x too)
    monkeypatch.setattr(
        "pdscope.engine.kernels.median_times_s",
        lambda candidates, **_: {
            n: 1.0 if n in PAIRS_LINEAR else 1.06 if n == "amx" else 1.2 for n in candidates
        },
    )
    kept = LLM(model=str(path), kv_cache_memory="8MiB").engine.kernels
    assert (kept.linear, kept.how["linear"]) == ("amx", "measured")
    # another path the fastest: taken, not amx (the choice measured again: no cache)
    _between_the_margins(monkeypatch, ("amx",), ("c", "pairs", "pairs2"))
    shutil.rmtree(tmp_path / "kernels")
    fastest = LLM(model=str(path), kv_cache_memory="8MiB").engine.kernels
    assert fastest.linear in ("packed", "plain"), fastest.summary()
