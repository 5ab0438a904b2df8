"""bench/verify_attention_kernel.py on the CPU: the reference path, the kernels' arithmetic
(emulated), and the guard's verdicts on attention kernels."""

from __future__ import annotations

import json
import logging
import math

import mlx.core as mx
import pytest

from bench import verify_attention_kernel as A
from specgate.kernels.guard import TOLERANCE, Candidate, Guard, row_error

DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def qkv(hq, hkv, length, m, d, dtype, seed=0):
    ks = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, hq, m, d), key=ks[0]).astype(dtype)
    k = mx.random.normal((1, hkv, length, d), key=ks[1]).astype(dtype)
    v = mx.random.normal((1, hkv, length, d), key=ks[2]).astype(dtype)
    return q, k, v, 1.0 / math.sqrt(d)


def make_guard(tmp_path, candidates, **kw):
    kw.setdefault("reps", 3)
    kw.setdefault("inner", 2)
    return A.make_guard(candidates=candidates, cache_dir=tmp_path, machine="test-machine", **kw)


def test_reference_is_stock_sdpa_with_the_causal_tail_mask():
    """Row i of the last M sees keys 0..L-M+i: mask="causal" is bottom-right aligned."""
    for dtype in DTYPES:
        for hq, hkv, length, m, d in ((8, 2, 50, 4, 64), (4, 4, 33, 16, 128), (6, 3, 17, 2, 64)):
            q, k, v, scale = qkv(hq, hkv, length, m, d, dtype)
            mask = A.causal_tail_mask(m, length)
            assert mask.shape == (m, length)
            assert mask[0, length - m].item() and not mask[0, length - m + 1].item()
            assert mask[m - 1].all().item()
            want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
            assert mx.allclose(A.reference_attention(q, k, v, scale), want, atol=1e-6, rtol=0)
            assert mx.allclose(A.verify_attention(q, k, v, scale), want, atol=1e-6, rtol=0)
            # and the explicit float mask of -inf above the tail: the same
            fmask = mx.where(mask, 0.0, -math.inf).astype(dtype)
            alt = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=fmask)
            assert mx.allclose(alt, want, atol=1e-2 if dtype != mx.float32 else 1e-6, rtol=0)


SHAPES = [  # (Hq, Hkv, L, M, D): plain and GQA, L ragged vs the 32-key tile,
    (4, 4, 97, 16, 128),  # several tiles a split (Hkv 8, L 2500), rows that see
    (8, 2, 300, 5, 64),  # nothing of the last split (L 33, M 16)
    (32, 8, 1000, 16, 128),
    (16, 8, 2500, 3, 64),
    (32, 8, 2500, 8, 128),
    (8, 8, 33, 16, 64),
    (12, 4, 64, 2, 128),
    (2, 1, 40, 9, 64),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "Hq{}-Hkv{}-L{}-M{}-D{}".format(*s))
def test_kernel_arithmetic_emulated(shape):
    """The kernels' tiling, splits, row mapping, masking, base-2 online softmax
    and combine (emulate_attention) against the exact answer (stock, float32)."""
    hq, hkv, length, m, d = shape
    for dtype in DTYPES:
        q, k, v, scale = qkv(hq, hkv, length, m, d, dtype, seed=length + m)
        assert A.supports(m, hq, hkv, length, d, dtype)
        y = A.emulate_attention(q, k, v, scale)
        assert y.shape == (1, hq, m, d) and y.dtype == dtype
        exact = A.ATTENTION.exact(q, k, v, scale)
        assert row_error(y, exact) <= TOLERANCE[str(dtype).split(".")[-1]], (shape, dtype)


