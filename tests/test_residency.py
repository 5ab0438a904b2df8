"""specgate/gateway/serving/residency.py: which models make room for a new one, as plain decisions."""

from __future__ import annotations

from specgate.gateway.serving.residency import (
    ModelChanges,
    NeverFits,
    Resident,
    Room,
    idle_expired,
    make_room,
    model_changes,
)

GB = 1 << 30


def test_a_model_that_fits_evicts_nothing():
    assert make_room(4 * GB, 16 * GB, [Resident("a", 8 * GB, 1.0)]) == Room()
    assert make_room(4 * GB, 16 * GB, []) == Room()


def test_the_least_recently_used_idle_models_go_oldest_first_and_no_more_than_needed():
    residents = [Resident("new", 4 * GB, 30.0), Resident("old", 4 * GB, 10.0),
                 Resident("mid", 4 * GB, 20.0)]  # fmt: skip
    assert make_room(6 * GB, 14 * GB, residents) == Room(("old",))  # 2 free + 4
    assert make_room(10 * GB, 14 * GB, residents) == Room(("old", "mid"))


def test_pinned_and_busy_models_stay():
    residents = [Resident("pinned", 4 * GB, 1.0, pinned=True), Resident("busy", 4 * GB, 2.0, busy=True),
                 Resident("idle", 4 * GB, 3.0)]  # fmt: skip
    assert make_room(6 * GB, 14 * GB, residents) == Room(("idle",))
    # Only once the busy one is done would it fit: wait, evicting nothing yet.
    assert make_room(9 * GB, 14 * GB, residents) == Room(wait=True)


def test_a_model_bigger_than_the_budget_less_the_pinned_ones_never_fits():
    residents = [Resident("p", 6 * GB, 1.0, pinned=True), Resident("x", 6 * GB, 2.0)]
    assert make_room(20 * GB, 16 * GB, []) == NeverFits(20 * GB, 16 * GB, (), 0)
    assert make_room(11 * GB, 16 * GB, residents) == NeverFits(11 * GB, 16 * GB, ("p",), 6 * GB)
    assert make_room(10 * GB, 16 * GB, residents) == Room(("x",))


def test_idle_ttl():
    assert idle_expired(100.0, 40.0, 60.0, busy=False, pinned=False)
    assert not idle_expired(100.0, 41.0, 60.0, busy=False, pinned=False)
    assert not idle_expired(100.0, 0.0, 60.0, busy=True, pinned=False)
    assert not idle_expired(100.0, 0.0, None, busy=False, pinned=False)
    assert not idle_expired(100.0, 0.0, 60.0, busy=False, pinned=True)


def test_model_changes_by_id():
    running = {"a": 1, "b": 2, "c": 3}
    assert model_changes(running, {"b": 2, "c": 4, "d": 5}) == ModelChanges(
        added=("d",), removed=("a",), changed=("c",), unchanged=("b",))
    assert model_changes(running, running) == ModelChanges(unchanged=("a", "b", "c"))
