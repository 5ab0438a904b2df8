"""One sequence decoded with its model's MTP head: prefill, then rounds.

A round at depth k:
1. draft   the head, fed the trunk's hidden state before the last committed
           token and that token's embedding, proposes d_1; for k > 1 it is
           fed its own output and its own draft (as published) for d_2..d_k;
2. verify  the trunk runs [last, d_1..d_k] in one forward;
3. accept  engines/speculative.py decides how many drafts stand and adds
           one target token, so each round commits accepted + 1 tokens;
4. undo    what the rejected drafts left in the caches: KV trimmed,
           GatedDeltaNet state restored from the verify tape (trunk.py), the
           head's draft-fed entries dropped and re-fed at the next round with
           the trunk's verified hidden states.
Depth 0 is a plain decoding step, so a planner can switch speculation off
for a round without leaving the engine. At temperature 0 every committed
token is the trunk's argmax at its position: the output is plain greedy
decoding's.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engines.base import GenerationRequest, RoundStats, TokenLogprob, TopLogprob
from engines.mlx_mtp.head import MTPHead
from engines.mlx_mtp.trunk import Trunk, checkpoint, restore, rollback, tape
from engines.sampling import (
    KeyStream,
    PenaltyState,
    apply_penalties,
    logprobs_of,
    probabilities,
    sample,
)
from engines.speculative import accept_greedy, accept_sampled


@dataclass
class Step:
    """What one prefill or round produced."""

    tokens: list[int]  # committed, cut at EOS (excluded) or max_tokens
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    stats: RoundStats | None = None


@dataclass
class _HeadInput:
    """Head entries owed to its cache: (token t[i+1], trunk hidden h[i]) pairs."""

    tokens: list[int] = field(default_factory=list)
    hidden: list[mx.array] = field(default_factory=list)  # each (1, n, H)


class MTPDecoder:
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
        self.trunk, self.head, self.request = trunk, head, request
        self.params = request.sampling
        self.cache = cache if cache is not None else trunk.make_cache()
        self.cached_tokens = cached_tokens
        self.head_cache = [KVCache() for _ in head.layers]
        self.tokens = list(request.prompt_tokens)  # the trunk's cache holds tokens[:-1]
        self.generated = 0
        self.keys = KeyStream(self.params.seed)
        self.penalties = (
            PenaltyState.from_prompt(request.prompt_tokens, trunk_vocab(trunk))
            if self.params.has_penalties
            else None
        )
        self.tokenizer = tokenizer
        self.prefill_step = prefill_step
        self.rollback_mode = rollback_mode  # "capture" (tape) or "replay"
        self.owed = _HeadInput()
        self.h_prev: mx.array | None = None

    # -- distributions ------------------------------------------------------------

    def _adjust(self, logits: mx.array, state: PenaltyState | None) -> mx.array:
        return logits if state is None else apply_penalties(logits, state, self.params)

    def _advanced(self, state: PenaltyState | None, tokens: list[int] | mx.array):
        return None if state is None else state.advance(tokens)

    # -- prefill --------------------------------------------------------------------

    def prefill(self) -> Step:
        """Feed the uncached prompt; commit the first generated token."""
        prompt = self.request.prompt_tokens
        start = self.cached_tokens
        hidden = None
        for s in range(start, len(prompt), self.prefill_step):
            chunk = prompt[s : s + self.prefill_step]
            hidden = self.trunk.hidden(mx.array([chunk]), self.cache)
            # Head entries for these positions: (token i+1, hidden i); the
            # last prompt position's entry needs the first generated token.
            nxt = prompt[s + 1 : s + 1 + len(chunk)]
            if len(nxt) < len(chunk):
                self.h_prev = hidden[:, -1:]
                hidden_owed = hidden[:, : len(nxt)]
            else:
                hidden_owed = hidden
            if nxt:
                self.head(self.trunk.embed(mx.array([nxt])), hidden_owed, self.head_cache)
            mx.eval(hidden, [c.state for c in self.cache], [c.state for c in self.head_cache])
        logits = self.trunk.logits(hidden[:, -1:])[0, -1]
        adjusted = self._adjust(logits, self.penalties)
        token = int(sample(adjusted, self.params, self.keys.next()).item())
        return self._commit([token], [adjusted])

    # -- rounds ---------------------------------------------------------------------

    def round(self, depth: int) -> Step:
        t0 = time.perf_counter()
        last = self.tokens[-1]
        # Drafting and verifying build one lazy graph: the only wait is for
        # the verdict, once per round.
        draft_arr, draft_probs = self._draft(last, depth) if depth > 0 else (None, [])
        verify_arr = mx.array([last])
        if draft_arr is not None:
            verify_arr = mx.concatenate([verify_arr, draft_arr.astype(verify_arr.dtype)])
        replay = self.rollback_mode == "replay"
        saved = checkpoint(self.cache) if replay else None
        with nullcontext() if replay else tape() as recorded:
            hidden = self.trunk.hidden(verify_arr[None], self.cache)
        logits = self.trunk.logits(hidden)[0]
        states = [self.penalties]
        for j in range(depth):
            states.append(self._advanced(states[-1], draft_arr[j : j + 1]))
        adjusted = [self._adjust(logits[j], states[j]) for j in range(depth + 1)]
        if self.params.greedy:
            argmax = mx.argmax(mx.stack(adjusted), axis=-1)
            mx.eval(verify_arr, argmax)
            drafts = verify_arr.tolist()[1:]
            verdict = accept_greedy(drafts, argmax.tolist())
        else:
            target = mx.stack([probabilities(a, self.params) for a in adjusted])
            q = mx.stack(draft_probs) if depth else mx.zeros((0, target.shape[-1]))
            mx.eval(verify_arr, target, q)
            drafts = verify_arr.tolist()[1:]
            verdict = accept_sampled(drafts, q, target, self.keys.next())
        n = verdict.accepted
        committed = [*drafts[:n], verdict.next_token]
        step = self._commit(committed, adjusted[: n + 1])
        # Undo: keep the inputs that are now history; the last committed
        # token is fed at the next round.
        kept = 1 + len(step.tokens) - (0 if step.finish_reason == "stop" else 1)
        kept = min(kept, n + 1)
        if replay and kept < depth + 1:
            restore(self.cache, saved)
            self.trunk.hidden(verify_arr[None, :kept], self.cache)
        else:
            rollback(self.cache, recorded, depth + 1 - kept, kept)
        if depth > 0:
            for c in self.head_cache:
                c.trim(depth - 1)  # entries fed with the head's own outputs
        # Owed head entries: (d_j, trunk hidden before it) for accepted d_j,
        # or, at depth 0, (last, h_prev) which the head never saw.
        if depth == 0:
            self.owed.tokens.append(last)
            self.owed.hidden.append(self.h_prev)
        self.owed.tokens += drafts[:n]
        self.owed.hidden.append(hidden[:, :n])
        self.h_prev = hidden[:, n : n + 1]
        step.stats = RoundStats(
            model=self.request.model,
            method="mtp",
            drafted=depth,
            accepted_per_position=[j < n for j in range(depth)],
            verify_width=depth + 1,
            seconds=time.perf_counter() - t0,
        )
        return step

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

    # -- bookkeeping ----------------------------------------------------------------

    def _commit(self, tokens: list[int], adjusted: list[mx.array]) -> Step:
        """Cut at EOS or max_tokens; record what stands."""
        eos = self.request.stop_token_ids
        out, finish = [], None
        for t in tokens:
            if t in eos:
                finish = "stop"
                self.tokens.append(t)
                break
            out.append(t)
            self.tokens.append(t)
            self.generated += 1
            if self.generated >= self.request.max_tokens:
                finish = "length"
                break
        if self.penalties is not None:
            self.penalties = self.penalties.advance(out)
        logprobs = None
        if self.params.logprobs and out:
            logprobs = [self._logprob(t, a) for t, a in zip(out, adjusted, strict=False)]
        return Step(out, finish, logprobs)

    def _logprob(self, token: int, adjusted: mx.array) -> TokenLogprob:
        lp = logprobs_of(adjusted)
        k = self.params.top_logprobs
        top: tuple[TopLogprob, ...] = ()
        if k:
            ids = mx.argsort(-lp)[:k].tolist()
            vals = lp[mx.array(ids)].tolist()
            top = tuple(
                TopLogprob(i, self.tokenizer.decode([i]), v) for i, v in zip(ids, vals, strict=True)
            )
        return TokenLogprob(token, self.tokenizer.decode([token]), lp[token].item(), top)


def trunk_vocab(trunk: Trunk) -> int:
    return trunk.inner.embed_tokens.weight.shape[0]
