"""The DFlash drafter trainer: its forward is the engine's, it learns, it
resumes exactly, and the shipped demo drafter really drafts for the demo model."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from specgate.builders import dflash_training as dt
from specgate.builders.drafters import build_dflash_drafter
from specgate.builders.tiny import build_qwen35_hybrid
from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.checkpoints.builtin import default_model_path, demo_dflash_path
from specgate.engines.drafting.dflash.model import check_pairing, load_dflash
from specgate.engines.drafting.dflash.proposer import DFlashProposer
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.targets import target_for

BLOCK = 5
LAYER_IDS = [0, 2]  # of the tiny target's 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A float32 Qwen3.5 hybrid (4 layers, GQA 4:2) and a prepared work dir
    whose corpus is random tokens (the labels are the target's own argmax,
    so even random text has something to learn)."""
    root = tmp_path_factory.mktemp("dflash_training")
    target = build_qwen35_hybrid(root / "target", tokenizer=False)
    work = root / "work"
    work.mkdir()
    rng = np.random.default_rng(0)
    np.savez(work / "corpus.npz", train=rng.integers(0, 2000, 20_000).astype(np.uint16),
             heldout=rng.integers(0, 2000, 2_000).astype(np.uint16))  # fmt: skip
    cfg = small_config(steps=12)
    dt.prepare(work, target, cfg)
    return target, work


def small_config(**kw) -> dt.DrafterConfig:
    return dt.DrafterConfig(**{**dict(batch_size=2, seq_len=48, anchors=12, block_size=BLOCK,
                                      num_layers=2, target_layer_ids=LAYER_IDS,
                                      learning_rate=3e-3, warmup_steps=2, save_every=100), **kw})  # fmt: skip


def test_training_forward_equals_the_inference_module(tiny):
    target, work = tiny
    trunk, drafter = dt.load_target(target), dt.load_trainable(work / "init")
    tokens = mx.array(np.random.default_rng(1).integers(0, 2000, (2, 40)).astype(np.int32))
    features, greedy = dt.target_view(trunk, tokens, LAYER_IDS)
    # The first and last anchors a window allows, and some between.
    anchors = mx.array([[1, 7, 20, 36], [3, 4, 30, 35]])
    blocks, labels = dt.block_inputs(
        trunk, tokens, greedy, anchors, BLOCK, drafter.args.mask_token_id
    )
    out = dt.block_forward(drafter, blocks, features, anchors)
    mask = drafter.args.mask_token_id
    for b in range(2):
        for k in range(4):
            a = anchors[b, k].item()
            block = mx.array([[tokens[b, a].item()] + [mask] * (BLOCK - 1)])
            want = drafter(trunk.embed(block), features[b : b + 1, :a], drafter.make_cache())
            np.testing.assert_allclose(np.array(out[b, k]), np.array(want[0]), atol=1e-4, rtol=1e-4)
            # Block position j learns the target's greedy choice for token a+j.
            assert labels[b, k].tolist() == greedy[b, a : a + BLOCK - 1].tolist()


def _loss(drafter, trunk, work, cfg) -> float:
    data = np.load(work / "corpus.npz")["heldout"]
    tokens, anchors = dt.sample_batch(data, small_config(batch_size=4), 0)
    features, greedy = dt.target_view(trunk, tokens, LAYER_IDS)
    blocks, labels = dt.block_inputs(
        trunk, tokens, greedy, anchors, BLOCK, drafter.args.mask_token_id
    )
    weights = dt.position_weights(cfg)
    loss, _ = dt.block_loss(drafter, trunk, blocks, labels, features, anchors, weights)
    return loss.item()


def _weights(path: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(load_dflash(path).parameters())}


def test_trainer_reduces_the_loss_and_resumes_exactly(tiny, tmp_path):
    target, work = tiny
    cfg = small_config(steps=12, dtype="float32")
    trunk = dt.load_target(target)
    before = _loss(dt.load_trainable(work / "init"), trunk, work, cfg)

    w1 = shutil.copytree(work, tmp_path / "w1")
    straight = dt.train(w1, target, tmp_path / "straight", cfg, log=lambda _: None)
    after = _loss(dt.load_trainable(straight), trunk, work, cfg)
    assert after < 0.9 * before, (before, after)

    # Stopped after its first step (state saved), then resumed by the same call.
    w2 = shutil.copytree(work, tmp_path / "w2")
    assert dt.train(w2, target, tmp_path / "cut", cfg, log=lambda _: None, stop_after=0.0) is None
    resumed = dt.train(w2, target, tmp_path / "resumed", cfg, log=lambda _: None)
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    config = json.loads((straight / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == LAYER_IDS
    assert config["block_size"] == BLOCK


# -- the shipped drafter -----------------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    model, config = load_model(default_model_path())
    return target_for(model), config


def heldout_prompts(n: int = 6, length: int = 96) -> list[list[int]]:
    """The starts of stdlib files the demo model and its drafter never trained on."""
    from tokenizers import Tokenizer

    held = json.loads((default_model_path() / "heldout_files.json").read_text())
    tok = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / name).read_text(encoding="utf-8") for name in held[:n]]
    return [enc.ids[:length] for enc in tok.encode_batch(texts, add_special_tokens=False)]


def tokens_per_round(trunk, drafter, prompts, new_tokens: int = 48) -> float:
    """Greedy DFlash decoding at the full block: committed tokens per round
    (accepted drafts + the target's own token)."""
    depth = drafter.args.block_size - 1
    rounds = accepted = 0
    for prompt in prompts:
        request = GenerationRequest("t", "specgate-demo", prompt, SamplingParams(temperature=0),
                                    new_tokens, Plan("mlx_dflash", "dflash", depth, "spec_on"))  # fmt: skip
        decoder = SpecDecoder(trunk, DFlashProposer(trunk, drafter), request, None, 0, None)
        step = decoder.prefill()
        while step.finish_reason is None:
            step = decoder.round(depth)
            rounds, accepted = rounds + 1, accepted + step.stats.accepted
    return 1 + accepted / rounds


def test_shipped_drafter_pairs_with_the_demo_and_is_small():
    path = demo_dflash_path()
    assert sum(f.stat().st_size for f in path.iterdir()) < 5 * 1024 * 1024
    drafter = load_dflash(path)
    model, _ = load_model(default_model_path())
    trunk = target_for(model)
    check_pairing(drafter, trunk)
    assert drafter.args.mask_token_id == dt.unused_token_id(default_model_path())


def test_shipped_drafter_accepts_where_a_random_one_does_not(demo, tmp_path):
    """Held out, the shipped drafter gets ~1.32 tokens a round on these six
    prompts (0.12-0.68 accepted drafts per prompt); a random drafter of the
    same shape gets exactly 1 (nothing accepted). The bound is conservative."""
    trunk, _ = demo
    prompts = heldout_prompts()
    trained = load_dflash(demo_dflash_path())
    a = trained.args
    random_path = build_dflash_drafter(tmp_path / "random", target=default_model_path(),
                                       num_hidden_layers=a.num_hidden_layers, block_size=a.block_size,
                                       target_layer_ids=a.target_layer_ids,
                                       mask_token_id=a.mask_token_id, dtype="bfloat16",
                                       tokenizer=False)  # fmt: skip
    got = tokens_per_round(trunk, trained, prompts)
    # A random drafter accepts nothing anywhere: two short prompts show it.
    baseline = tokens_per_round(trunk, load_dflash(random_path), prompts[:2], new_tokens=24)
    assert got > 1.15, got
    assert got > baseline + 0.1, (got, baseline)
