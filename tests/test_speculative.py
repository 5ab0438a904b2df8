"""specgate/engines/mlx_spec/acceptance.py: the acceptance rules, checked for exactness.

The greedy rule and the residual are checked on hand-made cases. A seeded
request's rule (the greedy rule on each position's Gumbel-max token, at the
end of this module) is checked to commit plain seeded sampling's tokens
whatever the drafts, and its law in a sample as below. The unseeded sampled
rule (Leviathan-Chen rejection sampling) is checked as a *distribution*: we
run many seeded speculative rounds against known target distributions and
compare the committed tokens with the target's own distribution in total
variation (TV), then show that the same test rejects a subtly wrong rule.

Statistical model used by the exactness tests
---------------------------------------------
Real drafts and targets condition on the prefix. Here both are prefix-
independent but position-specific: the token at absolute stream position t
(t = 0, 1, ...) has target distribution P[t] and draft distribution Q[t],
whatever came before. That is a valid special case of the algorithm, and the
target's joint distribution of the stream is then the product
P[0] x P[1] x ... . A round that starts at stream position s drafts
d_j ~ Q[s + j] (j < k) and verifies with p_j = P[s + j] (j <= k), exactly as
an engine would with models whose conditionals ignore the prefix. Each
simulated stream runs rounds until it has L committed tokens; the first L
tokens must then be distributed as P[0] x ... x P[L-1]. Positions past the
first round (a rejection at j, then a new round at s = j + 1) are covered
too, so corrections, bonus tokens and round boundaries all get checked.

Bound. For n i.i.d. samples of a distribution with m outcomes of positive
probability, E|p_hat_i - p_i| <= sqrt(p_i (1 - p_i) / n), so by
Cauchy-Schwarz E[TV] <= 0.5 * sqrt(m / n). TV is a function of n
independent samples that moves by at most 1/n when one sample changes, so
McDiarmid gives P(TV >= E[TV] + t) <= exp(-2 n t^2). With the threshold
3 * 0.5 * sqrt(m / n) (i.e. t = sqrt(m / n)) a correct rule fails a check
with probability <= exp(-2 m) for a random seed; the seeds here are fixed, so
the test is deterministic. Outcomes outside the target's support count in
the empirical TV, so a rule that commits an impossible token is caught too.

Exact law. The same model's law of the first L committed tokens is also
computed exactly, with no sampling, from the rule's own two parts: which
uniforms accept a draft (`accepted_drafts`, its acceptance measure found
by bisection on u, so a threshold off by 0.05 shows) and what the last
token is drawn from (`next_token_distribution`), over every draft tuple,
every first rejection and every later round. It must equal P[0] x ... x
P[L-1] to float precision. That is the fast tier's proof of the rule; the
20,000-stream TV tests (the proof tier, `pytest -m proof`) prove the same
of `accept_sampled` whole, its random draws included, and the fast tier
keeps one smaller sample of it for the glue between the parts.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from specgate.engines.base import SamplingParams
from specgate.engines.mlx_spec.acceptance import (
    Verdict,
    accept_greedy,
    accept_sampled,
    accepted_drafts,
    next_token_distribution,
    point_masses,
    residual,
)
from specgate.engines.sampling import gumbel_max, gumbel_noise, probabilities, sample

V = 6  # tiny vocabulary for the statistical tests

Rule = Callable[[Sequence[int], mx.array, mx.array, mx.array], Verdict]


# --------------------------------------------------------------------- greedy


@pytest.mark.parametrize(
    ("draft", "target_argmax", "expected"),
    [
        # all accepted: the bonus is target_argmax[k]
        ([5, 7, 9], [5, 7, 9, 11], Verdict(3, 11)),
        ([4], [4, 0], Verdict(1, 0)),
        # first mismatch at j: the correction is target_argmax[j]
        ([5, 7, 9], [4, 7, 9, 11], Verdict(0, 4)),
        ([5, 7, 9], [5, 8, 9, 11], Verdict(1, 8)),
        ([5, 7, 9], [5, 7, 2, 11], Verdict(2, 2)),
        # positions after the first mismatch do not matter, even if they agree
        ([1, 2, 3, 4], [1, 0, 3, 4, 5], Verdict(1, 0)),
        ([3], [2, 3], Verdict(0, 2)),
        # k = 0: just the target's token
        ([], [3], Verdict(0, 3)),
    ],
)
def test_accept_greedy_longest_prefix_plus_one(draft, target_argmax, expected):
    assert accept_greedy(draft, target_argmax) == expected
    # numpy / mx integer inputs give plain ints back
    got = accept_greedy(list(np.array(draft, dtype=np.int64)), np.array(target_argmax))
    assert got == expected
    assert type(got.next_token) is int


# ------------------------------------------------------------------- residual


def _np_residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    return r / r.sum(axis=-1, keepdims=True)


def test_residual_is_normalized_positive_part():
    rng = np.random.default_rng(0)
    for _ in range(20):
        p = rng.dirichlet(np.ones(9)).astype(np.float32)
        q = rng.dirichlet(np.ones(9)).astype(np.float32)
        got = np.array(residual(mx.array(p), mx.array(q)))
        np.testing.assert_allclose(got, _np_residual(p, q), rtol=1e-5, atol=1e-7)
        assert abs(got.sum() - 1.0) < 1e-5
        # zero exactly where q >= p
        assert np.all(got[q >= p] == 0.0)


def test_residual_falls_back_to_p_when_equal():
    p = np.array([0.5, 0.25, 0.0, 0.25], dtype=np.float32)
    np.testing.assert_array_equal(np.array(residual(mx.array(p), mx.array(p))), p)
    # batched (..., V): one row equal, one row not; each row handled alone
    q = np.array([0.25, 0.25, 0.25, 0.25], dtype=np.float32)
    P = mx.array(np.stack([p, p]))
    Q = mx.array(np.stack([p, q]))
    got = np.array(residual(P, Q))
    np.testing.assert_array_equal(got[0], p)
    np.testing.assert_allclose(got[1], [1.0, 0.0, 0.0, 0.0], atol=1e-7)


def test_residual_never_puts_mass_where_p_is_zero():
    rng = np.random.default_rng(1)
    for trial in range(50):
        logits = mx.array(rng.normal(size=(2, 12)).astype(np.float32) * 2)
        p = probabilities(logits[0], SamplingParams(top_k=3 + trial % 5, top_p=0.8))
        q = probabilities(logits[1], SamplingParams(temperature=1.5))
        r = np.array(residual(p, q))
        p_np = np.array(p)
        assert np.all(r[p_np == 0.0] == 0.0)
        assert abs(r.sum() - 1.0) < 1e-5
        assert np.all(r >= 0.0)


# ------------------------------------------------- sampled: exactness, in TV


def _truncated(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Rows of specgate.engines.sampling.probabilities (float32), as the engine sees them."""
    return np.array(probabilities(mx.array(logits.astype(np.float32)), params))


