"""Small-M quantized matmul for verify forwards: weights read once, shared by all rows.

A verify forward multiplies M = 2..16 rows (the drafted tokens plus one) by
every quantized weight matrix of the trunk. MLX's stock `quantized_matmul`
runs a matrix-vector kernel per row below M = 8 on CUDA (and on Metal up to
a larger M), so its cost grows ~linearly with M although the weights, which
are what costs, are the same for every row. The kernels here read each
packed weight word once and apply it to all M rows:

- a block (threadgroup) owns 32 * CPL output columns, one column per lane
  (CPL columns per lane), and splits K over its W warps (simdgroups) in
  contiguous ranges of 64-value chunks;
- per chunk a warp stages x[:, chunk] (M x 64) in shared memory as float32,
  every lane loads its column's packed words for the chunk (32 or 64 bytes,
  one load per 16 bytes) while the previous chunk computes, dequantizes each
  value once (w = scale * q + bias, float32) and accumulates it into M
  float32 accumulators; x is read from shared memory by all lanes at once
  (a broadcast), four values per load;
- at the end the W partial sums per (row, column) are added in shared
  memory, in warp order, and rounded once to the output dtype.

MLX's affine layout (`mx.quantize(w, group_size, bits)`): packed uint32
words (N, K * bits / 32), value j of a word in bits [bits * j, bits * (j + 1)),
low bits first; scales and biases (N, K / group_size); w = scale * q + bias.
4-bit and 8-bit, group sizes 32 / 64 / 128, K a multiple of 64.

`reference_qmm` is the stock path and every kernel's reference;
`emulate_qmm` runs the CUDA kernel's exact tiling, index arithmetic and
summation order in MLX ops on any device, so the indexing is tested on a
CPU. `cuda_qmm` and `metal_qmm` are the kernels; neither is used unless
kernels/guard.py proved it on the machine it runs on (the Metal one has
never run where it was written). `verify_qmm` dispatches through a guard.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from specgate.kernels import nvrtc

KC = 64  # K values a warp handles per chunk
MIN_M, MAX_M = 2, 16
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def reference_qmm(x, wq, scales, biases, group_size: int = 64, bits: int = 4):
    """The stock path: y = x @ dequantize(wq)^T."""
    return mx.quantized_matmul(x, wq, scales=scales, biases=biases, transpose=True,
                               group_size=group_size, bits=bits)  # fmt: skip


def supports(m: int, k: int, n: int, dtype, bits: int, group_size: int) -> bool:
    """Shapes the kernels are written for (anything else takes the reference)."""
    return (MIN_M <= m <= MAX_M and bits in BITS and group_size in GROUP_SIZES
            and k % KC == 0 and k % group_size == 0 and n >= 1 and dtype in DTYPES)  # fmt: skip


def launch_config(m: int, k: int, n: int, *, max_shared: int = 48 * 1024) -> tuple[int, int]:
    """(W warps a block, CPL columns a lane). x staging needs W * M * 64 floats
    of shared memory (48 KiB static on CUDA, 32 KiB threadgroup on Metal);
    at most 8 warps, so that a block's registers always fit (no launch bounds
    can be given to an mx.fast kernel)."""
    w = max(1, min(8, max_shared // (m * KC * 4), k // KC))
    cpl = 2  # each staged x value serves two columns (measured no worse at N = 4096)
    return w, cpl


# ---------------------------------------------------------------- CUDA -----

_CUDA_SOURCE = r"""
    // T: x / y dtype; S: scales / biases dtype; M rows; BITS; GS group size;
    // W warps a block; CPL columns a lane.
    constexpr int KC = 64;
    constexpr int PER_WORD = 32 / BITS;
    constexpr int WORDS = KC / PER_WORD;        // packed words a lane reads per chunk
    constexpr int VEC = WORDS / 4;              // 16-byte loads per chunk
    constexpr int PIECE = GS < KC ? GS : KC;    // values of a chunk under one scale
    constexpr uint32_t MASK = (1u << BITS) - 1u;
    __shared__ __align__(16) float xs[W * M * KC];

    const int K = x_shape[1];
    const int N = wq_shape[0];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int n_base = blockIdx.x * (32 * CPL);
    const int wrow = K / PER_WORD;
    const int srow = K / GS;
    const int nchunks = K / KC;
    const int cpw = (nchunks + W - 1) / W;
    const int c0 = warp * cpw;
    const int c1 = min(c0 + cpw, nchunks);
    float* xw = xs + warp * (M * KC);

    float acc[CPL][M];
    const uint4* wp[CPL];
    const S* sp[CPL];
    const S* bp[CPL];
    #pragma unroll
    for (int cc = 0; cc < CPL; ++cc) {
        const int n = n_base + cc * 32 + lane;
        const size_t row = n < N ? (size_t)n : 0;
        wp[cc] = reinterpret_cast<const uint4*>(wq + row * wrow);
        sp[cc] = scales + row * srow;
        bp[cc] = biases + row * srow;
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[cc][m] = 0.0f;
    }

    // Registers one chunk ahead: this lane's packed words and its share of x.
    uint32_t cur[CPL][WORDS];
    uint32_t nxt[CPL][WORDS];
    T xr[M][2];
    if (c0 < c1) {
        #pragma unroll
        for (int cc = 0; cc < CPL; ++cc)
            #pragma unroll
            for (int v = 0; v < VEC; ++v) {
                const uint4 t = wp[cc][c0 * VEC + v];
                nxt[cc][4 * v] = t.x; nxt[cc][4 * v + 1] = t.y;
                nxt[cc][4 * v + 2] = t.z; nxt[cc][4 * v + 3] = t.w;
            }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            xr[m][0] = x[(size_t)m * K + c0 * KC + lane];
            xr[m][1] = x[(size_t)m * K + c0 * KC + 32 + lane];
        }
    }
    for (int c = c0; c < c1; ++c) {
        const int k0 = c * KC;
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            xw[m * KC + lane] = static_cast<float>(xr[m][0]);
            xw[m * KC + 32 + lane] = static_cast<float>(xr[m][1]);
        }
        #pragma unroll
        for (int cc = 0; cc < CPL; ++cc)
            #pragma unroll
            for (int i = 0; i < WORDS; ++i) cur[cc][i] = nxt[cc][i];
        if (c + 1 < c1) {
            #pragma unroll
            for (int cc = 0; cc < CPL; ++cc)
                #pragma unroll
                for (int v = 0; v < VEC; ++v) {
                    const uint4 t = wp[cc][(c + 1) * VEC + v];
                    nxt[cc][4 * v] = t.x; nxt[cc][4 * v + 1] = t.y;
                    nxt[cc][4 * v + 2] = t.z; nxt[cc][4 * v + 3] = t.w;
                }
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                xr[m][0] = x[(size_t)m * K + k0 + KC + lane];
                xr[m][1] = x[(size_t)m * K + k0 + KC + 32 + lane];
            }
        }
        __syncwarp();
        #pragma unroll
        for (int cc = 0; cc < CPL; ++cc) {
            #pragma unroll
            for (int p = 0; p < KC / PIECE; ++p) {
                const int g = (k0 + p * PIECE) / GS;
                const float s = static_cast<float>(sp[cc][g]);
                const float b = static_cast<float>(bp[cc][g]);
                #pragma unroll
                for (int i = 0; i < PIECE / 4; ++i) {
                    const int kk = p * PIECE + 4 * i;   // 4 values: one float4 of x per row
                    const uint32_t wd = cur[cc][kk / PER_WORD];
                    const int sh = (kk % PER_WORD) * BITS;
                    float wv[4];
                    #pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const uint32_t q = (wd >> (sh + BITS * j)) & MASK;
                        wv[j] = fmaf(s, __uint_as_float(0x4B000000u | q) - 8388608.0f, b);
                    }
                    #pragma unroll
                    for (int m = 0; m < M; ++m) {
                        const float4 xv = *reinterpret_cast<const float4*>(xw + m * KC + kk);
                        float a = acc[cc][m];
                        a = fmaf(xv.x, wv[0], a);
                        a = fmaf(xv.y, wv[1], a);
                        a = fmaf(xv.z, wv[2], a);
                        a = fmaf(xv.w, wv[3], a);
                        acc[cc][m] = a;
                    }
                }
            }
        }
        __syncwarp();
    }

    __syncthreads();
    #pragma unroll
    for (int cc = 0; cc < CPL; ++cc)
        #pragma unroll
        for (int m = 0; m < M; ++m) xs[((warp * CPL + cc) * M + m) * 32 + lane] = acc[cc][m];
    __syncthreads();
    for (int t = threadIdx.x; t < CPL * M * 32; t += W * 32) {
        const int l = t & 31;
        const int m = (t >> 5) % M;
        const int cc = (t >> 5) / M;
        float sum = 0.0f;
        for (int wv = 0; wv < W; ++wv) sum += xs[((wv * CPL + cc) * M + m) * 32 + l];
        const int n = n_base + cc * 32 + l;
        if (n < N) y[(size_t)m * N + n] = static_cast<T>(sum);
    }
