"""One sequence decoded speculatively: the part every drafter shares.

A round at depth k:
1. draft   the method's drafter proposes d_1..d_k (a subclass's `_draft`);
2. verify  the trunk runs [last, d_1..d_k] in one forward (through the
           small-M kernels where the engine enabled them: kernels/wiring.py);
3. accept  engines/speculative.py decides how many drafts stand and adds one
           target token, so each round commits accepted + 1 tokens;
4. undo    what the rejected drafts left in the trunk's caches: KV trimmed,
           GatedDeltaNet state restored from the verify tape (trunk.py); the
           subclass then brings its drafter's state up to date (`_after_round`).
Depth 0 is a plain decoding step, so a planner can switch speculation off for
a round without leaving the engine. At temperature 0 every committed token is
the trunk's argmax at its position: the output is plain greedy decoding's.

Two acceptance rules, chosen by the subclass:
- "leviathan": rejection sampling against q, the distribution each draft was
  drawn from (MTP, DSpark);
- "match": the target samples every position itself and the longest prefix
  of drafts equal to its samples stands, plus its next sample (DFlash). Every
  committed token is a target sample, so it is exact for any sampler and any
  drafts, without q.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import mlx.core as mx

from engines.base import GenerationRequest, Handoff, Method, RoundStats, TokenLogprob, TopLogprob
from engines.sampling import (
    KeyStream,
    PenaltyState,
    apply_penalties,
    logprobs_of,
    probabilities,
    sample,
)
from engines.speculative import accept_greedy, accept_sampled
from engines.trunk import Trunk, checkpoint, restore, rollback, tape
from kernels import hook


@dataclass
class Step:
    """What one prefill or round produced."""

    tokens: list[int]  # committed, cut at EOS (excluded) or max_tokens
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    stats: RoundStats | None = None


class SpecDecoder:
    method: Method
    accept_rule = "leviathan"  # or "match"

    def __init__(
        self,
        trunk: Trunk,
        request: GenerationRequest,
        cache: list | None,
        cached_tokens: int,
        tokenizer,
        prefill_step: int = 512,
        rollback_mode: str = "capture",
    ):
        self.trunk, self.request = trunk, request
        self.params = request.sampling
        self.cache = cache if cache is not None else trunk.make_cache()
        self.cached_tokens = cached_tokens
        self.tokens = list(request.prompt_tokens)  # the trunk's cache holds tokens[:-1]
        self.generated = 0
        self.keys = KeyStream(self.params.seed)
        self.penalties = (
            PenaltyState.from_prompt(request.prompt_tokens, trunk.vocab_size)
            if self.params.has_penalties
            else None
        )
        self.tokenizer = tokenizer
        self.prefill_step = prefill_step
        self.rollback_mode = rollback_mode  # "capture" (tape) or "replay"
        self.cold = False  # resumed: the drafter has seen nothing yet
        self._prefill_hidden: mx.array | None = None  # the last prefill chunk's

    def resume(self, handoff: Handoff) -> Step:
        """Continue a sequence another engine decoded (the decoder was made
        with handoff.cache); commits its pending tokens. The drafter starts
        blind, so the first round is a plain step that gives it context."""
        n_pending = len(handoff.pending)
        self.tokens = handoff.tokens[: len(handoff.tokens) - n_pending]
        self.generated = handoff.generated - n_pending
        self.keys = handoff.keys
        if self.penalties is not None:
            self.penalties = self.penalties.advance(self.tokens[len(self.request.prompt_tokens) :])
        self.cold = True
        return self._commit(list(handoff.pending), [])

    def handoff(self, plan, detokenizer) -> Handoff:
        """This sequence, ready for another engine (between rounds)."""
        mx.eval([c.state for c in self.cache], self.keys.state)
        return Handoff(plan, list(self.tokens), self.generated, self.cache, detokenizer, self.keys)

    # -- what a drafter supplies -------------------------------------------------------

    def _forward(self, tokens: mx.array) -> mx.array:
        """The trunk's hidden states for `tokens` (1, T); a drafter that reads
        more of the trunk (named layers) records it here."""
        return self.trunk.hidden(tokens, self.cache)

    def _after_prefill_chunk(self, start: int, chunk: list[int], hidden: mx.array) -> None:
        """Prompt tokens [start, start + len(chunk)) went through the trunk."""

    def _draft(self, last: int, depth: int) -> tuple[mx.array, list[mx.array]]:
        """Up to `depth` drafts as a lazy 1-D array, and (leviathan rule, when
        sampling) the distributions they were drawn from."""
        raise NotImplementedError

    def _after_round(self, last: int, drafts: list[int], accepted: int, depth: int,
                     hidden: mx.array) -> None:
        """The round committed drafts[:accepted] + one target token; `hidden`
        is the verify forward's, one row per input [last, *drafts]."""

    def _extra_evals(self) -> list:
        """Drafter state to evaluate with each prefill chunk."""
        return []

    # -- distributions ------------------------------------------------------------

    def _adjust(self, logits: mx.array, state: PenaltyState | None) -> mx.array:
        return logits if state is None else apply_penalties(logits, state, self.params)

    def _advanced(self, state: PenaltyState | None, tokens: list[int] | mx.array):
        return None if state is None else state.advance(tokens)

    # -- prefill --------------------------------------------------------------------

    def prefill(self) -> Step:
        """Feed the uncached prompt; commit the first generated token."""
        for _ in self.prefill_chunks():
            pass
        return self.first_token()

    def prefill_chunks(self) -> Iterator[int]:
        """Feed the uncached prompt one chunk at a time, yielding how many
        prompt tokens the cache holds after each: an engine takes its lock
        per chunk and may stop between chunks (a cancelled request). Then
        `first_token`."""
        prompt = self.request.prompt_tokens
        for s in range(self.cached_tokens, len(prompt), self.prefill_step):
            chunk = prompt[s : s + self.prefill_step]
            hidden = self._forward(mx.array([chunk]))
            self._after_prefill_chunk(s, chunk, hidden)
            mx.eval(hidden, [c.state for c in self.cache], self._extra_evals())
            self._prefill_hidden = hidden
            yield s + len(chunk)

    def first_token(self) -> Step:
        """After the prompt is in the cache: sample and commit the first token."""
        logits = self.trunk.logits(self._prefill_hidden[:, -1:])[0, -1]
        self._prefill_hidden = None
        adjusted = self._adjust(logits, self.penalties)
        token = int(sample(adjusted, self.params, self.keys.next()).item())
        return self._commit([token], [adjusted])

    # -- rounds ---------------------------------------------------------------------

    def round(self, depth: int) -> Step:
        t0, context = time.perf_counter(), len(self.tokens)
        last = self.tokens[-1]
        if self.cold:
            depth, self.cold = 0, False
        # Drafting and verifying build one lazy graph: the only wait is for
        # the verdict, once per round (the drafts start computing early).
        draft_arr, draft_probs = self._draft(last, depth) if depth > 0 else (None, [])
        depth = 0 if draft_arr is None else draft_arr.shape[0]
        if depth:  # the device drafts while this thread builds the verify graph
            mx.async_eval(draft_arr, draft_probs)
        verify_arr = mx.array([last])
        if depth:
            verify_arr = mx.concatenate([verify_arr, draft_arr.astype(verify_arr.dtype)])
        replay = self.rollback_mode == "replay"
        saved = checkpoint(self.cache) if replay else None
        # The verify forward (and its logits): the only place the small-M
        # kernels run, where the engine enabled them (kernels/wiring.py).
        with hook.kernels(self.trunk.kernels):
            with nullcontext() if replay else tape() as recorded:
                hidden = self._forward(verify_arr[None])
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
        elif self.accept_rule == "match":
            keys = self.keys.next()
            keys = mx.random.split(keys, depth + 1) if keys is not None else [None] * (depth + 1)
            own = mx.stack([sample(a, self.params, k).reshape(()) for a, k in zip(adjusted, keys, strict=True)])
            mx.eval(verify_arr, own)
            drafts = verify_arr.tolist()[1:]
            verdict = accept_greedy(drafts, own.tolist())  # longest prefix equal to the target's samples
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
            self._forward(verify_arr[None, :kept])
        else:
            rollback(self.cache, recorded, depth + 1 - kept, kept)
        self._after_round(last, drafts, n, depth, hidden)
        step.stats = RoundStats(
            model=self.request.model,
            method=self.method,
            drafted=depth,
            accepted_per_position=[j < n for j in range(depth)],
            verify_width=depth + 1,
            seconds=time.perf_counter() - t0,
            context_tokens=context,
        )
        return step

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