def _case(
    seed: int, rows: int, p_params: SamplingParams, q_params: SamplingParams, q_noise: float = 0.8
):
    """Random target rows P and draft rows Q (a noisy copy of the target logits)."""
    rng = np.random.default_rng(seed)
    target_logits = rng.normal(size=(rows, V)) * 1.5
    draft_logits = target_logits + rng.normal(size=(rows, V)) * q_noise
    return _truncated(target_logits, p_params), _truncated(draft_logits, q_params)


def _simulate(
    rule: Rule, P: np.ndarray, Q: np.ndarray, k: int, length: int, n: int, seed: int
) -> tuple[np.ndarray, int]:
    """n independent streams, each run round by round until `length` tokens are
    committed; returns their first `length` tokens (n, length) and the number of
    rule calls. P: (length + k, V) float32, Q: (length + k - 1, V) float32."""
    assert P.shape[0] >= length + k and Q.shape[0] >= length + k - 1
    rng = np.random.default_rng(seed)
    # Drafts, pre-drawn by inverse CDF: for a round starting at stream position
    # s, drafts[s][i, j] ~ Q[s + j]. A stream starts at most one round at each s,
    # so every round gets fresh independent drafts.
    drafts = []
    for s in range(length):
        cols = []
        for j in range(k):
            cdf = np.cumsum(Q[s + j].astype(np.float64))
            u = rng.random(n) * cdf[-1]
            cols.append(np.searchsorted(cdf, u, side="right"))  # never a 0-mass token
        drafts.append(np.stack(cols, axis=1) if k else np.zeros((n, 0), dtype=np.int64))
    p_rows = [mx.array(P[s : s + k + 1]) for s in range(length)]
    q_rows = [mx.array(Q[s : s + k]) for s in range(length)]
    mx.eval(p_rows, q_rows)
    keys = mx.random.split(mx.random.key(seed), n * length)  # >= rounds needed
    out = np.empty((n, length), dtype=np.int64)
    calls = 0
    for i in range(n):
        s = 0
        while s < length:
            d = [int(t) for t in drafts[s][i]]
            v = rule(d, q_rows[s], p_rows[s], keys[calls])
            calls += 1
            assert 0 <= v.accepted <= k
            committed = d[: v.accepted] + [v.next_token]
            take = committed[: length - s]
            out[i, s : s + len(take)] = take
            s += len(take)
    return out, calls


