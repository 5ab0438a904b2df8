"""A request's thinking held to its budget, token by token, with the answer's grammar after it.

A reasoning model writes its thinking between two markers (`<think>` and
`</think>` for Qwen3.x; engines/base.ThinkingFormat). A request may give
the thinking a budget (`SamplingParams.thinking`): once that many thinking
tokens are out and the closing marker has not come, the next token is
forced to the closing marker (its tokens in order where it is several).
Forcing is a mask, like a grammar's, so it is a constraint on the
distribution, not a cut of the text: every engine applies it at every
position it samples or verifies (the plain engine's logits processor, the
speculative decoder's drafts and verify rows), so greedy decoding under
speculation gives plain decoding's tokens under the same budget, and a
sampled token comes from the target's distribution under the same mask.
An answer grammar (structured output, a forced tool call) applies from the
token after the closing marker: a model that thinks first may think freely.

Counting follows llama.cpp's reasoning-budget sampler: `budget` tokens after
the opening marker (the prompt's, or the output's own first tokens), then
the closing marker. `ThinkingTracker` is the count alone (pure; the gateway
counts reasoning tokens with it too); `ThinkingState` is what the engines
hold in place of a `GrammarState` (matcher.py), with the same methods.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass

import numpy as np

from specgate.engines.base import SamplingParams, ThinkingBudget
from specgate.engines.grammar.matcher import Grammars, GrammarState


class Phase(enum.Enum):
    BEFORE = "before"  # the output's start: it may open its thinking here
    OPENING = "opening"  # the opening marker's first token came: the rest is forced
    THINKING = "thinking"
    ANSWER = "answer"  # after the closing marker, or an output that did not think


@dataclass
class ThinkingTracker:
    """Where an output stands in its thinking. `feed` each token in order;
    `forced()` is the token the next position must be, if any.

    An output whose prompt did not open thinking thinks only if its first
    token is the opening marker's (a marker of several tokens is then
    completed by force, so that a grammar never sees half of one); any
    other first token starts the answer."""

    spec: ThinkingBudget
    phase: Phase = Phase.BEFORE
    thinking_tokens: int = 0  # counted against the budget
    spent: int = 0  # every token before the answer, markers included (usage's reasoning tokens)
    _opened: int = 0  # opening-marker tokens so far (OPENING)
    _closed: int = 0  # closing-marker tokens matched so far

    def __post_init__(self) -> None:
        if self.spec.opened and self.phase is Phase.BEFORE:
            self.phase = Phase.THINKING

    @property
    def spending(self) -> bool:
        """The budget is spent: the closing marker is being forced."""
        budget = self.spec.budget
        return (
            self.phase is Phase.THINKING and budget is not None and self.thinking_tokens >= budget
        )

    def forced(self) -> int | None:
        if self.phase is Phase.OPENING:
            return self.spec.start[self._opened]
        if self.spending:
            return self.spec.end[self._closed]
        return None

    def answers(self, token: int) -> bool:
        """Whether `token`, fed next, is a token of the answer."""
        return self.phase is Phase.ANSWER or (
            self.phase is Phase.BEFORE and token != self.spec.start[0]
        )

    def feed(self, token: int) -> None:
        if self.phase is Phase.ANSWER:
            return
        if self.phase is Phase.BEFORE:
            if token != self.spec.start[0]:
                self.phase = Phase.ANSWER
                return
            self.spent, self._opened = 1, 1
            self.phase = Phase.THINKING if len(self.spec.start) == 1 else Phase.OPENING
            return
        self.spent += 1
        if self.phase is Phase.OPENING:
            self._opened += 1
            if self._opened == len(self.spec.start):
                self.phase = Phase.THINKING
            return
        end = self.spec.end
        if not self.spending:
            self.thinking_tokens += 1
        # The closing marker's tokens matched so far (markers do not overlap
        # themselves, so a mismatch restarts at this token).
        if token == end[self._closed]:
            self._closed += 1
        else:
            self._closed = 1 if token == end[0] else 0
        if self._closed == len(end):
            self.phase = Phase.ANSWER

    def free_for(self, n: int) -> bool:
        """No token can be forced in the next `n` positions, whatever they are."""
        budget = self.spec.budget
        if self.phase is Phase.ANSWER:
            return True
        if self.phase is Phase.OPENING or self.spending:
            return False
        if self.phase is Phase.BEFORE:
            return len(self.spec.start) == 1 and (budget is None or budget >= n)
        return budget is None or budget - self.thinking_tokens >= n


def spent_on_thinking(spec: ThinkingBudget, tokens: list[int]) -> int:
    """How many of an output's tokens went to thinking, markers included."""
    tracker = ThinkingTracker(spec)
    for t in tokens:
        tracker.feed(t)
        if tracker.phase is Phase.ANSWER:
            break
    return tracker.spent


