"""Under a grammar, speculative decoding is still exactly the target's.

Greedy: a tiny Qwen3.5 hybrid with a real byte-level tokenizer, held to a
JSON schema, decodes with MTP (its own random head, drafting under the
mask), DFlash (a random drafter, and injected drafts: the true continuation
corrupted at one position, often into a token the grammar refuses), DSpark
(a random drafter drawing under the mask), ngram (injected copies, likewise
corrupted) and mtp+ngram. Each equals plain mlx-lm
greedy decoding whose logits are masked by a separate llguidance matcher,
token for token, and the output is valid JSON of the schema. In a batch
(mlx_spec/batch_decoder.py, a tiny dense qwen3 with the same tokenizer),
streams held to the schema beside free ones are each exact the same way.

Sampled: the 12-token hybrid of test_mtp_distribution, its tokens spelled
"a".."k" and an EOS, held to /[a-k][degjk][a-k]/; from one prefix, the two
tokens of a depth-2 round are drawn many times, with MTP drafts (q
masked as the target's p) and with drafts that come alone (point masses), and compared with the
target's exact constrained joint p(x) p(y | x), computed from plain forwards
with the masks written out by hand. A stale mask (every verify position
masked as the first, a slip that forgets the drafts before it) must fail the
same check: it is valid at every position here, [degjk] inside [a-k], so only
the distribution shows it. The fast tier draws N_FAST samples, the proof
tier (`pytest -m proof`) N.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
import pytest
from exactness import Injected
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load_model
from test_mtp_distribution import PARAMS, PROMPT, tv
from test_ngram_exactness import InjectedNgram

from specgate.builders.drafters import build_dflash_drafter, build_dspark_drafter
from specgate.builders.tiny import build_qwen3_dense, build_qwen35_hybrid
from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.cache.prefix_cache import PrefixCache
from specgate.engines.drafting.base import Proposal
from specgate.engines.drafting.dflash.model import load_dflash
from specgate.engines.drafting.dflash.proposer import DFlashProposer
from specgate.engines.drafting.dspark.model import load_dspark
from specgate.engines.drafting.dspark.proposer import DSparkProposer
from specgate.engines.drafting.mtp.loading import load_mtp_head
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.drafting.mtp_ngram import MTPNgramProposer
from specgate.engines.drafting.ngram.proposer import NgramProposer
from specgate.engines.grammar.matcher import GrammarState, json_constraint, lark_constraint
from specgate.engines.loading import LoadedModel
from specgate.engines.mlx_spec.batch_decoder import BatchSpecDecoder
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.sampling import probabilities
from specgate.engines.targets import target_for

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 9999},
        "kind": {"enum": ["file", "dir", "link"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "size", "kind", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 120


class Hybrid:
    def __init__(self, root):
        path = build_qwen35_hybrid(root / "target")
        model, config = load_model(path)
        model.set_dtype(mx.float32)
        self.model, self.trunk = model, target_for(model)
        self.tokenizer = load_tokenizer(path)
        loaded = LoadedModel(str(path), model, self.tokenizer, config, PrefixCache(str(path)))
        self.head = load_mtp_head(loaded)
        self.head.set_dtype(mx.float32)
        self.drafter = load_dflash(build_dflash_drafter(root / "dflash", target=path, block_size=5,
                                                        num_hidden_layers=2, tokenizer=False))
        self.dspark = load_dspark(build_dspark_drafter(root / "dspark", target=path, block_size=4,
                                                       num_hidden_layers=2, target_layer_ids=[-1, 2],
                                                       tokenizer=False))
        self.grammars = loaded.grammars
        self.eos = frozenset(self.tokenizer.eos_token_ids)
        self.constraint = json_constraint(SCHEMA, "response_format")
        self._references: dict = {}

    def reference(self, prompt: list[int]):
        """Plain greedy decoding, masked by an llguidance matcher of its own."""
        if tuple(prompt) not in self._references:
            ll = llguidance.hf.from_tokenizer(self.tokenizer._tokenizer, n_vocab=self.trunk.vocab_size,
                                              eos_token=sorted(self.eos))
            matcher = llguidance.LLMatcher(ll, self.constraint.grammar)
            start = len(prompt)

            def mask(tokens, logits):
                new = tokens[start + matcher_len[0] :].tolist()
                assert all(matcher.consume_token(t) for t in new)
                matcher_len[0] += len(new)
                bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
                allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]].astype(bool)
                return mx.where(mx.array(allowed), logits, float("-inf"))

            matcher_len = [0]
            self._references[tuple(prompt)] = greedy_reference(
                self.model, prompt, MAX_TOKENS, self.eos, logits_processors=[mask])
        return self._references[tuple(prompt)]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return Hybrid(tmp_path_factory.mktemp("grammar"))


def decode(h: Hybrid, prompt, depth, proposer, params=None):
    params = params or SamplingParams(temperature=0, constraint=h.constraint)
    request = GenerationRequest("t", "m", prompt, params, MAX_TOKENS,
                                Plan("e", proposer.method, depth, "spec_on"), h.eos)  # fmt: skip
    decoder = SpecDecoder(h.trunk, proposer, request, None, 0, None,
                          grammar=h.grammars.state(params.constraint))  # fmt: skip
    step = decoder.prefill()
    tokens, drafted, accepted = list(step.tokens), 0, 0
    while step.finish_reason is None:
        step = decoder.round(depth)
        tokens += step.tokens
        drafted, accepted = drafted + step.stats.drafted, accepted + step.stats.accepted
    return tokens, step.finish_reason, drafted, accepted


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(rng.randint(2, 24))] for _ in range(n)]


def check(h: Hybrid, prompt, tokens, finish) -> int:
    want, margins = h.reference(prompt)
    diverged = assert_same_greedy(tokens, want, margins)
    if finish == "stop" and not diverged:  # the grammar ended it: a whole value
        value = json.loads(h.tokenizer.decode(tokens))
        assert set(value) == set(SCHEMA["required"]) and value["kind"] in ("file", "dir", "link")
    return diverged


@pytest.mark.parametrize("method", ["mtp", "dflash", "dflash_injected", "dspark", "ngram_injected",
                                    "mtp_ngram"])
def test_greedy_under_a_grammar_equals_plain(hybrid, method):
    h, rng = hybrid, random.Random(1)
    stopped, drafted, accepted = 0, 0, 0
    for i, prompt in enumerate(prompts(6, seed=3)):
        depth = 1 + i % 4
        if method == "mtp":
            proposer = MTPProposer(h.trunk, h.head)
        elif method == "dflash":
            proposer = DFlashProposer(h.trunk, h.drafter)
        elif method == "dspark":
            proposer = DSparkProposer(h.trunk, h.dspark)
        elif method == "mtp_ngram":
            proposer = MTPNgramProposer(h.trunk, h.head, mtp_depth=3)
        elif method == "dflash_injected":  # failure injection: drafts the test chose
            proposer = Injected(DFlashProposer(h.trunk, h.drafter), h.reference(prompt)[0], rng,
                                h.trunk.vocab_size)  # fmt: skip
        else:  # failure injection: the index is handed a corrupted copy of the answer
            want = h.reference(prompt)[0]
            corrupt = [t if rng.random() > 0.15 else rng.randrange(1000) for t in want]
            proposer = InjectedNgram(prompt + corrupt)
        tokens, finish, d, a = decode(h, prompt, depth, proposer)
        check(h, prompt, tokens, finish)
        stopped += finish == "stop"
        drafted, accepted = drafted + d, accepted + a
    assert stopped >= 3, "the schema should end most outputs well within MAX_TOKENS"
    assert drafted > 0
    if method not in ("dflash", "dspark"):  # a random block drafter rarely agrees with the trunk
        assert accepted > 0


# -- sampled: the 12-token hybrid -----------------------------------------------------------------

LETTERS = "abcdefghijk"  # token ids 0..10; 11 is EOS
EOS = 11
GRAMMAR = "start: /[a-k][degjk][a-k]/"
SETS = [set(range(11)), {3, 4, 6, 9, 10}, set(range(11))]  # the grammar, by hand
FIRST = 7  # "h": the committed token every sample starts from


class _LetterTokenizer:
    """Token i is the letter LETTERS[i], so llguidance can read the grammar
    over a 12-token vocabulary."""

    eos_token_id, bos_token_id = EOS, None
    tokens = [c.encode() for c in LETTERS] + [b"<eos>"]
    special_token_ids = [EOS]

    def __call__(self, text: bytes) -> list[int]:
        return [LETTERS.index(chr(b)) for b in text]


def letter_grammar() -> GrammarState:
    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_LetterTokenizer()), n_vocab=12)
    return GrammarState(ll, lark_constraint(GRAMMAR, "grammar"))


def exact_constrained_pairs(model, prefix: list[int]) -> dict:
    """p(x) p(y | x) at generated positions 1 and 2, masked by SETS."""

    def dist(tokens, allowed):
        logits = model(mx.array([tokens]))[0, -1]
        keep = mx.array([i in allowed for i in range(12)])
        return probabilities(mx.where(keep, logits, float("-inf")), PARAMS).tolist()

    joint = {}
    for x, px in enumerate(dist(prefix, SETS[1])):
        if px > 0:
            for y, py in enumerate(dist(prefix + [x], SETS[2])):
                if py > 0:
                    joint[(x, y)] = px * py
    return joint


class PointDrafts:
    """Drafts without q, as DFlash's argmax and ngram's copies come: always
    the same two tokens, so both the accepted and the resampled paths run."""

    method, layers = "ngram", ()

    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def prefilled(self, start, forward, prompt) -> None:
        pass

    def propose(self, context, depth) -> Proposal:
        return Proposal(mx.array(self.drafts[:depth]))

    def committed(self, last, drafts, accepted, forward) -> None:
        pass

    def pending(self) -> list:
        return []


def sample_constrained_pairs(trunk, head, n: int, proposer) -> tuple[Counter, list[int], float]:
    params = SamplingParams(**{**vars(PARAMS), "constraint": letter_grammar().constraint})
    # max_tokens 3: the round's bonus token after y is cut (the stale
    # control would draw it outside the grammar, which the engine refuses).
    request = GenerationRequest("d", "m", PROMPT, params, 3, Plan("e", "mtp", 2, "spec_on"),
                                frozenset([EOS]))
    counts, accepted, drafted = Counter(), 0, 0
    for i in range(n):
        # A fresh decoder per sample (the first token's prefill is cheap
        # here), its first token fixed so every sample shares one prefix.
        d = SpecDecoder(trunk, proposer(), request, None, 0, None, grammar=letter_grammar())
        for _ in d.prefill_chunks():
            pass
        d._prefill_hidden = None
        d._commit([FIRST], [])  # the prompt is in: a fixed first token
        mx.random.seed(1000 + i)
        got = []
        while len(got) < 2:
            step = d.round(2)
            got += step.tokens
            accepted, drafted = accepted + step.stats.accepted, drafted + step.stats.drafted
        counts[tuple(got[:2])] += 1
    return counts, PROMPT + [FIRST], accepted / max(drafted, 1)


_masks_along = GrammarState.masks_along


def stale_masks(self, drafts):
    """Failure injection: every verify position masked as the first."""
    rows = _masks_along(self, drafts)
    return np.repeat(rows[:1], len(rows), axis=0)


# The fast tier: the stale mask is far off at this size (TV 0.43, bound 0.29),
# so the correct rule's check there has the power to see it. (A correct
# sampler passes at any size with the same probability: the bound scales.)
N_FAST = 300
N = 3000  # the proof tier


@pytest.fixture(scope="module")
def v12_target(tmp_path_factory):
    path = build_qwen35_hybrid(
        tmp_path_factory.mktemp("v12"), vocab_size=12, hidden_size=32, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        tokenizer=False, seed=11,
    )  # test_mtp_distribution's target
    model, config = load_model(path)
    loaded = LoadedModel(str(path), model, None, config, PrefixCache(str(path)))
    return target_for(model), load_mtp_head(loaded), model


@pytest.mark.timeout(900)
@pytest.mark.parametrize("rule,drafts,n", [
    ("masked", "mtp", N_FAST), ("masked", "alone", N_FAST), ("stale_mask", "mtp", N_FAST),
    *[pytest.param(*case, marks=pytest.mark.proof) for case in [
        ("masked", "mtp", N), ("masked", "alone", N), ("stale_mask", "mtp", N // 3)]],
])  # fmt: skip
def test_sampling_under_a_grammar_is_the_constrained_target(v12_target, rule, drafts, n,
                                                             monkeypatch, capsys):
    trunk, head, model = v12_target
    if rule == "stale_mask":
        monkeypatch.setattr(GrammarState, "masks_along", stale_masks)
    proposer = {"mtp": lambda: MTPProposer(trunk, head),
                "alone": lambda: PointDrafts([4, 7])}[drafts]  # fmt: skip
    counts, prefix, acceptance = sample_constrained_pairs(trunk, head, n, proposer)
    exact = exact_constrained_pairs(model, prefix)
    bound = 3 * 0.5 * math.sqrt(len(exact) / n)
    distance = tv(counts, exact, n)
    with capsys.disabled():
        print(f"[{rule}, {drafts}: TV {distance:.4f}, bound {bound:.4f}, {len(exact)} outcomes, "
              f"acceptance {acceptance:.2f}]", end=" ")
    if rule == "masked":
        assert acceptance > 0.1
        assert set(counts) <= set(exact)
        assert distance < bound
    else:
        assert distance > bound


def test_grammars_build_from_the_checkpoint_tokenizer(hybrid):
    state = hybrid.grammars.state(hybrid.constraint)
    allowed = state.allowed()
    opening = hybrid.tokenizer.encode("{", add_special_tokens=False)
    assert allowed[opening[0]] and allowed.sum() < len(allowed) / 10
    assert hybrid.grammars.state(None) is None


# -- streams under a grammar inside a batch (issue 45) ---------------------------------


class Dense(Hybrid):
    """A tiny dense qwen3 with a real byte-level tokenizer: all KV caches,
    so the batch takes it (mlx_spec/batch_decoder.py); no drafter."""

    def __init__(self, root):  # Hybrid's references and constraint, on another target
        path = build_qwen3_dense(root / "dense")
        model, config = load_model(path)
        model.set_dtype(mx.float32)
        self.model, self.trunk = model, target_for(model)
        self.tokenizer = load_tokenizer(path)
        self.grammars = LoadedModel(str(path), model, self.tokenizer, config, PrefixCache(str(path))).grammars
        self.eos = frozenset(self.tokenizer.eos_token_ids)
        self.constraint = json_constraint(SCHEMA, "response_format")
        self._references = {}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return Dense(tmp_path_factory.mktemp("grammar-dense"))


def test_streams_under_a_grammar_decode_in_a_batch_each_as_alone(dense):
    """Four streams in one BatchSpecDecoder, two held to the JSON schema
    (n-gram drafts, cut where the grammar refuses them, at depths 3 and 1)
    beside two free ones (depths 2 and 0): each constrained stream equals
    plain greedy decoding masked by its own llguidance matcher, each free
    one plain greedy, token for token, whoever finishes first."""
    h = dense
    free = SamplingParams(temperature=0)
    held = SamplingParams(temperature=0, constraint=h.constraint)
    streams = {"g3": (held, 3), "f2": (free, 2), "g1": (held, 1), "f0": (free, 0)}
    ps = dict(zip(streams, prompts(4, seed=5), strict=True))
    batch, out, drafted = BatchSpecDecoder(h.trunk), {}, 0
    for key, (params, depth) in streams.items():
        request = GenerationRequest(key, "m", ps[key], params, MAX_TOKENS,
                                    Plan("e", "ngram", depth, "spec_on"), h.eos)  # fmt: skip
        decoder = SpecDecoder(h.trunk, NgramProposer(), request, None, 0, None,
                              grammar=h.grammars.state(params.constraint))  # fmt: skip
        step = decoder.prefill()
        out[key] = [list(step.tokens), step.finish_reason]
        batch.join(key, decoder)
    widths = []
    while batch.decoders:
        widths.append(len(batch.decoders))
        for key, step in batch.round({k: d for k, (_, d) in streams.items()}).items():
            out[key][0] += step.tokens
            drafted += step.stats.drafted if key.startswith("g") else 0
            if step.finish_reason is not None:
                out[key][1] = step.finish_reason
                batch.leave(key)
    assert max(widths) == 4
    for key, (params, _) in streams.items():
        tokens, finish = out[key]
        if params.constraint is not None:
            check(h, ps[key], tokens, finish)
        else:
            want, margins = greedy_reference(h.model, ps[key], MAX_TOKENS, h.eos)
            assert_same_greedy(tokens, want, margins)
    assert drafted > 0  # the constrained streams did speculate
