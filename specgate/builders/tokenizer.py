"""A small byte-level BPE tokenizer in Qwen's format, trained on local text.

Tiny test and demo checkpoints need a real tokenizer (chat template, special
tokens, streaming detokenization) without downloading one. We train a BPE on
Python standard-library sources, which every machine running specgate has.
"""

from __future__ import annotations

import functools
import json
import sysconfig
import tempfile
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Qwen's order; they take the last ids of the vocabulary, as in Qwen's own files.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# A reasoning model's thinking markers: added tokens, not special ones, as in
# Qwen3.x's files (so decoding keeps them in the text). Here just before the
# special tokens, which keep the last ids.
THINK_START, THINK_END = "<think>", "</think>"
THINKING_TOKENS = (THINK_START, THINK_END)
# A vision-language model's image markers, special tokens as in Qwen3.5's
# files (the processor repeats <|image_pad|> once per image token). Here just
# before the special tokens too, after the thinking markers.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# Qwen2/3/3.5's pre-tokenizer split (transformers' tokenization_qwen3_5.py).
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, as Qwen renders it. Content may be a string or OpenAI-style parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# The demo model's template: Qwen3.5's layout with tools, written here (not
# copied from a published file). Tools go into the system turn as one JSON
# signature a line inside <tools>; a call is Qwen3.5's XML, which
# gateway/api/tools.py reads as "qwen3_xml" (mlx-lm's qwen3_coder parser);
# tool results go back in a user turn, each inside <tool_response>, several
# in a row in one turn; an assistant turn's earlier calls are written back in
# the same XML. No <think> block: the demo model cannot think. Every tag is
# whitespace-trimmed on both sides, so the line breaks here are not output
# and Jinja2 (transformers) and llama-server's engine render alike.
_DEMO_TEMPLATE_LINES = (
    "{%- macro text(content) -%}",
    "{%- if content is string -%}{{- content -}}",
    "{%- elif content -%}{%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}",
    "{%- endif -%}",
    "{%- endmacro -%}",
    "{%- set system_first = messages and messages[0].role == 'system' -%}",
    "{%- if tools -%}",
    "{{- '<|im_start|>system\\n' -}}",
    "{%- if system_first -%}{{- text(messages[0].content) + '\\n\\n' -}}{%- endif -%}",
    "{{- '# Tools\\n\\nYou may call the functions below. Their signatures, one JSON object a line:\\n<tools>\\n' -}}",
    "{%- for tool in tools -%}{{- (tool | tojson) + '\\n' -}}{%- endfor -%}",
    "{{- '</tools>\\n\\nTo call one, answer with\\n<tool_call>\\n<function=FUNCTION_NAME>\\n"
    "<parameter=PARAMETER_NAME>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>\\n"
    "with one <parameter> block for each argument (objects and arrays as JSON) and one "
    "<tool_call> block for each call.<|im_end|>\\n' -}}",
    "{%- elif system_first -%}",
    "{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' -}}",
    "{%- endif -%}",
    "{%- for message in messages -%}",
    "{%- if message.role == 'tool' -%}",
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}",
    "{{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' -}}",
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}",
    "{%- elif message.role == 'assistant' -%}",
    "{%- set said = text(message.content) -%}",
    "{{- '<|im_start|>assistant\\n' + said -}}",
    "{%- for call in message.tool_calls or [] -%}",
    "{%- set call = call.function if call.function is defined else call -%}",
    "{%- if said or not loop.first -%}{{- '\\n' -}}{%- endif -%}",
    "{{- '<tool_call>\\n<function=' + call.name + '>\\n' -}}",
    "{%- if call.arguments is mapping -%}",
    "{%- for name, value in call.arguments | items -%}",
    "{{- '<parameter=' + name + '>\\n' + (value if value is string else (value | tojson)) + '\\n</parameter>\\n' -}}",
    "{%- endfor -%}",
    "{%- endif -%}",
    "{{- '</function>\\n</tool_call>' -}}",
    "{%- endfor -%}",
    "{{- '<|im_end|>\\n' -}}",
    "{%- elif not (message.role == 'system' and loop.first) -%}",
    "{{- '<|im_start|>' + message.role + '\\n' + text(message.content) + '<|im_end|>\\n' -}}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
)
DEMO_CHAT_TEMPLATE = "\n".join(_DEMO_TEMPLATE_LINES)

