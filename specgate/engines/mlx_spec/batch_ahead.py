"""A batch's greedy MTP rounds queued one ahead: ahead.py's pipelining for
batch_decoder.py.

Why: a batched round (batch_decoder.py) reads its verdict before it builds
the next round's graph, so on a GPU, where a 7B round is bound by the
host's work (the head's drafting and the verify forward, ~600 kernel
launches), the device idles while the host builds and the host idles while
the device runs. Plain continuous batching (mlx-lm's BatchGenerator)
queues step n+1 before it reads step n; a batch of speculative streams
paid the whole host time on top of the device's (an H100, 2 streams at
depth 3: 1.6x plain batching where the rows' costs allow ~2.5x).

How: every quantity the next round depends on stays on the device, one
row per stream, as ahead.py keeps them for one sequence: each stream's
accepted count and bonus token ((B,) arrays), the trunk's lengths (the
batch's `BatchOffsetKV` offsets already are device arrays; a hybrid's
recurrent layers keep each row's state from the verify's tape,
`keep_rows`), and the MTP head's next input, the pairs (token, trunk
hidden before it) of the last round, padded to one width, with how many
of each row's stand. The head's cache is batched the same way (a
`BatchOffsetKV` of every stream's). The host reads round n (one wait for
all streams) while round n+1 runs, commits each stream's tokens and
queues round n+2.

Where: every stream in the batch is an AheadDecoder (the engine made it
one: greedy, no penalties, grammar or logprobs, the MTP head of one
layer) and some stream asks a depth > 0. Streams may ask different
depths: the round drafts k, the deepest asked, for every row, and a row
asked for fewer accepts none past its own depth (its extra rows are
verified, as a batch's pad rows are, and never kept), so the planner's
per-stream choice, a plain step included, never stops the pipeline.
Anything else, a stream joining or leaving (ending, cancelled, handed off)
drops the round queued past the last one read and hands the batch back to its ordinary rounds:
the trunk's lengths as the host knows them, each stream's head cache and
owed pairs back in its proposer (`drop`), as ahead.py's `_drop_queued`
does for one sequence.

Exactness: each stream's tokens are the trunk's argmax at each position
over the same rows as batch_decoder.py's rounds (hidden columns weigh
exactly 0), so each is its plain greedy decoding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from specgate.engines.base import RoundStats
from specgate.engines.drafting.mtp.proposer import _HeadInput
from specgate.engines.forwards.batch_kv import BatchOffsetKV
from specgate.engines.mlx_spec.ahead import AheadDecoder
from specgate.engines.mlx_spec.ahead_round import (
    BuiltFirst,
    DraftsHook,
    buffers_of,
    make_room,
    took_back,
)
from specgate.engines.mlx_spec.decoder import Step
from specgate.kernels import hook as kernel_hook
from specgate.kernels import tiles


@dataclass
class BatchRound:
    """One batched round's outputs, on the device."""

    drafts: mx.array  # (B, k)
    accepted: mx.array  # (B,) drafts that stand
    bonus: mx.array  # (B,) the target's token after them
    pairs: mx.array  # (B, k + 1) the head's next input tokens
    hidden: mx.array  # (B, k + 1, H) the trunk's at the verify rows


