"""One sequence decoding alone, outside mlx-lm's `BatchGenerator`.

A batch of one still pays the batch's bookkeeping every token: a left-padded
`BatchKVCache` with its mask, per-row logprob slices, list conversions. On
a GPU, where a 7B step is host-bound, that made a lone request decode at
~0.8x mlx-lm's own `generate_step`. The plain engine (engine.py) therefore
takes a sequence out of the batch when it is alone and decodes it here, as
`generate_step` does: a plain `KVCache`, the next step's graph queued
(`mx.async_eval`) before the current token is read, and that read the only
host sync per token. The sequence goes back into the batch as soon as
another request arrives.

A request that finds the engine idle never enters the batch at all: its
prompt is fed here (`feed`, in chunks, into mlx-lm's own cache with its
causal mask rather than the batch's padded one), so a lone request's
prefill and first token cost what `generate_step`'s do.

The state between steps is the batch's after a step: the cache holds
`tokens`, and `pending` is the next token, already sampled (from the
target's distribution, by the request's own sampler) but neither fed nor
sent. So a sequence moves between the batch and this loop with no token
drawn twice or lost, and the same sampler and logits processors carry on.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

Processor = Callable[[mx.array, mx.array], mx.array]


def feed(model, cache: list, tokens: list[int], stream) -> None:
    """Feed one prefill chunk into `cache` and wait for it, as
    `generate_step` does (and frees MLX's buffer cache after, as it does)."""
    with mx.stream(stream):
        model(mx.array(tokens)[None], cache=cache)
        mx.eval([c.state for c in cache])
    mx.clear_cache()


class LoneSequence:
    def __init__(self, model, cache: list, tokens: list[int], pending: mx.array,
                 pending_logprobs: mx.array, sampler: Callable[[mx.array], mx.array],
                 processors: list[Processor], context, stream):  # fmt: skip
        """cache: the sequence's own (mlx-lm's KVCache and kin), holding
        `tokens`; pending: the sampled next token, shape (1,), and its
        logprobs (vocab,); context: mlx-lm's TokenBuffer of the tokens the
        processors have seen (None without processors); stream: the MLX
        stream to queue on (the batch's)."""
        self.model, self.cache, self.tokens = model, cache, tokens
        self.pending, self.pending_logprobs = pending, pending_logprobs
        self.sampler, self.processors, self.context = sampler, processors, context
        self.stream = stream

    def step(self) -> tuple[int, mx.array]:
        """Feed the pending token and queue the sampling of the next one;
        return the fed token (waiting for it, the step's one sync) and its
        logprobs (lazy: evaluated only if read)."""
        y, logprobs = self.pending, self.pending_logprobs
        with mx.stream(self.stream):
            logits = self.model(y[None], cache=self.cache)[:, -1, :]
            if self.processors:
                seen = self.context.update_and_fetch(y)
                for processor in self.processors:
                    logits = processor(seen, logits)
            following = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            self.pending = self.sampler(following)
            self.pending_logprobs = following[0]
        mx.async_eval(self.pending, self.pending_logprobs)
        token = y.item()
        self.tokens.append(token)
        return token, logprobs

    @classmethod
    def after_prompt(cls, model, cache: list, tokens: list[int], last: int, sampler,
                     processors: list[Processor], context, stream) -> LoneSequence:  # fmt: skip
        """The state once a prompt is fed but its `last` token: that token
        fed and the first one's sampling queued (not waited for)."""
        lone = cls(model, cache, tokens, mx.array([last]), None, sampler, processors, context, stream)
        lone.step()  # returns `last` at once: it is an array already
        return lone

    def pending_token(self) -> int:
        return self.pending.item()
