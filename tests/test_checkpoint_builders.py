"""The MoE, Qwen3-Next and drafter builders write the published layouts; trap helpers work.

Targets mlx-lm supports are loaded and run with it; drafters, which it does
not support, are checked name by name and shape by shape against the
layouts in their reference code.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

from specgate.builders import drafters, tiny
from specgate.builders.drafters import (
    build_dflash_drafter,
    build_dspark_drafter,
    build_gemma4_assistant,
    default_target_layer_ids,
)
from specgate.builders.tiny import (
    apply_double_norm_shift,
    apply_gemma4_norm_shift,
    build_gemma4,
    build_qwen3_dense,
    build_qwen3_next,
    build_qwen35_hybrid,
    build_qwen35_moe,
    strip_mtp,
)

# The builders' defaults.
H, V, HD, N_Q, N_KV, FF = 128, 2048, 32, 4, 2, 256
E, I_MOE, I_SHARED = 8, 64, 64
N_K, N_V, DK, DV, KERNEL = 2, 4, 32, 32, 4
KEY_DIM, VALUE_DIM = N_K * DK, N_V * DV
T = "model.language_model."


@pytest.fixture(scope="module")
def qwen3_target(tmp_path_factory):
    return build_qwen3_dense(tmp_path_factory.mktemp("target") / "qwen3", seed=0)


def _shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def _tensors(path) -> dict[str, np.ndarray]:
    arrays = mx.load(str(path / "model.safetensors"))
    return {
        k: np.array(v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
        for k, v in arrays.items()
    }


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _gated_attention(prefix: str) -> dict:
    return {
        f"{prefix}self_attn.q_proj.weight": (2 * N_Q * HD, H),  # [query | gate] per head
        f"{prefix}self_attn.k_proj.weight": (N_KV * HD, H),
        f"{prefix}self_attn.v_proj.weight": (N_KV * HD, H),
        f"{prefix}self_attn.o_proj.weight": (H, N_Q * HD),
        f"{prefix}self_attn.q_norm.weight": (HD,),
        f"{prefix}self_attn.k_norm.weight": (HD,),
    }


def _moe(prefix: str, *, fused: bool) -> dict:
    p = f"{prefix}mlp."
    shapes = {
        f"{p}gate.weight": (E, H),
        f"{p}shared_expert.gate_proj.weight": (I_SHARED, H),
        f"{p}shared_expert.up_proj.weight": (I_SHARED, H),
        f"{p}shared_expert.down_proj.weight": (H, I_SHARED),
        f"{p}shared_expert_gate.weight": (1, H),
    }
    if fused:
        return shapes | {
            f"{p}experts.gate_up_proj": (E, 2 * I_MOE, H),
            f"{p}experts.down_proj": (E, H, I_MOE),
        }
    for e in range(E):
        shapes |= {
            f"{p}experts.{e}.gate_proj.weight": (I_MOE, H),
            f"{p}experts.{e}.up_proj.weight": (I_MOE, H),
            f"{p}experts.{e}.down_proj.weight": (H, I_MOE),
        }
    return shapes


def _gdn_tail(p: str) -> dict:
    return {
        f"{p}linear_attn.conv1d.weight": (2 * KEY_DIM + VALUE_DIM, 1, KERNEL),  # HF layout
        f"{p}linear_attn.dt_bias": (N_V,),
        f"{p}linear_attn.A_log": (N_V,),
        f"{p}linear_attn.norm.weight": (DV,),
        f"{p}linear_attn.out_proj.weight": (H, VALUE_DIM),
    }


def _hybrid_moe_shapes(prefix: str, *, fused_gdn: bool, trunk_fused: bool, mtp_fused: bool):
    shapes = {
        f"{prefix}embed_tokens.weight": (V, H),
        f"{prefix}norm.weight": (H,),
        "lm_head.weight": (V, H),
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
    }
    layers = [(f"{prefix}layers.{i}.", i == 3, trunk_fused) for i in range(4)]
    for p, full, fused in [*layers, ("mtp.layers.0.", True, mtp_fused)]:
        shapes |= {f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,)}
        shapes |= _moe(p, fused=fused)
        if full:
            shapes |= _gated_attention(p)
        elif fused_gdn:  # Qwen3-Next
            shapes |= {
                f"{p}linear_attn.in_proj_qkvz.weight": (2 * KEY_DIM + 2 * VALUE_DIM, H),
                f"{p}linear_attn.in_proj_ba.weight": (2 * N_V, H),
            } | _gdn_tail(p)
        else:  # Qwen3.5
            shapes |= {
                f"{p}linear_attn.in_proj_qkv.weight": (2 * KEY_DIM + VALUE_DIM, H),
                f"{p}linear_attn.in_proj_z.weight": (VALUE_DIM, H),
                f"{p}linear_attn.in_proj_b.weight": (N_V, H),
                f"{p}linear_attn.in_proj_a.weight": (N_V, H),
            } | _gdn_tail(p)
    return shapes


def _greedy(path, prompt: str = "def f(x): return x", steps: int = 4) -> list[int]:
    """A prefill and a few greedy steps in mlx-lm; every logit row finite and spread."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(str(path))
    cache = make_prompt_cache(model)
    tokens = mx.array([tokenizer.encode(prompt)])
    out = []
    for _ in range(steps):
        logits = np.array(model(tokens, cache=cache)[0, -1])
        assert np.isfinite(logits).all() and logits.std() > 1
        out.append(int(logits.argmax()))
        tokens = mx.array([[out[-1]]])
    return out


