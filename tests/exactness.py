"""One exactness harness for every in-process speculative engine the registry lists.

tests/test_exactness_greedy.py and test_exactness_sampled.py prove the same
claims of each engine with the same code: at temperature 0 its output is
plain greedy decoding's, token for token; above 0 a round's tokens follow
the target's distribution, and a seeded request's output is plain seeded
sampling's, token for token. The engines under test are built the way the
gateway builds them, through their registry record's builder, over tiny
float32 checkpoints in the published layouts (float32: in bfloat16 near-ties
would blur what is compared). A new engine inherits the proofs when it
registers: its record's `needs` (and `drafter_kind`) pick the targets below;
a drafter kind with no tiny builder here fails the suite, naming what to add.

Random heads and drafters are almost always wrong, so a sweep decodes its
prompts with injected drafts (failure injection: the proposer drafts as
usual, then its drafts are replaced by the true continuation corrupted at
one chosen position, or none), which forces every accepted-prefix length,
and its first prompt with the method's own drafts too. Prompts rotate across
depths and families: a prompt meets a different depth on each of a method's
families, so the pairs are covered over the suite, not all in every test.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import mlx.core as mx
from greedy import assert_same_greedy, greedy_reference, seeded_reference
from mlx_lm.utils import load_model

from specgate.builders.drafters import (
    build_dflash_drafter,
    build_dspark_drafter,
    build_gemma4_assistant,
)
from specgate.builders.gemma4 import build_gemma4
from specgate.builders.qwen3_next import build_qwen3_next
from specgate.builders.tiny import build_qwen3_dense, build_qwen35_hybrid, build_qwen35_moe
from specgate.engines import registry
from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.cache.prefix_cache import PrefixCache, snapshot
from specgate.engines.drafting.base import Proposal
from specgate.engines.forwards.quantized_kv import group_size_for, quantize_caches
from specgate.engines.loading import LoadedModel
from specgate.engines.mlx_spec import acceptance as speculative
from specgate.engines.mlx_spec.batch_decoder import BatchSpecDecoder
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.sampling import probabilities

GREEDY = SamplingParams(temperature=0)
N_TOKENS = 32
N_PROMPTS = 8
MAX_DEPTH = 8  # the deepest round any sweep runs
WINDOW = 16  # Gemma-4's sliding window here: prompts up to 60 tokens wrap it

# -- the tiny targets, by family ------------------------------------------------------

_no_tokenizer = {"tokenizer": False}
FAMILIES: dict[str, Callable[[Path], Path]] = {
    "qwen3_dense": partial(build_qwen3_dense, **_no_tokenizer),
    "qwen35_hybrid": partial(build_qwen35_hybrid, **_no_tokenizer),
    "qwen35_moe": partial(build_qwen35_moe, **_no_tokenizer),
    "qwen3_next": partial(build_qwen3_next, **_no_tokenizer),
    "gemma4_dense": partial(build_gemma4, variant="dense", sliding_window=WINDOW, **_no_tokenizer),
    "gemma4_moe": partial(build_gemma4, variant="moe", sliding_window=WINDOW, **_no_tokenizer),
    "gemma4_small": partial(build_gemma4, variant="small", sliding_window=WINDOW, **_no_tokenizer),
}

# 12-token targets for the sampled tests: every pair of tokens has a real
# chance under top-k 5, so a round's first two tokens can be counted.
_V12 = dict(vocab_size=12, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, tokenizer=False, seed=11)  # fmt: skip
_V12_LINEAR = dict(linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                   linear_value_head_dim=16)  # fmt: skip
FAMILIES |= {
    "v12_hybrid": partial(build_qwen35_hybrid, **_V12, **_V12_LINEAR),
    "v12_dense": partial(build_qwen3_dense, **_V12),
    # A window of 4: the sampled rounds attend across a wrap.
    "v12_gemma4": partial(build_gemma4, **_V12, global_head_dim=16, sliding_window=4,
                          num_hidden_layers=3),
}  # fmt: skip


@dataclass(frozen=True)
class Needs:
    """What the engines needing one thing run on: greedy sweeps on `greedy`
    families at `depths`, sampled rounds on `sampled` families; a drafter
    kind's builder makes its drafter for a target (and a smaller one for the
    12-token targets)."""

    greedy: tuple[str, ...]
    sampled: tuple[str, ...]
    depths: tuple[int, ...] = (1, 2, 3, 4)
    drafter: Callable[[Path, Path], Path] | None = None
    small_drafter: Callable[[Path, Path], Path] | None = None


NEEDS: dict[str, Needs] = {
    "nothing": Needs(("qwen3_dense", "qwen35_hybrid"), ("v12_hybrid", "v12_dense"), (1, 2, 4, 8)),
    "mtp_head": Needs(("qwen35_hybrid", "qwen35_moe", "qwen3_next"), ("v12_hybrid",)),
}
DRAFTERS: dict[str, Needs] = {  # by the record's drafter_kind
    "dflash": Needs(
        ("qwen3_dense", "qwen35_hybrid"), ("v12_hybrid",),
        drafter=lambda root, t: build_dflash_drafter(root, target=t, block_size=5,
                                                     num_hidden_layers=2, tokenizer=False),
        small_drafter=lambda root, t: build_dflash_drafter(root, target=t, block_size=3,
                                                           num_hidden_layers=1, mask_token_id=11,
                                                           tokenizer=False)),
    "dspark": Needs(
        ("qwen3_dense", "qwen35_hybrid"), ("v12_hybrid",),
        drafter=lambda root, t: build_dspark_drafter(root, target=t, block_size=4,
                                                     num_hidden_layers=2, target_layer_ids=[-1, 2],
                                                     tokenizer=False),
        # No confidence head: every round drafts, so the rule runs every time.
        small_drafter=lambda root, t: build_dspark_drafter(
            root, target=t, block_size=3, num_hidden_layers=1, mask_token_id=11, markov_rank=4,
            enable_confidence_head=False, confidence_head_with_markov=False, tokenizer=False)),
    "gemma4_assistant": Needs(
        ("gemma4_dense", "gemma4_moe", "gemma4_small"), ("v12_gemma4",), (1, 2, 4),
        drafter=lambda root, t: build_gemma4_assistant(root, target=t, tokenizer=False),
        # A centroid head (4 clusters of 3 tokens, top 2): q is a real, imperfect distribution.
        small_drafter=lambda root, t: build_gemma4_assistant(
            root, target=t, hidden_size=32, num_centroids=4, centroid_intermediate_top_k=2,
            tokenizer=False, seed=5)),
}  # fmt: skip


def speculative_records() -> list[registry.EngineRecord]:
    """Every in-process speculative engine (MLX checkpoints, a method other than plain)."""
    return [r for r in registry.records(registry.MLX) if r.speculative]


def needs_of(record: registry.EngineRecord) -> Needs:
    if record.needs != "drafter":
        return NEEDS[record.needs]
    if record.drafter_kind not in DRAFTERS:
        raise KeyError(f"engine {record.name} drafts with a {record.drafter_kind!r} drafter, which "
                       "tests/exactness.py cannot build: add its tiny builder to DRAFTERS so the "
                       "engine's exactness is proved")  # fmt: skip
    return DRAFTERS[record.drafter_kind]


def subjects(sampled: bool = False) -> list[tuple[str, str]]:
    """(engine, family) for every speculative engine and each family it is proved on."""
    out = []
    for record in speculative_records():
        needs = needs_of(record)
        out += [(record.name, f) for f in (needs.sampled if sampled else needs.greedy)]
    return out


# -- building: one float32 model per family, each engine through its record ---------


@dataclass
class Subject:
    """One engine, built by its registry record over one tiny family."""

    engine_name: str
    family: str
    family_index: int  # its place among the engine's families (prompts rotate by it)
    model: object  # the float32 target, for references
    engine: object  # the SpecEngine its record built
    depths: tuple[int, ...]
    references: dict = field(default_factory=dict)  # the family's, by prompt

    @property
    def method(self) -> str:
        return self.engine.method

    @property
    def vocab(self) -> int:
        return self.engine.vocab_size

    def reference(self, prompt: list[int], n: int = N_TOKENS) -> tuple[list[int], list[float]]:
        """Plain mlx-lm greedy decoding's first n tokens and their top-2
        margins, decoded once per prompt (shared by the family's engines)."""
        tokens, margins = self._decoded(prompt, n)
        return tokens[:n], margins[:n]

    def continuation(self, prompt: list[int], n: int = N_TOKENS) -> list[int]:
        """The reference and what follows (injected drafts: a round near the
        end drafts past it)."""
        return self._decoded(prompt, n)[0]

    def _decoded(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        key = tuple(prompt)
        if key not in self.references or len(self.references[key][0]) < n + MAX_DEPTH:
            self.references[key] = greedy_reference(self.model, prompt, n + MAX_DEPTH)
        return self.references[key]


class _Family:
    def __init__(self, path: Path, kv_bits: int | None = None):
        model, config = load_model(path)
        model.set_dtype(mx.float32)
        if kv_bits is not None:  # every cache of this model quantized, the references' too
            quantize_caches(model, kv_bits, group_size_for(config.get("text_config", config)))
        self.path, self.model = path, model
        self.loaded = LoadedModel(str(path), model, None, config, PrefixCache(str(path)),
                                  kv_bits=kv_bits)  # fmt: skip
        self.references: dict = {}


_families: dict[tuple[Path, str, int | None], _Family] = {}


def _family(root: Path, name: str, kv_bits: int | None = None) -> _Family:
    key = (root, name, kv_bits)
    if key not in _families:
        path = root / name
        _families[key] = _Family(path if path.exists() else FAMILIES[name](path), kv_bits)
    return _families[key]


_subjects: dict[tuple, Subject] = {}


def subject(root: Path, engine_name: str, family: str, sampled: bool = False,
            kv_bits: int | None = None) -> Subject:  # fmt: skip
    """The engine `engine_name` built over `family` (models and drafters under
    `root`), once per process; `kv_bits`: the family's model with its KV
    cache quantized (engines/forwards/quantized_kv.py), its references too."""
    key = (root, engine_name, family, sampled, kv_bits)
    if key not in _subjects:
        _subjects[key] = _build(root, engine_name, family, sampled, kv_bits)
    return _subjects[key]


def _build(root: Path, engine_name: str, family: str, sampled: bool,
           kv_bits: int | None = None) -> Subject:  # fmt: skip
    record = registry.record(engine_name)
    needs = needs_of(record)
    fam = _family(root, family, kv_bits)
    drafter = None
    if record.needs == "drafter":
        make = needs.small_drafter if sampled else needs.drafter
        drafter = root / f"{record.drafter_kind}-for-{family}"
        if not drafter.exists():
            make(drafter, fam.path)
    ctx = registry.BuildContext(engine_name, str(fam.path), registry.MLX, engines=(engine_name,),
                                drafter=None if drafter is None else str(drafter),
                                loaded=fam.loaded)  # fmt: skip
    built, refused = record.build(ctx, (engine_name,))
    assert not refused, refused
    families = needs.sampled if sampled else needs.greedy
    return Subject(engine_name, family, families.index(family), fam.model, built[engine_name],
                   needs.depths, fam.references)  # fmt: skip


# -- prompts and decoding -------------------------------------------------------------


def prompts(vocab: int, n: int = N_PROMPTS, seed: int = 0) -> list[list[int]]:
    """Lengths from 1 to 60 (some wrap a 16-token window in the prompt, some
    while decoding); every other one repeats a span, so copies can be found."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(vocab - 3) for _ in range(1 + (i * 59) // (n - 1))]
        out.append(p + p[: rng.randint(1, len(p))] if i % 2 and len(p) > 1 else p)
    return out


def rotated(s: Subject, depth: int) -> list[tuple[int, list[int]]]:
    """The prompts (with their index) this subject decodes at `depth`: prompt
    i goes to depth (i + family_index) mod len(depths), so each of a method's
    families decodes a prompt at another depth."""
    at = s.depths.index(depth)
    return [(i, p) for i, p in enumerate(prompts(s.vocab))
            if (i + s.family_index) % len(s.depths) == at]  # fmt: skip


class Injected:
    """Failure injection: the proposer drafts as usual (its state advances as
    it would), then its drafts are replaced by `reference`'s continuation with
    one token corrupted, or none. Where the corruption goes runs through a
    shuffled cycle of every position (and none), so each accepted-prefix
    length happens once every depth + 1 rounds; decodes that share `cycle`
    continue one cycle."""

    def __init__(self, proposer, reference: list[int], rng: random.Random, vocab: int,
                 cycle: list[int] | None = None):  # fmt: skip
        self.proposer, self.reference, self.rng, self.vocab = proposer, reference, rng, vocab
        self.cycle = [] if cycle is None else cycle

    def __getattr__(self, name):
        return getattr(self.proposer, name)

    def propose(self, context, depth):
        self.proposer.propose(context, depth)
        at = context.generated
        true = self.reference[at : at + depth]
        true += [0] * (depth - len(true))
        if not self.cycle or max(self.cycle) > depth:  # a new cycle (or a shallower round)
            self.cycle[:] = self.rng.sample(range(depth + 1), depth + 1)
        wrong = self.cycle.pop()  # depth: all drafts right
        if wrong < depth:
            true[wrong] = (true[wrong] + 1) % self.vocab
        return Proposal(mx.array(true))


@dataclass
class Decoded:
    tokens: list[int]
    finish: str | None
    rounds: list
    decoder: SpecDecoder


def _request(s: Subject, prompt: list[int], params: SamplingParams, depth: int, max_tokens: int,
             stop: frozenset[int] = frozenset()) -> GenerationRequest:  # fmt: skip
    return GenerationRequest("t", s.engine_name, prompt, params, max_tokens,
                             Plan(s.engine_name, s.method, depth, "spec_on"), stop)  # fmt: skip


def decode(s: Subject, prompt: list[int], depth: int, *, params: SamplingParams = GREEDY,
           max_tokens: int = N_TOKENS, stop: frozenset[int] = frozenset(), undo: str = "tape",
           schedule: list[int] | None = None, inject: list[int] | None = None,
           seed: int = 0, cycle: list[int] | None = None) -> Decoded:  # fmt: skip
    """Decode with the engine's own decoder (`make_decoder`, as a request
    gets it). `schedule`: each round's depth in turn (cycled) instead of
    `depth`; `inject`: the reference whose corrupted copies replace the drafts."""
    decoder = s.engine.make_decoder(_request(s, prompt, params, depth, max_tokens, stop), None, 0)
    decoder.undo = undo
    if inject is not None:
        decoder.proposer = Injected(decoder.proposer, inject, random.Random(seed), s.vocab, cycle)
    step = decoder.prefill()
    tokens, rounds = list(step.tokens), []
    while step.finish_reason is None:
        step = decoder.round(depth if schedule is None else schedule[len(rounds) % len(schedule)])
        tokens += step.tokens
        rounds.append(step.stats)
    return Decoded(tokens, step.finish_reason, rounds, decoder)


@dataclass
class Sweep:
    ties: int  # near-tie divergences (tests/greedy.py)
    natural: int  # drafts the method made itself
    lengths: Counter  # accepted-prefix lengths of the injected rounds that drafted `depth`


def greedy_sweep(s: Subject, depth: int) -> Sweep:
    """The subject's share of the prompts at `depth` (rotated), each decoded
    with injected drafts, the first also with the method's own; every output
    must equal plain greedy decoding's (asserted here, token for token)."""
    cases = rotated(s, depth)
    assert cases, (s.engine_name, s.family, depth)
    sweep, cycle = Sweep(0, 0, Counter()), []  # one cycle of corruptions over the prompts
    for n, (i, prompt) in enumerate(cases):
        want, margins = s.reference(prompt)
        if n == 0:  # the method's own drafts (on a random drafter, mostly rejected)
            out = decode(s, prompt, depth)
            sweep.ties += assert_same_greedy(out.tokens, want, margins)
            assert out.finish == "length" or sweep.ties
            assert all(r.method == s.method and r.depth == depth and r.drafted <= depth
                       for r in out.rounds)  # fmt: skip
            sweep.natural += sum(r.drafted for r in out.rounds)
        out = decode(s, prompt, depth, inject=s.continuation(prompt), seed=i, cycle=cycle)
        sweep.ties += assert_same_greedy(out.tokens, want, margins)
        sweep.lengths.update(r.accepted for r in out.rounds if r.drafted == depth)
    return sweep


# -- seeded sampling: plain sampling's tokens, whatever the drafts --------------------


def seeded_sweep(s: Subject, seed: int) -> tuple[int, int]:
    """A seeded request (SAMPLED with `seed`), one prompt per depth (rotated),
    decoded with the method's own drafts and with injected ones (the seeded
    reference's continuation corrupted at one position: every accepted
    length); each output must equal plain seeded sampling's
    (greedy.seeded_reference) token for token, near-ties aside. Returns
    (near-tie divergences, drafts accepted)."""
    params = replace(SAMPLED, seed=seed)
    ties = accepted = 0
    cycle: list[int] = []
    for depth in s.depths:
        i, prompt = rotated(s, depth)[0]
        want, margins = seeded_reference(s.model, prompt, N_TOKENS + MAX_DEPTH, params)
        for inject in (None, want):
            out = decode(s, prompt, depth, params=params, inject=inject, seed=i, cycle=cycle)
            ties += assert_same_greedy(out.tokens, want[:N_TOKENS], margins)
            accepted += sum(r.accepted for r in out.rounds)
    return ties, accepted


# -- sampling: a round's first tokens against the target's exact law ------------------

SAMPLED = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)


