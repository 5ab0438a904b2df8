"""Tiny reasoning checkpoints in Qwen3.x's thinking format, for tests/test_thinking.py.

Both have `<think>` and `</think>` as added tokens (builders/tokenizer.py)
and a chat template of our own in Qwen3.5's thinking layout: the generation
prompt opens `<think>\\n` (or, with `enable_thinking` false, writes an
empty `<think>\\n\\n</think>\\n\\n`), and an assistant turn after the last
user message shows its `reasoning_content` again (earlier turns' is left out).

- `build_thinker`: a Qwen3 lookup model (tests/tool_caller.py) whose greedy
  output thinks THOUGHT, closes with `</think>`, and answers ANSWER; with
  thinking switched off its prompt already ends after `</think>\\n\\n`, and
  it answers ANSWER at once; with a budget, `</think>` forced early, it
  still answers ANSWER (the lookup reads only the last few tokens).
- `build_thinking_mtp`: a random Qwen3.5 hybrid with an MTP head that
  drafts the trunk's own next token, for speculation's exactness.
"""

from __future__ import annotations

import json
from pathlib import Path

from tool_caller import XML_TEMPLATE, build_tool_caller

from specgate.builders.tiny import build_qwen35_hybrid
from specgate.builders.tokenizer import build_tokenizer

THOUGHT = "Two and two make four."
ANSWER = "The answer is 4."

_LAST_USER = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
)
THINKING_TEMPLATE = _LAST_USER + XML_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' + (m.content or '') -}}",
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user and m.reasoning_content -%}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- m.content or '' -}}",
).replace(
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}",
)
assert "enable_thinking" in THINKING_TEMPLATE and "reasoning_content" in THINKING_TEMPLATE


def build_thinker(dest: Path) -> Path:
    return build_tool_caller(dest, THINKING_TEMPLATE, f"{THOUGHT}\n</think>\n\n{ANSWER}",
                             thinking=True, tail="<|im_end|>\n<|im_start|>assistant\n<think>\n")  # fmt: skip


def build_thinking_mtp(dest: Path) -> Path:
    dest = build_qwen35_hybrid(dest, seed=1, aligned_mtp=True)
    build_tokenizer(dest, vocab_size=2048, thinking=True)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return dest
