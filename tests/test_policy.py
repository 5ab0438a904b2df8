"""The decision function, tested directly (pure code: no MLX, no HTTP)."""

import pytest

from specgate.engines.base import LiveState
from specgate.policies.decide import ModelPolicy, OverrideError, RequestFeatures, decide

IDLE = LiveState(0, 0, 0)
BUSY = LiveState(1, 0, 0)
PLAIN = ModelPolicy("m", {"none": "mlx_plain"}, 2)
MTP = ModelPolicy("m", {"none": "mlx_plain", "mtp": "mlx_mtp"}, 2)


def features(method=None, depth=None):
    return RequestFeatures(prompt_tokens=10, has_penalties=False, forced_method=method,
                           forced_depth=depth)


def test_plain_only_model():
    plan = decide(PLAIN, features(), IDLE)
    assert (plan.engine, plan.method, plan.depth, plan.reason) == ("mlx_plain", "none", 0, "no_drafter")


def test_speculates_when_idle_and_batches_under_concurrency():
    assert decide(MTP, features(), IDLE).header() == "method=mtp;depth=2;reason=spec_on;source=rule"
    assert decide(MTP, features(), BUSY).header() == "method=none;depth=0;reason=concurrency;source=rule"
    assert decide(MTP, features(), LiveState(0, 3, 0)).reason == "concurrency"


def test_overrides():
    assert decide(MTP, features("none"), IDLE).header() == "method=none;depth=0;reason=forced_by_request;source=rule"
    assert decide(MTP, features("mtp"), BUSY).header() == "method=mtp;depth=2;reason=forced_by_request;source=rule"
    assert decide(MTP, features("mtp", 4), IDLE).depth == 4
    assert decide(MTP, features("mtp", 0), IDLE).depth == 0  # rounds of plain steps
    assert decide(MTP, features(None, 3), IDLE).header() == "method=mtp;depth=3;reason=spec_on;source=rule"


@pytest.mark.parametrize("policy,method,depth,needle", [
    (PLAIN, "mtp", None, "available: none"),
    (MTP, "dflash", None, "available: none, mtp"),
    (MTP, "warp", None, "unknown method"),
    (PLAIN, None, 3, "needs a speculative method"),
])
def test_bad_overrides_say_why(policy, method, depth, needle):
    with pytest.raises(OverrideError, match=needle):
        decide(policy, features(method, depth), IDLE)


def test_per_method_depths_caps_and_fixed_depths():
    p = ModelPolicy("m", {"dflash": "mlx_dflash", "llamacpp_mtp": "llamacpp_mtp",
                          "none": "mlx_plain"}, 2, fixed_depth=("llamacpp_mtp",),
                    depths={"dflash": 7}, caps={"dflash": 7})
    assert decide(p, features(), IDLE).header() == "method=dflash;depth=7;reason=spec_on;source=rule"
    assert decide(p, features("dflash", 3), IDLE).depth == 3
    assert decide(p, features("llamacpp_mtp"), IDLE).depth == 2
    with pytest.raises(OverrideError, match="at most 7"):
        decide(p, features("dflash", 8), IDLE)
    with pytest.raises(OverrideError, match="fixed when its server starts"):
        decide(p, features("llamacpp_mtp", 3), IDLE)


def test_refused_method_says_why():
    p = ModelPolicy("m", {"none": "llamacpp"}, 2, refused={"llamacpp_mtp": "inspect says ar-only"})
    for asked in ("llamacpp_mtp", "mtp"):  # llamacpp_mtp answers to "mtp": refused as itself
        with pytest.raises(OverrideError, match="refused.*ar-only"):
            decide(p, features(asked), IDLE)
    assert decide(p, features(), IDLE).reason == "no_drafter"


def test_the_in_process_names_reach_llama_servers_methods():
    """A client need not know the backend: mtp and ngram name a GGUF model's
    llamacpp_mtp and llamacpp_ngram; a model that has the in-process method
    itself gets that one."""
    gguf = ModelPolicy("m", {"llamacpp_mtp": "llamacpp_mtp", "llamacpp_ngram": "llamacpp_ngram",
                             "none": "llamacpp"}, 2, fixed_depth=("llamacpp_mtp", "llamacpp_ngram"),
                       depths={"llamacpp_ngram": 8})  # fmt: skip
    assert decide(gguf, features("ngram"), IDLE).header() == (
        "method=llamacpp_ngram;depth=8;reason=forced_by_request;source=rule")
    assert decide(gguf, features("mtp"), IDLE).engine == "llamacpp_mtp"
    with pytest.raises(OverrideError, match="available: llamacpp_mtp, llamacpp_ngram, none"):
        decide(gguf, features("dflash"), IDLE)
    assert decide(MTP, features("mtp"), IDLE).engine == "mlx_mtp"


def test_configured_switches():
    from specgate.gateway.config import parse_config

    pc = parse_config({"models": [{"id": "a", "path": "d", "policy": {
        "depth": 3, "concurrency_threshold": 4, "penalties": "plain",
        "long_context_tokens": 8192, "min_params": 10, "allow_overrides": False}}]}).models[0].policy
    assert (pc.depth, pc.concurrency_threshold, pc.penalties, pc.long_context_tokens) == (
        3, 4, "plain", 8192)
    p = ModelPolicy("m", {"mtp": "mlx_mtp", "none": "mlx_plain"}, 2, concurrency_threshold=4,
                    penalty_capable=frozenset(), allow_overrides=False)
    assert decide(p, features(), LiveState(2, 0, 0)).reason == "spec_on"  # 3 in flight < 4
    assert decide(p, features(), LiveState(3, 0, 0)).reason == "concurrency"
    assert decide(p, RequestFeatures(10, True), IDLE).reason == "penalties"
    with pytest.raises(OverrideError, match="allow_overrides"):
        decide(p, features("none"), IDLE)


@pytest.mark.parametrize("policy,needle", [
    ({"depth": 0}, "policy.depth"), ({"depth": "deep"}, "policy.depth"),
    ({"penalties": "maybe"}, "policy.penalties"), ({"speed": 1}, "policy.speed"),
])
def test_bad_policy_config_says_where(policy, needle):
    from specgate.gateway.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        parse_config({"models": [{"id": "a", "path": "d", "policy": policy}]})
