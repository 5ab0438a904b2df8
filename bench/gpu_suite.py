"""One run, every headline number of issue 44: specgate against mlx-lm on the same model.

    python bench/gpu_suite.py [--shape 7b] [--reps 5] [--only plain,batched,mtp,ngram] [--json FILE]
    python bench/gpu_suite.py --tiny --reps 2          # the same path on a CPU, small (tests/test_gpu_suite.py)

Sections, each a table of median [min, max] over --reps interleaved repeats
(each repeat runs both sides, alternating which goes first; a ratio is taken
within a repeat, then summarised):
- plain:   specgate's plain engine (MLXPlainEngine, its async generate(), as
           the gateway drives it, on the model as loading prepares it:
           loading.prepare_for_decoding) vs mlx-lm's generate_step on the
           same weights as built: decode tok/s (the tokens after the first), prefill tok/s
           (a --prefill-tokens prompt, a new one each repeat, no prefix
           cache) and TTFT; greedy, outputs compared token for token.
- batched: aggregate tok/s and median TTFT at --streams concurrent requests:
           the plain engine (that many generate() calls at once) vs mlx-lm's
           BatchGenerator driven directly (all inserted, next() until done).
- mtp:     MTP at depths 1..4, acceptance --accept by construction
           (bench/e2e_mtp_7b.py's target and oracle drafts), stock verify
           and, where the guard proves them, specgate's kernels, and the
           product's GPU path ("ahead": rounds queued one ahead and
           compiled, mlx_spec/ahead.py and ahead_round.py, with the kernels
           where proved), each over generate_step; every output compared
           with generate_step's.
- batchspec: speculation inside the decode batch (issue 45): at
           --spec-streams streams, mlx-lm's BatchGenerator (first in each
           repeat: its tokens are the oracle's references) and then
           engines/mlx_spec/batch_decoder.py's BatchSpecDecoder at each of
           --spec-depths (MTP, acceptance --accept by construction, the
           kernels proved at the batch's verify widths), aggregate tok/s
           over BatchGenerator's; every stream compared with its output.
- batchengine: the same through the engines the gateway serves (issue
           45): at --spec-streams concurrent requests, specgate's plain
           engine (continuous batching; first in each repeat: its tokens
           are the oracle's references) and then its MTP SpecEngine at each
           of --spec-depths (oracle drafts, every request held to the
           depth; the engine proves its verify kernels itself, lone widths
           then batch widths, before the timed runs), aggregate tok/s over
           the plain engine's; every stream compared with its output.
           `--sides ... policy` adds the gateway's policy over both engines
           (PolicySide: each request on the plan it picks, handed between
           them as its planner says; no tune prior): issue 45's "at 16+
           streams the policy falls back to plain and loses < 3 %".
- ngram:   the agent transcripts (bench/agent_transcripts.json) on
           bench/agent_workloads.py's synthetic copying target, through the
           engines and the policy the gateway would build: per transcript
           specgate plain, n-gram and the policy over generate_step, their
           geomean and worst over the copy-heavy ones, and the policy's
           lowest single request over specgate plain (issue 44: >= 0.9x).
The model (--shape 7b): mlx-lm's qwen3 at a 7B shape (hidden 4096, 28 layers,
32/8 heads, MLP 12288, vocab 151936), random weights at 4 bits with
e2e_mtp_7b.py's bigram path, so greedy decoding is stable and known; --tiny
is a small shape with fewer tokens, for a CPU. A section that fails prints
its traceback and the run goes on; the exit status is 0 unless the
arguments are bad (2).

On the GPU machine (MLX's CUDA build; nothing can be fetched there), from
the repo root here:
    bash ../shared/tools/gpu-mlx/fetch-wheels.sh && bash bench/device/fetch-wheels.sh
then three device calls, one right after the other (a call carries the
repo and at most 64 MiB: MLX's CUDA wheel travels in three parts):
    1. carry .gpu-mlx/a:  bash bench/device/on-device.sh stage .gpu-mlx/a
    2. carry .gpu-mlx/a2: bash bench/device/on-device.sh stage .gpu-mlx/a2
    3. carry .gpu-mlx/b:  source bench/device/on-device.sh install &&
                          python3 bench/gpu_suite.py --json $OUT/suite.json
(bench/device/fetch-wheels.sh adds specgate's core dependencies the image
lacks to .gpu-mlx/b, which on-device.sh installs with MLX).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import math
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

SECTIONS = ("plain", "batched", "mtp", "batchspec", "batchengine", "ngram")
SHAPES = {  # hidden, layers, mlp, heads, kv heads, head dim, vocab
    "7b": (4096, 28, 12288, 32, 8, 128, 151936),
    "tiny": (64, 2, 128, 2, 1, 32, 512),
}
GREEDY_PLAN = ("mlx_plain", "none", 0, "no_drafter")


# ---------------------------------------------------------------- summaries


def summary(xs: list[float], fmt: str = ".2f") -> str:
    """median [min, max]"""
    if not xs:
        return "-"
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]"


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    sys.stdout.flush()


@dataclass
class Run:
    """One decode: its tokens, when it started, and when each token came."""

    tokens: list[int] = field(default_factory=list)
    t0: float = 0.0
    times: list[float] = field(default_factory=list)
    drafted: int = 0  # a speculative engine's rounds: drafts, and those that stood
    accepted: int = 0
    batched: int = 0  # rounds that ran in a batch of 2 or more
    rounds: int = 0

    @property
    def ttft(self) -> float:
        return self.times[0] - self.t0

    @property
    def decode_tps(self) -> float:
        """Tokens after the first, over the time after the first arrived."""
        dt = self.times[-1] - self.times[0]
        return (len(self.tokens) - 1) / dt if dt > 0 else float("nan")


# ---------------------------------------------------------------- mlx-lm's side


def generate_step_run(model, prompt: list[int], n: int) -> Run:
    from mlx_lm.generate import generate_step

    run = Run(t0=time.perf_counter())
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                  sampler=lambda lp: mx.argmax(lp, axis=-1)):  # fmt: skip
        run.times.append(time.perf_counter())
        run.tokens.append(int(token))
    return run


def batch_generator_runs(model, prompts: list[list[int]], n: int) -> tuple[list[Run], float]:
    """mlx-lm's BatchGenerator alone: every prompt inserted at once, next()
    until each has n tokens. The runs, and the wall time of the whole."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n, sampler=lambda lp: mx.argmax(lp, axis=-1))
    t0 = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
    runs = {uid: Run(t0=t0) for uid in uids}
    done = 0
    try:
        while done < len(uids):
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                runs[r.uid].tokens.append(int(r.token))
                runs[r.uid].times.append(now)
                done += r.finish_reason is not None
    finally:
        gen.close()
    return [runs[u] for u in uids], time.perf_counter() - t0


