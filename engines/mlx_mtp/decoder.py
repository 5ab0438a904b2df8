"""One sequence decoded with its model's MTP head (engines/spec_decoder.py does the rest).

The head drafts: fed the trunk's hidden state before the last committed token
and that token's embedding, it proposes d_1; for k > 1 it is fed its own
output and its own draft (as published) for d_2..d_k. After verification its
draft-fed cache entries are dropped and re-fed at the next round with the
trunk's verified hidden states (`_HeadInput`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engines.base import GenerationRequest
from engines.mlx_mtp.head import MTPHead
from engines.sampling import probabilities
from engines.spec_decoder import SpecDecoder
from engines.trunk import Trunk


@dataclass
class _HeadInput:
    """Head entries owed to its cache: (token t[i+1], trunk hidden h[i]) pairs."""

    tokens: list[int] = field(default_factory=list)
    hidden: list[mx.array] = field(default_factory=list)  # each (1, n, H)


class MTPDecoder(SpecDecoder):
    method = "mtp"
    accept_rule = "leviathan"

    def __init__(
        self,
        trunk: Trunk,
        head: MTPHead,
        request: GenerationRequest,
        cache: list | None,
        cached_tokens: int,
        tokenizer,
        prefill_step: int = 512,
        rollback_mode: str = "capture",
    ):
        super().__init__(trunk, request, cache, cached_tokens, tokenizer, prefill_step,
                         rollback_mode)  # fmt: skip
        self.head = head
        self.head_cache = [KVCache() for _ in head.layers]
        self.owed = _HeadInput()
        self.h_prev: mx.array | None = None

    def _extra_evals(self) -> list:
        return [c.state for c in self.head_cache]

    def _after_prefill_chunk(self, start: int, chunk: list[int], hidden: mx.array) -> None:
        # Head entries for these positions: (token i+1, hidden i); the last
        # prompt position's entry needs the first generated token.
        prompt = self.request.prompt_tokens
        nxt = prompt[start + 1 : start + 1 + len(chunk)]
        if len(nxt) < len(chunk):
            self.h_prev = hidden[:, -1:]
            hidden = hidden[:, : len(nxt)]
        if nxt:
            self.head(self.trunk.embed(mx.array([nxt])), hidden, self.head_cache)

    def _draft(self, last: int, depth: int) -> tuple[mx.array, list[mx.array]]:
        """Drafts d_1..d_depth as a lazy (depth,) array, and the distributions
        they were drawn from (none when greedy)."""
        tokens = [*self.owed.tokens, last]
        hidden = mx.concatenate([*self.owed.hidden, self.h_prev], axis=1)
        self.owed = _HeadInput()
        out = self.head(self.trunk.embed(mx.array([tokens])), hidden, self.head_cache)[:, -1:]
        drafts, probs, state = [], [], self.penalties
        for j in range(depth):
            logits = self._adjust(self.trunk.logits(out)[0, -1], state)
            if self.params.greedy:
                d = mx.argmax(logits, keepdims=True)
            else:
                q = probabilities(logits, self.params)
                d = mx.random.categorical(mx.log(q), key=self.keys.next())[None]
                probs.append(q)
            drafts.append(d)
            if j + 1 < depth:
                state = self._advanced(state, d)
                out = self.head(self.trunk.embed(d[None]), out, self.head_cache, step=j + 1)
        return mx.concatenate(drafts), probs

    def _after_round(self, last: int, drafts: list[int], accepted: int, depth: int,
                     hidden: mx.array) -> None:
        if depth > 0:
            for c in self.head_cache:
                c.trim(depth - 1)  # entries fed with the head's own outputs
        # Owed head entries: (d_j, trunk hidden before it) for accepted d_j,
        # or, at depth 0, (last, h_prev) which the head never saw.
        if depth == 0 and self.h_prev is not None:  # None: just resumed, no history
            self.owed.tokens.append(last)
            self.owed.hidden.append(self.h_prev)
        self.owed.tokens += drafts[:accepted]
        self.owed.hidden.append(hidden[:, :accepted])
        self.h_prev = hidden[:, accepted : accepted + 1]
