"""A coding-agent session replayed through the gateway: cold, warm, and after a restart.

    uv run python bench/agent_sessions.py [--passes 2] [--methods none,mtp,dflash]
    python bench/agent_sessions.py --model DIR [--drafter DIR] ...   # another checkpoint

The session ships in bench/agent_session.json: Claude Code's shape over the
Anthropic Messages API (a long system prompt, eight tool definitions, tool
calls and their results), fixing two bugs in a small module in 9 turns.
Its assistant turns are recorded, so turn k sends the same prompt on every
replay: the system prompt, the tools and every message up to the k-th user
message (the task, then each tool result). Each request streams 8 tokens at
temperature 0 with the method forced (X-Specgate-Method); TTFT is the time
to the first text delta, as a client sees it.

For each method, side by side in one run:
- cold:    a gateway whose prefix cache is off (prefix_cache_size: 0);
- warm:    a gateway with a fresh SPECGATE_HOME, turns in order (turn k
           resumes from what turn k-1 left), each followed at once by an
           identical retry;
- restart: that gateway stopped (SIGTERM: its disk writes flushed) and a
           new one started on the same home, the turns replayed: each
           resumes from the disk tier.
Reported per turn: prompt tokens, cached tokens, TTFT in each mode and the
ratios to cold; per mode the session's total wall time. With --passes N
the medians of the passes and the range of the ratios.

A model whose chat template takes no tools (the shipped demo) gets the
tool definitions as text at the end of the system prompt and each tool
call as text in its assistant turn: the same tokens every replay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from serving import serving

HERE = Path(__file__).resolve().parent
SESSION = HERE / "agent_session.json"
MAX_TOKENS = 8


def requests_of(session: dict, native_tools: bool) -> list[dict]:
    """One Messages request body per turn."""
    system, tools, messages = session["system"], session["tools"], session["messages"]
    if not native_tools:
        system += "\n\n# Tools\n\n" + json.dumps(tools, indent=1)
        messages = [_tool_calls_as_text(m) for m in messages]
    bodies = []
    for i, m in enumerate(messages):
        if m["role"] == "user":
            body = {"system": system, "messages": messages[: i + 1], "max_tokens": MAX_TOKENS,
                    "temperature": 0, "stream": True}  # fmt: skip
            if native_tools:
                body["tools"] = tools
            bodies.append(body)
    return bodies


def _tool_calls_as_text(message: dict) -> dict:
    if message["role"] != "assistant":
        return message
    text = ""
    for block in message["content"]:
        if block["type"] == "text":
            text += block["text"] + "\n"
        elif block["type"] == "tool_use":
            call = {"name": block["name"], "input": block["input"]}
            text += f"<tool_use>{json.dumps(call)}</tool_use>"
    return {"role": "assistant", "content": text}


def takes_tools(url: str, model: str, session: dict) -> bool:
    r = httpx.post(url + "/v1/messages/count_tokens", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "tools": session["tools"]})  # fmt: skip
    return r.status_code == 200


def timed(client: httpx.Client, model: str, method: str, body: dict) -> dict:
    """One streamed request: TTFT, wall time, prompt and cached tokens."""
    t0 = time.perf_counter()
    ttft, usage = None, {}
    with client.stream("POST", "/v1/messages", json=body | {"model": model},
                       headers={"X-Specgate-Method": method}) as r:  # fmt: skip
        if r.status_code != 200:
            raise SystemExit(f"{r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "message_start":
                usage = event["message"]["usage"]
            elif event["type"] == "content_block_delta" and ttft is None:
                ttft = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    cached = usage.get("cache_read_input_tokens", 0)
    return {"ttft": ttft if ttft is not None else wall, "wall": wall,
            "prompt": usage.get("input_tokens", 0) + cached, "cached": cached}  # fmt: skip


def replay(url: str, model: str, method: str, bodies: list[dict], retry: bool = False) -> dict:
    out: dict[str, list] = {"turns": [], "retries": []}
    with httpx.Client(base_url=url, timeout=600) as client:
        for body in bodies:
            out["turns"].append(timed(client, model, method, body))
            if retry:
                out["retries"].append(timed(client, model, method, body))
    return out


def model_entry(args, prefix_cache_size: int | None = None) -> dict:
    entry = {"id": "m", "path": args.model, "engines": ["mlx_plain", "mlx_mtp", "mlx_dflash"],
             "drafter": args.drafter}  # fmt: skip
    if prefix_cache_size is not None:
        entry["prefix_cache_size"] = prefix_cache_size
    return entry


def one_pass(args, session: dict, methods: list[str], work: Path) -> dict:
    results: dict = {}
    cold_dir = work / "cold"
    cold_dir.mkdir()
    with serving([model_entry(args, 0)], cold_dir, home=cold_dir / "home") as (url, _):
        native = takes_tools(url, "m", session)
        bodies = requests_of(session, native)
        for method in methods:
            results[method] = {"cold": replay(url, "m", method, bodies)}
    for method in methods:
        home = work / f"home-{method}"
        extra = {"prefix_cache": {"disk_min_tokens": 64}}
        d = work / f"warm-{method}"
        d.mkdir()
        with serving([model_entry(args)], d, home=home, extra=extra) as (url, _):
            results[method]["warm"] = replay(url, "m", method, bodies, retry=True)
        d = work / f"restart-{method}"
        d.mkdir()
        with serving([model_entry(args)], d, home=home, extra=extra) as (url, _):
            results[method]["restart"] = replay(url, "m", method, bodies)
    results["native_tools"] = native
    return results


def median(xs):
    return statistics.median(xs)


def spread(xs) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}" if len(xs) > 1 else ""


def report(passes: list[dict], methods: list[str]) -> None:
    n_turns = len(passes[0][methods[0]]["cold"]["turns"])
    print(f"\nTTFT per turn, seconds (median of {len(passes)} pass(es)); ratios to cold, "
          "with their range over the passes")
    for method in methods:
        print(f"\n### {method}\n")
        print("| turn | prompt | cached warm | cold | warm | warm/cold | retry | retry/cold "
              "| restart | restart/cold |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        ratios = {"warm": [], "retry": [], "restart": []}
        for k in range(n_turns):
            def col(mode, key="ttft", k=k, method=method):
                src = "retries" if mode == "retry" else "turns"
                real = "warm" if mode == "retry" else mode
                return [p[method][real][src][k][key] for p in passes]

            cold = col("cold")
            row = [str(k + 1), str(col("cold", "prompt")[0]), str(median(col("warm", "cached"))),
                   f"{median(cold):.3f}"]  # fmt: skip
            for mode in ("warm", "retry", "restart"):
                times = col(mode)
                r = [t / c for t, c in zip(times, cold, strict=True)]
                if mode != "warm" or k > 0:
                    ratios[mode].append(median(r))
                row += [f"{median(times):.3f}", f"{median(r):.3f} ({spread(r)})" if spread(r)
                        else f"{median(r):.3f}"]  # fmt: skip
            print("| " + " | ".join(row) + " |")
        walls = {mode: [sum(t["wall"] for t in p[method][mode]["turns"]) for p in passes]
                 for mode in ("cold", "warm", "restart")}  # fmt: skip
        print(f"\nsession wall time: cold {median(walls['cold']):.2f} s, warm "
              f"{median(walls['warm']):.2f} s ({median(walls['warm']) / median(walls['cold']):.2f}x "
              f"of cold), after restart {median(walls['restart']):.2f} s "
              f"({median(walls['restart']) / median(walls['cold']):.2f}x)")
        print(f"goals: identical retry TTFT <= 2% of cold: median {100 * median(ratios['retry']):.1f}%"
              f", worst {100 * max(ratios['retry']):.1f}%; turn N (2..{n_turns}) >= 5x faster than "
              f"cold: median {1 / median(ratios['warm']):.1f}x, worst {1 / max(ratios['warm']):.1f}x; "
              f"after restart <= 10% of cold: median {100 * median(ratios['restart']):.1f}%, "
              f"worst {100 * max(ratios['restart']):.1f}%")


def main() -> None:
    from specgate.engines.checkpoints.builtin import BUILTIN_DEMO, BUILTIN_DEMO_DFLASH

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=BUILTIN_DEMO)
    ap.add_argument("--drafter", default=BUILTIN_DEMO_DFLASH)
    ap.add_argument("--methods", default="none,mtp,dflash")
    ap.add_argument("--passes", type=int, default=1)
    args = ap.parse_args()
    session = json.loads(SESSION.read_text())
    methods = args.methods.split(",")
    passes = []
    for i in range(args.passes):
        with tempfile.TemporaryDirectory(prefix="agent-sessions-") as work:
            t0 = time.perf_counter()
            passes.append(one_pass(args, session, methods, Path(work)))
            print(f"pass {i + 1}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"model {args.model}; tools {'native' if passes[0]['native_tools'] else 'as text'}; "
          f"{len(passes[0][methods[0]]['cold']['turns'])} turns, {MAX_TOKENS} tokens each")
    report(passes, methods)


if __name__ == "__main__":
    main()
