"""The Qwen3.5 / Qwen3-Next MTP head, built from a checkpoint's own `mtp.*`.

Published forward (vLLM `Qwen3_5MultiTokenPredictor.forward`):

    x   = fc(concat[pre_fc_norm_embedding(embed(t[i+1])),   # embedding FIRST
                    pre_fc_norm_hidden(h[i])])              # h: trunk output
                                                            #    AFTER final norm
    x   = layer(x, position i)       # one full-attention decoder layer, own KV
    out = norm(x);  logits = lm_head(out)                   # predicts t[i+2]

The embedding and lm_head are the trunk's: the head holds references to the
trunk's modules, never copies. For depth > 1 the head is fed its own `out`
as the next hidden state, at the next position.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
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
    def __init__(self, args: TextModelArgs, num_layers: int = 1):
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        # A full-attention layer of the trunk's own kind (gated attention;
        # dense MLP or MoE as the trunk has).
        full = args.full_attention_interval - 1
        self.layers = [DecoderLayer(args, layer_idx=full) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(h, eps=eps)

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
        x = self.fc(
            mx.concatenate(
                [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
            )
        )
        layer = self.layers[step % len(self.layers)]
        c = None if cache is None else cache[step % len(self.layers)]
        x = layer(x, mask=create_attention_mask(x, c), cache=c)
        return self.norm(x)


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
