"""MTP rounds on a GPU: where a round's time goes, and rounds queued one ahead (mlx_spec/ahead.py).

    python bench/round_phases.py [--depth 4] [--accept 0.8] [--tokens 256] [--kernels auto|off]
    python bench/round_phases.py --tiny         # the same on a CPU, small

bench/e2e_mtp_7b.py's 7B-class qwen3 (4-bit) and its oracle MTP drafts
(acceptance a by construction), decoded by the product's SpecDecoder. Each
round is cut in three by its waits for the device (the decoder's
`mx.eval` calls, timed through a wrapper on the decoder module's own `mx`
name: instrumentation of this process only):
- build: from the round's start to its first wait (the host builds the
  drafting and verify graphs; the device starts on the drafts meanwhile);
- wait: inside the waits (the device finishing what was queued);
- after: from the last wait to the round's end (acceptance, commit,
  rollback, the proposer's bookkeeping).
The device idles during `after` and the next round's `build` unless
that build outruns it: overlapping them (the next round's graph queued
before this one's verdict is read) is what generate_step does for plain
decoding. Prints median ms per round and their share, and plain
generate_step's ms per token for scale.

Then the same rounds queued one ahead (AheadDecoder), and queued ahead and
compiled (mlx_spec/ahead_round.py, "compiled"; the head wired as the MTP
engine wires it: its siblings fused, its forward of the last round's pairs
and the drafts' one-row lm_head products through the verify kernels where
the guard proved them; "compiled-stockdraft": the same rounds with the
head's forward and the drafts' logits on the stock path, as before
kernels/hook.WIDE_N and Drafting.kernel_module), their drafts replaced
on the device by the same oracle (the reference token at the next
generated position with probability a per draft, a Bernoulli per round and
draft position from a seeded generator, else another token; the head still
runs): tok/s over generate_step, side by side with the decoder's, each
over --reps interleaved repeats, every output compared with plain greedy.
--modes picks them; --no-phases skips the per-round phases above.

--profile (needs torch on the machine: its profiler sees MLX's kernels
through CUPTI, as bench/gpu_profile.py does) then runs one more decode per
compiled mode, and one plain generate_step, under the profiler and prints
per round (per token for plain): wall ms, the GPU's busy ms (the union of
the kernels' intervals), kernels launched, and the top kernels by device
time. Busy close to wall: the round is bound by the GPU; far below it: by
the host.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_mtp_7b import OracleDrafts, build, plain  # noqa: E402  (bench/, beside this file)

from specgate.engines.base import GenerationRequest, Plan, SamplingParams  # noqa: E402
from specgate.engines.drafting.mtp.proposer import MTPProposer  # noqa: E402
from specgate.engines.mlx_spec import decoder as decoder_module  # noqa: E402
from specgate.engines.mlx_spec.ahead import AheadDecoder  # noqa: E402
from specgate.engines.mlx_spec.ahead_round import CompiledRounds  # noqa: E402
from specgate.engines.mlx_spec.decoder import SpecDecoder  # noqa: E402
from specgate.engines.targets import target_for  # noqa: E402
from specgate.kernels import hook, wiring  # noqa: E402
from specgate.kernels.guard import FUSED_QMM, Guard, cuda_mma_fused_candidate  # noqa: E402
from specgate.kernels.machine import this_machine  # noqa: E402


class TimedMx:
    """The decoder module's `mx`, with its evals timed."""

    def __init__(self):
        self.waits: list[tuple[float, float]] = []

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *args):
        t0 = time.perf_counter()
        mx.eval(*args)
        self.waits.append((t0, time.perf_counter()))


def oracle_hook(vocab: int):
    """The oracle's drafts, chosen on the device (a round's drafts hook,
    mlx_spec/ahead_round.py): the reference token at each generated position
    where `ok`, another token elsewhere; the head's drafts stay in the graph."""

    def hook(drafts, reference, position, ok, wrong):
        ref = mx.take(reference, position + mx.arange(drafts.shape[0]))
        forced = mx.where(ok, ref, (ref + wrong) % vocab)
        return mx.where(drafts >= 0, forced, drafts)

    return hook