def copy_prefix(model) -> list[int]:
    """Token 7 followed by every token t, then two more, and a final 7: whatever
    the first sampled token t is, the bigram (7, t) occurred, so a copying
    method has two tokens to draft (mtp+ngram, which copies from 4 matched
    tokens on, drafts with its head here). Those two are the target's argmax
    after (..., 7, t), a few times over (each change moves the context), so
    copies are likely tokens and a wrong rule shows. Any method drafts from here."""
    follow = {t: [(t * 5 + 1) % 12, (t * 7 + 3) % 12] for t in range(12)}

    def prefix() -> list[int]:
        return [tok for t in range(12) for tok in (7, t, *follow[t])] + [7]

    def argmax(tokens: list[int]) -> int:
        return int(mx.argmax(model(mx.array([tokens]))[0, -1]).item())

    for _ in range(3):
        p = prefix()
        for t in range(12):
            a = argmax(p + [t])
            follow[t] = [a, argmax(p + [t, a])]
    return prefix()


def exact_pairs(model, prefix: list[int], params: SamplingParams = SAMPLED) -> dict:
    """The target's p(a) p(b | a) after `prefix`, from plain forwards."""

    def dist(tokens):
        return probabilities(model(mx.array([tokens]))[0, -1], params).tolist()

    return {(a, b): pa * pb for a, pa in enumerate(dist(prefix)) if pa > 0
            for b, pb in enumerate(dist(prefix + [a])) if pb > 0}  # fmt: skip


