"""The MTP head built from a checkpoint's own mtp.* tensors, for every family.

Each family's tiny checkpoint is in its published layout; the head must hold
exactly the mtp.* tensors after the documented transforms (zero-centred
norms +1 where mlx-lm shifts the trunk's, experts stacked as SwitchGLU
wants), nothing of the trunk, and compute the published forward.
"""

from __future__ import annotations

import json
import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from specgate.builders.tiny import (
    build_qwen3_next,
    build_qwen35_hybrid,
    build_qwen35_moe,
    strip_mtp,
)
from specgate.engines.checkpoints.reader import read_checkpoint
from specgate.engines.drafting.mtp.head import MTPHead
from specgate.engines.drafting.mtp.loading import load_mtp_head
from specgate.engines.loading import load_mlx_model

TOKENS = mx.array([[3, 17, 250, 9, 1200, 41, 77, 5, 640, 2]])
NUM_EXPERTS = 8
# Every zero-centred norm a Qwen MTP head holds (the GDN gated norm is not one).
ZERO_CENTRED = (
    "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight",
)  # fmt: skip

BUILDERS = {
    "qwen3_5": lambda d: build_qwen35_hybrid(d, seed=1),
    "qwen3_5_moe": lambda d: build_qwen35_moe(d, seed=2, mtp_experts="per_expert"),
    "qwen3_5_moe_fused": lambda d: build_qwen35_moe(d, seed=3, mtp_experts="fused"),
    "qwen3_next": lambda d: build_qwen3_next(d, seed=4),
    "qwen3_next_declared": lambda d: build_qwen3_next(
        d, seed=5, mtp_config_keys=("num_nextn_predict_layers",)
    ),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_head")
    out = {}
    for name, build in BUILDERS.items():
        path = build(root / name)
        loaded = load_mlx_model(str(path))
        out[name] = (path, loaded, load_mtp_head(loaded))
    return out


def raw_tensors(path) -> dict[str, np.ndarray]:
    arrays = mx.load(str(path / "model.safetensors"))
    return {k: np.array(v.astype(mx.float32)) for k, v in arrays.items()}


def trunk_parts(model: nn.Module):
    """(inner model, embedding, lm_head) of a Qwen3.5 or Qwen3-Next mlx-lm model."""
    text = model.language_model if hasattr(model, "language_model") else model
    return text.model, text.model.embed_tokens, text.lm_head


def expected_head_tensor(key: str, raw: dict, loaded) -> np.ndarray:
    """What head parameter `key` must hold, derived from the raw HF tensors."""
    if ".switch_mlp." in key:
        block, proj = key.split(".switch_mlp.")
        n = proj.removesuffix(".weight")
        if f"mtp.{block}.experts.0.{n}.weight" in raw:  # per expert: stacked in order
            return np.stack([raw[f"mtp.{block}.experts.{e}.{n}.weight"] for e in range(NUM_EXPERTS)])
        # Fused: exactly what mlx-lm's own qwen3_5_moe sanitize makes of the
        # trunk's fused experts, fed the MTP tensors under a trunk layer's name.
        j = block.split(".")[1]
        trunk = f"model.language_model.layers.{j}.mlp.experts."
        fed = {trunk + n2: mx.array(raw[f"mtp.{block}.experts.{n2}"]) for n2 in ("gate_up_proj", "down_proj")}
        sanitized = loaded.model.sanitize(fed)
        return np.array(sanitized[f"language_model.model.layers.{j}.mlp.switch_mlp.{proj}"])
    value = raw[f"mtp.{key}"]
    return value + 1.0 if key.endswith(ZERO_CENTRED) else value


@pytest.mark.parametrize("name", list(BUILDERS))
def test_head_holds_the_checkpoint_tensors(built, name):
    path, loaded, head = built[name]
    raw = raw_tensors(path)
    params = dict(tree_flatten(head.parameters()))
    assert "layers.0.self_attn.q_proj.weight" in params
    for key, value in params.items():
        want = expected_head_tensor(key, raw, loaded)
        np.testing.assert_array_equal(np.array(value), want, err_msg=key)
    if "moe" in name or "next" in name:
        assert "layers.0.mlp.switch_mlp.gate_proj.weight" in params
        assert params["layers.0.mlp.switch_mlp.gate_proj.weight"].shape[0] == NUM_EXPERTS


@pytest.mark.parametrize("name", list(BUILDERS))
def test_head_holds_nothing_of_the_trunk(built, name):
    path, loaded, head = built[name]
    _, embed, lm_head = trunk_parts(loaded.model)
    vocab = loaded.vocab_size
    params = dict(tree_flatten(head.parameters()))
    for key, value in params.items():
        assert vocab not in value.shape, key  # no embedding, no lm_head, no copy of either
        for trunk_w in (embed.weight, lm_head.weight):
            assert value is not trunk_w
    modules = [m for _, m in head.named_modules()]
    assert all(m is not embed and m is not lm_head for m in modules)
    # Byte for byte: the head is the mtp.* tensors, all of them, and nothing else.
    info = read_checkpoint(path)
    assert info.mtp.nbytes > 0
    assert sum(v.nbytes for v in params.values()) == info.mtp.nbytes


@pytest.mark.parametrize("name", list(BUILDERS))
def test_forward_through_trunk_lm_head(built, name):
    _, loaded, head = built[name]
    inner, embed, lm_head = trunk_parts(loaded.model)
    # Both families' inner model ends with the final norm: its output is the
    # post-norm hidden state the head reads, and lm_head of it is the logits.
    hidden = inner(TOKENS)
    np.testing.assert_allclose(np.array(lm_head(hidden)), np.array(loaded.model(TOKENS)), atol=1e-5)
    out = head(embed(TOKENS[:, 1:]), hidden[:, :-1])
    logits = lm_head(out)
    assert logits.shape == (1, TOKENS.shape[1] - 1, loaded.vocab_size)
    assert mx.isfinite(logits).all().item()
    # With a cache, one position at a time, the head computes the same.
    cache = head.make_cache()
    e, h = embed(TOKENS[:, 1:]), hidden[:, :-1]
    steps = [head(e[:, i : i + 1], h[:, i : i + 1], cache) for i in range(e.shape[1])]
    np.testing.assert_allclose(np.array(mx.concatenate(steps, 1)), np.array(out), atol=1e-4)


# ---------------------------------------------------------------- numpy reference


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, dims, base):
    """mlx nn.RoPE(dims, traditional=False) over positions 0..L-1 of x (heads, L, hd)."""
    half = dims // 2
    pos = np.arange(x.shape[-2])[:, None]
    angle = pos * base ** (-np.arange(0, dims, 2) / dims)[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :half], x[..., half:dims]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., dims:]], -1)