# ---------------------------------------------------------------- specgate's plain engine


class Driven:
    """A specgate engine on an in-memory model, driven through its async
    generate() on an event loop of its own, as the gateway does."""

    def __init__(self, engine):
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.engine.start())
        self._n = 0

    def request(self, rid: str, prompt: list[int], n: int):
        """(GenerationRequest, planner) for one prompt."""
        from specgate.engines.base import GenerationRequest, Plan, SamplingParams

        plan = Plan(*GREEDY_PLAN)
        return GenerationRequest(rid, "suite", prompt, SamplingParams(temperature=0), n, plan), None

    async def _one(self, prompt: list[int], n: int) -> Run:
        from specgate.engines.base import RoundStats, TokenEvent

        self._n += 1
        request, planner = self.request(f"suite-{self._n}", prompt, n)
        run = Run(t0=time.perf_counter())
        async for event in self.engine.generate(request, planner):
            if isinstance(event, TokenEvent) and event.token_ids:
                now = time.perf_counter()
                run.times += [now] * len(event.token_ids)
                run.tokens += event.token_ids
            elif isinstance(event, RoundStats):
                run.drafted += event.drafted
                run.accepted += event.accepted
                run.batched += event.batch > 1
                run.rounds += 1
        return run

    def one(self, prompt: list[int], n: int) -> Run:
        return self.loop.run_until_complete(self._one(prompt, n))

    def many(self, prompts: list[list[int]], n: int) -> tuple[list[Run], float]:
        async def all_():
            return await asyncio.gather(*(self._one(p, n) for p in prompts))

        t0 = time.perf_counter()
        runs = self.loop.run_until_complete(all_())
        return list(runs), time.perf_counter() - t0

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.stop())
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()


def loaded_model(model, vocab: int):
    from agent_workloads import _NoTokenizer

    from specgate.engines.cache.prefix_cache import PrefixCache
    from specgate.engines.loading import LoadedModel

    return LoadedModel("suite", model, _NoTokenizer(), {"model_type": "qwen3", "vocab_size": vocab},
                       PrefixCache("suite", 0))  # fmt: skip


class PlainEngine(Driven):
    """specgate's MLXPlainEngine. Its batch steps' kernels (engines/mlx_plain/
    kernels.py) are proved in the background; `wait` (the sections that time
    it alone) waits for them, so no proof runs beside a timed run."""

    def __init__(self, model, vocab: int, max_concurrent: int, loaded=None, kernels: str = "auto",
                 wait: bool = True):  # fmt: skip
        from specgate.engines.mlx_plain import MLXPlainEngine

        t0 = time.perf_counter()
        # No prefix cache: every repeat pays its whole prefill, as mlx-lm's side does.
        engine = MLXPlainEngine("suite", loaded or loaded_model(model, vocab), max_context=32768,
                                max_concurrent=max_concurrent, prefix_cache_size=0, kernels=kernels)  # fmt: skip
        if wait:
            decided = engine.kernels_ready(900)
            print(f"[plain engine] batch steps {'through the kernels' if engine.batch_kernels.on else 'stock'}"
                  f"{'' if decided else ' (still proving)'}, {time.perf_counter() - t0:.1f} s after "
                  f"its load", flush=True)  # fmt: skip
        super().__init__(engine)


class OracleSpecEngine(Driven):
    """specgate's SpecEngine for MTP (its batching: concurrent requests
    decode in one BatchSpecDecoder, engine.py), each request's drafts its
    oracle's (e2e_mtp_7b.OracleDrafts at acceptance `accept`, against the
    reference set for its prompt), held to `depth` by a FixedPlanner as a
    forced method is. The engine proves and switches its verify kernels
    itself (kernel_proofs.py, the batch widths after the lone ones).
    `ahead`: on a GPU, each request an OracleAhead (bench/round_phases.py)
    as the engine makes greedy MTP requests AheadDecoders, so a batch's
    rounds run ahead (mlx_spec/batch_ahead.py); off, each reads its round
    before the next is built (decoder.py's rounds, alone and batched)."""

    def __init__(self, model, head, vocab: int, accept: float, max_depth: int, seed: int, loaded=None):
        import e2e_mtp_7b
        from round_phases import OracleAhead, oracle_hook

        from specgate.engines.drafting.base import Drafting
        from specgate.engines.drafting.mtp.proposer import MTPProposer
        from specgate.engines.mlx_spec.ahead_round import CompiledRounds
        from specgate.engines.mlx_spec.batch_ahead import CompiledBatchRounds
        from specgate.engines.mlx_spec.decoder import SpecDecoder
        from specgate.engines.mlx_spec.engine import SpecEngine
        from specgate.engines.settings import MTPSettings

        refs: dict[tuple[int, ...], list[int]] = {}
        self.refs, self.depth, self.ahead = refs, 1, True
        seeds = itertools.count(seed)
        outer = self

        def drafting(loaded, target, drafter=None, settings=None):
            return Drafting("mtp", lambda t: MTPProposer(t, head), weights=head, kernel_module=head)

        class Engine(SpecEngine):
            def make_decoder(self, request, cache, cached_tokens):
                reference = refs[tuple(request.prompt_tokens)]
                if self.ahead and outer.ahead:
                    return OracleAhead(self.target, MTPProposer(self.target, head), request, cache, cached_tokens,
                                       self.tokenizer, self.prefill_step_size, reference=reference,
                                       accept=accept, seed=next(seeds), vocab=vocab,
                                       rounds=self._rounds if self.compiled_rounds else None)  # fmt: skip
                oracle = e2e_mtp_7b.OracleDrafts(self.target, head, reference=refs[tuple(request.prompt_tokens)],
                                                 accept=accept, seed=next(seeds), vocab=vocab)  # fmt: skip
                return SpecDecoder(self.target, oracle, request, cache, cached_tokens, self.tokenizer,
                                   self.prefill_step_size)  # fmt: skip

        super().__init__(Engine("suite", loaded or loaded_model(model, vocab), name="mlx_mtp",
                                drafting=drafting, max_context=32768,
                                settings=MTPSettings(depth=max_depth)))  # fmt: skip
        # The engine's compiled rounds (alone and batched), with the oracle's
        # hook; alone, built in the background first, as the engine's own.
        e = self.engine
        e._rounds = CompiledRounds(e.target, head, oracle_hook(vocab), warm_first=True,
                                   warm_lock=e.loaded.lock)  # fmt: skip
        e._batch_rounds = CompiledBatchRounds(e.target, head, oracle_hook(vocab), warm_first=True,
                                              warm_lock=e.loaded.lock)  # fmt: skip

    def request(self, rid: str, prompt: list[int], n: int):
        from specgate.engines.base import GenerationRequest, Plan, SamplingParams
        from specgate.policies.decide import FixedPlanner

        plan = Plan("mlx_mtp", "mtp", self.depth, "forced_by_request")
        return (GenerationRequest(rid, "suite", prompt, SamplingParams(temperature=0), n, plan),
                FixedPlanner(plan))  # fmt: skip


