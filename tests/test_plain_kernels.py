"""The plain engine's batch steps through the proved small-M kernels
(engines/mlx_plain/kernels.py), on the CPU.

A 4-bit tiny Qwen3 (mlx-lm's converter, float32 activations) served by the
real MLXPlainEngine, with a guard whose only kernel is a correct one (the
stock op, counted, as in test_kernel_wiring.py):
- every width 2..16 is proved in the background, then the batch steps of
  concurrent requests run through the kernel at their batch's rows, with
  no proof inside a step, and each request's tokens equal greedy decoding;
- a request alone (the lone loop, lone.py) runs through it at one row
  where the kernel is written for one row: each layer's compiled one-row
  halves traced through it, and an lm_head of hook.WIDE_N columns; with
  greedy's tokens;
- its steps report `kernels`, so the policy forgets the stock steps' costs;
- with `kernels: off` nothing is proved and the kernel never runs.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from greedy import assert_same_greedy, greedy_reference
from test_kernel_wiring import Counting, Weights, counting_guard

from specgate.builders.tiny import build_qwen3_dense
from specgate.engines.base import GenerationRequest, Plan, RoundStats, SamplingParams, TokenEvent
from specgate.engines.loading import load_mlx_model
from specgate.engines.mlx_plain.engine import MLXPlainEngine
from specgate.engines.mlx_plain.kernels import WIDTHS
from specgate.kernels import hook, qmm, wiring
from specgate.kernels.guard import FUSED_QMM, QMM, Candidate, Guard
from specgate.policies.live_costs import LiveCosts

N_TOKENS = 16
PLAN = Plan("mlx_plain", "none", 0, "concurrency")


class FusedWeights:
    """A correct fused kernel (guard.FUSED_QMM: the stock op per part),
    noting each call's rows and its parts' weights (by id)."""

    def __init__(self):
        self.calls: list[tuple[int, tuple[int, ...]]] = []

    def __call__(self, x, *args):
        gs, bits, parts = args[-2], args[-1], range(0, len(args) - 2, 3)
        self.calls.append((x.size // x.shape[-1], tuple(id(args[i]) for i in parts)))
        return [qmm.reference_qmm(x, *args[i : i + 3], gs, bits) for i in parts]


def quantized(root, vocab: int, **dims):
    from mlx_lm import convert

    src = build_qwen3_dense(root / "f32", vocab_size=vocab, **dims)
    dest = root / "q4"
    convert(str(src), mlx_path=str(dest), quantize=True, q_group_size=64, q_bits=4,
            dtype="float32")  # fmt: skip
    return load_mlx_model(str(dest))


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    return quantized(tmp_path_factory.mktemp("plain_kernels"), 1024)


def prompts(vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(vocab - 3) for _ in range(rng.randint(20, 40))] for _ in range(n)]


async def serve(engine, rid: str, prompt: list[int], n: int = N_TOKENS):
    request = GenerationRequest(rid, "m", prompt, SamplingParams(temperature=0), n, PLAN,
                                cache_scope=rid)  # fmt: skip
    tokens, steps = [], []
    async for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            tokens += event.token_ids
        elif isinstance(event, RoundStats):
            steps.append(event)
    return tokens, steps


def run(loaded, guard, body, **kw):
    async def main():
        engine = MLXPlainEngine("m", loaded, max_context=2048, max_concurrent=4, prefix_cache_size=0,
                                kernel_guard=guard, **kw)  # fmt: skip
        try:
            assert await asyncio.to_thread(engine.kernels_ready, 120)
            await engine.start()
            return engine, await body(engine)
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_batch_steps_run_through_the_proved_kernels_and_decode_greedy(q4, tmp_path):
    kernel = Counting()
    guard = counting_guard(tmp_path, kernel)
    asks = prompts(q4.vocab_size, 3)
    lone_prompt = prompts(q4.vocab_size, 4)[-1]

    async def body(engine):
        assert engine.batch_kernels.on  # proved and warmed before the first request
        checks = guard.checks_run
        kernel.rows.clear()
        together = await asyncio.gather(*(serve(engine, f"r{i}", p) for i, p in enumerate(asks)))
        batch_rows, proofs = list(kernel.rows), guard.checks_run - checks
        kernel.rows.clear()
        alone = await serve(engine, "alone", lone_prompt)
        return together, batch_rows, proofs, alone, list(kernel.rows)

    engine, (together, batch_rows, proofs, alone, lone_rows) = run(q4, guard, body)
    shapes = wiring.model_shapes(q4.model)
    assert engine.batch_kernels.wiring.widths == tuple(WIDTHS)
    assert guard.checks_run == len(shapes) * len(WIDTHS)  # every width, proved before serving
    assert proofs == 0  # none inside a step
    # The three streams' steps (and two's, once one ended) through the kernel.
    assert 3 in batch_rows and set(batch_rows) <= set(WIDTHS)
    for prompt, (tokens, _) in zip(asks, together, strict=True):
        assert_same_greedy(tokens, *greedy_reference(q4.model, prompt, N_TOKENS))
    batched = [s for _, steps in together for s in steps if s.batch > 1]
    assert batched and all(s.kernels for s in batched)
    # Alone: the lone loop, stock.
    assert lone_rows == []
    assert_same_greedy(alone[0], *greedy_reference(q4.model, lone_prompt, N_TOKENS))


def test_a_lone_request_s_one_row_steps_run_through_the_kernels(tmp_path_factory, tmp_path):
    """A kernel written for one row too (as the tensor-core one is), and a
    vocabulary of hook.WIDE_N: every shape is proved at one row as well;
    each layer gets one-row halves traced through the kernel
    (forwards/one_row.py), which the lone loop runs, while its lm_head goes
    through the kernel outside the trace; the tokens are greedy decoding's."""
    wide = quantized(tmp_path_factory.mktemp("plain_kernels_wide"), hook.WIDE_N, num_hidden_layers=1,
                     hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    kernel, fused = Weights(), FusedWeights()

    def fused_rows(m, k, ns, *rest):  # one row for q/k/v only: gate/up stays stock there
        return 1 <= m <= qmm.MAX_M and (m > 1 or len(ns) == 3)

    guard, fused_guard = (Guard([Candidate(name, "1", fn, supports)], cache_dir=tmp_path,
                                machine="test-machine", reps=2, inner=1, margin=float("inf"), op=op)
                          for name, fn, supports, op in (
                              ("count", kernel, lambda m, *shape: 1 <= m <= qmm.MAX_M, QMM),
                              ("count_fused", fused, fused_rows, FUSED_QMM)))  # fmt: skip
    prompt = prompts(wide.vocab_size, 1)[0]
    layer = wide.model.model.layers[0]
    lm_head = id(wide.model.lm_head["weight"])
    qkv, gate_up = ({id(m["weight"]) for m in group}
                    for group in sorted(hook.fuse_groups(layer), key=len, reverse=True))  # fmt: skip
    alone = {id(m["weight"]) for _, m in layer.named_modules() if hook.eligible(m)} - qkv - gate_up
    runs = {"kernels": 0, "stock": 0}

    def counted(fn, key):
        def call(*args):
            runs[key] += 1
            return fn(*args)

        return call

    async def body(engine):
        # Traced at the switch: each of the layer's linears at one row, q/k/v
        # in one launch; gate/up, whose group has no kernel at one row, in
        # the group's one stock launch (hook.fuse_siblings), not one each.
        one_row = {w for m, w in kernel.calls if m == 1}
        assert alone and one_row >= alone and not one_row & (qkv | gate_up)
        assert qkv <= {w for m, ws in fused.calls if m == 1 for w in ws}
        before, after, enabled = layer.__dict__["_specgate_one_row_kernels"]
        layer.__dict__["_specgate_one_row_kernels"] = (counted(before, "kernels"), after, enabled)
        stock = layer.__dict__["_specgate_one_row"]
        layer.__dict__["_specgate_one_row"] = (counted(stock[0], "stock"), *stock[1:])
        kernel.calls.clear()
        fused.calls.clear()
        return await serve(engine, "alone", prompt)

    engine, (tokens, _) = run(wide, guard, body, kernel_fused_guard=fused_guard)
    assert engine.batch_kernels.on and engine.batch_kernels.one_row_layers == 1
    assert guard.checks_run == len(wiring.model_shapes(wide.model)) * (1 + len(WIDTHS))
    assert fused_guard.checks_run == len(wiring.group_shapes(wide.model)) * (1 + len(WIDTHS)) - 1
    assert engine.lone_tokens > 0
    # Every step's layer through the traced kernel halves (replayed: the
    # kernel's Python is not called again), its lm_head through the kernel.
    assert runs["kernels"] >= N_TOKENS - 1 and runs["stock"] == 0
    assert len(kernel.calls) >= N_TOKENS - 1 and set(kernel.calls) == {(1, lm_head)}
    assert fused.calls == []
    want = greedy_reference(wide.model, prompt, N_TOKENS)  # (kernels off: the stock halves)
    assert runs["stock"] > 0
    assert_same_greedy(tokens, *want)


def test_kernels_off_proves_nothing_and_steps_stay_stock(q4, tmp_path):
    kernel = Counting()
    guard = counting_guard(tmp_path, kernel)

    async def body(engine):
        return await asyncio.gather(*(serve(engine, f"r{i}", p) for i, p in enumerate(prompts(q4.vocab_size, 2))))

    engine, together = run(q4, guard, body, kernels="off")
    assert not engine.batch_kernels.on and guard.checks_run == 0 and kernel.rows == []
    assert all(not s.kernels for _, steps in together for s in steps)


def test_plain_batch_costs_start_over_when_the_batch_takes_the_kernels():
    costs = LiveCosts(min_samples=2)

    def step(seconds: float, batch: int, kernels: bool) -> RoundStats:
        return RoundStats("m", "none", 0, seconds=seconds, batch=batch, context_tokens=64, kernels=kernels)

    for _ in range(4):
        costs.observe(step(0.040, 4, False))
        costs.observe(step(0.010, 1, False))
    assert costs.get("none", 4, 0).mean == 0.040
    costs.observe(step(0.012, 4, True))  # switched: its first step is the shape's warm-up
    assert costs.get("none", 4, 0) is None and costs.get("none", 1, 0).mean == 0.010
    for _ in range(2):
        costs.observe(step(0.012, 4, True))
    assert costs.get("none", 4, 0).mean == 0.012