def reference_qwen35_mtp(raw, tc, emb, hid, *, concat_hidden_first=False):
    """The published Qwen3.5 MTP forward in numpy, from the raw HF tensors.

    Returns (fc input, mtp out). Norms are zero-centred: scale 1 + w.
    """
    w = {k[4:]: v for k, v in raw.items() if k.startswith("mtp.")}
    e = _rms(emb, 1 + w["pre_fc_norm_embedding.weight"])
    h = _rms(hid, 1 + w["pre_fc_norm_hidden.weight"])
    fc_in = np.concatenate([h, e] if concat_hidden_first else [e, h], -1)
    x = fc_in @ w["fc.weight"].T

    p = "layers.0."
    nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    L = x.shape[0]
    a_in = _rms(x, 1 + w[p + "input_layernorm.weight"])
    qg = (a_in @ w[p + "self_attn.q_proj.weight"].T).reshape(L, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(L, nh * hd)  # per head [query | gate]
    k = (a_in @ w[p + "self_attn.k_proj.weight"].T).reshape(L, nkv, hd)
    v = (a_in @ w[p + "self_attn.v_proj.weight"].T).reshape(L, nkv, hd)
    q = _rms(q, 1 + w[p + "self_attn.q_norm.weight"]).transpose(1, 0, 2)
    k = _rms(k, 1 + w[p + "self_attn.k_norm.weight"]).transpose(1, 0, 2)
    v = v.transpose(1, 0, 2)
    rot = int(hd * tc["partial_rotary_factor"])
    theta = tc["rope_parameters"]["rope_theta"]
    q, k = _rope(q, rot, theta), _rope(k, rot, theta)
    k, v = np.repeat(k, nh // nkv, 0), np.repeat(v, nh // nkv, 0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((L, L), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = (probs @ v).transpose(1, 0, 2).reshape(L, nh * hd)
    x = x + (attn / (1 + np.exp(-gate))) @ w[p + "self_attn.o_proj.weight"].T

    m_in = _rms(x, 1 + w[p + "post_attention_layernorm.weight"])
    g, u = m_in @ w[p + "mlp.gate_proj.weight"].T, m_in @ w[p + "mlp.up_proj.weight"].T
    x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    return fc_in, _rms(x, 1 + w["norm.weight"])


def test_dense_head_matches_a_numpy_reference(built):
    path, loaded, head = built["qwen3_5"]
    raw = raw_tensors(path)
    tc = loaded.text_config
    inner, embed, _ = trunk_parts(loaded.model)
    emb, hid = embed(TOKENS[:, 1:]), inner(TOKENS)[:, :-1]
    e_np, h_np = np.array(emb[0]), np.array(hid[0])

    fc_in, out = reference_qwen35_mtp(raw, tc, e_np, h_np)
    np.testing.assert_allclose(np.array(head.fc_input(emb, hid)[0]), fc_in, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(head(emb, hid)[0]), out, rtol=1e-3, atol=1e-4)
    # The check can tell the published order from the reversed one.
    wrong_in, wrong_out = reference_qwen35_mtp(raw, tc, e_np, h_np, concat_hidden_first=True)
    assert not np.allclose(np.array(head.fc_input(emb, hid)[0]), wrong_in, atol=1e-2)
    assert not np.allclose(np.array(head(emb, hid)[0]), wrong_out, atol=1e-2)


# ---------------------------------------------------------------- traps and quantization


@pytest.mark.parametrize(
    ("builder", "message"),
    [
        (lambda d: build_qwen35_hybrid(d, seed=6),
         r"config declares 1 MTP layers \(mtp_num_hidden_layers\) but the weights hold no mtp\.\* tensors"),
        (lambda d: build_qwen3_next(d, seed=7),
         r"the weights hold no mtp\.\* tensors and the config declares no MTP layers"),
    ],
)  # fmt: skip
def test_stripped_mtp_raises_a_clear_error(tmp_path, builder, message):
    path = strip_mtp(builder(tmp_path / "stripped"))
    loaded = load_mlx_model(str(path))  # mlx-lm itself loads it: it drops mtp.* anyway
    with pytest.raises(ValueError, match=message):
        load_mtp_head(loaded)


def test_shape_mismatch_raises(tmp_path):
    path = build_qwen35_hybrid(tmp_path / "bad", seed=8)
    arrays = mx.load(str(path / "model.safetensors"))
    arrays["mtp.fc.weight"] = arrays["mtp.fc.weight"][:, :64]
    mx.save_safetensors(str(path / "model.safetensors"), arrays, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"shapes do not match.*mtp\.fc\.weight"):
        load_mtp_head(load_mlx_model(str(path)))


def test_qwen35_factory_builds_the_same_head(built):
    _, loaded, head = built["qwen3_5"]
    direct = MTPHead.qwen35(loaded.model.language_model.args, 1)
    shapes = {k: v.shape for k, v in tree_flatten(direct.parameters())}
    assert shapes == {k: v.shape for k, v in tree_flatten(head.parameters())}


def _quantized_sidecar(head: MTPHead, bits: int = 4, group_size: int = 64) -> dict[str, mx.array]:
    """The head's tensors (mlx layout: norms already shifted) with every
    Linear/SwitchLinear quantized; routers at 8 bits, as mlx-lm quantizes them."""
    modules = dict(head.named_modules())
    out = {}
    for key, value in tree_flatten(head.parameters()):
        module = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and hasattr(modules[module], "to_quantized"):
            b = 8 if module.endswith(("mlp.gate", "shared_expert_gate")) else bits
            w, s, z = mx.quantize(value, group_size=group_size, bits=b)
            out |= {f"mtp.{key}": w, f"mtp.{module}.scales": s, f"mtp.{module}.biases": z}
        else:
            out[f"mtp.{key}"] = value
    return out


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_quantized_head_loads_quantized(built, tmp_path, caplog, name):
    from mlx_lm import convert

    src, float_loaded, float_head = built[name]
    dest = tmp_path / "q4"
    convert(str(src), mlx_path=str(dest), quantize=True, q_group_size=64, q_bits=4)
    config = json.loads((dest / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert not read_checkpoint(dest).mtp.tensor_names  # mlx-lm's converter wrote no mtp.*

    # Trunk quantized, head not: the head loads unquantized and says so. (An
    # unprefixed sidecar, as some conversions write it.)
    plain = {k: v for k, v in tree_flatten(float_head.parameters())}
    mx.save_safetensors(str(dest / "mtp.safetensors"), plain)
    with caplog.at_level(logging.INFO, logger="specgate.engines.drafting.mtp.loading"):
        head = load_mtp_head(load_mlx_model(str(dest)))
    assert "MTP tensors are not: loading the head unquantized" in caplog.text
    assert type(head.fc) is nn.Linear
    for (k, a), (_, b) in zip(tree_flatten(head.parameters()), tree_flatten(float_head.parameters()), strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=k)  # no second shift

    # Head quantized too: it loads as QuantizedLinear / QuantizedSwitchLinear.
    sidecar = _quantized_sidecar(float_head)
    mx.save_safetensors(str(dest / "mtp.safetensors"), sidecar)
    q_dest = tmp_path / "q4-mtp"
    dest.rename(q_dest)  # a fresh path: load_mlx_model memoises by path
    q_loaded = load_mlx_model(str(q_dest))
    q_head = load_mtp_head(q_loaded)
    layer = q_head.layers[0]
    assert isinstance(q_head.fc, nn.QuantizedLinear) and q_head.fc.bits == 4
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear)
    if name == "qwen3_5_moe":
        assert isinstance(layer.mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
        assert layer.mlp.gate.bits == 8 and layer.mlp.switch_mlp.down_proj.bits == 4
    else:
        assert isinstance(layer.mlp.down_proj, nn.QuantizedLinear)
    params = dict(tree_flatten(q_head.parameters()))
    assert set(params) == {k[4:] for k in sidecar}
    assert sum(v.nbytes for v in params.values()) == read_checkpoint(q_dest).mtp.nbytes

    inner, embed, lm_head = trunk_parts(float_loaded.model)
    emb, hid = embed(TOKENS[:, 1:]), inner(TOKENS)[:, :-1]
    got = q_head(emb, hid)
    # Exactly the stored values: a float head holding the dequantized tensors agrees.
    dequantized = load_mtp_head(float_loaded)
    dequantized.load_weights([(k, _dequantize(sidecar, k)) for k in plain])
    np.testing.assert_allclose(np.array(got), np.array(dequantized(emb, hid)), rtol=1e-3, atol=1e-3)
    # And close to the float head (4 bits on a random tiny head; MoE routes can flip).
    ref = float_head(emb, hid)
    rel = (mx.linalg.norm(got - ref) / mx.linalg.norm(ref)).item()
    assert rel < 0.3, rel  # measured: 0.15 dense, 0.19 MoE
    agree = (lm_head(got).argmax(-1) == lm_head(ref).argmax(-1)).mean().item()
    assert agree >= 0.5, agree  # measured: 7/9 dense, 6/9 MoE


def _dequantize(sidecar: dict[str, mx.array], key: str) -> mx.array:
    module = key.rsplit(".", 1)[0]
    if f"mtp.{module}.scales" not in sidecar:
        return sidecar[f"mtp.{key}"]
    w, s = sidecar[f"mtp.{key}"], sidecar[f"mtp.{module}.scales"]
    b = sidecar[f"mtp.{module}.biases"]
    bits = w.shape[-1] * 32 // (s.shape[-1] * 64)
    return mx.dequantize(w, s, b, group_size=64, bits=bits)
