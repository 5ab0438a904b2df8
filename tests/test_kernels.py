"""specgate/kernels/qmm.py, qmm_mma.py, guard.py, hook.py on the CPU: reference paths,
the CUDA kernels' arithmetic (emulated / simulated lane by lane), and the
guard's refusals and choices."""

from __future__ import annotations

import json
import logging
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import qwen3

from specgate.kernels import hook, qmm, qmm_mma
from specgate.kernels.guard import (
    FUSED_QMM,
    TIMING,
    TOLERANCE,
    Candidate,
    Guard,
    cuda_candidate,
    metal_candidate,
    row_error,
)

DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def quantized(n, k, dtype, bits, gs, seed=0):
    w = mx.random.normal((n, k), key=mx.random.key(seed)).astype(dtype)
    return mx.quantize(w, group_size=gs, bits=bits)


def exact(x, wq, s, b, gs, bits):
    f = mx.float32
    return qmm.reference_qmm(x.astype(f), wq, s.astype(f), b.astype(f), gs, bits)


def make_guard(tmp_path, candidates, **kw):
    kw.setdefault("reps", 3)
    kw.setdefault("inner", 2)
    return Guard(candidates, cache_dir=tmp_path, machine="test-machine", **kw)


def test_reference_is_stock_quantized_matmul():
    for bits in qmm.BITS:
        for gs in qmm.GROUP_SIZES:
            for dtype in DTYPES:
                wq, s, b = quantized(48, 256, dtype, bits, gs)
                x = mx.random.normal((1, 3, 256)).astype(dtype)
                want = mx.quantized_matmul(x, wq, scales=s, biases=b, transpose=True,
                                           group_size=gs, bits=bits)  # fmt: skip
                assert mx.array_equal(qmm.reference_qmm(x, wq, s, b, gs, bits), want)
                assert mx.array_equal(qmm.verify_qmm(x, wq, s, b, gs, bits), want)  # no guard


