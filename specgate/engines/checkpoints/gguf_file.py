"""A GGUF file's key/value table and tensor infos, read fast.

The `gguf` package's GGUFReader builds a numpy view for every element of
every array it meets: on SmolLM2's 49k-token vocabulary and 49k merges that
is ~100k small arrays, 3-6 s on this machine per open, and a Gemma's 262k
vocabulary takes half a minute; specgate opens a GGUF at config validation,
inspect, the memory estimate and the import. This reads the same format
(gguf-py's `gguf_reader.py` and llama.cpp's `gguf.cpp` are the reference)
into plain Python values, string arrays as lists, in ~0.1 s, and gives the
part of GGUFReader's interface specgate uses: `fields` (name -> a field with
`contents()`, `types`, `data`), `get_field`, and `tensors` (name,
tensor_type, shape in ggml order, n_elements, n_bytes, data_offset, and
`data` as GGUFReader shapes it, a view of the memory-mapped file).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALARS = {  # value type -> struct format (little-endian)
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
_NUMPY = {  # value type -> numpy dtype, for numeric arrays read in one go
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}  # fmt: skip
_TYPED = {  # tensor types GGUFReader hands out as typed arrays; the rest as bytes
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


class GGUFFormatError(ValueError):
    """Not a GGUF file, or a truncated or corrupt one."""


@dataclass
class Field:
    name: str
    types: list[GGUFValueType]  # [type] for a scalar, [ARRAY, element type] for an array
    value: Any

    @property
    def data(self) -> Any:  # GGUFReader's: an array's elements (len() is what callers read)
        return self.value if self.types[0] == GGUFValueType.ARRAY else [self.value]

    def contents(self) -> Any:
        v = self.value
        return v.tolist() if isinstance(v, np.ndarray) else v


@dataclass
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: the row length first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    _file: GGUFFile

    @property
    def data(self) -> np.ndarray:
        np_dims = tuple(reversed(self.shape))
        typed = _TYPED.get(self.tensor_type)
        if typed is not None:
            count, dtype = self.n_elements, typed
        else:
            count, dtype = self.n_bytes, np.uint8
            np_dims = quant_shape_to_byte_shape(np_dims, self.tensor_type)
        return np.frombuffer(self._file.buffer, dtype=dtype, count=count,
                             offset=self.data_offset).reshape(np_dims)  # fmt: skip


class GGUFFile:
    """A GGUF file opened for reading (memory-mapped; nothing is copied)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self.buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file
                raise GGUFFormatError(f"{self.path}: not a GGUF file (empty)") from e
        self._pos = 0
        self.fields: dict[str, Field] = {}
        self.tensors: list[Tensor] = []
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
            if isinstance(e, GGUFFormatError):
                raise
            raise GGUFFormatError(f"{self.path}: truncated or corrupt GGUF ({e})") from e

    def get_field(self, name: str) -> Field | None:
        return self.fields.get(name)

    # -- parsing ---------------------------------------------------------------------
    def _read(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buffer, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._read("<Q")
        if self._pos + n > len(self.buffer):
            raise GGUFFormatError(f"{self.path}: a string runs past the end of the file")
        s = self.buffer[self._pos : self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: GGUFValueType) -> tuple[list[GGUFValueType], Any]:
        if vtype == GGUFValueType.STRING:
            return [vtype], self._string()
        if vtype == GGUFValueType.ARRAY:
            etype = GGUFValueType(self._read("<I"))
            n = self._read("<Q")
            if etype in _NUMPY:
                dtype = np.dtype(_NUMPY[etype])
                if self._pos + n * dtype.itemsize > len(self.buffer):
                    raise GGUFFormatError(f"{self.path}: an array runs past the end of the file")
                arr = np.frombuffer(self.buffer, dtype=dtype, count=n, offset=self._pos)
                self._pos += n * dtype.itemsize
                return [vtype, etype], arr
            if etype == GGUFValueType.STRING:
                return [vtype, etype], [self._string() for _ in range(n)]
            return [vtype, etype], [self._value(etype)[1] for _ in range(n)]  # arrays of arrays
        return [vtype], self._read(_SCALARS[vtype])

    def _parse(self) -> None:
        if self.buffer[:4] != MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (no GGUF magic)")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} (2 and 3 are read)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        for _ in range(n_kv):
            name = self._string()
            types, value = self._value(GGUFValueType(self._read("<I")))
            self.fields[name] = Field(name, types, value)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._read("<Q") for _ in range(self._read("<I")))
            ttype = GGMLQuantizationType(self._read("<I"))
            infos.append((name, dims, ttype, self._read("<Q")))
        align = self.fields.get("general.alignment")
        align = int(align.value) if align is not None else DEFAULT_ALIGNMENT
        start = -(-self._pos // align) * align
        for name, dims, ttype, offset in infos:
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, size = GGML_QUANT_SIZES[ttype]
            n_bytes = n * size // block
            if start + offset + n_bytes > len(self.buffer):
                raise GGUFFormatError(f"{self.path}: tensor {name} runs past the end of the file")
            self.tensors.append(Tensor(name, ttype, dims, n, n_bytes, start + offset, self))


def open_gguf(path: str | Path) -> GGUFFile:
    return GGUFFile(path)
