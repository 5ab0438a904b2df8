"""Copied drafts where the context has them, the model's MTP head elsewhere (method "mtp+ngram").

Each round first asks the context (engines/drafting/ngram/proposer.py): a copy
that matched at least `copy_match` tokens (its settings) and, cut to what the engine's
evidence says pays (engines/drafting/ngram/copy_length.py, learnt from the
copied rounds alone), still offers more drafts than the head would draft
is taken (a point mass, no head forward this round); otherwise the head
drafts, at most `mtp_depth` tokens (it was trained for a few positions, a
copy can run much further). The head keeps
its history either way: after a copied round it is owed the committed
tokens with the trunk's hidden states, as after a plain step
(engines/drafting/mtp/proposer.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from specgate.engines.cache.prefix_cache import DrafterState
from specgate.engines.drafting.base import Context, Drafting, Proposal
from specgate.engines.drafting.mtp import proposer as mtp
from specgate.engines.drafting.mtp.head import MTPHead
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.drafting.ngram.copy_length import CopyEvidence
from specgate.engines.drafting.ngram.proposer import NgramProposer
from specgate.engines.loading import LoadedModel
from specgate.engines.settings import MTPNgramSettings
from specgate.engines.targets import Forward, Target

METHOD = "mtp+ngram"


def drafting(loaded: LoadedModel, target: Target, drafter: str | None = None,
             settings: MTPNgramSettings | None = None) -> Drafting:
    """The checkpoint's own head (ValueError, saying why, where it has none)."""
    from specgate.engines.drafting.mtp.loading import load_mtp_head

    head = load_mtp_head(loaded)
    evidence = CopyEvidence()  # the engine's
    settings = settings or MTPNgramSettings()
    return Drafting(
        METHOD,
        lambda t: MTPNgramProposer(t, head, settings.mtp_depth, evidence, settings.copy_match),
        cache_id=mtp.CACHE_ID,
        weights=head,
    )  # the head's state is the MTP engine's


class MTPNgramProposer:
    method = METHOD
    layers = ()

    def __init__(self, target: Target, head: MTPHead, mtp_depth: int,
                 evidence: CopyEvidence | None = None, copy_match: int = 4):  # fmt: skip
        self.mtp = MTPProposer(target, head)
        self.ngram = NgramProposer(evidence=evidence)
        self.mtp_depth = mtp_depth
        self.copy_match = copy_match

    def propose(self, context: Context, depth: int) -> Proposal | None:
        head_depth = min(depth, self.mtp_depth)
        draft = self.ngram.draft(context, depth)
        if draft is not None and draft.match >= self.copy_match and len(draft.tokens) > head_depth:
            kept = self.ngram.keep(draft)
            if kept is not None and len(kept.tokens) > head_depth:
                return self.ngram.offer(kept)
        return self.mtp.propose(context, head_depth)

    def prefilled(self, start: int, forward: Forward, prompt: Sequence[int]) -> None:
        self.mtp.prefilled(start, forward, prompt)

    def committed(self, last: int, drafts: list[int], accepted: int, forward: Forward) -> None:
        # Evidence only from copied rounds: the copy's timer runs only once it
        # was offered, so a head round's cost and acceptance are not a copy's.
        self.ngram.committed(last, drafts, accepted, forward)
        self.mtp.committed(last, drafts, accepted, forward)

    def pending(self) -> list:
        return self.mtp.pending()

    def snapshot(self) -> DrafterState:
        return self.mtp.snapshot()

    def restore(self, state: DrafterState) -> None:
        self.mtp.restore(state)