def test_packing_order_is_mlx_dequantize():
    """Value j of a word sits at bits [bits*j, bits*(j+1)), low first (what the kernels assume)."""
    for bits in qmm.BITS:
        wq, s, b = quantized(8, 128, mx.float32, bits, 32)
        words = np.array(wq)
        per = 32 // bits
        q = np.stack([(words >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], -1)
        q = q.reshape(8, 128).astype(np.float32)
        deq = q.reshape(8, 4, 32) * np.array(s)[..., None] + np.array(b)[..., None]
        np.testing.assert_allclose(deq.reshape(8, 128),
                                   np.array(mx.dequantize(wq, s, b, group_size=32, bits=bits)),
                                   rtol=1e-6, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("bits", qmm.BITS)
@pytest.mark.parametrize("gs", qmm.GROUP_SIZES)
def test_cuda_kernel_arithmetic_emulated(bits, gs):
    """The CUDA kernel's tiling, word/shift/scale indexing and summation order
    (emulate_qmm) against the exact product: ragged N (not a multiple of 32),
    K whose chunks split unevenly over the warps, leading batch dims, M 2..16."""
    for dtype in DTYPES:
        for m, k, n in ((2, 128, 33), (5, 640, 97), (16, 1024, 64), (7, 256, 8)):
            wq, s, b = quantized(n, k, dtype, bits, gs, seed=m)
            x = mx.random.normal((1, m, k), key=mx.random.key(k)).astype(dtype)
            y = qmm.emulate_qmm(x, wq, s, b, gs, bits)
            assert y.shape == (1, m, n) and y.dtype == dtype
            bound = TOLERANCE[str(dtype).split(".")[-1]]
            assert row_error(y, exact(x, wq, s, b, gs, bits)) <= bound


def test_emulation_catches_an_indexing_slip():
    """The emulated check is sharp: off-by-one-group scales fail it."""
    wq, s, b = quantized(40, 256, mx.float32, 4, 32)
    x = mx.random.normal((4, 256))
    s2 = mx.concatenate([s[:, 1:], s[:, :1]], axis=1)
    assert row_error(qmm.emulate_qmm(x, wq, s2, b, 32, 4), exact(x, wq, s, b, 32, 4)) > 1e-2


def test_supports_and_launch_config():
    assert qmm.supports(2, 4096, 12288, mx.bfloat16, 4, 64)
    assert not qmm.supports(1, 4096, 12288, mx.bfloat16, 4, 64)  # M = 1: stock
    assert not qmm.supports(17, 4096, 12288, mx.bfloat16, 4, 64)
    assert not qmm.supports(4, 4000, 12288, mx.bfloat16, 4, 64)  # K not a multiple of 64
    assert not qmm.supports(4, 4096, 12288, mx.bfloat16, 3, 64)
    for m in range(2, 17):
        w, cpl = qmm.launch_config(m, 4096, 12288)
        assert 1 <= w <= 8 and w * m * qmm.KC * 4 <= 48 * 1024 and cpl in (1, 2)
        w, _ = qmm.launch_config(m, 4096, 4096, max_shared=32 * 1024)
        assert w * m * qmm.KC * 4 <= 32 * 1024


def _shape(m=4, k=256, n=64, dtype=mx.float32, bits=4, gs=64):
    return m, k, n, dtype, bits, gs


def test_guard_refuses_wrong_kernels(tmp_path):
    def off_a_little(x, wq, s, b, gs, bits):
        y = qmm.reference_qmm(x, wq, s, b, gs, bits)
        return y + 0.05 * mx.abs(y).max() * (mx.arange(y.shape[-1]) == 3)

    def rows_swapped(x, wq, s, b, gs, bits):
        y = qmm.reference_qmm(x, wq, s, b, gs, bits)
        return mx.concatenate([y[1:2], y[0:1], y[2:]], axis=0)

    def nan_row(x, wq, s, b, gs, bits):
        y = qmm.reference_qmm(x, wq, s, b, gs, bits)
        return mx.where(mx.arange(y.shape[0])[:, None] == 1, mx.nan, y)

    cands = [Candidate(f.__name__, "1", f) for f in (off_a_little, rows_swapped, nan_row)]
    guard = make_guard(tmp_path, cands, margin=float("inf"))
    for dtype in DTYPES:
        for c in cands:
            v = guard.verdict(c, *_shape(dtype=dtype))
            assert v.status == "wrong" and v.max_error > v.bound, (c.name, dtype, v)
    x = mx.random.normal((4, 256))
    wq, s, b = quantized(64, 256, mx.float32, 4, 64)
    assert guard.kernel_for(x, wq, s, b, 64, 4) is None
    assert mx.array_equal(qmm.verify_qmm(x, wq, s, b, 64, 4, guard=guard),
                          qmm.reference_qmm(x, wq, s, b, 64, 4))  # fmt: skip
    saved = json.loads(guard.path.read_text())["verdicts"]
    assert guard.path == tmp_path / "test-machine" / "qmm.json"  # under the cache_dir given
    assert sorted({v["status"] for v in saved.values()}) == ["wrong"] and len(saved) == 9
    one = saved["off_a_little@1|M4|K256|N64|bfloat16|b4|g64"]
    assert one["bound"] == TOLERANCE["bfloat16"] and one["max_error"] > one["bound"]


def test_guard_failed_kernel_falls_back(tmp_path, caplog):
    calls = []

    def broken(*a):
        calls.append(1)
        raise RuntimeError("nvrtc: error: identifier 'bogus' is undefined\nmore")

    guard = make_guard(tmp_path, [Candidate("broken", "1", broken), cuda_candidate(),
                                  metal_candidate()])  # fmt: skip
    x = mx.random.normal((1, 4, 256))
    wq, s, b = quantized(64, 256, mx.float32, 4, 64)
    with caplog.at_level(logging.INFO, logger="specgate.kernels"):
        y = qmm.verify_qmm(x, wq, s, b, 64, 4, guard=guard)
        qmm.verify_qmm(x * 2, wq, s, b, 64, 4, guard=guard)  # known shape: no new check, no log
    assert mx.array_equal(y, qmm.reference_qmm(x, wq, s, b, 64, 4))
    assert len(calls) == 1
    vs = guard.verdicts()
    assert [v.status for v in vs.values()] == ["failed"] * 3
    assert "identifier 'bogus'" in vs["broken@1|M4|K256|N64|float32|b4|g64"].detail
    # on this CPU-only machine neither backend exists: both real kernels failed to build
    assert any("No CUDA" in v.detail for v in vs.values())
    assert any("No Metal" in v.detail for v in vs.values())
    lines = [r for r in caplog.records if r.name == "specgate.kernels"]
    assert all("stock quantized_matmul instead" in r.message for r in lines)
    # The broken build is a warning; the backends this CPU lacks are said at info.
    assert [r.levelno for r in lines] == [logging.WARNING, logging.INFO, logging.INFO]


def test_guard_refuses_a_correct_but_slower_kernel(tmp_path):
    def slow(x, wq, s, b, gs, bits):
        time.sleep(0.003)
        return qmm.reference_qmm(x, wq, s, b, gs, bits)

    guard = make_guard(tmp_path, [Candidate("slow", "1", slow)])
    v = guard.verdict(guard.candidates[0], *_shape())
    assert v.status == "slower" and v.max_error == 0.0
    assert v.kernel_us > v.reference_us > 0


def test_guard_enables_a_correct_faster_kernel_and_reads_verdicts_back(tmp_path):
    calls = []

    def good(x, wq, s, b, gs, bits):
        calls.append(x.shape)
        return qmm.emulate_qmm(x, wq, s, b, gs, bits)

    cand = Candidate("good", "1", good)
    guard = make_guard(tmp_path, [cand], margin=float("inf"))  # correct is enough here
    v = guard.verdict(cand, *_shape(dtype=mx.bfloat16))
    assert v.ok and v.max_error <= v.bound and guard.checks_run == 1
    n_calls = len(calls)
    again = make_guard(tmp_path, [cand], margin=float("inf"))  # a later process
    x = mx.random.normal((4, 256)).astype(mx.bfloat16)
    wq, s, b = quantized(64, 256, mx.bfloat16, 4, 64)
    assert again.kernel_for(x, wq, s, b, 64, 4) is good
    assert again.checks_run == 0 and len(calls) == n_calls  # read back, not re-proved
    changed = Candidate("good", "2", good)  # new kernel code: proved again
    assert make_guard(tmp_path, [changed], margin=float("inf")).verdict(changed, *_shape(
        dtype=mx.bfloat16)).ok and len(calls) > n_calls  # fmt: skip
    # shapes it is not written for get no verdict and no check
    assert guard.verdict(cand, *_shape(m=1)) is None and guard.verdict(cand, *_shape(m=17)) is None
    # verdicts timed by another method (an older specgate) are proved again
    raw = json.loads(guard.path.read_text())
    assert raw["timing"] == TIMING
    guard.path.write_text(json.dumps(raw | {"timing": "independent calls"}))
    later = make_guard(tmp_path, [cand], margin=float("inf"))
    assert later.verdict(cand, *_shape(dtype=mx.bfloat16)).ok and later.checks_run == 1


def test_guard_times_a_chain_of_dependent_calls(tmp_path):
    """Each timed call's x waits on the previous call's output, as in a
    forward (independent calls would overlap on a GPU)."""
    seen = []

    def spy(x, wq, s, b, gs, bits):
        seen.append(x)
        return qmm.reference_qmm(x, wq, s, b, gs, bits)

    cand = Candidate("spy", "1", spy)
    guard = make_guard(tmp_path, [cand], margin=float("inf"), reps=1, inner=3)
    args = guard.op.inputs(0, *_shape(dtype=mx.float32))
    guard._time(spy, args)
    x0 = args[0]
    firsts = [x for x in seen if x is x0]
    chained = [x for x in seen if x is not x0]
    assert firsts and chained  # one fresh start per timed run, then inputs built from outputs
    assert all(not mx.array_equal(x, x0).item() for x in chained)


@pytest.mark.parametrize(
    ("m", "k", "n", "dtype", "bits", "gs", "w", "nt"),
    [(3, 256, 20, mx.bfloat16, 4, 64, None, None), (1, 256, 16, mx.float16, 4, 32, 2, 2),
     (9, 512, 24, mx.bfloat16, 8, 128, 2, 1), (16, 128, 8, mx.float16, 8, 32, None, None),
     (8, 384, 40, mx.bfloat16, 4, 128, 3, 2), (5, 256, 16, mx.bfloat16, 8, 64, None, None)],
)  # fmt: skip
def test_tensor_core_kernel_simulated_lane_by_lane(m, k, n, dtype, bits, gs, w, nt):
    """Loads, masks, x permutation, fragment layout, split-K (w warps, some
    with no K block when w does not divide it), ragged N and 16-row tiles."""
    wq, s, b = quantized(n, k, dtype, bits, gs, seed=m + n)
    x = mx.random.normal((1, m, k), key=mx.random.key(k + m)).astype(dtype)
    y = qmm_mma.simulate_qmm(x, wq, s, b, gs, bits, w=w, nt=nt)
    assert y.shape == (1, m, n) and y.dtype == dtype
    err = row_error(y, exact(x, wq, s, b, gs, bits))
    assert err <= TOLERANCE[str(dtype).rsplit(".", 1)[-1]] / 2, err


def test_tensor_core_simulation_catches_a_pairing_slip(monkeypatch):
    """x pairs that do not match the weight pairs the mask takes out: wrong."""
    good = qmm_mma._mma_plan

    def swapped(bits):
        return [(wd, p2, p0, sh) for wd, p0, p2, sh in good(bits)]

    monkeypatch.setattr(qmm_mma, "_mma_plan", swapped)
    wq, s, b = quantized(16, 256, mx.bfloat16, 4, 64)
    x = mx.random.normal((3, 256)).astype(mx.bfloat16)
    assert row_error(qmm_mma.simulate_qmm(x, wq, s, b, 64, 4), exact(x, wq, s, b, 64, 4)) > 0.1


def test_tensor_core_supports_launch_and_compact_source():
    assert qmm_mma.supports(1, 4096, 1024, mx.bfloat16, 4, 64)
    assert not qmm_mma.supports(4, 4096, 1024, mx.float32, 4, 64)  # tensor cores: 16-bit x
    assert not qmm_mma.supports(4, 4160, 1024, mx.bfloat16, 4, 64)  # K not a multiple of 128
    assert qmm_mma.supports(4, 4160, 1024, mx.bfloat16, 8, 64)  # 8-bit: multiples of 64
    assert not qmm_mma.supports(17, 4096, 1024, mx.float16, 4, 64)
    for m, k, n in ((4, 4096, 1024), (8, 4096, 12288), (2, 12288, 4096), (16, 4096, 151936)):
        w, nt = qmm_mma.launch_config(m, k, n, 4)
        assert 1 <= w <= 8 and nt in (2, 4) and k // qmm_mma.k_block(4) >= w
        assert w * nt * 128 * 4 <= 48 * 1024  # the split-K buffer fits static shared memory
    src = qmm_mma.compact(qmm_mma._HEADER)
    assert "//" not in src and "mma16816<BF>" in src and len(src) < len(qmm_mma._HEADER)
    assert all(line == line.strip() for line in src.splitlines())


def test_guard_picks_the_fastest_proven_kernel(tmp_path):
    def sleepy(delay):
        def fn(x, wq, s, b, gs, bits):
            time.sleep(delay)
            return qmm.reference_qmm(x, wq, s, b, gs, bits)

        return fn

    slow, fast = sleepy(0.004), sleepy(0.0)
    cands = [Candidate("slow", "1", slow), Candidate("fast", "1", fast)]
    guard = make_guard(tmp_path, cands, margin=float("inf"))
    x = mx.random.normal((4, 256)).astype(mx.float32)
    wq, s, b = quantized(64, 256, mx.float32, 4, 64)
    assert guard.kernel_for(x, wq, s, b, 64, 4) is fast  # listed second, chosen for its time


def tiny_qwen3(bits=4, gs=64, vocab=512):
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=256, num_attention_heads=4, rms_norm_eps=1e-6,
                           vocab_size=vocab, num_key_value_heads=2, max_position_embeddings=512,
                           head_dim=32, tie_word_embeddings=False, rope_theta=10000.0)  # fmt: skip
    mx.random.seed(3)
    model = qwen3.Model(args)
    nn.quantize(model, group_size=gs, bits=bits)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("bits", qmm.BITS)
def test_hook_routes_quantized_linears_and_output_is_unchanged(tmp_path, bits):
    seen = []

    def wrapping(x, wq, s, b, gs, bits):
        seen.append(x.shape)
        return qmm.reference_qmm(x, wq, s, b, gs, bits)

    model = tiny_qwen3(bits)
    tokens = mx.array([[5, 9, 200, 7, 31, 4]])
    stock = model(tokens)
    guard = make_guard(tmp_path, [Candidate("wrap", "1", wrapping)], margin=float("inf"))
    assert hook.install(model, guard) == 2 * 7 + 1  # q k v o gate up down per layer + lm_head
    assert mx.array_equal(model(tokens), stock) and not seen  # off unless asked
    with hook.kernels():
        out = model(tokens)
        one = model(tokens[:, :1])  # M = 1: the stock path
    assert mx.array_equal(out, stock) and mx.array_equal(one, stock[:, :1])
    routed = [s for s in seen if s[-2] == 6]
    assert len(routed) >= 15 and all(s[-2] != 1 for s in seen)
    shapes = {(v.shape[1], v.shape[2]) for v in guard.verdicts().values()}
    assert shapes == {(128, 128), (128, 64), (128, 256), (256, 128), (128, 512)}
    hook.uninstall(model)
    assert all(type(m) is not hook._KernelQuantizedLinear for _, m in model.named_modules())


def test_a_wide_linear_goes_through_the_kernel_at_one_row_too(tmp_path):
    """An lm_head over a vocabulary (hook.WIDE_N wide or more) is proved and
    routed at one row as well (the MTP head's drafts); narrower linears'
    one-row products stay stock."""
    from specgate.kernels import wiring

    seen = []

    def wrapping(x, wq, s, b, gs, bits):
        seen.append((x.size // x.shape[-1], wq.shape[0]))
        return qmm.reference_qmm(x, wq, s, b, gs, bits)

    model = tiny_qwen3(vocab=hook.WIDE_N)
    tokens = mx.array([[5, 9, 200]])
    stock = model(tokens[:, :1])
    one_up = Candidate("wrap", "1", wrapping, lambda m, *_: 1 <= m <= qmm.MAX_M)  # (as qmm_mma's)
    guard = make_guard(tmp_path, [one_up], margin=float("inf"))
    wired = wiring.prepare(model, "auto", range(2, 4), guard=guard)
    assert wired.enabled
    ones = {tuple(v.shape) for v in guard.verdicts().values() if v.shape[0] == 1}
    assert ones == {(1, 128, hook.WIDE_N)}  # proved at load, the lm_head's alone
    seen.clear()
    assert mx.array_equal(model(tokens[:, :1]), stock) and not seen  # off unless asked
    with hook.kernels():
        one = model(tokens[:, :1])
    assert mx.array_equal(one, stock)
    assert seen == [(1, hook.WIDE_N)]  # the lm_head only; one-row q/k/v ... stay stock


def test_hook_uses_stock_path_where_guard_refused(tmp_path):
    def wrong(x, wq, s, b, gs, bits):
        return qmm.reference_qmm(x, wq, s, b, gs, bits) * 1.5

    model = tiny_qwen3()
    tokens = mx.array([[1, 2, 3, 4]])
    stock = model(tokens)
    hook.install(model, make_guard(tmp_path, [Candidate("wrong", "1", wrong)]))
    with hook.kernels():
        assert mx.array_equal(model(tokens), stock)
        with hook.kernels(False):
            assert not hook.enabled()
        assert hook.enabled()
    assert not hook.enabled()


def per_part_reference(x, *args):
    """A 'fused kernel' that is the stock op per part (routing is under test here)."""
    gs, bits = args[-2:]
    return [qmm.reference_qmm(x, *args[i : i + 3], gs, bits) for i in range(0, len(args) - 2, 3)]


def test_fused_op_guard_proves_and_refuses(tmp_path):
    shape = (4, 256, (64, 32, 32), mx.float32, 4, 64)
    good = Candidate("fused", "1", per_part_reference, lambda *s: True)  # float32 on a CPU

    def swapped(x, *args):  # k and v outputs exchanged: same shapes, wrong answer
        y = per_part_reference(x, *args)
        return [y[0], y[2], y[1]]

    bad = Candidate("swapped", "1", swapped, lambda *s: True)
    guard = make_guard(tmp_path, [good, bad], op=FUSED_QMM, margin=float("inf"))
    assert guard.verdict(good, *shape).ok
    assert guard.verdict(bad, *shape).status == "wrong"
    assert guard.path.name == "qmm_fused.json"
    key = next(k for k in json.loads(guard.path.read_text())["verdicts"] if k.startswith("fused@"))
    assert "|N64+32+32|" in key
    assert qmm_mma.supports_fused(4, 4096, (4096, 1024, 1024), mx.bfloat16, 4, 64)
    assert not qmm_mma.supports_fused(4, 4096, (4096,), mx.bfloat16, 4, 64)


def test_hook_fuses_sibling_linears_and_output_is_unchanged(tmp_path):
    singles, fused = [], []

    def single(x, wq, s, b, gs, bits):
        singles.append(wq.shape[0])
        return qmm.reference_qmm(x, wq, s, b, gs, bits)

    def group(x, *args):
        fused.append(tuple(a.shape[0] for a in args[:-2:3]))
        return per_part_reference(x, *args)

    model = tiny_qwen3()
    assert sorted(len(g) for g in hook.fuse_groups(model)) == [2, 2, 3, 3]  # q/k/v, gate/up a layer
    tokens = mx.array([[5, 9, 200, 7, 31, 4]])
    stock = model(tokens)
    guard = make_guard(tmp_path, [Candidate("single", "1", single)], margin=float("inf"))
    fguard = make_guard(tmp_path, [Candidate("group", "1", group, lambda *s: True)],
                        op=FUSED_QMM, margin=float("inf"))  # fmt: skip
    hook.install(model, guard, fguard)
    with hook.kernels():
        assert mx.array_equal(model(tokens), stock)  # proves each shape (many calls)
        fused.clear(), singles.clear()
        assert mx.array_equal(model(tokens), stock)
    # each layer: one launch for q/k/v (128+64+64), one for gate/up; o, down and lm_head alone
    assert fused == [(128, 64, 64), (256, 256)] * 2
    assert sorted(singles) == [128] * 4 + [512]  # o_proj and down_proj a layer, lm_head
    # a sibling called with another x than its group's first computes alone
    attn = model.model.layers[0].self_attn
    x = mx.random.normal((1, 3, 128))
    with hook.kernels():
        q, k_other = attn.q_proj(x), attn.k_proj(x + 1)
    assert mx.array_equal(k_other, nn.QuantizedLinear.__call__(attn.k_proj, x + 1))
    assert "_specgate_pending" not in attn.k_proj.__dict__ or attn.k_proj.__dict__["_specgate_pending"] is None
    assert mx.array_equal(q, nn.QuantizedLinear.__call__(attn.q_proj, x))
    hook.uninstall(model)
    assert all("_specgate_group" not in m.__dict__ for _, m in model.named_modules())


def test_prepare_proves_fused_groups_at_every_width(tmp_path):
    from specgate.kernels import wiring

    model = tiny_qwen3()
    guard = make_guard(tmp_path, [Candidate("single", "1", qmm.reference_qmm)], margin=float("inf"))
    fguard = make_guard(tmp_path, [Candidate("group", "1", per_part_reference, lambda *s: True)],
                        op=FUSED_QMM, margin=float("inf"))  # fmt: skip
    wired = wiring.prepare(model, "auto", range(2, 4), guard=guard, fused_guard=fguard)
    assert sorted(g[:2] for g in wired.groups) == [(128, (128, 64, 64)), (128, (256, 256))]
    assert "fused in one launch: 4 of 4 (group, width) pairs" in wired.reason
    assert fguard.checks_run == 4 and wired.fused_guard is fguard
    rows = [wiring.describe(v) for v in wired.fused_verdicts()]
    assert len(rows) == 4 and any("N=128+64+64" in r for r in rows)
    hook.uninstall(model)
    # given only a per-linear guard, nothing is fused
    assert wiring.prepare(model, "auto", range(2, 4), guard=guard).groups == []
    hook.uninstall(model)
    # a fused kernel written for none of this model's groups is not used for
    # it, and stays a candidate of the (shared) guard for the next model
    narrow = make_guard(tmp_path, [Candidate("group", "1", per_part_reference, lambda *s: False)],
                        op=FUSED_QMM, margin=float("inf"))  # fmt: skip
    wired = wiring.prepare(model, "auto", range(2, 4), guard=guard, fused_guard=narrow)
    assert wired.groups == [] and wired.fused_guard is None and len(narrow.candidates) == 1
