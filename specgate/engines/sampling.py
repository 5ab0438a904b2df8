"""Logits -> distribution -> token, shared by the plain and speculative paths.

One definition of a request's distribution, so the same request samples from
the same distribution whichever engine serves it, and a speculative engine's
target distribution p and draft distribution q are truncated identically.

Order: penalties -> temperature -> top-k -> top-p -> min-p.

Penalty semantics follow the OpenAI API / vLLM:
- presence and frequency penalties count the *generated* tokens only;
- the repetition penalty (HF/vLLM style: divide positive logits, multiply
  negative ones) applies to every token seen in the prompt or the output.
Counts are plain arrays advanced token by token, so a speculative verify
window can advance them per position and throw the copy away on rejection.

Randomness. A seeded request's token at absolute position t (its index in
prompt + output) is argmax(log p'_t + g(seed, t)): Gumbel-max, an exact
sample of p'_t, with g a Gumbel vector drawn from an MLX key that hashes
(seed, t) alone. Nothing counts draws, so the same seed gives the same
token at t on every engine, batch row and thread, whatever was drafted or
which engine decoded the tokens before (a speculative verify computes the
same x_t: engines/mlx_spec/acceptance.py). Unseeded requests draw from the
process's random state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import mlx.core as mx

from specgate.engines.base import SamplingParams

NEG_INF = float("-inf")


@dataclass
class PenaltyState:
    """Token statistics that penalties need, for one sequence."""

    output_counts: mx.array  # (V,) float32: how often each token was generated
    seen: mx.array  # (V,) bool: token appeared in prompt or output

    @classmethod
    def from_prompt(cls, prompt_tokens: list[int], vocab_size: int) -> PenaltyState:
        seen = mx.zeros((vocab_size,), dtype=mx.bool_)
        if prompt_tokens:
            seen[mx.array(prompt_tokens)] = True
        return cls(mx.zeros((vocab_size,), dtype=mx.float32), seen)

    def advance(self, token_ids: list[int] | mx.array) -> PenaltyState:
        """Return the state after generating token_ids (self is unchanged).

        Takes a lazy array too, so a speculative window can advance per
        position without waiting for its drafts to be computed."""
        ids = mx.array(token_ids, dtype=mx.int32) if isinstance(token_ids, list) else token_ids
        if ids.size == 0:
            return self
        counts = self.output_counts.at[ids].add(1.0)
        seen = mx.array(self.seen)
        seen[ids] = True
        return PenaltyState(counts, seen)


def apply_penalties(logits: mx.array, state: PenaltyState, params: SamplingParams) -> mx.array:
    """Penalised logits (float32), same shape as logits (..., V)."""
    logits = logits.astype(mx.float32)
    if params.repetition_penalty != 1.0:
        rp = params.repetition_penalty
        penalised = mx.where(logits > 0, logits / rp, logits * rp)
        logits = mx.where(state.seen, penalised, logits)
    if params.frequency_penalty != 0.0:
        logits = logits - params.frequency_penalty * state.output_counts
    if params.presence_penalty != 0.0:
        logits = logits - params.presence_penalty * (state.output_counts > 0)
    return logits


def penalised(logits: mx.array, state: PenaltyState | None, params: SamplingParams) -> mx.array:
    """`logits` with the request's penalties (none: unchanged)."""
    return logits if state is None else apply_penalties(logits, state, params)


def advanced(state: PenaltyState | None, tokens: list[int] | mx.array) -> PenaltyState | None:
    """The penalty state after `tokens` (None stays None: no penalties)."""
    return None if state is None else state.advance(tokens)


def truncated_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """Temperature-scaled logits with truncated tokens set to -inf.

    Only meaningful for temperature > 0; softmax of the result is the
    distribution a token is drawn from.
    """
    x = logits.astype(mx.float32) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = mx.sort(x, axis=-1)[..., vocab - params.top_k][..., None]
        x = mx.where(x < kth, NEG_INF, x)
    if params.top_p < 1.0:
        order = mx.argsort(-x, axis=-1)
        sorted_x = mx.take_along_axis(x, order, axis=-1)
        sorted_p = mx.softmax(sorted_x, axis=-1)
        # Keep a token if the mass strictly before it is below top_p: the
        # most likely token is always kept.
        before = mx.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = before < params.top_p
        keep = mx.put_along_axis(
            mx.zeros(x.shape, dtype=mx.bool_), order, keep_sorted, axis=-1
        )
        x = mx.where(keep, x, NEG_INF)
    if params.min_p > 0.0:
        # p >= min_p * p_max  <=>  x >= x_max + log(min_p)
        x_max = mx.max(x, axis=-1, keepdims=True)
        x = mx.where(x < x_max + float(mx.log(mx.array(params.min_p))), NEG_INF, x)
    return x


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """The exact distribution sampling draws from (one-hot argmax if greedy)."""
    if params.greedy:
        return (
            mx.arange(logits.shape[-1]) == mx.argmax(logits, axis=-1, keepdims=True)
        ).astype(mx.float32)
    return mx.softmax(truncated_logits(logits, params), axis=-1)


def position_key(seed: int, position: int) -> mx.array:
    """The MLX key of a seeded request's token at absolute `position`: a
    hash of both (any integer is a seed: the APIs allow negative and huge
    ones), so neighbouring positions and seeds get unrelated noise."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little"))


def gumbel_noise(seed: int, start: int, rows: int, vocab: int) -> mx.array:
    """(rows, vocab): g(seed, t) for t = start .. start + rows - 1, standard
    Gumbel, one key per position (the same vector whatever else is drawn)."""
    return mx.stack([mx.random.gumbel((vocab,), key=position_key(seed, start + i))
                     for i in range(rows)])  # fmt: skip


def gumbel_max(logits: mx.array, params: SamplingParams, noise: mx.array) -> mx.array:
    """argmax(log p' + g) per row: a sample of p' (the request's truncated
    distribution) fixed by `noise`. log p' is normalised, so logits that
    differ by a constant per row (an engine handed log-probabilities, one
    handed logits) choose alike."""
    x = truncated_logits(logits, params)
    return mx.argmax(x - mx.logsumexp(x, axis=-1, keepdims=True) + noise, axis=-1)


def sample(logits: mx.array, params: SamplingParams, position: int | None = None) -> mx.array:
    """One token per row of logits, (V,) or (R, V) -> () or (R,) uint32.
    Greedy: the argmax. Seeded: Gumbel-max with the noise of absolute
    positions `position`, `position` + 1, ... (one per row; needed then).
    Else a draw from the process's random state."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.uint32)
    if params.seed is not None:
        if position is None:
            raise ValueError("a seeded request samples at a position")
        rows = 1 if logits.ndim == 1 else logits.shape[0]
        noise = gumbel_noise(params.seed, position, rows, logits.shape[-1])
        return gumbel_max(logits, params, noise.reshape(logits.shape)).astype(mx.uint32)
    return mx.random.categorical(truncated_logits(logits, params)).astype(mx.uint32)


LOGPROB_FLOOR = -9999.0  # what the APIs report for "no probability": JSON has no -inf


def logprobs_of(logits: mx.array) -> mx.array:
    """Log-softmax in float32: what the API reports as a token's logprob."""
    logits = logits.astype(mx.float32)
    return reportable(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def reportable(logprobs: mx.array) -> mx.array:
    """Logprobs an API can send: extreme penalties push logits to +-inf,
    whose log-softmax is -inf or NaN; both are reported as the floor."""
    return mx.where(mx.isnan(logprobs), LOGPROB_FLOOR, mx.maximum(logprobs, LOGPROB_FLOOR))
