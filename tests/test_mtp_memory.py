"""The MTP engine costs its head's own tensors and caches, nothing more:
the trunk's weights (embedding and lm_head included) are shared, not copied."""

from __future__ import annotations

import gc

import mlx.core as mx
from mlx.utils import tree_flatten

from specgate.builders.tiny import build_qwen35_hybrid
from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.drafting.mtp import proposer as mtp
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.loading import load_mlx_model
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.mlx_spec.engine import SpecEngine


def active_bytes() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def test_loading_the_mtp_engine_costs_only_the_head(tmp_path):
    # A large vocabulary makes an accidental copy of embedding or lm_head obvious.
    path = build_qwen35_hybrid(tmp_path / "m", hidden_size=128, vocab_size=16384)
    loaded = load_mlx_model(str(path))
    mx.eval(loaded.model.parameters())
    trunk = nbytes(loaded.model)
    before = active_bytes()

    engine = SpecEngine("m", loaded, name="mlx_mtp", drafting=mtp.drafting, max_context=1024)
    mx.eval(engine.drafting.weights.parameters())
    head = nbytes(engine.drafting.weights)
    loaded_cost = active_bytes() - before
    assert head < trunk / 4
    assert loaded_cost <= head + 64 * 1024, (loaded_cost, head, trunk)

    # Decoding adds caches (trunk and head), bounded by the sequence, not weights.
    request = GenerationRequest("r", "m", list(range(1, 33)), SamplingParams(temperature=0), 16,
                                Plan("mlx_mtp", "mtp", 2, "spec_on"))
    decoder = SpecDecoder(engine.target, MTPProposer(engine.target, engine.drafting.weights), request, None, 0,
                          None)
    step = decoder.prefill()
    while step.finish_reason is None:
        step = decoder.round(2)
    caches = sum(c.nbytes for c in decoder.cache) + sum(c.nbytes for c in decoder.proposer.cache)
    decoding_cost = active_bytes() - before - loaded_cost
    assert decoding_cost <= caches + 256 * 1024, (decoding_cost, caches)

