"""`pdscope probe`: one server's prefill and decode, measured apart, compared, explained.

The procedure: recognise the server, one cold request (reported apart), a prompt-length sweep at
a fixed output length with repeats, a prefix-cache check (three long prefixes, each sent twice),
a context check (decode at short vs long context). Every request becomes a Trace;
analysis/probe.py turns the traces into figures and findings.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx

from pdscope.analysis.probe import (
    BATCH_SWEEP_LABEL,
    JOIN_LABEL,
    JOIN_NEW_LABEL,
    PREFIX_TAIL_TOKENS,
    Ceilings,
    ModelBytes,
    analyze,
    batch_joint,
    cache_hit,
)
from pdscope.analysis.stats import median
from pdscope.client.adapters import (
    API_OLLAMA,
    API_OPENAI_CHAT,
    API_OPENAI_COMPLETIONS,
    APIS,
    run_request,
)
from pdscope.client.adapters import session as adapter_session
from pdscope.client.counters import PrefixHitCounter
from pdscope.client.detect import ProbeError, Runtime, detect
from pdscope.client.prompts import PromptBuilder
from pdscope.client.trace import UNREAD, Trace
from pdscope.commands.flags import at_least, int_list
from pdscope.specs.models import ModelSpec, read_config
from pdscope.specs.precisions import WeightPrecision


@dataclass
class ProbeSettings:
    url: str
    api: str = "auto"
    model: str | None = None
    api_key: str | None = None
    prompt_tokens: list[int] = field(default_factory=lambda: [200, 500, 1000, 2000])
    output_tokens: int = 64
    repeats: int = 3
    # Seconds allowed per request; None: TIMEOUT_S, or more where the rates read predict more
    timeout_s: float | None = None
    max_model_len: int | None = None  # cap for the sweep when the server does not say
    prefix_tokens: int | None = None  # default: the sweep's longest prompt
    context_tokens: int | None = None  # default: 3/4 of the max length (capped at 8k)
    device: str | None = None  # for the ceiling: catalog name or "local"
    plan_model: str | None = None  # preset or config.json for the ceiling
    dtype: str | None = None  # weight precision for the ceiling (default: checkpoint's)
    # Streams sent at once for the batched-decode check: a step carrying several decodes is the
    # point `simulate --calibrate` fits the per-sequence cost from (0 skips the check).
    batch_streams: int = 8
    # More stream counts for the batched decode at short prompts, ascending: a server's step is
    # not linear in its sequences where it switches kernels (one row against a batch), and
    # `simulate --calibrate` fits the per-sequence cost between every pair of measured sizes.
    batch_sweep: list[int] = field(default_factory=lambda: [2, 32])
    # Prompt length of the second batched-decode check, the same streams at long context: its
    # steps read the batch's KV beside the weights (0 skips it).
    batch_context_tokens: int = 1024
    # Prompts are drawn fresh for every probe so no run meets an earlier one's prompts in the
    # server's prefix cache; a seed repeats a run's prompts exactly (recorded in the result).
    seed: int | None = None

    @classmethod
    def from_flags(
        cls, url: str | None, prompt_tokens: str, batch_sweep: str = "2,32", **fields: Any
    ) -> ProbeSettings:
        """The CLI's flags, checked (a ``ValueError`` names the flag). No URL: the embedded
        server, whose ceiling is this machine's (``device`` defaults to local)."""
        sweep = [] if batch_sweep.strip() == "0" else int_list(batch_sweep, "--batch-sweep")
        s = cls(
            url=url or "",
            prompt_tokens=int_list(prompt_tokens, "--prompt-tokens"),
            batch_sweep=sweep,
            **fields,
        )
        if s.api != "auto" and s.api not in APIS:
            raise ValueError(f"--api must be auto or one of {', '.join(APIS)}, got {s.api!r}")
        at_least(1, ("--output-tokens", s.output_tokens), ("--repeats", s.repeats))
        at_least(
            0, ("--batch-streams", s.batch_streams), ("--batch-context", s.batch_context_tokens)
        )
        if s.batch_streams == 1:  # one stream is the sweep's decode again, not a batch
            raise ValueError("--batch-streams takes 2 or more, or 0 to skip the batched checks")
        if 1 in s.batch_sweep:
            raise ValueError("--batch-sweep takes counts of 2 or more, or 0 to skip the sweep")
        # --batch-streams' count is measured by the batched check itself; 0 sends no batch
        s.batch_sweep = [n for n in s.batch_sweep if n != s.batch_streams and s.batch_streams]
        if s.timeout_s is not None and s.timeout_s <= 0:
            raise ValueError(f"--timeout must be positive, got {s.timeout_s}")
        if s.max_model_len is not None:
            at_least(1, ("--max-model-len", s.max_model_len))
        if url is None:
            s.device = s.device or "local"
        s._check_ceiling_flags()
        return s

    def _check_ceiling_flags(self) -> None:
        """The ceiling's facts, checked before the run (they were read, or ignored, after it)."""
        from pdscope.specs import SpecError, get_device, get_weight_precision, load_model

        if not self.device and (self.plan_model or self.dtype):
            raise ValueError("--plan-model and --dtype set the ceiling, which needs --device")
        try:
            if self.device and self.device.lower() != "local":
                get_device(self.device)
            spec = load_model(self.plan_model) if self.plan_model else None
            weights = get_weight_precision(self.dtype) if self.dtype else None
            if spec is not None and weights is not None:
                from pdscope.roofline.arithmetic import check_weights

                check_weights(spec, weights)
        except SpecError as exc:
            raise ValueError(str(exc)) from None


BATCH_PROMPT_TOKENS = 64  # the batched-decode check's prompts: short, so decode dominates
# The join check's prompts, sent among decoding streams: each prefills in one step with them.
JOIN_PROMPT_TOKENS = (128, 1024)
JOIN_WINDOW_S = 1.0  # the join check's streams decode this long at least
JOIN_MAX_OUTPUT = 2048  # and this many tokens at most
PREFIX_PAIRS = 3  # prefix-cache check: fresh prefixes, each sent cold then warm
MIN_PREFIX_TOKENS = 256  # its shared prefix: many KV blocks whatever the server's block size
# A decode check whose response could not be read (it came whole, or in bursts) is sent again
# with a fresh prompt, this many times in a run at most: a server that never streams (behind
# a buffering proxy) costs a few requests more, not every check thrice.
RESENDS = 4
TIMEOUT_S = 120.0  # a request's limit by default, and before the server's rates are read
# By default a request that the server's rates read so far predict longer is allowed this many
# times its prediction: a 7B-shaped model served on 2 CPU cores (bf16, Zen 4) prefilled 31
# tok/s, and its batch of 32 streams of 64-token prompts needed more than 120 s: every one of
# the 32 timed out, and 6 of the 8 streams of 1,024-token prompts.
TIMEOUT_MARGIN = 3.0
# The requests sent alone whose prefill and decode rates predict the others'
SOLO_LABELS = ("sweep", "prefix-cold", "context-short", "context-long")
MIN_RATE_PROMPT_TOKENS = 128  # prompts whose time per token the prefill prediction reads


