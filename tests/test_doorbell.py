"""specgate/engines/distributed/doorbell.py on loopback: rank 0's one-byte wake-ups to the other
ranks of a distributed model, and its watch over their heartbeats
(tests/test_distributed.py and _faults run it under mlx.launch). Here the
offer goes through a queue, where the lockstep's channel would carry it."""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time

import pytest

from specgate.engines.distributed.doorbell import Offer, answer_doorbell, leader_host, open_doorbell


def opening(followers: int, timeout: float = 5.0):
    """Rank 0 opening its doorbell in a thread: its offer, and a function
    that waits for the opening to end and returns the Doorbell."""
    offers: queue.Queue = queue.Queue()
    done: dict = {}
    opener = threading.Thread(target=lambda: done.update(
        bell=open_doorbell(offers.put, followers, "127.0.0.1", timeout)))  # fmt: skip
    opener.start()

    def opened():
        opener.join(10)
        return done["bell"]

    return offers.get(timeout=5), opened


def offered(followers: int, *, timeout: float = 5.0, answer: bool = True):
    """Rank 0's doorbell opened in a thread; each follower answers the offer."""
    offer, opened = opening(followers, timeout)
    bells = [answer_doorbell(offer, r + 1, timeout=5) for r in range(followers)] if answer else []
    return opened(), bells, offer


def test_each_ring_wakes_each_rank_once_and_a_close_says_gone():
    doorbell, bells, _ = offered(2)
    try:
        assert sorted(doorbell.connections) == [1, 2] and all(bells)
        doorbell.ring()
        doorbell.ring()
        assert [b.wait() for b in bells for _ in range(2)] == [True] * 4
        doorbell.close()
        assert [b.wait() for b in bells] == [False, False]  # rank 0 gone or stopped
    finally:
        for b in bells:
            b.close()


def test_a_wait_blocks_until_the_ring():
    doorbell, [bell], _ = offered(1)
    try:
        woke = threading.Event()
        waiter = threading.Thread(target=lambda: bell.wait() and woke.set())
        waiter.start()
        assert not woke.wait(0.3)
        doorbell.ring()
        assert woke.wait(5)
        waiter.join(5)
    finally:
        doorbell.close()
        bell.close()


def test_a_stranger_without_the_token_is_not_kept():
    offer, opened = opening(1)
    with socket.create_connection((offer.host, offer.port), timeout=5) as stranger:
        stranger.sendall(b"x" * (len(offer.token) + 4))
        assert stranger.recv(1) == b""  # closed on it
        bell = answer_doorbell(offer, 1, timeout=5)  # the real rank still gets in
    doorbell = opened()
    try:
        assert bell is not None and len(doorbell.connections) == 1
        doorbell.ring()
        assert bell.wait()
    finally:
        doorbell.close()
        bell.close()


def test_a_stranger_who_stalls_holds_the_ranks_up_only_briefly():
    offer, opened = opening(1, timeout=8.0)
    with socket.create_connection((offer.host, offer.port), timeout=10):
        bell = answer_doorbell(offer, 1, timeout=10)  # queued behind the silent stranger
        doorbell = opened()
    try:
        assert bell is not None and list(doorbell.connections) == [1]
    finally:
        doorbell.close()
        bell.close()


def test_a_rank_that_never_answers_leaves_rank_0_ringing_the_rest():
    doorbell, bells, offer = offered(1, timeout=0.5, answer=False)
    assert doorbell.connections == {}
    doorbell.ring()  # nobody to ring: no error
    assert answer_doorbell(offer, 1, timeout=2) is None  # too late: the listener closed


def test_without_an_address_nobody_waits_for_a_ring():
    offers: list = []
    doorbell = open_doorbell(offers.append, 1, None)
    assert offers == [None] and doorbell.connections == {}
    assert answer_doorbell(None, 1) is None


def test_rank_0s_address_comes_from_what_mlx_launch_set(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_JACCL_COORDINATOR", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    assert leader_host() is None  # MPI sets neither
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["10.0.0.2:5000", "10.0.1.2:5000"], ["10.0.0.3:5000"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hosts))
    assert leader_host() == "10.0.0.2"
    hosts.write_text("not json")
    assert leader_host() is None
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "[fe80::1]:32323")
    assert leader_host() == "fe80::1"


def test_an_offer_to_a_closed_port_is_refused_quietly():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    assert answer_doorbell(Offer("127.0.0.1", port, b"t" * 16), 1, timeout=2) is None


def watched(doorbell, silent_s: float) -> queue.Queue:
    lost: queue.Queue = queue.Queue()
    doorbell.watch(silent_s, lost.put)
    return lost


def test_a_rank_that_beats_is_not_lost_and_one_that_leaves_is_at_once():
    doorbell, bells, _ = offered(2)
    try:
        lost = watched(doorbell, silent_s=2.5)
        time.sleep(4)  # longer than the silence allowed: the heartbeats cover it
        assert lost.empty()
        bells[1].close()  # rank 2's process ends
        assert lost.get(timeout=5) == "rank 2's connection to rank 0 closed"  # not the silence
    finally:
        doorbell.close()
        bells[0].close()


@contextlib.contextmanager
def hand_made_rank(offer: Offer):
    """Rank 1's connection, made by hand: it presents the token and then
    sends only what the test sends (failure injection: no Bell beating)."""
    with socket.create_connection((offer.host, offer.port), timeout=5) as rank:
        rank.sendall(offer.token + (1).to_bytes(4, "little"))
        assert rank.recv(1) == b"\x01"
        yield rank


def test_a_rank_that_stops_beating_is_lost_after_the_timeout():
    """A rank stuck (or cut off) keeps its connection open and says nothing:
    here a hand-made connection that presents the token and then goes
    quiet stands in for it (failure injection)."""
    offer, opened = opening(1)
    with hand_made_rank(offer):
        doorbell = opened()
        try:
            lost = watched(doorbell, silent_s=1.5)
            assert lost.get(timeout=10) == "rank 1 sent no heartbeat for 1.5 s"
        finally:
            doorbell.close()


def test_a_stall_of_the_whole_machine_is_no_ranks_silence():
    """The host stalls rank 0's watcher and the other rank alike (a loaded
    machine, a paused VM): when it resumes, the watcher may run before the
    rank's next beat. Its clock jumping 5 s stands for the stall (failure
    injection); the hand-made connection beats when the test says. The rank
    is not lost, and once it truly goes quiet, it is."""
    offer, opened = opening(1)
    with hand_made_rank(offer) as rank:
        doorbell = opened()
        jumped = 0.0
        doorbell.clock = lambda: time.monotonic() + jumped
        try:
            lost = watched(doorbell, silent_s=2.5)
            for _ in range(3):
                rank.sendall(b"\x02")
                time.sleep(0.5)
            jumped = 5.0  # the stall, during which the rank sent nothing either
            time.sleep(1.5)  # the watcher wakes (every 0.5 s) before the rank beats again
            for _ in range(6):
                rank.sendall(b"\x02")
                time.sleep(0.5)
            assert lost.empty()
            assert lost.get(timeout=10) == "rank 1 sent no heartbeat for 2.5 s"
        finally:
            doorbell.close()


@pytest.fixture(autouse=True)
def _no_thread_left():
    before = set(threading.enumerate())
    yield
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]