class ThinkingState:
    """A sequence's thinking budget and, after its thinking, its answer
    grammar (or none): what the engines hold in place of a GrammarState,
    with its methods (matcher.py says what each is for). `allowed()` is None
    where nothing is masked: thinking within its budget, an answer without
    a grammar."""

    def __init__(self, spec: ThinkingBudget, grammar: GrammarState | None, vocab_size: int):
        self.tracker = ThinkingTracker(spec)
        self.grammar = grammar
        self.constraint = grammar.constraint if grammar is not None else None
        self.vocab_size = vocab_size
        self._before_drafts: ThinkingTracker | None = None

    def quiet(self, n: int) -> bool:
        """Nothing can be masked in the next `n` positions: a decoder need
        not wait for its drafts' values to mask them."""
        return self.grammar is None and self.tracker.free_for(n)

    def allowed(self) -> np.ndarray | None:
        forced = self.tracker.forced()
        if forced is not None:
            mask = np.zeros(self.vocab_size, dtype=bool)
            mask[forced] = True
            return mask
        if self.grammar is None or self.tracker.phase is Phase.THINKING:
            return None
        mask = self.grammar.allowed()
        if self.tracker.phase is Phase.BEFORE:  # the answer's first token, or the opening marker
            mask = mask.copy()
            mask[self.tracker.spec.start[0]] = True
        return mask

    def advance(self, tokens: list[int]) -> None:
        for t in tokens:
            if self.tracker.answers(t) and self.grammar is not None:
                self.grammar.advance([t])
            self.tracker.feed(t)

    def valid_prefix(self, tokens: list[int]) -> int:
        tracker = copy.copy(self.tracker)
        for i, t in enumerate(tokens):
            if tracker.answers(t):
                return i + (len(tokens) - i if self.grammar is None
                            else self.grammar.valid_prefix(tokens[i:]))  # fmt: skip
            forced = tracker.forced()
            if forced is not None and t != forced:
                return i
            tracker.feed(t)
        return len(tokens)

    def masks_along(self, drafts: list[int]) -> list[np.ndarray | None]:
        """The mask here and after each draft (None: nothing masked there);
        the state is left where it was."""
        saved, consumed = copy.copy(self.tracker), 0
        rows = [self.allowed()]
        for d in drafts:
            if self.tracker.answers(d) and self.grammar is not None:
                if self.grammar.is_eos(d):  # the rows after an EOS are never used
                    rows += [rows[-1]] * (len(drafts) + 1 - len(rows))
                    break
                self.grammar.consume(d)
                consumed += 1
            self.tracker.feed(d)
            rows.append(self.allowed())
        self.tracker = saved
        if self.grammar is not None:
            self.grammar.rollback(consumed)
        return rows

    def draft(self, token: int) -> None:
        if self._before_drafts is None:
            self._before_drafts = copy.copy(self.tracker)
        if self.tracker.answers(token) and self.grammar is not None:
            self.grammar.draft(token)
        self.tracker.feed(token)

    def undo_drafts(self) -> None:
        if self._before_drafts is not None:
            self.tracker, self._before_drafts = self._before_drafts, None
        if self.grammar is not None:
            self.grammar.undo_drafts()


def decoding_state(
    grammars: Grammars, sampling: SamplingParams
) -> GrammarState | ThinkingState | None:
    """What a sequence is masked by: its grammar, its thinking budget with
    the grammar after it, or nothing."""
    grammar = grammars.state(sampling.constraint)
    if sampling.thinking is None:
        return grammar
    return ThinkingState(sampling.thinking, grammar, grammars.vocab_size)
