"""The Qwen3.5 / Qwen3-Next MTP head, built from a checkpoint's own `mtp.*`.

Published forward (vLLM `Qwen3_5MultiTokenPredictor.forward`):

    x   = fc(concat[pre_fc_norm_embedding(embed(t[i+1])),   # embedding FIRST
                    pre_fc_norm_hidden(h[i])])              # h: trunk output
                                                            #    AFTER final norm
    x   = layer(x, position i)       # one full-attention decoder layer, own KV
    out = norm(x);  logits = lm_head(out)                   # predicts t[i+2]

The embedding and lm_head are the trunk's: the head holds neither (callers
pass embeddings in and apply the trunk's lm_head to `out`), so nothing of the
trunk is ever copied. For depth > 1 the head is fed its own `out`
as the next hidden state, at the next position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

# Qwen stores these norms zero-centred (effective scale 1 + w); raw HF
# checkpoints need +1 on load, exactly as mlx-lm does for the trunk's norms.
ZERO_CENTRED_NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


class MTPHead(nn.Module):
    """pre_fc norms, fc, the MTP decoder layer(s) and the final norm.

    The decoder layers come from the caller, so each family supplies its own
    full-attention layer class (loading.py: Qwen3.5's `DecoderLayer`,
    Qwen3-Next's `Qwen3NextDecoderLayer`); `MTPHead.qwen35(args, n)` builds
    Qwen3.5 layers, as the demo trainer does.
    """

    def __init__(self, hidden_size: int, eps: float, layers: Sequence[nn.Module]):
        super().__init__()
        if not layers:
            raise ValueError("an MTP head needs at least one layer")
        h = hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = list(layers)
        self.norm = nn.RMSNorm(h, eps=eps)

    @classmethod
    def qwen35(cls, args: TextModelArgs, num_layers: int = 1) -> MTPHead:
        return cls(args.hidden_size, args.rms_norm_eps, qwen35_layers(args, num_layers))

    def make_cache(self) -> list[KVCache]:
        """One KV cache per MTP layer (the head's own, apart from the trunk's)."""
        return [KVCache() for _ in self.layers]

    def fc_input(self, embeddings: mx.array, hidden: mx.array) -> mx.array:
        """concat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]: embedding first."""
        return mx.concatenate(
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
        )

    def __call__(
        self,
        embeddings: mx.array,
        hidden: mx.array,
        cache: list[Any] | None = None,
        step: int = 0,
    ) -> mx.array:
        """embeddings of t[i+1] and trunk hidden h[i], both (B, L, H) -> out (B, L, H).

        `step` picks the layer for chained depth (published: step % num_layers).
        """
        x = self.fc(self.fc_input(embeddings, hidden))
        layer = self.layers[step % len(self.layers)]
        c = None if cache is None else cache[step % len(self.layers)]
        x = layer(x, mask=create_attention_mask(x, c), cache=c)
        return self.norm(x)


def qwen35_layers(args: TextModelArgs, num_layers: int) -> list[DecoderLayer]:
    """Qwen3.5 MTP layers: full attention (gated), dense MLP or MoE as the trunk has."""
    full = args.full_attention_interval - 1
    return [DecoderLayer(args, layer_idx=full) for _ in range(num_layers)]


def head_weights_from_checkpoint(
    tensors: dict[str, mx.array], *, raw_hf: bool
) -> dict[str, mx.array]:
    """`mtp.*` tensors as MTPHead parameters (prefix stripped, norms shifted
    if the checkpoint is in raw HF layout)."""
    out = {}
    for name, value in tensors.items():
        if not name.startswith("mtp."):
            continue
        key = name[len("mtp.") :]
        if raw_hf and value.ndim == 1 and key.endswith(ZERO_CENTRED_NORMS):
            value = value + 1.0
        out[key] = value
    return out


def head_weights_to_checkpoint(head: MTPHead) -> dict[str, mx.array]:
    """The inverse: MTPHead parameters as published raw-HF `mtp.*` tensors."""
    from mlx.utils import tree_flatten

    out = {}
    for key, value in tree_flatten(head.parameters()):
        if value.ndim == 1 and key.endswith(ZERO_CENTRED_NORMS):
            value = value - 1.0
        out[f"mtp.{key}"] = value
    return out
