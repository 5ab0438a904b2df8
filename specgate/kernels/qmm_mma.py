"""Small-M quantized matmul on tensor cores (CUDA, sm_80+): a verify costs one weight read.

kernels/qmm.py's kernel does the products on CUDA cores in float32, so at
M = 8 rows a 4-bit weight byte asks for 16 FMAs and the arithmetic, not the
memory, sets the pace (measured: ~0.8 TB/s of 4.8 on an H200). Here the
products go to `mma.sync.m16n8k16` (16 rows x 8 columns x 16 K per
instruction, float32 accumulation), so 1..16 rows cost the same, and a
lane's only arithmetic is dequantizing its weights once:

- a warp owns NT tiles of 8 output columns and a contiguous range of K
  blocks; the W warps of a block split K and add their partial sums in
  shared memory, in warp order (split-K, so that thin matrices such as
  k_proj still fill the GPU);
- per K block a lane reads 16 bytes of one weight row (lane = 4 * g + t:
  row g of the tile, 16-byte piece t), a coalesced 64 bytes per row, and
  the matching 16-byte pieces of x for row g (and g + 8 when M > 8);
- a packed word's values are taken out in pairs with one mask: 4-bit
  values j and j + 4 land in the two halves of a bf16x2 / f16x2 register
  as 128 + q (bf16) or 1024 + q (f16), exact; one fma takes off the
  offset (exact), one more applies scale and bias (rounded once to the
  activation dtype, as a bf16 / f16 model's weights are). 8-bit values
  at bf16 go through float32 (bf16 cannot hold 128 + 255).
- the tensor core adds products over K in the order of its fragment slots;
  the slots' K order does not matter as long as x and the weights use the
  same one, so x is permuted in registers (`__byte_perm`) to the pairs the
  mask produced, instead of shuffling weights.

Layout (PTX ISA, mma.m16n8k16 with .bf16/.f16, g = lane / 4, t = lane % 4):
A regs a0: (row g, k 2t..2t+1), a1: (row g+8, same k), a2: (row g, k 2t+8..),
a3: (row g+8, k 2t+8..); B regs b0: (k 2t..2t+1, col g), b1: (k 2t+8.., col g);
C c0, c1: (row g, cols 2t, 2t+1), c2, c3: (row g+8, same cols).

`simulate_qmm` replays the kernel lane by lane in numpy (the same loads,
masks, permutations, fragment layout, split-K and output order), so the
index arithmetic is tested on a CPU; `cuda_qmm_mma` is the kernel, and
`cuda_qmm_mma_fused` the same tile code over 2 or 3 matrices that share x
(a layer's q/k/v, gate/up) in one launch, which saves MLX's per-launch host
cost; each is used only where kernels/guard.py proved it on the machine it
runs on (the fused one through guard.FUSED_QMM).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from specgate.kernels import nvrtc, qmm

MIN_M, MAX_M = 1, 16
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.float16, mx.bfloat16)


def k_block(bits: int) -> int:
    """K values one warp covers per step: 4 lanes x one 16-byte weight load each."""
    return 4 * (128 // bits)


def supports(m: int, k: int, n: int, dtype, bits: int, group_size: int) -> bool:
    return (MIN_M <= m <= MAX_M and bits in BITS and group_size in GROUP_SIZES
            and dtype in DTYPES and k % k_block(bits) == 0 and k % group_size == 0
            and n >= 1)  # fmt: skip


def launch_config(m: int, k: int, n: int, bits: int) -> tuple[int, int]:
    """(W warps splitting K in a block, NT column tiles of 8 a warp).

    NT = 4 on wide matrices (each x piece a lane loads serves 4 tiles), 2 on
    narrow ones (more blocks). W doubles up to 8 until the grid has ~2048
    warps (16 per H200 SM) or a warp would get fewer than 2 K blocks; at
    most 8, because no launch bounds can be given to an mx.fast kernel and
    256 threads always find their registers."""
    nt = 4 if n >= 8192 else 2
    blocks = -(-n // (8 * nt))
    nkb = k // k_block(bits)
    w = 1
    while w < 8 and blocks * w < 2048 and nkb // (2 * w) >= 2:
        w *= 2
    return w, nt


_HEADER = r"""
// d = a * b + c on two bf16 / f16 values at once.
template <int BF>
__device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    if constexpr (BF) asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// (lo, hi) floats rounded to one bf16x2 / f16x2 register, lo in the low half.
template <int BF>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    uint32_t d;
    if constexpr (BF) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Two values of a packed word, dequantized: the ones at bit `shift` and
