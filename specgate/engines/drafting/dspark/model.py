"""The DSpark drafter (DeepSpec layout), as an MLX module.

DFlash's backbone (engines/drafting/dflash/model.py: context fusion, bidirectional
block layers) with three differences:
- alignment: the output at block position j proposes the token *after* it,
  so a block of `block_size` positions gives `block_size` proposals;
- its own (frozen) copies of the target's embedding and lm_head;
- a low-rank Markov head, logits_j += w2(w1[prev_j]) with prev_0 the last
  committed token and then each previous proposal, so a block is sampled
  position by position (cheaply: the backbone runs once); and a confidence
  head, sigmoid(proj([h_j; w1[prev_j]])), that cuts the proposal at its
  first position below a threshold.
target_layer_ids may name -1: the target's embedding output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from specgate.engines.drafting.dflash.model import DFlashArgs, DFlashDrafter

DEFAULT_CONFIDENCE_THRESHOLD = 0.5


@dataclass
class DSparkArgs(DFlashArgs):
    markov_rank: int = 0
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    confidence_threshold: float = DEFAULT_CONFIDENCE_THRESHOLD

    @classmethod
    def from_config(cls, cfg: dict) -> DSparkArgs:
        base = DFlashArgs.from_config(cfg)
        kind = cfg.get("markov_head_type", "vanilla")
        if cfg.get("markov_rank") and kind != "vanilla":
            raise ValueError(f"DSpark markov_head_type {kind!r} is not supported (vanilla only)")
        return cls(
            **vars(base),
            markov_rank=int(cfg.get("markov_rank") or 0),
            enable_confidence_head=bool(cfg.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
            confidence_threshold=float(cfg.get("confidence_threshold",
                                               DEFAULT_CONFIDENCE_THRESHOLD)),
        )


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=True)


class DSparkDrafter(DFlashDrafter):
    def __init__(self, args: DSparkArgs):
        super().__init__(args)
        vocab = args.vocab_size
        self.embed_tokens = nn.Embedding(vocab, args.hidden_size)
        self.lm_head = nn.Linear(args.hidden_size, vocab, bias=False)
        if args.markov_rank:
            self.markov_head = MarkovHead(vocab, args.markov_rank)
        if args.enable_confidence_head:
            extra = args.markov_rank if args.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(args.hidden_size + extra)

    def markov(self, prev: mx.array) -> tuple[mx.array, mx.array | None]:
        """(logit correction, w1 row) for the previous token(s); zero without a head."""
        if not self.args.markov_rank:
            return mx.zeros((1,)), None
        row = self.markov_head.markov_w1(prev)
        return self.markov_head.markov_w2(row), row

    def confidence(self, h: mx.array, row: mx.array | None) -> mx.array | None:
        if not self.args.enable_confidence_head:
            return None
        x = mx.concatenate([h, row], axis=-1) if self.args.confidence_head_with_markov else h
        return mx.sigmoid(self.confidence_head.proj(x))[..., 0]


def load_dspark(path: str | Path) -> DSparkDrafter:
    """A DeepSpec DSpark drafter directory (config.json + *.safetensors)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    drafter = DSparkDrafter(DSparkArgs.from_config(cfg))
    weights: dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights |= mx.load(str(f))
    drafter.load_weights([(k.removeprefix("model."), v) for k, v in weights.items()], strict=True)
    mx.eval(drafter.parameters())
    return drafter
