"""llama.cpp's greedy divergence on a real model: prompt cache and speculation, side by side.

    uv run python bench/llamacpp_divergence.py [GGUF] [--reps 5] [--tokens 128]

GGUF defaults to SmolLM2-135M-Instruct.Q4_1.gguf as tests/real_model.py
fetches it. llama-server (specgate's build, `--no-repack` always: this CPU's
AMX repack path crashes on Q4_1) serves a corpus of chat prompts (questions,
lists, and code to copy or rename) at temperature 0, `--tokens` each, the
end-of-generation token ignored so every text is as long. Divergence rate:
the fraction of the corpus whose tokens differ from the reference, which is
each prompt evaluated cold (`cache_prompt: false`) on a plain server. The
conditions, each under llama-server's defaults (as specgate started it
before issue 42) and under specgate's determinism settings
(engines/llamacpp/adapter.py, `deterministic_flags`):

- resent: the same prompt again, its cache warm (all but its last token reused);
- continued: a second turn (prompt, the first answer, a new question) after
  the first turn, warm, against the same second turn cold;
- ngram / ngram-mod: the cold prompt on a server that speculates
  (`ngram-simple` with lookup length 4, `ngram-mod`), against the plain one.

The speculative texts are requested cold under both settings, so the two
columns share them. `--small-ubatch` adds a column that is not specgate's:
`-ub 32` with the cache on, every forward pass under flash attention's
64-row tile, batch-invariant for a Q4_1 model on one thread (adapter.py).
`--threads` defaults to 1: on a shared 2-core machine llama.cpp's spinning
barriers make 2 slower, and past 256 tokens of context the thread count is
itself one of the things that change the text.

`--reps` rounds, interleaved (every condition once per round); each cell is
the median [min, max] over the rounds, with the median first differing
position among the texts that differ. `divergence()` and `table()` are what
the main bench imports.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

_CODE = '''def parse_config(path):
    """Read a key=value file into a dict, skipping comments."""
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            config[key.strip()] = value.strip()
    return config
'''

_JS = """function debounce(fn, wait) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), wait);
  };
}
"""

# >= 20 prompts: questions, lists, prose, and copy-heavy code edits (where
# n-gram speculation drafts most, so where its verify batches are widest).
CORPUS: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain what a hash table is in three sentences.",
    "List ten fruits, one per line.",
    "Write a short poem about the sea.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me a recipe for pancakes.",
    "Count from 1 to 30, separated by commas.",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between TCP and UDP?",
    "Write a haiku about autumn leaves.",
    "Name the planets of the solar system in order.",
    "Why is the sky blue?",
    "Translate 'good morning, how are you?' into Spanish and French.",
    f"Repeat this code exactly, then explain it:\n\n{_CODE}",
    f"Rename `config` to `settings` in this function and print the whole function:\n\n{_CODE}",
    f"Add type hints to this function and print it in full:\n\n{_CODE}",
    f"Print this JavaScript function again, unchanged:\n\n{_JS}",
    f"Rewrite this function using `let` replaced by `var`, printing all of it:\n\n{_JS}",
    "Write a Python function that checks whether a number is prime, with a docstring.",
    "Write a SQL query that returns the five most recent orders per customer.",
    "Describe a cat to someone who has never seen one.",
)
FOLLOW_UP = "Now say that again in fewer words."

SPECULATION = {
    "ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
              "--spec-ngram-simple-size-m", "8"],
    "ngram-mod": ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "8",
                  "--spec-ngram-mod-n-min", "1"],
}  # fmt: skip
CONDITIONS = ("resent", "continued", *SPECULATION)


@dataclass(frozen=True)
class Settings:
    """A way to run llama-server and send it greedy requests."""

    name: str
    flags: tuple[str, ...] = ()  # process flags, beyond the model, -c, -np, -t
    body: dict = field(default_factory=dict)  # per-request fields over the bench's own


def settings_under_test(small_ubatch: bool = False) -> list[Settings]:
    from specgate.engines.llamacpp.adapter import DETERMINISTIC_BODY, deterministic_flags

    settings = [
        Settings("llama-server defaults", (), {"cache_prompt": True}),
        Settings("specgate deterministic", tuple(deterministic_flags()), dict(DETERMINISTIC_BODY)),
    ]
    if small_ubatch:
        # Not specgate's: every forward pass under 64 rows (flash attention's
        # tile), cache on; batch-invariant for a Q4_1 model (adapter.py).
        settings.append(Settings("-ub 32, cache on", ("-ub", "32"), {"cache_prompt": True}))
    return settings


class Server:
    """One llama-server through specgate's own process manager."""

    def __init__(self, gguf: Path, flags: list[str], *, threads: int, ctx: int):
        from specgate.engines.llamacpp.process import LlamaServer, ServerSpec

        extra = ["--no-repack", *flags]
        self.proc = LlamaServer(ServerSpec(gguf, ctx_size=ctx, parallel=1, threads=threads,
                                           extra_args=extra))  # fmt: skip
        self.client = httpx.AsyncClient(trust_env=False, timeout=600.0)

    async def __aenter__(self) -> Server:
        await self.proc.start()
        self.url = self.proc.base_url
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()
        await self.proc.stop()

    async def prompt(self, messages: list[dict]) -> list[int]:
        r = await self.client.post(self.url + "/apply-template", json={"messages": messages})
        r.raise_for_status()
        text = r.json()["prompt"]
        r = await self.client.post(
            self.url + "/tokenize",
            json={"content": text, "add_special": False, "parse_special": True},
        )
        r.raise_for_status()
        return list(r.json()["tokens"])

    async def greedy(self, tokens: list[int], n: int, body: dict) -> list[int]:
        req = {
            "prompt": tokens, "n_predict": n, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
            "min_p": 0.0, "samplers": ["temperature", "top_k", "top_p", "min_p"],
            "ignore_eos": True, "return_tokens": True, "seed": 0, "stream": False, **body,
        }  # fmt: skip
        r = await self.client.post(self.url + "/completion", json=req)
        r.raise_for_status()
        return list(r.json()["tokens"])


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))  # fmt: skip


