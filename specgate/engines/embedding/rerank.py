"""Relevance of a document to a query, from a causal LM asked "yes" or "no".

Qwen3-Reranker's published recipe: the pair is written into a fixed chat
(a system turn that asks for "yes" or "no", the instruction, query and
document in the user turn, an empty thinking block opening the answer), and
the score is the probability of "yes" against "no" at the next token. The
prompt's head and tail are written here as that model's card writes them;
only the middle (instruction, query, document) is the caller's text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

HEAD = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
        "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
        "<|im_end|>\n<|im_start|>user\n")  # fmt: skip
TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def middle(instruction: str, query: str, document: str) -> str:
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def prompts(tokenizer, instruction: str, query: str, documents: list[str],
            max_tokens_per_doc: int | None) -> list[list[int]]:  # fmt: skip
    """Each pair's prompt, tokenized: the head, the middle, the tail, as
    the recipe writes them; a document cut to `max_tokens_per_doc` where
    the client asked for that. (On the CPU workers: it tokenizes.)"""
    head = tokenizer.encode(HEAD, add_special_tokens=False)
    tail = tokenizer.encode(TAIL, add_special_tokens=False)
    out = []
    for doc in documents:
        if max_tokens_per_doc is None:
            body = tokenizer.encode(middle(instruction, query, doc), add_special_tokens=False)
        else:
            body = tokenizer.encode(middle(instruction, query, ""), add_special_tokens=False)
            body += tokenizer.encode(doc, add_special_tokens=False)[:max_tokens_per_doc]
        out.append(list(head) + list(body) + list(tail))
    return out


@dataclass(frozen=True)
class Answers:
    """The vocabulary ids of the two answers the score compares."""

    yes: int
    no: int


def answers(tokenizer) -> Answers:
    """"yes" and "no" as single tokens of this vocabulary; a vocabulary that
    spells either in several cannot be scored this way (ValueError)."""
    ids = []
    for word in ("yes", "no"):
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"the tokenizer writes {word!r} as {len(encoded)} tokens; a reranker "
                             "scores one-token answers")  # fmt: skip
        ids.append(encoded[0])
    return Answers(*ids)


def score(yes_logit: float, no_logit: float) -> float:
    """P(yes) over the two answers: softmax of their logits."""
    return 1.0 / (1.0 + math.exp(no_logit - yes_logit))
