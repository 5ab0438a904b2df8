"""How much of a copied draft is verified (specgate/engines/drafting/ngram/copy_length.py):
the length with the most expected tokens per second, from acceptance per
match-length bucket and the measured cost of each verify width. Pure logic,
no MLX; that a cut draft decodes the same is tests/test_ngram_exactness.py's."""

from __future__ import annotations

import pytest

from specgate.engines.drafting.ngram.copy_length import (
    COST_WINDOW,
    EXPLORE_EVERY,
    MIN_ROUNDS,
    CopyEvidence,
    best_length,
    match_bucket,
)

CPU = [13.0 + 4.0 * (w - 1) for w in range(1, 10)]  # ms: each row a third of a step
GPU = [10.0 + 0.1 * (w - 1) for w in range(1, 10)]  # a row nearly free


def test_best_length_weighs_expected_tokens_against_verify_cost():
    sure, weak = [1.0] * 8, [0.5] + [0.4] * 7
    assert best_length(sure, CPU) == 8  # every draft stands: the whole copy pays
    assert best_length(weak, CPU) == 1  # 1.5 tokens for 17 ms beats 1 for 13, 1.7 for 21
    assert best_length(weak, GPU) == 4  # rows nearly free: on until a row adds < 1 % tokens
    assert best_length([0.2] * 8, CPU) == 0  # a plain step beats any of it
    assert best_length([1.0, 0.0, 1.0], CPU[:4]) == 1  # the copy forks after one token
    assert best_length([], CPU[:1]) == 0


def test_match_buckets():
    assert [match_bucket(m) for m in (2, 3, 4, 5, 6, 8, 9, 15, 16, 31, 32, 64)] == \
        [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]  # fmt: skip


def feed_costs(ev: CopyEvidence, costs_ms, widths=(1, 9)):
    for w in widths:
        for _ in range(MIN_ROUNDS + 1):  # the first of each width is its warm-up
            ev.observe(None if w == 1 else 2, w - 1, w - 1, costs_ms[w - 1] / 1000)


def test_evidence_cuts_weak_copies_where_rows_cost_and_keeps_strong_ones():
    ev = CopyEvidence()
    assert ev.length(2, 5) == 5  # nothing measured: the copy goes whole
    feed_costs(ev, CPU)
    assert ev.costs(9) == pytest.approx([c / 1000 for c in CPU])  # a line through widths 1 and 9
    # Two-token matches: the first draft stands half the time, the second never.
    for i in range(40):
        ev.observe(2, 2, 1 if i % 2 else 0, 0.021)
    # Twenty-token matches: every draft stands.
    for _ in range(10):
        ev.observe(20, 8, 8, 0.045)
    lengths = [ev.length(2, 2) for _ in range(2 * EXPLORE_EVERY)]
    assert lengths.count(2) == 2 and set(lengths) == {1, 2}  # whole only to explore
    assert ev.length(20, 8) == 8
    assert ev.length(40, 8) == 8  # an unmeasured bucket: optimistic


def test_evidence_keeps_the_copy_where_rows_are_free():
    ev = CopyEvidence()
    feed_costs(ev, GPU)
    for i in range(40):
        ev.observe(2, 2, 1 if i % 2 else 0, 0.010)
    assert [ev.length(2, 2) for _ in range(EXPLORE_EVERY)] == [2] * EXPLORE_EVERY


def test_graph_builds_and_stalls_do_not_price_a_width_out():
    """Each width's first round (its graph build) is skipped, and a cost is
    a median: the builds MLX's CUDA build pays whenever the KV buffer grows
    must not make the whole copy look dear on a GPU, where rows are cheap."""
    ev = CopyEvidence()
    for w, ms in ((1, 8.0), (9, 16.0)):
        ev.observe(None if w == 1 else 40, w - 1, w - 1, 0.5)  # the graph build
        for i in range(12):
            stall = i % 5 == 4  # a rebuild now and then
            ev.observe(None if w == 1 else 40, w - 1, w - 1, 0.07 if stall else ms / 1000)
    assert ev.costs(9)[-1] == pytest.approx(0.016)
    assert ev.length(40, 8) == 8
    for _ in range(COST_WINDOW):
        ev.observe(None, 0, 0, 0.026)  # the machine got busier
    assert ev.costs(1)[0] == pytest.approx(0.026)
