"""A child that dies with the gateway, on every OS: a lifeline pipe.

Linux can ask the kernel to kill a child when its parent dies
(PR_SET_PDEATHSIG); macOS cannot, and a SIGKILLed gateway runs no cleanup.
So the gateway starts llama-server through this file (run as a script:
stdlib only, no package imports), with the read end of a pipe whose write
end only the gateway holds. It forks a watcher, then execs llama-server in
place, so the process the gateway started (its pid, its signals, its exit
status) *is* llama-server. The watcher (double-forked, so init reaps it)
waits for the pipe to reach EOF, which happens when the gateway closes it
or dies in any way, and then stops llama-server: SIGTERM, then SIGKILL.
It leaves by itself once llama-server has gone.

    python lifeline.py READ_FD PROGRAM [ARGS...]
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

GRACE_S = 5.0  # between SIGTERM and SIGKILL
POLL_S = 1.0  # how often the watcher checks that its server still runs


def _same_group_alive(pid: int, group: int) -> bool:
    """`pid` still runs in our process group (a reused pid would not be in it)."""
    try:
        return os.getpgid(pid) == group
    except ProcessLookupError:
        return False


def _watch(pipe: int, server: int, group: int) -> None:
    while _same_group_alive(server, group):
        ready, _, _ = select.select([pipe], [], [], POLL_S)
        if ready and not os.read(pipe, 1):  # EOF: the gateway is gone or let go
            break
    else:
        return  # the server ended first: nothing to do
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 0.0)):
        if not _same_group_alive(server, group):
            return
        try:
            os.kill(server, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _same_group_alive(server, group):
            time.sleep(0.05)


def main(argv: list[str]) -> None:
    pipe, program = int(argv[1]), argv[2:]
    server = os.getpid()  # after exec, llama-server
    middle = os.fork()
    if middle == 0:
        if os.fork() == 0:  # the watcher: its parent exits now, so init reaps it
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # hold neither the server's log nor a terminal
                os.dup2(devnull, fd)
            try:
                _watch(pipe, server, os.getpgid(0))
            finally:
                os._exit(0)
        os._exit(0)
    os.waitpid(middle, 0)
    os.close(pipe)  # only the watcher keeps it
    os.execvp(program[0], program)


if __name__ == "__main__":
    main(sys.argv)
