"""Acceptance rules for speculative decoding: pure functions on arrays.

A round drafts k tokens d_1..d_k; the target scores the k+1 positions in one
forward, giving p_1..p_{k+1} (p_j: the target's distribution for the token
after d_{j-1}, with p_1 following the last committed token). Each rule
returns how many drafts it accepts and the one token the target adds after
them, so every round commits accepted + 1 tokens.

- Greedy (temperature 0): accept while d_j == argmax p_j; the added token is
  argmax p_{accepted+1}. The output equals plain greedy decoding.
- Seeded (sampling with a seed): the target's own token at each position
  is its Gumbel-max sample there, x_j = argmax(log p_j + g(seed, t_j)) with
  t_j the position's index in the sequence (engines/sampling.py: what plain
  decoding of the same seed draws at t_j). Accept while d_j == x_j; the
  added token is x_{accepted+1}: the greedy rule on x (`accept_greedy`).
  The output is plain sampling's with that seed, token for token, whatever
  the drafts (so whichever engine serves the request), and exactly the
  target's distribution (Gumbel-max is exact). Drafts drawn from q with
  the same noise, argmax(log q_j + g(seed, t_j)), stand with probability
  P(argmax(log q + g) == argmax(log p + g)); a point-mass draft with p(d).
- Sampled (Leviathan et al. 2023, Chen et al. 2023), unseeded: accept d_j with
  probability min(1, p_j(d_j) / q_j(d_j)) where q_j is the distribution d_j
  was drawn from; at the first rejection draw from normalize(max(p_j - q_j, 0));
  if all k are accepted draw the bonus from p_{k+1}. The committed tokens are
  distributed exactly as the target's own samples.

Drafts that come without a distribution (a drafter's argmax, text copied
from the context) are point masses: q_j = one-hot(d_j), so d_j is accepted
with probability p_j(d_j) and a rejection draws from p_j without d_j. That
is exact whatever chose the drafts: given d, the token committed is
distributed as p.

p and q must be the exact distributions (after penalties, temperature, top-k,
top-p, min-p: engines/sampling.py), each conditioned on its own prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafts accepted, 0..k
    next_token: int  # the correction (after a rejection) or the bonus token


def accept_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> Verdict:
    """target_argmax[j]: the target's own token after accepting j drafts
    (k+1 entries for k drafts): its argmax, or, seeded, its Gumbel-max sample."""
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return Verdict(n, int(target_argmax[n]))


def residual(p: mx.array, q: mx.array) -> mx.array:
    """normalize(max(p - q, 0)); p itself if the residual has no mass (p == q)."""
    r = mx.maximum(p - q, 0.0)
    total = r.sum(axis=-1, keepdims=True)
    return mx.where(total > 0, r / mx.maximum(total, 1e-30), p)


def accept_sampled(
    draft: Sequence[int],
    draft_probs: mx.array,
    target_probs: mx.array,
    key: mx.array | None = None,
) -> Verdict:
    """Leviathan-Chen rejection sampling.

    draft_probs: (k, V), q_j the distribution d_j was drawn from.
    target_probs: (k+1, V), p_j as above.
    """
    k = len(draft)
    keys = mx.random.split(key, 2) if key is not None else (None, None)
    u = mx.random.uniform(shape=(k,), key=keys[0]).tolist() if k else []
    idx = mx.array(list(draft), dtype=mx.int32)
    p_d = target_probs[mx.arange(k), idx].tolist() if k else []
    q_d = draft_probs[mx.arange(k), idx].tolist() if k else []
    j = accepted_drafts(u, p_d, q_d)
    return Verdict(j, _draw(next_token_distribution(j, draft_probs, target_probs), keys[1]))


def accepted_drafts(u: Sequence[float], p_d: Sequence[float], q_d: Sequence[float]) -> int:
    """How many drafts stand: d_j is accepted while u_j < p_j(d_j) / q_j(d_j),
    u_j uniform on [0, 1); written without dividing (q_j(d_j) > 0: d_j was
    drawn from q_j)."""
    for j in range(len(u)):
        if u[j] * q_d[j] >= p_d[j]:
            return j
    return len(u)


def next_token_distribution(accepted: int, draft_probs: mx.array, target_probs: mx.array) -> mx.array:
    """What the round's last token is drawn from: the residual at the first
    rejection, p_{k+1} when all k drafts stood."""
    if accepted < draft_probs.shape[0]:
        return residual(target_probs[accepted], draft_probs[accepted])
    return target_probs[accepted]


def point_masses(drafts: mx.array, vocab: int) -> mx.array:
    """q for drafts that come alone: (k, V), one-hot on each draft."""
    return (mx.arange(vocab)[None, :] == drafts.astype(mx.int32)[:, None]).astype(mx.float32)


def _draw(probs: mx.array, key: mx.array | None) -> int:
    # categorical takes logits; log(0) = -inf keeps impossible tokens impossible.
    return int(mx.random.categorical(mx.log(probs), key=key).item())
