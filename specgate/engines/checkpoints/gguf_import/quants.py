"""GGUF tensor types as MLX affine quantization: packed weights, scales, biases.

MLX's affine quantization stores a row of integers q in [0, 2**bits) as a
little-endian bit stream packed into uint32 words (element i at bits
[bits*i, bits*(i+1)); for 4 bits: 8 values a word, element i at 4*(i%8)),
and a scale s and bias b per group of `group_size` elements along the row:
w = s*q + b. llama.cpp's blocks run along the row too (the input
dimension), so each block type whose blocks are groups of 32 with one
multiplier and one offset maps exactly:

    Q4_0  w = d*(q-8)           scale d,      bias -8d,    4 bits
    Q4_1  w = d*q + m           scale d,      bias m,      4 bits
    Q5_0  w = d*(q-16)          scale d,      bias -16d,   5 bits
    Q5_1  w = d*q + m           scale d,      bias m,      5 bits
    Q8_0  w = d*q, q signed     q+128, scale d, bias -128d, 8 bits
    Q4_K  w = d*sc*q - dmin*m   per 32-element sub-block of a 256 super-block, 4 bits
    Q5_K  the same with 5 bits

The scales of the first five are float16 in the file and their products
with small powers of two stay exact in float16; K-quants' d*sc is not, so
those keep float32 scales and biases. Everything else (Q6_K's groups of 16,
which MLX cannot group by, Q2_K/Q3_K, the IQ types, ...) has no faithful
mapping: it is dequantized by gguf's own code and kept as float16 (F16 and
F32 stay as they are; BF16 becomes float32, exactly, as numpy and
safetensors.numpy have no bfloat16).

The unpacking mirrors gguf.quants' dequantize_blocks (the reference the
tests compare against); it is written out here because gguf only returns
dequantized floats, never the integers and their scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize

GROUP = 32


@dataclass(frozen=True)
class Quantized:
    """One weight as MLX's quantized layers hold it."""

    weight: np.ndarray  # uint32 [rows, cols*bits/32]
    scales: np.ndarray  # [rows, cols/group]
    biases: np.ndarray
    bits: int
    group_size: int = GROUP


def _blocks(data: np.ndarray, qtype: T) -> np.ndarray:
    """The tensor's bytes as [n_blocks, type_size]."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1, type_size)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """ggml's 4-bit order: in each run of `width` bytes, the low nibbles are
    elements [0, width), the high ones [width, 2*width)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def _high_bits(qh: np.ndarray, n_elems: int) -> np.ndarray:
    """Q5_0/Q5_1's fifth bits: element j's is bit j of a little-endian uint32."""
    h = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1)
    return ((h >> np.arange(n_elems, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:], 16), d, -8 * d, 4


def _q4_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:], 16), d, m, 4


def _q5_0(b):
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 6:], 16) | (_high_bits(b[:, 2:6], 32) << 4)
    return q, d, -16 * d, 5


def _q5_1(b):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:], 16) | (_high_bits(b[:, 4:8], 32) << 4)
    return q, d, m, 5


def _q8_0(b):
    d = _f16(b[:, :2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d, 8


def _k_scales(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(b):
    scale, bias = _k_scales(b)
    return _nibbles(b[:, 16:], 32), scale, bias, 4


def _q5_k(b):
    scale, bias = _k_scales(b)
    n = b.shape[0]
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _nibbles(b[:, 48:], 32) | ((qh & 1).reshape(n, -1) << 4)
    return q, scale, bias, 5


# type -> (unpack(blocks) -> (q [n_blocks, elems], scale [n_blocks, groups], bias, bits),
#          scales' dtype)
_EXACT = {
    T.Q4_0: (_q4_0, np.float16),
    T.Q4_1: (_q4_1, np.float16),
    T.Q5_0: (_q5_0, np.float16),
    T.Q5_1: (_q5_1, np.float16),
    T.Q8_0: (_q8_0, np.float16),
    T.Q4_K: (_q4_k, np.float32),
    T.Q5_K: (_q5_k, np.float32),
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Rows of integers in [0, 2**bits) as MLX packs them: a little-endian
    bit stream in uint32 words. Eight values fill `bits` bytes exactly, so
    each eight are shifted into one uint64 and its low `bits` bytes kept
    (in row chunks: the uint64s take 8 bytes a value)."""
    rows, cols = q.shape
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    out = np.empty((rows, cols * bits // 8), np.uint8)
    step = max(1, (1 << 24) // max(cols, 1))
    for r in range(0, rows, step):
        eights = q[r:r + step].reshape(-1, cols // 8, 8).astype(np.uint64) << shifts
        words = np.bitwise_or.reduce(eights, axis=-1)  # [chunk, cols/8] little-endian
        out[r:r + step] = words.view(np.uint8).reshape(-1, cols // 8, 8)[..., :bits].reshape(-1, cols * bits // 8)
    return out.view("<u4")


def maps_exactly(qtype: T) -> bool:
    return qtype in _EXACT


def to_mlx(data: np.ndarray, qtype: T, rows: int, cols: int) -> Quantized | np.ndarray:
    """A tensor's data as GGUFReader (and gguf_file.GGUFFile) gives it (`rows` rows of `cols`
    elements): MLX's quantized arrays where the type maps exactly, else a
    float array [rows, cols]."""
    if qtype in FLOAT_TYPES:
        if qtype == T.BF16:  # bfloat16 bits are float32's top half
            bits = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(rows, cols)
        return np.asarray(data).reshape(rows, cols)
    if qtype not in _EXACT:
        return dequantize(data, qtype).astype(np.float16).reshape(rows, cols)
    unpack, dtype = _EXACT[qtype]
    q, scale, bias, bits = unpack(_blocks(data, qtype))
    return Quantized(
        weight=pack(q.reshape(rows, cols), bits),
        scales=scale.reshape(rows, cols // GROUP).astype(dtype),
        biases=bias.reshape(rows, cols // GROUP).astype(dtype),
        bits=bits,
    )
