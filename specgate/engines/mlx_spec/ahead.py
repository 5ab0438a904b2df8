"""Greedy MTP rounds queued one ahead: the next round's graph is built and
sent to the device before this round's verdict is read.

Why: on a GPU a round is bound by the host's work (building the drafting
and verify graphs in Python, MLX encoding ~700 kernels); the decoder
(decoder.py) reads each round's verdict before it builds the next round, so
the device idles while the host builds and the host idles while the device
finishes. mlx-lm's generate_step hides the same gap for plain decoding by
queueing step n+1 before reading token n; this does it for speculation.

What makes it possible is keeping every quantity the next round depends on
on the device, as arrays, never as host numbers:
- the number of drafts accepted (greedy: the length of the run where each
  draft equals the target's argmax), the bonus token after them, the
  trunk's hidden states at the kept positions;
- the caches' lengths (engines/forwards/kv_buffer.DeviceOffsetKV: rows written at a
  device-side offset, attention masked past it), so a rejected draft's
  rows are simply written over by the next round; a hybrid's recurrent
  layers take the state after the accepted steps from the verify's tape by
  device-side indexing (the target adapter's `keep`);
- the MTP head's input: the pairs (token, trunk hidden before it) of the
  last round, all k+1 of them fed at once, only the first accepted+1
  standing (the head's cache keeps those; its chained, self-fed entries are
  dropped the same way).
The host then reads round n (its drafts, the count, the bonus token: one
wait) while round n+1 runs, commits its tokens (EOS, max_tokens) and queues
round n+2. A round queued past the end is dropped: nothing it wrote is kept.

Exactness: every committed token is the trunk's argmax at its position,
over the same rows and caches as decoder.py's rounds (masked positions
weigh exactly 0), so the output is plain greedy decoding's.

Where it applies (`AheadDecoder.fits`): greedy requests with no penalties,
grammar or logprobs; the MTP proposer with a one-layer head; a target
adapter that keeps its caches on the device (dense attention, Qwen3.5/3.6
and Qwen3-Next hybrids). The engine uses it on a GPU (SpecEngine.ahead).
Where every cache is a DeviceOffsetKV, the engine's rounds are compiled
(ahead_round.py). Anything else, and depth 0, runs decoder.py's rounds: `round(0)` hands the
sequence back to them, as does a handoff, with the round queued past the
last one read dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from specgate.engines.base import GenerationRequest, RoundStats
from specgate.engines.drafting.mtp.proposer import MTPProposer, _HeadInput
from specgate.engines.forwards.kv_buffer import DeviceOffsetKV
from specgate.engines.mlx_spec.ahead_round import CompiledRounds, compilable, round_graph
from specgate.engines.mlx_spec.decoder import SpecDecoder, Step
from specgate.engines.targets.base import TransformerTarget


@dataclass
class _Queued:
    """One round sent to the device, not yet read."""

    depth: int
    drafts: mx.array  # (k,)
    accepted: mx.array  # () int32
    bonus: mx.array  # (1,) the target's token after the accepted drafts
    pairs: mx.array  # (1, k + 1) the head's next tokens: accepted drafts, then the bonus
    hidden: mx.array  # (1, k + 1, H) the trunk's at the verify rows (the pairs' hidden states)
    before: tuple  # the trunk's and the head's buffers before it (to drop it)
    queued_at: float


class AheadDecoder(SpecDecoder):
    @staticmethod
    def fits(target, proposer, request: GenerationRequest, grammar) -> bool:
        p = request.sampling
        return (_keeps_on_device(target) and type(proposer) is MTPProposer
                and len(proposer.head.layers) == 1 and p.greedy and not p.has_penalties
                and not p.logprobs and grammar is None)  # fmt: skip

    def __init__(self, *args, rounds: CompiledRounds | None = None, **kwargs):
        """rounds: the engine's compiled rounds (ahead_round.py); None: every
        round's graph is built in Python."""
        super().__init__(*args, **kwargs)
        self.rounds = rounds
        self._queued: _Queued | None = None  # sent, not read
        self._read_last: _Queued | None = None  # the last one read
        self._read_at: float | None = None

    # -- the rounds ---------------------------------------------------------------------

    def round(self, depth: int) -> Step:
        if depth == 0 or self.cold or self._head_blind():
            self._drop_queued()
            return super().round(depth)
        if self._queued is None:
            self._enter()
            self._queued = self._queue(depth)
        following = self._queue(depth)  # built while the device runs the queued one
        step = self._read(self._queued, following)
        self._queued = following
        if step.finish_reason is not None:
            self._drop_queued()
        return step

    def _head_blind(self) -> bool:
        """The head has not run yet (a sequence handed over from plain
        decoding: its cache is empty, so nothing says its buffers' shape):
        decoder.py's round drafts through it first, then rounds queue ahead."""
        return self._queued is None and any(c.keys is None for c in self.proposer.cache)

    def handoff(self, plan, detokenizer):
        self._drop_queued()
        return super().handoff(plan, detokenizer)

    def to_batch(self) -> None:
        """decoder.py's state again (its caches mlx-lm's KV caches), for a
        batch's rounds; alone again, its next round queues ahead anew."""
        self._drop_queued()

    # -- entering and leaving --------------------------------------------------------------

    def _enter(self) -> None:
        """From decoder.py's state (host lengths; the head owes pairs) to
        device-side lengths and the first round's head input."""
        proposer: MTPProposer = self.proposer
        self.cache = [DeviceOffsetKV(c) if type(c) is KVCache else c for c in self.cache]
        proposer.cache = [DeviceOffsetKV(c) for c in proposer.cache]
        owed = proposer.owed
        self._pairs = mx.array([[*owed.tokens, self.tokens[-1]]], dtype=mx.int32)
        self._hidden = mx.concatenate([*owed.hidden, proposer.h_prev], axis=1)
        self._standing = mx.array(self._pairs.shape[1], dtype=mx.int32)  # pairs that stand
        self._fed = self._pairs.shape[1]  # the host's count of them, for the oldest unread round
        self._head_length = proposer.cache[0].bound  # the host's, as of the last round read
        self._last = mx.array([self.tokens[-1]], dtype=mx.int32)
        proposer.owed, proposer.h_prev = _HeadInput(), None

    def _drop_queued(self) -> None:
        """Back to decoder.py's state: the round queued past the last one
        read is dropped (the caches as they were before it, at the lengths
        the host knows) and the head owes the last read round's pairs."""
        queued, last = self._queued, self._read_last
        self._queued = self._read_last = self._read_at = None
        if queued is None:
            return
        proposer: MTPProposer = self.proposer
        trunk, head = queued.before
        self.cache = [b.restored(len(self.tokens) - 1) for b in trunk]
        proposer.cache = [b.restored(self._head_length) for b in head]
        n = self._fed  # the last round's committed tokens: its pairs that stand
        proposer.owed = _HeadInput(last.pairs[0, : n - 1].tolist(), [last.hidden[:, : n - 1]])
        proposer.h_prev = last.hidden[:, n - 1 : n]
        proposer.drafted = False

    # -- one round, on the device -------------------------------------------------------

    def _queue(self, k: int) -> _Queued:
        trunk, heads = self.cache, self.proposer.cache
        before = ([_Buffers(c) for c in trunk], [_Buffers(c) for c in heads])
        t0 = time.perf_counter()
        args = (k, self._pairs, self._hidden, self._standing, self._last, trunk, heads)
        hook_inputs = self._hook_inputs(k, None if self._queued is None else self._queued.accepted)
        r = self.rounds(*args, hook_inputs) if self.rounds is not None and compilable(trunk, heads) else None
        if r is None:  # (None from the compiled rounds: its kernels are being built)
            r = round_graph(self.target, self.proposer.head, *args, self.rounds_hook, hook_inputs)
        self._pairs, self._hidden, self._standing, self._last = r.pairs, r.hidden, r.accepted + 1, r.bonus
        mx.async_eval(r.drafts, r.accepted, r.bonus, r.pairs, [c.state for c in trunk],
                      [c.state for c in heads])  # fmt: skip
        return _Queued(k, r.drafts, r.accepted, r.bonus, r.pairs, r.hidden, before, t0)

    # A bench's oracle drafts (bench/round_phases.py): a hook on the round's
    # drafts, and its inputs for round k; the product's rounds have none.
    rounds_hook = None

    def _hook_inputs(self, k: int, in_flight: mx.array | None) -> tuple:
        """The hook's inputs for a round at depth k queued after the one
        in flight, which accepts `in_flight` drafts (None: none is)."""
        return ()

    def _read(self, queued: _Queued, following: _Queued) -> Step:
        """Round n's verdict (round n+1 already queued): commit its tokens."""
        context = len(self.tokens)
        drafts = queued.drafts.tolist()
        n = int(queued.accepted.item())
        step = self._commit([*drafts[:n], int(queued.bonus.item())], [])
        # The host's lengths move on by round n's: the head kept the pairs
        # it was fed, the trunk the rows of the committed tokens.
        self._head_length += self._fed
        self._fed = len(self.tokens) - context
        for c in self.cache:
            if isinstance(c, DeviceOffsetKV):
                c.settle(len(self.tokens) - 1, following.depth + 1)
        for c in self.proposer.cache:
            c.settle(self._head_length, 2 * following.depth)
        self._read_last = queued
        now = time.perf_counter()
        step.stats = RoundStats(
            model=self.request.model, method=self.method, drafted=queued.depth,
            accepted_per_position=[j < n for j in range(queued.depth)],
            verify_width=queued.depth + 1,
            seconds=now - (self._read_at if self._read_at is not None else queued.queued_at),
            context_tokens=context, depth=queued.depth, constrained=False,
            kernels=bool(self.target.kernels))  # fmt: skip
        self._read_at = now
        return step


