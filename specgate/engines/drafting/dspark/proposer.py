"""Drafting with a DSpark block drafter (engines/drafting/dspark/model.py).

DFlash's context feeding (`BlockProposer`); the block is then drafted position
by position through the drafter's Markov head, each draft drawn from the
request's own distribution (so q is given when sampling), and cut at the
first position its confidence head doubts.
"""

from __future__ import annotations

import mlx.core as mx

from specgate.engines.cache.prefix_cache import drafter_id
from specgate.engines.drafting.base import Context, Drafting, Proposal, drafted
from specgate.engines.drafting.dflash.model import check_pairing
from specgate.engines.drafting.dflash.proposer import BlockProposer
from specgate.engines.drafting.dspark.model import DSparkDrafter, load_dspark
from specgate.engines.loading import LoadedModel
from specgate.engines.precision import follow
from specgate.engines.sampling import advanced
from specgate.engines.settings import DraftSettings
from specgate.engines.targets import Target


def drafting(loaded: LoadedModel, target: Target, drafter: str | None,
             settings: DraftSettings | None = None) -> Drafting:
    """A DeepSpec DSpark drafter directory, checked against the target."""
    if drafter is None:
        raise ValueError("dspark needs a `drafter` directory")
    d = load_dspark(drafter)
    follow(d, loaded.upcast)  # computes in its target's type (engines/precision.py)
    check_pairing(d, target, min_block=1)
    # One proposal per block position.
    return Drafting("dspark", lambda t: DSparkProposer(t, d), max_drafts=d.args.block_size,
                    cache_id=drafter_id("dspark", drafter), weights=d)  # fmt: skip


class DSparkProposer(BlockProposer):
    method = "dspark"
    drafter: DSparkDrafter

    def propose(self, context: Context, depth: int) -> Proposal | None:
        d = self.drafter
        out = self._pass(d.embed_tokens, context.last)[0]
        bs = d.args.block_size
        base = d.lm_head(out)
        drafts, q, confidence = [], [], []
        prev, state = mx.array([context.last]), context.penalties
        for j in range(min(depth, bs)):
            correction, row = d.markov(prev)
            token, qj = context.draw(base[j] + correction.reshape(-1), state)
            q += [] if qj is None else [qj]
            confidence.append(d.confidence(out[j : j + 1], row))
            drafts.append(token)
            state = advanced(state, token)
            prev = token
        n = len(drafts)
        if confidence and confidence[0] is not None:
            # The cut needs the values now: one wait before the verify.
            scores = mx.concatenate(confidence).tolist()
            n = next((j for j, c in enumerate(scores) if c < d.args.confidence_threshold), n)
        return drafted(drafts[:n], q[:n])