def batch_round_graph(target, head, k: int, limit: mx.array, pairs: mx.array, hidden: mx.array,
                      standing: mx.array, last: mx.array, trunk: list, head_cache: list,
                      kernels: Callable[[], AbstractContextManager], hook: DraftsHook | None = None,
                      hook_inputs: list[tuple] = ()) -> BatchRound:  # fmt: skip
    """ahead_round.round_graph for B sequences: the head fed every row's
    pairs at once (row b's first standing[b] stand), its k chained drafts,
    the verify forward over [last_b, d_b1..d_bk] and each row's greedy
    verdict, at most limit[b] drafts standing; the caches keep what stands. `kernels()`: the verify kernels'
    context for this round's rows. `hook(drafts_b, *hook_inputs[b])`
    replaces row b's drafts on the device (a bench's oracle; the product
    has none)."""
    recurrent = any(type(c) is ArraysCache for c in trunk)
    with kernels():
        out = head(target.embed(pairs), hidden, head_cache)  # (B, P, H)
        head_cache[0].keep(standing)
        stays = head_cache[0].offset
        o = mx.take_along_axis(out, (standing - 1)[:, None, None], axis=1)  # (B, 1, H)
        drafts = []
        for j in range(k):
            d = mx.argmax(target.logits(o)[:, -1], axis=-1).astype(mx.int32)  # (B,)
            drafts.append(d)
            if j + 1 < k:
                o = head(target.embed(d[:, None]), o, head_cache, step=j + 1)
        head_cache[0].offset = stays  # the chain's self-fed rows are dropped
        drafts = mx.stack(drafts, axis=1)  # (B, k)
        if hook is not None:
            drafts = mx.stack([hook(drafts[b], *inputs) for b, inputs in enumerate(hook_inputs)])
        rows = mx.concatenate([last[:, None], drafts], axis=1)
        forward = target.forward(rows, trunk, undo="tape" if recurrent else None)
        chosen = mx.argmax(target.logits(forward.hidden), axis=-1).astype(mx.int32)  # (B, k + 1)
    asked = mx.arange(k)[None] < limit[:, None]  # (B, k): the drafts each row was planned for
    accepted = mx.cumprod(((drafts == chosen[:, :k]) & asked).astype(mx.int32), axis=1).sum(axis=1)
    bonus = mx.take_along_axis(chosen, accepted[:, None], axis=1)[:, 0]
    kept = accepted + 1
    for c in trunk:
        if isinstance(c, BatchOffsetKV):
            c.keep(kept)
    if recurrent:
        target.keep_rows(trunk, forward, kept)
    # The next round's head pairs: (d_j, the trunk's hidden before it) for
    # each accepted draft, then (bonus, the last accepted row's).
    following = mx.concatenate([drafts, bonus[:, None]], axis=1)
    pairs = mx.where(mx.arange(k + 1)[None] < accepted[:, None], following, bonus[:, None])
    return BatchRound(drafts, accepted, bonus, pairs, forward.hidden)


@dataclass
class _Queued:
    """One round sent to the device, not yet read."""

    depths: list[int]  # each row's asked (the round drafts the deepest)
    out: BatchRound
    head_rows: int  # rows it writes into the head's cache (its pairs, then its chain)
    recurrent: list  # each recurrent layer's arrays before it (to drop it)
    queued_at: float