def _tv_checks(tokens: np.ndarray, P: np.ndarray) -> list[tuple[str, float, float]]:
    """(name, TV, bound) for the marginal at every position and the joint of
    the first two positions (the pair must be P[0] x P[1])."""
    n, length = tokens.shape
    P64 = P.astype(np.float64)
    P64 = P64 / P64.sum(axis=-1, keepdims=True)
    checks = []

    def check(name: str, idx: np.ndarray, exact: np.ndarray) -> None:
        emp = np.bincount(idx, minlength=exact.size) / n
        tv = 0.5 * float(np.abs(emp - exact).sum())
        m = int((exact > 0).sum())
        checks.append((name, tv, 3 * 0.5 * math.sqrt(m / n)))

    for t in range(length):
        check(f"position {t}", tokens[:, t], P64[t])
    if length >= 2:
        check("pair (0, 1)", tokens[:, 0] * V + tokens[:, 1], np.outer(P64[0], P64[1]).ravel())
    return checks


def _run(rule: Rule, P, Q, k, length, n, seed):
    t0 = time.perf_counter()
    tokens, calls = _simulate(rule, P, Q, k, length, n, seed)
    checks = _tv_checks(tokens, P)
    dt = time.perf_counter() - t0
    report = ", ".join(f"{name}: TV={tv:.4f} (bound {bound:.4f})" for name, tv, bound in checks)
    print(f"k={k} n={n} calls={calls} {dt:.1f}s :: {report}")
    return checks


def _rule_under_test(draft, draft_probs, target_probs, key):
    return accept_sampled(draft, draft_probs, target_probs, key)


# Target: top-k 4 and top-p 0.9; draft: a noisy copy with top-k 3 and top-p 0.95.
# Both have zeros, and the supports differ both ways (asserted below), so the
# draft proposes tokens the target forbids and the target wants tokens the
# draft never proposes (only reachable through the residual / bonus).
P_TRUNC = SamplingParams(temperature=1.0, top_k=4, top_p=0.9)
Q_TRUNC = SamplingParams(temperature=1.0, top_k=3, top_p=0.95)
CASES = {
    # n = 20,000 streams each (>= 20,000 rounds); top-k and top-p on both sides.
    "k1_topk_topp": dict(k=1, length=2, n=20_000, seed=11, p=P_TRUNC, q=Q_TRUNC),
    "k2_topk_topp": dict(k=2, length=3, n=20_000, seed=12, p=P_TRUNC, q=Q_TRUNC),
    # k=3: the target is truncated hard, the draft not at all, so every draft
    # position puts mass where p is zero.
    "k3_q_mass_where_p_zero": dict(
        k=3,
        length=4,
        n=20_000,
        seed=13,
        p=SamplingParams(temperature=1.0, top_k=3, top_p=0.85),
        q=SamplingParams(temperature=1.0),
    ),
}


