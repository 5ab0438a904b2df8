"""Where a lone plain request's time goes, against mlx-lm's own loops (a GPU probe).

    python bench/plain_probe.py [--tokens 256] [--prompt 128] [--reps 5] [--variants ...]
    python bench/plain_probe.py --tiny          # the same on a CPU, small

The model is bench/e2e_mtp_7b.py's 7B-class qwen3 (4-bit, group 64, the
bigram path so greedy decoding is stable). Variants, timed interleaved, each
decoding --tokens greedy tokens after a --prompt-token prompt; tok/s count
the tokens after the first:
- generate_step: mlx-lm's own loop (the baseline);
- lone: specgate's plain engine (MLXPlainEngine, through its async
  generate()), a lone request on its lone loop (engines/mlx_plain/lone.py);
- batch1: the same engine with the lone loop off (a batch of one);
- batchgen: mlx-lm's BatchGenerator driven directly, one sequence;
- fused: generate_step on the model as specgate loads it, each layer's
  q/k/v and gate/up decoded by one stock quantized matmul over their joined
  weights (kernels/hook.fuse_siblings: fewer launches, the same numbers).
  The engine variants run on the model as loading prepares what it serves
  (loading.prepare_for_decoding: fused siblings and compiled one-row
  halves); mlx-lm's on the model as built;
- mlpc: generate_step on a model whose layers' MLP and residual adds are
  compiled (`mx.compile` per layer: the one-row attention stays as it is),
  an experiment: fewer kernels and Python calls a token;
- layerc: generate_step on a model whose one-row layers run as two
  compiled halves around the cache write and the attention (norm, q/k/v,
  q/k norms and RoPE at an array offset; then o_proj, residual, norm, MLP,
  residual): the attention keeps MLX's one-row kernel, the rest is
  replayed from C++;
- mma1: generate_step with every one-row quantized matmul through
  specgate's tensor-core kernel (kernels/qmm_mma.py; q/k/v and gate/up in
  one fused launch each), unproved (no guard: an experiment, CUDA only),
  where stock uses MLX's qmv.
- mmac: layerc and mma1 together: the kernels' launches inside the
  compiled halves, so MLX replays them from C++ (mma1 paid their Python
  launch cost each token).
Prints tok/s median [min, max] and each variant's ratio to generate_step,
and whether every variant's tokens equal generate_step's.
MLX reads MLX_MAX_OPS_PER_BUFFER (ops per CUDA graph) at its start: run the
probe once per value to compare it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_mtp_7b import build  # noqa: E402  (bench/, beside this file)

from specgate.engines.base import GenerationRequest, Plan, SamplingParams, TokenEvent  # noqa: E402
from specgate.engines.cache.prefix_cache import PrefixCache  # noqa: E402
from specgate.engines.loading import LoadedModel, prepare_for_decoding  # noqa: E402
from specgate.engines.mlx_plain.engine import MLXPlainEngine  # noqa: E402
from specgate.kernels import hook  # noqa: E402

VARIANTS = ("generate_step", "lone", "batch1", "batchgen", "fused", "mlpc", "layerc", "mma1", "mmac")


def compile_mlps(model) -> None:
    """Each decoder layer's second half (h = x + attn; h + mlp(norm(h)))
    compiled: this instance's layers get a subclass calling it."""
    for layer in model.model.layers:
        post = mx.compile(lambda x, r, layer=layer: (h := x + r) + layer.mlp(
            layer.post_attention_layernorm(h)))  # fmt: skip

        def call(self, x, mask=None, cache=None, post=post):
            return post(x, self.self_attn(self.input_layernorm(x), mask, cache))

        layer.__class__ = type("CompiledPost" + type(layer).__name__, (type(layer),), {"__call__": call})


