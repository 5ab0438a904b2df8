"""Distributed servers started and stopped by the test itself: a rank
killed mid-stream, and a clean stop (tests/test_distributed.py has the
rest). A module of their own: while another distributed server is up, its
mlx.launch polls (docs/DESIGN.md) and takes much of this machine's two
cores, and rank 0 here could be stopped by mlx.launch before it had
noticed the lost rank."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest
from conftest import stop_gateway
from test_distributed import PROMPTS, client, complete, gone, launch, ranks_of


def signal_mid_stream(gw, method: str, pid: int, signum: int, error: str) -> None:
    """Stream a long completion, send `signum` to `pid` after 3 chunks: the
    stream must end in an APIError matching `error`, no chunk claiming to finish."""
    got = []
    with pytest.raises(openai.APIError, match=error):
        stream = client(gw).completions.create(
            model="demo", prompt="Count:", max_tokens=3000, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"X-Specgate-Method": method})
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                os.kill(pid, signum)
    assert got and all(c.choices[0].finish_reason is None for c in got)


def test_killing_rank_1_fails_the_request_cleanly(tmp_path):
    gw = launch(tmp_path, "tensor")
    try:
        signal_mid_stream(gw, "mtp", ranks_of(gw)[1], signal.SIGKILL,
                          "rank of this distributed model is gone")  # fmt: skip
        try:  # rank 0 says why until mlx.launch stops it (it stops every rank once one died)
            ready = httpx.get(gw.base_url + "/ready", timeout=5)
            assert ready.status_code == 503
        except httpx.TransportError:
            pass
        gw.process.wait(timeout=60)
        assert gone(gw)
    finally:
        stop_gateway(gw)


def test_stopping_the_ranks_ends_each_cleanly(tmp_path):
    """A service manager signals every rank at once: rank 0 drains and sends
    the stop, rank 1 takes it and exits 0. (mlx.launch is left running here,
    to pass on what the ranks log as they end.)"""
    gw = launch(tmp_path, "pipeline")
    try:
        complete(gw, PROMPTS[0], "none", max_tokens=4)
        for pid in ranks_of(gw).values():
            os.kill(pid, signal.SIGTERM)
        assert gw.process.wait(timeout=60) == 0  # mlx.launch saw every rank succeed
        assert "rank 1: rank 0 stopped" in gw.log()
        assert "is gone" not in gw.log() and "rank 1 exited with code" not in gw.log()
        assert gone(gw)
    finally:
        stop_gateway(gw)


def test_a_stuck_rank_is_found_by_its_silence(tmp_path):
    """Rank 1 frozen mid-stream (SIGSTOP: alive, its connections open, so no
    collective ever fails): rank 0 hears no heartbeat for rank_timeout_s and
    answers the stream with the reason, though its own engine thread is
    stuck in a collective; /ready says why."""
    gw = launch(tmp_path, "tensor", rank_timeout_s=3)
    follower = None
    try:  # (a failure finding the rank, too, must stop what was launched)
        follower = ranks_of(gw)[1]
        signal_mid_stream(gw, "none", follower, signal.SIGSTOP, "rank 1 sent no heartbeat for 3 s")
        ready = httpx.get(gw.base_url + "/ready", timeout=5)
        assert ready.status_code == 503 and "no heartbeat" in ready.text
        with pytest.raises(openai.APIError, match="rank 1 sent no heartbeat"):  # refused at once
            complete(gw, PROMPTS[0], "mtp", max_tokens=4)
    finally:
        if follower is not None:
            os.kill(follower, signal.SIGKILL)
        stop_gateway(gw)
    assert gone(gw)