def _distributions(case):
    rows = case["length"] + case["k"]
    return _case(case["seed"], rows, case["p"], case["q"])


def _checked_case(name: str) -> tuple[np.ndarray, np.ndarray]:
    case = CASES[name]
    P, Q = _distributions(case)
    Q = Q[: case["length"] + case["k"] - 1]
    # preconditions: truncation really produced zeros where intended
    q_beyond_p = (Q > 0) & (P[: len(Q)] == 0)
    assert q_beyond_p.any(), "draft should propose tokens the target forbids"
    if case["q"] == Q_TRUNC:
        assert (P == 0).any() and (Q == 0).any()
        assert ((P[: len(Q)] > 0) & (Q == 0)).any(), "target should have tokens q never drafts"
    else:
        assert q_beyond_p.any(axis=1).all()
    return P, Q


def _point_mass_case() -> tuple[np.ndarray, np.ndarray]:
    """Drafts that come alone: the argmax of a noisy copy of the target, and
    at one position a token the target forbids."""
    case = CASES["k2_topk_topp"]
    P, soft = _distributions(case)
    rows = case["length"] + case["k"] - 1
    chosen = np.argmax(soft[:rows], axis=-1)
    chosen[1] = int(np.argmin(P[1]))
    assert P[1, chosen[1]] == 0
    Q = np.array(point_masses(mx.array(chosen), V))
    assert (Q.sum(axis=-1) == 1).all() and (Q.argmax(axis=-1) == chosen).all()
    return P, Q


# -------------------------------------------- sampled: the exact law, no sampling


def _acceptance_measure(accepted, j: int, p_d, q_d) -> float:
    """The measure of the uniforms u_j that accept draft j (the drafts before
    it accepted: u_i = 0 there), found by bisection on the rule itself. The
    accepted set is an interval [0, a): checked on a grid as well."""
    k = len(p_d)

    def accepts(u: float) -> bool:
        return accepted([0.0] * j + [u] + [0.0] * (k - j - 1), p_d, q_d) > j

    top = math.nextafter(1.0, 0.0)
    if accepts(top):
        lo = 1.0
    elif not accepts(0.0):
        lo = 0.0
    else:
        lo, hi = 0.0, top
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if accepts(mid) else (lo, mid)
    for u in np.linspace(0, top, 17):
        assert accepts(u) == (u < lo) or abs(u - lo) < 1e-9, "the accepted uniforms are not [0, a)"
    return lo


