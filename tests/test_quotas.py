"""The pure parts of quotas and admission: window arithmetic on a hand-stepped
clock, the round-robin order of the fair queue, and the gate's slot handover."""

from __future__ import annotations

import asyncio
import math

import pytest

from specgate.gateway.access.admission import FairQueue, KeyWork, ModelGate, QueueFull, QueueTimeout
from specgate.gateway.access.quotas import KeyLimits, KeyUsage, Rejected, RequestWindow, TokenWindow

# -- request window ---------------------------------------------------------------------------


def test_request_window_waits_for_the_oldest_to_leave():
    w = RequestWindow(limit=3)
    for t in (100.0, 110.0, 130.0):
        assert w.wait(t) == 0
        w.add(t)
    assert w.wait(140.0) == pytest.approx(20.0)  # 100 leaves at 160
    assert w.wait(160.0) == 0
    w.add(160.0)
    assert w.wait(165.0) == pytest.approx(5.0)  # now 110 is the one to leave, at 170


def test_request_window_keeps_at_most_limit_entries():
    w = RequestWindow(limit=2)
    for t in range(10):
        w.add(float(t))
    assert list(w.times) == [8.0, 9.0]


# -- token window -----------------------------------------------------------------------------


def test_token_window_buckets_by_second_and_expires():
    w = TokenWindow(limit=100)
    w.add(10.2, 30)
    w.add(10.9, 30)  # same second: one bucket
    w.add(12.5, 50)
    assert len(w.buckets) == 2 and w.used(13.0) == 110
    # Over the limit: room once the second-10 bucket (60 tokens) leaves, at 10 + 1 + 60.
    assert w.wait(13.0) == pytest.approx(71.0 - 13.0)
    assert w.used(71.0) == 50 and w.wait(71.0) == 0
    assert w.used(73.5) == 0


def test_token_window_wait_drops_just_enough_buckets():
    w = TokenWindow(limit=10)
    for second, tokens in ((0, 5), (1, 5), (2, 5), (3, 5)):  # 20 in the window
        w.add(second + 0.5, tokens)
    # Dropping seconds 0 and 1 leaves 10 (not below 10); dropping 2 too leaves 5.
    assert w.wait(4.0) == pytest.approx(2 + 1 + 60 - 4.0)


def test_token_window_below_limit_and_zero_limit():
    assert TokenWindow(limit=10).wait(0.0) == 0
    w = TokenWindow(limit=0)
    assert math.isinf(w.wait(0.0))


# -- one key's usage --------------------------------------------------------------------------


def test_key_usage_rpm_reason_and_retry_after():
    usage = KeyUsage(KeyLimits(rpm=2))
    for t in (0.0, 1.0):
        usage.check(t)
        usage.start(t)
        usage.finish()
    with pytest.raises(Rejected) as err:
        usage.check(30.0)
    assert err.value.reason == "rpm"
    assert err.value.retry_after == pytest.approx(30.0)
    assert err.value.retry_after_header == "30"
    usage.check(60.0)  # the first one left


def test_key_usage_concurrency_counts_queued_and_running():
    usage = KeyUsage(KeyLimits(max_concurrent=2))
    usage.start(0.0)
    usage.start(0.0)
    with pytest.raises(Rejected) as err:
        usage.check(0.0)
    assert err.value.reason == "concurrency" and err.value.retry_after_header == "1"
    usage.finish()
    usage.check(0.0)


def test_key_usage_tpm_admits_while_room_then_waits():
    usage = KeyUsage(KeyLimits(tpm=100))
    usage.check(0.0)
    usage.start(0.0)
    usage.count_tokens(0.0, 20)  # prompt
    usage.check(0.5)  # room left: another request is admitted
    usage.count_tokens(1.0, 90)  # completion tokens as they come: 110 now
    with pytest.raises(Rejected) as err:
        usage.check(2.0)
    assert err.value.reason == "tpm"
    # 20 (second 0) leaving is enough: room at 61.
    assert err.value.retry_after == pytest.approx(59.0)
    assert err.value.retry_after_header == "59"


def test_key_usage_sub_second_retry_rounds_up_to_one():
    err = Rejected("rpm", "x", 0.2)
    assert err.retry_after_header == "1"


def test_key_usage_keeps_history_when_limits_change():
    usage = KeyUsage(KeyLimits(rpm=5, tpm=1000))
    for t in range(3):
        usage.start(float(t))
        usage.count_tokens(float(t), 300)
    usage.set_limits(KeyLimits(rpm=3, tpm=500))  # a keys-file reload with lower limits
    with pytest.raises(Rejected) as err:
        usage.check(5.0)
    assert err.value.reason == "rpm"
    usage.set_limits(KeyLimits(tpm=500))
    with pytest.raises(Rejected) as err:
        usage.check(5.0)
    assert err.value.reason == "tpm"
    usage.set_limits(KeyLimits())
    usage.check(5.0)


# -- fair queue order ---------------------------------------------------------------------------


def drain(q: FairQueue) -> list:
    out = []
    while (head := q.pop()) is not None:
        out.append(head[1])
    return out


def test_fair_queue_round_robin_across_keys_fifo_within():
    q = FairQueue()
    for i in range(5):
        q.push("a", f"a{i}")
    q.push("b", "b0")
    q.push("c", "c0")
    q.push("b", "b1")
    assert len(q) == 8
    assert drain(q) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]
    assert len(q) == 0


