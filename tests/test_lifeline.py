"""specgate/engines/llamacpp/lifeline.py: a child started through it dies with its
parent even when the parent is SIGKILLed, with no parent-death signal
(macOS has none; the parent here sets none, so Linux shows the mechanism
macOS relies on). A child started without it survives the same kill: the
control that shows the test can fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specgate.engines.llamacpp.process import LIFELINE

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")

# A stand-in gateway: starts `sleep` (through the lifeline or not), prints
# its pid, reaps it if it ends, and waits to be killed.
PARENT = """
import os, subprocess, sys, time
lifeline, marker = sys.argv[1], sys.argv[2]
argv = ["sleep", marker]
if lifeline != "-":
    read_end, write_end = os.pipe()
    argv = [sys.executable, "-I", lifeline, str(read_end), *argv]
    child = subprocess.Popen(argv, start_new_session=True, pass_fds=(read_end,))
    os.close(read_end)
else:
    child = subprocess.Popen(argv, start_new_session=True)
print(child.pid, flush=True)
child.wait()  # reaped when it ends, as the gateway does (write_end stays open)
time.sleep(600)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (a reparented child may wait to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def cmdlines_with(marker: str) -> list[str]:
    """The running programs whose arguments end with `marker`: the child and
    its watcher (not the stand-in gateway, whose marker comes last but one)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args[-2:] == [marker.encode(), b""] and running(int(proc.name)):
            found.append(b" ".join(args).decode())
    return found


def start(tmp_path, lifeline: str, marker: str) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, lifeline, marker, "stand-in"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    pid = int(parent.stdout.readline())
    return parent, pid


def wait_until(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_a_child_dies_with_its_sigkilled_parent_through_the_lifeline(tmp_path):
    marker = f"{600 + os.getpid() % 1000}.{time.monotonic_ns() % 10**6}"
    parent, child = start(tmp_path, str(LIFELINE), marker)
    try:
        # exec in place: the pid the parent holds is the program itself.
        assert wait_until(lambda: Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep"))
        assert len(cmdlines_with(marker)) == 2  # sleep, and the watcher
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not running(child)), "the child outlived its SIGKILLed parent"
        assert wait_until(lambda: not cmdlines_with(marker), 5)  # the watcher left too
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)


def test_the_watcher_leaves_when_the_child_ends_first(tmp_path):
    marker = f"{601 + os.getpid() % 1000}.{time.monotonic_ns() % 10**6}"
    parent, child = start(tmp_path, str(LIFELINE), marker)
    try:
        assert wait_until(lambda: len(cmdlines_with(marker)) == 2)
        os.kill(child, signal.SIGKILL)
        assert wait_until(lambda: not cmdlines_with(marker), 5)
    finally:
        parent.kill()
        parent.wait()


def test_without_the_lifeline_the_child_survives(tmp_path):
    """The control: the same kill leaves an orphan when nothing watches."""
    marker = f"{602 + os.getpid() % 1000}.{time.monotonic_ns() % 10**6}"
    parent, child = start(tmp_path, "-", marker)
    try:
        parent.kill()
        parent.wait()
        time.sleep(1.5)
        assert running(child)
    finally:
        os.kill(child, signal.SIGKILL)
