"""Two model families in one process, speculating on both, decode as each does alone.

The hybrid (Qwen3.5, its MTP head) and a dense Qwen3 (a DFlash drafter) are
loaded together, their rounds interleaved on one thread, and their tokens
compared with what a fresh process that loads only that model decodes. The
hooks speculation needs (tapes, layer capture) are on these model instances
only: mlx-lm's modules and classes stay as shipped, and a third model that
is served plainly runs mlx-lm's own layers. A process-wide patch (rebinding
`qwen3_5.gated_delta_update`, swapping a class for every instance) fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

REPO = Path(__file__).resolve().parents[1]
N_TOKENS = 24
DEPTH = 3
PROMPTS = [[5, 17, 3, 9, 11], [40, 2, 2, 7, 31, 8, 19, 4]]


def decoders(kind: str, model_dir: Path, drafter_dir: Path | None, prompt: list[int]):
    """A speculative decoder for `prompt` on a model loaded here (one per call)."""
    from mlx_lm.utils import load_model

    from specgate.engines.base import GenerationRequest, Plan, SamplingParams
    from specgate.engines.cache.prefix_cache import PrefixCache
    from specgate.engines.loading import LoadedModel
    from specgate.engines.mlx_spec.decoder import SpecDecoder
    from specgate.engines.targets import target_for

    model, config = load_model(model_dir)
    target = target_for(model)
    if kind == "mtp":
        from specgate.engines.drafting.mtp.loading import load_mtp_head
        from specgate.engines.drafting.mtp.proposer import MTPProposer

        loaded = LoadedModel(str(model_dir), model, None, config, PrefixCache(str(model_dir)))
        proposer = MTPProposer(target, load_mtp_head(loaded))
    else:
        from specgate.engines.drafting.dflash.model import load_dflash
        from specgate.engines.drafting.dflash.proposer import DFlashProposer

        proposer = DFlashProposer(target, load_dflash(drafter_dir))
    request = GenerationRequest("t", "m", prompt, SamplingParams(temperature=0), N_TOKENS,
                                Plan("x", proposer.method, DEPTH, "spec_on"))  # fmt: skip
    return model, SpecDecoder(target, proposer, request, None, 0, None)


def run(decoder) -> list[int]:
    step = decoder.prefill()
    tokens = list(step.tokens)
    while step.finish_reason is None:
        step = decoder.round(DEPTH)
        tokens += step.tokens
    return tokens


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from specgate.builders.drafters import build_dflash_drafter
    from specgate.builders.tiny import build_qwen3_dense, build_qwen35_hybrid

    root = tmp_path_factory.mktemp("families")
    hybrid = build_qwen35_hybrid(root / "hybrid", tokenizer=False, aligned_mtp=True)
    dense = build_qwen3_dense(root / "dense", tokenizer=False)
    drafter = build_dflash_drafter(root / "dflash", target=dense, block_size=4,
                                   num_hidden_layers=1, tokenizer=False)  # fmt: skip
    return {"mtp": (hybrid, None), "dflash": (dense, drafter)}


def alone(kind: str, model_dir: Path, drafter_dir: Path | None) -> list[list[int]]:
    """Decode in a fresh process that loads only this model."""
    out = subprocess.run(
        [sys.executable, __file__, kind, str(model_dir), str(drafter_dir or "")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_families_in_one_process_decode_as_alone(checkpoints):
    from mlx_lm.models import gated_delta, qwen3_5

    want = {kind: alone(kind, *checkpoints[kind]) for kind in ("mtp", "dflash")}
    # Together: both loaded, rounds interleaved on this thread.
    for i, prompt in enumerate(PROMPTS):
        _, a = decoders("mtp", *checkpoints["mtp"], prompt)
        _, b = decoders("dflash", *checkpoints["dflash"], prompt)
        steps = {"mtp": a.prefill(), "dflash": b.prefill()}
        got = {k: list(s.tokens) for k, s in steps.items()}
        while any(s.finish_reason is None for s in steps.values()):
            for kind, d in (("mtp", a), ("dflash", b)):
                if steps[kind].finish_reason is None:
                    steps[kind] = d.round(DEPTH)
                    got[kind] += steps[kind].tokens
        assert got["mtp"] == want["mtp"][i] and got["dflash"] == want["dflash"][i]
    # mlx-lm as shipped: its module globals and its classes' own code.
    assert qwen3_5.gated_delta_update is gated_delta.gated_delta_update
    assert qwen3_5.GatedDeltaNet.__call__.__globals__ is vars(qwen3_5)
    assert nn.Conv1d.__call__.__module__.startswith("mlx.")
    # A third model, loaded beside them without a target: mlx-lm's own
    # classes only, and the same logits as a hooked instance outside a round.
    from mlx_lm.utils import load_model

    hooked, _ = decoders("mtp", *checkpoints["mtp"], PROMPTS[0])
    fresh, _ = load_model(checkpoints["mtp"][0])
    own = {type(m).__module__.split(".")[0] for _, m in fresh.named_modules()}
    assert own <= {"mlx", "mlx_lm"}, own
    tokens = mx.array([PROMPTS[0]])
    assert mx.array_equal(fresh(tokens), hooked(tokens)), "the hooks changed a forward"


if __name__ == "__main__":  # one model alone: its tokens per prompt, as JSON
    kind, model_dir, drafter_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3] or None
    print(json.dumps([run(decoders(kind, model_dir, drafter_dir and Path(drafter_dir), p)[1])
                      for p in PROMPTS]))  # fmt: skip
