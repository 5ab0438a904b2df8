"""Drafting with a Gemma-4 assistant (engines/drafting/assistant/gemma4.py).

The drafter keeps no state of its own beyond one hidden state: it reads the
target's K/V caches as they stand after each round's rollback (the caches
`Forward.cache` names), and starts each round from the target's hidden state
at the position that produced the last committed token. So it needs nothing
from a prefix-cache entry (the tail a request still feeds gives it that
hidden state) and is never blind after a handoff's first plain step.
Each draft is drawn from the request's own distribution, so q is given when
sampling; the query position is the last committed token's for every draft
of a round, as the assistants were trained.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from specgate.engines.drafting.assistant.gemma4 import (
    Gemma4Assistant,
    check_pairing,
    load_assistant,
)
from specgate.engines.drafting.base import Context, Drafting, Proposal, drafted
from specgate.engines.loading import LoadedModel
from specgate.engines.precision import follow
from specgate.engines.sampling import advanced
from specgate.engines.settings import DraftSettings
from specgate.engines.targets import Forward, Target


def drafting(loaded: LoadedModel, target: Target, drafter: str | None,
             settings: DraftSettings | None = None) -> Drafting:
    """A Gemma-4 assistant directory, checked against the target."""
    if drafter is None:
        raise ValueError("assistant needs a `drafter` directory (a Gemma-4 -assistant checkpoint)")
    d = load_assistant(drafter)
    follow(d, loaded.upcast)  # computes in its target's type (engines/precision.py)
    check_pairing(d, target)
    return Drafting("gemma4_assistant", lambda t: AssistantProposer(t, d), weights=d)


class AssistantProposer:
    method = "gemma4_assistant"
    layers = ()

    def __init__(self, target: Target, drafter: Gemma4Assistant):
        self.target, self.drafter = target, drafter
        self.cache: list | None = None  # the trunk's, from its last forward
        self.h_prev: mx.array | None = None  # (1, 1, H): the trunk's, before the last token

    def pending(self) -> list:
        return []

    def prefilled(self, start: int, forward: Forward, prompt: Sequence[int]) -> None:
        self.cache, self.h_prev = forward.cache, forward.hidden[:, -1:]

    def propose(self, context: Context, depth: int) -> Proposal | None:
        if self.h_prev is None or self.cache is None:
            return None
        d, target = self.drafter, self.target
        kv = target.drafter_kv(self.cache, d.sliding_window)
        position = len(context.tokens) - 1  # the last token's: the trunk holds those before it
        token, h = mx.array([[context.last]]), self.h_prev
        drafts, q, state = [], [], context.penalties
        for _ in range(depth):
            h, logits = d.step(target.embed(token), h, kv, position)
            draft, qj = context.draw(logits[0, -1], state)
            drafts.append(draft)
            q += [] if qj is None else [qj]
            state = advanced(state, draft)
            token = draft[None]
        return drafted(drafts, q)

    def committed(self, last: int, drafts: list[int], accepted: int, forward: Forward) -> None:
        self.cache, self.h_prev = forward.cache, forward.hidden[:, accepted : accepted + 1]
