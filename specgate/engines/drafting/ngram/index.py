"""Drafts copied from a sequence itself: what followed the longest earlier match of its tail.

Coding agents re-send and re-emit the same text (a file they edit, a tool
result they quote, a function repeated with a rename), so the tokens that
followed an earlier occurrence of the sequence's last few tokens are often
its next ones. `NgramIndex` knows, for every n-gram of `min_match`..`max_key`
tokens, where it occurred. A draft:

1. takes the longest key ending the sequence that occurred before, and
   extends its latest PER_KEY occurrences backwards to their true match
   length (up to MAX_MATCH): the occurrences sharing the longest match are
   the candidates (SuffixDecoding's matched node, without building the
   suffix tree);
2. walks forward, each step taking the token most candidates continue with
   (the most recent occurrence's on a tie) and dropping the ones that
   disagree; it stops where fewer than half agree (the text forked there);
3. is at most `max_drafts` long and at most `per_match` times the match:
   a long match is strong evidence that the copy goes on, a two-token
   match in prose is weak (SuffixDecoding's adaptive speculation length).

A continuation may run into the sequence's own tail (a repeating pattern):
the copy then reads the drafts it has made so far.

Two parts, because an agent's prompt arrives tens of thousands of tokens at
once and its answer a few tokens a round: the bulk is a sorted array of
64-bit n-gram hashes per key length (numpy: a 100k-token prompt in tens of
milliseconds, a few MB), the tokens added since in a dict of n-grams; the
fresh part is folded into the arrays when it grows past FRESH_MAX. A hash
match is checked against the tokens themselves, so a collision costs
nothing but the check.

Written here, not taken from a library: ArcticInference's suffix-decoding
cache builds only against PyTorch (its build requires torch >= 2.10),
llama.cpp's n-gram maps live inside its C++ server, and what a proposer
needs is this much.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_MATCH = 2  # tokens of the tail that must have occurred before to copy at all
MAX_KEY = 4  # the longest n-gram indexed; longer matches are found by extending
MAX_MATCH = 64  # match lengths are measured up to this
PER_KEY = 32  # occurrences of a key considered (the most recent)
PER_MATCH = 1.0  # drafts per matched token
FRESH_MAX = 2048  # tokens indexed in the dict before they are folded into the arrays
_MULT = 0x9E3779B97F4A7C15  # an odd 64-bit multiplier for the n-gram hash
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    match: int  # how many tokens of the tail matched the copied occurrence
    support: int  # earlier occurrences of that match (before the walk split them)


def _hash(key: Sequence[int]) -> int:
    """The n-gram's hash, as `_hashes` computes it for every position."""
    h = 0
    for t in key:
        h = (h * _MULT + t + 1) & _MASK
    return h


def _hashes(tokens: np.ndarray, k: int) -> np.ndarray:
    """The hash of every k-gram of `tokens` (uint64, wrapping), by its end."""
    h = np.zeros(len(tokens) - k + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(k):
            h = h * np.uint64(_MULT) + tokens[j : len(tokens) - k + 1 + j] + np.uint64(1)
    return h


class NgramIndex:
    def __init__(self, min_match: int = MIN_MATCH, max_key: int = MAX_KEY,
                 per_match: float = PER_MATCH):  # fmt: skip
        if min_match < 1:
            raise ValueError("min_match must be >= 1")
        self.min_match, self.max_key = min_match, max(max_key, min_match)
        self.per_match = per_match
        self.tokens: list[int] = []
        # tokens[:frozen] as, per key length k, (sorted hashes, the end of
        # each occurrence): equal hashes keep their ends in ascending order.
        self._frozen = 0
        self._sorted: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # n-grams ending after `frozen` -> their ends, oldest first
        self._fresh: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(tokens)
        if len(self.tokens) - self._frozen > FRESH_MAX:
            self._freeze()
            return
        seq, fresh = self.tokens, self._fresh
        for end in range(start + 1, len(seq) + 1):
            for k in range(self.min_match, min(self.max_key, end) + 1):
                fresh.setdefault(tuple(seq[end - k : end]), []).append(end)

    def _freeze(self) -> None:
        arr = np.asarray(self.tokens, dtype=np.uint64)
        self._sorted = {}
        for k in range(self.min_match, self.max_key + 1):
            if len(arr) < k:
                continue
            h = _hashes(arr, k)
            order = np.argsort(h, kind="stable")
            self._sorted[k] = (h[order], (order + k).astype(np.int64))
        self._frozen, self._fresh = len(self.tokens), {}

    def _occurrences(self, key: tuple[int, ...], before: int) -> list[int]:
        """The ends of `key`'s latest PER_KEY occurrences ending before `before`, oldest first."""
        k, seq = len(key), self.tokens
        found: list[int] = []
        if k in self._sorted:
            hashes, ends = self._sorted[k]
            h = np.uint64(_hash(key))
            lo, hi = np.searchsorted(hashes, h, "left"), np.searchsorted(hashes, h, "right")
            found = [e for e in ends[max(lo, hi - PER_KEY) : hi].tolist()
                     if e < before and tuple(seq[e - k : e]) == key]  # fmt: skip
        found += [e for e in self._fresh.get(key, ()) if e < before]
        return found[-PER_KEY:]

    def draft(self, max_drafts: int) -> Draft | None:
        """Up to `max_drafts` tokens copied after the longest earlier match
        of the tail, or None when nothing worth copying matched."""
        seq, n = self.tokens, len(self.tokens)
        if max_drafts < 1:
            return None
        ends: list[int] = []
        k = min(self.max_key, n - 1)
        while k >= self.min_match:
            ends = self._occurrences(tuple(seq[n - k :]), n)
            if ends:
                break
            k -= 1
        if not ends:
            return None
        best, candidates = k, []  # most recent first
        for e in reversed(ends):
            m = k
            while m < MAX_MATCH and m < e and seq[e - 1 - m] == seq[n - 1 - m]:
                m += 1
            if m > best:
                best, candidates = m, [e]
            elif m == best:
                candidates.append(e)
        budget = min(max_drafts, int(best * self.per_match))
        drafts: list[int] = []
        support = len(candidates)
        while len(drafts) < budget:
            j = len(drafts)
            votes: dict[int, list[int]] = {}
            for e in candidates:
                i = e + j
                votes.setdefault(seq[i] if i < n else drafts[i - n], []).append(e)
            token, agree = max(votes.items(), key=lambda kv: len(kv[1]))  # first: most recent
            if 2 * len(agree) < len(candidates):
                break
            drafts.append(token)
            candidates = agree
        return Draft(drafts, best, support) if drafts else None
