"""The small-M kernels wired into the engines' verify forward (specgate/kernels/wiring.py), on the CPU.

A 4-bit tiny Qwen3.5 hybrid (mlx-lm's converter, float32 activations) with
its MTP head, served by the real SpecEngine (MTP):
- with a guard whose only kernel is a correct one (the stock op, counted),
  greedy MTP decoding equals plain greedy decoding token for token, the
  kernel runs for every verify width and never for prefill or one-row
  steps, and every verify shape was proved at load, none during decoding;
- with `kernels: off` it never runs;
- with the real kernels (CUDA, Metal) on this CPU both are recorded
  `failed` once, with a log line, the hook is not installed, and the output
  is unchanged; a later process reads the verdicts back instead of building;
- with nothing recorded, the engine loads at once and serves on the stock
  path while the proofs run in the background, and switches to the kernels
  only once every verdict is recorded; with everything recorded it wires
  them at load.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time

import mlx.core as mx
import pytest
from greedy import assert_same_greedy, greedy_reference
from mlx.utils import tree_flatten

from specgate.builders.tiny import build_qwen35_hybrid
from specgate.engines import kernel_wiring, registry
from specgate.engines.base import GenerationRequest, LiveState, Plan, SamplingParams, TokenEvent
from specgate.engines.drafting.base import Proposal
from specgate.engines.drafting.mtp import proposer as mtp
from specgate.engines.drafting.mtp.loading import load_mtp_head
from specgate.engines.drafting.mtp.proposer import MTPProposer
from specgate.engines.loading import load_mlx_model
from specgate.engines.mlx_plain.engine import MLXPlainEngine
from specgate.engines.mlx_spec.decoder import SpecDecoder
from specgate.engines.mlx_spec.engine import SpecEngine
from specgate.engines.settings import MTPSettings
from specgate.gateway.config import ConfigError, parse_config
from specgate.kernels import hook, qmm, wiring
from specgate.kernels.guard import Candidate, Guard
from specgate.policies.config import PolicyConfig
from specgate.policies.decide import FixedPlanner, RequestFeatures, decide
from specgate.policies.model_policy import build_policy

N_TOKENS = 24
DEPTHS = (1, 2, 3)


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    """A 4-bit (group 64) tiny hybrid with a float MTP head sidecar."""
    from mlx_lm import convert

    root = tmp_path_factory.mktemp("kernel_wiring")
    src = build_qwen35_hybrid(root / "f32", hidden_size=128, vocab_size=1024)
    head = load_mtp_head(load_mlx_model(str(src)))
    dest = root / "q4"
    convert(str(src), mlx_path=str(dest), quantize=True, q_group_size=64, q_bits=4,
            dtype="float32")  # fmt: skip
    mx.save_safetensors(str(dest / "mtp.safetensors"), dict(tree_flatten(head.parameters())))
    loaded = load_mlx_model(str(dest))
    assert any(hook.eligible(m) for _, m in loaded.model.named_modules())
    return loaded


class Counting:
    """A correct kernel: the stock op, with every call's row count noted."""

    def __init__(self):
        self.rows: list[int] = []

    def __call__(self, x, wq, s, b, gs, bits):
        self.rows.append(x.size // x.shape[-1])
        return qmm.reference_qmm(x, wq, s, b, gs, bits)


def counting_guard(tmp_path, kernel: Counting) -> Guard:
    # margin inf: correct is enough to be enabled (wrapping stock is not faster)
    return Guard([Candidate("count", "1", kernel)], cache_dir=tmp_path, machine="test-machine",
                 reps=2, inner=1, margin=float("inf"))  # fmt: skip


class InjectedDrafts(MTPProposer):
    """The head drafts; its proposals are replaced by the reference
    continuation, one position corrupted (or none), so partial acceptance
    and rollback run through the kernels too."""

    def __init__(self, *args, reference, rng):
        super().__init__(*args)
        self.reference, self.rng = reference, rng

    def propose(self, context, depth):
        proposal = super().propose(context, depth)
        true = self.reference[context.generated : context.generated + depth]
        true += [0] * (depth - len(true))
        if (wrong := self.rng.randrange(depth + 1)) < depth:
            true[wrong] = (true[wrong] + 1) % 7
        return Proposal(mx.array(true), proposal.q)


def mtp_engine(loaded, **kw) -> SpecEngine:
    return SpecEngine("m", loaded, name="mlx_mtp", drafting=mtp.drafting, max_context=4096, **kw)


def prompts(vocab: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab - 3) for _ in range(rng.randint(3, 12))] for _ in range(n)]