def test_emulation_covers_multi_tile_splits_and_dead_splits():
    s, tps = A.launch_config(2500, 8)
    assert tps >= 2 and s * tps * A.TK >= 2500 > (s - 1) * tps * A.TK
    s, tps = A.launch_config(33, 8)
    assert (s, tps) == (2, 1)  # the last split holds key 32 only: rows 0..14 of 16 see none of it
    for length in (1, 31, 32, 33, 1000, 32768):
        for hkv in (1, 2, 8, 32):
            s, tps = A.launch_config(length, hkv)
            ntiles = -(-length // A.TK)
            assert s * tps >= ntiles > (s - 1) * tps and s * hkv <= max(A.TARGET_BLOCKS, hkv) + hkv


@pytest.mark.parametrize("m", range(2, 17))
def test_every_width_emulated(m):
    q, k, v, scale = qkv(8, 2, 130, m, 64, mx.float16, seed=m)
    exact = A.ATTENTION.exact(q, k, v, scale)
    assert row_error(A.emulate_attention(q, k, v, scale), exact) <= TOLERANCE["float16"]


def test_emulation_catches_indexing_slips():
    """The emulated check is sharp: one key too many under the causal tail, or
    query head h reading KV head h % Hkv instead of h // G, fail it."""
    q, k, v, scale = qkv(8, 2, 200, 4, 64, mx.float32)
    exact = A.ATTENTION.exact(q, k, v, scale)
    assert row_error(A.emulate_attention(q, k, v, scale), exact) <= TOLERANCE["float32"]
    assert row_error(A.emulate_attention(q, k, v, scale, _mask_shift=1), exact) > 1e-2
    assert row_error(A.emulate_attention(q, k, v, scale, _mask_shift=-1), exact) > 1e-2
    assert row_error(A.emulate_attention(q, k, v, scale, _gqa_slip=True), exact) > 1e-1


def test_supports_and_layout():
    assert A.supports(2, 32, 8, 32768, 128, mx.bfloat16)
    assert A.supports(16, 32, 8, 32768, 128, mx.float16)
    assert A.supports(16, 32, 8, 1024, 128, mx.float32)
    assert not A.supports(1, 32, 8, 1024, 128, mx.bfloat16)  # M = 1: stock
    assert not A.supports(17, 32, 8, 1024, 128, mx.bfloat16)
    assert not A.supports(4, 32, 8, 1024, 96, mx.bfloat16)  # D
    assert not A.supports(4, 30, 8, 1024, 128, mx.bfloat16)  # Hq not a multiple of Hkv
    assert not A.supports(16, 64, 4, 1024, 128, mx.bfloat16)  # 256 rows a KV head
    assert not A.supports(8, 8, 8, 4, 64, mx.bfloat16)  # L < M
    assert not A.supports(16, 64, 8, 1024, 128, mx.float32)  # 128 fp32 rows: > 48 KiB shared
    for m in range(2, 17):
        for g in (1, 2, 4, 8):
            rpw, w = A.rows_per_warp(g * m)
            assert 1 <= w <= 8 and rpw * w >= g * m > rpw * (w - 1) and rpw <= 16
    assert A.metal_supports(16, 32, 8, 1024, 128, mx.float16)
    assert not A.metal_supports(16, 64, 8, 1024, 128, mx.float16)  # > 32 KiB threadgroup memory


def test_guard_records_real_kernels_failed_here_and_falls_back(tmp_path, caplog):
    guard = make_guard(tmp_path, A.default_candidates())
    q, k, v, scale = qkv(8, 2, 100, 4, 64, mx.float16)
    with caplog.at_level(logging.INFO, logger="specgate.kernels"):
        y = A.verify_attention(q, k, v, scale, guard=guard)
        A.verify_attention(q * 2, k, v, scale, guard=guard)  # known shape: no new check
    assert mx.array_equal(y, A.reference_attention(q, k, v, scale))
    assert guard.checks_run == 2 and guard.path == tmp_path / "test-machine" / "attention.json"
    vs = guard.verdicts()
    assert sorted(vs) == sorted(f"{n}@{ver}|M4|Hq8|Hkv2|L100|D64|float16" for n, ver in (
        ("cuda_attention", A.CUDA_VERSION), ("metal_attention", A.METAL_VERSION)))  # fmt: skip
    assert [v.status for v in vs.values()] == ["failed"] * 2
    assert any("No CUDA" in v.detail for v in vs.values())
    assert any("No Metal" in v.detail for v in vs.values())
    lines = [r.getMessage() for r in caplog.records if r.name == "specgate.kernels"]
    assert len(lines) == 2 and all("stock scaled_dot_product_attention instead" in s for s in lines)
    # neither backend exists on this CPU: expected, so not a warning
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "specgate.kernels")
    saved = json.loads(guard.path.read_text())["verdicts"]
    one = next(iter(saved.values()))
    assert one["shape"] == [4, 8, 2, 100, 64] and one["bits"] is None
    # M = 1 is not theirs: no verdict, no check
    q1 = q[:, :, :1]
    assert mx.array_equal(A.verify_attention(q1, k, v, scale, guard=guard),
                          A.reference_attention(q1, k, v, scale)) and guard.checks_run == 2  # fmt: skip


def test_guard_refuses_wrong_attention_and_enables_the_emulated_kernel(tmp_path):
    def one_key_too_many(q, k, v, scale):
        return A.emulate_attention(q, k, v, scale, _mask_shift=1)

    def gqa_slip(q, k, v, scale):
        return A.emulate_attention(q, k, v, scale, _gqa_slip=True)

    def emulated(q, k, v, scale):
        return A.emulate_attention(q, k, v, scale)

    cands = [Candidate(f.__name__, "1", f, A.supports) for f in (one_key_too_many, gqa_slip)]
    guard = make_guard(tmp_path, cands, margin=float("inf"))
    shape = (4, 8, 2, 130, 64)
    for dtype in DTYPES:
        for c in cands:
            v = guard.verdict(c, *shape, dtype)
            assert v.status == "wrong" and v.max_error > v.bound, (c.name, dtype, v)
    q, k, v, scale = qkv(8, 2, 130, 4, 64, mx.bfloat16)
    assert guard.kernel_for(q, k, v, scale) is None
    good = Candidate("emulated", "1", emulated, A.supports)
    ok = make_guard(tmp_path, [good], margin=float("inf"))
    for dtype in DTYPES:
        verdict = ok.verdict(good, *shape, dtype)
        assert verdict.ok and verdict.max_error <= verdict.bound and verdict.reference_error is not None
    assert ok.kernel_for(q, k, v, scale) is emulated
    assert Guard(cache_dir=tmp_path, machine="test-machine").path.name == "qmm.json"  # QMM untouched