def exact_law(P, Q, k: int, length: int, accepted=accepted_drafts,
              next_dist=next_token_distribution) -> np.ndarray:  # fmt: skip
    """The law (V,) * length of the first `length` tokens of a stream decoded
    round by round at depth k under the model above (drafts d_j ~ Q[s + j],
    verified against P[s + j]), computed from the rule's parts."""
    P32, Q32 = P.astype(np.float32), Q.astype(np.float32)

    @functools.cache
    def from_position(s: int, remaining: int) -> np.ndarray:
        if remaining == 0:
            return np.ones(())
        out = np.zeros((V,) * remaining)
        q_rows, p_rows = mx.array(Q32[s : s + k]), mx.array(P32[s : s + k + 1])
        for d in itertools.product(range(V), repeat=k):
            weight = math.prod(float(Q32[s + j, t]) for j, t in enumerate(d))
            if weight == 0:
                continue
            p_d = [float(P32[s + j, t]) for j, t in enumerate(d)]
            q_d = [float(Q32[s + j, t]) for j, t in enumerate(d)]
            a = [_acceptance_measure(accepted, j, p_d, q_d) for j in range(k)]
            reach = 1.0
            for j in range(k + 1):  # exactly j drafts accepted
                chance = reach * (1 - a[j] if j < k else 1.0)
                if j < k:
                    reach *= a[j]
                if chance == 0:
                    continue
                last = np.array(next_dist(j, q_rows, p_rows), dtype=np.float64)
                parts = [np.eye(V)[t] for t in d[:j]] + [last]
                tokens = functools.reduce(np.multiply.outer, parts[:remaining])
                if j + 1 < remaining:
                    tokens = np.multiply.outer(tokens, from_position(s + j + 1, remaining - j - 1))
                out += weight * chance * tokens
        return out

    return from_position(0, length)


def _target_law(P: np.ndarray, length: int) -> np.ndarray:
    rows = P[:length].astype(np.float64)
    return functools.reduce(np.multiply.outer, rows / rows.sum(axis=-1, keepdims=True))


def _tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


@pytest.mark.parametrize("name", [*CASES, "point_masses"])
def test_the_rule_commits_exactly_the_target_law(name):
    """Exactly, not in a sample: every draft tuple, every first rejection,
    every later round, from the rule's own parts."""
    P, Q = _point_mass_case() if name == "point_masses" else _checked_case(name)
    case = CASES["k2_topk_topp" if name == "point_masses" else name]
    law = exact_law(P, Q, case["k"], case["length"])
    assert abs(law.sum() - 1) < 1e-5
    assert _tv(law, _target_law(P, case["length"])) < 1e-5


def _lenient_threshold(u, p_d, q_d):
    """A slip: accept while u < p/q + 0.05."""
    for j in range(len(u)):
        if u[j] >= p_d[j] / q_d[j] + 0.05:
            return j
    return len(u)


def _redraw_from_p(accepted, draft_probs, target_probs):
    """A slip: after a rejection, draw from p itself rather than the residual."""
    return target_probs[accepted]


@pytest.mark.parametrize("slip", ["lenient_threshold", "redraw_from_p"])
def test_the_exact_law_shows_a_slightly_wrong_rule(slip):
    """Negative controls: each slip moves the law by far more than float error."""
    P, Q = _checked_case("k2_topk_topp")
    parts = {"accepted": _lenient_threshold} if slip == "lenient_threshold" else {
        "next_dist": _redraw_from_p}  # fmt: skip
    law = exact_law(P, Q, 2, 3, **parts)
    assert _tv(law, _target_law(P, 3)) > 1e-3


# ------------------------------------- sampled: accept_sampled whole, in a sample


@pytest.mark.parametrize("name,n", [
    ("k2_topk_topp", 4000),  # the fast tier: the glue between the parts (the exact law above)
    *[pytest.param(name, CASES[name]["n"], marks=pytest.mark.proof) for name in CASES],
])  # fmt: skip
def test_accept_sampled_commits_the_target_distribution(name, n):
    case = CASES[name]
    P, Q = _checked_case(name)
    checks = _run(_rule_under_test, P, Q, case["k"], case["length"], n, case["seed"])
    for check_name, tv, bound in checks:
        assert tv < bound, f"{name} {check_name}: TV {tv:.4f} >= bound {bound:.4f}"


@pytest.mark.proof
def test_point_mass_drafts_commit_the_target_distribution():
    """Drafts that come without a distribution (a drafter's argmax, text copied
    from the context) are point masses, q = one-hot(d): accepted with
    probability p(d), resampled from p without d."""
    case = CASES["k2_topk_topp"]
    P, Q = _point_mass_case()
    checks = _run(_rule_under_test, P, Q, case["k"], case["length"], case["n"], case["seed"])
    for check_name, tv, bound in checks:
        assert tv < bound, f"point masses {check_name}: TV {tv:.4f} >= bound {bound:.4f}"


