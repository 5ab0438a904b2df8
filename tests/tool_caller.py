"""A tiny Qwen3 checkpoint whose greedy answer is a chosen tool call.

Random tiny models never emit a well-formed tool call, so this one is built
by hand: one transformer layer whose weights make greedy decoding a
variable-order lookup, (the last w tokens) -> next token, for a chosen
token sequence. One token of context is not enough because tool-call text
repeats tokens (`>\n` after every tag) with different successors; each step
gets the shortest window of tokens that no other step shares.

- Embeddings are one-hot codes (dims A) plus a constant column C, scaled to
  RMS 1 so the input RMSNorm leaves them unchanged.
- Attention head group d (d = 1..K) attends to the token d positions back:
  queries and keys are constant (read from C), so after RoPE their product
  depends only on the distance t - s; the keys are rotated so that it peaks
  at distance d (with a small rope_theta the sum over frequencies leaves a
  wide margin). Values copy the code, o_proj writes it to dims B_d.
- The SwiGLU MLP has one unit per step, which fires only when every token
  of its window matches, and writes to its own dim R; lm_head reads R.

The chat template (our own, in Qwen3's hermes or Qwen3.5's XML tool-call
format) is written into tokenizer_config.json; the gateway reads the
format from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from specgate.builders._build import save_safetensors
from specgate.builders.tiny import build_qwen3_dense
from specgate.builders.tokenizer import IM_END, build_tokenizer, special_token_ids

VOCAB, HIDDEN, HEAD_DIM, UNITS = 2048, 640, 32, 128
ROPE_THETA = 10.0  # widely spaced RoPE frequencies: a sharp peak at the chosen distance
QK_NORM = 8.0  # the attention logits' margin for that distance is ~0.67 * QK_NORM**2
GATE, READOUT = 40.0, 3.0

_HEADER = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- 'Tools you may call, one JSON signature a line:\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\n' + HOWTO + '<|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (m.content or '') -}}"
    "{%- for call in m.tool_calls or [] -%}CALL{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif not (m.role == 'system' and loop.first) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

HERMES_TEMPLATE = _HEADER.replace(
    "HOWTO",
    "'To call a tool, answer with\\n<tool_call>\\n"
    '{"name": NAME, "arguments": {ARGUMENTS}}\\n</tool_call>\'',
).replace(
    "CALL",
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' '
    "+ (call.function.arguments | tojson) + '}\\n</tool_call>' -}}",
)

XML_TEMPLATE = _HEADER.replace(
    "HOWTO",
    "'To call a tool, answer with\\n<tool_call>\\n<function=NAME>\\n<parameter=NAME>\\n"
    "VALUE\\n</parameter>\\n</function>\\n</tool_call>'",
).replace(
    "CALL",
    "{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' -}}"
    "{%- for name, value in call.function.arguments | items -%}"
    "{{- '<parameter=' + name + '>\\n' + (value if value is string else (value | tojson)) "
    "+ '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\\n</tool_call>' -}}",
)


def windows(sequence: list[int], first: int) -> list[int]:
    """For each position k >= first, the fewest tokens before k that no other
    position with a different next token ends in."""
    out = []
    for k in range(first, len(sequence)):
        w = 1
        while w < k and any(
            j != k and sequence[j] != sequence[k] and sequence[j - w : j] == sequence[k - w : k]
            for j in range(w, len(sequence))
        ):
            w += 1
        out.append(w)
    return out


GENERATION_TAIL = "<|im_end|>\n<|im_start|>assistant\n"


def build_tool_caller(dest: Path, template: str, answer: str, *, thinking: bool = False,
                      tail: str = GENERATION_TAIL) -> Path:  # fmt: skip
    """A checkpoint at dest whose greedy reply to any chat is `answer`, then <|im_end|>.
    `thinking`: its tokenizer has `<think>` and `</think>`; `tail`: how every
    rendered chat ends (the template's generation prompt)."""
    from transformers import AutoTokenizer

    dest = Path(dest)
    build_qwen3_dense(
        dest, hidden_size=HIDDEN, num_hidden_layers=1, vocab_size=VOCAB,
        intermediate_size=UNITS, head_dim=HEAD_DIM,
    )  # fmt: skip
    if thinking:
        build_tokenizer(dest, vocab_size=VOCAB, thinking=True)
    config = json.loads((dest / "config.json").read_text())
    config["rope_theta"] = ROPE_THETA
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok_config = json.loads((dest / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")

    # Every chat ends in the same generation-prompt tail; the lookup starts from it.
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    tail = tok.encode(tail).ids
    hf = AutoTokenizer.from_pretrained(dest)
    prompt = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False
    )
    assert prompt[-len(tail) :] == tail, "the template's generation prompt changed"
    sequence = tail + tok.encode(answer).ids + [special_token_ids(VOCAB)[IM_END]]
    _write_lookup_weights(dest, sequence, len(tail))
    return dest


def _write_lookup_weights(dest: Path, sequence: list[int], first: int) -> None:
    steps = windows(sequence, first)
    assert all(w <= pos for pos, w in enumerate(steps, first)), "a window reaches past the tail"
    back = max(steps) - 1  # distances the attention must look back
    codes = {t: n for n, t in enumerate(dict.fromkeys(sequence[:-1]))}
    n_codes, per = len(codes), -(-len(codes) // HEAD_DIM)  # heads per distance
    heads = back * per
    c, other = (back + 1) * n_codes, (back + 1) * n_codes + 1
    r = other + 1
    assert r + len(steps) <= HIDDEN and len(steps) <= UNITS
    # The builder wrote a random model with these shapes; every tensor is replaced.
    config = json.loads((dest / "config.json").read_text())
    config.update(num_attention_heads=heads, num_key_value_heads=heads)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    s0 = np.sqrt(HIDDEN / 2)  # one-hot code + constant column at RMS 1
    emb = np.zeros((VOCAB, HIDDEN), np.float32)
    emb[:, c] = s0
    emb[:, other] = s0
    for token, n in codes.items():
        emb[token, other] = 0
        emb[token, n] = s0

    hd, half = HEAD_DIM, HEAD_DIM // 2
    theta = ROPE_THETA ** (-np.arange(half) * 2 / hd)
    zq = np.full(half, 1 + 1j)
    q = np.zeros((heads * hd, HIDDEN), np.float32)
    k = np.zeros((heads * hd, HIDDEN), np.float32)
    v = np.zeros((heads * hd, HIDDEN), np.float32)
    o = np.zeros((HIDDEN, heads * hd), np.float32)
    for d in range(1, back + 1):
        # Per RoPE pair, q = 1 + i and k = q e^{i d theta}: after rotation q.k is
        # 2 cos(theta (t - s - d)), largest at distance d.
        zk = zq * np.exp(1j * d * theta)
        for h in range((d - 1) * per, d * per):
            q[h * hd : (h + 1) * hd, c] = np.concatenate([zq.real, zq.imag])
            k[h * hd : (h + 1) * hd, c] = np.concatenate([zk.real, zk.imag])
        for n in range(n_codes):
            j = (d - 1) * per * hd + n  # this distance's heads, concatenated
            v[j, n] = 1.0
            o[d * n_codes + n, j] = 1.0

    kappa = np.sqrt(HIDDEN / (back + 2))  # a one-hot entry after the post-attention norm
    gate = np.zeros((UNITS, HIDDEN), np.float32)
    up = np.zeros((UNITS, HIDDEN), np.float32)
    down = np.zeros((HIDDEN, UNITS), np.float32)
    head = np.zeros((VOCAB, HIDDEN), np.float32)
    for unit, (pos, w) in enumerate(zip(range(first, len(sequence)), steps, strict=True)):
        for d in range(w):  # the token d back from the current one
            gate[unit, d * n_codes + codes[sequence[pos - 1 - d]]] = GATE / kappa
        gate[unit, c] = -(w - 0.5) * GATE / kappa  # fires only when all w match
        up[unit, c] = 1 / kappa
        down[r + unit, unit] = 1.0
        head[sequence[pos], r + unit] = READOUT

    p = "model.layers.0."
    ones = np.ones(HIDDEN, np.float32)
    tensors = {
        "model.embed_tokens.weight": emb,
        f"{p}input_layernorm.weight": ones,
        f"{p}post_attention_layernorm.weight": ones,
        f"{p}self_attn.q_proj.weight": q,
        f"{p}self_attn.k_proj.weight": k,
        f"{p}self_attn.v_proj.weight": v,
        f"{p}self_attn.o_proj.weight": o,
        f"{p}self_attn.q_norm.weight": np.full(hd, QK_NORM, np.float32),
        f"{p}self_attn.k_norm.weight": np.full(hd, QK_NORM, np.float32),
        f"{p}mlp.gate_proj.weight": gate,
        f"{p}mlp.up_proj.weight": up,
        f"{p}mlp.down_proj.weight": down,
        "model.norm.weight": ones,
        "lm_head.weight": head,
    }
    save_safetensors(dest, tensors, "float32")


def tiny_and_xml(tiny_model: Path, root: Path, max_context: int, max_body_bytes: int) -> dict:
    """A gateway config serving the tiny model as "tiny" and, as "xml", a
    tool caller in Qwen's XML format answering "ok" (forced tool calls need
    a template that takes tools)."""
    xml = build_tool_caller(root / "xml", XML_TEMPLATE, "ok")
    return {"server": {"max_body_bytes": f"{max_body_bytes}B"},
            "models": [{"id": "tiny", "path": str(tiny_model), "max_context": max_context},
                       {"id": "xml", "path": str(xml), "max_context": max_context}]}  # fmt: skip