def carried_fewer(carried: int, sent: int) -> bool:
    """Whether a server decoded clearly fewer of ``sent`` streams at once than it was sent: two
    fewer or more, and at most 80% of them. One fewer is how a loaded client reads a fast
    server's 8 (their first and last tokens overlap 7 at most), and none read (a failure, a
    buffering proxy) says nothing of its slots."""
    return 0 < carried <= 0.8 * sent and sent - carried >= 2


@dataclass(frozen=True)
class Sent:
    """A check's ``requests``, sent together where ``together`` is over 1, each
    ``prompt_tokens`` long then ``output_tokens``, ``more_prefill`` prompt tokens more sent
    among them."""

    label: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    together: int = 1
    more_prefill: int = 0


class Prober:
    def __init__(
        self,
        s: ProbeSettings,
        client: httpx.AsyncClient,
        runtime: Runtime,
        model: str,
        tick: Callable[[str], None],
        streams: aiohttp.ClientSession,
        seed: int = 0,
    ):
        self.s, self.client, self.runtime, self.model, self.tick = s, client, runtime, model, tick
        self.streams = streams  # generation requests; `client` for everything else
        self.headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else None
        self.api = runtime.api if s.api == "auto" else s.api
        exact = self.api == API_OPENAI_COMPLETIONS and runtime.has_tokenize
        self.builder = PromptBuilder(
            client, runtime.url, model, exact, self.headers, seed, runtime.tokenize_key
        )
        self.traces: list[Trace] = []
        self.resent = 0  # decode checks sent again, RESENDS at most
        self.resending: set[int] = set()  # ids of answers whose check is being sent again
        self.skipped_sizes: list[int] = []  # batch sweep sizes over what the server carried
        self.join_ran = False  # the join check sent its streams
        self.together = 0  # the most streams the batched checks saw decoding at once
        self.join_skipped: str | None = None  # why the join check sent nothing
        self.join_streams: int | None = None  # how many it sends (None: not decided yet)
        self.kept_unread = 0  # unread responses kept as they came: no resend was left
        self.on_total: Callable[[int], None] | None = None  # told the requests planned, anew
        # told after each answer what the rates read predict is left (None: nothing yet)
        self.on_left: Callable[[float | None], None] | None = None
        # Run before each sweep size and after the last (--device local: a bandwidth reading)
        self.between: Callable[[], None] | None = None
        self.longest_allowed_s = 0.0  # the longest limit a request was given
        # A bound on a step of each batch of short prompts sent, by streams: the slowest time
        # per output token its streams read, times the turns a server that carried fewer took
        self.batch_step_s: dict[int, float] = {}
        self.counter = (
            PrefixHitCounter(client, runtime.url, self.headers) if runtime.has_metrics else None
        )

    @property
    def exact_prompts(self) -> bool:
        return self.builder.use_tokenize

    async def prompt(self, tokens: int) -> list[int] | str:
        return await self.builder.ids(tokens) if self.exact_prompts else self.builder.text(tokens)

    async def send(
        self,
        prompt: list[int] | str,
        asked: int,
        label: str,
        max_tokens: int | None = None,
        count_hits: bool = True,
        learn: bool = True,
        progress: Callable[[Trace], None] | None = None,
        together: int = 1,
        more_prefill: int = 0,
        limit_s: float | None = None,
    ) -> Trace:
        """``learn``: the prompt builder learns tokens per word from the server's count.
        ``progress``: sees the trace as its stream is read. ``together`` and ``more_prefill``:
        what is sent with it, which its limit allows for (:meth:`allowed_s`); ``limit_s``: a
        limit set by the caller in its place."""
        out = max_tokens or self.s.output_tokens
        allowed_s = limit_s or self.allowed_s(asked, out, together, more_prefill)
        self.longest_allowed_s = max(self.longest_allowed_s, allowed_s)
        # The hit counter is read before and after: only meaningful for one request at a time.
        counter = self.counter if count_hits else None
        hits_before = await counter.read() if counter else None
        trace = await run_request(
            self.streams, self.runtime.url, self.api, self.model, prompt, out, label, asked,
            self.headers, progress, allowed_s,
        )  # fmt: skip
        if learn and trace.error is None and not self.exact_prompts and isinstance(prompt, str):
            words = len(prompt.split())
            self.builder.calibrate(words, trace.prompt_tokens)
        hits_after = await counter.read() if counter else None
        if hits_before is not None and hits_after is not None and counter:
            delta = round(hits_after - hits_before)
            trace.server["prefix_cache_hits_delta"] = {counter.label: delta}
            if trace.cached_source is None:  # the server's own per-request count wins
                trace.cached_tokens = delta
                trace.cached_source = "metrics-counter"
        self.traces.append(trace)
        self.tick(label)
        if self.on_left:
            self.on_left(self.left_s())
        return trace

    def allowed_s(
        self, prompt_tokens: int, output_tokens: int, together: int = 1, more_prefill: int = 0
    ) -> float:
        """Seconds one of ``together`` requests sent at once is allowed (each ``prompt_tokens``
        long, then ``output_tokens``; ``more_prefill`` prompt tokens more sent among them):
        --timeout where given, else TIMEOUT_S, or TIMEOUT_MARGIN times what the rates read so
        far predict where that is longer. The prediction: every prompt at the median prefill
        rate of the requests sent alone (of MIN_RATE_PROMPT_TOKENS or more where there are
        such: a short prompt's time is mostly what every request pays), then each output
        token a step of the streams, no longer than the tightest of the bounds the steps read
        give: a step read with k streams, times ``together / k`` where that is over 1 (a
        step grows with its streams, at most in proportion); no step read, none (a response
        that came whole has its decode in its first token's time)."""
        if self.s.timeout_s is not None:
            return self.s.timeout_s
        predicted_s = self.predicted_s(prompt_tokens, output_tokens, together, more_prefill)
        if predicted_s is None:
            return TIMEOUT_S
        return max(TIMEOUT_S, float(math.ceil(TIMEOUT_MARGIN * predicted_s)))

    def predicted_s(
        self,
        prompt_tokens: int,
        output_tokens: int,
        together: int = 1,
        more_prefill: int = 0,
        rates: tuple[float, dict[int, float]] | None = None,
    ) -> float | None:
        """Seconds the rates read so far (``rates``, where the caller read them already: see
        :meth:`rates`) predict for ``together`` requests sent at once (see :meth:`allowed_s`);
        None before any prefill rate is read."""
        rates = rates or self.rates()
        if rates is None:
            return None
        per_token, steps = rates
        step_s = min((s * max(1.0, together / k) for k, s in steps.items()), default=0.0)
        prefill_s = (together * prompt_tokens + more_prefill) * per_token
        return prefill_s + output_tokens * step_s

    def rates(self) -> tuple[float, dict[int, float]] | None:
        """Seconds a prompt token and, by streams decoding together, bounds on a step's seconds
        (see :meth:`allowed_s`); None before any prefill rate is read."""
        solo = [t for t in self.traces if t.ok and t.label in SOLO_LABELS and not cache_hit(t)]
        sized: list[tuple[float, int]] = [
            (t.ttft_s, n)
            for t in solo
            if t.ttft_s and (n := max(t.prompt_tokens or 0, t.prompt_tokens_asked or 0)) > 0
        ]
        long = [(ttft_s, n) for ttft_s, n in sized if n >= MIN_RATE_PROMPT_TOKENS]
        per_token = median([ttft_s / n for ttft_s, n in long or sized])
        if per_token is None:
            return None
        steps = dict(self.batch_step_s)
        one = [1 / t.decode_tok_s for t in solo if t.decode_tok_s]
        if one:
            steps[1] = max(one)
        return per_token, steps

    async def decode_check(self, tokens: int, label: str) -> Trace:
        """One fresh prompt whose decode is measured. A response that answered with tokens to
        time but whose decode could not be read (it reached the client whole, or in bursts:
        on a busy host a fast server's 8-token answer can arrive so) is relabelled ``label +
        UNREAD`` and the check sent again with a fresh prompt while resends are left; past
        them it is kept as it came, and counted."""
        trace = await self.send(await self.prompt(tokens), tokens, label)
        while True:
            # A cache hit is left out of the figures for that already; a resend would only
            # draw a prompt a repeated --seed's earlier run never sent.
            unread = trace.ok and (trace.n_output or 0) >= 2 and not cache_hit(trace)
            unread = unread and (trace.decode_tok_s is None or trace.read_in_bursts)
            if not unread:
                return trace
            if self.resent >= RESENDS:
                self.kept_unread += 1
                return trace
            self.resent += 1
            if self.on_total:
                self.on_total(self.planned_requests())
            with self.builder.aside():  # a repeated --seed still sends this run's prompts
                prompt = await self.prompt(tokens)
            self.resending.add(id(trace))  # not the check's answer while its resend runs
            try:
                resent = await self.send(prompt, tokens, label, learn=False)
            finally:
                self.resending.discard(id(trace))
            # Relabelled once its resend is in: a resend cut short (Ctrl-C, an error) leaves
            # the check this answer.
            trace.label, trace = label + UNREAD, resent

    async def run(self) -> None:
        s = self.s
        await self.send(await self.prompt(s.prompt_tokens[0]), s.prompt_tokens[0], "cold")
        for n in s.prompt_tokens:
            if self.between:
                self.between()
            for _ in range(s.repeats):
                await self.decode_check(n, "sweep")
        if self.between:
            self.between()
        tail_n, p = PREFIX_TAIL_TOKENS, self.prefix_tokens
        # Several fresh prefixes, each sent cold then warm: the check compares medians, so one
        # request disturbed by the host cannot turn a working cache into a "not reused".
        for _ in range(PREFIX_PAIRS):
            shared = await self.prompt(p)
            for label in ("prefix-cold", "prefix-warm"):
                tail = await self.prompt(tail_n)
                prompt = shared + tail if isinstance(shared, list) else f"{shared} {tail}"
                await self.send(prompt, p + tail_n, label)
        short = self.fitting(64)
        # Short and long interleaved (short, long, short, long): a host's speed drifting
        # through the check moves both alike, where two shorts then two longs read the drift
        # as context's cost.
        for _ in range(2):
            for label, n in (("context-short", short), ("context-long", self.context_tokens)):
                await self.decode_check(n, label)
        if s.batch_streams > 1:
            # Short fresh prompts sent together: after their prefills, every step decodes all
            # of them at once (what one stream's figures cannot show: the cost per sequence).
            carried = await self.batch(self.fitting(BATCH_PROMPT_TOKENS), "batch-decode")
            # The most streams the server may have carried at once (streams the client got
            # whole count as carried), and whether it ever clearly carried fewer
            # than it was sent (Ollama's parallel slots, a --max-num-seqs): then a larger batch
            # is carried no further.
            most, short = carried, carried_fewer(carried, s.batch_streams)
            if s.batch_context_tokens:
                await self.batch(s.batch_context_tokens, "batch-decode-long")
            # The sweep's other sizes, ascending; those over a limit seen are not sent.
            for n in s.batch_sweep:
                if short and n > most:
                    self.skipped_sizes.append(n)
                    continue
                label = f"{BATCH_SWEEP_LABEL}{n}"
                carried = await self.batch(self.fitting(BATCH_PROMPT_TOKENS), label, n)
                most, short = max(most, carried), short or carried_fewer(carried, n)
            if self.skipped_sizes and self.on_total:
                self.on_total(self.planned_requests())
            # Room for the join check's one new prompt at a time beside its streams: fewer
            # than the most seen decoding at once. Not `most`: counting streams the client got
            # whole (as the sweep must) filled llama.cpp's 4 slots in 1 of 14 runs beside a
            # busy process, and the new prompts waited for the streams to end.
            await self.join(min(s.batch_streams, self.together - 1) if short else s.batch_streams)

    async def join(self, streams: int) -> None:
        """The batched check's streams again, and JOIN_PROMPT_TOKENS prompts sent among them
        one at a time: the step that runs a prompt's prefill beside decodes. It shows what a
        prompt costs the streams already running, and is what `simulate --calibrate` fits a
        prefill step's own cost from (a prompt timed alone holds it together with the HTTP
        time outside any step). Each prompt is sent a quarter further into the streams'
        decode, counted in the chunks the furthest stream has delivered (the tokens asked,
        times the batched check's chunks per token: a server may send several tokens in a
        chunk, or none for a token whose text it holds back). A time planned from the batched
        check's step sent both prompts after the streams had ended in 3 of 14 runs against
        llama.cpp beside a busy process: in one, that check's mean gap read 3.6x the
        streams' own. The decode lasts JOIN_WINDOW_S at least by the batched check's step (a
        tiny model's steps of a fraction of a ms would end before a prompt's HTTP request
        reached the server), as far as the context allows (and JOIN_MAX_OUTPUT tokens).
        ``streams``: how many decode (2 at least, or none)."""
        self.join_ran = streams >= 2
        ref = [t for t in self.traces if t.label == "batch-decode" and t.ok and t.streamed]
        ttft = median([t.ttft_s for t in ref if t.ttft_s is not None])
        step = self.batch_gap_s()
        if ttft is None or not step > 0 or streams < 2:
            self.join_ran = False
            self.join_skipped = (
                f"the batched checks saw {max(streams + 1, 0)} streams decoding at once at "
                "most: no room for a prompt beside two"
                if streams < 2
                else "the batched check read no step to size its window from"
            )
            streams = 0
        if streams != self.s.batch_streams:
            self.join_streams = streams  # fewer than planned: the progress total follows
            if self.on_total:
                self.on_total(self.planned_requests())
        if not streams:
            return
        short = self.fitting(BATCH_PROMPT_TOKENS)
        prompts = [await self.prompt(short) for _ in range(streams)]
        sizes = [self.fitting(n) for n in JOIN_PROMPT_TOKENS]
        new = [await self.prompt(n) for n in sizes]
        out = self.join_output(step)
        # the new prompts too: where the server has no slot for one, it waits for the streams
        limit_s = self.allowed_s(short, out, streams, sum(sizes))

        tokens = sum(t.n_output or len(t.chunks) for t in ref)
        chunks_per_token = sum(len(t.chunks) for t in ref) / tokens
        delivered = [0] * streams  # chunks each stream has delivered so far
        ended = [False] * streams
        moved = asyncio.Event()

        def seen(i: int) -> Callable[[Trace], None]:
            def progress(trace: Trace) -> None:
                delivered[i] = len(trace.chunks)
                moved.set()

            return progress

        async def stream(i: int) -> None:
            try:
                await self.send(
                    prompts[i], short, JOIN_LABEL, out, count_hits=False, progress=seen(i),
                    limit_s=limit_s,
                )  # fmt: skip
            finally:
                ended[i] = True
                moved.set()

        async def joiner(k: int) -> None:
            # bounded: every stream ends, and then it is sent at once; never two at once
            target = max(k + 1, out * (k + 1) / (len(sizes) + 2) * chunks_per_token)
            while max(delivered) < target and not all(ended):
                moved.clear()
                await moved.wait()
            await self.send(
                new[k], sizes[k], JOIN_NEW_LABEL, max_tokens=2, count_hits=False, limit_s=limit_s
            )

        await asyncio.gather(
            *(stream(i) for i in range(streams)), *(joiner(k) for k in range(len(sizes)))
        )

    def batch_gap_s(self) -> float:
        """The batched check's mean gap between tokens (a client read in bursts sinks the
        median): only to size the join check's window; 0.0 before it is read."""
        ref = [t for t in self.traces if t.label == "batch-decode" and t.ok and t.streamed]
        gaps = [gap for t in ref for gap in t.itl_samples_s()]
        return sum(gaps) / len(gaps) if gaps else 0.0

    def join_output(self, step_s: float) -> int:
        """Tokens the join check's streams ask for: JOIN_WINDOW_S of steps of ``step_s`` (no
        fewer than --output-tokens, JOIN_MAX_OUTPUT at most), as far as the context allows."""
        out = self.s.output_tokens
        if step_s > 0:
            out = min(max(out, math.ceil(JOIN_WINDOW_S / step_s)), JOIN_MAX_OUTPUT)
        if self.max_len:
            out = max(1, min(out, self.max_len - self.fitting(BATCH_PROMPT_TOKENS) - 32))
        return out

    async def batch(self, prompt_tokens: int, label: str, streams: int | None = None) -> int:
        """Fresh prompts of one length sent together, so their decodes share steps. Returns
        the most of them the server may have decoded at once (0 when none streamed), counting
        a stream the client got whole as among them: it has no window to place, and leaving it
        out could make a loaded client look like a server's limit and stop the sweep."""
        streams = streams or self.s.batch_streams
        prompts = [await self.prompt(prompt_tokens) for _ in range(streams)]
        traces = await asyncio.gather(
            *(
                self.send(p, prompt_tokens, label, count_hits=False, together=streams)
                for p in prompts
            )
        )
        ok = [t for t in traces if t.ok]
        joint = batch_joint(ok)
        self.together = max(self.together, joint.streams if joint else 0)
        carried = min(len(ok), joint.streams + sum(not t.streamed for t in ok)) if joint else 0
        tpot = [t.tpot_s for t in ok if t.tpot_s]
        # short prompts only: the long batch's steps read its KV too (keyed alike, it raised
        # the short batches' bound: the 7B-shaped model's 8 streams, 3 at a time, to 3.8 s)
        if tpot and prompt_tokens <= BATCH_PROMPT_TOKENS:
            # A server that carried fewer at once ran them in turns: a token of each of them
            # took that many steps (a stream's own TPOT leaves its wait out).
            step_s = max(tpot) * streams / max(1, carried)
            self.batch_step_s[streams] = max(step_s, self.batch_step_s.get(streams, 0.0))
        return carried

    @property
    def prefix_tokens(self) -> int:
        """The prefix-cache check's shared prefix (a tail of PREFIX_TAIL_TOKENS follows it)."""
        if self.s.prefix_tokens:
            return self.s.prefix_tokens
        # At least MIN_PREFIX_TOKENS: a prefix shorter than a server's KV block (16 tokens in
        # vLLM) cannot be cached, and its "not reused" would be a false finding.
        tail_n = PREFIX_TAIL_TOKENS
        return max(
            1, self.fitting(max(self.s.prompt_tokens[-1], MIN_PREFIX_TOKENS) + tail_n) - tail_n
        )

    @property
    def context_tokens(self) -> int:
        if self.s.context_tokens:
            return self.s.context_tokens
        if not self.max_len:  # a context the server does not say: the usual 4,096's share
            return int(4096 * 0.75)
        limit = self.max_len
        # with room for the check's output, and for a text prompt a few tokens over its mark
        # (fitting's 32 would leave a 64-token server's long check no longer than its short)
        room = limit - self.s.output_tokens - min(32, limit // 16)
        return max(1, min(8192, int(limit * 0.75), room))

    @property
    def max_len(self) -> int | None:
        return self.s.max_model_len or self.runtime.max_model_len

    def fitting(self, prompt_tokens: int) -> int:
        """A fixed check length, shortened where the server's context has less room (as
        _cap_sweep sizes the sweep's)."""
        if not self.max_len:
            return prompt_tokens
        return max(1, min(prompt_tokens, self.max_len - self.s.output_tokens - 32))

    def planned(self) -> list[Sent]:
        """What :meth:`run` sends, in its order, as now planned (resends left out)."""
        s, out = self.s, self.s.output_tokens
        plan = [Sent("cold", 1, s.prompt_tokens[0], out)]
        plan += [Sent("sweep", 1, n, out) for n in s.prompt_tokens for _ in range(s.repeats)]
        tail_n = PREFIX_TAIL_TOKENS
        for _ in range(PREFIX_PAIRS):
            # the warm one is predicted a hit: its tail alone to prefill
            plan += [Sent("prefix-cold", 1, self.prefix_tokens + tail_n, out)]
            plan += [Sent("prefix-warm", 1, tail_n, out)]
        for _ in range(2):
            plan += [Sent("context-short", 1, self.fitting(64), out)]
            plan += [Sent("context-long", 1, self.context_tokens, out)]
        streams = s.batch_streams
        if streams <= 1:
            return plan
        short = self.fitting(BATCH_PROMPT_TOKENS)
        plan += [Sent("batch-decode", streams, short, out, streams)]
        if s.batch_context_tokens:
            plan += [Sent("batch-decode-long", streams, s.batch_context_tokens, out, streams)]
        for n in s.batch_sweep:
            if n not in self.skipped_sizes:
                plan += [Sent(f"{BATCH_SWEEP_LABEL}{n}", n, short, out, n)]
        join = streams if self.join_streams is None else self.join_streams
        if join:
            sizes = [self.fitting(n) for n in JOIN_PROMPT_TOKENS]
            joined = self.join_output(self.batch_gap_s())
            plan += [Sent(JOIN_LABEL, join, short, joined, join, sum(sizes))]
            # their prefill is predicted with the streams they join
            plan += [Sent(JOIN_NEW_LABEL, len(sizes), 0, 0)]
        return plan

    def planned_requests(self) -> int:
        return sum(sent.requests for sent in self.planned()) + self.resent

    def left_s(self) -> float | None:
        """Seconds the rates read so far predict for what is planned and not yet answered (a
        group sent together: its share not answered); None before any prefill rate is read."""
        rates = self.rates()
        if rates is None:
            return None
        answered: dict[str, int] = {}
        for t in self.traces:
            if id(t) not in self.resending:
                answered[t.label] = answered.get(t.label, 0) + 1
        total_s = 0.0
        for sent in self.planned():
            done = min(answered.get(sent.label, 0), sent.requests)
            answered[sent.label] = answered.get(sent.label, 0) - done
            if done == sent.requests:
                continue
            predicted_s = self.predicted_s(
                sent.prompt_tokens, sent.output_tokens, sent.together, sent.more_prefill, rates
            )
            assert predicted_s is not None  # rates given
            total_s += predicted_s * (sent.requests - done) / sent.requests
        return total_s


def _cap_sweep(s: ProbeSettings, max_len: int | None) -> list[str]:
    """Size every check to the server's context, so no request is sent that must fail."""
    notes = []
    whose = "--max-model-len" if s.max_model_len else "the server's max length"
    if max_len:
        room = max_len - s.output_tokens - 32
        if room < 16:
            raise ProbeError(
                f"{whose} of {max_len} tokens leaves no room for a prompt with "
                f"{s.output_tokens} output tokens: lower --output-tokens"
            )
        capped = sorted({min(n, room) for n in s.prompt_tokens if n > 0})
        if capped != sorted(s.prompt_tokens):
            notes.append(f"prompt lengths capped at {room} tokens by {whose} {max_len}")
        s.prompt_tokens = capped
        if s.prefix_tokens:
            s.prefix_tokens = min(s.prefix_tokens, room - 16)
        elif s.prompt_tokens[-1] + 16 > room:
            s.prefix_tokens = room - 16
        if s.context_tokens and s.context_tokens > room:
            notes.append(f"context check capped at {room} tokens by {whose} {max_len}")
            s.context_tokens = room
        if s.batch_context_tokens > room:
            s.batch_context_tokens = room
    return notes


async def _ollama_context(
    client: httpx.AsyncClient, url: str, model: str, headers: dict[str, str] | None
) -> tuple[int | None, str]:
    """The context Ollama serves this model with (its num_ctx), and where that came from.

    /api/ps gives the loaded model's context_length (recent versions); /api/show gives num_ctx
    when the Modelfile sets it. The model's trained length in model_info is not what Ollama
    serves (it runs at num_ctx, 2,048 tokens in older releases), so it is never used."""
    try:
        ps = (await client.get(f"{url}/api/ps", headers=headers)).json()
        for m in ps.get("models") or []:
            if model in (m.get("name"), m.get("model")) and m.get("context_length"):
                return int(m["context_length"]), "/api/ps context_length"
    except (httpx.HTTPError, ValueError, TypeError, AttributeError):
        pass
    try:
        show = (await client.post(f"{url}/api/show", json={"model": model}, headers=headers)).json()
        found = re.search(r"num_ctx\s+(\d+)", str(show.get("parameters") or ""))
        if found:
            return int(found.group(1)), "/api/show num_ctx"
    except (httpx.HTTPError, ValueError, TypeError, AttributeError):
        pass
    return None, ""


def _dtype_of(s: ProbeSettings, root: str | None) -> str | None:
    """The weights' --dtype for the arithmetic: given, else the quantization the plan model
    (--plan-model, else the served checkpoint) ships with (an AWQ checkpoint's torch_dtype
    says float16 of 4-bit weights; DeepSeek-V3's preset ships fp8), else None for a GGUF (its
    tensors' own bytes, plan.weights_for), else the served checkpoint's torch_dtype, else
    bf16."""
    if s.dtype:
        return s.dtype
    spec = _spec(s.plan_model or root)
    if spec is not None and spec.shipped_dtype is not None:
        return spec.shipped_dtype
    if spec is not None and spec.file_weights is not None:
        return None
    if root and (Path(root) / "config.json").is_file():
        torch_dtype = read_config(Path(root)).get("torch_dtype")
        return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(torch_dtype, "bf16")
    return "bf16"


def _weights(s: ProbeSettings, root: str | None) -> WeightPrecision:
    """The precision the ceiling counts (as ceilings_for resolves it): what the local matmul
    is timed in."""
    from pdscope.commands.plan import weights_for
    from pdscope.specs.precisions import get_weight_precision

    dtype = _dtype_of(s, root)
    spec = _spec(s.plan_model or root)
    return weights_for(spec, dtype) if spec is not None else get_weight_precision(dtype or "bf16")


def _spec(name: str | None) -> ModelSpec | None:
    if not name:
        return None
    from pdscope.specs import SpecError
    from pdscope.specs.models import load_model

    try:
        return load_model(name)
    except SpecError:
        return None


def model_bytes_for(s: ProbeSettings, root: str | None) -> ModelBytes | None:
    """What one decode step reads for the plan model (or the served checkpoint): needs no
    device, so the context check can be split into bytes and the rest on any server."""
    from pdscope.commands.plan import weights_for
    from pdscope.roofline import arithmetic as rf
    from pdscope.specs import SpecError
    from pdscope.specs.models import load_model
    from pdscope.specs.precisions import get_kv_precision

    name = s.plan_model or root
    if not name:
        return None
    try:
        spec = load_model(name)
        weights = weights_for(spec, _dtype_of(s, root))
        kv = get_kv_precision(weights.name if weights.name in ("fp32", "bf16", "fp16") else "bf16")
        read = rf.read_bytes(spec, weights)  # refuses a --dtype the model cannot take
    except SpecError:
        return None
    return ModelBytes(
        model=spec.name,
        params=spec.total_params,
        weight_bytes=read,
        kv_bytes=lambda n: float(rf.kv_bytes_at_context(spec, kv, max(n, 0))),
    )


# The arrays a bandwidth reading streams (float32, `pdscope plan --device local`'s reading at
# half its size): the triad's three are past every last-level cache seen here; the sum's one
# is not past the model-207 Xeon's 300 MiB of L3, yet read there as at 1,024 MiB (0.99x,
# docs/performance.md): its rate does not come from the cache.
READING_MIB = 256
READING_REPEATS = 3


def measure_local(compute: str) -> tuple[float, float, str]:
    """This machine's streaming read bandwidth (GB/s), ``compute`` matmul rate (TFLOP/s) and
    the words saying it ran in float32 where that was faster (specs.local.computed_in_note),
    now."""
    from pdscope.specs.local import computed_in_note, measure

    m = measure(compute, array_mib=READING_MIB, repeats=READING_REPEATS)
    return m.bandwidth_gb_s, m.matmul_tflops, computed_in_note(m)


@dataclass
class LocalReadings:
    """This machine read around a probe's requests (--device local): on a shared machine
    another tenant can halve either rate for minutes, and a verdict against the roofline needs
    the rate of the seconds it judges. The bandwidth is read before the requests, before each
    sweep size, after the sweep and after the requests (about 0.3 s each); the matmul rate,
    which only the prefill verdict's peak takes, before and after."""

    compute: str  # the matmul's type: the model's compute type
    bandwidth_gb_s: list[float] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)  # each reading's middle, perf_counter
    tflops: list[float] = field(default_factory=list)
    computed_in: str = ""

    def read(self, matmul: bool = False) -> None:
        from pdscope.specs.local import bandwidth_gb_s

        start = time.perf_counter()
        if matmul:
            gb_s, tflops, note = measure_local(self.compute)
            self.tflops.append(tflops)
            self.computed_in = self.computed_in or note
        else:  # the stream part of measure_local, alone
            gb_s = bandwidth_gb_s(READING_MIB, READING_REPEATS)
        self.bandwidth_gb_s.append(gb_s)
        self.times_s.append((start + time.perf_counter()) / 2)


