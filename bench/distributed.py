"""One model over two processes, side by side with one process, in one run.

    uv run python bench/distributed.py [--passes 3] [--max-tokens 48]

Serves the demo model three ways, one after another, each through a real
`specgate serve` on loopback: in one process; under `mlx.launch -n 2
--backend ring` split by tensor parallelism; and split into a 2-stage
pipeline. Each is asked greedy completions of the same prompts (streamed,
one at a time), plain (X-Specgate-Method: none) and MTP (depth 3), and the
decode time per token (first streamed token to last) is reported: median
over passes of the median over prompts, range over passes in brackets.

Communication share: the collectives each decoded token costs, counted
from the model's shape (tensor: an all_sum of the hidden state after every
attention and every MLP, an all_gather of the vocabulary slices; pipeline:
the hidden state sent between stages and gathered) plus specgate's own
lockstep messages (turns and decisions, CONTROL_PER_STEP), each timed
alone by the same ring on loopback, as a share of the measured time. Both
ranks share this machine's cores, so the rest is not "compute at half the
cost" as it would be on two machines.

Last, the same counts priced with Thunderbolt 5's published numbers, for a
model of a real size (see ESTIMATE and its sources).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serving import REPO, serving

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n",
           "The history of the river valley begins", "class Stack:\n    def __init__(self):\n"]  # fmt: skip
DEMO = {"id": "demo", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"], "mtp_depth": 3}
MODES = [("single", None), ("tensor x2", "tensor"), ("pipeline x2", "pipeline")]
METHODS = ["none", "mtp"]
# specgate's lockstep messages per plain step of one request (the commands
# shared, the step's turn, the planner asked) and per MTP round (new jobs,
# gone and plan; the round's turn); each a turn or a value (engines/distributed/lockstep.py).
CONTROL_PER_STEP = {"none": 5, "mtp": 3}

# Thunderbolt 5, published: 80 Gb/s each way (Apple's Mac Studio (2025) tech
# specs; USB-IF/Intel TB5: 80 Gb/s symmetric, 120 Gb/s Bandwidth Boost);
# RDMA over Thunderbolt (Apple TN3205, macOS 26.2) measured under 50 us a
# small message against ~300 us for TCP over Thunderbolt (press coverage of
# TN3205 with exo's cluster numbers); ~7.6 GB/s effective per rank for fp32
# collectives over RDMA on TB5 (PyTorch PR #189856, TCCL's measurements).
TB5 = {"rdma (jaccl)": {"latency_us": 50.0, "bytes_per_s": 7.6e9},
       "tcp over tb (ring)": {"latency_us": 300.0, "bytes_per_s": 7.6e9}}  # fmt: skip
# A model of a real size for the estimate: Qwen3-Next-80B-A3B's shape (48
# layers, hidden 2048, vocabulary 151936), bf16 activations, and the
# single-Mac decode time per token it is measured at elsewhere (M3 Ultra,
# 4-bit, mlx-lm: about 60 tok/s) as the compute to split.
ESTIMATE = {"layers": 48, "hidden": 2048, "vocab": 151936, "bytes": 2, "single_ms": 1000 / 60}


def collectives(shape: dict, mode: str, tokens: int) -> dict[str, tuple[int, int]]:
    """kind -> (count, bytes each) for one forward over `tokens` rows."""
    h = tokens * shape["hidden"] * shape["bytes"]
    if mode == "tensor":
        return {"all_sum": (2 * shape["layers"], h),
                "all_gather": (1, tokens * shape["vocab"] // 2 * shape["bytes"])}
    return {"send": (1, h), "all_gather": (1, h)}


def per_token_collectives(shape: dict, mode: str, method: str, tokens_per_round: float) -> dict:
    """kind -> (count per decoded token, bytes each)."""
    if method == "none":
        return collectives(shape, mode, 1)
    verify = collectives(shape, mode, 4)  # depth 3: the last token and three drafts
    out = {k: (n / tokens_per_round, b) for k, (n, b) in verify.items()}
    if mode == "tensor":  # each of the 3 drafts reads the sharded head's logits
        out["all_gather_draft"] = (3 / tokens_per_round, shape["vocab"] // 2 * shape["bytes"])
    return out


# -- the ring on loopback, each collective alone ----------------------------------------------


def time_collectives(shape: dict, repeats: int) -> dict[str, float]:
    """Seconds per collective of each kind and size, timed under mlx.launch."""
    out = Path(tempfile.mkdtemp(prefix="collectives-")) / "times.json"
    launcher = Path(sys.executable).with_name("mlx.launch")
    command = [str(launcher), "-n", "2", "--backend", "ring", "--", sys.executable,
               str(Path(__file__).resolve()), "--time-collectives", json.dumps(shape),
               "--repeats", str(repeats), "--out", str(out)]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=600)
    return json.loads(out.read_text())


def _time_collectives_here(shape: dict, repeats: int, out: str) -> None:
    import mlx.core as mx

    from specgate.engines.distributed.lockstep import Channel

    group = mx.distributed.init()
    dtype = {2: mx.bfloat16, 4: mx.float32}[shape["bytes"]]
    rank = group.rank()
    times: dict[str, float] = {}

    def timed(name: str, make) -> None:
        for _ in range(3):
            make()
        t0 = time.perf_counter()
        for _ in range(repeats):
            make()
        times[name] = (time.perf_counter() - t0) / repeats

    for tokens in (1, 4):
        h = mx.zeros((tokens, shape["hidden"]), dtype=dtype)
        v = mx.zeros((tokens, shape["vocab"] // 2), dtype=dtype)
        timed(f"all_sum/{tokens}", lambda h=h: mx.eval(mx.distributed.all_sum(h, group=group)))
        timed(f"all_gather_h/{tokens}", lambda h=h: mx.eval(mx.distributed.all_gather(h, group=group)))
        timed(f"all_gather_v/{tokens}", lambda v=v: mx.eval(mx.distributed.all_gather(v, group=group)))

        def send(h=h):
            if rank == 0:
                mx.eval(mx.distributed.send(h, 1, group=group))
            else:
                mx.eval(mx.distributed.recv_like(h, 0, group=group))

        timed(f"send/{tokens}", send)
    channel = Channel(group)
    message = ("turn", "mlx_mtp-demo")
    timed("control", lambda: channel.send(message) if rank == 0 else channel.receive())
    if rank == 0:
        Path(out).write_text(json.dumps(times))


def comm_ms(shape: dict, mode: str, method: str, tokens_per_round: float, t: dict) -> tuple[float, float]:
    """(model collectives, lockstep control) ms per decoded token, from the loopback timings."""
    rows = 1 if method == "none" else 4
    model = 0.0
    for kind, (n, _) in per_token_collectives(shape, mode, method, tokens_per_round).items():
        key = {"all_sum": f"all_sum/{rows}", "send": f"send/{rows}",
               "all_gather": f"all_gather_{'v' if mode == 'tensor' else 'h'}/{rows}",
               "all_gather_draft": "all_gather_v/1"}[kind]  # fmt: skip
        model += n * t[key]
    steps = 1 if method == "none" else 1 / tokens_per_round
    control = CONTROL_PER_STEP[method] * steps * t["control"]
    return model * 1e3, control * 1e3


# -- the servers ------------------------------------------------------------------------------


def decode_ms(url: str, prompt: str, method: str, max_tokens: int) -> float:
    stamps = []
    with httpx.stream("POST", url + "/v1/completions", timeout=600, headers={
            "X-Specgate-Method": method}, json={
            "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}) as r:  # fmt: skip
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    # A round's tokens may arrive in one chunk: time over tokens, not chunks.
    return (stamps[-1] - stamps[0]) / (max_tokens - 1) * 1e3


def tokens_per_round(url: str) -> float:
    drafts = accepted = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if 'method="mtp"' in line and line.startswith("specgate_spec_decode_num_drafts_total"):
            drafts = float(line.rsplit(" ", 1)[1])
        if 'method="mtp"' in line and line.startswith("specgate_spec_decode_num_accepted_tokens_total"):
            accepted = float(line.rsplit(" ", 1)[1])
    return 1 + accepted / drafts if drafts else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=200, help="timings of each collective")
    ap.add_argument("--time-collectives", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.time_collectives:
        return _time_collectives_here(json.loads(args.time_collectives), args.repeats, args.out)

    sys.path.insert(0, str(REPO))
    from specgate.gateway.serving.builtins import resolve_builtin

    text = json.loads((Path(resolve_builtin("builtin:demo")) / "config.json").read_text())
    text = text.get("text_config", text)
    demo = {"layers": text["num_hidden_layers"], "hidden": text["hidden_size"],
            "vocab": text["vocab_size"], "bytes": 2 if "16" in str(text.get("torch_dtype")) else 4}
    timings = time_collectives(demo, args.repeats)

    # mode -> method -> [per-pass median ms/token]
    ms: dict[str, dict[str, list[float]]] = {}
    per_round: dict[str, float] = {}
    for label, mode in MODES:
        model = DEMO | ({"distributed": {"mode": mode}} if mode else {})
        with tempfile.TemporaryDirectory() as work, \
                serving([model], Path(work), home=Path(work) / "home", ranks=2 if mode else 1) as (url, _):
            for method in METHODS:
                decode_ms(url, PROMPTS[0], method, 8)  # warm: the first forward of each shape
            for _ in range(args.passes):
                for method in METHODS:
                    runs = [decode_ms(url, p, method, args.max_tokens) for p in PROMPTS]
                    ms.setdefault(label, {}).setdefault(method, []).append(statistics.median(runs))
            per_round[label] = tokens_per_round(url)
        print(f"# {label} done", file=sys.stderr, flush=True)

    base = {m: statistics.median(ms["single"][m]) for m in METHODS}
    print(f"\nDemo ({demo}), greedy, {args.max_tokens} tokens, {len(PROMPTS)} prompts, "
          f"{args.passes} passes; ms per decoded token: median (range over passes)\n")
    print("| layout | method | ms/token | vs single plain | vs single same method | "
          "tokens/round | model collectives ms | lockstep ms | comm share |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, mode in MODES:
        for method in METHODS:
            runs = ms[label][method]
            med = statistics.median(runs)
            tpr = per_round[label] if method == "mtp" else 1.0
            model_ms, control_ms = comm_ms(demo, mode, method, tpr, timings) if mode else (0.0, 0.0)
            share = (model_ms + control_ms) / med if mode else 0.0
            print(f"| {label} | {method} | {med:.1f} ({min(runs):.1f}-{max(runs):.1f}) | "
                  f"{base['none'] / med:.2f}x | {base[method] / med:.2f}x | {tpr:.2f} | "
                  f"{model_ms:.1f} | {control_ms:.2f} | {share:.0%} |")
    print("\nEach collective alone on loopback (µs): "
          + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in timings.items()))

    shape = ESTIMATE
    print(f"\nEstimate, two Macs over Thunderbolt 5, a model shaped {shape} "
          f"(single Mac {shape['single_ms']:.1f} ms/token, plain):\n")
    print("| link | layout | collectives/token | comm ms/token | ms/token | vs single |")
    print("|---|---|---:|---:|---:|---:|")
    for link, cost in TB5.items():
        for mode in ("tensor", "pipeline"):
            parts = collectives(shape, mode, 1)
            count = sum(n for n, _ in parts.values()) + CONTROL_PER_STEP["none"]
            comm = sum(n * (cost["latency_us"] * 1e-6 + b / cost["bytes_per_s"])
                       for n, b in parts.values()) + CONTROL_PER_STEP["none"] * cost["latency_us"] * 1e-6
            compute = shape["single_ms"] / (2 if mode == "tensor" else 1)
            total = compute + comm * 1e3
            print(f"| {link} | {mode} x2 | {count} | {comm * 1e3:.2f} | {total:.1f} | "
                  f"{shape['single_ms'] / total:.2f}x |")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
