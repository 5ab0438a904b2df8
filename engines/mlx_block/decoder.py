"""One sequence decoded with a DFlash or DSpark block drafter (engines/spec_decoder.py
does the rest).

Every trunk forward (prefill chunks, verify) records the outputs of the
drafter's target layers; the rows of committed tokens are owed to the
drafter's context cache and fed with the next draft, so the drafter sees
each committed token exactly once, in order.

The drafter always drafts its full block: it was trained on blocks of that
size, and a shorter block of masks would ask it something it never saw. A
round at depth k (the planner's cap) verifies the first k proposals.
Drafts are the drafter's argmax; acceptance is the "match" rule, exact for
every sampler (the argmax is also the draft most likely to match a sample).

DSpark drafts its block position by position through its Markov head, from
the distribution q it then hands to Leviathan-Chen acceptance, and stops at
the first position its confidence head doubts.
"""

from __future__ import annotations

import mlx.core as mx

from engines.base import GenerationRequest
from engines.mlx_block.dflash import DFlashDrafter, forget_block
from engines.mlx_block.dspark import DSparkDrafter
from engines.sampling import probabilities
from engines.spec_decoder import SpecDecoder
from engines.trunk import Trunk, capture


class DFlashDecoder(SpecDecoder):
    method = "dflash"
    accept_rule = "match"

    def __init__(
        self,
        trunk: Trunk,
        drafter: DFlashDrafter,
        request: GenerationRequest,
        cache: list | None,
        cached_tokens: int,
        tokenizer,
        prefill_step: int = 512,
        rollback_mode: str = "capture",
    ):
        super().__init__(trunk, request, cache, cached_tokens, tokenizer, prefill_step,
                         rollback_mode)  # fmt: skip
        self.drafter = drafter
        self.layer_ids = drafter.args.target_layer_ids
        self.draft_cache = drafter.make_cache()
        self.owed: list[mx.array] = []  # (1, n, F) feature rows the drafter has not seen
        self._features: mx.array | None = None  # of the last trunk forward

    def _forward(self, tokens: mx.array) -> mx.array:
        with capture([i for i in self.layer_ids if i >= 0]) as got:
            hidden = self.trunk.hidden(tokens, self.cache)
        # Layer -1 (DSpark) is the embedding output.
        parts = [self.trunk.embed(tokens) if i < 0 else got.outputs[i] for i in self.layer_ids]
        self._features = mx.concatenate(parts, axis=-1)
        return hidden

    def _after_prefill_chunk(self, start: int, chunk: list[int], hidden: mx.array) -> None:
        self.owed.append(self._features)

    def _extra_evals(self) -> list:
        return self.owed

    def _draft(self, last: int, depth: int) -> tuple[mx.array, list[mx.array]]:
        bs = self.drafter.args.block_size
        block = mx.array([[last] + [self.drafter.args.mask_token_id] * (bs - 1)])
        features = mx.concatenate(self.owed, axis=1)
        self.owed = []
        out = self.drafter(self.trunk.embed(block), features, self.draft_cache)
        forget_block(self.draft_cache, bs)
        n = min(depth, bs - 1)
        return mx.argmax(self.trunk.logits(out[:, 1 : 1 + n])[0], axis=-1), []

    def _after_round(self, last: int, drafts: list[int], accepted: int, depth: int,
                     hidden: mx.array) -> None:
        # last and the accepted drafts are now history: the drafter's next context.
        self.owed.append(self._features[:, : accepted + 1])


class DSparkDecoder(DFlashDecoder):
    method = "dspark"
    accept_rule = "leviathan"
    drafter: DSparkDrafter

    def _draft(self, last: int, depth: int) -> tuple[mx.array | None, list[mx.array]]:
        d = self.drafter
        bs = d.args.block_size
        block = mx.array([[last] + [d.args.mask_token_id] * (bs - 1)])
        features = mx.concatenate(self.owed, axis=1)
        self.owed = []
        out = d(d.embed_tokens(block), features, self.draft_cache)[0]
        forget_block(self.draft_cache, bs)
        base = d.lm_head(out)
        drafts, probs, confidence = [], [], []
        prev, state = mx.array([last]), self.penalties
        for j in range(min(depth, bs)):
            correction, row = d.markov(prev)
            logits = self._adjust(base[j] + correction.reshape(-1), state)
            if self.params.greedy:
                token = mx.argmax(logits, keepdims=True)
            else:
                q = probabilities(logits, self.params)
                token = mx.random.categorical(mx.log(q), key=self.keys.next())[None]
                probs.append(q)
            confidence.append(d.confidence(out[j : j + 1], row))
            drafts.append(token)
            state = self._advanced(state, token)
            prev = token
        n = len(drafts)
        if confidence and confidence[0] is not None:
            # The cut needs the values now: one wait before the verify.
            scores = mx.concatenate(confidence).tolist()
            n = next((j for j, c in enumerate(scores) if c < d.args.confidence_threshold), n)
        if n == 0:
            return None, []
        return mx.concatenate(drafts[:n]), probs[:n]