"""

# ---------------------------------------------------------------- Metal ----
# The same algorithm for Apple silicon: a simdgroup is a warp, threadgroup
# memory is shared memory (32 KiB there, hence launch_config(max_shared=32K)).
_METAL_SOURCE = r"""
    constexpr int KC = 64;
    constexpr int PER_WORD = 32 / BITS;
    constexpr int WORDS = KC / PER_WORD;
    constexpr int VEC = WORDS / 4;
    constexpr int PIECE = GS < KC ? GS : KC;
    constexpr uint MASK = (1u << BITS) - 1u;
    threadgroup float4 xs4[W * M * KC / 4];
    threadgroup float* xs = (threadgroup float*)xs4;

    const int K = x_shape[1];
    const int N = wq_shape[0];
    const int lane = int(thread_index_in_simdgroup);
    const int warp = int(simdgroup_index_in_threadgroup);
    const int tid = int(thread_position_in_threadgroup.x);
    const int n_base = int(threadgroup_position_in_grid.x) * (32 * CPL);
    const int wrow = K / PER_WORD;
    const int srow = K / GS;
    const int nchunks = K / KC;
    const int cpw = (nchunks + W - 1) / W;
    const int c0 = warp * cpw;
    const int c1 = min(c0 + cpw, nchunks);
    threadgroup float* xw = xs + warp * (M * KC);

    float acc[CPL][M];
    const device uint4* wp[CPL];
    const device S* sp[CPL];
    const device S* bp[CPL];
    for (int cc = 0; cc < CPL; ++cc) {
        const int n = n_base + cc * 32 + lane;
        const size_t row = n < N ? size_t(n) : 0;
        wp[cc] = (const device uint4*)(wq + row * wrow);
        sp[cc] = scales + row * srow;
        bp[cc] = biases + row * srow;
        for (int m = 0; m < M; ++m) acc[cc][m] = 0.0f;
    }

    for (int c = c0; c < c1; ++c) {
        const int k0 = c * KC;
        for (int m = 0; m < M; ++m) {
            xw[m * KC + lane] = float(x[size_t(m) * K + k0 + lane]);
            xw[m * KC + 32 + lane] = float(x[size_t(m) * K + k0 + 32 + lane]);
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (int cc = 0; cc < CPL; ++cc) {
            uint words[WORDS];
            for (int v = 0; v < VEC; ++v) {
                const uint4 w4 = wp[cc][c * VEC + v];
                words[4 * v] = w4.x; words[4 * v + 1] = w4.y;
                words[4 * v + 2] = w4.z; words[4 * v + 3] = w4.w;
            }
            for (int p = 0; p < KC / PIECE; ++p) {
                const int g = (k0 + p * PIECE) / GS;
                const float s = float(sp[cc][g]);
                const float b = float(bp[cc][g]);
                for (int i = 0; i < PIECE / 4; ++i) {
                    const int kk = p * PIECE + 4 * i;
                    const uint wd = words[kk / PER_WORD];
                    const int sh = (kk % PER_WORD) * BITS;
                    float4 wv;
                    for (int j = 0; j < 4; ++j) {
                        const uint q = (wd >> (sh + BITS * j)) & MASK;
                        wv[j] = fma(s, as_type<float>(0x4B000000u | q) - 8388608.0f, b);
                    }
                    for (int m = 0; m < M; ++m) {
                        const float4 xv = xs4[(warp * (M * KC) + m * KC + kk) / 4];
                        float a = acc[cc][m];
                        a = fma(xv.x, wv.x, a);
                        a = fma(xv.y, wv.y, a);
                        a = fma(xv.z, wv.z, a);
                        a = fma(xv.w, wv.w, a);
                        acc[cc][m] = a;
                    }
                }
            }
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
    }

    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int cc = 0; cc < CPL; ++cc)
        for (int m = 0; m < M; ++m) xs[((warp * CPL + cc) * M + m) * 32 + lane] = acc[cc][m];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int t = tid; t < CPL * M * 32; t += W * 32) {
        const int l = t & 31;
        const int m = (t >> 5) % M;
        const int cc = (t >> 5) / M;
        float sum = 0.0f;
        for (int wv = 0; wv < W; ++wv) sum += xs[((wv * CPL + cc) * M + m) * 32 + l];
        const int n = n_base + cc * 32 + l;
        if (n < N) y[size_t(m) * N + n] = static_cast<T>(sum);
    }
