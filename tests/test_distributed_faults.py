"""A rank of a distributed model killed mid-stream (tests/test_distributed.py
has the rest). A module of its own: while another distributed server idles,
its ranks poll the ring and take most of this machine's two cores (see
docs/DESIGN.md), and rank 0 here would be stopped by mlx.launch before it
had noticed the lost rank."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest
from conftest import stop_gateway
from test_distributed import client, gone, launch, ranks_of


def test_killing_rank_1_fails_the_request_cleanly(tmp_path):
    gw = launch(tmp_path, "tensor")
    try:
        follower = ranks_of(gw)[1]
        got = []
        with pytest.raises(openai.APIError, match="rank of this distributed model is gone"):
            stream = client(gw).completions.create(
                model="demo", prompt="Count:", max_tokens=3000, stream=True,
                extra_body={"ignore_eos": True}, extra_headers={"X-Specgate-Method": "mtp"})
            for chunk in stream:
                got.append(chunk)
                if len(got) == 3:
                    os.kill(follower, signal.SIGKILL)
        assert got and all(c.choices[0].finish_reason is None for c in got)
        try:  # rank 0 says why until mlx.launch stops it (it stops every rank once one died)
            ready = httpx.get(gw.base_url + "/ready", timeout=5)
            assert ready.status_code == 503
        except httpx.TransportError:
            pass
        gw.process.wait(timeout=60)
        assert gone(gw)
    finally:
        stop_gateway(gw)
