"""The Gemma-4 assistant drafter (Gemma4AssistantForCausalLM), as an MLX module.

A few Gemma-4 decoder layers with queries only: every layer is KV-shared,
attending to the target's K/V of its last cache-owning layer of the same
attention type (sliding or full), so the drafter keeps no cache at all. One
step drafts one token:
    h   = pre_projection([target_embed(token) * sqrt(H_target), h_prev])
    h   = layers(h)  (queries at the position the token would take, the
          same for every step of a round), then the final norm
    out = logits(h), and post_projection(h) is the next step's h_prev
The first h_prev of a round is the target's hidden state (after its final
norm) at the position that produced the last committed token.

The layers are mlx-lm's `gemma4_text.DecoderLayer` (its `shared_kv` path),
so the norms are Gemma-4's (`x * w`) and `layer_scalar` multiplies (`h * s`)
exactly as the target's do. The output head is the tied embedding, or, with
`use_ordered_embeddings` (the E2B/E4B assistants), the centroid head:
score `num_centroids` clusters of tokens, keep the top
`centroid_intermediate_top_k`, compute logits for their tokens only, and
give every other token the smallest of those minus one. Either way the
logits are a full-vocabulary row, so q is a real distribution and the
drafts are accepted by the exact rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

from specgate.engines.mlx_load import evaluate_buffers


@dataclass
class AssistantArgs:
    backbone_hidden_size: int
    text: gemma4_text.ModelArgs
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True

    @classmethod
    def from_config(cls, cfg: dict) -> AssistantArgs:
        if cfg.get("model_type") != "gemma4_assistant" or "text_config" not in cfg:
            raise ValueError("not a Gemma-4 assistant config: needs model_type gemma4_assistant "
                             "and a text_config")  # fmt: skip
        tc = dict(cfg["text_config"])
        n = tc.get("num_hidden_layers")
        # Every layer is KV-shared unless the config says otherwise
        # (transformers' Gemma4AssistantConfig default).
        tc.setdefault("num_kv_shared_layers", n)
        text = gemma4_text.ModelArgs.from_dict(tc)
        if text.num_kv_shared_layers != text.num_hidden_layers:
            raise ValueError(f"Gemma-4 assistant with {text.num_hidden_layers - text.num_kv_shared_layers}"
                             " layers of its own K/V: only fully KV-shared assistants are published")
        if text.hidden_size_per_layer_input or text.enable_moe_block or text.use_double_wide_mlp:
            raise ValueError("Gemma-4 assistant config asks for per-layer inputs, MoE or a "
                             "double-wide MLP, which assistants do not have")
        return cls(
            backbone_hidden_size=int(cfg.get("backbone_hidden_size", 1536)),
            text=text,
            use_ordered_embeddings=bool(cfg.get("use_ordered_embeddings", False)),
            num_centroids=int(cfg.get("num_centroids", 2048)),
            centroid_intermediate_top_k=int(cfg.get("centroid_intermediate_top_k", 32)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )


class MaskedEmbedding(nn.Module):
    """The centroid head: logits for the tokens of the top-k clusters only."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        t = args.text
        if t.vocab_size % args.num_centroids:
            raise ValueError(f"vocab_size {t.vocab_size} is not a multiple of num_centroids "
                             f"{args.num_centroids}")  # fmt: skip
        self.top_k = args.centroid_intermediate_top_k
        self.vocab = t.vocab_size
        self.centroids = nn.Linear(t.hidden_size, args.num_centroids, bias=False)
        # Token ids grouped by cluster: row c of (C, V/C) holds cluster c's tokens.
        self.token_ordering = mx.zeros((t.vocab_size,), dtype=mx.int32)

    def __call__(self, h: mx.array, embed: nn.Module) -> mx.array:
        scores = self.centroids(h)  # (..., C)
        top = mx.argpartition(-scores, self.top_k - 1, axis=-1)[..., : self.top_k]
        clusters = self.token_ordering.reshape(scores.shape[-1], -1)
        ids = clusters[top].reshape(*h.shape[:-1], -1)  # (..., k * V/C)
        picked = (embed(ids) @ h[..., None])[..., 0]  # the rows' dot products
        floor = picked.min(axis=-1, keepdims=True) - 1
        full = mx.broadcast_to(floor, (*h.shape[:-1], self.vocab))
        return mx.put_along_axis(full, ids, picked, axis=-1)


