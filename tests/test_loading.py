"""Loading a model: once per path; what cannot load says why; the layouts
mlx-lm refuses as named but can read (a text-only save) are served."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import threading
import time
import weakref

import httpx
import openai
import pytest
from conftest import start_gateway, stop_gateway

from specgate.builders.tiny import build_qwen35_hybrid
from specgate.engines.loading import load_mlx_model
from specgate.engines.mlx_load import CheckpointLoadError


def test_weights_load_once_per_path(tiny_model):
    a = load_mlx_model(str(tiny_model))
    b = load_mlx_model(str(tiny_model) + "/")  # same directory, spelled differently
    assert a is b and a.model is b.model
    assert a.vocab_size == 2048


def test_a_load_keeps_mlx_compiled_kernels_in_the_home_unless_told_otherwise(tiny_model, tmp_path,
                                                                            monkeypatch):
    import mlx.core as mx

    from specgate.engines.mlx_load import load

    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    load(str(tiny_model))
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path / "home" / "mlx-ptx" / mx.__version__)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "mine"))
    load(str(tiny_model))
    assert os.environ["MLX_PTX_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_checkpoint_without_tokenizer_is_refused(tmp_path):
    # transformers would build an empty tokenizer from nothing: the model
    # would load as ready and every prompt would encode to no tokens.
    bare = build_qwen35_hybrid(tmp_path / "bare", tokenizer=False)
    with pytest.raises(CheckpointLoadError,
                       match=r"has no tokenizer \(tokenizer.json / tokenizer_config.json missing\)"):
        load_mlx_model(str(bare))


def test_a_hub_repo_not_downloaded_says_so_offline():
    # conftest sets HF_HUB_OFFLINE=1 (after huggingface_hub read it: the check reads it now).
    with pytest.raises(CheckpointLoadError) as err:
        load_mlx_model("specgate-tests/never-downloaded")
    message = str(err.value)
    assert "is not a local path and is not downloaded" in message
    assert "HF_HUB_OFFLINE is set" in message and "hf download specgate-tests/never-downloaded" in message


def test_the_registry_reports_why_a_model_failed(tmp_path):
    from specgate.gateway.config import parse_config
    from specgate.gateway.serving.models import ModelRegistry

    bare = build_qwen35_hybrid(tmp_path / "bare", tokenizer=False)
    registry = ModelRegistry(parse_config({"models": [
        {"id": "bare", "path": str(bare)}, {"id": "hub", "path": "specgate-tests/absent"}]}))

    async def start_and_stop():
        await registry.start()
        await registry.stop_all()

    asyncio.run(start_and_stop())
    assert "has no tokenizer" in registry.get("bare").error
    assert "is not downloaded" in registry.get("hub").error
    assert registry.get("bare").engine is None and not registry.ready


def test_ready_waits_for_every_boot_model(tiny_model):
    """Boot models load one after another; between one's end and the next
    one's start /ready once said ready (the later ones looked "unloaded", as
    a model loaded on first use does), and a full parallel test run caught a
    gateway answering 503 after its start-up check had seen 200."""
    from specgate.gateway.config import parse_config
    from specgate.gateway.serving.models import ModelRegistry

    registry = ModelRegistry(parse_config({"models": [
        {"id": f"m{i}", "path": str(tiny_model), "engines": ["mlx_plain"]} for i in range(3)]}))
    seen = []

    async def watch_while_booting():
        boot = asyncio.create_task(registry.start())
        while not boot.done():  # every turn of the event loop, as an HTTP /ready could
            seen.append((registry.ready, [m.state for m in registry.models.values()]))
            await asyncio.sleep(0)
        await boot
        seen.append((registry.ready, [m.state for m in registry.models.values()]))
        await registry.stop_all()

    asyncio.run(watch_while_booting())
    assert seen[-1] == (True, ["ready"] * 3)
    early = [states for ready, states in seen if ready and states != ["ready"] * 3]
    assert not early, early[:3]
    assert any(states[0] == "ready" and states[2] == "loading" for _, states in seen)


# ---------------------------------------------------------------- served


@pytest.fixture(scope="module")
def layouts(tiny_model, tmp_path_factory, request):
    """A gateway serving tiny_model as saved three more ways: from a hub cache
    (offline), as transformers saves the text model alone, and without a chat
    template."""
    root = tmp_path_factory.mktemp("layouts")
    flat = build_qwen35_hybrid(root / "flat", seed=0, text_only=True)  # tiny_model's weights
    bare_chat = root / "no-template"
    shutil.copytree(tiny_model, bare_chat)
    tcfg = json.loads((bare_chat / "tokenizer_config.json").read_text())
    del tcfg["chat_template"]
    (bare_chat / "tokenizer_config.json").write_text(json.dumps(tcfg))
    cache = root / "hub"
    snapshot = cache / "models--acme--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in tiny_model.iterdir():
        (snapshot / f.name).symlink_to(f)
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0" * 40)
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_CACHE", str(cache))  # the gateway process inherits it
    try:
        gw = start_gateway({"models": [
            {"id": "tiny", "path": str(tiny_model)}, {"id": "flat", "path": str(flat)},
            {"id": "hub", "path": "acme/tiny"}, {"id": "no-template", "path": str(bare_chat)},
            # The same directory with a template from the config (issue 42).
            {"id": "config-template", "path": str(bare_chat), "chat_template": CONFIG_TEMPLATE},
        ]}, root)
    finally:
        mp.undo()
    yield gw
    stop_gateway(gw)


def test_every_layout_serves_the_same_greedy_text(layouts):
    client = openai.OpenAI(base_url=layouts.api, api_key="unused", max_retries=0)
    texts = {m: client.completions.create(model=m, prompt="import os\n", max_tokens=16,
                                          temperature=0).choices[0].text
             for m in ("tiny", "flat", "hub", "no-template")}
    assert texts["tiny"] and set(texts.values()) == {texts["tiny"]}, texts


CONFIG_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_without_a_chat_template_is_a_clear_400(layouts):
    client = openai.OpenAI(base_url=layouts.api, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="no-template", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    body = err.value.body
    assert "no chat template" in body["message"] and "/v1/completions" in body["message"]
    assert body["param"] == "messages" and body["code"] == "chat_template_missing"
    assert "chat_template:" in body["message"]  # the fix, named
    # The config's template renders chats for the same checkpoint, and only for that model.
    reply = client.chat.completions.create(model="config-template", max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="no-template", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    # The same request to a model with a template works, and the server kept serving.
    assert client.chat.completions.create(model="tiny", max_tokens=4, messages=[
        {"role": "user", "content": "hi"}]).choices[0].message.content is not None
    assert httpx.get(layouts.base_url + "/ready").json()["status"] == "ready"
    assert "Traceback" not in layouts.log()


def collected(*refs: weakref.ref, within_s: float = 30.0) -> bool:
    """Whether every object goes once nothing holds it: collect until it is
    gone. One gc.collect() is not enough: while another thread's collection
    runs (it may be anywhere in its weakref callbacks), gc.collect() returns
    at once and collects nothing, and an object whose owner's weakref that
    collection has cleared stays until it finishes. A leak holds it for good."""
    deadline = time.monotonic() + within_s
    while True:
        gc.collect()
        if all(ref() is None for ref in refs):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def test_collected_waits_for_another_threads_collection():
    class Node:
        pass

    inside, release = threading.Event(), threading.Event()
    cache = Node()
    gc.disable()  # no automatic collection but the one below, in the other thread
    try:
        gc.collect()  # the cache survives into the oldest generation
        owner = Node()
        owner.me, owner.cache = owner, cache  # a cycle: only a collection frees it
        weakref.finalize(owner, lambda: (inside.set(), release.wait(10)))
        owner_ref, cache_ref = weakref.ref(owner), weakref.ref(cache)
        del owner, cache
        youngest = threading.Thread(target=gc.collect, args=(0,))
        youngest.start()
        assert inside.wait(10)
        # What the flaky run saw: the owner gone, what it held still there,
        # and a collection here doing nothing.
        assert gc.collect() == 0 and owner_ref() is None and cache_ref() is not None
        threading.Timer(0.1, release.set).start()
        assert collected(cache_ref)
        youngest.join(10)
    finally:
        release.set()
        gc.enable()


def test_an_unloaded_model_lets_its_weights_go_and_loads_again(tmp_path):
    """Eviction and idle unloads free memory only if nothing keeps the
    weights: not the per-path memo, not the prefix caches' RAM budget."""
    from specgate.engines import loading
    from specgate.gateway.config import parse_config
    from specgate.gateway.serving.models import ModelRegistry

    path = build_qwen35_hybrid(tmp_path / "m", seed=0)
    registry = ModelRegistry(parse_config({"models": [
        {"id": "m", "path": str(path), "engines": ["mlx_plain", "mlx_mtp"], "max_context": 512}]}))
    served = registry.get("m")

    async def cycle():
        await registry.ensure_loaded(served)
        loaded = weakref.ref(served.engine.loaded)
        cache = weakref.ref(served.engine.loaded.prefix_cache)
        assert served.memory()["weights"] > 0 and served.memory()["drafter"] > 0
        await registry.unload(served)
        assert collected(loaded, cache)  # (the RAM budget held the cache)
        assert str(path.resolve()) not in loading._loaded
        await registry.ensure_loaded(served)
        assert served.state == "ready" and served.counts.loads == 2
        assert served.counts.unloads == {"admin": 1}
        await registry.stop_all()

    asyncio.run(cycle())
