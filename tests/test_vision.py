"""Images in a prompt (engines/vision/): a tiny Qwen3.5-VL checkpoint in the
published layout, decoded by specgate's engines and held against mlx-vlm's
own generate on the same files, the prefix cache keyed by the image."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from specgate.engines.base import (
    GenerationRequest,
    ImageInput,
    Plan,
    RoundStats,
    SamplingParams,
    TokenEvent,
)

N = 14
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    from specgate.builders.vision import build_qwen35_vl

    return build_qwen35_vl(tmp_path_factory.mktemp("vlm") / "qwen35-vl", seed=0)


@pytest.fixture(scope="module")
def loaded(vlm):
    from specgate.engines.base import CacheSettings
    from specgate.engines.loading import load_mlx_model

    return load_mlx_model(str(vlm), CacheSettings(disk_bytes=0))


def picture(seed: int, shape=(64, 96)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (*shape, 3), dtype=np.uint8)


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"},
                                         {"type": "text", "text": text}]}]  # fmt: skip


def prompt_of(loaded, pictures: list[np.ndarray], text: str, rid: str, plan: str = "mlx_plain",
              depth: int = 0) -> GenerationRequest:  # fmt: skip
    vision = loaded.vision
    rendered = loaded.tokenizer.apply_chat_template(messages(text), add_generation_prompt=True,
                                                    tokenize=False)  # fmt: skip
    ids = loaded.tokenizer.encode(rendered, add_special_tokens=False)
    prepared = [vision.preprocess(p) for p in pictures]
    tokens, starts = vision.expand(ids, [n for _, _, n in prepared])
    images = tuple(ImageInput(s, grid, n, pixels, hashlib.sha256(p.tobytes()).hexdigest())
                   for s, (pixels, grid, n), p in zip(starts, prepared, pictures, strict=True))  # fmt: skip
    method = {"mlx_plain": "plain", "mlx_ngram": "ngram"}.get(plan, "mtp")
    return GenerationRequest(rid, "vlm", tokens, GREEDY, N, Plan(plan, method, depth, "test"),
                             cache_scope="k", images=images)  # fmt: skip


def reference(vlm: Path, pictures: list[np.ndarray], text: str) -> list[int]:
    """mlx-vlm's own greedy generate on the same checkpoint and prompt."""
    from mlx_vlm import generate
    from mlx_vlm.utils import load
    from PIL import Image

    model, processor = load(str(vlm))
    rendered = processor.tokenizer.apply_chat_template(messages(text), add_generation_prompt=True,
                                                       tokenize=False)  # fmt: skip
    out = generate(model, processor, rendered, image=[Image.fromarray(p) for p in pictures],
                   max_tokens=N, temperature=0.0, verbose=False)  # fmt: skip
    return list(out.token_ids)


async def collect(engine, request) -> tuple[list[int], int, list]:
    from specgate.policies.decide import FixedPlanner

    tokens, cached, rounds = [], 0, []
    planner = [] if request.plan.engine == "mlx_plain" else [FixedPlanner(request.plan)]
    async for event in engine.generate(request, *planner):
        if isinstance(event, TokenEvent):
            tokens += event.token_ids
            cached = event.cached_tokens or cached
        elif isinstance(event, RoundStats):
            rounds.append(event)
    return tokens, cached, rounds


def engine_of(loaded, name: str):
    from specgate.engines import registry

    ctx = registry.BuildContext(name, loaded.path, registry.MLX, engines=(name,), loaded=loaded)
    built, refused = registry.record(name).build(ctx, (name,))
    assert not refused, refused
    return built[name]


def run(engine, *requests, together: bool = False):
    async def main():
        await engine.start()
        try:
            if together:
                return await asyncio.gather(*(collect(engine, r) for r in requests))
            return [await collect(engine, r) for r in requests]
        finally:
            await engine.stop()

    return asyncio.run(asyncio.wait_for(main(), 300))


