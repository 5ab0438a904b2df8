"""The grammar compiler's child process (sandbox.py starts it): reads jobs
from stdin, compiles each grammar, writes whether it compiled.

Each job compiles on a thread of its own with a 2 MiB stack, the smallest
an engine thread gets (glibc's default when the stack rlimit is
unlimited), so a grammar that compiles here compiles on any engine
thread; the address space is capped where the OS enforces it. What kills
this process (a stack overflow, the cap) kills only this process.

Wire format, both ways: a 4-byte big-endian length, then JSON.
- {"op": "tokenizer", "key", "json", "n_vocab", "eos"}: keep a tokenizer
  (its tokenizer.json text) for later jobs; answers {"error": null}.
- {"op": "check", "grammar", "tokenizer": key or null}: compile and
  compute the first mask (llguidance reports some errors only there);
  without a tokenizer, validate only. Answers {"error": message or null}.
"""

from __future__ import annotations

import json
import resource
import struct
import sys
import threading

import llguidance

STACK_BYTES = 2 << 20


def main() -> None:
    memory = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if memory:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        except (ValueError, OSError):  # macOS does not enforce RLIMIT_AS
            pass
    threading.stack_size(STACK_BYTES)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizers: dict[str, llguidance.LLTokenizer] = {}
    while True:
        head = stdin.read(4)
        if len(head) < 4:
            return  # the gateway is gone
        job = json.loads(stdin.read(struct.unpack(">I", head)[0]))
        answer: dict = {}
        worker = threading.Thread(target=_run, args=(job, tokenizers, answer))
        worker.start()
        worker.join()
        reply = json.dumps({"error": answer.get("error")}).encode()
        stdout.write(struct.pack(">I", len(reply)) + reply)
        stdout.flush()


def _run(job: dict, tokenizers: dict, answer: dict) -> None:
    try:
        if job["op"] == "tokenizer":
            tokenizers[job["key"]] = llguidance.LLTokenizer(
                job["json"], n_vocab=job["n_vocab"], eos_token=job["eos"])  # fmt: skip
            return
        tokenizer = tokenizers.get(job["tokenizer"]) if job["tokenizer"] else None
        if tokenizer is None:
            answer["error"] = llguidance.LLMatcher.validate_grammar(job["grammar"]) or None
            return
        matcher = llguidance.LLMatcher(tokenizer, job["grammar"], log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            answer["error"] = matcher.get_error()
    except Exception as e:  # a bad grammar or tokenizer, as llguidance reports it
        answer["error"] = f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    main()
