"""`kv_bits`: a model's KV cache quantized to 4 or 8 bits (engines/forwards/
quantized_kv.py), under every engine (issue 46).

At temperature 0 every speculative engine's output equals plain greedy
decoding's over the same quantized cache (mlx-lm's `generate_step` on the
model whose caches quantize: tests/exactness.py's references), with the
method's own drafts and with injected ones that force every accepted
length. The plain engine's continuous batching (mlx-lm's BatchGenerator
over `BatchQuantizedKV`) gives each sequence what it gives alone.
"""

from __future__ import annotations

import exactness
import pytest

# One family per engine (its first), one depth: the full sweeps run unquantized.
CASES = [(r.name, exactness.needs_of(r).greedy[0], bits)
         for r in exactness.speculative_records() for bits in (4, 8)]  # fmt: skip


@pytest.mark.parametrize("engine_name,family,bits", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_speculation_equals_plain_decoding_over_the_same_quantized_cache(engine_name, family, bits,
                                                                         tmp_path_factory):  # fmt: skip
    s = exactness.subject(tmp_path_factory.getbasetemp() / "exactness", engine_name, family,
                          kv_bits=bits)  # fmt: skip
    assert type(s.model.make_cache()[-1]).__name__ in ("QuantizedKVCache", "RotatingKVCache")
    # Its concurrent requests run one after another: the policy prices no batched round for it.
    assert not exactness.registry.batches(s.engine)
    if not family.startswith("gemma4"):  # (whose rotating windows never batch)
        root = tmp_path_factory.getbasetemp() / "exactness"
        assert exactness.registry.batches(exactness.subject(root, engine_name, family).engine)
    depth = s.depths[min(2, len(s.depths) - 1)]
    sweep = exactness.greedy_sweep(s, depth)
    assert set(range(depth + 1)) <= set(sweep.lengths), sweep.lengths


# -- the plain engine: continuous batching over BatchQuantizedKV, and alone ----------------


@pytest.fixture(scope="module")
def quantized(tiny_model):
    """The session's tiny hybrid (attention and recurrent layers), its KV at 4 bits."""
    from specgate.engines.base import CacheSettings
    from specgate.engines.loading import load_mlx_model

    return load_mlx_model(str(tiny_model), CacheSettings(disk_bytes=0), kv_bits=4)


def test_plain_batches_and_lone_steps_equal_generate_step_over_the_same_quantized_cache(
        quantized, tiny_model):  # fmt: skip
    import asyncio

    from greedy import assert_same_greedy, greedy_reference
    from test_plain_lone import collect, request

    from specgate.engines.base import CacheSettings
    from specgate.engines.loading import load_mlx_model
    from specgate.engines.mlx_plain.engine import MLXPlainEngine

    prompts = [[5, 17, 99, 3, 250, 41, 7, 7, 300, 12], [8, 1, 2], list(range(40, 70)), [9] * 5]
    lengths = [40, 12, 30, 20]  # they end apart: sequences leave the batch, the last goes alone

    async def main():
        engine = MLXPlainEngine("q", quantized, max_context=2048, prefix_cache_size=0)
        await engine.start()
        try:
            first = await collect(engine, request("first", prompts[0], 8))  # alone from the start
            # The first decodes alone a while, then goes back into the batch
            # with its cache when the others come (a merge with history).
            started = asyncio.Event()
            lead = asyncio.ensure_future(collect(engine, request("r0", prompts[0], lengths[0]),
                                                 started, after=6))  # fmt: skip
            await started.wait()
            rest = await asyncio.gather(*(collect(engine, request(f"r{i}", p, n))
                                          for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)) if i))  # fmt: skip
            return first[0], [(await lead)[0]] + [t for t, _ in rest], engine.lone_tokens
        finally:
            await engine.stop()

    first, together, lone = asyncio.run(asyncio.wait_for(main(), 300))
    assert lone >= 8 + 6
    assert type(quantized.model.make_cache()[3]).__name__ == "QuantizedKVCache"
    for prompt, n, got in zip(prompts, lengths, together, strict=True):
        want, margins = greedy_reference(quantized.model, prompt, n)
        assert_same_greedy(got, want, margins)
    assert first == together[0][:8]
    # The quantization is real: the same model unquantized decodes otherwise.
    plain = load_mlx_model(str(tiny_model), CacheSettings(disk_bytes=0))
    assert any(greedy_reference(plain.model, p, n)[0] != greedy_reference(quantized.model, p, n)[0]
               for p, n in zip(prompts, lengths, strict=True))  # fmt: skip


