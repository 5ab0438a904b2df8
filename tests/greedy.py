"""Greedy references and the exactness check shared by the tests.

Floating point: a forward over several rows (a batch, or a verify window) is
not bit-identical to one-row steps, so a divergence from the reference is
accepted only where the reference's top two logits are within NEAR_TIE, and
the continuations legitimately differ after it.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generate_step

NEAR_TIE = 1e-4


def seeded_reference(
    model, prompt: list[int], max_tokens: int, params
) -> tuple[list[int], list[float]]:
    """Plain sampling of a seeded request through mlx-lm's generate_step, each
    token engines/sampling.sample's at its absolute position (the plain
    engine's sampler): tokens and, at each position, the top-2 margin of
    log p' + g, where a divergence is a near-tie as in greedy decoding."""
    from specgate.engines.sampling import gumbel_noise, sample, truncated_logits

    margins, position = [], len(prompt)

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal position
        x = truncated_logits(logprobs[0], params)
        scored = x - mx.logsumexp(x) + gumbel_noise(params.seed, position, 1, x.shape[-1])[0]
        top2 = mx.sort(scored)[-2:].tolist()
        margins.append(top2[1] - top2[0])
        token = sample(logprobs, params, position)
        position += 1
        return token

    tokens = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                          sampler=sampler)]  # fmt: skip
    return tokens, margins[: len(tokens)]


def greedy_reference(
    model, prompt: list[int], max_tokens: int, eos: frozenset[int] = frozenset(),
    logits_processors: list | None = None,
) -> tuple[list[int], list[float]]:
    """Plain mlx-lm greedy decoding: tokens (cut before EOS) and, at each
    position, the top1-top2 logit margin (after the processors)."""
    tokens, margins = [], []
    for token, logprobs in generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda lp: mx.argmax(lp, axis=-1),
        logits_processors=logits_processors,
    ):
        if token in eos:
            break
        top2 = mx.sort(logprobs)[-2:].tolist()
        tokens.append(token)
        margins.append(top2[1] - top2[0])
    return tokens, margins


def assert_same_greedy(got: list[int], want: list[int], margins: list[float]) -> int:
    """Equal token for token, or diverging at a checked near-tie; returns 1 if
    it diverged (at a near-tie), else 0."""
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            assert margins[i] < NEAR_TIE, (
                f"diverged at token {i} ({g} != {w}) where the plain path's top-2 margin is "
                f"{margins[i]:.3g}, not a near-tie"
            )
            return 1
    assert len(got) == len(want), f"lengths differ: {len(got)} vs {len(want)}"
    return 0