// bit `shift + 16` (4-bit: j and j + 4; 8-bit: j and j + 2).
template <int BF, int BITS>
__device__ __forceinline__ uint32_t deq2(uint32_t w, int shift, float s, float b,
                                         uint32_t s2, uint32_t b2) {
    if constexpr (BF && BITS == 8) {
        // 2^23 + q in float32, by putting the byte under a 0x4B exponent.
        const int j = shift / 8;
        const float lo = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540 | j)) - 8388608.0f;
        const float hi = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540 | (j + 2))) - 8388608.0f;
        return pack2<BF>(fmaf(s, lo, b), fmaf(s, hi, b));
    } else {
        constexpr uint32_t MASK = BITS == 4 ? 0x000F000Fu : 0x00FF00FFu;
        constexpr uint32_t MAGIC = BF ? 0x43004300u : 0x64006400u;   // 128 | 1024, twice
        constexpr uint32_t ONE = BF ? 0x3F803F80u : 0x3C003C00u;
        constexpr uint32_t NEG = BF ? 0xC300C300u : 0xE400E400u;     // -128 | -1024
        const uint32_t q = fma2<BF>(((w >> shift) & MASK) | MAGIC, ONE, NEG);  // exact
        return fma2<BF>(q, s2, b2);
    }
}

template <int BF>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1,
                                         uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    if constexpr (BF)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes at p (8 bf16 / f16 values), with a 4-byte path where p is not
// 16-byte aligned (an x that is a view at an odd offset).
__device__ __forceinline__ uint4 load16(const void* p, bool aligned) {
    if (aligned) return *reinterpret_cast<const uint4*>(p);
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    uint4 r;
    r.x = h[0] | (uint32_t(h[1]) << 16); r.y = h[2] | (uint32_t(h[3]) << 16);
    r.z = h[4] | (uint32_t(h[5]) << 16); r.w = h[6] | (uint32_t(h[7]) << 16);
    return r;
}

