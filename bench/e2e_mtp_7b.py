"""End to end at a 7B-class shape: plain decoding vs MTP speculative decoding, stock vs specgate's kernels.

    python bench/e2e_mtp_7b.py [--precisions 4b,bf16] [--accept 0.6,0.8] [--depths 1,2,3,4]
                               [--tokens 128] [--prompt 128] [--home DIR] [--out FILE] [--json FILE]
    python bench/e2e_mtp_7b.py --tiny --test-kernel      # the same path on a CPU, small

The target: mlx-lm's qwen3 (hidden 4096, 28 layers, 32 query / 8 KV heads,
head dim 128, MLP 12288, vocab 151936, untied lm_head), random weights, in
bfloat16 and 4-bit (nn.quantize, group 64, embedding and lm_head included),
so every forward costs what a 7B forward costs. Two things are built in so
that the greedy output is known and stable:
- a bigram path: embedding rows are scaled up (entries ~ --embed-scale) so
  the final hidden state points mostly along the current token's embedding,
  and row sigma(t) of the lm_head gets + (margin / sqrt(hidden)) * unit(e(t))
  for a fixed random permutation sigma of the vocabulary. Greedy decoding
  then follows t -> sigma(t) by a wide logit margin (printed), so that the
  rounding differences between a 1-row and a k-row forward (or the kernel's
  float32 accumulation) cannot flip a greedy choice, as they would among
  151936 random logits. All layers still run at full cost.
- acceptance known by construction. First the greedy continuation is
  decoded plainly (mlx-lm's generate_step: the plain tokens/s, and the
  exactness reference). Then the product's own SpecDecoder decodes the same
  prompt with an MTP head of the real shape (fc 2*hidden -> hidden, one
  qwen3 decoder layer, the trunk's shared lm_head; random weights, quantized
  with the trunk at 4-bit, so its cost is real and in the round's graph),
  but each proposed token is replaced, per draft position, by the reference
  continuation's token with probability a and by a different token
  otherwise (a Bernoulli per draft position from a seeded generator, the
  same sequence for stock and kernels). Verification, acceptance and
  rollback are the product's (engines/mlx_spec/decoder.py); a replaced token is
  accepted exactly when the trunk agrees, so the measured per-position
  acceptance (accepted / positions reached) is printed next to a.
The speculative output must equal the plain output token for token
(exactness, checked for every run). Kernels: kernels/wiring.prepare, as the
MTP engine does at load, sibling linears fused (the guard proves every verify width 2..max depth+1
on this machine first; bf16 has no quantized linears: stock only).
Tokens/s count the tokens after the first (prefill and its token excluded),
each run after a warm-up decode at the same depth and kernel setting.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specgate.engines.base import GenerationRequest, Plan, SamplingParams  # noqa: E402
from specgate.engines.drafting.base import Proposal  # noqa: E402
from specgate.engines.drafting.mtp.head import MTPHead  # noqa: E402
from specgate.engines.drafting.mtp.proposer import MTPProposer  # noqa: E402
from specgate.engines.home import kernel_cache_dir  # noqa: E402
from specgate.engines.mlx_spec.decoder import SpecDecoder  # noqa: E402
from specgate.engines.targets import target_for  # noqa: E402
from specgate.kernels import qmm, wiring  # noqa: E402
from specgate.kernels.guard import FUSED_QMM, Candidate, Guard, cuda_mma_fused_candidate  # noqa: E402

OUT: list = []  # the --out file, written line by line (a run cut short keeps what it said)


def say(s: str = "") -> None:
    print(s, flush=True)
    for f in OUT:
        f.write(s + "\n")
        f.flush()


# ---------------------------------------------------------------- the target


def build(a) -> tuple[nn.Module, MTPHead, list[int]]:
    """The qwen3 trunk with the bigram path, its MTP head, and sigma."""
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=a.hidden, num_hidden_layers=a.layers,
                           intermediate_size=a.mlp, num_attention_heads=a.heads,
                           rms_norm_eps=1e-6, vocab_size=a.vocab, num_key_value_heads=a.kv_heads,
                           max_position_embeddings=32768, head_dim=a.head_dim,
                           tie_word_embeddings=False, rope_theta=1e6)  # fmt: skip
    mx.random.seed(a.seed)
    model = qwen3.Model(args)
    head = MTPHead(a.hidden, args.rms_norm_eps, [qwen3.TransformerBlock(args)])
    rng = random.Random(a.seed)
    sigma = list(range(a.vocab))
    rng.shuffle(sigma)
    inner = model.model
    e = mx.random.normal((a.vocab, a.hidden), key=mx.random.key(a.seed + 1)) * a.embed_scale
    unit = e / mx.linalg.norm(e, axis=-1, keepdims=True)
    inv = [0] * a.vocab
    for t, s in enumerate(sigma):
        inv[s] = t
    bonus = (a.margin / math.sqrt(a.hidden)) * unit[mx.array(inv)]  # row sigma(t) += .. unit(e(t))
    inner.embed_tokens.weight = e
    model.lm_head.weight = model.lm_head.weight + bonus
    model.set_dtype(mx.bfloat16)
    head.set_dtype(mx.bfloat16)
    mx.eval(model.parameters(), head.parameters())
    return model, head, sigma


# ---------------------------------------------------------------- decoding


def plain(model, prompt: list[int], n: int, margins: bool = False):
    """mlx-lm greedy generate_step: tokens, tokens/s after the first, and
    (margins=True) the top-1 - top-2 logit margin at each position."""
    from mlx_lm.generate import generate_step

    tokens, gaps, t0 = [], [], None
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=n,
                                         sampler=lambda lp: mx.argmax(lp, axis=-1)):  # fmt: skip
        if t0 is None:
            t0 = time.perf_counter()
        tokens.append(int(token))
        if margins:
            top2 = mx.topk(logprobs, 2).tolist()
            gaps.append(abs(top2[1] - top2[0]))
    dt = time.perf_counter() - t0
    return tokens, (len(tokens) - 1) / dt, gaps


class OracleDrafts(MTPProposer):
    """The head drafts (its work stays in the round's graph); each proposal is
    then the reference token with probability a, else a different token."""

    def __init__(self, *args, reference: list[int], accept: float, seed: int, vocab: int):
        super().__init__(*args)
        self.reference, self.accept, self.vocab = reference, accept, vocab
        self.rng = random.Random(seed)

    def propose(self, context, depth):
        proposal = super().propose(context, depth)
        drafts, forced = proposal.drafts, []
        for j in range(depth):
            i = context.generated + j
            ref = self.reference[i] if i < len(self.reference) else 0
            ok = self.rng.random() < self.accept
            forced.append(ref if ok else (ref + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab)
        forced = mx.array(forced, dtype=drafts.dtype)
        # always `forced`, after the head ran
        return Proposal(mx.where(drafts >= 0, forced, drafts), proposal.q)


def mtp(trunk, head, prompt, n, depth, reference, accept, seed, vocab):
    request = GenerationRequest("e2e", "e2e", prompt, SamplingParams(temperature=0), n,
                                Plan("mlx_mtp", "mtp", depth, "spec_on"))  # fmt: skip
    oracle = OracleDrafts(trunk, head, reference=reference, accept=accept, seed=seed, vocab=vocab)
    dec = SpecDecoder(trunk, oracle, request, None, 0, None)
    step = dec.prefill()
    t0 = time.perf_counter()
    tokens, acc, reached, rounds = list(step.tokens), 0, 0, 0
    while step.finish_reason is None:
        step = dec.round(depth)
        tokens += step.tokens
        n_acc = step.stats.accepted
        acc += n_acc
        reached += min(n_acc + 1, step.stats.drafted)
        rounds += 1
    dt = time.perf_counter() - t0
    return tokens, (len(tokens) - 1) / dt, acc / max(reached, 1), (len(tokens) - 1) / max(rounds, 1)


def first_diff(got: list[int], want: list[int]) -> int | None:
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


# ---------------------------------------------------------------- the run


def run_precision(prec: str, model, head, sigma, a, guard, fused) -> list[dict]:
    rng = random.Random(a.seed + 7)
    prompt = [rng.randrange(a.vocab) for _ in range(a.prompt)]
    t0 = time.perf_counter()
    trunk = target_for(model)
    depths = [int(d) for d in a.depths.split(",")]
    wired = wiring.prepare(model, a.kernels, range(2, max(depths) + 2), guard=guard, fused_guard=fused)
    say(f"\n[{prec}] kernels: {wired.reason} ({time.perf_counter() - t0:.1f} s)")
    if wired.enabled:
        for v in wired.verdicts() + wired.fused_verdicts():
            say("   " + wiring.describe(v))
    modes = ["stock"] + (["kernels"] if wired.enabled and wired.in_use() else [])

    reference, _, gaps = plain(model, prompt, a.tokens, margins=True)  # also the warm-up
    follows = sum(reference[i + 1] == sigma[reference[i]] for i in range(len(reference) - 1))
    say(f"[{prec}] reference: {len(reference)} tokens, {follows}/{len(reference) - 1} follow the "
        f"bigram, top-2 logit margin min {min(gaps):.2f} median {sorted(gaps)[len(gaps) // 2]:.2f}")  # fmt: skip
    plain_tps = []
    for _ in range(a.plain_reps):
        toks, tps, _ = plain(model, prompt, a.tokens)
        assert toks == reference, "plain decoding is not deterministic"
        plain_tps.append(tps)
    p_tps = sorted(plain_tps)[len(plain_tps) // 2]
    say(f"[{prec}] plain: {p_tps:.1f} tok/s (median of {a.plain_reps}: "
        + ", ".join(f"{t:.1f}" for t in plain_tps) + ")")  # fmt: skip

    rows = []
    for depth in depths:
        for mode in modes:  # warm-up: this depth's widths compile / JIT once
            trunk.kernels = mode == "kernels"
            mtp(trunk, head, prompt, min(24, a.tokens), depth, reference, 0.7, 1, a.vocab)
        for acc in [float(x) for x in a.accept.split(",")]:
            row = {"precision": prec, "a": acc, "depth": depth, "plain": p_tps}
            seed = int(acc * 1000) + depth
            for _rep in range(a.reps):
                for mode in modes:  # alternated, so drift hits both alike
                    trunk.kernels = mode == "kernels"
                    toks, tps, measured, per_round = mtp(trunk, head, prompt, a.tokens, depth,
                                                         reference, acc, seed, a.vocab)  # fmt: skip
                    d = first_diff(toks, reference)
                    row.setdefault(mode, []).append(tps)
                    row[f"{mode} acc"], row[f"{mode} tok/round"] = measured, per_round
                    row[f"{mode} exact"] = row.get(f"{mode} exact", True) and d is None
                    if d is not None:
                        say(f"   !! {prec} a={acc} depth={depth} {mode}: differs from plain at token {d} "
                            f"({toks[d] if d < len(toks) else '-'} vs {reference[d] if d < len(reference) else '-'}, "
                            f"margin {gaps[d] if d < len(gaps) else float('nan'):.2f})")  # fmt: skip
            for mode in modes:
                row[mode] = sorted(row[mode])[len(row[mode]) // 2]
            rows.append(row)
            k = row.get("kernels")
            say(f"   a={acc} depth={depth}: stock {row['stock']:.1f} tok/s"
                + (f", kernels {k:.1f} tok/s" if k else "")
                + f"; acceptance {row['stock acc']:.2f}, {row['stock tok/round']:.2f} tok/round")  # fmt: skip
    trunk.kernels = False
    return rows


def table(rows: list[dict]) -> None:
    say("\nprecision |   a | depth | plain tok/s | MTP stock tok/s | MTP kernels tok/s | "
        "stock/plain | kernels/plain | acceptance measured (stock, kernels) | exact")  # fmt: skip
    for r in rows:
        k, p = r.get("kernels"), r["plain"]
        acc = f"{r['stock acc']:.2f}" + (f", {r['kernels acc']:.2f}" if k else "")
        exact = r["stock exact"] and r.get("kernels exact", True)
        say(f"{r['precision']:>9} | {r['a']:.1f} | {r['depth']:5d} | {r['plain']:11.1f} | "
            f"{r['stock']:15.1f} | {(f'{k:.1f}' if k else '-'):>17} | {r['stock'] / p:10.2f}x | "
            f"{(f'{k / p:.2f}x' if k else '-'):>13} | {acc:>36} | {'yes' if exact else 'NO'}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="4b,bf16")
    ap.add_argument("--accept", default="0.6,0.8")
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1, help="timed runs per (a, depth, mode); median")
    ap.add_argument("--plain-reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=12288)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--embed-scale", type=float, default=16.0)
    ap.add_argument("--margin", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a small model (CPU check of the bench)")
    ap.add_argument("--test-kernel", action="store_true",
                    help="use qmm.emulate_qmm as the kernel, enabled when correct (CPU check)")
    ap.add_argument("--kernels", default="auto", choices=wiring.SETTINGS,
                    help="off: no hook at all (stock only)")
    ap.add_argument("--home", type=Path, default=None, help="SPECGATE_HOME for the verdicts")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        OUT.append(a.out.open("w"))
    if a.tiny:
        a.layers, a.hidden, a.mlp, a.heads, a.kv_heads, a.head_dim, a.vocab = 2, 256, 768, 4, 2, 64, 4096
    cache = kernel_cache_dir(a.home)
    if a.test_kernel:
        guard = Guard([Candidate("emulate", "1", qmm.emulate_qmm)], cache_dir=cache,
                      margin=float("inf"), reps=2, inner=1)  # fmt: skip
    else:
        guard = Guard(cache_dir=cache)
    fused = None if a.test_kernel else Guard([cuda_mma_fused_candidate()], cache_dir=cache, op=FUSED_QMM)
    say(f"mlx {mx.__version__} on {mx.default_device()}; qwen3 hidden {a.hidden}, {a.layers} layers, "
        f"{a.heads}/{a.kv_heads} heads, MLP {a.mlp}, vocab {a.vocab}; prompt {a.prompt}, "
        f"{a.tokens} tokens; verdicts {guard.path}")  # fmt: skip
    t0 = time.perf_counter()
    rows = []
    for prec in a.precisions.split(","):
        if prec not in ("bf16", "4b"):
            raise SystemExit(f"unknown precision {prec}")
        model, head, sigma = build(a)  # the same weights for every precision (seeded)
        if prec == "4b":
            nn.quantize(model, group_size=64, bits=4)
            nn.quantize(head, group_size=64, bits=4)
            mx.eval(model.parameters(), head.parameters())
        say(f"\n[{prec}] built in {time.perf_counter() - t0:.1f} s")
        rows += run_precision(prec, model, head, sigma, a, guard, fused)
        del model, head
        gc.collect()
        mx.clear_cache()
        say(f"[{prec} done at {time.perf_counter() - t0:.0f} s]")
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1))
    table(rows)
    best = [r.get("kernels", r["stock"]) / r["plain"] for r in rows
            if r["precision"] == "4b" and abs(r["a"] - 0.8) < 1e-9]  # fmt: skip
    if best:
        say(f"\ngoal (4-bit, a = 0.8, MTP with kernels >= 2.0x plain): best {max(best):.2f}x -> "
            + ("met" if max(best) >= 2.0 else "not met"))  # fmt: skip


if __name__ == "__main__":
    main()
