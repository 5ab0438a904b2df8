"""Multi-row forwards over a KV cache's whole buffer (specgate/engines/forwards/kv_buffer.py) change nothing but shapes.

On the CPU (where engines leave the views off) they are forced on:
- one forward of 2..9 rows through the views equals the same forward
  without them, at offsets inside the buffer (past the end: stale keys and
  values a trim left behind, which the mask must hide) and across its
  growth; the keys each layer attends keep the buffer's length from round
  to round. A mask one column too wide (failure injection) must differ;
- ngram decoding with the views on equals plain greedy decoding token for
  token, dense and hybrid (mtp+ngram, the MTP head's cache seen through
  them too: tests/test_ngram_exactness.py);
- a DFlash drafter (attention without a causal part, `visible()`) drafts
  from the same hidden states through the views as without them, round
  after round; without the mask on the buffer's tail (failure injection)
  it does not.
- a DeviceOffsetKV (rows written at a device-side offset) writes them by a
  scatter over the new rows: MLX's CUDA DynamicSliceUpdate (0.32) passes
  over the whole buffer for every write.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from greedy import assert_same_greedy
from mlx_lm.models.cache import KVCache
from test_ngram_exactness import (
    BUILDERS,
    N_TOKENS,
    InjectedNgram,
    corrupted,
    decode,
    prompts,
)
from tiny_targets import TinyTarget

from specgate.builders.drafters import build_dflash_drafter
from specgate.builders.tiny import build_qwen3_dense
from specgate.engines.base import GenerationRequest, Plan, SamplingParams
from specgate.engines.drafting.dflash.model import check_pairing, load_dflash
from specgate.engines.drafting.dflash.proposer import DFlashProposer
from specgate.engines.drafting.ngram.proposer import NgramProposer
from specgate.engines.forwards import kv_buffer
from specgate.engines.forwards.kv_buffer import DeviceOffsetKV
from specgate.engines.mlx_spec.decoder import SpecDecoder


@pytest.fixture(scope="module", params=list(BUILDERS))
def target(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param), tokenizer=False)
    return TinyTarget(path, head=request.param == "qwen35_hybrid")


def rounds(vocab: int, seed: int = 0):
    """Verify-like widths and how many rows each round keeps."""
    rng = random.Random(seed)
    for _ in range(60):
        width = rng.choice([2, 3, 5, 9])
        yield [rng.randrange(vocab) for _ in range(width)], rng.randint(1, width)


def run(target, whole: bool, record: list | None = None):
    """Prefill 200 tokens, then verify-like rounds, trimming the rejected
    rows (stale entries stay in the buffer); the logits of every round."""
    trunk = target.trunk
    cache = trunk.make_cache()
    rng = random.Random(1)
    mx.eval(target.model(mx.array([[rng.randrange(target.vocab) for _ in range(200)]]), cache=cache))
    out = []
    for tokens, kept in rounds(target.vocab):
        seen = kv_buffer.views(cache, len(tokens)) if whole else cache
        logits = target.model(mx.array([tokens]), cache=seen)
        mx.eval(logits)
        out.append(logits)
        if record is not None:
            kv = [v for v in seen if isinstance(v, kv_buffer.WholeBufferKV)]
            record.append((kv[0].offset, kv[0].whole, kv[0].cache.keys.shape[2]))
        for c in cache:
            if isinstance(c, KVCache):
                c.trim(len(tokens) - kept)
            # A hybrid's recurrent state is not rolled back: both runs see the same.
    return out


def test_whole_buffer_forward_equals_the_plain_forward(target):
    record: list = []
    plain, whole = run(target, False), run(target, True, record)
    for a, b in zip(plain, whole, strict=True):
        assert mx.allclose(a, b, atol=1e-5, rtol=1e-5).item()
    assert any(w for _, w, _ in record) and any(not w for _, w, _ in record)  # inside and at growth
    lengths = {n for _, w, n in record if w}
    assert len(lengths) < len({o for o, w, _ in record if w})  # key lengths repeat; offsets do not


def test_a_mask_one_column_too_wide_is_caught(target, monkeypatch):
    """Failure injection: the mask also shows the first stale position past
    the end; the forward must then differ from the plain one."""
    plain = run(target, False)
    real = kv_buffer.WholeBufferKV.make_mask

    def too_wide(self, n, return_array=False, window_size=None):
        mask = real(self, n, return_array, window_size)
        if not self.whole:
            return mask
        rows = mx.arange(self.cache.offset, self.cache.offset + n)[:, None]
        return mask | (mx.arange(mask.shape[-1])[None] == rows + 1)

    monkeypatch.setattr(kv_buffer.WholeBufferKV, "make_mask", too_wide)
    wrong = run(target, True)
    assert not all(mx.allclose(a, b, atol=1e-5).item() for a, b in zip(plain, wrong, strict=True))


@pytest.fixture
def whole_buffer(target):
    target.trunk.whole_buffer = True
    yield target
    target.trunk.whole_buffer = kv_buffer.HELPS


@pytest.mark.parametrize("depth", [2, 8])
def test_ngram_through_whole_buffers_equals_plain_greedy(whole_buffer, depth):
    target = whole_buffer
    for i, prompt in enumerate(prompts(target.vocab, 6)):
        want, margins = target.reference(prompt, N_TOKENS)
        earlier = prompt + corrupted(want, random.Random(i), target.vocab, 2 * depth + 2)
        for proposer in (NgramProposer(), InjectedNgram(earlier)):
            got, rounds_, _ = decode(target, prompt, depth, proposer)
            assert_same_greedy(got, want, margins)
            assert any(r.drafted for r in rounds_) or isinstance(proposer, NgramProposer)


class RecordingDFlash(DFlashProposer):
    """Keeps the drafter's output of every pass."""

    def _pass(self, embed, last):
        out = super()._pass(embed, last)
        self.outputs = [*getattr(self, "outputs", []), out]
        return out


