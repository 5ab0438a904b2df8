"""Waking the other ranks of a distributed model without keeping them busy.

While a receive is pending, MLX's ring backend polls its socket in a loop
(its socket thread retries a non-blocking recv): a rank waiting for rank
0's next turn burned most of a core while the server sat idle, and on a
small machine starved the rank serving HTTP. So before each message the
other ranks' conductors wait for (engines/distributed/lockstep.py: turns and the stop),
rank 0 writes one byte to each of them over a plain TCP connection, and a
conductor blocks in an ordinary read for that byte, costing nothing, before
it posts the MLX receive.

The connections are made once, through the lockstep's own channel: rank 0
listens on its address as mlx.launch gave it to every rank (the ring
hostfile's first entry, jaccl's coordinator), sends the port and a one-time
token down the channel, keeps the connections that present the token, and
closes the listener. A rank without an address (MPI) or a connection does
without, and polls as before.

The same connections tell rank 0 that another rank is lost, which MLX's
collectives say only once one runs, and never for a rank that is alive but
stuck: each other rank sends a heartbeat every second, and rank 0's watcher
reports a rank whose connection closed or who went silent. Silence is
counted only while the watcher itself ran: when the whole machine stalls
(a loaded host, a paused VM), the watcher wakes before the ranks' beats
do, and without that rule it took its own sleep for their silence.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

SETUP_S = 10.0  # rank 0: how long it waits for the other ranks to connect
TOKEN_BYTES = 16
TOKEN_WAIT_S = 2.0  # rank 0: how long one connection has to present the token
RING = b"\x01"  # rank 0 to another rank: a message follows
BEAT = b"\x02"  # another rank to rank 0: still here
BEAT_S = 1.0
LISTEN_S = 0.5  # rank 0's watcher wakes at least this often
STALL_S = 1.0  # a watcher that woke this much later than it asked was not running


@dataclass(frozen=True)
class Offer:
    """Where the other ranks connect, sent down the lockstep's channel."""

    host: str
    port: int
    token: bytes


def leader_host() -> str | None:
    """Rank 0's address, as mlx.launch gave it to every rank; None when it
    gave none (MPI) or the file is unreadable."""
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return _host(coordinator)
    hostfile = os.environ.get("MLX_HOSTFILE")
    if not hostfile:
        return None
    try:
        with open(hostfile) as f:
            return _host(json.load(f)[0][0])
    except (OSError, ValueError, LookupError, TypeError) as e:
        log.warning("doorbell: no address for rank 0 in %s (%s)", hostfile, e)
        return None


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


class Doorbell:
    """Rank 0's side: a connection to each other rank that answered, by rank."""

    def __init__(self, connections: dict[int, socket.socket]):
        self.connections = connections
        self.clock = time.monotonic  # (a test moves it, to stand for a stall)
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    def ring(self) -> None:
        for c in self.connections.values():
            try:
                c.sendall(RING)
            except OSError:
                pass  # a rank that is gone: the watcher or the channel says so

    def watch(self, silent_s: float, lost: Callable[[str], None]) -> None:
        """From now on, call lost(why) once when a rank's connection closes
        or it sent nothing for `silent_s`."""
        if not self.connections:
            return
        self._watcher = threading.Thread(target=self._watch, args=(silent_s, lost),
                                         name="doorbell-watch", daemon=True)  # fmt: skip
        self._watcher.start()

    def _watch(self, silent_s: float, lost: Callable[[str], None]) -> None:
        awake = self.clock()
        last = dict.fromkeys(self.connections, awake)
        with selectors.DefaultSelector() as selector:
            for rank, c in self.connections.items():
                selector.register(c, selectors.EVENT_READ, rank)
            while not self._closing.is_set():
                events = selector.select(timeout=LISTEN_S)
                now = self.clock()
                if (asleep := now - awake - LISTEN_S) > STALL_S:
                    # The watcher was not running, so it heard nothing: that time is no one's silence.
                    log.warning("doorbell: rank 0's watcher did not run for %.1f s", asleep)
                    last = {r: t + asleep for r, t in last.items()}
                awake = now
                for key, _ in events:
                    try:
                        heard = key.fileobj.recv(256)
                    except OSError:
                        heard = b""
                    if not heard:
                        lost(f"rank {key.data}'s connection to rank 0 closed")
                        return
                    last[key.data] = now
                silent = [r for r, t in last.items() if now - t > silent_s]
                if silent:
                    lost(f"rank {silent[0]} sent no heartbeat for {silent_s:g} s")
                    return

    def close(self) -> None:
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join()
        for c in self.connections.values():
            c.close()
        self.connections = {}