def test_a_batch_of_quantized_caches_merges_and_gives_each_back_unchanged():
    """Sequences of other lengths joined in one BatchQuantizedKV (each
    right-aligned behind its left padding) and taken out again: the same
    quantized rows, and the same attention output as alone."""
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import QuantizedKVCache

    from specgate.engines.forwards.quantized_kv import BatchQuantizedKV

    def filled(n: int, seed: int) -> QuantizedKVCache:
        c = QuantizedKVCache(32, 4)
        k, v = (mx.random.normal((1, 2, n, 32), key=mx.random.key(seed + i)) for i in (0, 1))
        c.update_and_fetch(k, v)
        return c

    caches = [filled(5, 0), filled(9, 10), filled(1, 20)]
    batch = BatchQuantizedKV.merge(caches)
    q = mx.random.normal((3, 2, 1, 32), key=mx.random.key(99))
    k_new, v_new = (mx.random.normal((3, 2, 1, 32), key=mx.random.key(s)) for s in (7, 8))
    mask = batch.make_mask(1, return_array=True)  # (as a model makes it: before the layers' writes)
    keys, values = batch.update_and_fetch(k_new, v_new)
    # (mlx-lm's quantized attention scales its queries in place: each call gets its own copy)
    together = scaled_dot_product_attention(q + 0, keys, values, cache=batch, scale=0.2, mask=mask)
    for i, c in enumerate(caches):
        back = batch.extract(i)
        assert back.offset == c.offset + 1
        for got, want in zip((*back.keys, *back.values), (*c.keys, *c.values), strict=True):
            assert mx.array_equal(got[..., : c.offset, :], want[..., : c.offset, :])
        ck, cv = c.update_and_fetch(k_new[i: i + 1], v_new[i: i + 1])
        alone = scaled_dot_product_attention(q[i: i + 1] + 0, ck, cv, cache=c, scale=0.2, mask=None)
        assert mx.allclose(together[i: i + 1], alone, atol=1e-5)


def test_the_budget_counts_the_smaller_cache_and_specgate_models_shows_it(tiny_model, tmp_path_factory,
                                                                        capsys):  # fmt: skip
    import httpx
    from conftest import start_gateway, stop_gateway

    from specgate.gateway.config import parse_config
    from specgate.gateway.operator.cli import main
    from specgate.gateway.serving.footprint import estimate

    def reserve(**fields) -> int:
        mc = parse_config({"models": [{"id": "m", "path": str(tiny_model), "max_context": 8192,
                                       "max_concurrent": 4, **fields}]}).models[0]  # fmt: skip
        return estimate(mc).kv_reserve

    full, eight, four = reserve(), reserve(kv_bits=8), reserve(kv_bits=4)
    assert four < eight < full * 0.7 and four < full * 0.45, (full, eight, four)
    work = tmp_path_factory.mktemp("kv-bits-gateway")
    models = [{"id": "kv4", "path": str(tiny_model), "kv_bits": 4, "max_context": 8192},
              {"id": "full", "path": str(tiny_model), "max_context": 8192}]  # fmt: skip
    config = {"models": models, "prefix_cache": {"disk_min_tokens": 16}}
    gw = start_gateway(config, work)
    try:
        body = httpx.get(gw.base_url + "/admin/models", timeout=60).json()
        memory = {m["id"]: m["memory"]["kv_reserve"] for m in body["models"]}
        assert memory["kv4"] < memory["full"] * 0.45
        assert main(["models", "--url", gw.base_url]) == 0
        out = capsys.readouterr().out
        assert "KV 4-bit" in out.splitlines()[1] + out.splitlines()[2]
        ask = {"model": "kv4", "prompt": "def handler(request):\n    body = request.json()\n" * 8,
               "max_tokens": 12, "temperature": 0}  # fmt: skip
        first = httpx.post(gw.api + "/completions", json=ask, timeout=120).json()
    finally:
        stop_gateway(gw)
    # A restart reads the quantized prompt's state back from the prefix cache's disk tier.
    gw = start_gateway(config, work)
    try:
        again = httpx.post(gw.api + "/completions", json=ask, timeout=120).json()
    finally:
        stop_gateway(gw)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]


def test_a_gguf_model_s_llama_server_keeps_its_cache_in_q8_0(smollm2_gguf, llama_server_binary,
                                                              tmp_path_factory):  # fmt: skip
    """llama.cpp engines take kv_bits as llama-server's cache block type."""
    from pathlib import Path

    import httpx
    from conftest import start_gateway, stop_gateway

    def descendants(root: int) -> list[list[str]]:
        """The command lines of `root`'s processes, children's children too
        (other tests' llama-servers may serve the same file meanwhile)."""
        parent, lines = {}, {}
        for proc in Path("/proc").iterdir():
            try:
                stat = (proc / "stat").read_text()
                parent[int(proc.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
                lines[int(proc.name)] = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except (OSError, ValueError):
                continue
        mine, grew = {root}, True
        while grew:
            found = {pid for pid, ppid in parent.items() if ppid in mine} - mine
            mine |= found
            grew = bool(found)
        return [lines[pid] for pid in mine if pid in lines]

    model = {"id": "smol", "path": str(smollm2_gguf), "engines": ["llamacpp"], "kv_bits": 8,
             "max_concurrent": 1, "max_context": 1024,
             "llamacpp": {"threads": 1, "extra_args": ["--no-repack"]}}  # fmt: skip
    gw = start_gateway({"llama_server": {"binary": str(llama_server_binary)}, "models": [model]},
                       tmp_path_factory.mktemp("kv-bits-llamacpp"))  # fmt: skip
    try:
        r = httpx.post(gw.api + "/completions", json={"model": "smol", "prompt": "The capital of France is",
                                                      "max_tokens": 8, "temperature": 0}, timeout=300)  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
        mine = [c for c in descendants(gw.process.pid) if c[0].endswith("llama-server")]
        assert mine and all(
            c[c.index("--cache-type-k") + 1] == "q8_0" and c[c.index("--cache-type-v") + 1] == "q8_0"
            for c in mine), mine  # fmt: skip
    finally:
        stop_gateway(gw)
