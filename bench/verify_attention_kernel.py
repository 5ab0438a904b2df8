"""Multi-row decode attention for verify forwards: each KV tile read once for all rows.

A verify forward attends M = 2..16 new query rows (the drafted tokens plus
one) over the whole KV cache. The rows are the LAST M positions of the
sequence: with L keys (cache plus the new rows), row i sees keys
0..L-M+i (causal among the new rows; MLX's mask="causal" is aligned
bottom-right in exactly this way). Shapes: q (1, Hq, M, D), k and v
(1, Hkv, L, D), Hq a multiple of Hkv (GQA: query head h reads KV head
h // (Hq / Hkv)), D in {64, 128}, float16 / bfloat16 / float32.

The kernels (flash-decoding style, two launches):

- partial: a block (threadgroup) owns one KV head and one split of the keys
  (TPS tiles of TK = 32 keys), and all R = G * M rows that read that head
  (G = Hq / Hkv query heads x M rows), spread over W <= 8 warps, RPW rows a
  warp. Per tile the block loads K and V (32 x D each, 16-byte loads, zero
  past the split) into shared memory ONCE; each warp then computes its rows'
  scores with one key per lane (q pre-scaled by scale * log2(e) in float32,
  read as float4 broadcasts), masks (past L, causal tail), does the online
  softmax in base 2 (tile max and sum by warp shuffles, running max m, sum l,
  accumulators rescaled by 2^(m_old - m_new)), stages the probabilities in
  shared memory and accumulates P @ V with D / 32 contiguous output values
  a lane. Everything in float32. Writes acc (Hq*M, S, D) and (m, l)
  (Hq*M, S, 2) per split;
- combine: one block per row, one thread per output value: weights
  2^(m_s - max m) (0 for a split the row saw nothing of), adds the splits in
  order, divides by the weighted l, rounds once to the output dtype.

`reference_attention` is the stock path and every kernel's reference;
`emulate_attention` runs the kernels' exact tiling, split boundaries, row
mapping, masking, base-2 online softmax and combine in MLX ops (float32) on
any device, so the indexing is tested on a CPU. `cuda_attention` and
`metal_attention` are the kernels; neither is used unless kernels/guard.py
proved it on the machine it runs on (the Metal one has never run where it
was written). `verify_attention` dispatches through a guard.
"""

from __future__ import annotations

import hashlib
import math

import mlx.core as mx

from specgate.kernels.guard import Candidate, Op, dtype_name

TK = 32  # keys a tile
MIN_M, MAX_M = 2, 16
HEAD_DIMS = (64, 128)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_ROWS = 128  # G * M rows a KV head, at most 8 warps x 16 rows
LOG2E = 1.4426950408889634
TARGET_BLOCKS = 264  # about two blocks per SM on an H200 (132 SMs)


def causal_tail_mask(m: int, length: int) -> mx.array:
    """(M, L) bool: row i (position L-M+i) sees keys 0..L-M+i."""
    return mx.arange(length)[None, :] <= (length - m + mx.arange(m))[:, None]


def reference_attention(q, k, v, scale: float):
    """The stock path: MLX's fused attention with the causal-tail mask
    (mask="causal" is bottom-right aligned, i.e. exactly causal_tail_mask)."""
    mask = "causal" if q.shape[2] > 1 else None
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _itemsize(dtype) -> int:
    return 4 if dtype == mx.float32 else 2