class BatchAhead:
    """The batch's rounds while they run ahead: the device-side state, the
    round in flight, and the host's counts of what stands."""

    @staticmethod
    def fits(decoders: list, depths: list[int]) -> bool:
        """Every stream an AheadDecoder, some asking a depth > 0, each with
        a drafter that has seen its context (a resumed one starts with a
        plain step) and a head cache to batch."""
        return (max(depths) > 0
                and all(isinstance(d, AheadDecoder) and not d.cold and d.proposer.h_prev is not None
                        and d.proposer.cache[0].offset > 0 for d in decoders))  # fmt: skip

    def __init__(self, target, decoders: list, trunk: list, rounds: CompiledBatchRounds | None = None):
        """Takes the streams' head caches and owed pairs (their proposers
        hold none while it runs; `drop` gives them back). `rounds`: the
        engine's compiled rounds, for a batch whose caches are all
        BatchOffsetKVs (None: each round's graph built in Python)."""
        self.target, self.decoders, self.trunk, self.rounds = target, decoders, trunk, rounds
        proposers = [d.proposer for d in decoders]
        self.head = proposers[0].head
        self.head_cache = [BatchOffsetKV.from_caches([p.cache[0] for p in proposers])]
        self.head_length = [p.cache[0].offset for p in proposers]  # the host's, as of the last round read
        inputs = [([*p.owed.tokens, d.tokens[-1]], mx.concatenate([*p.owed.hidden, p.h_prev], axis=1))
                  for d, p in zip(decoders, proposers, strict=True)]  # fmt: skip
        width = max(len(t) for t, _ in inputs)
        # Padded to one width; a row's pad is fed but not kept (its standing count).
        self.pairs = mx.array([t + [t[-1]] * (width - len(t)) for t, _ in inputs], dtype=mx.int32)
        self.hidden = mx.concatenate([mx.pad(h, [(0, 0), (0, width - h.shape[1]), (0, 0)]) for _, h in inputs])
        self.fed = [len(t) for t, _ in inputs]  # each row's pairs that stand, in the oldest unread round
        self.standing = mx.array(self.fed, dtype=mx.int32)
        self.last = mx.array([d.tokens[-1] for d in decoders], dtype=mx.int32)
        for p in proposers:
            p.owed, p.h_prev, p.cache = _HeadInput(), None, None
        self.queued: _Queued | None = None
        self.read_last: _Queued | None = None
        self.read_at: float | None = None

    def round(self, depths: list[int], kernels: Callable[[int], bool]) -> list[Step]:
        """Round n read, round n+1 queued at `depths` (each stream's; round
        n first, when none is queued). `kernels(rows)`: whether a round of
        `rows` rows verifies through the kernels."""
        if self.queued is None:
            self.queued = self._queue(depths, kernels)
        following = self._queue(depths, kernels)  # built while the device runs the queued one
        steps = self._read(self.queued, following)
        self.queued = following
        return steps

    def _queue(self, depths: list[int], kernels: Callable[[int], bool]) -> _Queued:
        t0 = time.perf_counter()
        k = max(depths)
        recurrent = [list(c.cache) for c in self.trunk if type(c) is ArraysCache]
        width = max(self.pairs.shape[1], k + 1)  # the widest forward's rows, a stream
        head_rows = self.pairs.shape[1] + k - 1
        on = kernels(len(self.decoders) * width)
        compiled = self.rounds is not None and compilable(self.trunk, self.head_cache)
        hook, hook_inputs = self.rounds.hook if compiled else self.decoders[0].rounds_hook, []
        if hook is not None:  # a bench's oracle: each row's inputs its decoder's
            in_flight = None if self.queued is None else self.queued.out.accepted
            hook_inputs = [d._hook_inputs(k, None if in_flight is None else in_flight[b])
                           for b, d in enumerate(self.decoders)]  # fmt: skip
        limit = mx.array(depths, dtype=mx.int32)
        args = (k, limit, self.pairs, self.hidden, self.standing, self.last, self.trunk, self.head_cache)
        out = self.rounds(*args, on, hook_inputs) if compiled else None
        if out is None:  # (None from the compiled rounds: its kernels are being built)
            out = batch_round_graph(self.target, self.head, *args, partial(kernel_hook.kernels, on), hook,
                                    hook_inputs)  # fmt: skip
        self.pairs, self.hidden, self.standing, self.last = out.pairs, out.hidden, out.accepted + 1, out.bonus
        mx.async_eval(out.drafts, out.accepted, out.bonus, out.pairs, out.hidden,
                      [c.state for c in (*self.trunk, *self.head_cache)])  # fmt: skip
        return _Queued(depths, out, head_rows, recurrent, t0)

    def _read(self, queued: _Queued, following: _Queued) -> list[Step]:
        """Round n's verdicts (round n+1 queued already): each stream commits its tokens."""
        out = queued.out
        mx.eval(out.drafts, out.accepted, out.bonus)
        drafts, accepted, bonus = out.drafts.tolist(), out.accepted.tolist(), out.bonus.tolist()
        now = time.perf_counter()
        seconds = now - (self.read_at if self.read_at is not None else queued.queued_at)
        steps = []
        for b, d in enumerate(self.decoders):
            context, n = len(d.tokens), accepted[b]
            step = d._commit([*drafts[b][:n], bonus[b]], [])
            # The head kept the pairs it was fed; the trunk the committed tokens' rows.
            self.head_length[b] += self.fed[b]
            self.fed[b] = len(d.tokens) - context
            asked = queued.depths[b]
            step.stats = RoundStats(
                model=d.request.model, method=d.method, drafted=asked,
                accepted_per_position=[j < n for j in range(asked)], verify_width=asked + 1,
                seconds=seconds, context_tokens=context, depth=asked, constrained=False,
                kernels=bool(self.target.kernels) and asked > 0)  # fmt: skip
            steps.append(step)
        # The most any offset can be: what the host knows, plus the round in flight.
        for c in self.trunk:
            if isinstance(c, BatchOffsetKV):
                c.bound = max(len(d.tokens) - 1 for d in self.decoders) + max(following.depths) + 1
        self.head_cache[0].bound = max(self.head_length) + following.head_rows
        self.read_last, self.read_at = queued, now
        return steps

    def drop(self) -> None:
        """Back to batch_decoder.py's state: the round queued past the last
        one read is dropped (the trunk at the lengths the host knows, a
        recurrent layer's arrays as they were before it), and each stream's
        head cache and owed pairs go back to its proposer."""
        queued, last = self.queued, self.read_last
        lengths = [len(d.tokens) - 1 for d in self.decoders]
        recurrent = iter(queued.recurrent)
        for c in self.trunk:
            if isinstance(c, BatchOffsetKV):
                c.offset, c.bound = mx.array(lengths, dtype=mx.int32), max(lengths)
            else:
                c.cache = next(recurrent)
        heads = self.head_cache[0]
        for b, d in enumerate(self.decoders):
            p, n = d.proposer, self.fed[b]  # n: the last read round's committed tokens
            p.cache = [heads.sequence(b, self.head_length[b])]
            p.owed = _HeadInput(last.out.pairs[b, : n - 1].tolist(), [last.out.hidden[b : b + 1, : n - 1]])
            p.h_prev = last.out.hidden[b : b + 1, n - 1 : n]
            p.drafted = False
        self.queued = self.read_last = None


