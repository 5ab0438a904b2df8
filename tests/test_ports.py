"""The tests' own ports (tests/conftest.py), which must hold under
pytest-xdist on a loaded machine: a gateway binds its own port (there is no
moment when another process could take it), and a process that must be
told its ports before it starts gets them below the ephemeral range, from
its worker's own slice, never the same twice while it runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
from conftest import (
    REPO,
    RESERVED_LOW,
    _ephemeral_low,
    _worker_slice,
    reserved_ports,
    start_gateway,
    stop_gateway,
)


def test_a_gateway_binds_its_own_port_and_says_which(tiny_model, tmp_path):
    gw = start_gateway({"models": [{"id": "t", "path": str(tiny_model), "engines": ["mlx_plain"]}]},
                       tmp_path)  # fmt: skip
    try:
        args = [str(a) for a in gw.process.args]
        assert args[args.index("--port") + 1] == "0"  # its own pick, when it binds
        port = int(gw.base_url.rsplit(":", 1)[1])
        assert f"specgate.gateway.operator.cli: listening on http://127.0.0.1:{port}" in gw.log()
        assert httpx.get(gw.base_url + "/health").status_code == 200
    finally:
        stop_gateway(gw)


# Each process takes 10 runs of 3 ports, says which, and keeps them (and
# their lock files) until its stdin closes.
_WORKER = f"""
import sys
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
import conftest
print(" ".join(str(conftest.reserved_ports(3)) for _ in range(10)), flush=True)
sys.stdin.read()
"""


def test_reserved_ports_are_below_the_ephemeral_range_and_never_shared():
    """Four xdist workers, and a second session's gw1 beside them, all at
    once: every port lies below the range the kernel hands out by itself,
    each worker's in its own slice, and no two processes share one."""
    workers = ["gw0", "gw1", "gw2", "gw3", "gw1"]
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=os.environ | {"PYTEST_XDIST_WORKER": w,
                                                "PYTEST_XDIST_WORKER_COUNT": "4"})
             for w in workers]  # fmt: skip
    try:
        firsts = [[int(p) for p in proc.stdout.readline().split()] for proc in procs]
    finally:
        for proc in procs:
            proc.communicate("", timeout=60)  # (closing stdin lets it go)
    taken = [{f + i for f in runs for i in range(3)} for runs in firsts]
    assert all(len(runs) == 10 for runs in firsts) and all(len(t) == 30 for t in taken)
    low, size = _ephemeral_low(), (_ephemeral_low() - RESERVED_LOW) // 4
    for worker, ports in zip(workers, taken, strict=True):
        start = RESERVED_LOW + int(worker[2:]) * size
        mine = range(start, start + size)
        assert all(p in mine and p < low for p in ports), (worker, sorted(ports))
    everything = set().union(*taken)
    assert len(everything) == sum(len(t) for t in taken)  # no port in two processes


def test_a_port_something_listens_on_is_passed_over():
    first = reserved_ports()
    assert first in _worker_slice()
    try:
        taken = socket.create_server(("127.0.0.1", first + 1))  # where it would look next
    except OSError:
        taken = None  # something else listens there already: as good
    try:
        assert reserved_ports() != first + 1
    finally:
        if taken is not None:
            taken.close()
