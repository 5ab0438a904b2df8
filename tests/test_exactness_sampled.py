"""Above temperature 0 every speculative engine samples the target's own distribution.

The acceptance rule itself is proved exactly in tests/test_speculative.py
(its law computed from its parts, no sampling). Here each in-process
speculative engine of the registry (tests/exactness.py), on a 12-token tiny
target, is checked for the wiring around it:

- the verify rows: every p a round hands the rule is the target's exact
  conditional distribution at that position, penalties advanced by the
  drafts before it (no sampling: recorded and recomputed by plain forwards);
- a seeded request's output is plain seeded sampling's, token for token, at
  every depth, with the method's own drafts and with injected ones (each
  position's token is the Gumbel-max of its seed and position,
  engines/sampling.py; that law is proved in tests/test_speculative.py);
- unseeded (rejection sampling), a round's first two tokens, over many
  runs, against the target's exact p(a) p(b | a), in total variation,
  bound 3 x 0.5 sqrt(m/n) (for n samples over m outcomes E[TV] <= 0.5
  sqrt(m/n); McDiarmid: a correct sampler fails with probability < exp(-2m)
  for a random seed; the seeds are fixed). The fast tier draws N_FAST
  samples, the proof tier (`pytest -m proof`) N_PROOF;
- the same sampled rounds with each request in a batch beside a greedy
  one (issue 45), for every engine whose target batches;
- a deliberately wrong rule (failure injection: the residual with p and q
  swapped) fails the same check at the fast tier's size, so that size has
  the power to see a real slip (run in the fast tier for MTP and DFlash,
  a full q and point masses; for every engine in the proof tier).
"""

from __future__ import annotations

import exactness
import mlx.core as mx
import pytest
from exactness import copy_prefix, decode, sample_rounds, wrong_rule

from specgate.engines.base import SamplingParams
from specgate.engines.mlx_spec import decoder as spec_decoder
from specgate.engines.mlx_spec.batch_decoder import unbatchable
from specgate.engines.sampling import PenaltyState, penalised, probabilities

N_FAST = 300  # the size the wrong rule is shown to fail at (N_WRONG)
N_PROOF = 4000
N_WRONG = N_FAST


# The wrong rule's power in the fast tier on one proposer whose q is a full
# distribution (MTP) and one whose drafts come alone (point masses: DFlash);
# every other engine's in the proof tier.
WRONG_FAST = ("mlx_mtp", "mlx_dflash")


def pytest_generate_tests(metafunc):
    if "subject" in metafunc.fixturenames:
        wrong = metafunc.function.__name__ == "test_a_wrong_rule_fails_the_same_check"
        metafunc.parametrize("engine_name,family", [
            pytest.param(e, f, id=f"{e}-{f}",
                         marks=pytest.mark.proof if wrong and e not in WRONG_FAST else ())
            for e, f in exactness.subjects(sampled=True)])  # fmt: skip


@pytest.fixture
def subject(engine_name, family, tmp_path_factory):
    return exactness.subject(tmp_path_factory.getbasetemp() / "exactness", engine_name, family,
                             sampled=True)  # fmt: skip


def test_verify_rows_are_the_targets_conditionals(subject, monkeypatch):
    """Sampled with penalties: each row p_j the decoder hands the rule equals
    the target's distribution after the committed tokens and drafts d_1..d_{j-1},
    penalised by all of them."""
    params = SamplingParams(temperature=0.8, top_k=6, presence_penalty=0.4, frequency_penalty=0.3,
                            repetition_penalty=1.2)  # fmt: skip
    mx.random.seed(3)
    calls, real = [], spec_decoder.accept_sampled

    def recorded(draft, draft_probs, target_probs, key=None):  # the real rule, its inputs kept
        calls.append((list(draft), target_probs))
        return real(draft, draft_probs, target_probs, key)

    monkeypatch.setattr(spec_decoder, "accept_sampled", recorded)
    prefix = copy_prefix(subject.model)
    out = decode(subject, prefix, 2, params=params, max_tokens=16)
    assert len(calls) == len(out.rounds) and sum(len(d) for d, _ in calls) > 0
    done = 1  # the prefill's token
    for (drafts, p), stats in zip(calls, out.rounds, strict=True):
        for j in range(len(drafts) + 1):
            seen = out.tokens[:done] + drafts[:j]
            state = PenaltyState.from_prompt(prefix, subject.vocab).advance(seen)
            logits = subject.model(mx.array([prefix + seen]))[0, -1]
            want = probabilities(penalised(logits, state, params), params)
            assert mx.allclose(p[j], want, atol=1e-5).item(), (done, j)
        done += stats.accepted + 1


def test_a_seeded_request_decodes_plain_samplings_tokens(subject):
    """Whatever was drafted and accepted, each committed token is the one
    plain sampling draws with the same seed at that position: the same text
    on every engine (the n-gram evidence may cut copies, the planner change
    depths, a stream change engines)."""
    ties, accepted = exactness.seeded_sweep(subject, seed=5)
    assert accepted > 0  # the injected drafts stood, so later verify positions were checked
    assert ties <= 1


@pytest.mark.timeout(1800)  # the proof tier's samples: a hang guard, not a speed check
@pytest.mark.parametrize("n", [N_FAST, pytest.param(N_PROOF, marks=pytest.mark.proof)])
def test_sampled_rounds_follow_the_target(subject, n, capsys):
    got = sample_rounds(subject, n)
    with capsys.disabled():
        print(f"[{subject.engine_name} on {subject.family}, n={n}: TV {got.distance:.4f}, bound "
              f"{got.bound:.4f}, {got.outcomes} outcomes, {got.drafted} drafted, {got.accepted} "
              f"accepted]", end=" ")  # fmt: skip
    assert got.accepted > 0  # accepted drafts and bonus tokens are in the sample
    assert got.support_ok  # never a pair the target truncated away
    assert got.distance < got.bound


def test_sampled_rounds_in_a_batch_follow_the_target(subject, capsys):
    """The same check with each request's rounds in a BatchSpecDecoder beside
    a greedy request on another prompt (issue 45): the batch's one verify
    forward hands each row's rule its target's distribution."""
    if (why := unbatchable(subject.engine.target)) is not None:
        pytest.skip(f"{subject.family} does not batch: {why}")
    got = sample_rounds(subject, N_FAST, batched=True)
    with capsys.disabled():
        print(f"[batched, {subject.engine_name} on {subject.family}: TV {got.distance:.4f}, bound "
              f"{got.bound:.4f}, {got.drafted} drafted, {got.accepted} accepted]", end=" ")  # fmt: skip
    assert got.accepted > 0 and got.support_ok
    assert got.distance < got.bound


@pytest.mark.parametrize("n", [N_WRONG])  # it fails at this size, so at the larger ones too
def test_a_wrong_rule_fails_the_same_check(subject, n, monkeypatch, capsys):
    monkeypatch.setattr(spec_decoder, "accept_sampled", wrong_rule)
    got = sample_rounds(subject, n)
    with capsys.disabled():
        print(f"[wrong rule, {subject.engine_name}, n={n}: TV {got.distance:.4f}, bound "
              f"{got.bound:.4f}]", end=" ")  # fmt: skip
    assert got.drafted > 0 and got.distance > got.bound