def compilable(trunk: list, head_cache: list) -> bool:
    """Every cache a BatchOffsetKV (a hybrid's recurrent layers keep their
    rows from a tape whose shape is the target's business: uncompiled)."""
    return all(type(c) is BatchOffsetKV for c in (*trunk, *head_cache))


class CompiledBatchRounds:
    """`batch_round_graph` compiled (`mx.compile`), as ahead_round.
    CompiledRounds compiles one sequence's round: traced once per (depth,
    kernels on or off, batch, pairs width, buffer sizes) and replayed from
    C++ until a buffer grows or the batch changes, so a batched round pays
    no Python module calls. One per engine: the traces serve every batch."""

    def __init__(self, target, head, hook: DraftsHook | None = None, *, warm_first: bool = False,
                 warm_lock: AbstractContextManager | None = None):  # fmt: skip
        """warm_first, warm_lock: as CompiledRounds' (its kernels built first)."""
        self.target, self.head, self.hook = target, head, hook
        self._compiled: dict[tuple, object] = {}
        self.built_first = BuiltFirst(warm_lock) if warm_first else None

    def _function(self, k: int, kernels: bool, n_trunk: int, n_hook: int, batch: int, fresh: bool = False):
        key = (k, kernels, n_trunk, n_hook, batch)
        if key not in self._compiled or fresh:
            target, head, hook = self.target, self.head, self.hook

            def one_round(limit, pairs, hidden, standing, last, trunk_offset, head_offset, *inputs):
                flat, buffers = inputs[: n_hook * batch], inputs[n_hook * batch :]
                hook_inputs = [tuple(flat[b * n_hook : (b + 1) * n_hook]) for b in range(batch)]
                caches = [BatchOffsetKV(buffers[2 * i], buffers[2 * i + 1], trunk_offset if i < n_trunk
                                        else head_offset, bound=0)  # fmt: skip  (grown already)
                          for i in range(len(buffers) // 2)]
                trunk, heads = caches[:n_trunk], caches[n_trunk:]
                with tiles.stock():  # (a trace keeps its branch: never the way round a tile's build)
                    r = batch_round_graph(target, head, k, limit, pairs, hidden, standing, last, trunk,
                                          heads, partial(kernel_hook.kernels, kernels), hook,
                                          hook_inputs)  # fmt: skip
                return (r.drafts, r.accepted, r.bonus, r.pairs, r.hidden, trunk[0].offset,
                        heads[0].offset, *[a for c in caches for a in (c.keys, c.values)])  # fmt: skip

            if fresh:  # (a build's own: its trace and stream apart from the engine's)
                return mx.compile(one_round)
            self._compiled[key] = mx.compile(one_round)
        return self._compiled[key]

    def __call__(self, k: int, limit: mx.array, pairs: mx.array, hidden: mx.array, standing: mx.array,
                 last: mx.array, trunk: list, head_cache: list, kernels: bool,
                 hook_inputs: list[tuple] = ()) -> BatchRound | None:  # fmt: skip
        """The round, compiled; None while its kernels are built (warm_first):
        the caller runs `batch_round_graph`."""
        head_rows = make_room(trunk, head_cache, k, pairs.shape[1])
        batch = pairs.shape[0]
        n_hook = len(hook_inputs[0]) if hook_inputs else 0
        key = (k, kernels, len(trunk), n_hook, batch)
        # One offset input for the trunk's caches and one for the head's
        # (each group is written and kept alike), as CompiledRounds does.
        inputs = (limit, pairs, hidden, standing, last, trunk[0].offset, head_cache[0].offset,
                  *[a for inputs in hook_inputs for a in inputs], *buffers_of(trunk, head_cache))  # fmt: skip
        if self.built_first is not None and not self.built_first.ready(
                key, lambda: self._function(*key, fresh=True), inputs, ones=(3,)):  # (3: standing)
            return None
        drafts, accepted, bonus, pairs, hidden, trunk_offset, head_offset, *buffers = \
            self._function(*key)(*inputs)  # fmt: skip
        took_back(trunk, head_cache, buffers, trunk_offset, head_offset, k, head_rows)
        return BatchRound(drafts, accepted, bonus, pairs, hidden)