def compile_layers(model) -> None:
    """Each qwen3 decoder layer, for one row on a KV cache, as two compiled
    halves around the cache write and the attention (a bench experiment)."""
    from mlx_lm.models.base import scaled_dot_product_attention

    offsets: dict[int, mx.array] = {}  # one offset array a token, shared by the layers

    for layer in model.model.layers:
        attn = layer.self_attn

        def pre(x, offset, layer=layer, attn=attn):
            h = layer.input_layernorm(x)
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            q = attn.q_norm(q.reshape(1, 1, attn.n_heads, -1)).transpose(0, 2, 1, 3)
            k = attn.k_norm(k.reshape(1, 1, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            v = v.reshape(1, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

        def post(x, o, layer=layer, attn=attn):
            h = x + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(1, 1, -1))
            return h + layer.mlp(layer.post_attention_layernorm(h))

        pre_c, post_c = mx.compile(pre), mx.compile(post)
        stock = type(layer).__call__

        def call(self, x, mask=None, cache=None, pre_c=pre_c, post_c=post_c, stock=stock,
                 attn=attn):  # fmt: skip
            if cache is None or x.shape[:2] != (1, 1):
                return stock(self, x, mask, cache)
            if cache.offset not in offsets:
                offsets.clear()
                offsets[cache.offset] = mx.array(cache.offset)
            q, k, v = pre_c(x, offsets[cache.offset])
            k, v = cache.update_and_fetch(k, v)
            o = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=None)
            return post_c(x, o)

        layer.__class__ = type("CompiledLayer" + type(layer).__name__, (type(layer),), {"__call__": call})


class _Always:
    """A stand-in for kernels/guard.Guard that answers every shape with one
    kernel, unproved (the mma1 experiment measures the kernel itself)."""

    def __init__(self, fn):
        self.fn = fn

    def kernel_for(self, *args):
        return self.fn


def mma_one_row(model) -> None:
    """Every quantized linear of `model` hooked (kernels/hook.install) to the
    tensor-core kernel for any M from 1 (stock hooks start at 2)."""
    from specgate.kernels import qmm, qmm_mma

    qmm.MIN_M = 1  # this bench process only: the hook's lower bound
    hook.install(model, _Always(qmm_mma.cuda_qmm_mma), _Always(qmm_mma.cuda_qmm_mma_fused))


def word_tokenizer(vocab: int):
    """A real tokenizer (HF tokenizers, mlx-lm's wrapper) over `vocab` words,
    so the engine detokenizes every token as it would a model's."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok))


def loaded_model(model, vocab: int) -> LoadedModel:
    return LoadedModel("probe", model, word_tokenizer(vocab),
                       {"vocab_size": vocab, "max_position_embeddings": 32768},
                       PrefixCache("probe", max_entries=0))  # fmt: skip


# ---------------------------------------------------------------- the variants


def run_generate_step(model, prompt, n):
    from mlx_lm.generate import generate_step

    tokens, t0 = [], None
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                  sampler=lambda lp: mx.argmax(lp, axis=-1)):  # fmt: skip
        if t0 is None:
            t0 = time.perf_counter()
        tokens.append(int(token))
    return tokens, (len(tokens) - 1) / (time.perf_counter() - t0)


def step_phases(model, prompt, n) -> dict[str, float]:
    """generate_step's loop by hand, each token's host time cut in three
    (median ms): building the next step's graph in Python, queueing it
    (`mx.async_eval`: MLX encodes its kernels on this thread), and waiting
    for the current token."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)

    def step(y):
        logits = model(y[None], cache=cache)[:, -1, :]
        return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)

    mx.eval(model(mx.array([prompt[:-1]]), cache=cache))
    y = step(mx.array(prompt[-1:]))
    mx.async_eval(y)
    build, queue, wait = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        nxt = step(y)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.item()
        t3 = time.perf_counter()
        build.append(t1 - t0), queue.append(t2 - t1), wait.append(t3 - t2)
        y = nxt
    return {k: statistics.median(v) * 1000 for k, v in
            (("build", build), ("queue", queue), ("wait", wait))}  # fmt: skip


def run_batchgen(model, prompt, n):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8,
                         prefill_step_size=512, sampler=lambda lp: mx.argmax(lp, axis=-1))  # fmt: skip
    gen.insert([prompt], max_tokens=[n])
    tokens, t0 = [], None
    while len(tokens) < n:
        _, responses = gen.next()
        for r in responses:
            if t0 is None:
                t0 = time.perf_counter()
            tokens.append(r.token)
    gen.close()
    return tokens, (len(tokens) - 1) / (time.perf_counter() - t0)