def rows_per_warp(rows: int) -> tuple[int, int]:
    """(RPW rows a warp, W warps) for R rows a KV head: at most 8 warps."""
    rpw = max(1, -(-rows // 8))
    return rpw, -(-rows // rpw)


def shared_bytes(m: int, g: int, d: int, dtype) -> int:
    """Static shared memory of the partial kernel: padded K tile, V tile, P."""
    s = _itemsize(dtype)
    rpw, w = rows_per_warp(g * m)
    return TK * (d + 16 // s) * s + TK * d * s + w * rpw * TK * 4


def supports(m: int, hq: int, hkv: int, length: int, d: int, dtype, *,
             max_shared: int = 48 * 1024) -> bool:  # fmt: skip
    """Shapes the kernels are written for (anything else takes the reference)."""
    if not (MIN_M <= m <= MAX_M and d in HEAD_DIMS and dtype in DTYPES and hkv >= 1
            and hq % hkv == 0 and length >= m):  # fmt: skip
        return False
    g = hq // hkv
    return g * m <= MAX_ROWS and shared_bytes(m, g, d, dtype) <= max_shared


def metal_supports(m, hq, hkv, length, d, dtype) -> bool:
    return supports(m, hq, hkv, length, d, dtype, max_shared=32 * 1024)


def launch_config(length: int, hkv: int) -> tuple[int, int]:
    """(S splits, TPS tiles a split): about TARGET_BLOCKS blocks over the KV
    heads, every split a whole number of tiles, none empty."""
    ntiles = -(-length // TK)
    s = max(1, min(ntiles, -(-TARGET_BLOCKS // hkv)))
    tps = -(-ntiles // s)
    return -(-ntiles // tps), tps


# ---------------------------------------------------------------- CUDA -----

_CUDA_PARTIAL = r"""
    // T: k / v dtype; M rows a query head; G query heads a KV head; D head dim;
    // RPW rows a warp; W warps. params = [TPS tiles a split, S splits].
    constexpr int TK = 32;
    constexpr int R = G * M;
    const float NEG_INF = __int_as_float(0xff800000);
    constexpr int DPL = D / 32;              // output values a lane owns
    constexpr int VE = 16 / sizeof(T);       // elements a 16-byte load
    constexpr int KP = D + VE;               // padded K row (16 bytes): no bank conflicts
    constexpr int VPR = D / VE;
    __shared__ __align__(16) T ks[TK * KP];
    __shared__ __align__(16) T vs[TK * D];
    __shared__ __align__(16) float ps[W * RPW * TK];

    const int L = k_shape[1];
    const int TPS = params[0];
    const int S = params[1];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int split = blockIdx.x;
    const int kvh = blockIdx.y;
    const int key0 = split * TPS * TK;
    const int key1 = min(key0 + TPS * TK, L);
    const T* kh = k + (size_t)kvh * L * D;
    const T* vh = v + (size_t)kvh * L * D;

    const float* qr[RPW];
    float mrow[RPW], lrow[RPW], o[RPW][DPL];
    #pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int r = min(warp * RPW + i, R - 1);   // rows past R compute, never write
        qr[i] = qf + ((size_t)kvh * R + r) * D;     // (h * M + m) = kvh * R + r
        mrow[i] = NEG_INF;
        lrow[i] = 0.0f;
        #pragma unroll
        for (int j = 0; j < DPL; ++j) o[i][j] = 0.0f;
    }

    for (int t0 = key0; t0 < key1; t0 += TK) {
        __syncthreads();   // the previous tile is consumed
        for (int i = threadIdx.x; i < TK * VPR; i += W * 32) {
            const int t = i / VPR;
            const int c = (i % VPR) * VE;
            uint4 a = make_uint4(0u, 0u, 0u, 0u);
            uint4 b = a;
            if (t0 + t < key1) {
                a = *reinterpret_cast<const uint4*>(kh + (size_t)(t0 + t) * D + c);
                b = *reinterpret_cast<const uint4*>(vh + (size_t)(t0 + t) * D + c);
            }
            *reinterpret_cast<uint4*>(ks + t * KP + c) = a;
            *reinterpret_cast<uint4*>(vs + t * D + c) = b;
        }
        __syncthreads();

        // scores: key t0 + lane against this warp's rows
        float s[RPW];
        #pragma unroll
        for (int i = 0; i < RPW; ++i) s[i] = 0.0f;
        const T* kr = ks + lane * KP;
        #pragma unroll 2
        for (int d0 = 0; d0 < D; d0 += VE) {
            const uint4 raw = *reinterpret_cast<const uint4*>(kr + d0);
            const T* kt = reinterpret_cast<const T*>(&raw);
            float kf[VE];
            #pragma unroll
            for (int j = 0; j < VE; ++j) kf[j] = static_cast<float>(kt[j]);
            #pragma unroll
            for (int i = 0; i < RPW; ++i) {
                float a = s[i];
                #pragma unroll
                for (int j = 0; j < VE; j += 4) {
                    const float4 q4 = __ldg(reinterpret_cast<const float4*>(qr[i] + d0 + j));
                    a = fmaf(q4.x, kf[j], a);
                    a = fmaf(q4.y, kf[j + 1], a);
                    a = fmaf(q4.z, kf[j + 2], a);
                    a = fmaf(q4.w, kf[j + 3], a);
                }
                s[i] = a;
            }
        }

        // online softmax (base 2) per row
        const int key = t0 + lane;
        #pragma unroll
        for (int i = 0; i < RPW; ++i) {
            const int m = (warp * RPW + i) % M;
            const float sc = (key < key1 && key <= L - M + m) ? s[i] : NEG_INF;
            float tmax = sc;
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
            const float mnew = fmaxf(mrow[i], tmax);
            float p = 0.0f, alpha = 1.0f;
            if (mnew != NEG_INF) {
                p = exp2f(sc - mnew);
                alpha = exp2f(mrow[i] - mnew);
            }
            float psum = p;
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                psum += __shfl_xor_sync(0xffffffffu, psum, off);
            lrow[i] = lrow[i] * alpha + psum;
            mrow[i] = mnew;
            #pragma unroll
            for (int j = 0; j < DPL; ++j) o[i][j] *= alpha;
            ps[(warp * RPW + i) * TK + lane] = p;
        }
        __syncwarp();

        // o += P @ V: this lane's D / 32 contiguous values
        #pragma unroll 2
        for (int t = 0; t < TK; t += 4) {
            float vf[4][DPL];
            #pragma unroll
            for (int tt = 0; tt < 4; ++tt)
                #pragma unroll
                for (int j = 0; j < DPL; ++j)
                    vf[tt][j] = static_cast<float>(vs[(t + tt) * D + lane * DPL + j]);
            #pragma unroll
            for (int i = 0; i < RPW; ++i) {
                const float4 p4 = *reinterpret_cast<const float4*>(ps + (warp * RPW + i) * TK + t);
                #pragma unroll
                for (int j = 0; j < DPL; ++j) {
                    float a = o[i][j];
                    a = fmaf(p4.x, vf[0][j], a);
                    a = fmaf(p4.y, vf[1][j], a);
                    a = fmaf(p4.z, vf[2][j], a);
                    a = fmaf(p4.w, vf[3][j], a);
                    o[i][j] = a;
                }
            }
        }
        __syncwarp();
    }

    #pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int r = warp * RPW + i;
        if (r < R) {
            const size_t row = (size_t)kvh * R + r;
            #pragma unroll
            for (int j = 0; j < DPL; ++j) acc[(row * S + split) * D + lane * DPL + j] = o[i][j];
            if (lane == 0) {
                ml[(row * S + split) * 2] = mrow[i];
                ml[(row * S + split) * 2 + 1] = lrow[i];
            }
        }
    }
"""

_CUDA_COMBINE = r"""
    // one block a row (h * M + m), one thread an output value
    const float NEG_INF = __int_as_float(0xff800000);
    const int S = acc_shape[1];
    const int D = acc_shape[2];
    const size_t row = blockIdx.x;
    const int d = threadIdx.x;
    float mx = NEG_INF;
    for (int s = 0; s < S; ++s) mx = fmaxf(mx, ml[(row * S + s) * 2]);
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < S; ++s) {
        const float ms = ml[(row * S + s) * 2];
        const float w = ms == NEG_INF ? 0.0f : exp2f(ms - mx);
        den += w * ml[(row * S + s) * 2 + 1];
        num += w * acc[(row * S + s) * D + d];
    }
    y[row * D + d] = static_cast<T>(num / den);
"""

# ---------------------------------------------------------------- Metal ----
# The same algorithm for Apple silicon: a simdgroup is a warp, threadgroup
# memory is shared memory (32 KiB there, hence metal_supports).
_METAL_PARTIAL = r"""
    constexpr int TK = 32;
    constexpr int R = G * M;
    constexpr int DPL = D / 32;
    constexpr int KP = D + 16 / sizeof(T);
    threadgroup T ks[TK * KP];
    threadgroup T vs[TK * D];
    threadgroup float ps[W * RPW * TK];

    const int L = k_shape[1];
    const int TPS = params[0];
    const int S = params[1];
    const int lane = int(thread_index_in_simdgroup);
    const int warp = int(simdgroup_index_in_threadgroup);
    const int tid = int(thread_position_in_threadgroup.x);
    const int split = int(threadgroup_position_in_grid.x);
    const int kvh = int(threadgroup_position_in_grid.y);
    const int key0 = split * TPS * TK;
    const int key1 = min(key0 + TPS * TK, L);
    const device T* kh = k + size_t(kvh) * L * D;
    const device T* vh = v + size_t(kvh) * L * D;

    float mrow[RPW], lrow[RPW], o[RPW][DPL];
    size_t qoff[RPW];
    for (int i = 0; i < RPW; ++i) {
        const int r = min(warp * RPW + i, R - 1);
        qoff[i] = (size_t(kvh) * R + r) * D;
        mrow[i] = -INFINITY;
        lrow[i] = 0.0f;
        for (int j = 0; j < DPL; ++j) o[i][j] = 0.0f;
    }

    for (int t0 = key0; t0 < key1; t0 += TK) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int i = tid; i < TK * D; i += W * 32) {
            const int t = i / D;
            const int c = i % D;
            const bool in = t0 + t < key1;
            ks[t * KP + c] = in ? kh[size_t(t0 + t) * D + c] : T(0);
            vs[t * D + c] = in ? vh[size_t(t0 + t) * D + c] : T(0);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);

        float s[RPW];
        for (int i = 0; i < RPW; ++i) s[i] = 0.0f;
        for (int d0 = 0; d0 < D; d0 += 4) {
            float4 kf;
            for (int j = 0; j < 4; ++j) kf[j] = float(ks[lane * KP + d0 + j]);
            for (int i = 0; i < RPW; ++i) {
                const float4 q4 = *((const device float4*)(qf + qoff[i] + d0));
                float a = s[i];
                a = fma(q4.x, kf.x, a);
                a = fma(q4.y, kf.y, a);
                a = fma(q4.z, kf.z, a);
                a = fma(q4.w, kf.w, a);
                s[i] = a;
            }
        }

        const int key = t0 + lane;
        for (int i = 0; i < RPW; ++i) {
            const int m = (warp * RPW + i) % M;
            const float sc = (key < key1 && key <= L - M + m) ? s[i] : -INFINITY;
            const float mnew = max(mrow[i], simd_max(sc));
            float p = 0.0f, alpha = 1.0f;
            if (mnew != -INFINITY) {
                p = metal::precise::exp2(sc - mnew);
                alpha = metal::precise::exp2(mrow[i] - mnew);
            }
            lrow[i] = lrow[i] * alpha + simd_sum(p);
            mrow[i] = mnew;
            for (int j = 0; j < DPL; ++j) o[i][j] *= alpha;
            ps[(warp * RPW + i) * TK + lane] = p;
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);

        for (int t = 0; t < TK; t += 4) {
            float vf[4][DPL];
            for (int tt = 0; tt < 4; ++tt)
                for (int j = 0; j < DPL; ++j) vf[tt][j] = float(vs[(t + tt) * D + lane * DPL + j]);
            for (int i = 0; i < RPW; ++i) {
                const int pb = (warp * RPW + i) * TK + t;
                const float4 p4 = float4(ps[pb], ps[pb + 1], ps[pb + 2], ps[pb + 3]);
                for (int j = 0; j < DPL; ++j) {
                    float a = o[i][j];
                    a = fma(p4.x, vf[0][j], a);
                    a = fma(p4.y, vf[1][j], a);
                    a = fma(p4.z, vf[2][j], a);
                    a = fma(p4.w, vf[3][j], a);
                    o[i][j] = a;
                }
            }
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
    }

    for (int i = 0; i < RPW; ++i) {
        const int r = warp * RPW + i;
        if (r < R) {
            const size_t row = size_t(kvh) * R + r;
            for (int j = 0; j < DPL; ++j) acc[(row * S + split) * D + lane * DPL + j] = o[i][j];
            if (lane == 0) {
                ml[(row * S + split) * 2] = mrow[i];
                ml[(row * S + split) * 2 + 1] = lrow[i];
            }
        }
    }
"""

_METAL_COMBINE = r"""
    const int S = acc_shape[1];
    const int D = acc_shape[2];
    const size_t row = threadgroup_position_in_grid.x;
    const int d = int(thread_position_in_threadgroup.x);
    float mx = -INFINITY;
    for (int s = 0; s < S; ++s) mx = max(mx, ml[(row * S + s) * 2]);
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < S; ++s) {
        const float ms = ml[(row * S + s) * 2];
        const float w = ms == -INFINITY ? 0.0f : metal::precise::exp2(ms - mx);
        den += w * ml[(row * S + s) * 2 + 1];
        num += w * acc[(row * S + s) * D + d];
    }
    y[row * D + d] = static_cast<T>(num / den);
"""

CUDA_VERSION = hashlib.sha256((_CUDA_PARTIAL + _CUDA_COMBINE).encode()).hexdigest()[:12]
METAL_VERSION = hashlib.sha256((_METAL_PARTIAL + _METAL_COMBINE).encode()).hexdigest()[:12]
_compiled: dict[str, tuple] = {}


def _kernels(kind: str):
    """(partial, combine) mx.fast kernel objects, made once; raises where that backend is absent."""
    if kind not in _compiled:
        maker = mx.fast.cuda_kernel if kind == "cuda" else mx.fast.metal_kernel
        version = CUDA_VERSION if kind == "cuda" else METAL_VERSION
        part, comb = (_CUDA_PARTIAL, _CUDA_COMBINE) if kind == "cuda" else (
            _METAL_PARTIAL, _METAL_COMBINE)  # fmt: skip
        _compiled[kind] = (
            maker(name=f"specgate_attn_partial_{version}", input_names=["qf", "k", "v", "params"],
                  output_names=["acc", "ml"], source=part),
            maker(name=f"specgate_attn_combine_{version}", input_names=["acc", "ml"],
                  output_names=["y"], source=comb),
        )  # fmt: skip
    return _compiled[kind]


def _check(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or q.shape[0] != 1 or k.shape[0] != 1:
        raise ValueError(f"attention wants q (1, Hq, M, D), k = v (1, Hkv, L, D): "
                         f"got {q.shape} {k.shape} {v.shape}")  # fmt: skip
    _, hq, m, d = q.shape
    _, hkv, length, dk = k.shape
    if dk != d or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q {q.shape} {q.dtype} does not fit k {k.shape} {k.dtype}")
    if not supports(m, hq, hkv, length, d, q.dtype):
        raise ValueError(f"no multi-row attention kernel for M={m} Hq={hq} Hkv={hkv} L={length} "
                         f"D={d} {q.dtype}")  # fmt: skip
    return m, hq, hkv, length, d


def scaled_queries(q, scale: float):
    """q in float32, times scale * log2(e) (the kernels' softmax is base 2)."""
    return q.astype(mx.float32) * (scale * LOG2E)


def _launch(kind: str, q, k, v, scale: float):
    m, hq, hkv, length, d = _check(q, k, v)
    if kind == "metal" and not metal_supports(m, hq, hkv, length, d, q.dtype):
        raise ValueError("shape needs more than Metal's 32 KiB of threadgroup memory")
    g = hq // hkv
    rpw, w = rows_per_warp(g * m)
    s, tps = launch_config(length, hkv)
    partial, combine = _kernels(kind)
    qf = scaled_queries(q, scale).reshape(hq * m, d)
    params = mx.array([tps, s], dtype=mx.int32)
    acc, ml = partial(
        inputs=[qf, k.reshape(hkv, length, d), v.reshape(hkv, length, d), params],
        template=[("T", q.dtype), ("M", m), ("G", g), ("D", d), ("RPW", rpw), ("W", w)],
        grid=(s * w * 32, hkv, 1), threadgroup=(w * 32, 1, 1),
        output_shapes=[(hq * m, s, d), (hq * m, s, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )  # fmt: skip
    (y,) = combine(
        inputs=[acc, ml], template=[("T", q.dtype)],
        grid=(hq * m * d, 1, 1), threadgroup=(d, 1, 1),
        output_shapes=[(hq * m, d)], output_dtypes=[q.dtype],
    )  # fmt: skip
    return y.reshape(1, hq, m, d)


def cuda_attention(q, k, v, scale: float):
    """The CUDA kernels (mx.fast.cuda_kernel); raises where there is no CUDA."""
    return _launch("cuda", q, k, v, scale)


def metal_attention(q, k, v, scale: float):
    """The Metal kernels (mx.fast.metal_kernel); raises where there is no Metal."""
    return _launch("metal", q, k, v, scale)


def emulate_attention(q, k, v, scale: float, *, _mask_shift: int = 0, _gqa_slip: bool = False):
    """The kernels' arithmetic in MLX ops (float32): the same launch
    configuration, split and tile boundaries (zero-filled past the split),
    row mapping r = g * M + m per KV head, masking, base-2 online softmax
    with the same -inf handling, per-split (acc, m, l) and the combine's
    weights, splits added in order, one rounding. (Within a tile the dot
    products and P @ V are one matmul each rather than the kernel's FMA
    chains.) `_mask_shift` / `_gqa_slip` inject indexing slips (tests only)."""
    m, hq, hkv, length, d = _check(q, k, v)
    g = hq // hkv
    r = g * m
    s, tps = launch_config(length, hkv)
    f32 = mx.float32
    qf = scaled_queries(q, scale).reshape(hq, m, d)
    if _gqa_slip:  # query head h read KV head h % Hkv instead of h // G
        qf = qf.reshape(g, hkv, m, d).transpose(1, 0, 2, 3)
    qf = qf.reshape(hkv, 1, r, d)  # rows of KV head kvh: r = g * M + m
    padded = s * tps * TK
    kf = mx.pad(k.reshape(hkv, length, d).astype(f32), [(0, 0), (0, padded - length), (0, 0)])
    vf = mx.pad(v.reshape(hkv, length, d).astype(f32), [(0, 0), (0, padded - length), (0, 0)])
    kf = kf.reshape(hkv, s, tps, TK, d)
    vf = vf.reshape(hkv, s, tps, TK, d)
    rows_m = (mx.arange(r) % m)[:, None]  # (R, 1)
    ninf = mx.array(-math.inf, f32)
    mrow = mx.full((hkv, s, r), -math.inf, f32)
    lrow = mx.zeros((hkv, s, r), f32)
    o = mx.zeros((hkv, s, r, d), f32)
    split0 = (mx.arange(s) * tps * TK)[:, None, None]  # (S, 1, 1)
    for j in range(tps):
        keys = split0 + j * TK + mx.arange(TK)[None, None, :]  # (S, 1, TK)
        key1 = mx.minimum(split0 + tps * TK, length)
        ok = (keys < key1) & (keys <= length - m + rows_m[None] + _mask_shift)  # (S, R, TK)
        sc = qf @ kf[:, :, j].swapaxes(-1, -2)  # (Hkv, S, R, TK)
        sc = mx.where(ok[None], sc, ninf)
        mnew = mx.maximum(mrow, sc.max(axis=-1))
        dead = mnew == -math.inf
        p = mx.where(dead[..., None], 0.0, mx.power(2.0, sc - mnew[..., None]))
        alpha = mx.where(dead, 1.0, mx.power(2.0, mrow - mnew))
        lrow = lrow * alpha + p.sum(axis=-1)
        mrow = mnew
        o = o * alpha[..., None] + p @ vf[:, :, j]
    # combine: per row (h * M + m = kvh * R + r), splits in order
    mxs = mrow.max(axis=1, keepdims=True)  # (Hkv, 1, R)
    wts = mx.where(mrow == -math.inf, 0.0, mx.power(2.0, mrow - mxs))  # (Hkv, S, R)
    num = mx.zeros((hkv, r, d), f32)
    den = mx.zeros((hkv, r), f32)
    for i in range(s):
        den = den + wts[:, i] * lrow[:, i]
        num = num + wts[:, i, :, None] * o[:, i]
    y = (num / den[..., None]).astype(q.dtype)  # (Hkv, R, D) = (Hq * M, D)
    if _gqa_slip:
        y = y.reshape(hkv, g, m, d).transpose(1, 0, 2, 3)
    return y.reshape(1, hq, m, d)


# ---------------------------------------------------------------- guard ----


class AttentionOp(Op):
    """kernels/guard.py's view of multi-row decode attention. A shape is
    (M, Hq, Hkv, L, D, dtype); inputs q, k, v normal(0, 1), scale 1/sqrt(D);
    the exact answer is the stock path in float32 on the CPU (no TF32 there);
    k and v are what is copied to overflow L2 when timing."""

    name = "attention"
    stock_name = "scaled_dot_product_attention"

    def heavy_args(self, args: tuple) -> tuple[int, ...]:
        return (1, 2)  # k, v

    def shape_of(self, q, k, v, scale):
        return q.shape[2], q.shape[1], k.shape[1], k.shape[2], q.shape[3], q.dtype

    def dtype(self, m, hq, hkv, length, d, dtype):
        return dtype

    def key(self, name, version, m, hq, hkv, length, d, dtype) -> str:
        return f"{name}@{version}|M{m}|Hq{hq}|Hkv{hkv}|L{length}|D{d}|{dtype_name(dtype)}"

    def fields(self, m, hq, hkv, length, d, dtype) -> dict:
        return {"shape": [m, hq, hkv, length, d], "bits": None, "group_size": None}

    def describe(self, m, hq, hkv, length, d, dtype) -> str:
        return f"M={m} Hq={hq} Hkv={hkv} L={length} D={d} {dtype_name(dtype)}"

    def inputs(self, seed, m, hq, hkv, length, d, dtype):
        keys = mx.random.split(mx.random.key(seed + 7919 * m + length + 31 * hq + d), 3)
        q = mx.random.normal((1, hq, m, d), key=keys[0]).astype(dtype)
        k = mx.random.normal((1, hkv, length, d), key=keys[1]).astype(dtype)
        v = mx.random.normal((1, hkv, length, d), key=keys[2]).astype(dtype)
        return q, k, v, 1.0 / math.sqrt(d)

    def out_shape(self, m, hq, hkv, length, d, dtype):
        return (1, hq, m, d)

    def stock(self, q, k, v, scale):
        return reference_attention(q, k, v, scale)

    def exact(self, q, k, v, scale):
        f32 = mx.float32
        with mx.stream(mx.cpu):
            return reference_attention(q.astype(f32), k.astype(f32), v.astype(f32), scale)


ATTENTION = AttentionOp()


def cuda_candidate() -> Candidate:
    return Candidate("cuda_attention", CUDA_VERSION, cuda_attention, supports)


def metal_candidate() -> Candidate:
    return Candidate("metal_attention", METAL_VERSION, metal_attention, metal_supports)


def default_candidates() -> list[Candidate]:
    return [metal_candidate(), cuda_candidate()] if mx.metal.is_available() else [
        cuda_candidate(), metal_candidate()]  # fmt: skip


def make_guard(**kw):
    """A guard for attention kernels (verdicts in .../kernels/<machine>/attention.json)."""
    from specgate.kernels.guard import Guard

    kw.setdefault("candidates", default_candidates())
    cands = kw.pop("candidates")
    return Guard(cands, op=ATTENTION, **kw)


def verify_attention(q, k, v, scale: float, *, guard=None):
    """Attention of the last M rows through the kernel the guard enabled for
    this shape on this machine, else the stock path (always, without a guard)."""
    if guard is not None:
        fn = guard.kernel_for(q, k, v, scale)
        if fn is not None:
            return fn(q, k, v, scale)
    return reference_attention(q, k, v, scale)