@dataclass
class Cell:
    rates: list[float] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def add(self, pairs: list[tuple[list[int], list[int]]]) -> None:
        diffs = [first_difference(a, b) for a, b in pairs]
        found = [d for d in diffs if d is not None]
        self.rates.append(len(found) / len(pairs))
        self.positions += found

    def text(self) -> str:
        r = self.rates
        pos = f" @{statistics.median(self.positions):.0f}" if self.positions else ""
        return f"{statistics.median(r):.2f} [{min(r):.2f}, {max(r):.2f}]{pos}"


async def one_round(servers: dict, settings: Settings, prompts: list[str], n: int,
                    cells: dict[str, Cell], done: dict) -> None:  # fmt: skip
    """One pass over the corpus; `done`: the round's speculative texts by
    (flags, kind), which every settings whose requests there are cold shares."""
    plain = servers[(settings.flags, None)]
    cold = {"cache_prompt": False}
    refs, resent, second_cold, second_warm = [], [], [], []
    for text in prompts:
        turn1 = [{"role": "user", "content": text}]
        p1 = await plain.prompt(turn1)
        ref = await plain.greedy(p1, n, settings.body | cold)
        refs.append(ref)
        # The slot holds p1 and ref now: all of p1 but its last token is reused.
        resent.append(await plain.greedy(p1, n, settings.body))
        answer = (await plain.client.post(plain.url + "/detokenize",
                                          json={"tokens": ref})).json()["content"]  # fmt: skip
        p2 = await plain.prompt([*turn1, {"role": "assistant", "content": answer},
                                 {"role": "user", "content": FOLLOW_UP}])  # fmt: skip
        second_warm.append(await plain.greedy(p2, n, settings.body))  # p1 + ref's tokens reused
        second_cold.append(await plain.greedy(p2, n, settings.body | cold))
    cells["resent"].add(list(zip(refs, resent, strict=True)))
    cells["continued"].add(list(zip(second_cold, second_warm, strict=True)))
    for kind in SPECULATION:
        spec = servers[(settings.flags, kind)]
        key = (settings.flags, kind)
        if key not in done:  # the same flags, the same cold requests: the same texts
            done[key] = [await spec.greedy(await spec.prompt([{"role": "user", "content": t}]), n,
                                           settings.body | cold) for t in prompts]  # fmt: skip
        outs = done[key]
        cells[kind].add(list(zip(refs, outs, strict=True)))


