"""Drafting by copying from the sequence itself (engines/ngram_index.py): no drafter, any model.

The drafts continue the longest earlier match of the sequence's tail in its
prompt and output; a round with nothing worth copying drafts nothing (a
plain step). A copied draft is a point mass, so it comes without q: the
decoder accepts d with probability p(d) and resamples from p without d on a
rejection, which keeps the target's distribution exactly (and at
temperature 0 takes the target's argmax). The index is built from the
context at the first round (a prompt served from the prefix cache, or
handed over by another engine, is indexed the same way) and extended with
each round's committed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from engines.loading import LoadedModel
from engines.ngram_index import Draft, NgramIndex
from engines.proposers.base import Context, Drafting, Proposal
from engines.targets import Forward, Target


def drafting(loaded: LoadedModel, target: Target, drafter: str | None = None) -> Drafting:
    return Drafting("ngram", NgramProposer)


class NgramProposer:
    method = "ngram"
    layers = ()

    def __init__(self, target: Target | None = None):
        self.index = NgramIndex()

    def draft(self, context: Context, depth: int) -> Draft | None:
        """The copy on offer this round (its match length says how strong)."""
        self.index.extend(context.tokens[len(self.index) :])
        return self.index.draft(depth)

    def propose(self, context: Context, depth: int) -> Proposal | None:
        draft = self.draft(context, depth)
        return None if draft is None else copied(draft)

    def prefilled(self, start: int, forward: Forward, prompt: Sequence[int]) -> None:
        pass

    def committed(self, last: int, drafts: list[int], accepted: int, forward: Forward) -> None:
        pass

    def pending(self) -> list:
        return []


def copied(draft: Draft) -> Proposal:
    return Proposal(mx.array(draft.tokens, dtype=mx.int32))