class OracleAhead(AheadDecoder):
    """AheadDecoder whose drafts are the oracle's: the generated position
    each round starts at is a device-side count too."""

    def __init__(self, *args, reference: list[int], accept: float, seed: int, vocab: int,
                 rounds: CompiledRounds | None = None):  # fmt: skip
        super().__init__(*args, rounds=rounds)
        self.rounds_hook = rounds.hook if rounds is not None else oracle_hook(vocab)
        self.reference = mx.array(reference + [0] * 64, dtype=mx.int32)
        self.accept, self.vocab = accept, vocab
        self.rng = random.Random(seed)

    def _hook_inputs(self, k, in_flight):
        # The round starts where the one in flight (if any) leaves the sequence.
        position = mx.array(self.generated, dtype=mx.int32)
        if in_flight is not None:
            position = position + in_flight + 1
        ok = mx.array([self.rng.random() < self.accept for _ in range(k)])
        wrong = mx.array([1 + self.rng.randrange(self.vocab - 1) for _ in range(k)], dtype=mx.int32)
        return (self.reference, position, ok, wrong)


def ahead_run(trunk, head, prompt, n, depth, reference, accept, seed, vocab, rounds=None,
              counts: list | None = None):  # fmt: skip
    request = GenerationRequest("ahead", "ahead", prompt, SamplingParams(temperature=0), n,
                                Plan("mlx_mtp", "mtp", depth, "spec_on"))  # fmt: skip
    dec = OracleAhead(trunk, MTPProposer(trunk, head), request, None, 0, None,
                      reference=reference, accept=accept, seed=seed, vocab=vocab,
                      rounds=rounds)  # fmt: skip
    step = dec.prefill()
    tokens, rounds_run = list(step.tokens), 0
    t0 = time.perf_counter()
    while step.finish_reason is None:
        step = dec.round(depth)
        tokens += step.tokens
        rounds_run += 1
    if counts is not None:
        counts.append(rounds_run)
    return tokens, (len(tokens) - 1) / (time.perf_counter() - t0), (len(tokens) - 1) / rounds_run


class StockDrafts:
    """The target and head with the drafting's products on the stock path
    (the verify still through the kernels): what a round cost before the
    head's forward and the drafts' lm_head went through them."""

    def __init__(self, target, head):
        self._target, self._head = target, head

    def __getattr__(self, name):
        return getattr(self._target, name)

    def logits(self, hidden):
        from specgate.kernels import hook

        with hook.kernels(hook.enabled() and hidden.shape[-2] > 1):
            return self._target.logits(hidden)

    def head(self, x, hidden, cache, step=0):
        from specgate.kernels import hook

        with hook.kernels(False):
            return self._head(x, hidden, cache, step=step)


def profiled(fn, top: int) -> dict:
    """fn() under PyTorch's profiler: its kernels' count, busy and summed
    device time, and the top kernels by device time and by launches."""
    from gpu_profile import busy_us, by_name, cuda_kernels

    def timed():
        t0 = time.perf_counter()
        return fn(), time.perf_counter() - t0

    ks, (units, wall) = cuda_kernels(timed)
    per_name = by_name(ks)
    return {"units": units, "wall": wall, "busy": busy_us(ks), "sum": sum(e["dur"] for e in ks),
            "launches": len(ks),
            "top": sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top],
            "most": sorted(per_name.items(), key=lambda kv: -len(kv[1]))[:top]}  # fmt: skip