// One block's NT * 8 output columns of y = x @ dequantize(wq)^T.
// T activations; S scales/biases; BF 1 for bf16, 0 for f16; M rows; BITS;
// GS group size; W warps splitting K; NT column tiles of 8 a warp.
template <typename T, typename S, int BF, int M, int BITS, int GS, int W, int NT>
__device__ __forceinline__ void qmm_tile(const T* x, const char* wq, const S* scales,
                                         const S* biases, T* y, int K, int N, int blk) {

    constexpr int VPL = 128 / BITS;          // values in a lane's 16 weight bytes
    constexpr int KB = 4 * VPL;              // K values a warp covers per step
    constexpr int XV = VPL / 8;              // 16-byte x pieces per row per step
    __shared__ float red[W * NT * 128];

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n_base = blk * (NT * 8);
    const int nkb = K / KB;
    const int per = (nkb + W - 1) / W;
    const int kb0 = warp * per;
    const int kb1 = min(kb0 + per, nkb);
    const bool walign = (reinterpret_cast<size_t>(wq) & 15) == 0;
    const bool xalign = (reinterpret_cast<size_t>(x) & 15) == 0;

    const char* wrow[NT];
    const S* srow[NT];
    const S* brow[NT];
    float acc[NT][4];
    #pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int n = min(n_base + 8 * j + g, N - 1);  // past N: a real row, output dropped
        wrow[j] = reinterpret_cast<const char*>(wq) + (size_t)n * (K * BITS / 8);
        srow[j] = scales + (size_t)n * (K / GS);
        brow[j] = biases + (size_t)n * (K / GS);
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    }
    const bool row0 = g < M;                 // x row g exists
    const bool row1 = M > 8 && g + 8 < M;    // x row g + 8 exists
    const T* x0 = x + (size_t)(row0 ? g : 0) * K;
    const T* x1 = x + (size_t)(row1 ? g + 8 : 0) * K;

    uint4 wn[NT], xn0[XV], xn1[XV];
    float sn[NT], bn[NT];
    auto fetch = [&](int kb) {
        const int k = kb * KB + t * VPL;
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            wn[j] = load16(wrow[j] + (size_t)k * BITS / 8, walign);
            sn[j] = static_cast<float>(srow[j][k / GS]);
            bn[j] = static_cast<float>(brow[j][k / GS]);
        }
        #pragma unroll
        for (int i = 0; i < XV; ++i) {
            xn0[i] = row0 ? load16(x0 + k + 8 * i, xalign) : make_uint4(0, 0, 0, 0);
            if (M > 8) xn1[i] = row1 ? load16(x1 + k + 8 * i, xalign) : make_uint4(0, 0, 0, 0);
        }
    };

    if (kb0 < kb1) fetch(kb0);
    for (int kb = kb0; kb < kb1; ++kb) {
        uint4 wc[NT], xc0[XV], xc1[XV];
        float sc[NT], bc[NT];
        #pragma unroll
        for (int j = 0; j < NT; ++j) { wc[j] = wn[j]; sc[j] = sn[j]; bc[j] = bn[j]; }
        #pragma unroll
        for (int i = 0; i < XV; ++i) { xc0[i] = xn0[i]; if (M > 8) xc1[i] = xn1[i]; }
        if (kb + 1 < kb1) fetch(kb + 1);

        // A fragments: x pairs in the order deq2 takes weight values out.
        // 4-bit: a word holds x[8i .. 8i+7] of the lane's piece; its two mmas
        // take (0,4),(1,5) then (2,6),(3,7). 8-bit: a word holds 4 values,
        // one mma takes (0,2),(1,3).
        constexpr int WORDS = 4;
        constexpr int PER_WORD = BITS == 4 ? 2 : 1;
        uint32_t a0[WORDS * PER_WORD], a2[WORDS * PER_WORD];
        uint32_t a1[WORDS * PER_WORD], a3[WORDS * PER_WORD];
        #pragma unroll
        for (int wd = 0; wd < WORDS; ++wd) {
            #pragma unroll
            for (int h = 0; h < PER_WORD; ++h) {
                const int r = wd * PER_WORD + h;
                uint32_t lo0, hi0, lo1 = 0, hi1 = 0;
                if (BITS == 4) {   // word wd = x piece wd (8 values): .x .y | .z .w
                    const uint4 p = xc0[wd];
                    lo0 = h ? p.y : p.x; hi0 = h ? p.w : p.z;
                    if (M > 8) { const uint4 q = xc1[wd]; lo1 = h ? q.y : q.x; hi1 = h ? q.w : q.z; }
                } else {           // word wd = half of x piece wd / 2 (4 values)
                    const uint4 p = xc0[wd >> 1];
                    lo0 = (wd & 1) ? p.z : p.x; hi0 = (wd & 1) ? p.w : p.y;
                    if (M > 8) { const uint4 q = xc1[wd >> 1]; lo1 = (wd & 1) ? q.z : q.x; hi1 = (wd & 1) ? q.w : q.y; }
                }
                a0[r] = __byte_perm(lo0, hi0, 0x5410);
                a2[r] = __byte_perm(lo0, hi0, 0x7632);
                a1[r] = M > 8 ? __byte_perm(lo1, hi1, 0x5410) : 0u;
                a3[r] = M > 8 ? __byte_perm(lo1, hi1, 0x7632) : 0u;
            }
        }

        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            const uint32_t s2 = pack2<BF>(sc[j], sc[j]);
            const uint32_t b2 = pack2<BF>(bc[j], bc[j]);
            const uint32_t words[4] = {wc[j].x, wc[j].y, wc[j].z, wc[j].w};
            #pragma unroll
            for (int wd = 0; wd < WORDS; ++wd) {
                #pragma unroll
                for (int h = 0; h < PER_WORD; ++h) {
                    const int r = wd * PER_WORD + h;
                    // 4-bit: shifts 8h and 8h + 4; 8-bit: shifts 0 and 8.
                    const int sh0 = BITS == 4 ? 8 * h : 0;
                    const int sh1 = BITS == 4 ? 8 * h + 4 : 8;
                    const uint32_t b0 = deq2<BF, BITS>(words[wd], sh0, sc[j], bc[j], s2, b2);
                    const uint32_t b1 = deq2<BF, BITS>(words[wd], sh1, sc[j], bc[j], s2, b2);
                    mma16816<BF>(acc[j], a0[r], a1[r], a2[r], a3[r], b0, b1);
                }
            }
        }
    }

    #pragma unroll
    for (int j = 0; j < NT; ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e) red[((warp * NT + j) * 32 + lane) * 4 + e] = acc[j][e];
    __syncthreads();
    for (int idx = threadIdx.x; idx < NT * 128; idx += W * 32) {
        const int j = idx >> 7;
        const int l = (idx >> 2) & 31;
        const int e = idx & 3;
        const int m = (l >> 2) + (e >> 1) * 8;
        const int n = n_base + 8 * j + (l & 3) * 2 + (e & 1);
        if (m < M && n < N) {
            float sum = 0.0f;
            for (int wv = 0; wv < W; ++wv) sum += red[((wv * NT + j) * 32 + l) * 4 + e];
            y[(size_t)m * N + n] = static_cast<T>(sum);
        }
    }
}
"""

_SOURCE = r"""
    qmm_tile<T, S, BF, M, BITS, GS, W, NT>(x, reinterpret_cast<const char*>(wq), scales, biases, y,
                                           wq_shape[1] * (32 / BITS), wq_shape[0], blockIdx.x);
