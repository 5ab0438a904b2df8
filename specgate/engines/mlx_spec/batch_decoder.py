"""Speculative rounds over a batch of sequences (issue 45, its first part).

Each sequence in the batch is its own `SpecDecoder` (decoder.py): its
request, proposer, depth (0: a plain step inside the batch), penalties,
grammar, sampling and stopping. A round runs every decoder's
`begin_round` (the drafts, the rows [last, d_1..d_k]), one forward over
all of them (each padded to the batch's longest window; a pad row is
never kept), then every decoder's `end_round` on its own row of the
forward and its logits: the verdict is decoder.py's own, so each
sequence's tokens are what it would produce alone (greedy: its plain
greedy decoding; seeded: its plain seeded sampling, token for token;
sampled: exactly its target's distribution), whatever the others in the
batch draft, keep, join or leave.

The trunk's caches are one `forwards.batch_kv.BatchOffsetKV` per
attention layer, so each sequence keeps its own accepted drafts plus one
(what `end_round` says to keep) without moving any data. A hybrid's
recurrent layers (Qwen3.5/3.6's GatedDeltaNet: an mlx-lm ArraysCache of
conv window and state, batched along its first axis) are undone by the
tape their verify forward records (targets/qwen3_5.py): each row's
window and state after its own kept steps, picked on the device
(`keep_rows`). Caches of other kinds (Gemma-4's rotating windows) are
refused: `unbatchable` says why, and the engine then queues requests.
A decoder joins after its prefill (its caches hold every token but the
last) and leaves with its caches back, so prefill, the prefix cache,
handoffs and the single-sequence engine keep working on it as they do.

Where every stream is a greedy MTP AheadDecoder (a GPU's engine), the
rounds are queued one ahead (batch_ahead.py): the next round's graph is
built while the device runs this one. A join, a leave, every depth 0 or a
stream of another kind first drops the round queued ahead, and the batch
goes on with these rounds.

SpecEngine (engine.py) drives it for the requests that reach it while one
decodes. The engine proves the verify kernels at a
batch's widths in the background once its lone widths are switched on
(kernel_proofs.py); a round wider than the rows proved so far verifies
stock meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from specgate.engines.forwards.batch_kv import BatchOffsetKV
from specgate.engines.mlx_spec.batch_ahead import BatchAhead, CompiledBatchRounds
from specgate.engines.mlx_spec.decoder import SpecDecoder, Step
from specgate.engines.targets import Forward, Target
from specgate.kernels import hook


def unbatchable(target: Target) -> str | None:
    """Why `target`'s sequences cannot decode in one batch; None: they can."""
    kinds = {type(c) for c in target.make_cache()}
    if kinds <= {KVCache} or (kinds <= {KVCache, ArraysCache} and hasattr(target, "keep_rows")):
        return None
    names = ", ".join(sorted(k.__name__ for k in kinds - {KVCache}))
    return f"its caches ({names}) are not batched: only KV caches and a hybrid's recurrent state"