# ---------------------------------------------- a biased rule fails the test


def _resample_from_p_rule(draft, draft_probs, target_probs, key):
    """Leviathan acceptance, but on rejection draw from p_j instead of the
    residual normalize(max(p_j - q_j, 0)). A plausible bug, and biased: the
    committed token at a drafted position has distribution
        w = min(p, q) + (1 - beta) * p,   beta = sum(min(p, q)),
    which double-counts the overlap min(p, q) (accepted drafts already
    supplied it): w = p only if min(p, q) = beta * p, i.e. essentially p == q.
    """
    k = len(draft)
    k_u, k_draw = mx.random.split(key, 2)
    u = mx.random.uniform(shape=(k,), key=k_u).tolist() if k else []
    for j in range(k):
        p_d = target_probs[j, draft[j]].item()
        q_d = draft_probs[j, draft[j]].item()
        if u[j] * q_d >= p_d:
            probs = target_probs[j]  # BUG (on purpose): should be residual(p_j, q_j)
            return Verdict(j, int(mx.random.categorical(mx.log(probs), key=k_draw).item()))
    return Verdict(k, int(mx.random.categorical(mx.log(target_probs[k]), key=k_draw).item()))


@pytest.mark.proof
def test_biased_rule_fails_the_same_test():
    case = CASES["k1_topk_topp"]
    P, Q = _distributions(case)
    Q = Q[: case["length"] + case["k"] - 1]
    # Analytic output of the biased rule at stream position 0 (k = 1).
    p, q = P[0].astype(np.float64), Q[0].astype(np.float64)
    overlap = np.minimum(p, q)
    w = overlap + (1 - overlap.sum()) * p
    tv_true = 0.5 * np.abs(w - p).sum()
    n, m = case["n"], int((p > 0).sum())
    bound = 3 * 0.5 * math.sqrt(m / n)
    # The bias is large against the bound, so failing is not luck: the
    # empirical TV concentrates at tv_true +- O(0.5 sqrt(m/n)).
    assert tv_true > 0.05 and tv_true > 3 * bound, (tv_true, bound)
    checks = _run(_resample_from_p_rule, P, Q, case["k"], case["length"], n, case["seed"])
    name, tv, b = checks[0]
    assert name == "position 0" and b == pytest.approx(bound)
    print(f"biased rule: analytic TV={tv_true:.4f}, empirical TV={tv:.4f}, bound={b:.4f}")
    assert tv >= b, "the exactness test should reject the resample-from-p rule"
    assert abs(tv - tv_true) < b  # and it measures the bias we derived


# ------------------------------------------------------ greedy as the limit


def test_accept_sampled_at_temperature_zero_is_accept_greedy():
    rng = np.random.default_rng(5)
    greedy = SamplingParams(temperature=0.0)
    vocab = 16
    seen_accepted = set()
    for case in range(120):
        k = case % 5
        target_logits = rng.normal(size=(k + 1, vocab)).astype(np.float32)
        # the draft agrees with the target often, but not always
        draft_logits = target_logits[:k] + rng.normal(size=(k, vocab)).astype(np.float32) * 0.6
        p = probabilities(mx.array(target_logits), greedy)
        q = probabilities(mx.array(draft_logits), greedy) if k else mx.zeros((0, vocab))
        draft = np.argmax(draft_logits, axis=-1).tolist()  # d_j ~ one-hot q_j
        target_argmax = np.argmax(target_logits, axis=-1).tolist()
        expected = accept_greedy(draft, target_argmax)
        seen_accepted.add((k, expected.accepted))
        for s in range(3):
            key = mx.random.key(1000 * case + s)
            assert accept_sampled(draft, q, p, key) == expected, (case, draft, target_argmax)
    # coverage: full acceptance and early rejection both happened
    assert any(a == k and k > 0 for k, a in seen_accepted)
    assert any(a < k for k, a in seen_accepted)