class _Buffers:
    """A cache as it was before a round, to drop that round: a recurrent
    layer's arrays (MLX arrays never change). A DeviceOffsetKV keeps no
    copy: the dropped round wrote only rows past the length the host knows,
    which the restored KVCache writes over (holding the old buffers would
    also stop MLX from updating them in place: every round would copy every
    layer's whole buffer)."""

    def __init__(self, cache):
        self.cache = cache
        self.arrays = None if isinstance(cache, DeviceOffsetKV) else tuple(cache.state)

    def restored(self, length: int):
        """The cache as it was (a KV cache: mlx-lm's, of `length` rows)."""
        if isinstance(self.cache, DeviceOffsetKV):
            kv = KVCache()
            kv.keys, kv.values = self.cache.keys, self.cache.values
            kv.offset = length
            return kv
        self.cache.state = list(self.arrays)
        return self.cache


def _keeps_on_device(target) -> bool:
    """A target whose rollback this decoder can do on the device: its
    `keep` comes from the class its `cut` comes from (an adapter that cuts
    its caches its own way and has no `keep` of its own does not fit)."""

    def owner(name: str) -> type:
        return next(c for c in type(target).__mro__ if name in vars(c))

    # A quantized KV cache (kv_bits) keeps tuples of arrays, which
    # DeviceOffsetKV does not wrap: its rounds are read one at a time.
    quantized = any(type(c) is QuantizedKVCache for c in target.make_cache())
    return isinstance(target, TransformerTarget) and owner("keep") is owner("cut") and not quantized