def ceilings_for(
    s: ProbeSettings,
    output_tokens: int,
    root: str | None,
    readings_gb_s: list[float],
    readings_tflops: list[float] | None = None,
    computed_in: str = "",
    times_s: list[float] | None = None,
) -> tuple[Ceilings | None, list[str]]:
    """The roofline for this model on the given device, when both are known. On this machine
    ('local') the bandwidth is the mean of the readings taken around the probe (``times_s``:
    when, for the readings around each sweep point), and the peak FLOP/s the best of the matmul
    readings, timed in the model's compute type (another tenant only slows a matmul: one
    slowed reading put a real prefill at 132% of the floor)."""
    if not s.device:
        return None, []
    from pdscope.commands.plan import local_compute, resolve
    from pdscope.roofline import arithmetic as rf
    from pdscope.specs import SpecError
    from pdscope.specs.local import last_level_cache_bytes

    model = s.plan_model or root
    if not model:
        return None, ["no model for the ceiling: pass --plan-model (a preset or config.json)"]
    local = s.device.lower() == "local"
    mean_gb_s = sum(readings_gb_s) / len(readings_gb_s) if local and readings_gb_s else None
    tflops = list(readings_tflops or []) if local else []
    dtype = _dtype_of(s, root)
    try:
        p = resolve(
            model=model,
            device=s.device,
            dtype=dtype,
            bandwidth_gb_s=mean_gb_s,
            tflops=max(tflops) if tflops else None,
        )
    except SpecError as exc:
        return None, [f"no ceiling: {exc}"]
    notes = []
    if p.model.quantization and not s.dtype and p.model.shipped_dtype is None:
        notes.append(
            f"the checkpoint ships quantized ({p.model.quantization}), which no --dtype states: "
            f"the ceiling counts it as {dtype}; pass --dtype for a closer one"
        )

    def decode(n: int) -> float:  # the mean context during the decode: prompt + half the output
        return rf.decode_ceiling_tok_s(p.model, p.device, p.weights, p.kv, n + output_tokens // 2)

    def floor(n: int) -> float | None:
        step = rf.prefill_step(p.model, p.device, p.weights, p.kv, n)
        return None if step.compute_s is None else step.seconds

    label = (
        p.device.label
        if not local
        else "this machine ("
        + _readings_words(readings_gb_s, "{:.1f}", "GB/s", "around the requests")
        + (
            f", {local_compute(p.weights)} matmul "
            + _readings_words(tflops, "{:.3f}", "TFLOP/s", "before and after" + computed_in)
            if tflops
            else ""
        )
        + ")"
    )
    return (
        Ceilings(
            label,
            decode,
            floor,
            model=p.model.name,
            model_params=p.model.total_params,
            bandwidth_readings_gb_s=list(readings_gb_s) if local else [],
            bandwidth_times_s=list(times_s or []) if local else [],
            tflops_readings=tflops,
            peak_tflops=None
            if (peak := p.device.peak_flops(p.weights.compute)) is None
            else peak / 1e12,
            weight_bits=p.weights.bits_per_weight,
            # this CPU's cache, where the server is on this machine
            cache_bytes=last_level_cache_bytes() if local and _loopback(s.url) else None,
        ),
        notes,
    )


def _readings_words(values: list[float], form: str, unit: str, when: str) -> str:
    """'20.1 and 19.8 GB/s measured before and after', or for more readings their range:
    '18.2-20.1 GB/s in 6 readings around the requests'."""
    if len(values) <= 2:
        said = " and ".join(form.format(v) for v in values)
        return f"{said} {unit} measured {when}"
    low, high = form.format(min(values)), form.format(max(values))
    return f"{low}-{high} {unit} in {len(values)} readings {when}"


def _loopback(url: str) -> bool:
    """Whether ``url`` names this machine (localhost, a loopback address, or 0.0.0.0, which a
    client's connection reaches here too)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
        return address.is_loopback or address.is_unspecified
    except ValueError:
        return False


# Ollama's num_ctx when nothing says otherwise: 2,048 in releases before 0.6 (later ones serve
# more), so checks sized to it fit every release.
OLLAMA_DEFAULT_CONTEXT = 2048
INTERRUPTED = "interrupted (Ctrl-C)"
INTERRUPTED_LOOKUP_S = 3.0


async def probe(
    s: ProbeSettings,
    on_start: Callable[[int], None] | None = None,
    tick: Callable[[str], None] = lambda label: None,
    on_left: Callable[[float | None], None] | None = None,
) -> dict[str, Any]:
    """Run the whole procedure; returns the JSON-ready result (traces included). ``on_left``
    is told after each answer the seconds the rates read predict are left."""
    limits = httpx.Limits(max_keepalive_connections=0)
    timeout = httpx.Timeout(s.timeout_s or TIMEOUT_S, connect=10)
    started = time.time()
    async with (
        httpx.AsyncClient(limits=limits, timeout=timeout) as client,
        adapter_session(s.timeout_s or TIMEOUT_S, fresh_connections=True) as streams,
    ):
        headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else None
        runtime = await detect(client, s.url, s.api, headers)
        model = runtime.pick_model(s.model)
        if s.api == API_OPENAI_CHAT and runtime.api == API_OLLAMA:
            raise ProbeError(f"{runtime.url} speaks Ollama's API, not openai-chat")
        notes: list[str] = []
        if runtime.name == "ollama" and not (s.max_model_len or runtime.max_model_len):
            runtime.max_model_len, source = await _ollama_context(
                client, runtime.url, model, headers
            )
            if runtime.max_model_len is None:
                runtime.max_model_len = OLLAMA_DEFAULT_CONTEXT
                notes.append(
                    f"Ollama did not say its context (num_ctx): checks sized to "
                    f"{OLLAMA_DEFAULT_CONTEXT} tokens, its smallest default; pass --max-model-len"
                )
            else:
                runtime.evidence.append(f"{source} {runtime.max_model_len}")
        if s.max_model_len and runtime.max_model_len and s.max_model_len > runtime.max_model_len:
            notes.append(
                f"--max-model-len {s.max_model_len:,} is above the {runtime.max_model_len:,} "
                "tokens the server reports: checks are sized to the flag, and a request past "
                "the server's context may fail"
            )
        notes += _cap_sweep(s, s.max_model_len or runtime.max_model_len)
        seed = s.seed if s.seed is not None else secrets.randbelow(2**31)
        prober = Prober(s, client, runtime, model, tick, streams, seed)
        if not prober.exact_prompts:
            notes.append(
                "no /tokenize for this API: prompt sizes are calibrated from the "
                "server's reported prompt counts; figures use the reported counts"
            )
        if on_start:
            on_start(prober.planned_requests())
            prober.on_total = on_start
        prober.on_left = on_left
        local = (s.device or "").lower() == "local"
        compute = "bf16"
        served: dict[str, Any] | None = None
        if local:
            # The matmul readings are timed in the model's compute type, found from the served
            # checkpoint's config (or --dtype) before the requests.
            from pdscope.commands.plan import local_compute

            served = await _served_model(client, runtime, model, headers)
            compute = local_compute(_weights(s, served.get("root")))
        readings = LocalReadings(compute)
        if local:
            readings.read(matmul=True)
            prober.between = readings.read
        partial = None
        try:
            await prober.run()
        except (httpx.HTTPError, aiohttp.ClientError, ProbeError, OSError, ValueError) as exc:
            # ValueError: the server's /tokenize failed mid-run (the prompt builder's one line)
            partial = f"stopped early: {type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            # Ctrl-C (asyncio.run cancels this task): what was measured is analysed and kept,
            # marked partial, as bench keeps its finished requests. A second Ctrl-C still stops.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            partial = INTERRUPTED
        if local:
            readings.read(matmul=True)
        try:
            # Asked once: before the requests where the matmul readings needed it. After
            # Ctrl-C the user waits: two quick questions, not two of --timeout each.
            limit_s = INTERRUPTED_LOOKUP_S if partial == INTERRUPTED else None
            if served is None:
                served = await asyncio.wait_for(
                    _served_model(client, runtime, model, headers), limit_s
                )
        except TimeoutError:
            served = {"name": model, "max_model_len": runtime.max_model_len}

    root = served.get("root")
    ceilings, more = ceilings_for(
        s,
        s.output_tokens,
        root,
        readings.bandwidth_gb_s,
        readings.tflops,
        readings.computed_in,
        readings.times_s,
    )
    notes += more
    result = analyze(
        prober.traces, runtime.name, ceilings, model_bytes_for(s, root), served_model=served
    )
    unread = [t for t in prober.traces if t.label.endswith(UNREAD)]
    if unread:
        whole = sum(t.decode_tok_s is None for t in unread)
        notes.append(
            f"{len(unread)} response(s) whose decode could not be read ({whole} came whole, "
            f"{len(unread) - whole} in bursts) were sent again with fresh prompts; kept in the "
            f"traces labelled '*{UNREAD}', left out of every figure"
        )
    if prober.skipped_sizes:
        notes.append(
            f"batch sweep: {', '.join(map(str, prober.skipped_sizes))} streams not sent: the "
            "server decoded fewer streams at once than an earlier batch sent it"
        )
    if prober.join_skipped:
        notes.append(f"join check: not run: {prober.join_skipped}")
    if prober.join_ran and not result.get("prefill_join"):
        join = [t for t in prober.traces if t.label == JOIN_LABEL and t.ok and t.streamed]
        bursty = sum(t.read_in_bursts for t in join)
        why = (
            f"the client read {bursty} of its {len(join)} streams in bursts (their gaps time "
            "the client; two read steadily are needed)"
            if len(join) - bursty < 2
            else "no new prompt's first token came while two or more of the streams decoded "
            "with a gap that could hold its prefill (they ended first, the server queued "
            "it, or their text was held back around it)"
        )
        notes.append(f"join check: {why}: no prefill step was timed inside a batch")
    if prober.longest_allowed_s > (s.timeout_s or TIMEOUT_S):
        notes.append(
            f"requests the server's rates read predicted long were allowed up to "
            f"{prober.longest_allowed_s:,.0f} s ({TIMEOUT_MARGIN:g}x the prediction; "
            f"{TIMEOUT_S:g} s the others): --timeout sets one limit for all"
        )
    if prober.kept_unread:
        notes.append(
            f"{prober.kept_unread} more response(s) whose decode could not be read were kept as "
            f"they came ({RESENDS} resends a run): their decode figures read the client"
        )
    if prober.traces and all(t.cached_source is None for t in prober.traces if t.ok):
        notes.append(
            "the server reports no cached-token count and has no prefix-hit counter: a cache "
            "hit cannot be ruled out"
            + (" (--seed repeats earlier prompts)" if s.seed is not None else "")
        )
    return {
        "runtime": {
            "name": runtime.name,
            "version": runtime.version,
            "url": runtime.url,
            "api": prober.api,
            "evidence": runtime.evidence,
            "max_model_len": prober.max_len,
        },
        "model": model,
        "served_model": served,
        "settings": {
            "prompt_tokens": s.prompt_tokens,
            "output_tokens": s.output_tokens,
            "repeats": s.repeats,
            "exact_prompt_tokens": prober.exact_prompts,
            "context_tokens": prober.context_tokens,
            "batch_streams": s.batch_streams,
            "batch_sweep": s.batch_sweep,
            "batch_sweep_skipped": prober.skipped_sizes,
            "batch_context_tokens": s.batch_context_tokens,
            "device": s.device,
            "timeout_s": s.timeout_s,  # None: TIMEOUT_S, or more where predicted
            "longest_allowed_s": prober.longest_allowed_s,
            "seed": seed,
            "seed_given": s.seed is not None,
        },
        "prefix_counter": prober.counter.label if prober.counter and prober.counter.name else None,
        "started_unix_s": started,
        "partial": partial,
        "notes": notes,
        **result,
        "traces": [t.to_dict() for t in prober.traces],
    }


async def _llamacpp_model_path(
    client: httpx.AsyncClient, url: str, headers: dict[str, str] | None
) -> str | None:
    """The GGUF file a llama.cpp server loaded (/props model_path), where this machine can read
    it: plan's arithmetic then counts its tensors' own bytes, no --plan-model needed."""
    from pdscope.specs.gguf import is_gguf

    try:
        path = (await client.get(f"{url}/props", headers=headers)).json().get("model_path")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return path if isinstance(path, str) and is_gguf(Path(path)) else None


def _same_file(path: str, weight_bytes: float | None) -> bool:
    """Whether the GGUF at ``path`` on this machine holds the tensors the server says it loaded
    (a remote server's path can name another file here)."""
    from pdscope.specs import SpecError
    from pdscope.specs.gguf import read_gguf

    try:
        return weight_bytes is not None and read_gguf(Path(path)).total_bytes == weight_bytes
    except (SpecError, OSError):
        return False


def _modelfile_gguf(modelfile: object) -> str | None:
    """The GGUF file an Ollama modelfile's FROM line names (Ollama's /api/show gives the blob's
    path there), where this machine can read it."""
    from pdscope.specs.gguf import is_gguf

    if not isinstance(modelfile, str):
        return None
    for line in modelfile.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word.upper() == "FROM" and is_gguf(Path(rest.strip()).expanduser()):
            return rest.strip()
    return None


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


async def _served_model(
    client: httpx.AsyncClient, runtime: Runtime, model: str, headers: dict[str, str] | None
) -> dict[str, Any]:
    """What the server says about the model it serves: name, context, parameter count where it
    exposes one (Ollama's /api/show, llama.cpp's /v1/models meta, a checkpoint's config), the
    weights' bytes and type where it says (llama.cpp), and a local checkpoint (`root`: the
    directory pdscope and vLLM give, the GGUF file llama.cpp's /props and Ollama's modelfile
    name, where this machine can read it)."""
    out: dict[str, Any] = {"name": model, "max_model_len": runtime.max_model_len}
    if runtime.api == API_OLLAMA or runtime.name in ("ollama", "pdscope"):
        try:
            show = await client.post(
                f"{runtime.url}/api/show", json={"model": model}, headers=headers
            )
            body = show.json() if show.status_code == 200 else {}
            info = body.get("model_info") or {}
            if isinstance(info.get("general.parameter_count"), int | float):
                out["params"] = float(info["general.parameter_count"])
            if runtime.name == "ollama" and (blob := _modelfile_gguf(body.get("modelfile"))):
                out["root"] = blob  # the GGUF blob it loaded, where this machine can read it
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
    if runtime.api != API_OLLAMA:
        try:
            data = (await client.get(f"{runtime.url}/v1/models", headers=headers)).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            data = []
        entry = next((m for m in data if m.get("id") == model), data[0] if data else {})
        # llama.cpp describes the GGUF it loaded: parameters, the tensors' bytes, their type
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
        if _positive(meta.get("n_params")):
            out["params"] = float(meta["n_params"])
        if _positive(meta.get("size")):
            out["weight_bytes"] = float(meta["size"])
            if isinstance(meta.get("ftype"), str):
                out["weights_type"] = meta["ftype"]
        root = entry.get("root")
        if runtime.name == "llama.cpp":  # the GGUF it loaded, readable where it runs here
            root = await _llamacpp_model_path(client, runtime.url, headers)
            if root and _same_file(root, out.get("weight_bytes")):
                out["root"] = root
        elif root and Path(root, "config.json").is_file():
            out["root"] = root
            if "params" not in out:
                from pdscope.specs import SpecError
                from pdscope.specs.models import load_model

                with contextlib.suppress(SpecError):
                    out["params"] = load_model(root).total_params
    return out