def test_accept_sampled_is_reproducible_with_a_key():
    P, Q = _case(3, 4, P_TRUNC, Q_TRUNC)
    p, q = mx.array(P), mx.array(Q[:3])
    draft = [int(np.argmax(Q[j])) for j in range(3)]
    for seed in range(10):
        a = accept_sampled(draft, q, p, mx.random.key(seed))
        b = accept_sampled(draft, q, p, mx.random.key(seed))
        assert a == b


# ------------------------------------------------------- seeded: Gumbel-max
#
# A seeded request's rule (engines/mlx_spec/decoder.py): the target's token at
# each verify row is `sample(rows, params, t)`, its Gumbel-max at absolute
# position t, and `accept_greedy` keeps the drafts while they equal it. Its
# claims: the committed tokens are plain seeded sampling's, one `sample` per
# position, whatever the drafts (so every engine gives one text); hence the
# law is P[0] x P[1] x ... (Gumbel-max is exact, each position's noise its own).

DRAFTS = ("coupled", "independent", "point masses")


def _log(rows: np.ndarray) -> mx.array:
    """Rows of probabilities as logits whose distribution they are (0: -inf)."""
    with np.errstate(divide="ignore"):
        return mx.array(np.log(rows.astype(np.float32)))


SEEDED = SamplingParams(temperature=1.0)  # on logits that are already the truncated law


def _seeded_drafts(kind: str, Q: np.ndarray, s: int, k: int, seed: int, rng) -> list[int]:
    """k drafts from position s: drawn from Q with the target's noise (as
    drafting/base.Context.draw draws them), from Q with noise of their own,
    or Q's argmax (drafts that come alone)."""
    if kind == "coupled":
        return sample(_log(Q[s : s + k]), replace(SEEDED, seed=seed), s).tolist()
    if kind == "independent":
        return [int(rng.choice(V, p=Q[s + j] / Q[s + j].sum())) for j in range(k)]
    return np.argmax(Q[s : s + k], axis=-1).tolist()


def _seeded_stream(P: np.ndarray, Q: np.ndarray, k: int, length: int, seed: int, drafts: str,
                   rng, choose=sample) -> tuple[list[int], int]:  # fmt: skip
    """One seeded stream decoded in rounds at depth k under the prefix-free
    model: its first `length` tokens and how many drafts stood."""
    params, out, s, stood = replace(SEEDED, seed=seed), [], 0, 0
    while s < length:
        d = _seeded_drafts(drafts, Q, s, k, seed, rng)
        verdict = accept_greedy(d, choose(_log(P[s : s + k + 1]), params, s).tolist())
        stood += verdict.accepted
        take = [*d[: verdict.accepted], verdict.next_token][: length - s]
        out += take
        s += len(take)
    return out, stood


def test_the_seeded_rule_commits_plain_seeded_sampling_whatever_the_drafts():
    """Prefix-dependent targets (a random table by the tokens so far) and
    drafters of every kind, at depths 0..4: each stream is, token for token,
    plain decoding's with `sample` at each position."""
    rng = np.random.default_rng(21)
    table = rng.normal(size=(97, V)).astype(np.float32) * 1.5
    params = SamplingParams(temperature=0.9, top_k=4)

    def logits(tokens: list[int]) -> mx.array:
        return mx.array(table[hash(tuple(tokens)) % 97])

    prompt, length, stood = [1, 2, 3], 12, dict.fromkeys(DRAFTS, 0)
    for seed in range(12):
        p = replace(params, seed=seed)
        plain = list(prompt)
        for _ in range(length):
            plain.append(sample(logits(plain), p, len(plain)).item())
        for k, kind in itertools.product(range(5), DRAFTS):
            tokens = list(prompt)
            while len(tokens) < len(prompt) + length:
                d = []  # drafted one by one, each from the prefix it extends
                for _ in range(k):
                    row = table[hash(tuple(tokens + d)) % 97] + rng.normal(size=V) * 0.5
                    if kind == "coupled":
                        at = len(tokens) + len(d)
                        d.append(sample(mx.array(row, dtype=mx.float32), p, at).item())
                    elif kind == "independent":
                        d.append(int(rng.integers(V)))
                    else:
                        d.append(int(np.argmax(row)))
                rows = mx.stack([logits(tokens + d[:j]) for j in range(k + 1)])
                verdict = accept_greedy(d, sample(rows, p, len(tokens)).tolist())
                stood[kind] += verdict.accepted
                tokens += [*d[: verdict.accepted], verdict.next_token]
            assert tokens[: len(plain)] == plain, (seed, k, kind)
    assert all(stood.values()), stood  # every kind had drafts stand (and later rows checked)


