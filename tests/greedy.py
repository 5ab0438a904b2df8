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
