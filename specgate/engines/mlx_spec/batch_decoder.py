"""Greedy speculative rounds over a batch of sequences (issue 45, its first part).

Each sequence in the batch drafts with its own proposer at its own depth
(0: a plain step inside the batch), and one forward verifies them all:
every sequence feeds [last, d_1..d_k], padded to the batch's longest
window (a pad row is never kept). The trunk's caches are one
`forwards.batch_kv.BatchOffsetKV` per layer, so each sequence keeps its
own accepted drafts plus one without moving any data. The verdict is
decoder.py's rule per sequence (`acceptance.accept_greedy` on its own
row), so each sequence's tokens are its plain greedy decoding's, whatever
the others in the batch draft, keep, join or leave. A proposer is told
what its sequence kept with its own row of the forward (MTP reads its
hidden states there), as decoder.py tells it.

Sequences join prefilled on their own (their mlx-lm caches hold every
token but the last, which the next round feeds) and leave with their
caches back, so prefill, the prefix cache and the single-sequence engines
keep working as they do.

Not yet here (issue 45): sampling at temperature and penalties (a stream
asking for them is refused), grammars, hybrid models' recurrent state,
an engine that drives it, the policy's per-round choice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from specgate.engines.base import SamplingParams
from specgate.engines.drafting.base import Context, Proposer
from specgate.engines.forwards.batch_kv import BatchOffsetKV
from specgate.engines.mlx_spec.acceptance import accept_greedy
from specgate.engines.targets import Forward, Target


@dataclass
class BatchStream:
    """One sequence in the batch."""

    key: str
    proposer: Proposer
    tokens: list[int]  # prompt + committed; tokens[-1] is fed next round
    prompt_len: int
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))

    def __post_init__(self):
        if not self.params.greedy or self.params.has_penalties:
            raise ValueError(f"{self.key}: batched speculation is greedy without penalties "
                             "for now (issue 45)")  # fmt: skip


class BatchSpecDecoder:
    def __init__(self, target: Target):
        self.target = target
        self.streams: list[BatchStream] = []
        self.caches: list[BatchOffsetKV] | None = None

    def join(self, stream: BatchStream, cache: list[KVCache]) -> None:
        """A sequence prefilled on its own: `cache` (mlx-lm KVCaches, one a
        layer) holds every token of stream.tokens but the last."""
        if any(type(c) is not KVCache for c in cache):
            raise ValueError("batched speculation takes plain KV caches only (no hybrids yet)")
        if any(c.offset != len(stream.tokens) - 1 for c in cache):
            raise ValueError(f"{stream.key}: its cache must hold all its tokens but the last")
        if any(s.key == stream.key for s in self.streams):
            raise ValueError(f"{stream.key}: already in the batch")
        joined = [BatchOffsetKV.from_caches([c]) for c in cache]
        if self.caches is None:
            self.caches = joined
        else:
            for mine, theirs in zip(self.caches, joined, strict=True):
                mine.extend(theirs)
        self.streams.append(stream)

    def leave(self, key: str) -> list[KVCache]:
        """Takes the sequence out; its caches (all its tokens but the last) back."""
        b = next(i for i, s in enumerate(self.streams) if s.key == key)
        length = len(self.streams[b].tokens) - 1
        caches = [c.sequence(b, length) for c in self.caches]
        stay = [i for i in range(len(self.streams)) if i != b]
        self.streams.pop(b)
        if stay:
            for c in self.caches:
                c.filter(stay)
        else:
            self.caches = None
        return caches

    def round(self, depths: Mapping[str, int]) -> dict[str, list[int]]:
        """One round for the whole batch: each sequence drafts up to
        depths[key] (missing: 0); returns the tokens each commits."""
        streams = self.streams
        drafts: list[list[int]] = []
        for s in streams:
            depth = depths.get(s.key, 0)
            context = Context(s.tokens, s.prompt_len, s.params, None)
            proposal = s.proposer.propose(context, depth) if depth > 0 else None
            drafts.append([] if proposal is None else proposal.drafts.tolist())
        width = 1 + max(len(d) for d in drafts)
        rows = [[s.tokens[-1], *d, *[0] * (width - 1 - len(d))] for s, d in zip(streams, drafts, strict=True)]
        layers = sorted({i for s in streams for i in s.proposer.layers})
        forward = self.target.forward(mx.array(rows, dtype=mx.int32), self.caches, layers=layers)
        chosen = mx.argmax(self.target.logits(forward.hidden), axis=-1).tolist()  # the one wait
        verdicts = [accept_greedy(d, chosen[b][: len(d) + 1]) for b, d in enumerate(drafts)]
        kept = mx.array([v.accepted + 1 for v in verdicts], dtype=mx.int32)
        for c in self.caches:
            c.keep(kept)
            c.settle([len(s.tokens) + v.accepted for s, v in zip(streams, verdicts, strict=True)])
        out = {}
        for b, (s, d, v) in enumerate(zip(streams, drafts, verdicts, strict=True)):
            row = Forward(forward.tokens[b : b + 1], forward.hidden[b : b + 1],
                          {i: h[b : b + 1] for i, h in forward.layers.items()})  # fmt: skip
            s.proposer.committed(s.tokens[-1], d, v.accepted, row)
            out[s.key] = [*d[: v.accepted], v.next_token]
            s.tokens += out[s.key]
        return out