def decode(engine, prompt, depth, cls=MTPProposer, kernel: Counting | None = None, **inject):
    request = GenerationRequest("t", "m", prompt, SamplingParams(temperature=0), N_TOKENS,
                                Plan("mlx_mtp", "mtp", depth, "spec_on"))  # fmt: skip
    decoder = SpecDecoder(engine.target, cls(engine.target, engine.drafting.weights, **inject), request, None,
                          0, None)
    step = decoder.prefill()
    if kernel is not None:
        assert kernel.rows == [], "prefill went through the kernel"
    tokens, accepted = list(step.tokens), 0
    while step.finish_reason is None:
        step = decoder.round(depth)
        tokens += step.tokens
        accepted += step.stats.accepted
    return tokens, accepted


def check_equal_to_plain(loaded, engine, kernel: Counting | None = None) -> int:
    """Greedy MTP (own drafts, and injected ones) equals plain greedy; returns accepted drafts."""
    accepted = 0
    for i, prompt in enumerate(prompts(loaded.vocab_size)):
        want, margins = greedy_reference(loaded.model, prompt, N_TOKENS)
        for depth in DEPTHS:
            if kernel is not None:
                kernel.rows.clear()
            got, _ = decode(engine, prompt, depth, kernel=kernel)
            assert_same_greedy(got, want, margins)
            if kernel is not None:
                assert kernel.rows and set(kernel.rows) == {depth + 1}, (depth, set(kernel.rows))
                kernel.rows.clear()
            got, acc = decode(engine, prompt, depth, InjectedDrafts, kernel=kernel,
                              reference=want, rng=random.Random(i))  # fmt: skip
            assert_same_greedy(got, want, margins)
            accepted += acc
            if kernel is not None:
                assert set(kernel.rows) == {depth + 1}
    return accepted


def settled(engine: SpecEngine) -> bool:
    """Its verify path decided, and its batch widths proved after that (the
    background thread ended: nothing of it runs into the next test)."""
    return engine.kernels_ready(120) and engine.kernel_switch.batch_done.wait(120)


def test_verify_through_a_proved_kernel_equals_plain_greedy(q4, tmp_path):
    kernel = Counting()
    guard = counting_guard(tmp_path, kernel)
    engine = mtp_engine(q4, settings=MTPSettings(depth=max(DEPTHS)), kernel_guard=guard)
    assert settled(engine)  # proved in the background: nothing was recorded
    wired = engine.kernel_wiring
    assert wired.enabled and engine.target.kernels and wired.hooked > 0
    # every verify shape at widths 2..max depth + 1 proved ok before the switch
    assert wired.widths == (2, 3, 4)
    shapes = wiring.model_shapes(q4.model)
    assert wired.in_use() == len(shapes) * 3
    # then the widths only a batch of streams verifies: 2..8 streams of 1..4
    # rows, up to 16 rows in all (11 and 13 are no such product)
    assert engine.kernel_switch.batch_widths == [5, 6, 7, 8, 9, 10, 12, 14, 15, 16]
    assert engine.kernel_switch.rows == qmm.MAX_M
    assert guard.checks_run == len(shapes) * 13
    saved = json.loads(guard.path.read_text())["verdicts"]
    assert len(saved) == guard.checks_run and {v["status"] for v in saved.values()} == {"ok"}
    checks = guard.checks_run
    assert check_equal_to_plain(q4, engine, kernel) > 0  # partial and full acceptance happened
    assert guard.checks_run == checks  # no proof inside a request
    # one-row steps and plain decoding never use it
    kernel.rows.clear()
    greedy_reference(q4.model, [1, 2, 3, 4, 5], 4)
    with hook.kernels():
        q4.model(mx.array([[7]]))
    assert kernel.rows == []


def test_kernels_off_never_calls_the_kernel(q4, tmp_path):
    kernel = Counting()
    guard = counting_guard(tmp_path, kernel)
    hook.install(q4.model, guard)  # even with a hook in place (another engine's), off is off
    engine = mtp_engine(q4, settings=MTPSettings(depth=max(DEPTHS)), kernel_guard=guard, kernels="off")
    assert not engine.target.kernels and not engine.kernel_wiring.enabled
    assert guard.checks_run == 0
    check_equal_to_plain(q4, engine)
    assert kernel.rows == []