class PolicySide:
    """Requests planned as the gateway plans them: the LivePolicy the gateway
    builds for a model with the plain engine and the MTP SpecEngine above
    (sharing one loaded model, so its lock), each request started on the
    policy's plan and handed between the engines as the policy's planner
    says, every round's stats observed. No tune prior (a fresh machine):
    the policy's rules, and what live rounds measure. A burst counts its
    requests not yet in an engine as the model's planning state does."""

    def __init__(self, plain: PlainEngine, spec: OracleSpecEngine, depth: int):
        from specgate.engines.registry import MLX, BuildContext
        from specgate.engines.settings import MTPSettings
        from specgate.policies.config import PolicyConfig
        from specgate.policies.model_policy import LivePolicy, build_policy, timed_methods

        self.loop, self.spec = plain.loop, spec
        self.engines = {"mlx_plain": plain.engine, "mlx_mtp": spec.engine}
        ctx = BuildContext("suite", "suite", MLX, engines=tuple(self.engines),
                           settings={"mlx_mtp": MTPSettings(depth=depth)}, loaded=plain.engine.loaded)  # fmt: skip
        self.policy = LivePolicy(build_policy("suite", self.engines, {}, PolicyConfig(), context=ctx,
                                              params=None),
                                 live_state=self.planning_state, timed=timed_methods(self.engines))  # fmt: skip
        self.arrived = 0  # requests of a burst not yet in an engine
        self.methods: dict[str, int] = {}  # tokens by the method that decoded them
        # Plans decided, each request's first and every handoff's, as
        # method/reason/source: a batch trial shows as mtp/concurrency/explore.
        self.plans: dict[str, int] = {}
        self._n = 0

    def planning_state(self, arriving: bool = False):
        from specgate.engines.base import LiveState

        states = [e.live_state() for e in self.engines.values()]
        return LiveState(sum(s.active_requests for s in states),
                         sum(s.waiting_requests for s in states) + max(0, self.arrived - arriving), 0)  # fmt: skip

    async def _one(self, prompt: list[int], n: int) -> Run:
        from specgate.engines.base import (
            GenerationRequest,
            Handoff,
            RoundStats,
            SamplingParams,
            TokenEvent,
        )
        from specgate.policies.decide import RequestFeatures

        self._n += 1
        plan, planner = self.policy.start(RequestFeatures(len(prompt), False, content="code"),
                                          self.planning_state(arriving=True))  # fmt: skip
        self.arrived -= 1
        self._count(plan)
        request = GenerationRequest(f"policy-{self._n}", "suite", prompt, SamplingParams(temperature=0), n, plan)
        run, engine, resume, method = Run(t0=time.perf_counter()), self.engines[plan.engine], None, plan.method
        while engine is not None:
            events, following = engine.generate(request, planner, resume=resume), None
            async for event in events:
                if isinstance(event, Handoff):
                    following, resume, method = self.engines[event.plan.engine], event, event.plan.method
                    self._count(event.plan)
                    break
                if isinstance(event, RoundStats):
                    self.policy.observe(event, "code")
                    run.drafted += event.drafted
                    run.accepted += event.accepted
                    run.batched += event.batch > 1
                    run.rounds += 1
                elif isinstance(event, TokenEvent) and event.token_ids:
                    now = time.perf_counter()
                    run.times += [now] * len(event.token_ids)
                    run.tokens += event.token_ids
                    self.methods[method] = self.methods.get(method, 0) + len(event.token_ids)
            await events.aclose()
            engine = following
        return run

    def _count(self, plan) -> None:
        key = f"{plan.method}/{plan.reason}/{plan.source}"
        self.plans[key] = self.plans.get(key, 0) + 1

    def many(self, prompts: list[list[int]], n: int) -> tuple[list[Run], float]:
        async def all_():
            self.arrived = len(prompts)  # the burst arrives at once
            return await asyncio.gather(*(self._one(p, n) for p in prompts))

        self.spec.ahead = True  # the engine's own way on a GPU
        t0 = time.perf_counter()
        runs = self.loop.run_until_complete(all_())
        return list(runs), time.perf_counter() - t0


# ---------------------------------------------------------------- the target


def target_args(a) -> argparse.Namespace:
    """bench/e2e_mtp_7b.py's builder arguments for this run's shape."""
    hidden, layers, mlp, heads, kv, hd, vocab = SHAPES[a.shape]
    return argparse.Namespace(hidden=hidden, layers=layers, mlp=mlp, heads=heads, kv_heads=kv,
                              head_dim=hd, vocab=vocab, seed=a.seed, embed_scale=16.0,
                              margin=20.0)  # fmt: skip


def bigram_target(a):
    """e2e_mtp_7b's qwen3 with the bigram path and an MTP head, at 4 bits."""
    import e2e_mtp_7b

    t = target_args(a)
    model, head, _ = e2e_mtp_7b.build(t)
    nn.quantize(model, group_size=64, bits=4)
    nn.quantize(head, group_size=64, bits=4)
    mx.eval(model.parameters(), head.parameters())
    return model, head, t.vocab


