"""At temperature 0 every speculative engine's output is plain greedy decoding's.

For every in-process speculative engine of the registry, on each tiny family
it is proved on (tests/exactness.py): the output equals mlx-lm's plain greedy
decoding token for token (near-ties aside: tests/greedy.py) with the
method's own drafts and with injected ones that force every accepted-prefix
length, at every depth the engine plans; rounds of depth 0 between deeper
ones are plain steps; replay rollback gives what the tape gives; an EOS among
the drafts ends the output there.
"""

from __future__ import annotations

import exactness
import pytest
from exactness import decode
from greedy import assert_same_greedy


def _cases(params: list[tuple]) -> list:
    return [pytest.param(*p, id="-".join(map(str, p))) for p in params]


def pytest_generate_tests(metafunc):
    """Every (engine, family), and for the sweep every depth the engine plans."""
    if "subject" not in metafunc.fixturenames:
        return
    pairs = exactness.subjects()
    if "depth" in metafunc.fixturenames:
        cases = [(e, f, d) for e, f in pairs
                 for d in exactness.needs_of(exactness.registry.record(e)).depths]  # fmt: skip
        metafunc.parametrize("engine_name,family,depth", _cases(cases))
    else:
        metafunc.parametrize("engine_name,family", _cases(pairs))


@pytest.fixture
def subject(engine_name, family, tmp_path_factory):
    return exactness.subject(tmp_path_factory.getbasetemp() / "exactness", engine_name, family)


def test_greedy_equals_plain(subject, depth, capsys):
    sweep = exactness.greedy_sweep(subject, depth)
    assert set(range(depth + 1)) <= set(sweep.lengths), sweep.lengths  # every accepted length
    with capsys.disabled():
        print(f"[{subject.engine_name} on {subject.family} at depth {depth}: {sweep.natural} "
              f"drafted naturally, accepted lengths {dict(sorted(sweep.lengths.items()))}, "
              f"{sweep.ties} near-tie divergence(s)]", end=" ")  # fmt: skip


def test_plain_steps_between_rounds(subject):
    """Depth-0 rounds between deeper ones (a round the policy runs plain) are
    plain steps, also right after a rollback (a rotating cache updated in
    place, where a cut that only moved its counters would write the wrong slot)."""
    deepest = max(d for d in (1, 2, 3) if d <= max(subject.depths))
    schedule = [deepest, 0, 2, 0, 0, 1]
    for i, prompt in enumerate(exactness.prompts(subject.vocab, 3, seed=1 + subject.family_index)[1:]):
        want, margins = subject.reference(prompt)
        out = decode(subject, prompt, 0, schedule=schedule, inject=subject.continuation(prompt),
                     seed=i)  # fmt: skip
        assert_same_greedy(out.tokens, want, margins)
        assert any(r.drafted == 0 for r in out.rounds)
        assert any(r.accepted < r.drafted for r in out.rounds)


def test_replay_rollback_gives_the_same_tokens(subject):
    """The two ways of undoing rejected drafts (the tape, and replaying the
    kept inputs over the restored caches) give the same output."""
    for i, prompt in enumerate(exactness.prompts(subject.vocab, 4, seed=3)[2:]):
        ahead = subject.continuation(prompt)
        tape = decode(subject, prompt, 2, inject=ahead, seed=i)
        replay = decode(subject, prompt, 2, inject=ahead, seed=i, undo="replay")
        assert tape.tokens == replay.tokens


def test_eos_at_a_draft_position_stops_there(subject):
    prompt = exactness.prompts(subject.vocab, 6, seed=5)[5]
    want, _ = subject.reference(prompt)
    depth = max(subject.depths[:3])
    for cut in (3, 10, 25):
        stop = frozenset({want[cut]})
        expected = want[: want.index(want[cut])]
        out = decode(subject, prompt, depth, stop=stop, inject=subject.continuation(prompt),
                     seed=cut)  # fmt: skip
        assert (out.tokens, out.finish) == (expected, "stop")