def test_fair_queue_late_key_waits_behind_one_item_per_waiting_key():
    """The bound the admission docstring states: a key arriving while K other
    keys wait is served after at most K items, however many those keys queued."""
    q = FairQueue()
    for i in range(50):
        q.push("flood", i)
    q.pop()  # the queue has been serving the flood a while
    q.push("late", "mine")
    order = drain(q)
    assert order.index("mine") == 1
    for k in range(3):
        for i in range(20):
            q.push(f"k{k}", i)
    q.push("late", "mine")
    assert drain(q).index("mine") == 3


def test_fair_queue_remove():
    q = FairQueue()
    q.push("a", 1)
    q.push("a", 2)
    q.push("b", 3)
    assert q.remove("a", 1) and not q.remove("a", 1) and not q.remove("z", 1)
    assert q.remove("b", 3)
    assert q.waiting("a") == 1 and q.waiting("b") == 0
    assert drain(q) == [2]


# -- the gate ---------------------------------------------------------------------------------


def test_gate_hands_slots_round_robin_and_bounds_the_queue():
    async def main():
        # Nothing charged to any key: the order is the plain round-robin.
        gate = ModelGate(slots=1, max_queue=4, max_wait=10)
        assert gate.reserve("a") is None  # a slot at once
        places = [(k, gate.reserve(k)) for k in ("a", "a", "a", "b")]
        with pytest.raises(QueueFull):  # full, and "a" holds the most places
            gate.reserve("a")
        order = []

        async def waiter(key, place):
            await gate.wait(key, place)
            order.append(key)

        tasks = [asyncio.create_task(waiter(k, p)) for k, p in places]
        await asyncio.sleep(0)
        for _ in range(4):
            gate.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "a", "a"]
        assert gate.running == 1 and gate.waiting == 0
        gate.release()
        assert gate.running == 0

    asyncio.run(main())


def test_gate_cancelled_waiter_leaves_the_queue():
    async def main():
        gate = ModelGate(slots=1, max_queue=4, max_wait=10)
        gate.reserve("a")
        place = gate.reserve("b")
        task = asyncio.create_task(gate.wait("b", place))
        await asyncio.sleep(0)
        assert gate.waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.waiting == 0
        gate.release()
        assert gate.running == 0  # nobody inherited the slot

    asyncio.run(main())


def test_gate_times_out_a_waiter_and_a_late_grant_is_passed_on():
    async def main():
        gate = ModelGate(slots=1, max_queue=4, max_wait=0.05)
        gate.reserve("a")
        place = gate.reserve("b")
        with pytest.raises(QueueTimeout):
            await gate.wait("b", place)
        assert gate.waiting == 0 and gate.running == 1
        # A grant racing with the waiter giving up: the slot must not leak.
        place = gate.reserve("c")
        task = asyncio.create_task(gate.wait("c", place))
        await asyncio.sleep(0)
        gate.release()  # hands the slot to c ...
        task.cancel()  # ... which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.running == 0 and gate.waiting == 0

    asyncio.run(main())


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_key_work_adds_up_and_halves_per_half_life():
    clock = FakeClock()
    work = KeyWork(half_life_s=10, clock=clock)
    work.charge("a", 3000)
    work.charge("a", 32)
    assert work.of("a") == pytest.approx(3032)
    clock.now = 10.0
    assert work.of("a") == pytest.approx(1516)  # one half-life later
    work.charge("a", -5000)  # a refund never goes below nothing
    assert work.of("a") == 0.0 and work.of("b") == 0.0


def test_slots_go_to_the_key_whose_requests_cost_least():
    """A key sending 3000-token prompts (its clients may hang up before the
    first token) against one sending 60-token requests, both always waiting:
    the tokens processed are shared about evenly. Round-robin over requests
    gave the long key 98 % of the tokens."""
    work = KeyWork(half_life_s=1e9, clock=FakeClock())
    queue = FairQueue(work.of)
    cost = {"long": 3000, "short": 60}
    done = dict.fromkeys(cost, 0)
    for _ in range(2000):
        for key in cost:
            if queue.waiting(key) == 0:
                queue.push(key, object())
        key, _ = queue.pop()
        work.charge(key, cost[key])
        done[key] += cost[key]
    share = done["short"] / sum(done.values())
    assert 0.45 < share < 0.55, done


def test_a_full_queue_makes_room_for_a_key_with_fewer_places():
    """One key retrying at once after every 429 fills the queue; a key that
    waited its Retry-After still gets a place, the hammering key's newest
    gives its up (429), until the two hold about as many."""
    async def main():
        gate = ModelGate(slots=1, max_queue=4, max_wait=10)
        gate.reserve("hammer")  # the slot
        mine = [gate.reserve("hammer") for _ in range(4)]
        waits = [asyncio.create_task(gate.wait("hammer", p)) for p in mine]
        await asyncio.sleep(0)
        polite = gate.reserve("polite")
        assert polite is not None and gate.waiting == 4
        with pytest.raises(QueueFull):
            await waits[-1]  # the newest hammer request lost its place
        gate.reserve("polite")  # hammer 3 vs polite 1: room again
        with pytest.raises(QueueFull):  # 2 and 2: no more
            gate.reserve("polite")
        with pytest.raises(QueueFull):
            gate.reserve("hammer")
        for t in waits[:2]:
            t.cancel()
        outcomes = await asyncio.gather(*waits, return_exceptions=True)
        assert [type(o) for o in outcomes[2:]] == [QueueFull, QueueFull]

    asyncio.run(main())