@pytest.mark.parametrize("mtp_experts", ["per_expert", "fused"])
def test_qwen35_moe_layout_and_mlx_lm_decode(tmp_path, mtp_experts):
    path = build_qwen35_moe(tmp_path, mtp_experts=mtp_experts)
    assert _shapes(path) == _hybrid_moe_shapes(
        T, fused_gdn=False, trunk_fused=True, mtp_fused=mtp_experts == "fused"
    )
    config = _config(path)
    assert config["model_type"] == "qwen3_5_moe"
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    tc = config["text_config"]
    assert tc["model_type"] == "qwen3_5_moe_text" and "intermediate_size" not in tc
    assert (tc["num_experts"], tc["num_experts_per_tok"]) == (E, 2)
    assert (tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]) == (I_MOE, I_SHARED)
    assert tc["mtp_num_hidden_layers"] == 1
    assert len(_greedy(path)) == 4


def test_qwen35_moe_per_expert_trunk_is_what_mlx_lm_cannot_load(tmp_path):
    from mlx_lm.utils import load_model

    path = build_qwen35_moe(tmp_path, experts="per_expert", tokenizer=False)
    assert f"{T}layers.0.mlp.experts.7.down_proj.weight" in _shapes(path)
    with pytest.raises(ValueError, match="experts.0"):
        load_model(path)


def test_qwen3_next_layout_and_mlx_lm_decode(tmp_path):
    path = build_qwen3_next(tmp_path)
    assert _shapes(path) == _hybrid_moe_shapes(
        "model.", fused_gdn=True, trunk_fused=False, mtp_fused=False
    )
    config = _config(path)
    assert config["model_type"] == "qwen3_next" and "text_config" not in config
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert (config["decoder_sparse_step"], config["mlp_only_layers"]) == (1, [])
    # Released configs declare no MTP layers; the head is found by its tensors.
    assert not set(config) & {"num_nextn_predict_layers", "mtp_num_hidden_layers"}
    assert len(_greedy(path)) == 4

    # mlx-lm's own split of the fused projections finds a (gain 0.5) and b
    # (gain 1) where the builder put them: rows of W, one per output unit.
    from mlx_lm.utils import load_model

    gdn = load_model(path)[0].model.layers[0].linear_attn
    w_qkvz, w_ba = gdn.in_proj_qkvz.weight, gdn.in_proj_ba.weight
    *_, b, a = gdn.fix_query_key_value_ordering(w_qkvz.T[None], w_ba.T[None])
    row_norms = [np.linalg.norm(np.array(x[0]), axis=0) for x in (b, a)]
    np.testing.assert_allclose(row_norms[0], 1.0, atol=0.25)
    np.testing.assert_allclose(row_norms[1], 0.5, atol=0.15)


