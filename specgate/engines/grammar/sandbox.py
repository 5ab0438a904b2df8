"""Compile a request's grammar in a child process before any engine does.

A grammar compiler is native code fed by strangers: a schema it recurses
too deep on overflows the C stack, and that kills the process it runs in.
bounds.py refuses the known shapes of that; this is the backstop for the
unknown ones, and the time and memory budget for the slow ones. A request's
grammar is compiled here, in `python -m specgate.engines.grammar.child`,
with the model's tokenizer and the first mask computed (llguidance reports
some errors only then), before the request is admitted; only what compiled
here reaches an engine, whose own compile of the same grammar then cannot
fail differently (child.py compiles on a thread with the smallest stack an
engine thread gets).

A child that crashes or runs past `timeout_s` is killed and the request
gets a 400 naming its parameter; the next job starts a fresh child. The
children are shared by every model of the process (`SANDBOX`), at most
`workers` at once, each with each model's tokenizer sent once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import sys

from specgate.engines.grammar.matcher import GrammarError, TokenizerSpec, first_line

log = logging.getLogger(__name__)

MAX_GRAMMAR_BYTES = 8 << 20  # bounded schemas inline into far less; this is a last fence


class _Child:
    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process
        self.tokenizers: set[str] = set()

    async def ask(self, job: dict) -> str | None:
        payload = json.dumps(job).encode()
        self.process.stdin.write(struct.pack(">I", len(payload)) + payload)
        await self.process.stdin.drain()
        head = await self.process.stdout.readexactly(4)
        reply = json.loads(await self.process.stdout.readexactly(struct.unpack(">I", head)[0]))
        return reply["error"]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def end(self) -> int:
        """Kill it and reap it (a killed process exits at once)."""
        self.kill()
        return await self.process.wait()


class GrammarSandbox:
    def __init__(self, timeout_s: float = 10.0, memory_bytes: int = 4 << 30, workers: int = 2):
        self.timeout_s, self.memory_bytes, self.workers = timeout_s, memory_bytes, workers
        self._idle: list[_Child] = []
        self._reaping: set[asyncio.Future] = set()
        self._slots = asyncio.Semaphore(workers)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Jobs by outcome since start (the metrics read them).
        self.outcomes = dict.fromkeys(("ok", "refused", "crashed", "timed_out"), 0)

    async def check(self, grammar: str, param: str, tokenizer: TokenizerSpec | None) -> None:
        """Raise GrammarError (a 400 naming `param`) where the grammar does
        not compile with this tokenizer (None: the grammar alone) within
        the budget, or kills the compiler."""
        if len(grammar) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"{param}: the grammar is larger than {MAX_GRAMMAR_BYTES} bytes")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # children and slots belong to one event loop
            for child in self._idle:
                child.kill()
            self._idle, self._slots, self._loop = [], asyncio.Semaphore(self.workers), loop
        async with self._slots:
            child = self._idle.pop() if self._idle else await self._start()
            try:
                async with asyncio.timeout(self.timeout_s):
                    if tokenizer is not None and tokenizer.key not in child.tokenizers:
                        error = await child.ask({"op": "tokenizer", "key": tokenizer.key,
                                                 "json": tokenizer.json, "n_vocab": tokenizer.n_vocab,
                                                 "eos": list(tokenizer.eos)})  # fmt: skip
                        if error:
                            raise GrammarError(f"this model's tokenizer cannot drive constrained "
                                               f"decoding: {first_line(error)}")  # fmt: skip
                        child.tokenizers.add(tokenizer.key)
                    error = await child.ask({"op": "check", "grammar": grammar,
                                             "tokenizer": tokenizer and tokenizer.key})  # fmt: skip
            except TimeoutError:
                await child.end()
                self.outcomes["timed_out"] += 1
                raise GrammarError(f"{param}: the grammar did not compile within "
                                   f"{self.timeout_s:g} s; simplify the schema") from None  # fmt: skip
            except (asyncio.IncompleteReadError, ConnectionError):
                code = await child.end()
                self.outcomes["crashed"] += 1
                log.warning(
                    "the grammar compiler's child ended with %s on a request's %s", code, param
                )
                raise GrammarError(f"{param}: the grammar compiler failed on this schema "
                                   "(it exceeded the compiler's stack or memory); simplify it") from None  # fmt: skip
            except BaseException:  # cancelled mid-job: the child's state is unknown
                child.kill()
                self._reaping.add(task := asyncio.ensure_future(child.process.wait()))
                task.add_done_callback(self._reaping.discard)
                raise
            self._idle.append(child)
        self.outcomes["refused" if error else "ok"] += 1
        if error:
            raise GrammarError(f"{param}: {first_line(error)}")

    async def _start(self) -> _Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "specgate.engines.grammar.child", str(self.memory_bytes),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        return _Child(process)

    async def close(self) -> None:
        children, self._idle = self._idle, []
        for child in children:
            child.process.stdin.close()  # it ends at end of input
            try:
                await asyncio.wait_for(child.process.wait(), 2.0)
            except TimeoutError:
                await child.end()
        if self._reaping:
            await asyncio.wait(self._reaping, timeout=2.0)


SANDBOX = GrammarSandbox()
