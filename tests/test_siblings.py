"""A layer's q/k/v and gate/up decode in one launch each (kernels/hook.fuse_siblings):
the same numbers, the same memory, and the other paths untouched."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import qwen3
from mlx_lm.models.cache import make_prompt_cache

from specgate.engines.memory import parameter_bytes
from specgate.kernels import hook, qmm
from specgate.kernels.guard import Candidate, Guard


def model() -> nn.Module:
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=256, num_hidden_layers=2,
                           intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, rms_norm_eps=1e-6, vocab_size=1024,
                           max_position_embeddings=4096, rope_theta=1e6,
                           tie_word_embeddings=False)  # fmt: skip
    mx.random.seed(3)
    m = qwen3.Model(args)
    nn.quantize(m, group_size=64, bits=4)
    mx.eval(m.parameters())
    return m


def decode(m: nn.Module, verify: bool = False) -> list[mx.array]:
    """Logits of a prefill, six one-row steps and (verify) a 4-row forward
    through the kernels."""
    cache = make_prompt_cache(m)
    out = [m(mx.array([[5, 9, 2, 77, 300, 12, 8]]), cache=cache)]
    y = mx.array([[3]])
    for _ in range(6):
        out.append(m(y, cache=cache))
        y = mx.argmax(out[-1][:, -1:], axis=-1)
    if verify:
        with hook.kernels():
            out.append(m(mx.array([[4, 40, 400, 1000]]), cache=cache))
    mx.eval(out)
    return out


def test_fused_siblings_decode_the_same_numbers_in_the_same_memory():
    m = model()
    before, size = decode(m), parameter_bytes(m)
    assert hook.fuse_siblings(m) == 4  # q/k/v and gate/up of two layers
    assert hook.fuse_siblings(m) == 0  # once
    after = decode(m)
    assert all(mx.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert parameter_bytes(m) == size  # the members' weights are slices of the joined ones
    attn = m.model.layers[0].self_attn
    assert "_specgate_siblings" in attn.q_proj.__dict__
    assert attn.k_proj["weight"].shape == (128, 256 * 4 // 32)


def test_a_member_called_out_of_order_computes_its_own_output():
    m = model()
    attn = m.model.layers[1].self_attn
    x = mx.random.normal((1, 1, 256))
    want = [attn.k_proj(x), attn.q_proj(x), attn.v_proj(x)]
    hook.fuse_siblings(m)
    got = [attn.k_proj(x), attn.q_proj(x), attn.v_proj(x)]  # k before the group's first
    assert all(mx.array_equal(a, b) for a, b in zip(want, got, strict=True))
    # k's output left waiting by q (for x) is not taken for another input
    y = mx.random.normal((1, 1, 256))
    assert mx.array_equal(attn.k_proj(y), nn.QuantizedLinear.__call__(attn.k_proj, y))


@pytest.mark.parametrize("fused_first", [True, False])
def test_verify_kernels_route_the_sliced_weights_as_before(tmp_path, fused_first):
    rows = []

    def kernel(x, wq, s, b, gs, bits):  # a correct kernel that notes its calls
        rows.append(x.size // x.shape[-1])
        return qmm.reference_qmm(x, wq, s, b, gs, bits)

    plain = model()
    hook.install(plain, Guard([Candidate("count", "1", kernel)], cache_dir=tmp_path / "a",
                              machine="t", reps=2, inner=1, margin=float("inf")))  # fmt: skip
    want = decode(plain, verify=True)
    rows.clear()
    m = model()
    guard = Guard([Candidate("count", "1", kernel)], cache_dir=tmp_path / "b", machine="t", reps=2,
                  inner=1, margin=float("inf"))  # fmt: skip
    if fused_first:
        hook.fuse_siblings(m)
        hook.install(m, guard)
    else:
        hook.install(m, guard)
        hook.fuse_siblings(m)
    got = decode(m, verify=True)
    assert all(mx.allclose(a, b, atol=1e-5) for a, b in zip(want, got, strict=True))
    assert rows and set(rows) == {4}  # the kernel took the 4-row verify only
    hook.uninstall(m)  # the hook goes; the joined siblings stay
    assert "_specgate_siblings" in m.model.layers[0].self_attn.q_proj.__dict__
    assert all(mx.array_equal(a, b) for a, b in zip(want[:-1], decode(m)[:7], strict=True))


def test_a_quantized_mtp_head_drafts_the_same_joined():
    """The MTP engine joins its head's siblings too (its chained drafts are
    one-row steps): the same outputs, step for step."""
    from mlx_lm.models.cache import KVCache

    from specgate.engines.drafting.mtp.head import MTPHead

    m = model()
    mx.random.seed(5)
    head = MTPHead(256, 1e-6, [qwen3.TransformerBlock(m.args)])
    nn.quantize(head, group_size=64, bits=4)
    mx.eval(head.parameters())

    def chain():
        cache, outs = [KVCache()], []
        o = head(mx.random.normal((1, 3, 256), key=mx.random.key(1)),
                 mx.random.normal((1, 3, 256), key=mx.random.key(2)), cache)[:, -1:]
        for j in range(4):
            o = head(mx.random.normal((1, 1, 256), key=mx.random.key(3 + j)), o, cache, step=j + 1)
            outs.append(o)
        mx.eval(outs)
        return outs

    before = chain()
    assert hook.fuse_siblings(head) == 2
    assert all(mx.array_equal(a, b) for a, b in zip(before, chain(), strict=True))
