"""specgate/engines/sampling.py against a plain numpy reference."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from specgate.engines.base import SamplingParams
from specgate.engines.sampling import (
    PenaltyState,
    apply_penalties,
    probabilities,
    sample,
)

LOGITS = np.array([2.0, 1.5, 0.3, 0.2, -1.0, -3.0, 0.9, 1.1], dtype=np.float32)


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    x = logits / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    if top_k:
        keep &= x >= np.sort(x)[-top_k]
    if top_p < 1.0:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        keep_sorted = before < top_p
        mask = np.zeros_like(keep)
        mask[order[keep_sorted]] = True
        keep &= mask
    if min_p:
        keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.3, top_k=3),
    dict(temperature=1.0, top_p=0.6), dict(temperature=0.8, min_p=0.2),
    dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
])
def test_probabilities_match_reference(params):
    got = np.array(probabilities(mx.array(LOGITS), SamplingParams(**params)))
    np.testing.assert_allclose(got, reference(LOGITS, **params), atol=1e-6)


def test_greedy_is_one_hot_argmax():
    p = SamplingParams(temperature=0.0)
    assert np.array(probabilities(mx.array(LOGITS), p)).tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert sample(mx.array(LOGITS), p).item() == 0


def _chi2(draws: np.ndarray, want: np.ndarray) -> float:
    n = len(draws)
    counts = np.bincount(draws, minlength=len(want))
    assert counts[want == 0].sum() == 0  # truncated tokens are never drawn
    support = want > 0
    return (((counts[support] - n * want[support]) ** 2) / (n * want[support])).sum()


@pytest.mark.parametrize("over", ["process state", "seeds", "positions"])
def test_samples_follow_the_distribution(over):
    """Unseeded, from MLX's random state; seeded (Gumbel-max), over seeds at
    one position and over positions of one seed: each is the distribution."""
    want = reference(LOGITS, 0.9, 6, 0.95)
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95)
    logits, n = mx.array(LOGITS), 4000
    if over == "process state":
        mx.random.seed(1234)
        draws = [sample(logits, params).item() for _ in range(n)]
    elif over == "seeds":
        draws = [sample(logits, replace(params, seed=s), 17).item() for s in range(n)]
    else:
        draws = [sample(logits, replace(params, seed=7), t).item() for t in range(n)]
    chi2 = _chi2(np.array(draws), want)
    assert chi2 < 25, chi2  # dof <= 5: p ~ 1e-4


def test_a_seeded_token_depends_on_its_seed_and_position_alone():
    """The same (seed, position) gives the same token whatever was drawn
    before, one row at a time or as rows of a verify window, as log-probs or
    logits; any integer is a seed."""
    params = SamplingParams(temperature=1.0, seed=7)
    rows = mx.array(np.stack([np.roll(LOGITS, i) for i in range(5)]))
    each = [sample(rows[i], params, 40 + i).item() for i in range(5)]
    assert sample(rows, params, 40).tolist() == each
    assert sample(rows[2:3], params, 42).tolist() == each[2:3]  # mlx-lm's (1, V)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    assert sample(logprobs, params, 40).tolist() == each
    other = [sample(rows[i], replace(params, seed=8), 40 + i).item() for i in range(5)]
    later = [sample(rows[i], params, 41 + i).item() for i in range(5)]
    assert each != other and each != later  # (a 5-token coincidence: ~1e-4)
    for seed in (-1, 2**64 + 7, 10**30):
        assert 0 <= sample(rows[0], replace(params, seed=seed), 0).item() < len(LOGITS)
    with pytest.raises(ValueError, match="position"):
        sample(rows[0], params)


def test_logprobs_stay_reportable_under_extreme_logits():
    from specgate.engines.sampling import LOGPROB_FLOOR, logprobs_of

    lp = logprobs_of(mx.array([float("inf"), 1.0, float("-inf"), float("nan")]))
    assert all(LOGPROB_FLOOR <= v <= 0.0 for v in lp.tolist())


def test_penalties():
    state = PenaltyState.from_prompt([0, 1], len(LOGITS))
    later = state.advance([2, 2, 4])
    # advance returns a new state: a rejected speculative window leaves the
    # accepted state untouched.
    assert np.array(state.output_counts).sum() == 0
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    got = np.array(apply_penalties(mx.array(LOGITS), later, params))
    want = LOGITS.copy()
    for t in (0, 1, 2, 4):  # seen in prompt or output: repetition penalty
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    want[2] -= 0.25 * 2 + 0.5
    want[4] -= 0.25 * 1 + 0.5
    np.testing.assert_allclose(got, want, atol=1e-6)
