"""The demo model: the shipped one is verified and calls tools, and the trainer really trains."""

from __future__ import annotations

import json
import shutil

import anthropic
import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx.utils import tree_flatten

from specgate.builders.demo_training import TrainConfig, evaluate, load_demo, prepare, train
from specgate.builders.tokenizer import DEMO_CHAT_TEMPLATE
from specgate.engines.checkpoints.builtin import default_model_path, demo_dflash_path
from specgate.engines.checkpoints.inspect import inspect_checkpoint
from specgate.gateway.api.tools import ToolCall, split_output, tool_format


def test_shipped_demo_model_is_verified_and_small():
    path = default_model_path()
    assert inspect_checkpoint(str(path)).verdict == "verified"
    assert sum(f.stat().st_size for f in path.iterdir()) < 20 * 1024 * 1024


def _template(path) -> str:
    return json.loads((path / "tokenizer_config.json").read_text())["chat_template"]


TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "limit": {"type": "integer"},
        "mode": {"type": "string", "enum": ["text", "bytes"]}}, "required": ["mode"]}}}]  # fmt: skip


def test_shipped_demo_calls_tools_in_qwen35_xml():
    """The shipped model (and its drafter's copy of the tokenizer) carries
    the builder's template, which the gateway reads as Qwen3.5's XML calls;
    a call it writes back into an assistant turn parses to the same call."""
    from transformers import PreTrainedTokenizerFast

    assert _template(default_model_path()) == DEMO_CHAT_TEMPLATE
    assert _template(demo_dflash_path()) == DEMO_CHAT_TEMPLATE
    assert tool_format(DEMO_CHAT_TEMPLATE) == "qwen3_xml"

    tok = PreTrainedTokenizerFast(tokenizer_file=str(default_model_path() / "tokenizer.json"))
    tok.chat_template = DEMO_CHAT_TEMPLATE
    args = {"path": "a b.py", "limit": 3, "mode": "text"}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "read_file", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "1", "content": "AAA"},
        {"role": "tool", "tool_call_id": "2", "content": "BBB"},
    ]  # fmt: skip
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text  # the signature, as JSON
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert split_output(turn, "qwen3_xml", TOOLS) == ("", [ToolCall("read_file", args)])
    # Two results in a row: one user turn; then the model's turn.
    assert text.endswith("<|im_start|>user\n<tool_response>\nAAA\n</tool_response>\n"
                         "<tool_response>\nBBB\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")  # fmt: skip


# Only bounded parameters: in a free string the demo (a Python model) rambles.
BOUNDED = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {
        "mode": {"type": "string", "enum": ["text", "bytes"]}, "all": {"type": "boolean"}},
        "required": ["mode"], "additionalProperties": False}}}]  # fmt: skip


def test_demo_takes_tools_through_both_sdks(gateway):
    """Every coding agent sends tools: the demo takes them (a 400 before), and
    a forced call comes back in the SDKs' own types."""
    client = openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Read the file."}]
    free = client.chat.completions.create(model="demo", messages=ask, tools=BOUNDED, max_tokens=4)
    assert free.choices[0].finish_reason in ("length", "stop", "tool_calls")
    named = {"type": "function", "function": {"name": "read_file"}}
    forced = client.chat.completions.create(model="demo", messages=ask, tools=BOUNDED,
                                            tool_choice=named, max_tokens=200, temperature=0,
                                            parallel_tool_calls=False)  # fmt: skip
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert isinstance(call, openai.types.chat.ChatCompletionMessageToolCall)
    assert call.function.name == "read_file"
    assert json.loads(call.function.arguments)["mode"] in ("text", "bytes")

    claude = anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0)
    tools = [{"name": "read_file", "description": "Read a file.",
              "input_schema": BOUNDED[0]["function"]["parameters"]}]  # fmt: skip
    msg = claude.messages.create(model="demo", messages=ask, tools=tools, max_tokens=200,
                                 tool_choice={"type": "tool", "name": "read_file",
                                              "disable_parallel_tool_use": True},
                                 extra_body={"temperature": 0})  # fmt: skip
    assert msg.stop_reason == "tool_use"
    (use,) = msg.content
    assert isinstance(use, anthropic.types.ToolUseBlock) and use.name == "read_file"
    assert use.input["mode"] in ("text", "bytes")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("demo") / "work", "tiny", max_files=30, log=lambda _: None)


def fresh(work, dest):
    """A copy of the prepared work dir without any training state."""
    return shutil.copytree(work, dest, ignore=shutil.ignore_patterns("state"))


def _weights(path) -> dict[str, np.ndarray]:
    model = load_demo(path)
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_trainer_learns_and_resumes_exactly(work, tmp_path):
    cfg = TrainConfig(size="tiny", steps=24, batch_size=4, seq_len=48, warmup_steps=2,
                      learning_rate=3e-3, save_every=100)
    held = np.load(work / "corpus.npz")["heldout"][:3000]
    before = evaluate(load_demo(work / "init"), held)

    straight = train(fresh(work, tmp_path / "w1"), tmp_path / "straight", cfg, log=lambda _: None)
    after = evaluate(load_demo(straight), held)
    assert after.trunk_perplexity < 0.5 * before.trunk_perplexity, (before, after)

    # Interrupted at step 10 (state saved), then resumed by the same call.
    other = fresh(work, tmp_path / "w2")
    assert train(other, tmp_path / "cut", cfg, log=lambda _: None, stop_after=0.0) is None
    resumed = train(other, tmp_path / "resumed", cfg, log=lambda _: None)
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_exported_model_loads_in_mlx_lm_and_is_verified(work, tmp_path):
    from mlx_lm import load

    cfg = TrainConfig(size="tiny", steps=2, batch_size=2, seq_len=16, warmup_steps=1)
    out = train(fresh(work, tmp_path / "w"), tmp_path / "out", cfg, log=lambda _: None)
    assert _template(out) == DEMO_CHAT_TEMPLATE  # prepare gave it the tool template
    model, tokenizer = load(str(out))
    logits = model(mx.array([tokenizer.encode("def f(x):")]))
    assert bool(mx.isfinite(logits).all())
    report = inspect_checkpoint(str(out))
    assert report.verdict == "verified", report.to_dict()
