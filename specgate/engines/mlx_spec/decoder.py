"""One sequence decoded speculatively, with any proposer (engines/drafting/).

A round at depth k:
1. draft   the proposer proposes d_1..d_k, with or without q;
2. verify  the target runs [last, d_1..d_k] in one forward (through the
           small-M kernels where the engine enabled them: kernels/wiring.py);
3. accept  engines/mlx_spec/acceptance.py decides how many drafts stand and adds one
           target token, so each round commits accepted + 1 tokens;
4. undo    the target cuts its caches back to what stands (KV trimmed,
           recurrent state restored: engines/targets/), and the proposer
           brings its own state up to date.
Depth 0 is a plain decoding step, so a planner can switch speculation off for
a round without leaving the engine. At temperature 0 every committed token is
the trunk's argmax at its position: the output is plain greedy decoding's.

A seeded sampled request takes, at every verify position t, the target's
Gumbel-max token there (argmax(log p + g(seed, t)), engines/sampling.py)
and accepts drafts while they equal it: its output is plain sampling's with
the same seed, whatever was drafted, so the same on every engine. The
proposers draw their own drafts with the same noise (drafting/base.Context.draw).
Unseeded, every proposal is checked by rejection sampling
(engines/mlx_spec/acceptance.py) against the distributions q its drafts were drawn
from: the proposer's own (MTP, DSpark), or, for drafts that come alone
(DFlash's argmax, text copied from the context), a point mass on each draft:
d is accepted with probability p(d), and a rejection resamples from p
without d. Both are exact for any drafts, however they were chosen.

Under a grammar (engines/grammar/matcher.py) every position's logits are masked by
the state the grammar reaches after the tokens before it: the drafter's q
as it draws (drafting/base.Context.draw), the verify's p at each position
from the committed tokens and the drafts before it. Drafts that come alone
are cut at the first one the grammar refuses (a draft with p(d) = 0 would
only be rejected). So p and q are masked alike and the output is the
constrained target's, greedy or sampled. A thinking budget
(engines/grammar/thinking.py) is held the same way, so a token it forces is
forced at every position, drafted or verified; where no mask can apply
within a round (thinking far from its budget, no grammar) the round runs
as an unconstrained one, without waiting for its drafts' values.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from specgate.engines.base import (
    EngineError,
    GenerationRequest,
    Handoff,
    RoundStats,
    TokenLogprob,
    TopLogprob,
)
from specgate.engines.drafting.base import Context, Proposal, Proposer
from specgate.engines.grammar.matcher import GrammarState, masked
from specgate.engines.grammar.thinking import ThinkingState
from specgate.engines.mlx_spec.acceptance import accept_greedy, accept_sampled, point_masses
from specgate.engines.sampling import (
    PenaltyState,
    advanced,
    logprobs_of,
    penalised,
    probabilities,
    sample,
)
from specgate.engines.targets import Forward, Target, Undo


@dataclass(frozen=True)
class PlannedRound:
    """A round between `begin_round` and `end_round`."""

    t0: float
    context: int  # tokens before it
    asked: int  # the depth planned
    depth: int  # drafts proposed (and kept by a grammar)
    proposal: Proposal | None
    grammar: GrammarState | ThinkingState | None  # masking this round
    rows: mx.array  # (depth + 1,) [last, d_1..d_k]: what the verify feeds


@dataclass
class Step:
    """What one prefill or round produced."""

    tokens: list[int]  # committed, cut at EOS (excluded) or max_tokens
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    stats: RoundStats | None = None


class SpecDecoder:
    def __init__(
        self,
        target: Target,
        proposer: Proposer,
        request: GenerationRequest,
        cache: list | None,
        cached_tokens: int,
        tokenizer,
        prefill_step: int = 512,
        undo: Undo = "tape",
        grammar: GrammarState | ThinkingState | None = None,
        vision=None,
    ):
        self.target, self.proposer, self.request = target, proposer, request
        self.method = proposer.method
        self.params = request.sampling
        self.cache = cache if cache is not None else target.make_cache()
        self.cached_tokens = cached_tokens
        self.tokens = list(request.prompt_tokens)  # the trunk's cache holds tokens[:-1]
        self.generated = 0
        self.penalties = (
            PenaltyState.from_prompt(request.prompt_tokens, target.vocab_size)
            if self.params.has_penalties
            else None
        )
        self.tokenizer = tokenizer
        self.grammar = grammar  # after self.tokens[prompt_len:]
        self.prefill_step = prefill_step
        self.undo = undo
        self.cold = False  # resumed: the drafter has seen nothing yet
        self._prefill_hidden: mx.array | None = None  # the last prefill chunk's
        self.vision = vision  # the model's image side (engines/vision/), where it has one

    def resume(self, handoff: Handoff) -> Step:
        """Continue a sequence another engine decoded (the decoder was made
        with handoff.cache); commits its pending tokens. The drafter starts
        blind, so the first round is a plain step that gives it context."""
        n_pending = len(handoff.pending)
        self.tokens = handoff.tokens[: len(handoff.tokens) - n_pending]
        self.generated = handoff.generated - n_pending
        generated = self.tokens[len(self.request.prompt_tokens) :]
        if self.penalties is not None:
            self.penalties = self.penalties.advance(generated)
        if self.grammar is not None:
            self.grammar.advance(generated)
        self.cold = True
        return self._commit(list(handoff.pending), [])

    def to_batch(self) -> None:
        """Ready for a batch (batch_decoder.py) to take this sequence between
        rounds: nothing to settle here (ahead.py's decoder has a round queued)."""

    def handoff(self, plan, detokenizer) -> Handoff:
        """This sequence, ready for another engine (between rounds)."""
        mx.eval([c.state for c in self.cache])
        return Handoff(plan, list(self.tokens), self.generated, self.cache, detokenizer)

    # -- the target ------------------------------------------------------------------

    def _forward(self, tokens: mx.array, undo: Undo | None = None) -> Forward:
        """The target over `tokens` (1, T), capturing the layers the proposer reads."""
        return self.target.forward(tokens, self.cache, layers=self.proposer.layers, undo=undo)

    # -- prefill --------------------------------------------------------------------

    def prefill(self) -> Step:
        """Feed the uncached prompt; commit the first generated token."""
        for _ in self.prefill_chunks():
            pass
        return self.first_token()

    def prefill_chunks(self, cuts: list[int] = ()) -> Iterator[int]:
        """Feed the uncached prompt one chunk at a time, yielding how many
        prompt tokens the cache holds after each: an engine takes its lock
        per chunk and may stop between chunks (a cancelled request). A chunk
        ends at each of `cuts` (where the engine keeps a snapshot). Then
        `first_token`."""
        prompt = self.request.prompt_tokens
        ends = {*cuts, *range(self.cached_tokens + self.prefill_step, len(prompt),
                              self.prefill_step), len(prompt)}  # fmt: skip
        # From its first uncached image to its last, the prompt is one chunk
        # (engines/vision/).
        images = self.request.images_end
        if images > self.cached_tokens:
            lo = min(i.start for i in self.request.images if i.end > self.cached_tokens)
            ends = {e for e in ends if e <= lo or e > images} | {lo, images}
        s = self.cached_tokens
        for e in (e for e in sorted(ends) if e > self.cached_tokens):
            chunk = prompt[s:e]
            if e == images and s < images:
                forward = self._image_forward(s, e)
            else:
                forward = self._forward(mx.array([chunk]))
            self.proposer.prefilled(s, forward, prompt)
            mx.eval(forward.hidden, [c.state for c in self.cache], self.proposer.pending())
            self._prefill_hidden = forward.hidden
            s = e
            yield e

    def _image_forward(self, start: int, end: int) -> Forward:
        if self.vision is None:
            raise EngineError("this model takes no images")
        layers = self.proposer.layers
        return self.vision.prefill(
            lambda tokens, emb: self.target.forward(tokens, self.cache, layers=layers, embeddings=emb),
            self.cache, self.target.embed, self.request.prompt_tokens, start, end, self.request.images)

    def first_token(self) -> Step:
        """After the prompt is in the cache: sample and commit the first token."""
        logits = self.target.logits(self._prefill_hidden[:, -1:])[0, -1]
        self._prefill_hidden = None
        adjusted = penalised(logits, self.penalties, self.params)
        if self.grammar is not None:
            adjusted = masked(adjusted, self.grammar.allowed())
        token = int(sample(adjusted, self.params, len(self.tokens)).item())
        return self._commit([token], [adjusted])

    # -- rounds ---------------------------------------------------------------------

    def round(self, depth: int) -> Step:
        planned = self.begin_round(depth)
        # The verify forward (and its logits): the only place the small-M
        # kernels run, where the engine enabled them (kernels/wiring.py).
        with self.target.verify_kernels():
            # A round without drafts keeps its one input: nothing to undo (and a
            # hybrid's recurrent layers then run mlx-lm's own path, its kernel
            # on Metal, not the stepwise one a tape needs).
            forward = self._forward(planned.rows[None], undo=self.undo if planned.depth else None)
            logits = self.target.logits(forward.hidden)[0]
        return self.end_round(planned, forward, logits,
                              lambda kept: self.target.rollback(self.cache, forward, kept))  # fmt: skip

    def begin_round(self, depth: int) -> PlannedRound:
        """A round up to its verify forward: the drafts, and the rows to
        verify ([last, d_1..d_k]). `end_round` finishes it; `round` runs
        both around this sequence's own forward, a batch
        (batch_decoder.py) around one forward for all its sequences."""
        t0, context = time.perf_counter(), len(self.tokens)
        last = self.tokens[-1]
        if self.cold:
            depth, self.cold = 0, False
        asked = depth
        # Masked this round: a thinking budget far from its end masks nothing.
        grammar = self.grammar
        if isinstance(grammar, ThinkingState) and grammar.quiet(depth + 1):
            grammar = None
        # Drafting and verifying build one lazy graph: the only wait is for
        # the verdict, once per round (the drafts start computing early).
        proposal = self.proposer.propose(self._context(grammar), depth) if depth > 0 else None
        if grammar is not None:
            grammar.undo_drafts()
            proposal = self._grammatical(proposal)
        depth = 0 if proposal is None else proposal.drafts.shape[0]
        verify_arr = mx.array([last])
        if depth:  # the device drafts while this thread builds the verify graph
            mx.async_eval(proposal.drafts, *([] if proposal.q is None else [proposal.q]))
            verify_arr = mx.concatenate([verify_arr, proposal.drafts.astype(verify_arr.dtype)])
        return PlannedRound(t0, context, asked, depth, proposal, grammar, verify_arr)

    def end_round(self, planned: PlannedRound, forward: Forward, logits: mx.array,
                  cut: Callable[[int], None]) -> Step:  # fmt: skip
        """The verdict on a planned round, given its verify forward and the
        logits of its rows (depth + 1, V); `cut(kept)` cuts the trunk's
        caches back to the first `kept` rows of the forward."""
        t0, context, asked, depth = planned.t0, planned.context, planned.asked, planned.depth
        proposal, grammar, verify_arr = planned.proposal, planned.grammar, planned.rows
        last = self.tokens[-1]
        states = [self.penalties]
        for j in range(depth):
            states.append(advanced(states[-1], verify_arr[j + 1 : j + 2]))
        adjusted = [penalised(logits[j], states[j], self.params) for j in range(depth + 1)]
        if grammar is not None:  # the masks, on the CPU while the verify runs
            mx.async_eval(adjusted)
            masks = grammar.masks_along(proposal.drafts.tolist() if depth else [])
            if not any(m is None for m in masks):
                masks = mx.array(np.asarray(masks))  # one copy for the whole window
            adjusted = [masked(a, masks[j]) for j, a in enumerate(adjusted)]
        if self.params.greedy or self.params.seed is not None:
            # The target's own token at each position: its argmax, or seeded
            # its Gumbel-max sample at that position (engines/sampling.py).
            chosen = sample(mx.stack(adjusted), self.params, context)
            mx.eval(verify_arr, chosen)
            drafts = verify_arr.tolist()[1:]
            verdict = accept_greedy(drafts, chosen.tolist())
        else:
            target = mx.stack([probabilities(a, self.params) for a in adjusted])
            if not depth:
                q = mx.zeros((0, target.shape[-1]))
            elif proposal.q is None:  # drafts alone
                q = point_masses(proposal.drafts, target.shape[-1])
            else:
                q = proposal.q
            mx.eval(verify_arr, target, q)
            drafts = verify_arr.tolist()[1:]
            verdict = accept_sampled(drafts, q, target)
        n = verdict.accepted
        committed = [*drafts[:n], verdict.next_token]
        step = self._commit(committed, adjusted[: n + 1])
        # Undo: keep the inputs that are now history; the last committed
        # token is fed at the next round.
        kept = min(1 + len(step.tokens) - (0 if step.finish_reason == "stop" else 1), n + 1)
        cut(kept)
        # The proposer sees what the trunk kept (fewer than accepted where
        # max_tokens or EOS cut the round).
        self.proposer.committed(last, drafts, kept - 1, forward)
        step.stats = RoundStats(
            model=self.request.model,
            method=self.method,
            drafted=depth,
            accepted_per_position=[j < n for j in range(depth)],
            verify_width=depth + 1,
            seconds=time.perf_counter() - t0,
            context_tokens=context,
            depth=asked,
            constrained=self.grammar is not None and self.grammar.constraint is not None,
            kernels=bool(depth and self.target.kernels),
        )
        return step

    def _context(self, grammar: GrammarState | ThinkingState | None) -> Context:
        return Context(self.tokens, len(self.request.prompt_tokens), self.params, self.penalties,
                       grammar)  # fmt: skip

    def _grammatical(self, proposal: Proposal | None) -> Proposal | None:
        """The proposal cut before its first draft the grammar refuses (drawn
        under the mask, a proposer's own drafts all stand; copied or argmax
        drafts may not). One wait: the drafts are needed as values."""
        if proposal is None:
            return None
        drafts = proposal.drafts.tolist()
        n = self.grammar.valid_prefix(drafts)
        if n == len(drafts):
            return proposal
        if n == 0:
            return None
        return Proposal(proposal.drafts[:n], None if proposal.q is None else proposal.q[:n])

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
        if self.grammar is not None:
            self.grammar.advance(self.tokens[len(self.tokens) - len(out) - (finish == "stop") :])
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