def dflash_outputs(target, prompt, whole: bool):
    target.trunk.whole_buffer = whole
    try:
        request = GenerationRequest("t", "m", prompt, SamplingParams(temperature=0), 40,
                                    Plan("mlx_dflash", "dflash", 3, "spec_on"))  # fmt: skip
        proposer = RecordingDFlash(target.trunk, target.drafter)
        decoder = SpecDecoder(target.trunk, proposer, request, None, 0, None)
        step = decoder.prefill()
        while step.finish_reason is None:
            step = decoder.round(3)
        return proposer.outputs
    finally:
        target.trunk.whole_buffer = kv_buffer.HELPS


@pytest.fixture(scope="module")
def dflash_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    t = build_qwen3_dense(root / "target", tokenizer=False)
    d = build_dflash_drafter(root / "dflash", target=t, block_size=4, num_hidden_layers=2,
                             tokenizer=False)  # fmt: skip
    return TinyTarget(t, drafter=d, loader=load_dflash, pairing=check_pairing)


@pytest.mark.parametrize("mask", ["visible", "none"])
def test_dflash_drafter_through_whole_buffers_drafts_the_same(dflash_target, mask, monkeypatch):
    if mask == "none":  # failure injection: the stale tail of the buffer left visible
        monkeypatch.setattr(kv_buffer.WholeBufferKV, "visible", lambda self: None)
    same = []
    for prompt in [[3, 1, 4, 1, 5, 9, 2, 6], list(range(2, 30))]:
        plain, whole = dflash_outputs(dflash_target, prompt, False), dflash_outputs(dflash_target, prompt, True)
        assert len(plain) == len(whole) > 5
        same += [mx.allclose(a, b, atol=1e-5).item() for a, b in zip(plain, whole, strict=True)]
    assert all(same) if mask == "visible" else not all(same)


def test_device_offset_writes_scatter_the_new_rows_only():
    import io
    import re

    cache = KVCache()
    first = mx.random.normal((1, 2, 3, 8))
    cache.update_and_fetch(first, first + 1)
    kv = DeviceOffsetKV(cache)
    new = mx.random.normal((1, 2, 2, 8))
    keys, values = kv.update_and_fetch(new, new + 1)
    dot = io.StringIO()
    mx.export_to_dot(dot, keys, values)  # (before anything evaluates the graph)
    ops = set(re.findall(r'label ="?([A-Za-z]+)', dot.getvalue()))
    assert "ScatterAxis" in ops and "DynamicSliceUpdate" not in ops, ops
    assert mx.array_equal(keys[:, :, :3], first) and mx.array_equal(keys[:, :, 3:5], new)
    assert mx.array_equal(values[:, :, 3:5], new + 1) and int(kv.offset) == 5
    assert not mx.any(keys[:, :, 5:]).item()  # the rest of the buffer untouched