def print_profile(label: str, unit: str, r: dict) -> None:
    n = r["units"]
    print(f"\nprofile {label}: {n} {unit}s; per {unit}: wall {r['wall'] * 1e3 / n:.2f} ms (profiler on), "
          f"GPU busy {r['busy'] / 1e3 / n:.2f} ms, kernel sum {r['sum'] / 1e3 / n:.2f} ms, "
          f"{r['launches'] / n:.0f} kernels")  # fmt: skip
    for title in ("top", "most"):
        print("  by device time:" if title == "top" else "  by launches:")
        for name, durs in r[title]:
            print(f"   {sum(durs) / n / 1e3:7.3f} ms  {len(durs) / n:6.1f}x {statistics.mean(durs):8.1f} us  {name}")


def decoder_run(trunk, head, prompt, n, depth, reference, accept, seed, vocab):
    from e2e_mtp_7b import mtp

    tokens, tps, _, per_round = mtp(trunk, head, prompt, n, depth, reference, accept, seed, vocab)
    return tokens, tps, per_round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--accept", type=float, default=0.8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--kernels", default="auto", choices=wiring.SETTINGS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--modes", default="decoder,ahead,compiled",
                    help="of decoder, ahead, compiled, compiled-stockdraft")
    ap.add_argument("--no-phases", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--home", type=Path, default=None,
                    help="verdicts kept here (default: a fresh directory, so proved again)")
    a = ap.parse_args()
    shape = dict(hidden=4096, layers=28, mlp=12288, heads=32, kv_heads=8, head_dim=128,
                 vocab=151936)  # fmt: skip
    if a.tiny:
        shape = dict(hidden=256, layers=4, mlp=768, heads=4, kv_heads=2, head_dim=64, vocab=4096)
        a.tokens = min(a.tokens, 48)
    ns = SimpleNamespace(**shape, seed=0, embed_scale=16.0, margin=20.0)
    model, head, _ = build(ns)
    nn.quantize(model, group_size=64, bits=4)
    nn.quantize(head, group_size=64, bits=4)
    mx.eval(model.parameters(), head.parameters())
    home = a.home or Path(tempfile.mkdtemp())
    guard, fused = Guard(cache_dir=home), Guard([cuda_mma_fused_candidate()], cache_dir=home,
                                                op=FUSED_QMM)  # fmt: skip
    trunk = target_for(model)
    t0 = time.perf_counter()
    wired = wiring.prepare(model, a.kernels, range(2, a.depth + 2), guard=guard, fused_guard=fused)
    trunk.kernels = wired.enabled
    hook.fuse_siblings(head)  # the head as engines/drafting/mtp/proposer.drafting and the engine wire it
    if wired.enabled:
        wiring.prepare(head, a.kernels, range(2, a.depth + 2), guard=guard, fused_guard=fused)
    print(f"device {mx.default_device()}, mlx {mx.__version__}; kernels: {wired.reason} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
    print(f"verdicts keyed {guard.machine}: {json.dumps(this_machine(), sort_keys=True)}")
    prompt = list(range(7, 7 + a.prompt))
    reference, tps, _ = plain(model, prompt, a.tokens)
    reference, tps, _ = plain(model, prompt, a.tokens)
    print(f"plain generate_step: {1000 / tps:.2f} ms/token ({tps:.1f} tok/s)")

    timed = TimedMx()
    decoder_module.mx = timed
    try:
        for rep in range(0 if a.no_phases else 3):  # the first warms up
            request = GenerationRequest("phases", "phases", prompt, SamplingParams(temperature=0),
                                        a.tokens, Plan("mlx_mtp", "mtp", a.depth, "spec_on"))  # fmt: skip
            oracle = OracleDrafts(trunk, head, reference=reference, accept=a.accept, seed=rep,
                                  vocab=ns.vocab)  # fmt: skip
            dec = SpecDecoder(trunk, oracle, request, None, 0, None)
            step = dec.prefill()
            tokens, rows = list(step.tokens), []
            t_start = time.perf_counter()
            while step.finish_reason is None:
                timed.waits.clear()
                r0 = time.perf_counter()
                step = dec.round(a.depth)
                r1 = time.perf_counter()
                tokens += step.tokens
                w = timed.waits
                if w:
                    rows.append((w[0][0] - r0, sum(e - s for s, e in w), r1 - w[-1][1], r1 - r0,
                                 len(step.tokens)))  # fmt: skip
            dt = time.perf_counter() - t_start
            if rep == 0:
                continue
            exact = tokens == reference[: len(tokens)]
            med = [statistics.median(r[i] for r in rows) * 1000 for i in range(4)]
            per_round = sum(r[4] for r in rows) / len(rows)
            print(f"rep {rep}: {len(rows)} rounds, {per_round:.2f} tokens/round, "
                  f"{(len(tokens) - 1) / dt:.1f} tok/s = {(len(tokens) - 1) / dt / tps:.2f}x plain; "
                  f"exact {exact}")  # fmt: skip
            print("   per round (median ms): build {:.2f} | wait {:.2f} | after {:.2f} | "
                  "total {:.2f}  (build+after {:.0%} of the round)".format(
                      *med, (med[0] + med[2]) / med[3]))  # fmt: skip
    finally:
        decoder_module.mx = mx

    compiled = CompiledRounds(trunk, head, oracle_hook(ns.vocab))  # its traces serve every rep
    stock = StockDrafts(trunk, head)
    compiled_stock = CompiledRounds(stock, stock.head, oracle_hook(ns.vocab))
    everything = {"decoder": decoder_run, "ahead": ahead_run,
                  "compiled": lambda *args, **kw: ahead_run(*args, rounds=compiled, **kw),
                  "compiled-stockdraft": lambda *args, **kw: ahead_run(*args, rounds=compiled_stock,
                                                                       **kw)}  # fmt: skip
    runs = {m: everything[m] for m in a.modes.split(",")}
    rows = {m: [] for m in runs}
    exact, per_round = {m: True for m in runs}, {}
    plain_ms = []
    for rep in range(a.reps + 1):  # the first warms up
        _, tps, _ = plain(model, prompt, a.tokens)  # each repeat against its own plain run
        for mode, run in runs.items():
            tokens, tps_m, pr = run(trunk, head, prompt, a.tokens, a.depth, reference, a.accept,
                                    100 + rep, ns.vocab)  # fmt: skip
            exact[mode] = exact[mode] and tokens == reference[: len(tokens)]
            if rep:
                rows[mode].append(tps_m / tps)
                per_round.setdefault(mode, []).append(pr)
        if rep:
            plain_ms.append(1000 / tps)
    print(f"\ndepth {a.depth}, a={a.accept}: tok/s over generate_step (run before each repeat: "
          f"{statistics.median(plain_ms):.2f} ms/token [{min(plain_ms):.2f}, {max(plain_ms):.2f}]), "
          f"median [min, max] of {a.reps}")  # fmt: skip
    for mode, r in rows.items():
        print(f"   {mode:19} {statistics.median(r):.2f} [{min(r):.2f}, {max(r):.2f}]  "
              f"{statistics.median(per_round[mode]):.2f} tokens/round  exact {exact[mode]}  "
              f"(each: {' '.join(f'{x:.2f}' for x in r)})")
    if a.profile:
        def plain_tokens():
            return len(plain(model, prompt, a.tokens)[0]) - 1

        print_profile("plain generate_step", "token", profiled(plain_tokens, a.top))
        for mode, run in runs.items():
            if not mode.startswith("compiled"):
                continue
            def rounds_of(run=run) -> int:
                counts: list[int] = []
                run(trunk, head, prompt, a.tokens, a.depth, reference, a.accept, 999, ns.vocab,
                    counts=counts)  # fmt: skip
                return counts[0]

            r = profiled(rounds_of, a.top)
            print_profile(mode, "round", r)


if __name__ == "__main__":
    main()