class Engines:
    """The plain engine with and without its lone loop, on one event loop."""

    def __init__(self, loaded: LoadedModel):
        self.loop = asyncio.new_event_loop()
        self.engines = {lone: MLXPlainEngine("probe", loaded, max_context=32768, lone=lone,
                                             prefix_cache_size=0) for lone in (True, False)}  # fmt: skip
        for e in self.engines.values():
            self.loop.run_until_complete(e.start())

    def run(self, lone: bool, prompt, n):
        async def go():
            req = GenerationRequest(f"r{time.monotonic_ns()}", "probe", prompt,
                                    SamplingParams(temperature=0.0), n,
                                    Plan("mlx_plain", "none", 0, "forced_by_request"))  # fmt: skip
            tokens, t0 = [], None
            async for ev in self.engines[lone].generate(req):
                if isinstance(ev, TokenEvent) and ev.token_ids:
                    if t0 is None:
                        t0 = time.perf_counter()
                    tokens += ev.token_ids
            return tokens, (len(tokens) - 1) / (time.perf_counter() - t0)

        return self.loop.run_until_complete(go())

    def close(self):
        for e in self.engines.values():
            self.loop.run_until_complete(e.stop())
        self.loop.close()


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    variants = a.variants.split(",")
    shape = dict(hidden=4096, layers=28, mlp=12288, heads=32, kv_heads=8, head_dim=128,
                 vocab=151936)  # fmt: skip
    if a.tiny:
        shape = dict(hidden=256, layers=4, mlp=768, heads=4, kv_heads=2, head_dim=64, vocab=4096)
        a.tokens, a.reps = min(a.tokens, 48), min(a.reps, 3)
    ns = SimpleNamespace(**shape, seed=0, embed_scale=16.0, margin=20.0)
    t0 = time.perf_counter()

    def quantized():
        model, _, _ = build(ns)
        nn.quantize(model, group_size=64, bits=4)
        mx.eval(model.parameters())
        return model

    model, fused, served = quantized(), quantized(), quantized()  # the same seed: the same weights
    hook.fuse_siblings(fused)
    prepare_for_decoding(served)  # as loading.py prepares a model it serves
    mlpc = layerc = None
    if "mlpc" in variants:
        mlpc = quantized()
        compile_mlps(mlpc)
    if "layerc" in variants:
        layerc = quantized()
        compile_layers(layerc)
    mma1 = mmac = None
    if "mma1" in variants:
        mma1 = quantized()
        mma_one_row(mma1)
    if "mmac" in variants:
        mmac = quantized()
        mma_one_row(mmac)
        compile_layers(mmac)
    print(f"device {mx.default_device()}, mlx {mx.__version__}, "
          f"MLX_MAX_OPS_PER_BUFFER={os.environ.get('MLX_MAX_OPS_PER_BUFFER', 'default')}; "
          f"model built in {time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
    rng = random.Random(1)
    prompt = [rng.randrange(ns.vocab) for _ in range(a.prompt)]
    engines = Engines(loaded_model(served, ns.vocab)) if {"lone", "batch1"} & set(variants) else None

    def once(v):
        if v == "generate_step":
            return run_generate_step(model, prompt, a.tokens)
        if v == "batchgen":
            return run_batchgen(model, prompt, a.tokens)
        if v == "fused":
            return run_generate_step(fused, prompt, a.tokens)
        if v == "mlpc":
            return run_generate_step(mlpc, prompt, a.tokens)
        if v == "layerc":
            return run_generate_step(layerc, prompt, a.tokens)
        if v in ("mma1", "mmac"):
            with hook.kernels(True):
                return run_generate_step(mma1 if v == "mma1" else mmac, prompt, a.tokens)
        return engines.run(v == "lone", prompt, a.tokens)

    results = {v: [] for v in variants}
    want, _ = run_generate_step(model, prompt, a.tokens)
    same = {}
    for v in variants:  # warm-up (JIT, graph caches)
        tokens, _ = once(v)
        same[v] = tokens == want
    for _ in range(a.reps):
        for v in variants:
            tokens, tps = once(v)
            same[v] = same[v] and tokens == want
            results[v].append(tps)
    if engines is not None:
        engines.close()
    for name, m in (("stock", model), ("fused", fused), ("mlpc", mlpc), ("layerc", layerc),
                    ("mma1", mma1), ("mmac", mmac)):  # fmt: skip
        if m is None:
            continue
        with hook.kernels(name in ("mma1", "mmac")):
            ph = step_phases(m, prompt, a.tokens)
        print(f"generate_step's loop by hand ({name}), ms per token: build {ph['build']:.2f} | "
              f"queue (MLX encodes) {ph['queue']:.2f} | wait {ph['wait']:.2f}")  # fmt: skip
    base = results.get("generate_step")
    print(f"\n{a.tokens} tokens after a {a.prompt}-token prompt, {a.reps} interleaved reps")
    print(f"{'variant':14} {'tok/s median [min, max]':28} {'/ generate_step':24} same tokens")
    for v in variants:
        r = results[v]
        ratio = ""
        if base:
            q = [x / y for x, y in zip(r, base, strict=True)]
            ratio = f"{statistics.median(q):.3f} [{min(q):.3f}, {max(q):.3f}]"
        print(f"{v:14} {statistics.median(r):8.1f} [{min(r):7.1f}, {max(r):7.1f}]    {ratio:24} "
              f"{same[v]}")  # fmt: skip


if __name__ == "__main__":
    main()