async def divergence(gguf: Path, *, reps: int = 5, tokens: int = 128, threads: int = 1,
                     ctx: int = 4096, prompts: list[str] | None = None,
                     settings: list[Settings] | None = None) -> dict[str, dict[str, Cell]]:  # fmt: skip
    """{settings name: {condition: Cell}}, every condition once per round."""
    prompts = list(prompts or CORPUS)
    settings = settings or settings_under_test()
    cells = {s.name: {c: Cell() for c in CONDITIONS} for s in settings}
    servers: dict = {}
    try:
        for s in settings:
            for kind in (None, *SPECULATION):
                if (s.flags, kind) not in servers:  # settings with the same flags share processes
                    flags = [*s.flags, *(SPECULATION[kind] if kind else [])]
                    server = Server(gguf, flags, threads=threads, ctx=ctx)
                    servers[(s.flags, kind)] = await server.__aenter__()
        for r in range(reps):
            order = settings if r % 2 == 0 else settings[::-1]
            done: dict = {}
            for s in order:
                await one_round(servers, s, prompts, tokens, cells[s.name], done)
            print(f"  round {r + 1}/{reps} done", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            await server.__aexit__()
    return cells


def table(cells: dict[str, dict[str, Cell]]) -> str:
    names = list(cells)
    w = max(len(n) for n in names) + 2
    head = "condition".ljust(12) + "".join(n.ljust(w + 10) for n in names)
    lines = [head]
    for c in CONDITIONS:
        lines.append(c.ljust(12) + "".join(cells[n][c].text().ljust(w + 10) for n in names))
    return "\n".join(lines)


def run(gguf: Path, *, repeats: int = 5, home: Path | None = None, say=print,
        tokens: int = 64, prompts: int = 20) -> dict[str, dict[str, Cell]]:  # fmt: skip
    """The table, for bench/real_routes.py: `repeats` rounds over the corpus's
    first `prompts`, `tokens` each. `home` is unused: llama-server is found as
    specgate finds it (engines/llamacpp/binary.py)."""
    cells = asyncio.run(divergence(gguf, reps=repeats, tokens=tokens,
                                   prompts=list(CORPUS[:prompts])))  # fmt: skip
    say(f"greedy divergence rate, {prompts} prompts x {tokens} tokens, {repeats} rounds: "
        "median [min, max] (@ median first differing token)")  # fmt: skip
    say(table(cells))
    return cells


def default_gguf() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import real_model

    from specgate.engines.home import specgate_home

    return real_model.smollm2_gguf(specgate_home())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="?", type=Path, help="default: SmolLM2-135M-Instruct.Q4_1")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=len(CORPUS), help="the corpus's first N")
    ap.add_argument(
        "--small-ubatch",
        action="store_true",
        help="a third column: -ub 32 with the cache on (batch-invariant here)",
    )
    args = ap.parse_args()
    gguf = args.gguf or default_gguf()
    cells = asyncio.run(divergence(gguf, reps=args.reps, tokens=args.tokens,
                                   threads=args.threads, prompts=list(CORPUS[: args.prompts]),
                                   settings=settings_under_test(args.small_ubatch)))  # fmt: skip
    print(
        f"greedy divergence rate on {gguf.name}, {args.prompts} prompts x {args.tokens} "
        f"tokens, {args.reps} rounds: median [min, max] (@ median first differing token)"
    )
    print(table(cells))


if __name__ == "__main__":
    main()