def test_real_kernels_fail_once_on_this_cpu_and_output_is_unchanged(q4, tmp_path, monkeypatch,
                                                                    caplog):  # fmt: skip
    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path))
    monkeypatch.setattr(wiring, "_guards", {})
    with caplog.at_level(logging.INFO, logger="specgate.kernels"):
        engine = mtp_engine(q4, settings=MTPSettings(depth=2))
        assert engine.kernels_ready(120)
    wired = engine.kernel_wiring
    assert not wired.enabled and not engine.target.kernels
    assert set(wired.failed) == {"cuda_qmm", "metal_qmm"}
    assert "No CUDA" in wired.failed["cuda_qmm"] and "No Metal" in wired.failed["metal_qmm"]
    guard = kernel_wiring.shared_guard()
    assert guard.path.parent.parent == tmp_path / "kernels"  # SPECGATE_HOME's verdict cache
    assert guard.checks_run == 2 and guard.candidates == []  # one probe each, then dropped
    saved = json.loads(guard.path.read_text())["verdicts"]
    assert len(saved) == 2 and {v["status"] for v in saved.values()} == {"failed"}
    said = [r.message for r in caplog.records if r.name == "specgate.kernels"]
    assert sum("no kernel builds on this device" in m for m in said) == 1
    check_equal_to_plain(q4, engine)

    # A later process: the verdicts are read back, nothing is built again.
    monkeypatch.setattr(wiring, "_guards", {})
    again = mtp_engine(q4, settings=MTPSettings(depth=2))
    assert not again.target.kernels and kernel_wiring.shared_guard().checks_run == 0


def test_config_kernels_setting():
    base = {"id": "m", "path": "builtin:demo", "engines": ["mlx_plain", "mlx_mtp"]}
    assert parse_config({"models": [base]}).models[0].kernels == "auto"
    assert parse_config({"models": [base | {"kernels": "off"}]}).models[0].kernels == "off"
    with pytest.raises(ConfigError, match="kernels"):
        parse_config({"models": [base | {"kernels": "fast"}]})
    with pytest.raises(ValueError, match="kernels"):
        wiring.prepare(None, "fast")


def test_tune_shows_verdicts_and_measures_the_curve_in_use(q4, tmp_path, monkeypatch, capsys):
    """`specgate tune` on a quantized model: the guard's verdicts for its shapes,
    both verify curves, the kernels' one saved as the policy's, the stock one
    beside it (read when the model is served with `kernels: off`)."""
    from argparse import Namespace

    from specgate.gateway.serving import tuning

    kernel = Counting()
    guard = counting_guard(tmp_path, kernel)
    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path))
    real = wiring.shared_guard  # the fused guard stays the real one (float32 here: not written for)
    monkeypatch.setattr(wiring, "shared_guard",
                        lambda cache_dir, op="qmm": guard if op == "qmm" else real(cache_dir, op))
    assert tuning.run_cli(Namespace(model=q4.path, drafter=None, reps=1)) == 0
    out = capsys.readouterr().out
    shapes = wiring.model_shapes(q4.model)
    assert f": {len(shapes) * 15} of {len(shapes) * 15} (shape, width) pairs" in out
    assert out.count("      count M=") == len(shapes) * 15  # a verdict row per shape and width
    assert "stock | kernels" in out and "kernels verify at context 4096" in out
    assert set(kernel.rows) >= set(range(2, 17)) and 1 not in kernel.rows
    data = json.loads(next((tmp_path / "tune").rglob("*.json")).read_text())
    k = data["kernels"]
    assert k["enabled"] and len(k["verdicts"]) == len(shapes) * 15
    assert k["verify_stock"]["64"]["1"] == 1.0 and len(k["verify_stock"]["64"]) == 16
    auto, off = tuning.costs_for(q4.path, "auto"), tuning.costs_for(q4.path, "off")
    assert auto.verify_cost(4, 64) == pytest.approx(data["verify"]["64"]["4"])
    assert off.verify_cost(4, 64) == pytest.approx(k["verify_stock"]["64"]["4"])


class Gated(Counting):
    """Failure injection: a proof as slow as the test wants (on the H200 a
    7B model's took ~46 s): every call waits for `release`, and the thread
    that made it is noted."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def __call__(self, *args):
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(120), "the test never released the proof"
        return super().__call__(*args)


def watch_kernels(target, guard: Guard) -> list[tuple]:
    """Each time the target's verify path is set: (on, the statuses and the
    number of the guard's recorded verdicts then)."""
    seen: list[tuple] = []

    class Watched(type(target)):
        @property
        def kernels(self):
            return self.__dict__["_watched"]

        @kernels.setter
        def kernels(self, on):
            recorded = guard.verdicts()
            seen.append((on, {v.status for v in recorded.values()}, len(recorded)))
            self.__dict__["_watched"] = on

    target.__dict__["_watched"] = target.__dict__.pop("kernels")
    target.__class__ = Watched
    return seen


