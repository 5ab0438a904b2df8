"""The lockstep's handoffs between a model's engines on a rank other than 0.

A follower engine posts a handoff when it runs the step in which rank 0's
engine handed the request over; the engine resuming the request takes it
when rank 0's command to resume arrives. The two engines' threads run apart
between turns, so on a busy machine the command can come first (seen in a
full parallel test run: the resuming follower's KeyError ended its thread
and with it the distributed model). These tests use a real single-rank
group: handoffs need no peer.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from specgate.engines.base import Handoff, Plan
from specgate.engines.distributed.lockstep import FollowerOut, Lockstep, LockstepBroken


def handoff() -> Handoff:
    return Handoff(Plan("mlx_mtp", "mtp", 2, "spec_on"), [1, 2, 3], 1, [], None, [3])


def test_a_resume_that_comes_before_its_handoff_waits_for_it():
    lockstep = Lockstep(mx.distributed.init(), rank_timeout_s=60)
    sent, got = handoff(), []
    resuming = threading.Thread(target=lambda: got.append(lockstep.take_handoff("req-1")))
    resuming.start()
    resuming.join(0.3)
    assert resuming.is_alive() and not got  # waiting, not failed: nothing was handed over yet
    # Failure injection's timing: the handing-over engine posts only now.
    FollowerOut("req-1", lockstep).put_nowait(sent)
    resuming.join(10)
    assert got == [sent] and lockstep.problem is None


def test_a_handoff_that_never_comes_breaks_the_lockstep_with_the_reason():
    lockstep = Lockstep(mx.distributed.init(), rank_timeout_s=0.2)
    with pytest.raises(LockstepBroken, match="the handoff of req-2 never came"):
        lockstep.take_handoff("req-2")
    assert "req-2" in lockstep.problem


def test_a_broken_lockstep_wakes_a_waiting_resume():
    lockstep = Lockstep(mx.distributed.init(), rank_timeout_s=60)
    threading.Timer(0.1, lockstep._fail, ["rank 1's connection to rank 0 closed"]).start()
    with pytest.raises(LockstepBroken, match="connection to rank 0 closed"):
        lockstep.take_handoff("req-3")
