"""End to end at Gemma-4 31B's shape: plain decoding vs its assistant drafting, stock vs specgate's kernels.

    python bench/e2e_gemma4.py [--precisions 4b] [--accept 0.6,0.8] [--depths 1,2,3]
                               [--tokens 128] [--prompt 1100] [--out FILE] [--json FILE]
    python bench/e2e_gemma4.py --tiny --test-kernel      # the same path on a CPU, small

The target: mlx-lm's gemma4_text at the published 31B shape (60 layers,
5 sliding-window layers of window 1024 to 1 full, 32 query / 16 K/V
heads, head dim 256 (512 on full layers, proportional RoPE), MLP 21504,
vocab 262144, final logit soft-cap 30), random weights, 4-bit (nn.quantize,
group 64) or bfloat16. The assistant: 4 query-only layers of hidden 1024
(3 sliding, 1 full) attending to the target's K/V, tied head, at the
released 31B assistant's size (~0.5 B parameters). The prompt is longer
than the window, so every verify's rollback crosses wrapped rotating
caches. As in bench/e2e_mtp_7b.py (whose decoding helpers this reuses):
- a bigram path makes the greedy output known and stable: input rows are
  scaled so the last hidden state points along the current token's
  embedding, and lm_head row sigma(t) gets a bonus along it (the head is
  untied here for that; the matmul costs the same as a tied one);
- acceptance is set by construction: the assistant drafts (its whole cost
  stays in the round's graph), then each draft becomes the reference
  continuation's token with probability a, else another token; verify,
  acceptance and rollback are the product's.
The speculative output must equal plain decoding's token for token.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_mtp_7b import OUT, first_diff, plain, say  # noqa: E402

from specgate.engines.base import GenerationRequest, Plan, SamplingParams  # noqa: E402
from specgate.engines.drafting.assistant.gemma4 import AssistantArgs, Gemma4Assistant, check_pairing  # noqa: E402
from specgate.engines.drafting.assistant.proposer import AssistantProposer  # noqa: E402
from specgate.engines.drafting.base import Proposal  # noqa: E402
from specgate.engines.home import kernel_cache_dir  # noqa: E402
from specgate.engines.mlx_load import evaluate_buffers  # noqa: E402
from specgate.engines.mlx_spec.decoder import SpecDecoder  # noqa: E402
from specgate.engines.targets import target_for  # noqa: E402
from specgate.kernels import qmm, wiring  # noqa: E402
from specgate.kernels.guard import FUSED_QMM, Candidate, Guard, cuda_mma_fused_candidate  # noqa: E402


def layer_types(n: int, pattern: int) -> list[str]:
    kinds = (["sliding_attention"] * (pattern - 1) + ["full_attention"]) * n
    return kinds[:n]


def build(a):
    from mlx_lm.models import gemma4_text

    common = dict(rms_norm_eps=1e-6, vocab_size=a.vocab, head_dim=a.head_dim,
                  global_head_dim=a.global_head_dim, num_key_value_heads=a.kv_heads,
                  sliding_window=a.window, hidden_size_per_layer_input=0,
                  vocab_size_per_layer_input=0, use_double_wide_mlp=False,
                  max_position_embeddings=262144)  # fmt: skip
    args = gemma4_text.ModelArgs(
        model_type="gemma4_text", hidden_size=a.hidden, num_hidden_layers=a.layers,
        intermediate_size=a.mlp, num_attention_heads=a.heads, num_kv_shared_layers=0,
        layer_types=layer_types(a.layers, a.pattern), final_logit_softcapping=30.0,
        tie_word_embeddings=False, **common)  # fmt: skip
    mx.random.seed(a.seed)
    model = gemma4_text.Model(args)
    n = a.assistant_layers
    text = gemma4_text.ModelArgs(
        model_type="gemma4_text", hidden_size=a.assistant_hidden, num_hidden_layers=n,
        intermediate_size=4 * a.assistant_hidden, num_attention_heads=a.kv_heads,
        num_kv_shared_layers=n, layer_types=["sliding_attention"] * (n - 1) + ["full_attention"],
        final_logit_softcapping=None, tie_word_embeddings=True, **common)  # fmt: skip
    assistant = Gemma4Assistant(AssistantArgs(a.hidden, text, use_ordered_embeddings=False))
    rng = random.Random(a.seed)
    sigma = list(range(a.vocab))
    rng.shuffle(sigma)
    e = mx.random.normal((a.vocab, a.hidden), key=mx.random.key(a.seed + 1)) * a.embed_scale
    unit = e / mx.linalg.norm(e, axis=-1, keepdims=True)
    inv = [0] * a.vocab
    for t, s in enumerate(sigma):
        inv[s] = t
    bonus = (a.margin / math.sqrt(a.hidden)) * unit[mx.array(inv)]
    # The model multiplies its input rows by sqrt(hidden): store them divided.
    model.model.embed_tokens.weight = e / math.sqrt(a.hidden)
    model.lm_head.weight = model.lm_head.weight + bonus
    model.set_dtype(mx.bfloat16)
    assistant.set_dtype(mx.bfloat16)
    mx.eval(model.parameters(), assistant.parameters())
    evaluate_buffers(model)
    evaluate_buffers(assistant)
    return model, assistant, sigma


class OracleDrafts(AssistantProposer):
    """The assistant drafts; each proposal is then the reference token with
    probability a, else a different token."""

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
        return Proposal(mx.where(drafts >= 0, forced, drafts), proposal.q)  # after the drafter ran


def drafted(trunk, assistant, prompt, n, depth, reference, accept, seed, vocab):
    request = GenerationRequest("e2e", "e2e", prompt, SamplingParams(temperature=0), n,
                                Plan("mlx_assistant", "gemma4_assistant", depth, "spec_on"))  # fmt: skip
    oracle = OracleDrafts(trunk, assistant, reference=reference, accept=accept, seed=seed,
                          vocab=vocab)  # fmt: skip
    dec = SpecDecoder(trunk, oracle, request, None, 0, None)
    step = dec.prefill()
    t0 = time.perf_counter()
    tokens, acc, reached, rounds = list(step.tokens), 0, 0, 0
    while step.finish_reason is None:
        step = dec.round(depth)
        tokens += step.tokens
        acc += step.stats.accepted
        reached += min(step.stats.accepted + 1, step.stats.drafted)
        rounds += 1
    dt = time.perf_counter() - t0
    return tokens, (len(tokens) - 1) / dt, acc / max(reached, 1), (len(tokens) - 1) / max(rounds, 1)


def run_precision(prec, model, assistant, sigma, a, guard, fused) -> list[dict]:
    rng = random.Random(a.seed + 7)
    prompt = [rng.randrange(a.vocab) for _ in range(a.prompt)]
    t0 = time.perf_counter()
    trunk = target_for(model)
    check_pairing(assistant, trunk)
    depths = [int(d) for d in a.depths.split(",")]
    wired = wiring.prepare(model, a.kernels, range(2, max(depths) + 2), guard=guard, fused_guard=fused)
    say(f"\n[{prec}] kernels: {wired.reason} ({time.perf_counter() - t0:.1f} s)")
    modes = ["stock"] + (["kernels"] if wired.enabled and wired.in_use() else [])
    reference, _, gaps = plain(model, prompt, a.tokens, margins=True)  # also the warm-up
    follows = sum(reference[i + 1] == sigma[reference[i]] for i in range(len(reference) - 1))
    say(f"[{prec}] reference: {len(reference)} tokens, {follows}/{len(reference) - 1} follow the "
        f"bigram, top-2 logit margin min {min(gaps):.2f}")  # fmt: skip
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
            drafted(trunk, assistant, prompt, min(24, a.tokens), depth, reference, 0.7, 1, a.vocab)
        for acc in [float(x) for x in a.accept.split(",")]:
            row = {"precision": prec, "a": acc, "depth": depth, "plain": p_tps,
                   "plain runs": plain_tps}  # fmt: skip
            seed = int(acc * 1000) + depth
            for _rep in range(a.reps):
                for mode in modes:  # alternated, so drift hits both alike
                    trunk.kernels = mode == "kernels"
                    toks, tps, measured, per_round = drafted(trunk, assistant, prompt, a.tokens,
                                                             depth, reference, acc, seed, a.vocab)  # fmt: skip
                    d = first_diff(toks, reference)
                    row.setdefault(mode, []).append(tps)
                    row[f"{mode} acc"], row[f"{mode} tok/round"] = measured, per_round
                    row[f"{mode} exact"] = row.get(f"{mode} exact", True) and d is None
                    if d is not None:
                        say(f"   !! {prec} a={acc} depth={depth} {mode}: differs from plain at token {d}")
            for mode in modes:
                row[f"{mode} runs"] = row[mode]
                row[mode] = sorted(row[mode])[len(row[mode]) // 2]
            rows.append(row)
            k = row.get("kernels")
            say(f"   a={acc} depth={depth}: stock {row['stock']:.1f} tok/s"
                + (f", kernels {k:.1f} tok/s" if k else "")
                + f"; acceptance {row['stock acc']:.2f}, {row['stock tok/round']:.2f} tok/round")  # fmt: skip
    trunk.kernels = False
    return rows


def table(rows: list[dict]) -> None:
    say("\nprecision |   a | depth | plain tok/s | assistant stock tok/s | assistant kernels tok/s | "
        "stock/plain | kernels/plain | acceptance (stock, kernels) | tok/round | exact")  # fmt: skip
    for r in rows:
        k, p = r.get("kernels"), r["plain"]
        acc = f"{r['stock acc']:.2f}" + (f", {r['kernels acc']:.2f}" if k else "")
        exact = r["stock exact"] and r.get("kernels exact", True)
        say(f"{r['precision']:>9} | {r['a']:.1f} | {r['depth']:5d} | {p:11.1f} | {r['stock']:21.1f} | "
            f"{(f'{k:.1f}' if k else '-'):>23} | {r['stock'] / p:10.2f}x | "
            f"{(f'{k / p:.2f}x' if k else '-'):>13} | {acc:>27} | {r['stock tok/round']:9.2f} | "
            f"{'yes' if exact else 'NO'}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="4b")
    ap.add_argument("--accept", default="0.6,0.8")
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=1100)
    ap.add_argument("--reps", type=int, default=2, help="timed runs per (a, depth, mode); median")
    ap.add_argument("--plain-reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--pattern", type=int, default=6, help="one full layer per this many")
    ap.add_argument("--hidden", type=int, default=5376)
    ap.add_argument("--mlp", type=int, default=21504)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--global-head-dim", type=int, default=512)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--assistant-hidden", type=int, default=1024)
    ap.add_argument("--assistant-layers", type=int, default=4)
    ap.add_argument("--embed-scale", type=float, default=16.0)
    ap.add_argument("--margin", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a small model (CPU check of the bench)")
    ap.add_argument("--test-kernel", action="store_true",
                    help="use qmm.emulate_qmm as the kernel, enabled when correct (CPU check)")
    ap.add_argument("--kernels", default="auto", choices=wiring.SETTINGS)
    ap.add_argument("--home", type=Path, default=None, help="SPECGATE_HOME for the verdicts")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        OUT.append(a.out.open("w"))
    if a.tiny:
        a.layers, a.hidden, a.mlp, a.heads, a.kv_heads = 6, 256, 512, 4, 2
        a.head_dim, a.global_head_dim, a.window, a.vocab = 64, 128, 32, 4096
        a.assistant_hidden, a.prompt = 128, 80
    cache = kernel_cache_dir(a.home)
    if a.test_kernel:
        guard = Guard([Candidate("emulate", "1", qmm.emulate_qmm)], cache_dir=cache,
                      margin=float("inf"), reps=2, inner=1)  # fmt: skip
    else:
        guard = Guard(cache_dir=cache)
    fused = None if a.test_kernel else Guard([cuda_mma_fused_candidate()], cache_dir=cache, op=FUSED_QMM)
    say(f"mlx {mx.__version__} on {mx.default_device()}; gemma4 hidden {a.hidden}, {a.layers} layers "
        f"(window {a.window}, 1 full per {a.pattern}), {a.heads}/{a.kv_heads} heads, MLP {a.mlp}, "
        f"vocab {a.vocab}; assistant hidden {a.assistant_hidden}, {a.assistant_layers} layers; "
        f"prompt {a.prompt}, {a.tokens} tokens")  # fmt: skip
    t0 = time.perf_counter()
    rows = []
    for prec in a.precisions.split(","):
        if prec not in ("bf16", "4b"):
            raise SystemExit(f"unknown precision {prec}")
        model, assistant, sigma = build(a)
        if prec == "4b":
            nn.quantize(model, group_size=64, bits=4)
            nn.quantize(assistant, group_size=64, bits=4)
            mx.eval(model.parameters(), assistant.parameters())
        say(f"\n[{prec}] built in {time.perf_counter() - t0:.1f} s")
        rows += run_precision(prec, model, assistant, sigma, a, guard, fused)
        del model, assistant
        gc.collect()
        mx.clear_cache()
        say(f"[{prec} done at {time.perf_counter() - t0:.0f} s]")
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1))
    table(rows)


if __name__ == "__main__":
    main()