# A fixed selection, sorted, so the corpus (and so the vocabulary) depends only
# on the Python version. Modules a version lacks are skipped.
_CORPUS_MODULES = (
    "abc.py", "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py",
    "cmd.py", "codecs.py", "codeop.py", "collections/__init__.py", "colorsys.py",
    "compileall.py", "concurrent/futures/_base.py", "configparser.py",
    "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "datetime.py",
    "difflib.py", "dis.py", "email/message.py", "email/utils.py", "enum.py",
    "filecmp.py", "fileinput.py", "fnmatch.py", "fractions.py", "ftplib.py",
    "functools.py", "getopt.py", "gettext.py", "glob.py", "graphlib.py", "gzip.py",
    "hashlib.py", "heapq.py", "hmac.py", "html/parser.py", "http/client.py",
    "http/server.py", "inspect.py", "ipaddress.py", "json/decoder.py",
    "json/encoder.py", "keyword.py", "linecache.py", "locale.py",
    "logging/__init__.py", "lzma.py", "mimetypes.py", "numbers.py", "operator.py",
    "optparse.py", "os.py", "pathlib.py", "pickle.py", "pkgutil.py", "platform.py",
    "plistlib.py", "posixpath.py", "pprint.py", "queue.py", "quopri.py",
    "random.py", "reprlib.py", "sched.py", "secrets.py", "selectors.py", "shlex.py",
    "shutil.py", "socket.py", "socketserver.py", "statistics.py", "string.py",
    "struct.py", "subprocess.py", "tempfile.py", "textwrap.py", "threading.py",
    "timeit.py", "token.py", "tokenize.py", "trace.py", "traceback.py",
    "types.py", "typing.py", "unittest/case.py", "urllib/parse.py",
    "urllib/request.py", "uuid.py", "warnings.py", "weakref.py", "zipapp.py",
)  # fmt: skip
_CORPUS_MAX_BYTES = 3_000_000


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Ids of the special tokens in a tokenizer built with this vocab_size."""
    first = vocab_size - len(SPECIAL_TOKENS)
    return {token: first + i for i, token in enumerate(SPECIAL_TOKENS)}


def vision_token_ids(vocab_size: int) -> dict[str, int]:
    """Ids of the image markers in a tokenizer built with `vision=True`."""
    first = vocab_size - len(SPECIAL_TOKENS) - len(VISION_TOKENS)
    return {token: first + i for i, token in enumerate(VISION_TOKENS)}


def corpus_files() -> list[Path]:
    """The stdlib sources the tokenizer trains on, capped at ~3 MB in total."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for name in _CORPUS_MODULES:
        path = stdlib / name
        if not path.is_file():
            continue
        total += path.stat().st_size
        if total > _CORPUS_MAX_BYTES:
            break
        files.append(path)
    return files


@functools.cache
def _trained_json(vocab_size: int, thinking: bool = False, words: tuple[str, ...] = (),
                  vision: bool = False) -> str:  # fmt: skip
    """tokenizer.json text; cached because training dominates a tiny build.
    `words`: each learnt as one token of the vocabulary (trained on a
    corpus that repeats them), as a real vocabulary has common words."""
    added = THINKING_TOKENS if thinking else ()
    markers = VISION_TOKENS if vision else ()
    tok = Tokenizer(models.BPE())
    # Exactly the pipeline transformers' Qwen3_5Tokenizer builds: in a
    # qwen3_5 checkpoint AutoTokenizer always uses that class and keeps only
    # the vocabulary and merges from tokenizer.json, so anything else here
    # would make `tokenizers` and transformers disagree on ids. NFC means
    # decode(encode(s)) == NFC(s), as with Qwen's own tokenizer.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(added) - len(markers),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        files = [str(p) for p in corpus_files()]
        if words:
            extra = Path(tmp) / "words.txt"
            extra.write_text((" ".join(words) + "\n") * 20000, encoding="utf-8")
            files.append(str(extra))
        tok.train(files, trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    tok.add_special_tokens([*markers, *SPECIAL_TOKENS])
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    first = vocab_size - len(SPECIAL_TOKENS) - len(added) - len(markers)
    if any(tok.token_to_id(t) != first + i for i, t in enumerate((*added, *markers))):
        raise RuntimeError(f"the added markers did not get ids from {first}")
    if tok.get_vocab_size() != vocab_size or ids != special_token_ids(vocab_size):
        raise RuntimeError(
            f"tokenizer reached {tok.get_vocab_size()} tokens (specials {ids}), wanted {vocab_size}"
        )
    return tok.to_str()


def build_tokenizer(dest: Path, *, vocab_size: int = 2048, thinking: bool = False,
                    words: tuple[str, ...] = (), vision: bool = False,
                    chat_template: str | None = None) -> None:  # fmt: skip
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json;
    `thinking`: with `<think>` and `</think>` added, as a reasoning model's;
    `words`: each one token (_trained_json); `vision`: with the image
    markers (VISION_TOKENS); `chat_template` in place of ChatML's."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok_json = _trained_json(vocab_size, thinking, tuple(words), vision)
    (dest / "tokenizer.json").write_text(tok_json, encoding="utf-8")

    ids = special_token_ids(vocab_size) | (vision_token_ids(vocab_size) if vision else {})
    first = vocab_size - len(SPECIAL_TOKENS) - len(THINKING_TOKENS) - (
        len(VISION_TOKENS) if vision else 0)
    added = ({str(first + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": False}
              for i, t in enumerate(THINKING_TOKENS)} if thinking else {})  # fmt: skip
    config = {
        # Outside a model directory this loads tokenizer.json verbatim; inside
        # one, transformers substitutes Qwen3_5Tokenizer (same pipeline).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_prefix_space": False,
        "added_tokens_decoder": added | {
            str(ids[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in ids
        },
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 262144,
        "split_special_tokens": False,
        "chat_template": chat_template or CHAT_TEMPLATE,
    }
    _write_json(dest / "tokenizer_config.json", config)
    _write_json(
        dest / "special_tokens_map.json",
        {"eos_token": IM_END, "pad_token": ENDOFTEXT},
    )


def write_chat_template(dest: Path, template: str) -> None:
    """Set the chat template in `dest`'s tokenizer_config.json (the demo
    model's tool-capable one over the tiny checkpoints' plain ChatML)."""
    path = Path(dest) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    _write_json(path, config)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
