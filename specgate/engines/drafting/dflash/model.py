"""The DFlash drafter (z-lab layout), as an MLX module.

A few Qwen3 decoder layers that draft a whole block in one pass. Its input is
the block `[last token, mask x (L-1)]` embedded with the *target's*
embedding, and the context: the outputs of the target's layers
`target_layer_ids` (before the final norm) for every committed token,
concatenated and fused by `hidden_norm(fc(.))`. Each layer projects K/V from
the context and from the block; the context K/V are cached, the block's are
dropped after the pass. There is no mask: the block attends to all of the
context and to itself both ways. The output at block position j, through the
target's lm_head, proposes the token at position j (so L-1 proposals).
Norms are plain `x * w` RMSNorms (Qwen3), unlike Qwen3.5's zero-centred ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from specgate.engines.forwards import kv_buffer


@dataclass
class DFlashArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    vocab_size: int | None = None

    @classmethod
    def from_config(cls, cfg: dict) -> DFlashArgs:
        dflash = cfg.get("dflash_config") or {}

        def pick(key: str, default=None):
            # z-lab reads dflash_config first, then the top level.
            return dflash.get(key, cfg.get(key, default))

        ids, mask = pick("target_layer_ids"), pick("mask_token_id")
        if ids is None or mask is None or "block_size" not in cfg and "block_size" not in dflash:
            raise ValueError("not a DFlash drafter config: needs block_size, "
                             "dflash_config.target_layer_ids and dflash_config.mask_token_id")
        return cls(
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            block_size=int(pick("block_size")),
            target_layer_ids=[int(i) for i in ids],
            mask_token_id=int(mask),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 1_000_000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            vocab_size=cfg.get("vocab_size"),
        )


class DFlashAttention(nn.Module):
    def __init__(self, args: DFlashArgs):
        super().__init__()
        h, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(h, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = initialize_rope(hd, base=args.rope_theta, traditional=False,
                                    scaling_config=args.rope_scaling,
                                    max_position_embeddings=args.max_position_embeddings)

    def absorb(self, context: mx.array, cache: KVCache) -> None:
        """Context rows alone into the cache: their K/V depend on nothing
        else (the block only reads them), as in __call__."""
        B, C, _ = context.shape
        k = self.k_norm(self.k_proj(context).reshape(B, C, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(context).reshape(B, C, self.n_kv, -1).transpose(0, 2, 1, 3)
        cache.update_and_fetch(self.rope(k, offset=cache.offset), v)

    def __call__(self, x: mx.array, context: mx.array, cache: KVCache) -> mx.array:
        B, L, _ = x.shape
        C = context.shape[1]
        kv_in = mx.concatenate([context, x], axis=1)
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(kv_in).reshape(B, C + L, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(kv_in).reshape(B, C + L, self.n_kv, -1).transpose(0, 2, 1, 3)
        # Positions: cached context, then the new context, then the block.
        k = self.rope(k, offset=cache.offset)
        q = self.rope(q, offset=cache.offset + C)
        k, v = cache.update_and_fetch(k, v)
        mask = cache.visible() if isinstance(cache, kv_buffer.WholeBufferKV) else None
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DFlashLayer(nn.Module):
    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.self_attn = DFlashAttention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, context: mx.array, cache: KVCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), context, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.args = args
        n = len(args.target_layer_ids)
        self.fc = nn.Linear(n * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DFlashLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def absorb(self, features: mx.array, cache: list[KVCache]) -> None:
        """Committed tokens' features into the context cache, without a block
        (a prompt chunk, as it is prefilled)."""
        context = self.hidden_norm(self.fc(features))
        for layer, c in zip(self.layers, cache, strict=True):
            layer.self_attn.absorb(context, c)

    def __call__(self, block: mx.array, features: mx.array, cache: list[KVCache]) -> mx.array:
        """block: (B, L, H) embedded block; features: (B, C, n*H) the target's
        layer outputs for the C committed tokens the cache has not seen.
        Leaves the block's K/V in the cache: trim them with `forget_block`."""
        context = self.hidden_norm(self.fc(features))
        h = block
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, context, c)
        return self.norm(h)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]


def check_pairing(drafter: DFlashDrafter, target, min_block: int = 2) -> None:
    """A drafter built for another target fails here, by name, not with a
    shape error later. `target`: anything with hidden_size, num_layers and
    vocab_size (engines/targets/). min_block: 2 for DFlash, whose block's
    first position is the last committed token; 1 for DSpark."""
    a = drafter.args
    if a.hidden_size != target.hidden_size:
        raise ValueError(f"drafter hidden_size {a.hidden_size} != target's {target.hidden_size}")
    bad = [i for i in a.target_layer_ids if not -1 <= i < target.num_layers]  # -1: embeddings
    if bad:
        raise ValueError(f"drafter reads target layers {bad}; the target has {target.num_layers}")
    if not 0 <= a.mask_token_id < target.vocab_size:
        raise ValueError(f"drafter mask_token_id {a.mask_token_id} outside the target's vocab "
                         f"({target.vocab_size})")  # fmt: skip
    if a.vocab_size is not None and a.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocab_size {a.vocab_size} != target's {target.vocab_size}")
    if a.block_size < min_block:
        raise ValueError(f"drafter block_size {a.block_size} leaves nothing to propose")


def forget_block(cache: list[KVCache], block_len: int) -> None:
    for c in cache:
        c.trim(block_len)


def load_dflash(path: str | Path, dtype: mx.Dtype | None = None) -> DFlashDrafter:
    """A z-lab DFlash drafter directory (config.json + *.safetensors)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    drafter = DFlashDrafter(DFlashArgs.from_config(cfg))
    weights: dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights |= mx.load(str(f))
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    drafter.load_weights(list(weights.items()), strict=True)
    mx.eval(drafter.parameters())
    return drafter