async def serve(engine: SpecEngine, prompt: list[int]) -> list[int]:
    plan = Plan("mlx_mtp", "mtp", 2, "spec_on")
    request = GenerationRequest("t", "m", prompt, SamplingParams(temperature=0), N_TOKENS, plan)
    tokens = []
    async for item in engine.generate(request, FixedPlanner(plan)):
        if isinstance(item, TokenEvent):
            tokens += item.token_ids
    return tokens


def test_serves_on_the_stock_path_while_its_kernels_are_proved(q4, tmp_path):
    kernel = Gated()
    guard = counting_guard(tmp_path, kernel)
    prompt = prompts(q4.vocab_size)[0]
    want, margins = greedy_reference(q4.model, prompt, N_TOKENS)
    engine = mtp_engine(q4, settings=MTPSettings(depth=2), kernel_guard=guard)
    # Loaded while its first proof waits: nothing was recorded on this machine.
    assert kernel.entered.wait(60) and kernel.threads == ["kernel-proofs m mlx_mtp"]
    assert engine.kernels_proving and not engine.target.kernels and engine.kernel_wiring is None
    seen = watch_kernels(engine.target, guard)
    shapes = wiring.model_shapes(q4.model)
    # The model's policy, as the gateway builds it: plain decoding meanwhile.
    context = registry.BuildContext("m", q4.path, registry.MLX, max_context=4096, loaded=q4)
    plain = registry.record("mlx_plain").build(context, ("mlx_plain",))[0]["mlx_plain"]
    policy = build_policy("m", {"mlx_plain": plain, "mlx_mtp": engine}, {}, PolicyConfig(),
                          context=context, params=None)  # fmt: skip

    def planned():
        plan = decide(policy, RequestFeatures(len(prompt), False), LiveState(0, 0, 0))
        return plan.method, plan.reason

    assert planned() == ("none", "kernels_proving")

    async def run():
        await engine.start()
        try:
            # served meanwhile, speculating on the stock verify path
            assert_same_greedy(await serve(engine, prompt), want, margins)
            assert engine.kernels_proving and set(kernel.threads) == {"kernel-proofs m mlx_mtp"}
            assert seen == []
            kernel.release.set()
            assert await asyncio.to_thread(settled, engine)
            # switched once, after every verdict was recorded ok
            assert seen == [(True, {"ok"}, len(shapes) * 2)]
            assert not engine.kernels_proving and engine.kernel_wiring.enabled
            assert planned() == ("mtp", "spec_on")
            kernel.rows.clear()
            assert_same_greedy(await serve(engine, prompt), want, margins)
            assert set(kernel.rows) == {3} and "mlx_mtp-m" in kernel.threads  # the verify, through it
        finally:
            kernel.release.set()
            await engine.stop()

    asyncio.run(run())

    # A later process on this machine: the verdicts are recorded, wired at load.
    again = counting_guard(tmp_path, Counting())
    engine = mtp_engine(q4, settings=MTPSettings(depth=2), kernel_guard=again)
    assert not engine.kernels_proving and engine.target.kernels and engine.kernel_wiring.enabled
    assert settled(engine)  # its widths warmed in the background, with no proof
    assert again.checks_run == 0


def test_background_proofs_take_turns_with_the_model_s_rounds(q4, tmp_path):
    """A proof waits for the round (or step) holding the model's lock before
    it starts: MLX builds one kernel at a time, and proofs back to back held
    off a first round's own builds (91 s on an H100). The lock is not kept
    through a proof, so a slow one never stops serving (the test above)."""
    kernel = Gated()
    guard = counting_guard(tmp_path, kernel)
    engine = mtp_engine(q4, settings=MTPSettings(depth=2), kernel_guard=guard)
    try:
        assert kernel.entered.wait(60)  # its first proof under way
        with q4.lock:  # a round in progress
            started = guard.checks_run
            kernel.release.set()  # that proof ends; the next waits for the round
            time.sleep(0.5)
            assert guard.checks_run == started and engine.kernels_proving
        assert settled(engine) and engine.target.kernels
        assert guard.checks_run > started
    finally:
        kernel.release.set()
        engine.kernel_switch.stop(30)


