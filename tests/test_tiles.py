"""A prompt's products while MLX's tiles build (specgate/kernels/tiles.py), on the CPU.

On CUDA, MLX's quantized matmul from 8 rows up is a tile built at its
first call (~27 s); until the builder's workers built the one a product
needs, a watched model computes it as dequantize + matmul. What a CPU
can show of it:
- a row count's range is never wider than one tile's;
- a tile is ready once a job of its range, dtype, bits and group size is
  built, or once the builds finished, and not before;
- a watched linear goes without the tile from 8 rows up while it is not
  ready (under 64 rows in chunks of 7 through MLX's matrix-vector
  kernel, each row as a lone step's; from 64 dequantized, as close to the
  float32 product as the stock one), and the stock path once it is, or
  inside `tiles.stock()` (what a compiled trace records); fewer rows
  never wait for a tile; the kernels' hook leaves the watch when it goes.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import pytest

from specgate.engines import kernel_wiring
from specgate.kernels import hook, tiles, wiring
from specgate.kernels.prebuild import Builder, Job
from specgate.kernels.tiles import TileWatch, row_range


def test_a_row_range_is_never_wider_than_a_tile_s():
    assert [row_range(m) for m in (8, 16, 17, 32, 33, 64, 65, 128, 129, 2048)] == \
        [16, 16, 32, 32, 64, 64, 128, 128, 256, 256]  # fmt: skip


def test_a_tile_is_ready_once_built_or_once_the_builds_finished():
    built: set[tuple] = set()
    finished = threading.Event()
    watch = TileWatch(lambda: built, finished)
    assert not watch.ready(100, mx.float16, 4, 64)
    # Our compiles' groups name a module, not a tile (the first H100 run with both
    # failed every prompt on this: "'>' not supported between 'int' and 'str'").
    built.add(("ours", "cuda_qmm_mma_4a6f"))
    built.add(("qmm", 2048, "float16", 4, 64))  # another range
    built.add(("qmm", 128, "bfloat16", 4, 64))  # another dtype
    built.add(("qmm", 128, "float16", 8, 64))  # other bits
    assert not watch.ready(100, mx.float16, 4, 64)
    built.add(("qmm", 128, "float16", 4, 64))
    assert watch.ready(100, mx.float16, 4, 64) and watch.ready(65, mx.float16, 4, 64)
    assert not watch.ready(16, mx.float16, 4, 64)
    finished.set()  # (what is left, MLX builds where it is called)
    assert watch.ready(16, mx.float16, 4, 64) and watch.ready(3000, mx.bfloat16, 8, 32)


class _Counting(TileWatch):
    """The watch, counting the products it was asked about (instrumentation)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.asked: list[int] = []

    def ready(self, rows, dtype, bits, group_size):
        self.asked.append(rows)
        return super().ready(rows, dtype, bits, group_size)