"""



def source_hash(module_file: str, fallback: str) -> str:
    """A kernel's version: the hash of its module's source file (kernel text,
    launch configuration and dispatch alike), so any edit proves it again;
    the kernel text alone where the file cannot be read."""
    try:
        text = Path(module_file).read_bytes()
    except OSError:
        text = fallback.encode()
    return hashlib.sha256(text).hexdigest()[:12]


CUDA_VERSION = source_hash(__file__, "cuda" + _CUDA_SOURCE)
METAL_VERSION = source_hash(__file__, "metal" + _METAL_SOURCE)
_compiled: dict[str, object] = {}


def _kernel(kind: str):
    """The mx.fast kernel object, made once; raises where that backend is absent."""
    if kind not in _compiled:
        maker = mx.fast.cuda_kernel if kind == "cuda" else mx.fast.metal_kernel
        src = _CUDA_SOURCE if kind == "cuda" else _METAL_SOURCE
        version = CUDA_VERSION if kind == "cuda" else METAL_VERSION
        _compiled[kind] = maker(name=f"specgate_qmm_{version}",
                                input_names=["x", "wq", "scales", "biases"],
                                output_names=["y"], source=src)  # fmt: skip
    return _compiled[kind]


def check_shapes(x, wq, scales, group_size, bits, written_for=None, what="small-M kernel"):
    """(M, K, N) of a call, or ValueError if the operands do not fit each
    other or the kernel is not written for them (`written_for`, default
    this module's `supports`)."""
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    n = wq.shape[0]
    if wq.shape[-1] * 32 // bits != k or scales.shape != (n, k // group_size):
        raise ValueError(f"quantized weight {wq.shape} / scales {scales.shape} do not fit x {x.shape}"
                         f" at {bits} bits, group {group_size}")  # fmt: skip
    if not (written_for or supports)(m, k, n, x.dtype, bits, group_size):
        raise ValueError(f"no {what} for M={m} K={k} N={n} {x.dtype} {bits}-bit g{group_size}")
    return m, k, n


def _launch(kind: str, x, wq, scales, biases, group_size: int, bits: int,
            w: int | None = None, cpl: int | None = None):  # fmt: skip
    m, k, n = check_shapes(x, wq, scales, group_size, bits)
    template, w, cpl = _template(kind, m, k, n, x.dtype, scales.dtype, bits, group_size, w, cpl)
    x2 = x.reshape(m, k)
    (y,) = _kernel(kind)(
        inputs=[x2, wq, scales, biases], template=template,
        grid=(-(-n // (32 * cpl)) * w * 32, 1, 1), threadgroup=(w * 32, 1, 1),
        output_shapes=[(m, n)], output_dtypes=[x.dtype],
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)


def _template(kind: str, m: int, k: int, n: int, dtype, sdtype, bits: int, group_size: int,
              w: int | None = None, cpl: int | None = None) -> tuple[list, int, int]:  # fmt: skip
    """(template arguments, W, CPL) of a launch."""
    dw, dcpl = launch_config(m, k, n, max_shared=48 * 1024 if kind == "cuda" else 32 * 1024)
    w, cpl = w or dw, cpl or dcpl
    return [("T", dtype), ("S", sdtype), ("M", m), ("BITS", bits), ("GS", group_size), ("W", w),
            ("CPL", cpl)], w, cpl  # fmt: skip


def cuda_launch(m: int, k: int, n: int, dtype, bits: int, group_size: int, sdtype=None) -> nvrtc.Launch:
    """`cuda_qmm`'s launch at this shape as MLX writes it (kernels/nvrtc.py)."""
    template, _, _ = _template("cuda", m, k, n, dtype, sdtype or dtype, bits, group_size)
    return nvrtc.launch(f"specgate_qmm_{CUDA_VERSION}", "", _CUDA_SOURCE,
                        [("x", dtype, 2), ("wq", mx.uint32, 2), ("scales", sdtype or dtype, 2),
                         ("biases", sdtype or dtype, 2)], [("y", dtype)], template)  # fmt: skip


def cuda_qmm(x, wq, scales, biases, group_size: int = 64, bits: int = 4, *, w=None, cpl=None):
    """The CUDA kernel (mx.fast.cuda_kernel); raises where there is no CUDA."""
    return _launch("cuda", x, wq, scales, biases, group_size, bits, w, cpl)


def metal_qmm(x, wq, scales, biases, group_size: int = 64, bits: int = 4, *, w=None, cpl=None):
    """The Metal kernel (mx.fast.metal_kernel); raises where there is no Metal."""
    return _launch("metal", x, wq, scales, biases, group_size, bits, w, cpl)


def emulate_qmm(x, wq, scales, biases, group_size: int = 64, bits: int = 4, *, w=None, cpl=None):
    """The CUDA kernel's arithmetic in MLX ops: the same launch configuration,
    word and shift of every value, scale index, per-warp K ranges, float32
    dequantization and accumulation, partial sums added in warp order, one
    rounding at the end. (Within a warp's range the emulation adds chunk by
    chunk as the kernel does, but a chunk's 64 products as one sum.)"""
    m, k, n = check_shapes(x, wq, scales, group_size, bits)
    dw, _ = launch_config(m, k, n)
    w = w or dw
    per_word = 32 // bits
    kk = mx.arange(k)
    words = wq[:, kk // per_word]  # (N, K): the word holding value k
    shifts = ((kk % per_word) * bits).astype(mx.uint32)
    q = mx.bitwise_and(mx.right_shift(words, shifts), (1 << bits) - 1)
    q = mx.view(mx.bitwise_or(q, 0x4B000000).astype(mx.uint32), mx.float32) - 8388608.0
    s = scales.astype(mx.float32)[:, kk // group_size]
    b = biases.astype(mx.float32)[:, kk // group_size]
    wdq = s * q + b  # (N, K) float32
    xf = x.reshape(m, k).astype(mx.float32)
    nchunks = k // KC
    cpw = -(-nchunks // w)
    total = mx.zeros((m, n), mx.float32)
    for warp in range(w):
        c0, c1 = warp * cpw, min(warp * cpw + cpw, nchunks)
        part = mx.zeros((m, n), mx.float32)
        for c in range(c0, c1):
            sl = slice(c * KC, (c + 1) * KC)
            part = part + xf[:, sl] @ wdq[:, sl].T
        total = total + part
    return total.astype(x.dtype).reshape(*x.shape[:-1], n)


Kernel = Callable[..., mx.array]


def verify_qmm(x, wq, scales, biases, group_size: int = 64, bits: int = 4, *, guard=None):
    """x @ dequantize(wq)^T through the kernel the guard enabled for this
    shape on this machine, else the stock path (always, without a guard)."""
    if guard is not None:
        fn = guard.kernel_for(x, wq, scales, biases, group_size, bits)
        if fn is not None:
            return fn(x, wq, scales, biases, group_size, bits)
    return reference_qmm(x, wq, scales, biases, group_size, bits)
