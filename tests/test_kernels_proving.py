"""The policy while a speculative engine proves its verify kernels in the
background (engines/mlx_spec/kernel_proofs.py): plain decoding for that
method (`kernels_proving`), and its stock-path costs forgotten once the
engine switches to the kernels."""

from __future__ import annotations

from specgate.engines.base import LiveState, RoundStats
from specgate.policies.decide import ModelPolicy, RequestFeatures, decide
from specgate.policies.live_costs import LiveCosts

IDLE = LiveState(0, 0, 0)
ASK = RequestFeatures(prompt_tokens=16, has_penalties=False)


def policy(proving: set[str]) -> ModelPolicy:
    engines = {"mtp": "mlx_mtp", "ngram": "mlx_ngram", "none": "mlx_plain"}
    return ModelPolicy("m", engines, max_depth=3, proving=lambda: proving)


def test_plain_decoding_while_every_speculative_engine_proves():
    plan = decide(policy({"mtp", "ngram"}), ASK, IDLE)
    assert (plan.method, plan.reason) == ("none", "kernels_proving")
    # one done: the other speculates (the idle rule, nothing measured yet)
    plan = decide(policy({"mtp"}), ASK, IDLE)
    assert (plan.method, plan.reason) == ("ngram", "spec_on")
    plan = decide(policy(set()), ASK, IDLE)
    assert (plan.method, plan.reason) == ("mtp", "spec_on")
    # a request that names its method gets it, on the stock path meanwhile
    forced = RequestFeatures(16, False, forced_method="mtp")
    assert decide(policy({"mtp", "ngram"}), forced, IDLE).reason == "forced_by_request"


def mtp_round(seconds: float, kernels: bool, depth: int = 2) -> RoundStats:
    return RoundStats("m", "mtp", depth, [True] * depth, depth + 1, seconds, 64, kernels=kernels)


def test_stock_path_costs_are_forgotten_when_the_kernels_take_over():
    costs = LiveCosts(min_samples=2)
    for _ in range(4):  # the first round of a shape is its warm-up, not a cost
        costs.observe(mtp_round(0.030, kernels=False))
        costs.observe(RoundStats("m", "none", 0, seconds=0.010, context_tokens=64))
    assert costs.get("mtp", 2, 0).mean == 0.030
    costs.observe(mtp_round(0.012, kernels=True))  # switched: its warm-up round
    assert costs.get("mtp", 2, 0) is None and costs.get("none", 1, 0).mean == 0.010
    for _ in range(2):
        costs.observe(mtp_round(0.012, kernels=True))
    assert costs.get("mtp", 2, 0).mean == 0.012  # the kernels' cost alone
