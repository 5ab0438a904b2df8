"""specgate/engines/drafting/ngram/index.py: what a copy from the context proposes, checked directly."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specgate.engines.drafting.ngram.index import MAX_MATCH, PER_KEY, Draft, NgramIndex


def index(tokens: list[int], **kw) -> NgramIndex:
    ix = NgramIndex(**kw)
    ix.extend(tokens)
    return ix


def test_nothing_to_copy_without_an_earlier_match():
    assert index([1, 2, 3, 4, 5]).draft(8) is None
    assert index([1, 2, 3, 1]).draft(8) is None  # one token matched: below min_match
    assert index([]).draft(8) is None and index([7]).draft(8) is None
    assert index([1, 2, 3, 1, 2]).draft(0) is None


def test_copies_what_followed_and_stops_at_the_budget():
    # "1 2 3" matched (3 tokens): at most 3 drafts at one per matched token.
    ix = index([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3])
    assert ix.draft(8) == Draft([4, 5, 6], match=3, support=1)
    assert ix.draft(2).tokens == [4, 5]
    twice = index([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], per_match=2.0)
    assert twice.draft(8).tokens == [4, 5, 6, 7, 8, 9]


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    # The 4-gram 1 2 3 4 occurs twice; extended backwards, the older one
    # matches 5 tokens (5 1 2 3 4), the newer only 4 (6 1 2 3 4).
    ix = index([5, 1, 2, 3, 4, 9, 9, 6, 1, 2, 3, 4, 8, 5, 1, 2, 3, 4])
    d = ix.draft(3)
    assert d.match == 5 and d.tokens == [9, 9, 6]


def test_candidates_vote_and_a_fork_ends_the_draft():
    # "1 2" followed three times: 3 7 / 3 8 / 4 9. Two of three agree on 3,
    # then the two left split 7 / 8: a tie, which the most recent (8) takes.
    ix = index([1, 2, 3, 7, 10, 1, 2, 3, 8, 11, 1, 2, 4, 9, 12, 1, 2], per_match=4.0)
    d = ix.draft(8)
    assert d.support == 3 and d.tokens[:2] == [3, 8]
    # Three ways apart at once: no majority, no draft.
    assert index([1, 2, 3, 10, 1, 2, 4, 11, 1, 2, 5, 12, 1, 2]).draft(8) is None


def test_a_repeating_tail_reads_its_own_drafts():
    assert index([1, 2, 1, 2, 1, 2]).draft(4).tokens == [1, 2, 1, 2]
    assert index([5, 5, 5, 5, 5]).draft(3).tokens == [5, 5, 5]


def test_extending_step_by_step_equals_indexing_at_once():
    seq = [(i * 7) % 11 for i in range(200)] + [3, 1, 4, 1, 5] * 5
    whole = index(seq)
    step = NgramIndex()
    for i in range(0, len(seq), 3):
        step.extend(seq[i : i + 3])
        assert step.draft(6) == index(seq[: i + 3]).draft(6)
    assert step.draft(6) == whole.draft(6) and len(step) == len(seq)


def test_frequent_ngrams_keep_their_most_recent_occurrences():
    # 0 0 occurs hundreds of times: followed by 1 in the older text, by 2
    # in the last 40. Only the most recent PER_KEY are kept, so the copy is 2.
    seq = [0, 0, 1] * 300 + [0, 0, 2] * 40 + [0, 0]
    d = index(seq, max_key=2).draft(2)
    assert d is not None and d.support <= PER_KEY and d.tokens[0] == 2


def brute_longest(seq: list[int], min_match: int) -> int:
    """The longest tail (>= min_match, <= MAX_MATCH) that also ends earlier."""
    n, best = len(seq), 0
    for e in range(1, n):
        m = 0
        while m < MAX_MATCH and m < e and seq[e - 1 - m] == seq[n - 1 - m]:
            m += 1
        best = max(best, m)
    return best if best >= min_match else 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=60), st.integers(1, 10))
def test_drafts_copy_the_longest_earlier_match(seq, depth):
    # Few enough occurrences of each key that none was trimmed (len <= 60 < PER_KEY * 2).
    d = index(seq).draft(depth)
    longest = brute_longest(seq, 2)
    if d is None:
        return  # no match, or the candidates forked at once
    assert d.match == longest and 1 <= len(d.tokens) <= min(depth, d.match)
    # The draft is what followed an occurrence of the matched tail.
    n, tail = len(seq), seq[len(seq) - d.match :]
    ext = seq + d.tokens
    assert any(seq[e - d.match : e] == tail and ext[e : e + len(d.tokens)] == d.tokens
               for e in range(d.match, n))  # fmt: skip


def reference_draft(seq: list[int], max_drafts: int, min_match=2, max_key=4, per_match=1.0):
    """The same rules by brute force over the whole sequence (no index)."""
    n = len(seq)
    for k in range(min(max_key, n - 1), min_match - 1, -1):
        ends = [e for e in range(k, n) if seq[e - k : e] == seq[n - k :]][-PER_KEY:]
        if ends:
            break
    else:
        return None
    best, candidates = k, []
    for e in reversed(ends):
        m = k
        while m < MAX_MATCH and m < e and seq[e - 1 - m] == seq[n - 1 - m]:
            m += 1
        if m > best:
            best, candidates = m, [e]
        elif m == best:
            candidates.append(e)
    drafts, support = [], len(candidates)
    while len(drafts) < min(max_drafts, int(best * per_match)):
        j, votes = len(drafts), {}
        for e in candidates:
            votes.setdefault(seq[e + j] if e + j < n else drafts[e + j - n], []).append(e)
        token, agree = max(votes.items(), key=lambda kv: len(kv[1]))
        if 2 * len(agree) < len(candidates):
            break
        drafts.append(token)
        candidates = agree
    return Draft(drafts, best, support) if drafts else None


def long_sequence(rng, n: int) -> list[int]:
    """Random text with copied spans, some of them edited, and runs of one token."""
    seq = [rng.randrange(50) for _ in range(200)]
    while len(seq) < n:
        r = rng.random()
        if r < 0.5:
            start = rng.randrange(len(seq) - 20)
            span = seq[start : start + rng.randint(5, 60)]
            if rng.random() < 0.5:
                span[rng.randrange(len(span))] = rng.randrange(50)
            seq += span
        elif r < 0.6:
            seq += [7] * rng.randint(3, 40)
        else:
            seq += [rng.randrange(50) for _ in range(rng.randint(1, 30))]
    return seq[:n]


def test_the_arrays_and_the_fresh_dict_agree_with_brute_force():
    """A prompt far past FRESH_MAX arrives at once (into the sorted arrays),
    then the answer a few tokens at a time (into the dict, folded in when it
    grows): every draft on the way is the brute-force one."""
    import random

    from specgate.engines.drafting.ngram.index import FRESH_MAX

    rng = random.Random(3)
    seq = long_sequence(rng, 5000 + 2 * FRESH_MAX + 500)
    ix = NgramIndex()
    ix.extend(seq[:5000])
    assert ix._frozen == 5000 and not ix._fresh
    pos, checked = 5000, 0
    while pos < len(seq):
        step = rng.randint(1, 9)
        ix.extend(seq[pos : pos + step])
        pos = min(len(seq), pos + step)
        if rng.random() < 0.3:
            assert ix.draft(8) == reference_draft(seq[:pos], 8), pos
            checked += 1
    assert ix._frozen > 5000 and checked > 100


def test_a_hash_collision_costs_nothing_but_the_check(monkeypatch):
    """With every n-gram hashing alike, the tokens themselves decide."""
    import random

    from specgate.engines.drafting.ngram import index as ngram_index

    monkeypatch.setattr(ngram_index, "_hash", lambda key: 0)
    monkeypatch.setattr(ngram_index, "_hashes",
                        lambda tokens, k: np.zeros(len(tokens) - k + 1, dtype=np.uint64))  # fmt: skip
    rng = random.Random(5)
    seq = long_sequence(rng, 3000)
    for n in range(2500, 3000, 37):
        ix = NgramIndex()
        ix.extend(seq[:n])  # past FRESH_MAX: the arrays alone
        want = reference_draft(seq[:n], 8)
        got = ix.draft(8)
        # Every occurrence of every key shares one hash: the PER_KEY latest
        # of them are the candidates, checked token by token, so fewer real
        # occurrences may be seen than by exact keys, never a wrong one.
        assert got is None or (want is not None and got.match <= want.match)
        if got is not None:
            tail = seq[n - got.match : n]
            assert any(seq[e - got.match : e] == tail for e in range(got.match, n))  # a real match