class Slow(Counting):
    """Failure injection: every call of a correct kernel takes `seconds`
    longer (a fresh GPU's builds do), and the thread that made it is noted."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.threads: list[str] = []
        self.proved_by: list[str] = []  # the thread of each call from a proof (2-D x; a forward's is 3-D)

    def __call__(self, x, *args):
        self.threads.append(threading.current_thread().name)
        if x.ndim == 2:
            self.proved_by.append(self.threads[-1])
        time.sleep(self.seconds)
        return super().__call__(x, *args)


def test_a_speculative_engine_s_widths_are_proved_before_the_plain_engine_s_batches(q4, tmp_path):
    """The plain engine proves every width 1..16 for its batches (225 s on a
    fresh H100); a speculative engine loaded after it started still gets its
    lone verify widths proved first (its first speculative token waits for
    them): the plain engine yields the model's proving lock between two
    verdicts (LoadedModel.urgent_proofs), then goes on."""
    kernel = Slow(0.003)
    guard = counting_guard(tmp_path, kernel)
    plain = MLXPlainEngine("m", q4, max_context=4096, kernel_guard=guard)
    deadline = time.monotonic() + 60
    while "kernel-proofs m mlx_plain" not in kernel.threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "kernel-proofs m mlx_plain" in kernel.threads  # its proofs under way
    engine = mtp_engine(q4, settings=MTPSettings(depth=2), kernel_guard=guard)
    assert engine.kernels_proving
    assert engine.kernels_ready(120) and engine.target.kernels
    # Its lone widths proved by itself, before the plain engine's last proof.
    spec, plain_thread = "kernel-proofs m mlx_mtp", "kernel-proofs m mlx_plain"
    assert spec in kernel.proved_by
    assert plain.kernels_ready(300) and plain.batch_kernels.on
    assert settled(engine)
    order = kernel.proved_by
    assert order.index(spec) < len(order) - 1 - order[::-1].index(plain_thread)


def test_a_proof_stopped_before_its_probes_runs_none(q4, tmp_path):
    """A `prove` whose stop is set (the plain engine yielding to a
    speculative engine's proofs) returns before `_usable`'s probes: a probe
    builds our kernel in this process. On a fresh H100 the plain engine's
    probes ran after its cancelled builds, 16 s of in-process builds
    holding the proving lock, and the guard's, while the speculative
    engine's urgent proofs waited."""
    kernel = Counting()
    guard = counting_guard(tmp_path, kernel)
    stop = threading.Event()
    stop.set()
    assert not wiring.prove(q4.model, "auto", range(2, 4), guard=guard, stop=stop)
    assert kernel.rows == [] and guard.verdicts() == {}
    # Not stopped, the same call probes and proves.
    assert wiring.prove(q4.model, "auto", range(2, 4), guard=guard)
    assert kernel.rows and guard.verdicts()


class Weights(Counting):
    """A correct kernel noting each call's rows and weight (by id)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, int]] = []

    def __call__(self, x, wq, s, b, gs, bits):
        self.calls.append((x.size // x.shape[-1], id(wq)))
        return super().__call__(x, wq, s, b, gs, bits)


def test_a_quantized_mtp_head_is_wired_with_the_trunk(q4, tmp_path):
    """The MTP head's forward of the last round's pairs (several rows) goes
    through the verify kernels too (Drafting.kernel_module), proved with the
    trunk before the switch; greedy output is still plain greedy."""
    import mlx.nn as nn

    def quantized_head(loaded, target, drafter=None, settings=None):
        drafting = mtp.drafting(loaded, target, drafter, settings)
        nn.quantize(drafting.weights, group_size=64, bits=4)
        return drafting

    kernel = Weights()
    guard = counting_guard(tmp_path, kernel)
    engine = SpecEngine("m", q4, name="mlx_mtp", drafting=quantized_head, max_context=4096,
                        settings=MTPSettings(depth=3), kernel_guard=guard)  # fmt: skip
    assert settled(engine) and engine.target.kernels
    head = engine.drafting.weights
    hooked = [m for _, m in head.named_modules() if type(m) is hook._KernelQuantizedLinear]
    assert hooked and all(m.__dict__["_specgate_guard"] is guard for m in hooked)
    checks = guard.checks_run
    prompt = prompts(q4.vocab_size)[0]
    want, margins = greedy_reference(q4.model, prompt, N_TOKENS)
    kernel.calls.clear()
    got, accepted = decode(engine, prompt, 3, InjectedDrafts, reference=want, rng=random.Random(1))
    assert_same_greedy(got, want, margins)
    weights = {id(m["weight"]) for m in hooked}
    head_rows = {m for m, w in kernel.calls if w in weights}
    assert accepted > 0 and head_rows and head_rows <= {2, 3, 4}  # the pairs: accepted + 1 rows
    assert guard.checks_run == checks  # the head's shapes were proved before the switch