def test_the_checkpoint_is_qwen35_vl_s_published_layout(vlm, loaded):
    config = json.loads((vlm / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert {"image_token_id", "vision_start_token_id", "vision_end_token_id"} <= set(config)
    assert config["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    from safetensors import safe_open

    with safe_open(str(vlm / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert f.get_tensor("model.visual.patch_embed.proj.weight").ndim == 5  # NCDHW, as saved
    assert any(n.startswith("model.visual.blocks.") for n in names)
    assert any(n.startswith("mtp.") for n in names)
    assert loaded.vision is not None and loaded.images_refused is None


def logits_gap(path: Path, loaded, a: np.ndarray) -> float:
    """Checks that our prompt tokens are mlx-vlm's processor's, then
    returns how far the logits of the text after the image (fed as plain
    text after specgate's image segment) are from mlx-vlm's whole-prompt
    forward on the same checkpoint."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load
    from PIL import Image

    request = prompt_of(loaded, [a], "What is in the picture?", "l")
    model, processor = load(str(path))
    rendered = processor.tokenizer.apply_chat_template(messages("What is in the picture?"),
                                                       add_generation_prompt=True, tokenize=False)  # fmt: skip
    inputs = processor(text=[rendered], images=[Image.fromarray(a)], return_tensors="np")
    assert [int(t) for t in inputs["input_ids"][0]] == request.prompt_tokens
    extra = {k: mx.array(v) for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    want = model(mx.array(inputs["input_ids"]), **extra)
    want = getattr(want, "logits", want)
    inner = loaded.model.language_model.model
    cache = make_prompt_cache(loaded.model)
    end = request.images_end
    loaded.vision.prefill(lambda t, e: inner(t, cache=cache, input_embeddings=e), cache,
                          inner.embed_tokens, request.prompt_tokens, 0, end, request.images)  # fmt: skip
    got = loaded.model(mx.array([request.prompt_tokens[end:]]), cache=cache)
    return mx.abs(got[0] - want[0, end:]).max().item()


def test_the_tower_s_weights_are_reported_with_the_model_s(vlm, loaded):
    """The memory budget's measure after a load (engines' `memory()`)
    counts the tower, as its estimate before (the checkpoint's bytes) does."""
    from specgate.engines.checkpoints.inspect import inspect_checkpoint
    from specgate.engines.memory import parameter_bytes

    tower = parameter_bytes(loaded.vision.tower)
    assert tower > 0
    held = {h.holder: h.nbytes for h in engine_of(loaded, "mlx_plain").memory() if h.kind == "weights"}
    assert sum(held.values()) == parameter_bytes(loaded.model) + tower
    assert inspect_checkpoint(str(vlm)).memory.weights_bytes >= sum(held.values())


def test_logits_after_an_image_equal_mlx_vlm_s_forward(vlm, loaded):
    """Positions on the image's grid, and the cached keys realigned after
    it (either one wrong moves the logits by ~0.4)."""
    assert logits_gap(vlm, loaded, picture(7)) < 1e-3


def test_an_image_prompt_decodes_as_mlx_vlm_s_own_generate(vlm, loaded):
    """Plain decoding (alone, then two in a batch) and MTP speculation after
    the image tokens give mlx-vlm's greedy tokens; another image, others."""
    a, b = picture(0), picture(1, (96, 64))
    want_a, want_b = reference(vlm, [a], "What is it?"), reference(vlm, [b], "What is it?")
    assert want_a != want_b  # the image reaches the text model
    plain = engine_of(loaded, "mlx_plain")
    (alone, _, _), = run(plain, prompt_of(loaded, [a], "What is it?", "a"))
    assert alone == want_a
    both = run(plain, prompt_of(loaded, [a], "What is it?", "a2"),
               prompt_of(loaded, [b], "What is it?", "b2"), together=True)  # fmt: skip
    assert [t for t, _, _ in both] == [want_a, want_b]
    mtp = engine_of(loaded, "mlx_mtp")
    (spec, _, rounds), = run(mtp, prompt_of(loaded, [a], "What is it?", "m", "mlx_mtp", 3))
    assert spec == want_a
    assert sum(r.drafted for r in rounds) > 0  # it did speculate after the image


def test_two_images_in_one_prompt(vlm, loaded):
    a, b = picture(2), picture(3, (48, 80))
    messages_two = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                 {"type": "image"}, {"type": "text", "text": "And these?"}]}]  # fmt: skip
    rendered = loaded.tokenizer.apply_chat_template(messages_two, add_generation_prompt=True,
                                                    tokenize=False)  # fmt: skip
    from mlx_vlm import generate
    from mlx_vlm.utils import load
    from PIL import Image

    model, processor = load(str(vlm))
    want = list(generate(model, processor, rendered, image=[Image.fromarray(a), Image.fromarray(b)],
                         max_tokens=N, temperature=0.0, verbose=False).token_ids)  # fmt: skip
    vision = loaded.vision
    ids = loaded.tokenizer.encode(rendered, add_special_tokens=False)
    prepared = [vision.preprocess(p) for p in (a, b)]
    tokens, starts = vision.expand(ids, [n for _, _, n in prepared])
    images = tuple(ImageInput(s, g, n, px, hashlib.sha256(bytes([i])).hexdigest())
                   for i, (s, (px, g, n)) in enumerate(zip(starts, prepared, strict=True)))  # fmt: skip
    request = GenerationRequest("two", "vlm", tokens, GREEDY, N, Plan("mlx_mtp", "mtp", 2, "test"),
                                images=images)  # fmt: skip
    (got, _, _), = run(engine_of(loaded, "mlx_mtp"), request)
    assert got == want


@pytest.mark.parametrize("name", ["mlx_plain", "mlx_mtp"])
def test_the_prefix_cache_keys_an_image_by_its_content(vlm, loaded, name):
    """The same image again resumes past it (cached tokens reported); a
    different image in the same place does not, and decodes its own way."""
    a, b = picture(4), picture(5)
    depth = 0 if name == "mlx_plain" else 2
    first = prompt_of(loaded, [a], f"Describe it ({name}).", "1", name, depth)
    again = prompt_of(loaded, [a], f"Describe it ({name}).", "2", name, depth)
    other = prompt_of(loaded, [b], f"Describe it ({name}).", "3", name, depth)
    engine = engine_of(loaded, name)
    (t1, c1, _), (t2, c2, _), (t3, c3, _) = run(engine, first, again, other)
    image = first.images[0]
    assert c1 == 0
    assert c2 > image.end and t2 == t1
    assert c3 <= image.start
    assert t3 == reference(vlm, [b], f"Describe it ({name}).")


def test_a_prompt_ending_in_an_image_is_refused_alone(loaded):
    """Nothing after the image to decode from: the request fails with a
    clear error and the engine serves the next one."""
    from specgate.engines.base import EngineError

    good = prompt_of(loaded, [picture(6)], "Next?", "ok")
    image = good.images[0]
    bad = GenerationRequest("bad", "vlm", good.prompt_tokens[: image.end], GREEDY, 4,
                            good.plan, images=good.images)  # fmt: skip
    engine = engine_of(loaded, "mlx_plain")

    async def main():
        await engine.start()
        try:
            with pytest.raises(EngineError, match="ends with an image"):
                await collect(engine, bad)
            return await collect(engine, good)
        finally:
            await engine.stop()

    tokens, _, _ = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(tokens) == N


def test_a_model_without_an_image_side_refuses_images_by_name(vlm, loaded, tmp_path):
    """A VLM checkpoint saved without its tower's tensors: the model serves
    text, and an image request fails saying why."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from specgate.engines.base import CacheSettings, EngineError
    from specgate.engines.loading import load_mlx_model

    towerless = tmp_path / "towerless"
    shutil.copytree(vlm, towerless)
    weights = load_file(str(vlm / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("model.visual.")},
              str(towerless / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    (towerless / "model.safetensors.index.json").unlink(missing_ok=True)
    text_only = load_mlx_model(str(towerless), CacheSettings(disk_bytes=0))
    assert text_only.vision is None and "no vision tower tensors" in text_only.images_refused
    request = prompt_of(loaded, [picture(8)], "Hm?", "q")
    engine = engine_of(text_only, "mlx_plain")

    async def main():
        await engine.start()
        try:
            with pytest.raises(EngineError, match="takes no images.*no vision tower"):
                await collect(engine, request)
            text = GenerationRequest("t", "vlm", request.prompt_tokens[request.images_end :],
                                     GREEDY, 4, request.plan)  # fmt: skip
            return await collect(engine, text)
        finally:
            await engine.stop()

    tokens, _, _ = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(tokens) == 4


@pytest.mark.parametrize("bits", [8, 4])
def test_qwen35_takes_images_with_a_quantized_kv_cache(vlm, bits):
    """After an image its cached keys are realigned (vision/mrope.py), packed
    ones through a dequantize and a quantize; plain decoding and MTP give
    the same tokens with the same cache, and another image others."""
    from specgate.engines.base import CacheSettings
    from specgate.engines.loading import load_mlx_model

    loaded = load_mlx_model(str(vlm), CacheSettings(disk_bytes=0), kv_bits=bits)
    assert loaded.vision is not None, loaded.images_refused
    if bits == 8:  # near mlx-vlm's unquantized logits: 0.010 realigned, 0.46 without
        assert logits_gap(vlm, loaded, picture(7)) < 0.05
    a, b = picture(0), picture(1, (96, 64))
    (plain, _, _), (other, _, _) = run(engine_of(loaded, "mlx_plain"),
                                       prompt_of(loaded, [a], "What is it?", "p"),
                                       prompt_of(loaded, [b], "What is it?", "o"))  # fmt: skip
    assert len(plain) == N and other != plain
    (spec, _, rounds), = run(engine_of(loaded, "mlx_mtp"),
                             prompt_of(loaded, [a], "What is it?", "m", "mlx_mtp", 3))  # fmt: skip
    assert spec == plain and sum(r.drafted for r in rounds) > 0


# -- Gemma-4 ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from specgate.builders.drafters import build_gemma4_assistant
    from specgate.builders.vision import build_gemma4_vl
    from specgate.engines.base import CacheSettings
    from specgate.engines.loading import load_mlx_model

    root = tmp_path_factory.mktemp("gemma4-vl")
    path = build_gemma4_vl(root / "gemma4-vl", seed=0)
    drafter = build_gemma4_assistant(root / "assistant", target=path, tokenizer=False)
    return path, drafter, load_mlx_model(str(path), CacheSettings(disk_bytes=0))


def gemma_request(loaded, pictures, text, rid, engine="mlx_plain", method="plain", depth=0):
    request = prompt_of(loaded, pictures, text, rid)
    return GenerationRequest(rid, "g", request.prompt_tokens, GREEDY, N, Plan(engine, method, depth, "test"),
                             cache_scope="k", images=request.images)  # fmt: skip


def test_gemma4_s_logits_after_an_image_equal_mlx_vlm_s_forward(gemma):
    """Gemma-4's image tokens attend to each other both ways (as released:
    without that the logits move by ~2.5), its tower's output goes in
    unscaled, and <boi>/<eoi> frame the soft tokens as its processor does."""
    path, _, loaded = gemma
    assert logits_gap(path, loaded, picture(7)) < 1e-3


def test_gemma4_decodes_after_an_image_as_mlx_vlm_plain_assistant_and_ngram(gemma):
    """Plain decoding (alone and in a batch), the -assistant drafter and
    n-gram drafting after the image tokens give mlx-vlm's greedy tokens."""
    from specgate.engines import registry

    path, drafter, loaded = gemma
    a, b = picture(0), picture(1, (96, 64))
    want_a, want_b = reference(path, [a], "What is it?"), reference(path, [b], "What is it?")
    assert want_a != want_b
    plain = engine_of(loaded, "mlx_plain")
    (alone, _, _), = run(plain, gemma_request(loaded, [a], "What is it?", "a"))
    assert alone == want_a
    both = run(plain, gemma_request(loaded, [a], "What is it?", "a2"),
               gemma_request(loaded, [b], "What is it?", "b2"), together=True)  # fmt: skip
    assert [t for t, _, _ in both] == [want_a, want_b]
    ctx = registry.BuildContext("mlx_assistant", loaded.path, registry.MLX, engines=("mlx_assistant",),
                                drafter=str(drafter), loaded=loaded)  # fmt: skip
    built, refused = registry.record("mlx_assistant").build(ctx, ("mlx_assistant",))
    assert not refused, refused
    (spec, _, rounds), = run(built["mlx_assistant"],
                             gemma_request(loaded, [b], "What is it?", "s", "mlx_assistant",
                                           "gemma4_assistant", 3))  # fmt: skip
    assert spec == want_b and sum(r.drafted for r in rounds) > 0
    (copied, _, _), = run(engine_of(loaded, "mlx_ngram"),
                          gemma_request(loaded, [a], "What is it?", "n", "mlx_ngram", "ngram", 3))  # fmt: skip
    assert copied == want_a


def test_gemma4_s_prefix_cache_keys_the_image_and_prepare_matches_its_processor(gemma):
    """The gateway's path (engines/vision/images.prepare: header size, token
    count, decode, expand) gives the tokens mlx-vlm's processor gives; the
    same image again resumes past it, another does not."""
    import io

    from mlx_vlm.utils import load
    from PIL import Image

    from specgate.engines.vision.images import prepare

    path, _, loaded = gemma
    a = picture(11, (80, 50))
    png = io.BytesIO()
    Image.fromarray(a).save(png, "PNG")
    rendered = loaded.tokenizer.apply_chat_template(messages("Hm?"), add_generation_prompt=True,
                                                    tokenize=False)  # fmt: skip
    ids = loaded.tokenizer.encode(rendered, add_special_tokens=False)
    tokens, images = prepare(loaded.vision, ids, [png.getvalue()], room=1000)
    _, processor = load(str(path))
    inputs = processor(text=[rendered], images=[Image.fromarray(a)], return_tensors="np")
    assert tokens == [int(t) for t in inputs["input_ids"][0]]
    assert images[0].length == loaded.vision.tokens_for(80, 50)
    first = gemma_request(loaded, [a], "Hm?", "1")
    again = gemma_request(loaded, [a], "Hm?", "2")
    other = gemma_request(loaded, [picture(12, (80, 50))], "Hm?", "3")
    engine = engine_of(loaded, "mlx_plain")
    (t1, c1, _), (t2, c2, _), (_, c3, _) = run(engine, first, again, other)
    assert c1 == 0 and c2 > first.images[0].end and t2 == t1
    assert c3 <= first.images[0].start


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_a_checkpoint_saved_by_mlx_vlm_s_convert_decodes_as_mlx_vlm_does(family, request, tmp_path):
    """What mlx-community publishes: mlx-vlm's `convert` at 4 bits renames
    the tensors (`language_model.model.*`, `vision_tower.*`, a Conv3d kept
    channels-last) and drops Qwen's MTP head. Text and tower load from it,
    and plain and n-gram decoding give mlx-vlm's greedy tokens on it."""
    from mlx_vlm.convert import convert

    from specgate.engines.base import CacheSettings
    from specgate.engines.loading import load_mlx_model

    published = request.getfixturevalue("vlm") if family == "qwen3_5" else request.getfixturevalue("gemma")[0]
    converted = tmp_path / f"{family}-4bit"
    convert(str(published), str(converted), quantize=True, q_group_size=32, q_bits=4)
    assert json.loads((converted / "config.json").read_text())["quantization"]["bits"] == 4
    loaded = load_mlx_model(str(converted), CacheSettings(disk_bytes=0))
    assert loaded.vision is not None, loaded.images_refused
    a = picture(0)
    want = reference(converted, [a], "What is it?")
    (plain, _, _), = run(engine_of(loaded, "mlx_plain"), prompt_of(loaded, [a], "What is it?", "c"))
    assert plain == want
    ngram = prompt_of(loaded, [a], "What is it?", "n", "mlx_ngram", 3)
    assert run(engine_of(loaded, "mlx_ngram"), ngram)[0][0] == want


@pytest.mark.parametrize("bits", [8, 4])
def test_gemma4_takes_images_with_a_quantized_kv_cache(gemma, bits):
    """Gemma-4 needs no key realignment after an image: its image prefill
    writes the quantized cache as a text prefill does, and the -assistant
    drafter and n-gram after the image give plain decoding's tokens with
    the same cache."""
    from specgate.engines import registry
    from specgate.engines.base import CacheSettings
    from specgate.engines.loading import load_mlx_model

    path, drafter, _ = gemma
    loaded = load_mlx_model(str(path), CacheSettings(disk_bytes=0), kv_bits=bits)
    assert loaded.vision is not None, loaded.images_refused
    a = picture(0)
    (plain, _, _), (other, _, _) = run(engine_of(loaded, "mlx_plain"),
                                       gemma_request(loaded, [a], "What is it?", "p"),
                                       gemma_request(loaded, [picture(1)], "What is it?", "o"))  # fmt: skip
    assert len(plain) == N and other != plain  # the image reaches the text model
    ctx = registry.BuildContext("mlx_assistant", loaded.path, registry.MLX, engines=("mlx_assistant",),
                                drafter=str(drafter), loaded=loaded)  # fmt: skip
    built, refused = registry.record("mlx_assistant").build(ctx, ("mlx_assistant",))
    assert not refused, refused
    (spec, _, rounds), = run(built["mlx_assistant"], gemma_request(
        loaded, [a], "What is it?", "s", "mlx_assistant", "gemma4_assistant", 3))  # fmt: skip
    assert spec == plain and sum(r.drafted for r in rounds) > 0
    (copied, _, _), = run(engine_of(loaded, "mlx_ngram"),
                          gemma_request(loaded, [a], "What is it?", "n", "mlx_ngram", "ngram", 3))  # fmt: skip
    assert copied == plain