def open_doorbell(send: Callable[[object], None], followers: int, host: str | None,
                  timeout: float = SETUP_S) -> Doorbell:  # fmt: skip
    """Rank 0: offer a connection to the `followers` other ranks through
    `send` (every rank receives the offer, or None), and keep those that
    present the token within `timeout`."""
    if host is None:
        send(None)
        return Doorbell({})
    try:
        listener = socket.create_server((host, 0))
    except OSError as e:
        log.warning("doorbell: cannot listen on %s (%s); idle ranks will poll", host, e)
        send(None)
        return Doorbell({})
    with listener:
        offer = Offer(host, listener.getsockname()[1], secrets.token_bytes(TOKEN_BYTES))
        send(offer)
        kept: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout
        while len(kept) < followers and (left := deadline - time.monotonic()) > 0:
            listener.settimeout(left)
            try:
                conn, _ = listener.accept()
            except OSError:  # the deadline
                break
            rank = _admit(conn, offer.token, deadline)
            if rank is not None and rank not in kept:
                kept[rank] = conn
            else:
                conn.close()  # not a rank of this model (or too late)
    if len(kept) < followers:
        log.warning("doorbell: %d of %d other ranks connected; the others poll while idle",
                    len(kept), followers)  # fmt: skip
    return Doorbell(kept)


def _admit(conn: socket.socket, token: bytes, deadline: float) -> int | None:
    """The rank that presented the token (token, then its rank in 4 bytes), or None."""
    try:
        # A rank sends its token at once; a stranger that stalls holds up the others only briefly.
        conn.settimeout(min(max(deadline - time.monotonic(), 0.01), TOKEN_WAIT_S))
        got = b""
        while len(got) < TOKEN_BYTES + 4:
            chunk = conn.recv(TOKEN_BYTES + 4 - len(got))
            if not chunk:
                return None
            got += chunk
        if not hmac.compare_digest(got[:TOKEN_BYTES], token):
            return None
        conn.sendall(RING)  # the rank now waits for rings
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return int.from_bytes(got[TOKEN_BYTES:], "little")
    except OSError:
        return None


class Bell:
    """Another rank's side of its connection to rank 0; it beats while open."""

    def __init__(self, connection: socket.socket):
        self.connection = connection
        self._closing = threading.Event()
        self._beating = threading.Thread(target=self._beat, name="doorbell-beat", daemon=True)
        self._beating.start()

    def wait(self) -> bool:
        """Block until rank 0 rings (True), or its connection closes (False)."""
        try:
            return self.connection.recv(1) == RING
        except OSError:
            return False

    def _beat(self) -> None:
        while not self._closing.wait(BEAT_S):
            try:
                self.connection.sendall(BEAT)
            except OSError:
                return

    def close(self) -> None:
        self._closing.set()
        self._beating.join()
        self.connection.close()


def answer_doorbell(offer: Offer | None, rank: int,
                    timeout: float = 2 * SETUP_S) -> Bell | None:  # fmt: skip
    """Another rank: connect to rank 0's offer; None without one."""
    if offer is None:
        return None
    try:
        conn = socket.create_connection((offer.host, offer.port), timeout=timeout)
    except OSError as e:
        log.warning("doorbell: cannot reach rank 0 at %s:%d (%s); polling while idle",
                    offer.host, offer.port, e)  # fmt: skip
        return None
    try:
        conn.sendall(offer.token + rank.to_bytes(4, "little"))
        if conn.recv(1) != RING:
            raise ConnectionError("rank 0 did not keep the connection")
        conn.settimeout(None)
        return Bell(conn)
    except OSError as e:
        log.warning("doorbell: rank 0 at %s:%d refused (%s); polling while idle",
                    offer.host, offer.port, e)  # fmt: skip
        conn.close()
        return None