def _seeded_run(P, Q, k, length, n, drafts, choose=sample) -> tuple[list, float]:
    rng = np.random.default_rng(length)
    streams = [_seeded_stream(P, Q, k, length, seed, drafts, rng, choose) for seed in range(n)]
    tokens = np.array([t for t, _ in streams])
    stood = sum(a for _, a in streams)
    return _tv_checks(tokens, P), stood


@pytest.mark.parametrize("drafts,n", [
    *[(kind, 2000) for kind in DRAFTS],  # the fast tier
    *[pytest.param(kind, 20_000, marks=pytest.mark.proof) for kind in DRAFTS],
])  # fmt: skip
def test_the_seeded_rule_commits_the_target_distribution(drafts, n):
    """Over seeds, the committed tokens' law is P[0] x P[1] x ... at every
    position and for the first pair, across round boundaries."""
    P, Q = _checked_case("k2_topk_topp")
    checks, stood = _seeded_run(P, Q, 2, 3, n, drafts)
    assert stood > 0
    for name, tv, bound in checks:
        assert tv < bound, f"{drafts} {name}: TV {tv:.4f} >= bound {bound:.4f}"


def _one_noise_per_round(rows: mx.array, params: SamplingParams, position: int) -> mx.array:
    """A slip: every row of a verify window gets the noise of its first position."""
    noise = gumbel_noise(params.seed, position, 1, rows.shape[-1])
    return gumbel_max(rows, params, noise)


def test_the_same_check_sees_a_slip_in_the_noise():
    """Negative control: tokens of one round drawn with one noise vector
    are not the target's, and the check sees it at the fast tier's size
    (position 2: TV 0.108 against a bound of 0.058)."""
    P, Q = _checked_case("k2_topk_topp")
    checks, _ = _seeded_run(P, Q, 2, 3, 2000, "coupled", choose=_one_noise_per_round)
    assert [name for name, tv, bound in checks if tv > bound], checks


def test_coupled_drafts_stand_as_often_as_the_two_laws_choose_alike():
    """A coupled draft stands exactly when argmax(log q + g) == argmax(log p + g):
    over seeds, its rate is that probability (computed here by brute force
    on the same noise), below the maximal coupling sum(min(p, q))."""
    P, Q = _checked_case("k2_topk_topp")
    n, same = 4000, 0
    for seed in range(n):
        p = replace(SEEDED, seed=seed)
        same += sample(_log(P[0]), p, 0).item() == sample(_log(Q[0]), p, 0).item()
    overlap = float(np.minimum(P[0], Q[0]).sum())
    stood = sum(_seeded_stream(P, Q, 1, 1, seed, "coupled", None)[1] for seed in range(n))
    assert stood == same  # one draft per stream at position 0: it stood iff they chose alike
    assert same / n <= overlap + 3 * 0.5 / math.sqrt(n)
    print(f"coupled acceptance {same / n:.3f}, maximal coupling {overlap:.3f}")