class BatchSpecDecoder:
    def __init__(self, target: Target, kernel_rows: Callable[[], int] | None = None,
                 ahead: bool = False, rounds: Callable[[object], CompiledBatchRounds | None] | None = None):  # fmt: skip
        """`kernel_rows`: how many verify rows the kernels are proved for
        now (engine.py: its KernelSwitch's `rows`); a round wider verifies
        stock rather than prove a shape inside it. None: as the target says.
        `ahead`: greedy MTP streams' rounds run ahead where they all fit
        (batch_ahead.py; the engine's choice on a GPU); `rounds(head)`: the
        engine's compiled rounds for that MTP head (None: built in Python)."""
        self.target = target
        self.kernel_rows = kernel_rows
        self.ahead, self.rounds = ahead, rounds
        self._ahead: BatchAhead | None = None  # running ahead now
        self.decoders: dict[str, SpecDecoder] = {}  # in batch order
        self.caches: list[BatchOffsetKV | ArraysCache] | None = None
        self.refused = unbatchable(target)
        # recurrent layers: verify forwards record their tape, rows keep by it
        self.recurrent = any(type(c) is ArraysCache for c in target.make_cache())

    def join(self, key: str, decoder: SpecDecoder) -> None:
        """A decoder after its prefill (its caches hold all its tokens but
        the last); the batch holds its caches until it leaves."""
        if key in self.decoders:
            raise ValueError(f"{key}: already in the batch")
        self._settle()
        if decoder.target is not self.target:
            raise ValueError(f"{key}: decodes another target")
        cache = decoder.cache
        if self.refused is not None:
            raise ValueError(f"{key}: {self.refused}")
        if any(type(c) is KVCache and c.offset != len(decoder.tokens) - 1 for c in cache) or any(
                type(c) is ArraysCache and c[1] is None for c in cache):  # fmt: skip
            raise ValueError(f"{key}: its caches must hold all its tokens but the last")
        joined = [BatchOffsetKV.from_caches([c]) if type(c) is KVCache else _arrays(c) for c in cache]
        if self.caches is None:
            self.caches = joined
        else:
            for mine, theirs in zip(self.caches, joined, strict=True):
                mine.extend(theirs)
        decoder.cache = None  # the batch's now: nothing may decode it alone meanwhile
        self.decoders[key] = decoder

    def leave(self, key: str) -> SpecDecoder:
        """Takes the sequence out, its caches back in its decoder."""
        self._settle()
        keys = list(self.decoders)
        b = keys.index(key)
        decoder = self.decoders.pop(key)
        decoder.cache = [c.sequence(b, len(decoder.tokens) - 1) if isinstance(c, BatchOffsetKV)
                         else _arrays(c, b) for c in self.caches]  # fmt: skip
        stay = [i for i in range(len(keys)) if i != b]
        if stay:
            for c in self.caches:
                c.filter(stay if isinstance(c, BatchOffsetKV) else mx.array(stay))
        else:
            self.caches = None
        return decoder

    def round(self, depths: Mapping[str, int]) -> dict[str, Step]:
        """One round for the whole batch: each sequence drafts up to
        depths[key] (missing: 0); returns each one's Step."""
        ks = [depths.get(key, 0) for key in self.decoders]
        if self._ahead is not None and max(ks) == 0:
            self._settle()
        if self._ahead is None and self.ahead and BatchAhead.fits(list(self.decoders.values()), ks):
            decoders = list(self.decoders.values())
            rounds = self.rounds and self.rounds(decoders[0].proposer.head)
            self._ahead = BatchAhead(self.target, decoders, self.caches, rounds)
        if self._ahead is not None:
            return dict(zip(self.decoders, self._ahead.round(ks, self._kernels_on), strict=True))
        decoders = list(self.decoders.items())
        held = [len(d.tokens) - 1 for _, d in decoders]
        planned = [d.begin_round(k) for (_, d), k in zip(decoders, ks, strict=True)]
        width = 1 + max(p.depth for p in planned)
        rows = mx.stack([mx.pad(p.rows.astype(mx.int32), [(0, width - 1 - p.depth)]) for p in planned])
        layers = sorted({i for _, d in decoders for i in d.proposer.layers})
        with hook.kernels(self._kernels_on(len(decoders) * width)):
            forward = self.target.forward(rows, self.caches, layers=layers,
                                          undo="tape" if self.recurrent else None)  # fmt: skip
            logits = self.target.logits(forward.hidden)
        kept = [0] * len(decoders)
        steps = {}
        for b, ((key, d), p) in enumerate(zip(decoders, planned, strict=True)):
            n = p.depth + 1
            row = Forward(forward.tokens[b : b + 1, :n], forward.hidden[b : b + 1, :n],
                          {i: h[b : b + 1, :n] for i, h in forward.layers.items()})  # fmt: skip
            steps[key] = d.end_round(p, row, logits[b, :n], lambda k, b=b: kept.__setitem__(b, k))
        kept_arr = mx.array(kept, dtype=mx.int32)
        for c in self.caches:
            if isinstance(c, BatchOffsetKV):
                c.keep(kept_arr)
                c.settle([h + k for h, k in zip(held, kept, strict=True)])
        if self.recurrent:
            self.target.keep_rows(self.caches, forward, kept_arr)
        return steps

    def _kernels_on(self, rows: int) -> bool:
        """Whether a verify forward of `rows` rows runs through the kernels:
        where the target's are on, and not past the rows proved so far."""
        return bool(self.target.kernels) and (self.kernel_rows is None or rows <= self.kernel_rows())

    def _settle(self) -> None:
        """Out of running ahead: the round queued past the last one read dropped."""
        if self._ahead is not None:
            self._ahead.drop()
            self._ahead = None


def batched_caches(sequences: list[list]) -> list:
    """Several sequences' caches (each per layer, as make_cache gives them)
    as one batch's, in order."""
    layers = []
    for per_layer in zip(*sequences, strict=True):
        if type(per_layer[0]) is KVCache:
            layers.append(BatchOffsetKV.from_caches(list(per_layer)))
        else:
            joined = _arrays(per_layer[0])
            for other in per_layer[1:]:
                joined.extend(other)
            layers.append(joined)
    return layers


def _arrays(cache: ArraysCache, row: int | None = None) -> ArraysCache:
    """A recurrent layer's arrays as a cache of its own: all of them (a
    sequence joining: the batch's to extend), or one row of a batch's (a
    sequence leaving)."""
    own = ArraysCache(len(cache.cache))
    own.cache = list(cache.cache) if row is None else [a[row : row + 1] for a in cache.cache]
    return own
