"""Kernels built side by side in worker processes (specgate/kernels/prebuild.py), on the CPU.

On CUDA, MLX builds each kernel at its first call, one at a time per
process; the builder's worker processes build them into MLX's kernel cache
first. What a CPU can show of it:
- a module a worker built reaches the shared cache whole, and a worker
  links in what the others built;
- jobs run in worker processes (MLX's stock op builds on a CPU too; a job
  for one of our kernels is refused and says why), each once, and the
  workers exit when idle;
- one job of a group (likely the same modules) builds at a time;
- a stop drops the jobs not taken; a worker past its time is killed and
  turns the builders off, as does one that cannot start; a bad job is an
  error, not a dead builder;
- kernels/wiring.prove hands the builder the references (MLX's own
  products) of exactly the verdicts it is about to prove, and nothing once
  they are recorded.
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import mlx.nn as nn

from specgate.kernels import qmm, wiring
from specgate.kernels.guard import Candidate, Guard
from specgate.kernels.prebuild import Builder, Job, _Batch, hand_over, take_in

STOCK = [Job("qmm", "stock", (m, 256, 512, "bfloat16", 4, 64)) for m in (16, 32, 64)]


def _module(d, stem: str, text: str) -> None:
    for suffix in (".txt", ".cu", ".ptx"):
        (d / f"{stem}{suffix}").write_text(f"{text}{suffix}")


def test_a_built_module_moves_whole_and_others_are_linked_in(tmp_path):
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir()
    shared.mkdir()
    _module(private, "mine", "m")
    (private / "half.txt").write_text("no .ptx yet")  # MLX writes it with its .ptx: not a module yet
    seen: set[str] = set()
    assert hand_over(private, shared, seen) == ["mine"]
    assert sorted(p.name for p in shared.iterdir()) == ["mine.cu", "mine.ptx", "mine.txt"]
    assert (shared / "mine.ptx").read_text() == "m.ptx" and (shared / "mine.txt").read_text() == "m.txt"
    assert sorted(p.name for p in private.iterdir()) == ["half.txt"]

    _module(shared, "theirs", "t")  # another worker's
    assert take_in(shared, private, seen) == 1
    assert (private / "theirs.ptx").read_text() == "t.ptx" and (private / "theirs.txt").exists()
    assert not (private / "mine.ptx").exists()  # handed over: in the worker's memory already
    assert take_in(shared, private, seen) == 0
    assert hand_over(private, shared, seen) == []  # what was linked in is not handed back


def test_jobs_run_in_worker_processes_once_and_the_workers_leave(tmp_path):
    b = Builder(tmp_path, 2, idle_s=0.5)
    cuda = Job("qmm", "cuda_qmm_mma", (4, 256, 512, "bfloat16", 4, 64))
    report = b.build([*STOCK, cuda, STOCK[0]])
    assert (report.built, report.failed) == (3, 1)
    assert "unknown job kind 'cuda_qmm_mma'" in report.errors[0]  # never our kernels: MLX would not keep them
    assert b.done == {*STOCK, cuda}
    again = b.build(STOCK)
    assert (again.built, again.failed, again.known) == (0, 0, 3)
    deadline = time.monotonic() + 30
    while (b._threads or b._procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert b._threads == 0 and not b._procs  # idle: exited, no process left behind
    assert list(tmp_path.iterdir()) == []  # their private directories removed


def test_a_stop_drops_untaken_jobs_and_a_late_worker_is_killed(tmp_path):
    b = Builder(tmp_path, 1, idle_s=0.5)
    stop = threading.Event()
    stop.set()
    report = b.build(STOCK, stop)
    assert report.cancelled >= len(STOCK) - 1 and report.built == 0
    b.close()

    slow = Builder(tmp_path, 1, job_timeout=0.001, idle_s=0.5)  # no worker answers within 1 ms
    report = slow.build(STOCK)
    assert report.failed == len(STOCK) and "timed out" in report.errors[0]
    assert all("builder off" in e for e in report.errors[1:])  # stuck: the rest fail at once
    deadline = time.monotonic() + 30
    while slow._procs and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not slow._procs
    assert slow.build([Job("qmm", "stock", (128, 256, 512, "bfloat16", 4, 64))]).cancelled == 1


def test_a_builder_that_cannot_start_fails_its_jobs_at_once(tmp_path):
    """No worker can start (its directory cannot be made): the jobs fail at
    once, each built where it is called, rather than a proof waiting forever."""
    (tmp_path / "file").write_text("not a directory")
    b = Builder(tmp_path / "file" / "ptx", 2, idle_s=0.5)
    report = b.build(STOCK)
    assert report.failed == len(STOCK) and report.built == 0
    assert b.build(STOCK[:1]).cancelled == 0  # known (failed) already: nothing queued
    later = b.build([Job("qmm", "stock", (128, 256, 512, "bfloat16", 4, 64))])
    assert later.cancelled == 1  # off from then on


def test_a_bad_job_is_an_error_and_the_worker_goes_on(tmp_path):
    b = Builder(tmp_path, 1, idle_s=0.5)
    report = b.build([Job("no_such_op", "stock", (2, 64, 64, "bfloat16", 4, 64)), STOCK[0]])
    assert (report.built, report.failed) == (1, 1)
    assert "no_such_op" in report.errors[0]
    b.close()


def test_one_job_of_a_group_builds_at_a_time(tmp_path):
    """Jobs at one op, row count and precision likely build the same
    modules: the next of them waits for the first (then links its modules
    in) while other groups go ahead."""
    b = Builder(tmp_path, 4)
    a, same, other = (Job("qmm", "stock", (16, 256, 512, "bfloat16", 4, 64)),
                      Job("qmm", "stock", (16, 512, 256, "bfloat16", 4, 64)),
                      Job("qmm", "stock", (32, 256, 512, "bfloat16", 4, 64)))  # fmt: skip
    assert a.group == same.group != other.group
    batch = _Batch(3)
    b._queue.extend([(a, batch), (same, batch), (other, batch)])
    assert b._take()[0] == a
    assert b._take()[0] == other  # `same` waits: a's group is being built
    with b._cond:
        b._finish(a, batch, True, "", 0.5, 2)
    assert b._take()[0] == same
    assert (batch.report.built, batch.report.modules) == (1, 2)
    # A job another caller queued again once it was built is answered as
    # known, and leaves the group of the one being built alone.
    again = _Batch(2)
    b._queue.extend([(a, again), (Job("qmm", "stock", (64, 256, 512, "bfloat16", 4, 64)), again)])
    assert b._take()[0].shape[0] == 64
    assert a.group in b._building and (again.left, again.report.known) == (1, 1)



class Stock:
    """A correct kernel: the stock op."""

    def __call__(self, x, wq, s, b, gs, bits):
        return qmm.reference_qmm(x, wq, s, b, gs, bits)


def test_prove_hands_the_builder_the_references_of_the_verdicts_it_proves(tmp_path):
    """What a proof waits for MLX to build: the stock product and the float32
    one it compares with, where they are MLX's tiles (8 rows up; below, its
    built-in matrix-vector kernel); not the kernel, which MLX never writes
    to its disk cache."""
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128))
    nn.quantize(model, group_size=64, bits=4)
    cand = Candidate("test_stock", "v1", Stock())
    guard = Guard([cand], cache_dir=tmp_path / "verdicts", machine="test", reps=1, inner=1)
    b = Builder(tmp_path / "ptx", 1, idle_s=0.5)
    (tmp_path / "ptx").mkdir()
    assert wiring.prove(model, "auto", range(6, 10), guard=guard, builder=b)
    shapes = [(m, k, n, "float32", 4, 64) for k, n in ((128, 256), (256, 128)) for m in (8, 9)]
    assert b.done == {Job("qmm", "reference", s) for s in shapes}
    # every width proved (6 and 7 with nothing built first), and the probe at 2 rows
    assert len(guard.verdicts()) == 2 * 4 + 1
    before = set(b.done)
    assert wiring.prove(model, "auto", range(6, 10), guard=guard, builder=b)  # all recorded
    assert b.done == before
    b.close()


def test_forward_jobs_cover_every_shape_at_each_row_count():
    model = nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128))
    nn.quantize(model, group_size=64, bits=4)
    jobs = wiring.forward_jobs(model, (16, 2048))
    assert len(jobs) == 4 and set(jobs) == {Job("qmm", "stock", (m, k, n, "float32", 4, 64))
                                            for k, n in ((128, 256), (256, 128)) for m in (16, 2048)}  # fmt: skip
    assert [j.shape[0] for j in jobs] == [16, 2048, 16, 2048]  # shape by shape: the builds spread


def test_an_urgent_batch_does_not_wait_for_busy_workers(tmp_path):
    """Every worker busy with slow builds (MLX's prompt tiles, ~27 s each on
    an H100), an urgent batch starts workers of its own: it is done while
    the others are still building."""
    b = Builder(tmp_path, 1, idle_s=0.5)
    slow = [Job("qmm", "reference", (m, 2048, 2048, "float32", 4, 64)) for m in (512, 513)]  # ~4 s each
    t = threading.Thread(target=b.build, args=(slow,))
    t.start()
    while not b._building:
        time.sleep(0.05)
    report = b.build([STOCK[0]], urgent=True)
    assert report.built == 1 and slow[0] not in b.done  # the busy worker's build is not over
    b.close()  # (the slow batch's caller returns too: its queued job is cancelled)
    t.join(60)
    assert not t.is_alive()


def test_closing_returns_every_caller(tmp_path):
    """A builder closed (an engine stopping, the process exiting) while jobs
    wait: their callers return, the jobs cancelled, instead of waiting for
    builds that will never run."""
    b = Builder(tmp_path, 1, idle_s=0.5)
    slow = [Job("qmm", "reference", (m, 2048, 2048, "float32", 4, 64)) for m in (512, 513, 514)]
    reports = []
    t = threading.Thread(target=lambda: reports.append(b.build(slow)))
    t.start()
    while not b._building:
        time.sleep(0.05)
    b.close()
    t.join(30)
    assert not t.is_alive() and reports[0].cancelled == 2