def _stock(x, lin):
    return mx.quantized_matmul(x, lin.weight, lin.scales, lin.biases, transpose=True, group_size=64,
                               bits=4) + lin.bias  # fmt: skip


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("rows", [40, 100])
def test_a_watched_linear_computes_without_its_tile_until_it_is_built(dtype, rows):
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(256, 384, bias=True))
    nn.quantize(model, group_size=64, bits=4)
    model.set_dtype(dtype)
    lin = model.layers[0]
    built: set[tuple] = set()
    finished = threading.Event()
    watch = _Counting(lambda: built, finished)
    assert hook.watch_tiles(model, watch) == 1
    x = mx.random.normal((2, rows // 2, 256)).astype(dtype)
    stock = _stock(x, lin)
    waiting = model(x)
    assert watch.asked == [rows]
    if rows < tiles.SPLIT_BELOW:  # chunks of 7 rows through MLX's matrix-vector kernel: each row as a lone step
        x2 = x.reshape(rows, 256)
        want = mx.concatenate([_stock(x2[i : i + 7], lin) for i in range(0, rows, 7)]).reshape(stock.shape)
        assert mx.array_equal(waiting, want)
        assert mx.array_equal(waiting[0, :1], _stock(x[0, :1], lin))
    else:
        want = tiles.dequantized_matmul(x, lin.weight, lin.scales, lin.biases, 64, 4) + lin.bias
        assert mx.array_equal(waiting, want)
        # As close to the float32 product as the stock one is (or one rounding of the output).
        exact = x.astype(mx.float32) @ mx.dequantize(lin.weight, lin.scales, lin.biases, 64, 4).T + lin.bias
        err = (waiting.astype(mx.float32) - exact).abs().max().item()
        stock_err = (stock.astype(mx.float32) - exact).abs().max().item()
        assert err <= max(stock_err, 2 * 2.0**-8 * exact.abs().max().item())

    small = mx.random.normal((1, 7, 256)).astype(dtype)  # MLX's precompiled kernel: nothing to wait for
    assert mx.array_equal(model(small), _stock(small, lin))
    with tiles.stock():  # what a compiled trace records
        assert mx.array_equal(model(x), stock)
    assert watch.asked == [rows]

    built.add(("qmm", 128 if rows <= 128 else 256, tiles.dtype_name(dtype), 4, 64))
    assert mx.array_equal(model(x), stock)

    hook.uninstall(model)  # the verify kernels' hook going: the watch stays
    assert lin.__dict__["_specgate_tiles"] is watch


def test_a_real_builder_s_finished_job_readies_its_tile(tmp_path):
    b = Builder(tmp_path, 1, idle_s=0.5)
    watch = TileWatch(b.built_groups, threading.Event())
    assert not watch.ready(200, mx.bfloat16, 4, 64)
    report = b.build([Job("qmm", "stock", (256, 256, 512, "bfloat16", 4, 64))])
    assert report.built == 1
    assert watch.ready(200, mx.bfloat16, 4, 64) and not watch.ready(20, mx.bfloat16, 4, 64)
    b.close()


class _Recording(Builder):
    """A real builder that records the jobs each build call was given (instrumentation)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.given: list[list[tuple]] = []

    def build(self, jobs, **kwargs):
        self.given.append(sorted(j.shape for j in jobs))
        return super().build(jobs, **kwargs)


def _quantized(*dims: tuple[int, int]) -> nn.Module:
    model = nn.Sequential(*(nn.Linear(k, n) for k, n in dims))
    nn.quantize(model, group_size=64, bits=4)
    return model


def test_a_head_beside_its_trunk_queues_only_its_own_shapes(tmp_path, monkeypatch):
    """prebuild_forward on an MTP head after its trunk: the shapes they
    share are queued once, and the head's watch waits for the trunk's
    builds of them as well as its own."""
    b = _Recording(tmp_path, 1, idle_s=0.5)
    monkeypatch.setattr(kernel_wiring, "builder", lambda: b)  # (a CPU has none: a real one here)
    trunk, head = _quantized((256, 384), (384, 256)), _quantized((256, 384), (512, 256))
    threads = [kernel_wiring.prebuild_forward(trunk), kernel_wiring.prebuild_forward(head)]
    assert kernel_wiring.prebuild_forward(_quantized((384, 256))) is None  # nothing new: no build
    for t in threads:
        t.join(300)
    rows = len(wiring.forward_jobs(_quantized((256, 384))))
    assert [len(g) for g in b.given] == [2 * rows, rows]
    assert {shape[1:3] for shape in b.given[1]} == {(512, 256)}
    trunk_watch, head_watch = (m.layers[0].__dict__["_specgate_tiles"] for m in (trunk, head))
    assert len(trunk_watch._finished) == 1 and len(head_watch._finished) == 2
    assert set(trunk_watch._finished) < set(head_watch._finished)
    assert all(e.is_set() for e in head_watch._finished)
    b.close()