def test_qwen3_next_mtp_declaration_keys(tmp_path):
    both = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
    config = _config(build_qwen3_next(tmp_path / "a", mtp_config_keys=both, tokenizer=False))
    assert [config[k] for k in both] == [1, 1]
    path = build_qwen3_next(tmp_path / "b", num_mtp_layers=0, tokenizer=False)
    assert not any(name.startswith("mtp.") for name in _shapes(path))
    with pytest.raises(ValueError, match="mtp_config_keys"):
        build_qwen3_next(tmp_path / "c", mtp_config_keys=("n_predict",))


def _draft_backbone(n_layers: int, n_context: int) -> dict:
    shapes = {"fc.weight": (H, n_context * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes |= {
            f"{p}self_attn.q_proj.weight": (N_Q * HD, H),
            f"{p}self_attn.k_proj.weight": (N_KV * HD, H),
            f"{p}self_attn.v_proj.weight": (N_KV * HD, H),
            f"{p}self_attn.o_proj.weight": (H, N_Q * HD),
            f"{p}self_attn.q_norm.weight": (HD,),
            f"{p}self_attn.k_norm.weight": (HD,),
            f"{p}mlp.gate_proj.weight": (FF, H),
            f"{p}mlp.up_proj.weight": (FF, H),
            f"{p}mlp.down_proj.weight": (H, FF),
            f"{p}input_layernorm.weight": (H,),
            f"{p}post_attention_layernorm.weight": (H,),
        }
    return shapes


def test_default_target_layer_ids_match_z_lab():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-4B/8B drafters
    assert default_target_layer_ids(4, 2) == [1, 2]  # widened for the tiny target
    assert default_target_layer_ids(4, 1) == [2]
    with pytest.raises(ValueError):
        default_target_layer_ids(4, 4)


def test_dflash_drafter_layout(tmp_path, qwen3_target):
    path = build_dflash_drafter(tmp_path, target=qwen3_target)
    assert _shapes(path) == _draft_backbone(2, 2)  # no embed_tokens, no lm_head
    target, config = _config(qwen3_target), _config(path)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert (
        (config["hidden_size"], config["vocab_size"])
        == (H, V)
        == (target["hidden_size"], target["vocab_size"])
    )
    assert config["num_hidden_layers"] == 2 and config["num_target_layers"] == 4
    assert config["block_size"] == 16
    assert config["dflash_config"] == {"mask_token_id": V - 4, "target_layer_ids": [1, 2]}
    # Plain x * w norms: stored near 1.
    assert abs(_tensors(path)["hidden_norm.weight"].mean() - 1) < 0.1
    # The target's tokenizer, byte for byte.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (path / name).read_bytes() == (qwen3_target / name).read_bytes()


def test_dspark_drafter_layout(tmp_path, qwen3_target):
    path = build_dspark_drafter(tmp_path, target=qwen3_target)
    r = 16
    assert _shapes(path) == _draft_backbone(2, 2) | {
        "embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
        "markov_head.markov_w1.weight": (V, r),
        "markov_head.markov_w2.weight": (V, r),
        "confidence_head.proj.weight": (1, H + r),
        "confidence_head.proj.bias": (1,),
    }
    config = _config(path)
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert {
        k: config[k]
        for k in (
            "block_size",
            "mask_token_id",
            "target_layer_ids",
            "num_target_layers",
            "markov_rank",
            "markov_head_type",
            "enable_confidence_head",
            "confidence_head_with_markov",
            "num_anchors",
            "tie_word_embeddings",
        )
    } == {
        "block_size": 7,
        "mask_token_id": V - 4,
        "target_layer_ids": [1, 2],
        "num_target_layers": 4,
        "markov_rank": r,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "num_anchors": 512,
        "tie_word_embeddings": False,
    }
    # Embedding and head are the target's, copied (DeepSpec freezes them).
    mine, theirs = _tensors(path), _tensors(qwen3_target)
    np.testing.assert_array_equal(mine["embed_tokens.weight"], theirs["model.embed_tokens.weight"])
    np.testing.assert_array_equal(mine["lm_head.weight"], theirs["lm_head.weight"])


def test_dspark_without_markov_head_is_deepspecs_dflash(tmp_path, qwen3_target):
    path = build_dspark_drafter(
        tmp_path,
        target=qwen3_target,
        markov_rank=0,
        confidence_head_with_markov=False,
        target_layer_ids=[-1, 3],
        tokenizer=False,
    )
    shapes = _shapes(path)
    assert not any(n.startswith("markov_head.") for n in shapes)
    assert shapes["confidence_head.proj.weight"] == (1, H)
    config = _config(path)
    assert "markov_head_type" not in config and config["target_layer_ids"] == [-1, 3]
    with pytest.raises(ValueError, match="strictly increasing"):
        build_dspark_drafter(tmp_path / "bad", target=qwen3_target, target_layer_ids=[2, 1])


def test_dspark_copies_a_tied_targets_embedding_as_its_head(tmp_path):
    target = build_qwen3_dense(tmp_path / "t", tie_word_embeddings=True, tokenizer=False)
    path = build_dspark_drafter(tmp_path / "d", target=target, tokenizer=False)
    t = _tensors(path)
    np.testing.assert_array_equal(t["lm_head.weight"], t["embed_tokens.weight"])


def test_drafters_refuse_non_qwen3_targets(tmp_path):
    target = build_qwen35_moe(tmp_path / "t", tokenizer=False)
    with pytest.raises(ValueError, match="Qwen3"):
        build_dflash_drafter(tmp_path / "d", target=target)


def test_dflash_drafter_for_a_hybrid_target_is_qwen3(tmp_path):
    target = build_qwen35_hybrid(tmp_path / "t", tokenizer=False)
    path = build_dflash_drafter(tmp_path / "d", target=target, tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    tc = json.loads((target / "config.json").read_text())["text_config"]
    assert cfg["model_type"] == "qwen3" and cfg["num_target_layers"] == tc["num_hidden_layers"]
    assert (cfg["hidden_size"], cfg["vocab_size"]) == (tc["hidden_size"], tc["vocab_size"])
    assert _tensors(path)["fc.weight"].shape == (tc["hidden_size"],
                                                 tc["hidden_size"] * len(cfg["dflash_config"]["target_layer_ids"]))


def _gemma_shapes(*, ordered: bool) -> dict:
    h, h_b, c = 64, 128, 64
    shapes = {
        "model.embed_tokens.weight": (V, h),
        "model.norm.weight": (h,),
        "pre_projection.weight": (h, 2 * h_b),
        "post_projection.weight": (h_b, h),
    }
    for i in range(4):
        p, hd = f"model.layers.{i}.", 64 if i == 3 else 32  # global_head_dim on the full layer
        shapes |= {
            f"{p}self_attn.q_proj.weight": (2 * hd, h),
            f"{p}self_attn.q_norm.weight": (hd,),
            f"{p}self_attn.o_proj.weight": (h, 2 * hd),
            f"{p}mlp.gate_proj.weight": (128, h),
            f"{p}mlp.up_proj.weight": (128, h),
            f"{p}mlp.down_proj.weight": (h, 128),
            f"{p}layer_scalar": (1,),
        } | {
            f"{p}{n}_layernorm.weight": (h,)
            for n in ("input", "post_attention", "pre_feedforward", "post_feedforward")
        }
    if ordered:
        shapes |= {
            "masked_embedding.centroids.weight": (c, h),
            "masked_embedding.token_ordering": (V,),
        }
    return shapes


def test_gemma4_assistant_layout(tmp_path):
    from transformers import AutoConfig

    path = build_gemma4_assistant(tmp_path / "a", target_hidden_size=128)
    assert _shapes(path) == _gemma_shapes(ordered=True)
    t = _tensors(path)
    ordering = t["masked_embedding.token_ordering"]
    assert ordering.dtype == np.int64 and sorted(ordering) == list(range(V))
    assert abs(t["model.norm.weight"].mean() - 1) < 0.1  # plain x * w
    config = _config(path)
    assert (config["model_type"], config["backbone_hidden_size"]) == ("gemma4_assistant", 128)
    assert config["tie_word_embeddings"] and config["use_ordered_embeddings"]
    assert (config["num_centroids"], config["centroid_intermediate_top_k"]) == (64, 8)
    tc = config["text_config"]
    assert tc["model_type"] == "gemma4_text" and tc["num_kv_shared_layers"] == 4
    assert tc["hidden_size_per_layer_input"] == 0
    # transformers parses it as the assistant's config and accepts the architecture.
    parsed = AutoConfig.from_pretrained(path)
    assert type(parsed).__name__ == "Gemma4AssistantConfig"
    parsed.validate_architecture()

    plain = build_gemma4_assistant(tmp_path / "b", use_ordered_embeddings=False, tokenizer=False)
    assert _shapes(plain) == _gemma_shapes(ordered=False)


BUILDERS = {
    "build_qwen35_hybrid": lambda d, seed, target: build_qwen35_hybrid(d, seed=seed),
    "build_qwen35_moe": lambda d, seed, target: build_qwen35_moe(d, seed=seed),
    "build_qwen3_dense": lambda d, seed, target: build_qwen3_dense(d, seed=seed),
    "build_qwen3_next": lambda d, seed, target: build_qwen3_next(d, seed=seed),
    "build_dflash_drafter": lambda d, seed, target: build_dflash_drafter(
        d, target=target, seed=seed
    ),
    "build_dspark_drafter": lambda d, seed, target: build_dspark_drafter(
        d, target=target, seed=seed
    ),
    "build_gemma4_assistant": lambda d, seed, target: build_gemma4_assistant(d, seed=seed),
    "build_gemma4": lambda d, seed, target: build_gemma4(d, seed=seed),
}


@pytest.mark.parametrize("variant", ["dense", "moe", "small"])
def test_gemma4_layout_and_mlx_lm_decode(tmp_path, variant):
    from mlx_lm.utils import load_model
    from transformers import AutoConfig

    path = build_gemma4(tmp_path / variant, variant=variant, tokenizer=False)
    config = _config(path)
    tc = config["text_config"]
    assert (config["model_type"], tc["model_type"]) == ("gemma4", "gemma4_text")
    assert type(AutoConfig.from_pretrained(path)).__name__ == "Gemma4Config"
    t = _tensors(path)
    p = "model.language_model.layers."
    full = tc["layer_types"].index("full_attention")
    assert t["model.language_model.layers.0.layer_scalar"].shape == (1,)
    assert abs(t[f"{p}0.input_layernorm.weight"].mean() - 1) < 0.1  # x * w, stored near 1
    # 26B/31B: keys serve as values on full layers (no v_proj there).
    assert (f"{p}{full}.self_attn.v_proj.weight" in t) == (variant != "moe")
    if variant == "moe":
        e, i, h = tc["num_experts"], tc["moe_intermediate_size"], tc["hidden_size"]
        assert t[f"{p}0.experts.gate_up_proj"].shape == (e, 2 * i, h)
        assert t[f"{p}0.experts.down_proj"].shape == (e, h, i)
    if variant == "small":  # E2B/E4B: per-layer inputs, KV-shared last layers
        assert "model.language_model.embed_tokens_per_layer.weight" in t
        last = tc["num_hidden_layers"] - 1
        assert f"{p}{last}.self_attn.k_proj.weight" in t  # stored, dropped by mlx-lm's sanitize
    model, _ = load_model(path)
    text = model.language_model.model
    shared = tc["num_hidden_layers"] - tc["num_kv_shared_layers"]
    assert len(model.make_cache()) == shared
    assert not hasattr(text.layers[-1].self_attn, "k_proj") or variant != "small"
    logits = model(mx.array([[1, 2, 3] * 12]))  # longer than the sliding window
    assert logits.shape == (1, 36, tc["vocab_size"]) and mx.isfinite(logits).all().item()


def test_gemma4_norm_shift_moves_norms_only(tmp_path):
    path = build_gemma4(tmp_path / "g", tokenizer=False)
    before = _tensors(path)
    after = _tensors(apply_gemma4_norm_shift(path))
    for name, w in before.items():
        moved = name.endswith("norm.weight") or name.endswith("layernorm.weight")
        assert np.allclose(after[name], w - 1 if moved else w), name
    with pytest.raises(ValueError, match="not a Gemma-4"):
        apply_gemma4_norm_shift(build_qwen3_dense(tmp_path / "q", tokenizer=False))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_same_seed_same_bytes(tmp_path, qwen3_target, name):
    build = BUILDERS[name]
    first, again = (build(tmp_path / d, 0, qwen3_target) for d in ("a", "b"))
    files = sorted(p.name for p in first.iterdir())
    assert {
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    } <= set(files)
    assert files == sorted(p.name for p in again.iterdir())
    for f in files:
        assert (first / f).read_bytes() == (again / f).read_bytes(), f
    other = build(tmp_path / "c", 1, qwen3_target)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_layout_confirmed_covers_every_builder():
    assert drafters.LAYOUT_CONFIRMED is tiny.LAYOUT_CONFIRMED
    assert set(tiny.LAYOUT_CONFIRMED) == set(BUILDERS)
    assert tiny.LAYOUT_CONFIRMED["build_dspark_drafter"] is False
    assert set(tiny.UNCONFIRMED) <= set(BUILDERS)


@pytest.mark.parametrize("build", [build_qwen35_hybrid, build_qwen35_moe, build_qwen3_next])
def test_double_norm_shift_moves_zero_centred_norms_only(tmp_path, build):
    path = build(tmp_path, dtype="bfloat16", tokenizer=False)
    before = _tensors(path)
    apply_double_norm_shift(path)
    after = _tensors(path)
    assert set(after) == set(before)
    prefix = T if "text_config" in _config(path) else "model."
    shifted = [
        f"{prefix}norm.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_hidden.weight",
        f"{prefix}layers.3.self_attn.k_norm.weight",
        "mtp.layers.0.input_layernorm.weight",
    ]
    for name in shifted:  # now near 1: "already converted"
        np.testing.assert_allclose(after[name], before[name] + 1, atol=1e-2)
    # The gated GDN norm stores its scale, and conv1d keeps HF's [C, 1, K].
    for name in (
        "layers.0.linear_attn.norm.weight",
        "layers.0.linear_attn.conv1d.weight",
        "layers.0.mlp.shared_expert_gate.weight",
    ):
        if prefix + name in before:
            np.testing.assert_array_equal(after[prefix + name], before[prefix + name])
    assert after[f"{prefix}layers.0.linear_attn.conv1d.weight"].shape[1:] == (1, KERNEL)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(after)


def test_double_shift_is_shifted_again_by_mlx_lm(tmp_path):
    from mlx_lm.utils import load_model

    path = apply_double_norm_shift(build_qwen35_hybrid(tmp_path, tokenizer=False))
    norm = np.array(load_model(path)[0].language_model.model.norm.weight)
    assert abs(norm.mean() - 2) < 0.1  # the trap: scale ~2 instead of ~1
    with pytest.raises(ValueError, match="zero-centred"):
        apply_double_norm_shift(build_qwen3_dense(tmp_path / "dense", tokenizer=False))


@pytest.mark.parametrize("build", [build_qwen35_hybrid, build_qwen35_moe, build_qwen3_next])
def test_strip_mtp_keeps_the_config_declaring_them(tmp_path, build):
    kwargs = {"mtp_config_keys": ("num_nextn_predict_layers",)} if build is build_qwen3_next else {}
    path = build(tmp_path, tokenizer=False, **kwargs)
    config_before = (path / "config.json").read_bytes()
    before = _tensors(path)
    strip_mtp(path)
    after = _tensors(path)
    assert after.keys() == {n for n in before if not n.startswith("mtp.")} != before.keys()
    for name, value in after.items():
        np.testing.assert_array_equal(value, before[name])
    assert (path / "config.json").read_bytes() == config_before
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(after)
