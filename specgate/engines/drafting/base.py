"""What a speculative decoder asks of its drafter (engines/mlx_spec/decoder.py does the rest).

A `Proposer` is one sequence's drafter state. The decoder calls it:
- `prefilled(start, forward, prompt)` after each prompt chunk went through
  the trunk (`forward` holds the chunk's hidden states and the named layers
  the proposer reads, `layers`);
- `propose(context, depth)` at a round: up to `depth` drafts as a lazy 1-D
  array, and either the distributions q they were drawn from (one row per
  draft) or none. Sampling unseeded, either is rejection sampling
  (Leviathan et al.): against q, or, for drafts without q, against a point
  mass on each (d accepted with probability p(d): exact for any drafts).
  It may propose fewer than `depth`, or None (a plain step). Greedy
  decoding needs neither (the trunk's argmax decides), nor does a seeded
  request (the trunk's Gumbel-max token at each position decides; drafts
  drawn through `Context.draw` share its noise);
- `committed(last, drafts, accepted, forward)` after the round committed
  drafts[:accepted] and one target token; `forward` is the verify's, one
  row per input [last, *drafts];
- `pending()`: its own arrays to evaluate with each prefill chunk;
- where its `Drafting` names a `cache_id` (a drafter with state of its
  own): `snapshot()`, its state matching the trunk's cache now (a copy, for
  the prefix cache: engines/cache/prefix_cache.py), and `restore(state)`, before
  a request feeds only the rest of its prompt. The state after a prompt
  chunk must depend on that prefix alone (a drafter that reads one token
  ahead keeps it owed), so a snapshot fits any prompt that shares the prefix.
Each method's proposer module also has `drafting(loaded, target, drafter,
settings)`: the method's shared part, loaded once per engine (`Drafting`),
given the engine's own settings (engines/settings.py). A new method is one
module here and one record in engines/registry.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from specgate.engines.base import Method, SamplingParams
from specgate.engines.cache.prefix_cache import DrafterState
from specgate.engines.grammar.matcher import GrammarState, masked
from specgate.engines.grammar.thinking import ThinkingState
from specgate.engines.sampling import PenaltyState, penalised, probabilities, sample
from specgate.engines.targets import Forward, Target


@dataclass(frozen=True)
class Proposal:
    drafts: mx.array  # (n,) token ids, possibly still lazy
    q: mx.array | None = None  # (n, V): what each draft was drawn from; None: drafts alone


@dataclass
class Context:
    """The sequence as a proposer sees it at a round."""

    tokens: list[int]  # prompt + committed output; tokens[-1] is fed this round
    prompt_len: int
    params: SamplingParams
    penalties: PenaltyState | None  # after `tokens`; None without penalties
    # The request's grammar (or thinking budget), after `tokens`, or None.
    # `draw` masks by it and pushes each draft (so the next draw sees the
    # state after it); the decoder takes the pushes back after `propose`.
    grammar: GrammarState | ThinkingState | None = None
    drawn: int = 0  # drafts drawn so far this round: the next one's position is after them

    @property
    def last(self) -> int:
        return self.tokens[-1]

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def draw(self, logits: mx.array, state: PenaltyState | None) -> tuple[mx.array, mx.array | None]:
        """The next draft from the request's own distribution (penalties from
        `state`, the grammar's mask, the same truncation as the target's):
        the argmax when greedy; seeded, the Gumbel-max sample with the noise
        the target's token at that position gets (so the draft stands
        whenever the two distributions choose alike under it), no q needed;
        else a sample and the q it was drawn from. Drafts are drawn in
        order: the j-th of a round is the token at position len(tokens) + j.
        Under a grammar each draft is computed at once (its successor's mask
        depends on it)."""
        logits = penalised(logits, state, self.params)
        q = None
        if self.grammar is not None:
            logits = masked(logits, self.grammar.allowed())
        if self.params.greedy or self.params.seed is not None:
            token = sample(logits, self.params, len(self.tokens) + self.drawn)[None]
        else:
            q = probabilities(logits, self.params)
            token = mx.random.categorical(mx.log(q))[None]
        self.drawn += 1
        if self.grammar is not None:
            self.grammar.draft(int(token.item()))
        return token, q


class Proposer(Protocol):
    method: Method
    layers: tuple[int, ...]  # trunk layers each forward captures for it (-1: embeddings)

    def prefilled(self, start: int, forward: Forward, prompt: Sequence[int]) -> None: ...

    def propose(self, context: Context, depth: int) -> Proposal | None: ...

    def committed(self, last: int, drafts: list[int], accepted: int, forward: Forward) -> None: ...

    def pending(self) -> list: ...

    # With a Drafting.cache_id only:
    def snapshot(self) -> DrafterState: ...

    def restore(self, state: DrafterState) -> None: ...


@dataclass(frozen=True)
class Drafting:
    """What an engine keeps of its method: loaded once, shared by its requests."""

    method: Method
    proposer: Callable[[Target], Proposer]  # one sequence's proposer
    max_drafts: int | None = None  # the most drafts a round can propose (None: any)
    # Whose state a prefix-cache entry keeps for it (Proposer.snapshot): one
    # name per drafter (its weights), None for proposers without state.
    cache_id: str | None = None
    weights: object | None = None  # its own module (head, drafter): memory accounting
    # Its module whose multi-row forwards run inside the target's verify
    # kernels (the MTP head's forward of the last round's pairs): the engine
    # wires and proves it with the trunk (mlx_spec/kernel_proofs.py).
    kernel_module: object | None = None


def drafted(tokens: list[mx.array], q: list[mx.array]) -> Proposal | None:
    """A Proposal from per-position (1,) drafts and their q rows (if any)."""
    if not tokens:
        return None
    return Proposal(mx.concatenate(tokens), mx.stack(q) if q else None)