class _Inner(nn.Module):
    def __init__(self, t: gemma4_text.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        self.layers = [gemma4_text.DecoderLayer(t, i) for i in range(t.num_hidden_layers)]
        self.norm = nn.RMSNorm(t.hidden_size, eps=t.rms_norm_eps)


class Gemma4Assistant(nn.Module):
    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.args = args
        t = args.text
        self.model = _Inner(t)
        self.pre_projection = nn.Linear(2 * args.backbone_hidden_size, t.hidden_size, bias=False)
        self.post_projection = nn.Linear(t.hidden_size, args.backbone_hidden_size, bias=False)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
        if args.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedding(args)

    @property
    def sliding_window(self) -> int:
        return self.args.text.sliding_window

    @property
    def layer_types(self) -> list[str]:
        return list(self.args.text.layer_types)

    def step(self, token_embed: mx.array, h_prev: mx.array, kv: dict, position: int
             ) -> tuple[mx.array, mx.array]:  # fmt: skip
        """One draft: (next h_prev (1, 1, H_target), logits (1, 1, V)).
        `kv`: per attention type, the target's (keys, values, mask or None)."""
        h = self.pre_projection(mx.concatenate([token_embed, h_prev], axis=-1))
        for layer in self.model.layers:
            keys, values, seen = kv[layer.layer_type]
            mask = None if seen is None else seen[None]
            h, _, _ = layer(h, mask, None, shared_kv=(keys, values), offset=position)
        h = self.model.norm(h)
        return self.post_projection(h), self.logits(h)

    def logits(self, h: mx.array) -> mx.array:
        if self.args.use_ordered_embeddings:
            return self.masked_embedding(h, self.model.embed_tokens)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)


def load_assistant(path: str | Path) -> Gemma4Assistant:
    """A Gemma-4 assistant directory (config.json + *.safetensors), as published."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    drafter = Gemma4Assistant(AssistantArgs.from_config(cfg))
    weights: dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        weights |= mx.load(str(f))
    if drafter.args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # a copy of the embedding, where a tool saved one
    if "masked_embedding.token_ordering" in weights:  # int64 as published
        weights["masked_embedding.token_ordering"] = weights["masked_embedding.token_ordering"].astype(mx.int32)
    if q := cfg.get("quantization"):
        nn.quantize(drafter, group_size=q["group_size"], bits=q["bits"],
                    class_predicate=lambda p, m: f"{p}.scales" in weights)  # fmt: skip
    drafter.load_weights(list(weights.items()), strict=True)
    mx.eval(drafter.parameters())
    evaluate_buffers(drafter)  # its RoPEs' frequencies
    return drafter


def check_pairing(drafter: Gemma4Assistant, target) -> None:
    """A drafter released for another Gemma-4 size fails here, naming what
    differs, not with a shape error later. `target`: a Gemma-4 adapter
    (engines/targets/gemma4_text.py)."""
    args = getattr(target, "args", None)
    if not hasattr(target, "drafter_kv") or args is None:
        raise ValueError("a Gemma-4 assistant drafts for a Gemma-4 target; this target is "
                         f"{type(target.model).__module__.rsplit('.', 1)[-1]}")  # fmt: skip
    a, t = drafter.args, drafter.args.text
    wrong = []
    if a.backbone_hidden_size != target.hidden_size:
        wrong.append(f"it was released for a target of hidden size {a.backbone_hidden_size} "
                     f"(backbone_hidden_size), this target's is {target.hidden_size}")  # fmt: skip
    if t.vocab_size != target.vocab_size:
        wrong.append(f"its vocabulary has {t.vocab_size} tokens, the target's {target.vocab_size}")
    for kind in dict.fromkeys(t.layer_types):
        if kind not in target.kv_layer:
            wrong.append(f"it attends to the target's {kind} layers; the target has none with a cache")
            continue
        layer = target.inner.layers[target.kv_layer[kind]].self_attn
        mine = t.global_head_dim if kind == "full_attention" and t.global_head_dim else t.head_dim
        if mine != layer.head_dim:
            wrong.append(f"its {kind} heads are {mine} wide, the target's {layer.head_dim}")
        elif t.num_attention_heads % layer.n_kv_heads:
            wrong.append(f"its {t.num_attention_heads} query heads cannot share the target's "
                         f"{layer.n_kv_heads} {kind} K/V heads")  # fmt: skip
    if t.sliding_window != args.sliding_window:
        wrong.append(f"its sliding window is {t.sliding_window} tokens, the target's "
                     f"{args.sliding_window}")  # fmt: skip
    if wrong:
        raise ValueError("this Gemma-4 assistant does not fit the target: " + "; ".join(wrong))
