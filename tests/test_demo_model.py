"""The demo model: the shipped one is verified, and the trainer really trains."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from specgate.builders.demo_training import TrainConfig, evaluate, load_demo, prepare, train
from specgate.engines.checkpoints.builtin import default_model_path
from specgate.engines.checkpoints.inspect import inspect_checkpoint


def test_shipped_demo_model_is_verified_and_small():
    path = default_model_path()
    assert inspect_checkpoint(str(path)).verdict == "verified"
    assert sum(f.stat().st_size for f in path.iterdir()) < 20 * 1024 * 1024


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("demo") / "work", "tiny", max_files=30, log=lambda _: None)


def fresh(work, dest):
    """A copy of the prepared work dir without any training state."""
    return shutil.copytree(work, dest, ignore=shutil.ignore_patterns("state"))


def _weights(path) -> dict[str, np.ndarray]:
    model = load_demo(path)
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_trainer_learns_and_resumes_exactly(work, tmp_path):
    cfg = TrainConfig(size="tiny", steps=24, batch_size=4, seq_len=48, warmup_steps=2,
                      learning_rate=3e-3, save_every=100)
    held = np.load(work / "corpus.npz")["heldout"][:3000]
    before = evaluate(load_demo(work / "init"), held)

    straight = train(fresh(work, tmp_path / "w1"), tmp_path / "straight", cfg, log=lambda _: None)
    after = evaluate(load_demo(straight), held)
    assert after.trunk_perplexity < 0.5 * before.trunk_perplexity, (before, after)

    # Interrupted at step 10 (state saved), then resumed by the same call.
    other = fresh(work, tmp_path / "w2")
    assert train(other, tmp_path / "cut", cfg, log=lambda _: None, stop_after=0.0) is None
    resumed = train(other, tmp_path / "resumed", cfg, log=lambda _: None)
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_exported_model_loads_in_mlx_lm_and_is_verified(work, tmp_path):
    from mlx_lm import load

    cfg = TrainConfig(size="tiny", steps=2, batch_size=2, seq_len=16, warmup_steps=1)
    out = train(fresh(work, tmp_path / "w"), tmp_path / "out", cfg, log=lambda _: None)
    model, tokenizer = load(str(out))
    logits = model(mx.array([tokenizer.encode("def f(x):")]))
    assert bool(mx.isfinite(logits).all())
    report = inspect_checkpoint(str(out))
    assert report.verdict == "verified", report.to_dict()
