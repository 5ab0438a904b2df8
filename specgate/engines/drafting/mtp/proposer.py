"""Drafting with the model's own MTP head (engines/drafting/mtp/head.py).

Fed the trunk's hidden state before the last committed token and that
token's embedding, the head proposes d_1; for k > 1 it is fed its own
output and its own draft (as published) for d_2..d_k. After verification
its draft-fed cache entries are dropped and re-fed at the next round with
the trunk's verified hidden states (`_HeadInput`). Drafts are drawn from
the request's own distribution, so q is given when sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from specgate.engines.cache.prefix_cache import DrafterState, snapshot
from specgate.engines.drafting.base import Context, Drafting, Proposal, drafted
from specgate.engines.drafting.mtp.head import MTPHead
from specgate.engines.forwards import kv_buffer
from specgate.engines.loading import LoadedModel
from specgate.engines.sampling import advanced
from specgate.engines.settings import DraftSettings
from specgate.engines.targets import Forward, Target
from specgate.kernels import hook


def drafting(loaded: LoadedModel, target: Target, drafter: str | None = None,
             settings: DraftSettings | None = None) -> Drafting:
    """The checkpoint's own head (ValueError, saying why, where it has none
    that fits: engines/drafting/mtp/loading.py)."""
    from specgate.engines.drafting.mtp.loading import load_mtp_head

    head = load_mtp_head(loaded)
    hook.fuse_siblings(head)  # its chained drafts are one-row steps, as the trunk's decoding
    return Drafting("mtp", lambda t: MTPProposer(t, head), cache_id=CACHE_ID, weights=head,
                    kernel_module=head)


CACHE_ID = "mtp"  # the head is the checkpoint's own: the model's digest names it


@dataclass
class _HeadInput:
    """Head entries owed to its cache: (token t[i+1], trunk hidden h[i]) pairs."""

    tokens: list[int] = field(default_factory=list)
    hidden: list[mx.array] = field(default_factory=list)  # each (1, n, H)


class MTPProposer:
    method = "mtp"
    layers = ()

    def __init__(self, target: Target, head: MTPHead):
        self.target, self.head = target, head
        self.cache = [KVCache() for _ in head.layers]
        self.owed = _HeadInput()
        self.h_prev: mx.array | None = None  # trunk hidden before the last token
        self.drafted = False  # whether the head drafted this round (mtp+ngram may copy instead)

    def _cache(self, rows: int) -> list:
        """The head's caches for a forward of `rows` tokens, seen as the trunk's are."""
        return kv_buffer.views(self.cache, rows) if self.target.whole_buffer else self.cache

    def pending(self) -> list:
        return [c.state for c in self.cache]

    def snapshot(self) -> DrafterState:
        arrays = {"h_prev": self.h_prev} if self.h_prev is not None else {}
        if self.owed.tokens:
            arrays["owed_tokens"] = mx.array(self.owed.tokens, dtype=mx.int32)
            arrays["owed_hidden"] = mx.concatenate(self.owed.hidden, axis=1)
        return DrafterState(snapshot(self.cache), arrays)

    def restore(self, state: DrafterState) -> None:
        self.cache = state.caches
        self.h_prev = state.arrays.get("h_prev")
        if "owed_tokens" in state.arrays:
            self.owed = _HeadInput(state.arrays["owed_tokens"].tolist(),
                                   [state.arrays["owed_hidden"]])  # fmt: skip

    def prefilled(self, start: int, forward: Forward, prompt: Sequence[int]) -> None:
        # Head entries (token i+1, hidden i) for this chunk's positions but its
        # last, whose token lies past the chunk: that hidden state waits in
        # h_prev, so the state after a chunk depends on the tokens so far
        # alone (a prefix-cache snapshot fits any prompt sharing them). The
        # last prompt position's entry needs the first generated token.
        hidden, end = forward.hidden, start + forward.tokens.shape[1]
        owed = self.owed
        if self.h_prev is not None:  # the previous chunk's (or a restored) last position
            owed.tokens.append(prompt[start])
            owed.hidden.append(self.h_prev)
        owed.tokens += prompt[start + 1 : end]
        owed.hidden.append(hidden[:, :-1])
        self.h_prev = hidden[:, -1:]
        self.owed = _HeadInput()
        if owed.tokens:
            self.head(self.target.embed(mx.array([owed.tokens])),
                      mx.concatenate(owed.hidden, axis=1), self._cache(len(owed.tokens)))  # fmt: skip

    def propose(self, context: Context, depth: int) -> Proposal | None:
        tokens = [*self.owed.tokens, context.last]
        hidden = mx.concatenate([*self.owed.hidden, self.h_prev], axis=1)
        self.owed = _HeadInput()
        self.drafted = True
        # The pairs' forward and each draft's logits (one row of the lm_head)
        # through the verify kernels where the engine wired them (the hook
        # sends other one-row products stock).
        with self.target.verify_kernels():
            out = self.head(self.target.embed(mx.array([tokens])), hidden, self._cache(len(tokens)))
        out = out[:, -1:]
        drafts, q, state = [], [], context.penalties
        for j in range(depth):
            with self.target.verify_kernels():
                logits = self.target.logits(out)
            d, qj = context.draw(logits[0, -1], state)
            drafts.append(d)
            q += [] if qj is None else [qj]
            if j + 1 < depth:
                state = advanced(state, d)
                out = self.head(self.target.embed(d[None]), out, self.cache, step=j + 1)
        return drafted(drafts, q)

    def committed(self, last: int, drafts: list[int], accepted: int, forward: Forward) -> None:
        hidden = forward.hidden
        if self.drafted:
            for c in self.cache:
                c.trim(len(drafts) - 1)  # entries fed with the head's own outputs
        # Owed head entries: (d_j, trunk hidden before it) for accepted d_j,
        # and, in a round the head did not draft (depth 0, or drafts copied
        # from the context), (last, h_prev), which it has not seen.
        elif self.h_prev is not None:  # None: just resumed, no history
            self.owed.tokens.append(last)
            self.owed.hidden.append(self.h_prev)
        self.drafted = False
        self.owed.tokens += drafts[:accepted]
        self.owed.hidden.append(hidden[:, :accepted])
        self.h_prev = hidden[:, accepted : accepted + 1]
