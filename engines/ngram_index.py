"""Drafts copied from a sequence itself: what followed the longest earlier match of its tail.

Coding agents re-send and re-emit the same text (a file they edit, a tool
result they quote, a function repeated with a rename), so the tokens that
followed an earlier occurrence of the sequence's last few tokens are often
its next ones. `NgramIndex` keeps, for every n-gram of `min_match`..`max_key`
tokens, where its most recent occurrences ended. A draft:

1. takes the longest key ending the sequence that occurred before, and
   extends each occurrence backwards to its true match length (up to
   MAX_MATCH): the occurrences sharing the longest match are the candidates
   (SuffixDecoding's matched node, without building the suffix tree);
2. walks forward, each step taking the token most candidates continue with
   (the most recent occurrence's on a tie) and dropping the ones that
   disagree; it stops where fewer than half agree (the text forked there);
3. is at most `max_drafts` long and at most `per_match` times the match:
   a long match is strong evidence that the copy goes on, a two-token
   match in prose is weak (SuffixDecoding's adaptive speculation length).

A continuation may run into the sequence's own tail (a repeating pattern):
the copy then reads the drafts it has made so far.

Pure Python on token lists, no MLX. Written here, not taken from a library:
ArcticInference's suffix-decoding cache builds only against PyTorch (its
build requires torch >= 2.10), llama.cpp's n-gram maps live inside its C++
server, and what a proposer needs is this much.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_MATCH = 2  # tokens of the tail that must have occurred before to copy at all
MAX_KEY = 4  # the longest n-gram indexed; longer matches are found by extending
MAX_MATCH = 64  # match lengths are measured up to this
PER_KEY = 32  # occurrences kept per n-gram (the most recent)
PER_MATCH = 1.0  # drafts per matched token


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    match: int  # how many tokens of the tail matched the copied occurrence
    support: int  # earlier occurrences of that match (before the walk split them)


class NgramIndex:
    def __init__(self, min_match: int = MIN_MATCH, max_key: int = MAX_KEY,
                 per_match: float = PER_MATCH):  # fmt: skip
        if min_match < 1:
            raise ValueError("min_match must be >= 1")
        self.min_match, self.max_key = min_match, max(max_key, min_match)
        self.per_match = per_match
        self.tokens: list[int] = []
        # n-gram -> the positions just after its occurrences, oldest first
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        seq, ends_of = self.tokens, self._ends
        for t in tokens:
            seq.append(t)
            end = len(seq)
            for k in range(self.min_match, min(self.max_key, end) + 1):
                key = tuple(seq[end - k :])
                ends = ends_of.get(key)
                if ends is None:
                    ends_of[key] = [end]
                    continue
                ends.append(end)
                if len(ends) > 2 * PER_KEY:  # trimmed in batches: amortised O(1)
                    del ends[:PER_KEY]

    def draft(self, max_drafts: int) -> Draft | None:
        """Up to `max_drafts` tokens copied after the longest earlier match
        of the tail, or None when nothing worth copying matched."""
        seq, n = self.tokens, len(self.tokens)
        if max_drafts < 1:
            return None
        ends: list[int] = []
        k = min(self.max_key, n - 1)
        while k >= self.min_match:
            ends = [e for e in self._ends.get(tuple(seq[n - k :]), ()) if e < n]
            if ends:
                break
            k -= 1
        if not ends:
            return None
        best, candidates = k, []  # most recent first
        for e in reversed(ends[-PER_KEY:]):
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