def prompts_for(rng: random.Random, vocab: int, length: int, count: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


# ---------------------------------------------------------------- the sections


def served_model(a):
    """The bigram target again (the same seed: the same weights), prepared as
    loading prepares what it serves (fused siblings, compiled one-row
    halves); mlx-lm's side keeps the model as built."""
    from specgate.engines.loading import prepare_for_decoding

    model, _, _ = bigram_target(a)
    prepare_for_decoding(model)
    return model


def section_plain(a, target, out: dict) -> None:
    model, _, vocab = target
    rng = random.Random(a.seed + 11)
    engine = PlainEngine(served_model(a), vocab, max_concurrent=max(a.streams), kernels=a.kernels)
    try:
        warm_short, warm_long = prompts_for(rng, vocab, a.prompt, 1)[0], prompts_for(rng, vocab, a.prefill, 1)[0]
        for p, n in ((warm_short, a.tokens), (warm_long, 2)):  # untimed: each shape's kernels built once
            generate_step_run(model, p, n)
            engine.one(p, n)
        rows = {k: {"specgate": [], "mlx-lm": [], "ratio": []} for k in ("decode", "prefill", "ttft")}
        exact = True
        for rep in range(a.reps):
            short = prompts_for(rng, vocab, a.prompt, 1)[0]  # new prompts each repeat: no cache hit
            long = prompts_for(rng, vocab, a.prefill, 1)[0]
            sides = [("mlx-lm", lambda p, n: generate_step_run(model, p, n)), ("specgate", engine.one)]
            if rep % 2:
                sides.reverse()
            got: dict = {}
            for name, fn in sides:
                got[name] = (fn(short, a.tokens), fn(long, 2))
            (gs, gl), (es, el) = got["mlx-lm"], got["specgate"]
            exact &= es.tokens == gs.tokens and el.tokens == gl.tokens
            for key, e, g in (("decode", es.decode_tps, gs.decode_tps),
                              ("prefill", len(long) / el.ttft, len(long) / gl.ttft),
                              ("ttft", es.ttft * 1e3, gs.ttft * 1e3)):  # fmt: skip
                rows[key]["specgate"].append(e)
                rows[key]["mlx-lm"].append(g)
                rows[key]["ratio"].append(e / g)
    finally:
        engine.close()
    print(f"\n## plain: specgate's plain engine vs mlx-lm generate_step ({a.reps} repeats; decode: "
          f"{a.prompt}-token prompt, {a.tokens} tokens; prefill: {a.prefill}-token prompt)")  # fmt: skip
    table(["measure", "specgate", "mlx-lm generate_step", "specgate / mlx-lm"], [
        ["decode tok/s", summary(rows["decode"]["specgate"], ".1f"), summary(rows["decode"]["mlx-lm"], ".1f"),
         summary(rows["decode"]["ratio"])],
        ["prefill tok/s", summary(rows["prefill"]["specgate"], ".0f"),
         summary(rows["prefill"]["mlx-lm"], ".0f"), summary(rows["prefill"]["ratio"])],
        [f"TTFT ms ({a.prompt}-token prompt; lower is better)", summary(rows["ttft"]["specgate"], ".1f"),
         summary(rows["ttft"]["mlx-lm"], ".1f"), summary(rows["ttft"]["ratio"])],
    ])  # fmt: skip
    print(f"outputs token-for-token equal to generate_step: {'yes' if exact else 'NO'}")
    out["plain"] = {**rows, "exact": exact}


def section_batched(a, target, out: dict) -> None:
    model, _, vocab = target
    rng = random.Random(a.seed + 23)
    engine = PlainEngine(served_model(a), vocab, max_concurrent=max(a.streams), kernels=a.kernels)
    result: dict = {}
    exact = True
    try:
        for n_streams in a.streams:  # untimed: each batch width's kernels built once
            warm = prompts_for(rng, vocab, a.prompt, n_streams)
            batch_generator_runs(model, warm, 4)
            engine.many(warm, 4)
        for n_streams in a.streams:
            row = {k: [] for k in ("specgate tok/s", "mlx-lm tok/s", "ratio", "specgate ttft",
                                   "mlx-lm ttft", "ttft ratio")}  # fmt: skip
            for rep in range(a.reps):
                prompts = prompts_for(rng, vocab, a.prompt, n_streams)
                sides = [("mlx-lm", lambda p: batch_generator_runs(model, p, a.tokens)),
                         ("specgate", lambda p: engine.many(p, a.tokens))]  # fmt: skip
                if rep % 2:
                    sides.reverse()
                got = {name: fn(prompts) for name, fn in sides}
                (er, ew), (gr, gw) = got["specgate"], got["mlx-lm"]
                exact &= [r.tokens for r in er] == [r.tokens for r in gr]
                e_tps, g_tps = sum(len(r.tokens) for r in er) / ew, sum(len(r.tokens) for r in gr) / gw
                e_ttft = statistics.median(r.ttft for r in er) * 1e3
                g_ttft = statistics.median(r.ttft for r in gr) * 1e3
                for k, v in (("specgate tok/s", e_tps), ("mlx-lm tok/s", g_tps), ("ratio", e_tps / g_tps),
                             ("specgate ttft", e_ttft), ("mlx-lm ttft", g_ttft),
                             ("ttft ratio", e_ttft / g_ttft)):  # fmt: skip
                    row[k].append(v)
                print(f"  {n_streams} streams, repeat {rep + 1}: specgate {e_tps:.0f} tok/s, "
                      f"BatchGenerator {g_tps:.0f} tok/s", flush=True)  # a timed-out run keeps these
            result[n_streams] = row
    finally:
        kernels = engine.engine.batch_kernels.on
        engine.close()
    print(f"\n## batched: specgate's plain engine vs mlx-lm BatchGenerator ({a.reps} repeats; "
          f"{a.prompt}-token prompts, {a.tokens} tokens each; the engine's max_concurrent "
          f"{max(a.streams)})")  # fmt: skip
    table(["streams", "specgate tok/s", "BatchGenerator tok/s", "tok/s ratio", "specgate TTFT ms",
           "BatchGenerator TTFT ms", "TTFT ratio (lower is better)"],
          [[str(n), summary(r["specgate tok/s"], ".1f"), summary(r["mlx-lm tok/s"], ".1f"),
            summary(r["ratio"]), summary(r["specgate ttft"], ".1f"), summary(r["mlx-lm ttft"], ".1f"),
            summary(r["ttft ratio"])] for n, r in result.items()])  # fmt: skip
    print(f"specgate's batch steps: {'through the kernels' if kernels else 'stock'}")
    print(f"outputs token-for-token equal to BatchGenerator's: {'yes' if exact else 'NO'}")
    out["batched"] = {"streams": {str(k): v for k, v in result.items()}, "exact": exact, "kernels": kernels}


def section_mtp(a, target, out: dict) -> None:
    import e2e_mtp_7b
    from round_phases import ahead_run, oracle_hook

    from specgate.engines.home import kernel_cache_dir
    from specgate.engines.mlx_spec.ahead_round import CompiledRounds
    from specgate.engines.targets import target_for
    from specgate.kernels import hook, wiring
    from specgate.kernels.guard import FUSED_QMM, Guard, cuda_mma_fused_candidate

    model, head, vocab = target
    rng = random.Random(a.seed + 37)
    prompt = prompts_for(rng, vocab, a.prompt, 1)[0]
    trunk = target_for(model)
    cache = kernel_cache_dir(None)
    t0 = time.perf_counter()
    wired = wiring.prepare(model, a.kernels, range(2, max(a.depths) + 2), guard=Guard(cache_dir=cache),
                           fused_guard=Guard([cuda_mma_fused_candidate()], cache_dir=cache, op=FUSED_QMM))  # fmt: skip
    hook.fuse_siblings(head)  # the head as the MTP engine wires it (drafting(), KernelSwitch)
    if wired.enabled:
        wiring.prepare(head, a.kernels, range(2, max(a.depths) + 2), guard=Guard(cache_dir=cache),
                       fused_guard=Guard([cuda_mma_fused_candidate()], cache_dir=cache, op=FUSED_QMM))  # fmt: skip
    print(f"\n[mtp] kernels: {wired.reason} ({time.perf_counter() - t0:.1f} s)")
    kernels = wired.enabled and wired.in_use()
    # "ahead": the product's GPU path (mlx_spec/ahead.py rounds queued one
    # ahead, compiled: ahead_round.py), with the kernels where proved.
    modes = ["stock"] + (["kernels"] if kernels else []) + ["ahead"]
    rounds = CompiledRounds(trunk, head, oracle_hook(vocab))  # its traces serve every repeat

    def one(mode, n, depth, reference, accept, seed):
        trunk.kernels = mode == "kernels" or (mode == "ahead" and kernels)
        if mode == "ahead":
            toks, t, _ = ahead_run(trunk, head, prompt, n, depth, reference, accept, seed, vocab,
                                   rounds=rounds)  # fmt: skip
            return toks, t
        toks, t, _, _ = e2e_mtp_7b.mtp(trunk, head, prompt, n, depth, reference, accept, seed, vocab)
        return toks, t

    reference = generate_step_run(model, prompt, a.tokens).tokens  # also the warm-up
    for depth in a.depths:  # untimed: each depth's verify widths built (and rounds traced) once
        for mode in modes:
            one(mode, min(24, a.tokens), depth, reference, 0.7, 1)
    ratios = {(d, m): [] for d in a.depths for m in modes}
    tps = {(d, m): [] for d in a.depths for m in modes}
    plain_tps: list[float] = []
    exact = {m: True for m in modes}
    try:
        for rep in range(a.reps):
            run = generate_step_run(model, prompt, a.tokens)
            exact_gs = run.tokens == reference
            plain_tps.append(run.decode_tps)
            for depth in a.depths:
                for mode in modes if rep % 2 == 0 else modes[::-1]:
                    toks, t = one(mode, a.tokens, depth, reference, a.accept, a.seed + 1000 * rep + depth)
                    exact[mode] &= exact_gs and toks == reference
                    tps[(depth, mode)].append(t)
                    ratios[(depth, mode)].append(t / run.decode_tps)
    finally:
        trunk.kernels = False
    print(f"\n## mtp: MTP by depth over mlx-lm generate_step (acceptance {a.accept} by construction; "
          f"{a.reps} repeats; {a.prompt}-token prompt, {a.tokens} tokens; generate_step "
          f"{summary(plain_tps, '.1f')} tok/s)")  # fmt: skip
    head_row = ["depth"] + [f"MTP {m} tok/s" for m in modes] + [f"{m} / generate_step" for m in modes]
    table(head_row, [[str(d)] + [summary(tps[(d, m)], ".1f") for m in modes]
                     + [summary(ratios[(d, m)]) for m in modes] for d in a.depths])  # fmt: skip
    print("outputs token-for-token equal to generate_step: "
          + ", ".join(f"{m} {'yes' if exact[m] else 'NO'}" for m in modes))  # fmt: skip
    out["mtp"] = {"kernels": wired.reason, "generate_step": plain_tps, "exact": exact,
                  "depths": {f"{d} {m}": {"tok/s": tps[(d, m)], "ratio": ratios[(d, m)]}
                             for d in a.depths for m in modes}}  # fmt: skip


NGRAM_VARIANTS = ("none", "ngram", "policy")  # specgate's plain engine, forced n-gram, the policy

def batch_spec_run(trunk, head, prompts: list[list[int]], refs: list[list[int]], n: int, depth: int,
                   accept: float, seed: int, vocab: int) -> tuple[list[Run], float, float]:
    """Every prompt prefilled alone, then decoded together in one
    BatchSpecDecoder (engines/mlx_spec/batch_decoder.py) at `depth` (0: a
    plain step each, in the batch), each stream's MTP drafts replaced by its
    oracle (e2e_mtp_7b.OracleDrafts: its reference token with probability
    `accept`). The runs, the wall time of the whole, and the mean rows a
    verify forward carried."""
    import e2e_mtp_7b

    from specgate.engines.base import GenerationRequest, Plan, SamplingParams
    from specgate.engines.mlx_spec.batch_decoder import BatchSpecDecoder
    from specgate.engines.mlx_spec.decoder import SpecDecoder

    batch = BatchSpecDecoder(trunk)
    t0 = time.perf_counter()
    runs: dict[str, Run] = {}
    for i, (prompt, ref) in enumerate(zip(prompts, refs, strict=True)):
        request = GenerationRequest(f"b{i}", "suite", prompt, SamplingParams(temperature=0), n,
                                    Plan("mlx_mtp", "mtp", depth, "spec_on"))  # fmt: skip
        oracle = e2e_mtp_7b.OracleDrafts(trunk, head, reference=ref, accept=accept, seed=seed + i,
                                         vocab=vocab)  # fmt: skip
        decoder = SpecDecoder(trunk, oracle, request, None, 0, None)
        step = decoder.prefill()
        runs[request.request_id] = run = Run(t0=t0, tokens=list(step.tokens),
                                             times=[time.perf_counter()] * len(step.tokens))  # fmt: skip
        if step.finish_reason is None:
            batch.join(request.request_id, decoder)
    rows = verifies = 0
    while batch.decoders:
        width = len(batch.decoders)
        steps = batch.round({key: depth for key in batch.decoders})
        now = time.perf_counter()
        rows += width * (1 + max((s.stats.drafted for s in steps.values() if s.stats), default=0))
        verifies += 1
        for key, step in steps.items():
            run = runs[key]
            run.tokens += step.tokens
            run.times += [now] * len(step.tokens)
            if step.finish_reason is not None:
                batch.leave(key)
    return list(runs.values()), time.perf_counter() - t0, rows / max(verifies, 1)


def section_batchspec(a, target, out: dict) -> None:
    """Issue 45: speculation inside the decode batch against mlx-lm's
    BatchGenerator at the same number of streams."""
    from specgate.engines.home import kernel_cache_dir
    from specgate.engines.targets import target_for
    from specgate.kernels import hook, qmm, wiring
    from specgate.kernels.guard import FUSED_QMM, Guard, cuda_mma_fused_candidate

    model, head, vocab = target
    rng = random.Random(a.seed + 53)
    trunk = target_for(model)
    depths = a.spec_depths
    # Every width the kernels take: a batch's verify forward carries
    # streams x (depth + 1) rows, and fewer as streams finish (3 streams at
    # depth 1: 6 rows); a width first met inside a timed run was proved
    # there (single repeats at 0.2-0.4x on an H100).
    widths = list(range(qmm.MIN_M, qmm.MAX_M + 1))
    cache = kernel_cache_dir(None)
    t0 = time.perf_counter()
    guards = dict(guard=Guard(cache_dir=cache),
                  fused_guard=Guard([cuda_mma_fused_candidate()], cache_dir=cache, op=FUSED_QMM))  # fmt: skip
    wired = wiring.prepare(model, a.kernels, widths, **guards)
    hook.fuse_siblings(head)
    if wired.enabled:
        wiring.prepare(head, a.kernels, range(2, max(depths) + 2), **guards)
    print(f"\n[batchspec] kernels at widths {widths}: {wired.reason} ({time.perf_counter() - t0:.1f} s)")
    trunk.kernels = wired.enabled and wired.in_use()
    result: dict = {}
    exact = True
    try:
        for b in a.spec_streams:  # untimed: each width's graphs built once
            warm = prompts_for(rng, vocab, a.prompt, b)
            refs = [r.tokens for r in batch_generator_runs(model, warm, 8)[0]]
            for depth in depths:
                batch_spec_run(trunk, head, warm, refs, 8, depth, a.accept, 1, vocab)
        for b in a.spec_streams:
            row = {"BatchGenerator tok/s": [], **{f"d{d} {k}": [] for d in depths
                                                  for k in ("tok/s", "ratio", "rows")}}  # fmt: skip
            for rep in range(a.reps):
                prompts = prompts_for(rng, vocab, a.prompt, b)
                # BatchGenerator first: its tokens are the oracle's references
                # (and what every stream must equal).
                plain_runs, plain_wall = batch_generator_runs(model, prompts, a.tokens)
                refs = [r.tokens for r in plain_runs]
                plain_tps = sum(len(r) for r in refs) / plain_wall
                row["BatchGenerator tok/s"].append(plain_tps)
                line = [f"BatchGenerator {plain_tps:.0f}"]
                for depth in depths if rep % 2 == 0 else depths[::-1]:
                    runs, wall, rows = batch_spec_run(trunk, head, prompts, refs, a.tokens, depth, a.accept,
                                                      a.seed + 1000 * rep, vocab)  # fmt: skip
                    exact &= [r.tokens for r in runs] == refs
                    tps = sum(len(r.tokens) for r in runs) / wall
                    row[f"d{depth} tok/s"].append(tps)
                    row[f"d{depth} ratio"].append(tps / plain_tps)
                    row[f"d{depth} rows"].append(rows)
                    line.append(f"d{depth} {tps:.0f}")
                print(f"  {b} streams, repeat {rep + 1}: " + ", ".join(line), flush=True)
            result[b] = row
    finally:
        trunk.kernels = False
    print(f"\n## batchspec: speculation inside the batch (BatchSpecDecoder, MTP drafts at acceptance "
          f"{a.accept} by construction, kernels {'on' if wired.enabled and wired.in_use() else 'off'}) "
          f"vs mlx-lm BatchGenerator, aggregate tok/s ({a.reps} repeats; {a.prompt}-token prompts, "
          f"{a.tokens} tokens each; prefill included on both sides; d0: plain steps in the batch)")  # fmt: skip
    table(["streams", "BatchGenerator tok/s"] + [f"d{d} / BatchGenerator" for d in depths]
          + [f"d{d} rows per verify" for d in depths],
          [[str(b), summary(r["BatchGenerator tok/s"], ".0f")] + [summary(r[f"d{d} ratio"]) for d in depths]
           + [f"{statistics.median(r[f'd{d} rows']):.1f}" for d in depths]
           for b, r in result.items()])  # fmt: skip
    print(f"outputs token-for-token equal to BatchGenerator's: {'yes' if exact else 'NO'}")
    out["batchspec"] = {"kernels": wired.reason, "streams": {str(k): v for k, v in result.items()},
                        "exact": exact}  # fmt: skip


def section_batchengine(a, target, out: dict) -> None:
    """Issue 45 through the served engines: SpecEngine's batched speculation
    against MLXPlainEngine's continuous batching, both driven through
    generate() with that many requests in flight."""
    _, head, vocab = target
    model = served_model(a)
    rng = random.Random(a.seed + 71)
    depths = a.spec_depths
    loaded = loaded_model(model, vocab)  # one model, one lock: the policy side uses both engines
    plain = PlainEngine(model, vocab, max_concurrent=max(a.spec_streams), loaded=loaded, kernels=a.kernels,
                        wait=False)  # (waited for with the speculative engine's, below)
    t0 = time.perf_counter()
    spec = OracleSpecEngine(model, head, vocab, a.accept, max(max(depths), 1), a.seed, loaded=loaded)
    switch = spec.engine.kernel_switch
    decided = switch.done.wait(900) and switch.batch_done.wait(900) and plain.engine.kernels_ready(900)
    print(f"\n[batchengine] verify kernels {'on' if spec.engine.target.kernels else 'off'}, proved for "
          f"up to {switch.rows} rows; plain batch steps "
          f"{'through the kernels' if plain.engine.batch_kernels.on else 'stock'}"
          f"{'' if decided else ' (still proving)'}, "
          f"{time.perf_counter() - t0:.1f} s after the engine's load")  # fmt: skip
    result: dict = {}
    exact = True

    # Each depth twice on a GPU: rounds run ahead (the engine's way there),
    # and rounds read before the next is built (this bench's first runs).
    # (--tiny on the CPU: both too, compiled, as a check of the ahead path's oracle.)
    spec.engine.ahead |= a.tiny
    spec.engine.compiled_rounds |= a.tiny
    sides = [x for x in a.sides if x == "first" or (x == "ahead" and spec.engine.ahead)] \
        or ["first"]  # fmt: skip
    columns = [(d, side) for d in depths for side in (sides if d else sides[-1:])]  # d0: no rounds to run ahead
    # The policy's plans (PolicySide): one column, whatever the depths.
    policy = PolicySide(plain, spec, max(max(depths), 1)) if "policy" in a.sides else None
    if policy is not None:
        columns.append((max(max(depths), 1), "policy"))

    def spec_run(prompts: list[list[int]], n: int, depth: int, side: str) -> tuple[list[Run], float]:
        if side == "policy":
            return policy.many(prompts, n)
        spec.depth, spec.ahead = depth, side == "ahead"
        return spec.many(prompts, n)

    try:
        for b in a.spec_streams:  # untimed: each shape's graphs built once
            warm = prompts_for(rng, vocab, a.prompt, b)
            refs, _ = plain.many(warm, 8)
            spec.refs.update({tuple(p): r.tokens for p, r in zip(warm, refs, strict=True)})
            for depth, side in columns:
                spec_run(warm, 8, depth, side)
        for b in a.spec_streams:
            row = {"plain tok/s": [], **{f"d{d} {side} {k}": [] for d, side in columns for k in ("tok/s", "ratio")}}
            for rep in range(a.reps):
                prompts = prompts_for(rng, vocab, a.prompt, b)
                plain_runs, plain_wall = plain.many(prompts, a.tokens)
                refs = [r.tokens for r in plain_runs]
                spec.refs.update({tuple(p): r for p, r in zip(prompts, refs, strict=True)})
                plain_tps = sum(len(r) for r in refs) / plain_wall
                row["plain tok/s"].append(plain_tps)
                line = [f"plain {plain_tps:.0f}"]
                for depth, side in columns if rep % 2 == 0 else columns[::-1]:
                    runs, wall = spec_run(prompts, a.tokens, depth, side)
                    exact &= [r.tokens for r in runs] == refs
                    tps = sum(len(r.tokens) for r in runs) / wall
                    row[f"d{depth} {side} tok/s"].append(tps)
                    row[f"d{depth} {side} ratio"].append(tps / plain_tps)
                    drafted, rounds = sum(r.drafted for r in runs), sum(r.rounds for r in runs)
                    shown = (f" (a {sum(r.accepted for r in runs) / drafted:.2f}, "
                             f"{sum(r.batched for r in runs) / max(rounds, 1):.0%} batched)") if drafted else ""  # fmt: skip
                    line.append(f"d{depth} {side} {tps:.0f}{shown}")
                print(f"  {b} streams, repeat {rep + 1}: " + ", ".join(line), flush=True)
            result[b] = row
    finally:
        spec.close()
        plain.close()
    print(f"\n## batchengine: specgate's MTP SpecEngine (requests batched, oracle drafts at acceptance "
          f"{a.accept}, verify kernels {'on' if spec.engine.target.kernels else 'off'}) vs its plain "
          f"engine's continuous batching, aggregate tok/s ({a.reps} repeats; {a.prompt}-token "
          f"prompts, {a.tokens} tokens each; prefill included; d0: plain steps in the spec batch; "
          f"ahead: rounds queued one ahead (batch_ahead.py), first: each round read before the next "
          f"is built)")  # fmt: skip
    table(["streams", "plain engine tok/s"] + [f"d{d} {side} / plain engine" for d, side in columns],
          [[str(b), summary(r["plain tok/s"], ".0f")] + [summary(r[f"d{d} {side} ratio"]) for d, side in columns]
           for b, r in result.items()])  # fmt: skip
    if policy is not None:
        print(f"policy: no tune prior (rules, then live measurements); its tokens by method: "
              f"{policy.methods}; plans decided (method/reason/source, warm-up included): "
              f"{policy.plans}")  # fmt: skip
    print(f"outputs token-for-token equal to the plain engine's: {'yes' if exact else 'NO'}")
    out["batchengine"] = {"kernels": spec.engine.target.kernels, "rows": switch.rows,
                          "policy_methods": policy.methods if policy is not None else None,
                          "policy_plans": policy.plans if policy is not None else None,
                          "streams": {str(k): v for k, v in result.items()}, "exact": exact}  # fmt: skip


def section_ngram(a, out: dict) -> None:
    import agent_workloads as aw

    from specgate.policies.content import content_class

    # The same shapes: agent_workloads' "micro" is this suite's tiny one.
    args = argparse.Namespace(synthetic="7b" if a.shape == "7b" else "micro", vocab=SHAPES[a.shape][-1], seed=a.seed, embed_scale=16.0,
                              margin=20.0, mtp_accept=0.65, bits=4, mtp_depth=2, ngram_depth=8,
                              kernels=a.kernels)  # fmt: skip
    model, head, sigma = aw.synthetic_target(args)
    transcripts = aw.load_transcripts()
    prompts = [(p, min(n, a.tokens)) for p, n in aw.synthetic_prompts(transcripts, sigma, a.seed)]
    classes = [content_class(str(t["messages"][-1].get("content") or "")) for t in transcripts]
    bench = aw.InProcess(args, model, head)
    rows: dict = {t["name"]: {v: [] for v in ("generate_step", *NGRAM_VARIANTS)} for t in transcripts}
    per_request: dict = {t["name"]: [] for t in transcripts}  # the policy's requests / plain's, same repeat
    exact = True
    try:
        for (prompt, n), c in zip(prompts, classes, strict=True):  # untimed: shapes built once
            generate_step_run(model, prompt, min(n, 24))
            for v in NGRAM_VARIANTS[:-1]:
                bench.run(prompt, min(n, 24), v, c)
        for rep in range(a.reps):
            order = list(NGRAM_VARIANTS) + ["generate_step"]
            order = order[rep % len(order):] + order[: rep % len(order)]
            for (prompt, n), t, c in zip(prompts, transcripts, classes, strict=True):
                got = {}
                for v in order:
                    if v == "generate_step":
                        run = generate_step_run(model, prompt, n)
                        got[v] = (run.tokens, run.decode_tps)
                    else:
                        r = bench.run(prompt, n, v, c)
                        got[v] = (r.token_ids, r.tps)
                ref, ref_tps = got["generate_step"]
                for v in NGRAM_VARIANTS:
                    exact &= got[v][0] == ref
                    rows[t["name"]][v].append(got[v][1] / ref_tps)
                rows[t["name"]]["generate_step"].append(ref_tps)
                per_request[t["name"]].append(got["policy"][1] / got["none"][1])
    finally:
        bench.close()
    print(f"\n## ngram: the agent transcripts over mlx-lm generate_step ({a.reps} repeats; the "
          f"synthetic copying target of bench/agent_workloads.py; answers up to {a.tokens} tokens)")  # fmt: skip
    table(["transcript", "kind", "generate_step tok/s", "plain / gs", "ngram / gs", "policy / gs",
           "policy / plain, lowest request"],
          [[name, "copy" if t.get("copy") is not None else "prose", summary(r["generate_step"], ".1f"),
            summary(r["none"]), summary(r["ngram"]), summary(r["policy"]),
            f"{min(per_request[name]):.2f}"] for (name, r), t in zip(rows.items(), transcripts, strict=True)])  # fmt: skip
    copies = [t["name"] for t in transcripts if t.get("copy") is not None]
    for v in ("ngram", "policy"):
        med = [statistics.median(rows[name][v]) for name in copies]
        print(f"copy-heavy, {v} / generate_step: geomean {geomean(med):.2f}x, worst "
              f"{min(med):.2f}x (issue 44: >= 3.0 geomean, worst >= 2.5)")  # fmt: skip
    prose = [t["name"] for t in transcripts if t.get("copy") is None]
    low = min((x for name in prose for x in per_request[name]), default=float("nan"))
    print(f"prose under the policy: lowest single request {low:.2f}x specgate plain (issue 44: >= 0.9)")
    print(f"outputs token-for-token equal to generate_step: {'yes' if exact else 'NO'}")
    out["ngram"] = {"transcripts": rows, "policy_over_plain": per_request, "exact": exact}


# ---------------------------------------------------------------- the run


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    ap.add_argument("--tiny", action="store_true", help="--shape tiny, fewer tokens (a CPU check)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repeats (default 5)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per decode (256; --tiny 24)")
    ap.add_argument("--prompt", type=int, default=None, help="decode prompt tokens (128; --tiny 32)")
    ap.add_argument("--prefill", type=int, default=None, help="prefill prompt tokens (2048; --tiny 256)")
    ap.add_argument("--streams", default="4,8,16")
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--spec-streams", default="2,4,8", help="batchspec's streams")
    ap.add_argument("--spec-depths", default="0,1,2,3", help="batchspec's depths (0: plain steps)")
    ap.add_argument("--sides", default="ahead,first",
                    help="batchengine's sides: its batched rounds run ahead, read first, and/or "
                         "`policy` (the plans the gateway's policy makes, over both engines)")
    ap.add_argument("--accept", type=float, default=0.8)
    ap.add_argument("--kernels", default="auto", choices=("auto", "off"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    a = ap.parse_args(argv)
    if a.tiny:
        a.shape = "tiny"
    small = a.shape == "tiny"
    a.tokens = a.tokens or (24 if small else 256)
    a.prompt = a.prompt or (32 if small else 128)
    a.prefill = a.prefill or (256 if small else 2048)
    a.sections = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = sorted(set(a.sections) - set(SECTIONS))
    if unknown or not a.sections:
        ap.error(f"--only: unknown section(s) {', '.join(unknown) or '(none given)'}; "
                 f"choose from {', '.join(SECTIONS)}")  # fmt: skip
    try:
        a.streams = [int(x) for x in a.streams.split(",")]
        a.depths = [int(x) for x in a.depths.split(",")]
        a.spec_streams = [int(x) for x in a.spec_streams.split(",")]
        a.spec_depths = [int(x) for x in a.spec_depths.split(",")]
        a.sides = [x for x in a.sides.split(",") if x]
    except ValueError as e:
        ap.error(f"--streams and --depths take comma-separated integers: {e}")
    if a.reps < 1 or a.tokens < 2 or a.prompt < 1 or a.prefill < 1 or min(a.streams) < 1 \
            or min(a.depths) < 1 or min(a.spec_streams) < 1 or min(a.spec_depths) < 0 \
            or not 0 <= a.accept <= 1:  # fmt: skip
        ap.error("--reps, --prompt, --prefill, --streams and --depths must be >= 1, --tokens >= 2, "
                 "--accept in [0, 1]")  # fmt: skip
    if not a.sides or not set(a.sides) <= {"ahead", "first", "policy"}:
        ap.error(f"--sides takes ahead, first and policy, not {','.join(a.sides) or 'nothing'}")
    return a


def header(a) -> None:
    import mlx_lm

    info = {}
    try:
        info = dict(mx.device_info())
    except Exception:  # an MLX without device_info: the device alone
        pass
    name = info.get("device_name") or info.get("name") or ""
    print(f"device {mx.default_device()}{f' ({name})' if name else ''}; mlx {mx.__version__}; "
          f"mlx-lm {mlx_lm.__version__}; python {sys.version.split()[0]}")  # fmt: skip
    hidden, layers, mlp, heads, kv, hd, vocab = SHAPES[a.shape]
    print(f"target: qwen3 shape '{a.shape}' (hidden {hidden}, {layers} layers, {heads}/{kv} heads, "
          f"MLP {mlp}, vocab {vocab}), 4-bit, random weights; {a.reps} repeats; sections "
          f"{', '.join(a.sections)}")  # fmt: skip
    if a.reps < 5:
        print(f"(only {a.reps} repeats: issue 44's numbers want >= 5)")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    header(a)
    out: dict = {"args": {k: v for k, v in vars(a).items() if k != "json"}, "failed": {}}
    target = None
    for name in a.sections:
        t0 = time.perf_counter()
        try:
            if name == "ngram":
                target = None  # its own target: the bigram one goes first
                gc.collect()
                mx.clear_cache()
                section_ngram(a, out)
            else:
                if target is None:
                    target = bigram_target(a)
                {"plain": section_plain, "batched": section_batched, "mtp": section_mtp,
                 "batchspec": section_batchspec, "batchengine": section_batchengine}[name](a, target, out)
        except Exception as e:
            tb = traceback.format_exc()
            print(f"\n## {name}: FAILED ({type(e).__name__}: {e})\n" + "".join(tb.splitlines(True)[-12:]))
            out["failed"][name] = tb
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1, default=str))
    if out["failed"]:
        print(f"\nsections that failed: {', '.join(out['failed'])}")
    return 0


if __name__ == "__main__":
    from mlx_exit import end_process

    end_process(main())