"""


def _fused_source(parts: int) -> str:
    """A launch over 2 or 3 matrices that share x (q/k/v, gate/up): blocks
    are dealt to the matrices in order, each running the same tile code."""
    lines = ["    const int K = wq0_shape[1] * (32 / BITS);", "    int blk = blockIdx.x;"]
    for i in range(parts):
        call = (f"qmm_tile<T, S, BF, M, BITS, GS, W, NT>(x, reinterpret_cast<const char*>(wq{i}), "
                f"s{i}, b{i}, y{i}, K, wq{i}_shape[0], blk); return;")  # fmt: skip
        if i < parts - 1:
            lines.append(f"    {{ const int nb = (wq{i}_shape[0] + 8 * NT - 1) / (8 * NT);")
            lines.append(f"      if (blk < nb) {{ {call} }} blk -= nb; }}")
        else:
            lines.append(f"    {call}")
    return "\n".join(lines) + "\n"


_FUSED_SOURCES = {g: _fused_source(g) for g in (2, 3)}

# Hashes of this file (qmm.source_hash): the fused kernel's text is made here too.
VERSION = qmm.source_hash(__file__, _HEADER + _SOURCE)
FUSED_VERSION = qmm.source_hash(__file__, _HEADER + "".join(_FUSED_SOURCES.values()))
_compiled: dict = {}


def compact(src: str) -> str:
    """The source without comments and indentation. MLX rebuilds a custom
    kernel's full source text on every call and hashes it at every launch
    (mlx/backend/cuda/custom_kernel.cpp), so its length is paid ~200 times
    per verify forward; the readable text above is what VERSION names."""
    out = []
    for line in src.splitlines():
        line = line.split("//", 1)[0].strip()
        if line:
            out.append(line)
    return "\n".join(out)


def _spec(parts: int) -> tuple[str, list[str], list[str], str]:
    """(name, input names, output names, source) of the kernel over 1
    matrix, or 2 / 3 sharing x: what `_kernel` makes and `cuda_launch`
    describes, from one place (a mismatch would miss MLX's cache)."""
    if parts == 1:
        return f"sg_mma1_{VERSION}", ["x", "wq", "scales", "biases"], ["y"], _SOURCE
    names = ["x"] + [f"{a}{i}" for i in range(parts) for a in ("wq", "s", "b")]
    return f"sg_mma{parts}_{FUSED_VERSION}", names, [f"y{i}" for i in range(parts)], _FUSED_SOURCES[parts]


def _kernel(parts: int = 1):
    """The mx.fast kernel over 1 matrix, or 2 / 3 sharing x; made once."""
    if parts not in _compiled:
        name, names, outs, src = _spec(parts)
        _compiled[parts] = mx.fast.cuda_kernel(name=name, input_names=names, output_names=outs,
                                               source=compact(src), header=compact(_HEADER))  # fmt: skip
    return _compiled[parts]


def _check(x, wq, scales, group_size, bits) -> tuple[int, int, int]:
    return qmm.check_shapes(x, wq, scales, group_size, bits, supports, "tensor-core kernel")


_launches: dict[tuple, dict] = {}


def _template(dtype, sdtype, m: int, bits: int, group_size: int, w: int, nt: int) -> list:
    return [("T", dtype), ("S", sdtype), ("BF", int(dtype == mx.bfloat16)), ("M", m), ("BITS", bits),
            ("GS", group_size), ("W", w), ("NT", nt)]  # fmt: skip


def cuda_launch(m: int, k: int, ns, dtype, bits: int, group_size: int, sdtype=None) -> nvrtc.Launch:
    """The launch at this shape as MLX writes it (kernels/nvrtc.py): the
    single kernel for an int `ns`, the fused one for a tuple of 2 or 3."""
    sdtype = sdtype or dtype
    parts = 1 if isinstance(ns, int) else len(ns)
    w, nt = launch_config(m, k, ns if parts == 1 else sum(ns), bits)
    name, names, outs, src = _spec(parts)
    # (x's ndim: any above 0 gives the same text; wq uint32, scales and biases sdtype)
    inputs = [(n, dtype if n == "x" else mx.uint32 if n.startswith("wq") else sdtype, 2) for n in names]
    return nvrtc.launch(name, compact(_HEADER), compact(src), inputs,
                        [(o, dtype) for o in outs], _template(dtype, sdtype, m, bits, group_size, w, nt))  # fmt: skip


def cuda_qmm_mma(x, wq, scales, biases, group_size: int = 64, bits: int = 4, *, w=None, nt=None):
    """The tensor-core kernel (mx.fast.cuda_kernel); raises where there is no CUDA.

    The launch arguments are worked out once per shape: this runs ~200
    times per verify forward, while the GPU waits for the graph."""
    key = (x.shape, x.dtype, wq.shape, scales.shape, scales.dtype, group_size, bits, w, nt)
    launch = _launches.get(key)
    if launch is None:
        m, k, n = _check(x, wq, scales, group_size, bits)
        dw, dnt = launch_config(m, k, n, bits)
        w, nt = w or dw, nt or dnt
        launch = _launches[key] = dict(
            template=_template(x.dtype, scales.dtype, m, bits, group_size, w, nt),
            grid=(-(-n // (8 * nt)) * w * 32, 1, 1), threadgroup=(w * 32, 1, 1),
            output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype])  # fmt: skip
    # x keeps its leading dims (the kernel takes K from wq's shape and writes
    # rows in order): no reshape, one op fewer per call.
    return _kernel()(inputs=[x, wq, scales, biases], **launch)[0]


def supports_fused(m: int, k: int, ns: tuple, dtype, bits: int, group_size: int) -> bool:
    """2 or 3 matrices sharing x, each a shape the single kernel is written for."""
    return len(ns) in (2, 3) and all(supports(m, k, n, dtype, bits, group_size) for n in ns)


def cuda_qmm_mma_fused(x, *args) -> list:
    """[x @ dequantize(wq_i)^T for each part] in one launch (mx.fast.cuda_kernel).

    args: wq0, s0, b0, wq1, s1, b1[, wq2, s2, b2], group_size, bits; the parts
    share K, bits, group size and dtypes (q/k/v, or gate/up, of one layer)."""
    group_size, bits = args[-2], args[-1]
    flat = args[:-2]
    key = (x.shape, x.dtype, tuple(a.shape for a in flat), flat[1].dtype, group_size, bits)
    launch = _launches.get(key)
    if launch is None:
        parts = [flat[i : i + 3] for i in range(0, len(flat), 3)]
        ns = []
        for wq, sc, _ in parts:
            m, k, n = _check(x, wq, sc, group_size, bits)
            ns.append(n)
        if not supports_fused(m, k, tuple(ns), x.dtype, bits, group_size):
            raise ValueError(f"no fused tensor-core kernel for M={m} K={k} N={ns}")
        w, nt = launch_config(m, k, sum(ns), bits)
        blocks = sum(-(-n // (8 * nt)) for n in ns)
        launch = _launches[key] = dict(
            template=_template(x.dtype, flat[1].dtype, m, bits, group_size, w, nt),
            grid=(blocks * w * 32, 1, 1), threadgroup=(w * 32, 1, 1),
            output_shapes=[(*x.shape[:-1], n) for n in ns], output_dtypes=[x.dtype] * len(ns))  # fmt: skip
    return _kernel(len(flat) // 3)(inputs=[x, *flat], **launch)


# ------------------------------------------------------------ simulation ---


def _round(v: np.ndarray, bf: bool) -> np.ndarray:
    """float32 -> bf16 / f16 (round to nearest even), back as float32."""
    v = np.asarray(v, np.float32)
    if not bf:
        return v.astype(np.float16).astype(np.float32)
    u = v.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def _mma_plan(bits: int) -> list[tuple]:
    """The mmas of one lane's 16 weight bytes, as the kernel orders them:
    (word, x offsets of a0's pair, x offsets of a2's pair, shifts for b0, b1),
    offsets counted from the lane's first K value."""
    if bits == 4:  # a word: 8 values; mma h takes (2h, 2h+4) and (2h+1, 2h+5)
        return [(wd, (8 * wd + 2 * h, 8 * wd + 2 * h + 4), (8 * wd + 2 * h + 1, 8 * wd + 2 * h + 5),
                 (8 * h, 8 * h + 4)) for wd in range(4) for h in range(2)]  # fmt: skip
    return [(wd, (4 * wd, 4 * wd + 2), (4 * wd + 1, 4 * wd + 3), (0, 8)) for wd in range(4)]


def _mma(a0, a1, a2, a3, b0, b1) -> np.ndarray:
    """One m16n8k16 over a warp: each argument is (lo, hi), per lane (32,),
    placed where the PTX fragment layout puts it; returns the (32, 4) C
    fragments (c0, c1: row g; c2, c3: row g + 8; columns 2t, 2t + 1)."""
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes & 3
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for rows, cols, reg in ((g, 2 * t, a0), (g + 8, 2 * t, a1), (g, 2 * t + 8, a2),
                            (g + 8, 2 * t + 8, a3)):  # fmt: skip
        A[rows, cols], A[rows, cols + 1] = reg
    for ks, reg in ((2 * t, b0), (2 * t + 8, b1)):
        B[ks, g], B[ks + 1, g] = reg
    C = A @ B
    return np.stack([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]], axis=1)


def simulate_qmm(x, wq, scales, biases, group_size: int = 64, bits: int = 4, *, w=None, nt=None):
    """The kernel replayed in numpy, lane by lane: which 16 bytes each lane
    loads, which values a mask takes out of a word, how x is permuted into
    fragment registers, where the PTX fragment layout puts every register in
    the 16x8x16 product, how split-K partial sums are added (warp order) and
    where each accumulator is written. Dequantized weights are rounded to
    the activation dtype as the kernel's fma does; products are summed in
    float64 (the tensor core's internal order is its own)."""
    m, k, n = _check(x, wq, scales, group_size, bits)
    dw, dnt = launch_config(m, k, n, bits)
    w, nt = w or dw, nt or dnt
    bf = x.dtype == mx.bfloat16
    xv = _half_value(np.array(mx.view(x.reshape(m, k), mx.uint16)), bf)  # exact values
    xv = np.concatenate([xv, np.zeros((16 - m, k))])  # absent rows read as 0
    wb = np.array(wq).view(np.uint32).reshape(n, -1)
    sc = _round(np.array(scales.astype(mx.float32)), bf)
    bi = _round(np.array(biases.astype(mx.float32)), bf)
    vpl, kb_len, mask = 128 // bits, k_block(bits), (1 << bits) - 1
    nkb = k // kb_len
    per = -(-nkb // w)
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes & 3
    plan = _mma_plan(bits)
    y = np.zeros((m, n))
    for n_base in range(0, n, 8 * nt):
        total = np.zeros((nt, 32, 4))
        for warp in range(w):  # partial sums added in warp order
            part = np.zeros((nt, 32, 4))
            for kb in range(warp * per, min(warp * per + per, nkb)):
                k0 = kb * kb_len + t * vpl  # each lane's first K value
                for j in range(nt):
                    rows = np.minimum(n_base + 8 * j + g, n - 1)
                    words = wb[rows[:, None], (k0 * bits // 32)[:, None] + np.arange(4)]
                    s, b = sc[rows, k0 // group_size], bi[rows, k0 // group_size]
                    for wd, p0, p2, shifts in plan:
                        b0, b1 = (tuple(_round(s * ((words[:, wd] >> sh) & mask) + b, bf)
                                        for sh in (shift, shift + 16)) for shift in shifts)  # fmt: skip
                        a0, a2 = ((xv[g, k0 + p[0]], xv[g, k0 + p[1]]) for p in (p0, p2))
                        a1, a3 = ((xv[g + 8, k0 + p[0]], xv[g + 8, k0 + p[1]]) for p in (p0, p2))
                        part[j] += _mma(a0, a1, a2, a3, b0, b1)
            total += part
        for j in range(nt):
            for e in range(4):
                mm = g + 8 * (e >> 1)
                nn = n_base + 8 * j + 2 * t + (e & 1)
                ok = (mm < m) & (nn < n)
                y[mm[ok], nn[ok]] = total[j, ok, e]
    return mx.array(y.astype(np.float32)).astype(x.dtype).reshape(*x.shape[:-1], n)


def _half_value(bits16: np.ndarray, bf: bool) -> np.ndarray:
    """Raw bf16 / f16 half-words -> float64."""
    b = np.asarray(bits16, np.uint32)
    if bf:
        return (b << 16).view(np.float32).astype(np.float64)
    return b.astype(np.uint16).view(np.float16).astype(np.float64)