@dataclass
class Sample:
    distance: float  # TV between the counts and the exact law
    bound: float  # 3 x 0.5 sqrt(m / n): a correct sampler stays under it (module docstring)
    outcomes: int
    counted: int
    drafted: int
    accepted: int
    support_ok: bool  # no pair the target truncated away


def sample_rounds(s: Subject, n: int, batched: bool = False) -> Sample:
    """n unseeded requests (rejection sampling; MLX's random state seeded
    before each, so the run repeats) for the copy prefix, each resumed from
    one prefilled state as the engine resumes a cached prompt
    (specgate/engines/mlx_spec/engine.py: the prefix cache's entry before the
    prompt's last token, the drafter's state restored): the last prompt token, the first sampled token, then a depth-2
    round. The round's two tokens are counted given the commonest first token
    and compared with the target's exact p(a) p(b | a). `batched`: each
    request's rounds run in a BatchSpecDecoder beside a greedy request of
    the same engine at depth 1 on another prompt (issue 45: a stream's
    distribution in a batch is its target's)."""
    prefix = copy_prefix(s.model)
    cache_id = s.engine.drafting.cache_id
    entries = PrefixCache(f"sampling {s.engine_name}")
    first = s.engine.make_decoder(_request(s, prefix, SAMPLED, 2, 3), None, 0)
    for fed in first.prefill_chunks([len(prefix) - 1]):
        if fed == len(prefix) - 1:
            entries.insert(prefix[:fed], snapshot(first.cache), drafter=cache_id,
                           drafter_state=None if cache_id is None else first.proposer.snapshot())
    by_first: dict[int, Counter] = {}
    drafted = accepted = 0
    companion = prompts(s.vocab)[5]
    for seed in range(n):
        mx.random.seed(seed)
        hit = entries.fetch(prefix, drafter=cache_id)
        assert hit.cached == len(prefix) - 1
        decoder = s.engine.make_decoder(_request(s, prefix, SAMPLED, 2, 3), hit.cache, hit.cached)
        whole_copies(decoder.proposer)
        if hit.drafter is not None:
            decoder.proposer.restore(hit.drafter)
        step = decoder.prefill()
        tokens = list(step.tokens)
        batch = None
        if batched:
            other = s.engine.make_decoder(_request(s, companion, GREEDY, 1, 8), None, 0)
            other.prefill()
            batch = BatchSpecDecoder(s.engine.target)
            batch.join("other", other)
            batch.join("sampled", decoder)
        while step.finish_reason is None:
            step = decoder.round(2) if batch is None else batch.round({"sampled": 2, "other": 1})["sampled"]
            tokens += step.tokens
            drafted, accepted = drafted + step.stats.drafted, accepted + step.stats.accepted
        by_first.setdefault(tokens[0], Counter())[tuple(tokens[1:3])] += 1
    first_token, counts = max(by_first.items(), key=lambda kv: sum(kv[1].values()))
    m = sum(counts.values())
    exact = exact_pairs(s.model, prefix + [first_token])
    distance = 0.5 * sum(abs(counts[k] / m - exact.get(k, 0.0)) for k in set(counts) | set(exact))
    return Sample(distance, 3 * 0.5 * math.sqrt(len(exact) / m), len(exact), m, drafted, accepted,
                  set(counts) <= set(exact))  # fmt: skip


def whole_copies(proposer) -> None:
    """Copies go to verify whole: on this CPU the engine's evidence
    (engines/drafting/ngram/copy_length.py) soon learns that the random
    target rejects them and cuts them, which would leave the sample few
    drafts to show a wrong rule by."""
    for p in (proposer, getattr(proposer, "ngram", None)):
        if hasattr(p, "evidence"):
            p.evidence = None


def wrong_rule(draft, draft_probs, target_probs, key=None):
    """Failure injection: Leviathan acceptance, but the residual with p and q
    swapped, normalize(max(q - p, 0)): a slip that draws corrections from the
    draft (for drafts that come alone, the rejected draft itself)."""
    verdict = speculative.accept_sampled(draft, draft_probs, target_probs, key)
    j = verdict.accepted
    if j < len(draft):
        dist = speculative.residual(draft_probs[j], target_probs[j])
        key = None if key is None else mx.random.split(key)[1]
        token = int(mx.random.categorical(mx.log(dist), key=key).item())
        return speculative.Verdict(j, token)
    return verdict
