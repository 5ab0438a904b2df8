"""A tiny checkpoint loaded in the test process, with what it drafts with.

For tests that drive a proposer and `SpecDecoder` by hand (method-specific
behaviour, peers' cross-checks, cache plumbing); tests/exactness.py builds
whole engines through the registry instead. float32, so a greedy reference
and a speculative decode see the same weights without bfloat16 near-ties.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from greedy import greedy_reference
from mlx_lm.utils import load_model

from specgate.engines.cache.prefix_cache import PrefixCache
from specgate.engines.loading import LoadedModel
from specgate.engines.targets import target_for

N_TOKENS = 64


class TinyTarget:
    """`model` (float32), its `trunk` (specgate/engines/targets), its MTP `head` if
    asked for, and a `drafter` directory loaded with `loader` (its pairing
    with the trunk checked by `pairing`, where given)."""

    def __init__(self, path: Path, *, head: bool = False, drafter: Path | None = None,
                 loader: Callable | None = None, pairing: Callable | None = None):  # fmt: skip
        model, config = load_model(path)
        model.set_dtype(mx.float32)
        self.model = model
        self.loaded = LoadedModel(str(path), model, None, config, PrefixCache(str(path)))
        self.trunk = target_for(model)
        self.vocab = self.loaded.vocab_size
        self.head = self.drafter = None
        if head:
            from specgate.engines.drafting.mtp.loading import load_mtp_head

            self.head = load_mtp_head(self.loaded)
            self.head.set_dtype(mx.float32)
        if drafter is not None:
            self.drafter = loader(drafter)
            if pairing is not None:
                pairing(self.drafter, self.trunk)
        self._references: dict = {}

    def reference(self, prompt: list[int], n: int = N_TOKENS):
        """Plain greedy decoding, computed once per prompt."""
        key = (tuple(prompt), n)
        if key not in self._references:
            self._references[key] = greedy_reference(self.model, prompt, n)
        return self._references[key]
