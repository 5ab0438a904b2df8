"""Drafting by copying from the sequence itself (engines/drafting/ngram/index.py): no drafter, any model.

The drafts continue the longest earlier match of the sequence's tail in its
prompt and output; a round with nothing worth copying drafts nothing (a
plain step). A copied draft is a point mass, so it comes without q: the
decoder accepts d with probability p(d) and resamples from p without d on a
rejection, which keeps the target's distribution exactly (and at
temperature 0 takes the target's argmax). The index is built from the
context at the first round (a prompt served from the prefix cache, or
handed over by another engine, is indexed the same way) and extended with
each round's committed tokens. How much of a copy goes to verify is the
engine's evidence's call (engines/drafting/ngram/copy_length.py), learnt from
every round its requests served.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from specgate.engines.drafting.base import Context, Drafting, Proposal
from specgate.engines.drafting.ngram.copy_length import CopyEvidence, RoundTimer
from specgate.engines.drafting.ngram.index import Draft, NgramIndex
from specgate.engines.loading import LoadedModel
from specgate.engines.settings import DraftSettings
from specgate.engines.targets import Forward, Target


def drafting(loaded: LoadedModel, target: Target, drafter: str | None = None,
             settings: DraftSettings | None = None) -> Drafting:
    evidence = CopyEvidence()  # the engine's: every request it serves adds to it
    return Drafting("ngram", lambda t: NgramProposer(t, evidence))


class NgramProposer:
    method = "ngram"
    layers = ()

    def __init__(self, target: Target | None = None, evidence: CopyEvidence | None = None):
        """Without `evidence`, every copy goes to verify whole."""
        self.index = NgramIndex()
        self.evidence = evidence
        self._timer = RoundTimer()
        self._match: int | None = None  # this round's copy's

    def draft(self, context: Context, depth: int) -> Draft | None:
        """The copy on offer this round (its match length says how strong)."""
        self.index.extend(context.tokens[len(self.index) :])
        return self.index.draft(depth)

    def keep(self, draft: Draft | None) -> Draft | None:
        """What of `draft` the evidence says to verify (None: nothing). The
        cut never changes the text, a seeded sampled request's included (its
        tokens are its seed's at each position, whatever was drafted)."""
        if draft is None or self.evidence is None:
            return draft
        n = self.evidence.length(draft.match, len(draft.tokens))
        return Draft(draft.tokens[:n], draft.match, draft.support) if n else None

    def offer(self, draft: Draft | None) -> Proposal | None:
        """`draft` (already kept) as this round's proposal (None: a plain
        step), timed until `committed` when there is evidence to feed."""
        self._match = None if draft is None else draft.match
        if self.evidence is not None:
            self._timer.start()
        return None if draft is None else copied(draft)

    def propose(self, context: Context, depth: int) -> Proposal | None:
        return self.offer(self.keep(self.draft(context, depth)))

    def prefilled(self, start: int, forward: Forward, prompt: Sequence[int]) -> None:
        pass

    def committed(self, last: int, drafts: list[int], accepted: int, forward: Forward) -> None:
        seconds = self._timer.stop()  # None: no copy was offered this round
        if self.evidence is not None and seconds is not None:
            self.evidence.observe(self._match, len(drafts), accepted, seconds)

    def pending(self) -> list:
        return []


def copied(draft: Draft) -> Proposal:
    return Proposal(mx.array(draft.tokens, dtype=mx.int32))
