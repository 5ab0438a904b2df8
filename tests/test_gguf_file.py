"""specgate's GGUF reader (engines/checkpoints/gguf_file.py) reads what gguf's
GGUFReader reads, on the real SmolLM2 file and on a GGUF specgate writes,
and says so when a file is cut short or is not a GGUF."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
from gguf import GGUFReader

from specgate.engines.checkpoints.gguf_file import GGUFFormatError, open_gguf
from specgate.engines.checkpoints.gguf_info import read_gguf
from specgate.engines.checkpoints.info import CheckpointError


def same_as_gguf_reader(path) -> float:
    t0 = time.perf_counter()
    ours = open_gguf(path)
    took = time.perf_counter() - t0
    theirs = GGUFReader(path)
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for name, field in ours.fields.items():
        other = theirs.fields[name]
        assert field.contents() == other.contents(), name
        assert [int(t) for t in field.types] == [int(t) for t in other.types], name
        assert len(field.data) == len(other.data), name
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)  # fmt: skip
        assert a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name
    return took


def test_reads_the_real_gguf_as_gguf_does(smollm2_gguf):
    took = same_as_gguf_reader(smollm2_gguf)
    print(f"open_gguf: {took * 1000:.0f} ms")


def test_reads_a_gguf_specgate_writes(tmp_path):
    from specgate.builders.gguf_export import export_gguf
    from specgate.builders.tiny import build_qwen35_hybrid

    model = build_qwen35_hybrid(tmp_path / "hf", seed=0)
    same_as_gguf_reader(export_gguf(model, tmp_path / "tiny.gguf", outtype="f16"))


def test_a_cut_or_foreign_file_is_an_error_that_says_so(smollm2_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(2_000_000))  # inside the vocabulary
    with pytest.raises(GGUFFormatError, match="truncated or corrupt|past the end"):
        open_gguf(cut)
    with pytest.raises(CheckpointError, match="unreadable GGUF"):
        read_gguf(cut)
    header_only = tmp_path / "header.gguf"
    with open(smollm2_gguf, "rb") as src, open(header_only, "wb") as dst:
        dst.write(src.read(6_000_000))  # the tables whole, the tensors' data cut
    with pytest.raises(GGUFFormatError, match="runs past the end"):
        open_gguf(header_only)
    other = tmp_path / "other.gguf"
    shutil.copy(__file__, other)
    with pytest.raises(GGUFFormatError, match="not a GGUF"):
        open_gguf(other)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="empty"):
        open_gguf(tmp_path / "empty.gguf")
