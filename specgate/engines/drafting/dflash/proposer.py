"""Drafting with a DFlash block drafter (engines/drafting/dflash/model.py).

Every trunk forward (prefill chunks, verify) captures the outputs of the
drafter's target layers: a prompt chunk's go into the drafter's context
cache at once (`absorb`); the rows of tokens committed by a round are owed
to it and fed with the next draft, so the drafter sees each committed token
exactly once, in order (`BlockProposer`, which DSpark shares).

The drafter always drafts its full block: it was trained on blocks of that
size, and a shorter block of masks would ask it something it never saw. A
round at depth k verifies the first k proposals. Drafts are the drafter's
argmax and come without q: point masses, each accepted with the target's
probability of it (the argmax is also the draft the target most likely
keeps).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from specgate.engines.cache.prefix_cache import DrafterState, drafter_id, snapshot
from specgate.engines.drafting.base import Context, Drafting, Proposal
from specgate.engines.drafting.dflash.model import (
    DFlashDrafter,
    check_pairing,
    forget_block,
    load_dflash,
)
from specgate.engines.forwards import kv_buffer
from specgate.engines.loading import LoadedModel
from specgate.engines.precision import follow
from specgate.engines.settings import DraftSettings
from specgate.engines.targets import Forward, Target


def drafting(loaded: LoadedModel, target: Target, drafter: str | None,
             settings: DraftSettings | None = None) -> Drafting:
    """A z-lab DFlash drafter directory, checked against the target. The
    drafter reads the target's layer features of every context token: prefix-cache entries
    keep its context cache and the features it is owed (`snapshot`)."""
    if drafter is None:
        raise ValueError("dflash needs a `drafter` directory")
    d = load_dflash(drafter)
    follow(d, loaded.upcast)  # computes in its target's type (engines/precision.py)
    check_pairing(d, target)
    # The block's first position is the last committed token.
    return Drafting("dflash", lambda t: DFlashProposer(t, d), max_drafts=d.args.block_size - 1,
                    cache_id=drafter_id("dflash", drafter), weights=d)  # fmt: skip


class BlockProposer:
    """What DFlash and DSpark share: the committed tokens' layer features the
    drafter has not seen yet, fed with its next pass, and that pass."""

    method: str

    def __init__(self, target: Target, drafter: DFlashDrafter):
        self.target, self.drafter = target, drafter
        self.layers = tuple(drafter.args.target_layer_ids)
        self.cache = drafter.make_cache()
        self.owed: list[mx.array] = []  # (1, n, F) feature rows

    def _features(self, forward: Forward) -> mx.array:
        return mx.concatenate([forward.layers[i] for i in self.layers], axis=-1)

    def prefilled(self, start: int, forward: Forward, prompt: Sequence[int]) -> None:
        # Into the context cache with the chunk: a snapshot then holds a cache,
        # not every feature row since the drafter last ran, and the first
        # round after a long prompt does not digest it all at once.
        if self.owed:
            self.drafter.absorb(mx.concatenate(self.owed, axis=1), self.cache)
            self.owed = []
        self.drafter.absorb(self._features(forward), self.cache)

    def committed(self, last: int, drafts: list[int], accepted: int, forward: Forward) -> None:
        # last and the accepted drafts are now history: the drafter's next context.
        self.owed.append(self._features(forward)[:, : accepted + 1])

    def pending(self) -> list:
        return [c.state for c in self.cache] + self.owed

    def snapshot(self) -> DrafterState:
        # Its context (fed, and owed) covers exactly what the trunk holds.
        owed = {"owed": mx.concatenate(self.owed, axis=1)} if self.owed else {}
        return DrafterState(snapshot(self.cache), owed)

    def restore(self, state: DrafterState) -> None:
        self.cache = state.caches
        self.owed = [state.arrays["owed"]] if "owed" in state.arrays else []

    def _pass(self, embed, last: int) -> mx.array:
        """The drafter over [last, mask x (L-1)] (embedded by `embed`), with
        everything owed as new context; the block's own K/V are dropped."""
        bs, owed = self.drafter.args.block_size, self.owed
        self.owed = []
        block = mx.array([[last] + [self.drafter.args.mask_token_id] * (bs - 1)])
        width = self.drafter.fc.weight.shape[1]  # the features' width (its layers' outputs)
        context = (mx.concatenate(owed, axis=1) if owed
                   else mx.zeros((1, 0, width), dtype=self.drafter.fc.weight.dtype))
        cache = self.cache
        if self.target.whole_buffer:  # the trunk's reason, engines/forwards/kv_buffer.py
            cache = kv_buffer.views(cache, context.shape[1] + bs)
        out = self.drafter(embed(block), context, cache)
        forget_block(self.cache, bs)
        return out


class DFlashProposer(BlockProposer):
    method = "dflash"

    def propose(self, context: Context, depth: int) -> Proposal | None:
        out = self._pass(self.target.embed, context.last)
        n = min(depth, self.drafter.args.block_size - 1)
        return Proposal(mx.argmax(self.target.logits(out[:, 1 : 1 + n])[0], axis=-1))
