"""A new speculative method is a proposer module and one registry record.

`PromptLookup` below is a test-only proposer (copying what followed the
last earlier occurrence of the current tail, the simplest self-drafting),
defined in this module, registered for the test with one record whose
builder is `registry.spec_engine`: nothing in engines/, policies/ or
gateway/ is edited. The config accepts the new engine, the policy plans
it, and it decodes exactly: drafts without q are accepted against the
target's own tokens, so greedy output is plain greedy decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence

import exactness
import mlx.core as mx
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx_lm.utils import load_model

from specgate.builders.tiny import build_qwen35_hybrid
from specgate.engines import registry
from specgate.engines.base import GenerationRequest, LiveState, Plan, SamplingParams
from specgate.engines.cache.prefix_cache import PrefixCache
from specgate.engines.drafting.base import Context, Drafting, Proposal
from specgate.engines.loading import LoadedModel
from specgate.engines.registry import MLX, BuildContext, EngineRecord
from specgate.engines.settings import NgramSettings
from specgate.gateway.config import parse_config
from specgate.policies.config import PolicyConfig
from specgate.policies.decide import RequestFeatures, decide
from specgate.policies.model_policy import build_policy


class PromptLookup:
    """Test-only proposer: the tokens that followed the latest earlier
    occurrence of the sequence's last 3, 2 or 1 tokens."""

    method = "lookup"
    layers = ()

    def __init__(self, target):
        self.target = target

    def prefilled(self, start: int, forward, prompt: Sequence[int]) -> None:
        pass

    def committed(self, last: int, drafts: list[int], accepted: int, forward) -> None:
        pass

    def pending(self) -> list:
        return []

    def propose(self, context: Context, depth: int) -> Proposal | None:
        tokens = context.tokens
        for n in (3, 2, 1):
            tail = tokens[-n:]
            for i in range(len(tokens) - n - 1, -1, -1):
                if tokens[i : i + n] == tail:
                    drafts = tokens[i + n : i + n + depth]
                    return Proposal(mx.array(drafts)) if drafts else None
        return None


def drafting(loaded, target, drafter=None, settings=None) -> Drafting:
    return Drafting("lookup", PromptLookup)


RECORD = EngineRecord("mlx_lookup", "lookup", MLX, registry.spec_engine("mlx_lookup", __name__),
                      settings=NgramSettings, depth=lambda settings, engine: 4,
                      tune=registry.spec_rounds)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_qwen35_hybrid(tmp_path_factory.mktemp("lookup") / "m", tokenizer=False)
    model, config = load_model(path)
    model.set_dtype(mx.float32)
    return path, LoadedModel(str(path), model, None, config, PrefixCache(str(path)))


def test_a_module_and_a_record_make_a_method_that_decodes_exactly(tiny):
    path, loaded = tiny
    with registry.registered(RECORD):
        assert "lookup" in registry.methods()
        config = parse_config({"models": [{"id": "m", "path": str(path),
                                           "engines": ["mlx_plain", "mlx_lookup"]}]})  # fmt: skip
        assert config.models[0].engines == ["mlx_plain", "mlx_lookup"]
        ctx = BuildContext("m", str(path), MLX, engines=("mlx_plain", "mlx_lookup"),
                           max_context=1024, loaded=loaded)  # fmt: skip
        engines, refused = registry.build_engines(ctx)
        assert set(engines) == {"mlx_plain", "mlx_lookup"} and not refused
        policy = build_policy("m", engines, refused, PolicyConfig(), context=ctx, params=None)
        plan = decide(policy, RequestFeatures(16, has_penalties=False), LiveState(0, 0, 16))
        assert (plan.engine, plan.method, plan.depth) == ("mlx_lookup", "lookup", 4)

    engine = engines["mlx_lookup"]
    drafted = accepted = 0
    for prompt in ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 40, 41, 40, 2, 3, 40, 41]):
        want, margins = greedy_reference(loaded.model, prompt, 48)
        request = GenerationRequest("t", "m", prompt, SamplingParams(temperature=0), 48,
                                    Plan("mlx_lookup", "lookup", 4, "spec_on"))  # fmt: skip
        decoder = engine.make_decoder(request, None, 0)
        step = decoder.prefill()
        got = list(step.tokens)
        while step.finish_reason is None:
            step = decoder.round(4)
            got += step.tokens
            drafted += step.stats.drafted
            accepted += step.stats.accepted
        assert_same_greedy(got, want, margins)
    assert drafted > 0  # the lookup really proposed, and was verified
    print(f"[lookup: {accepted} of {drafted} drafts accepted]", end=" ")


def test_the_exactness_harness_proves_it_once_registered(tmp_path):
    """Registered, the method is one of tests/exactness.py's subjects, on the
    targets its record's needs pick, and passes the same proofs as every
    shipped method (a smaller sample at temperature here)."""
    with registry.registered(RECORD):
        ours = [family for engine, family in exactness.subjects() if engine == "mlx_lookup"]
        assert ours == list(exactness.NEEDS["nothing"].greedy)
        subject = exactness.subject(tmp_path, "mlx_lookup", ours[-1])
        for depth in subject.depths:
            sweep = exactness.greedy_sweep(subject, depth)
            assert set(range(depth + 1)) <= set(sweep.lengths)
        sampled = exactness.subject(tmp_path, "mlx_lookup", "v12_hybrid", sampled=True)
        got = exactness.sample_rounds(sampled, 400)
        assert got.drafted > 0 and got.accepted > 0 and got.support_ok
        assert got.distance < got.bound
        assert exactness.seeded_sweep(sampled, seed=5)[1] > 0
    assert "mlx_lookup" not in dict(exactness.subjects())
