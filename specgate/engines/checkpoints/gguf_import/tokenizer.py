"""A Hugging Face tokenizer rebuilt from a GGUF's `tokenizer.*` metadata.

A GGUF carries no tokenizer.json: llama.cpp's converter stores the vocabulary,
merges, token types and special ids as metadata, and names the pre-tokenizer
(`tokenizer.ggml.pre`) whose split regexes live in llama.cpp's C++
(src/llama-vocab.cpp, `llm_tokenizer_bpe`). `tokenizer_files` turns that back
into tokenizer.json / tokenizer_config.json / special_tokens_map.json with the
`tokenizers` library's own objects, so mlx-lm (through transformers) tokenizes
exactly as llama-server does on the same file.

Why not transformers' own GGUF path (integrations/gguf/gguf_tokenizer_mapping):
its reader imports torch, and it picks the split regex only for a handful of
pre names; every other byte-level file (SmolLM2's `smollm` among them) falls
back to GPT-2's regex without the digit split, so ids differ from llama.cpp.

Three tokenizer models are rebuilt:
- `gpt2`: byte-level BPE. llama.cpp applies the pre's regexes one after the
  other, each splitting every piece the previous ones left, keeping matches
  and the text between them (unicode.cpp `unicode_regex_split`); that is a
  Sequence of Split(Regex, "isolated") then ByteLevel(use_regex=False).
- `llama`: SentencePiece (Llama-2, Gemma 1-3 style): BPE with byte fallback
  over the vocabulary as written, merges recovered from the scores (as
  transformers' `generate_merges` does, and as llama.cpp's SPM tokenizer
  merges: best-scoring adjacent pair first), spaces as `▁`.
- `gemma4`: BPE over raw UTF-8 with the file's merges, spaces as `▁`.

Where llama.cpp's regex engine departs from the tokenizer.json regex it
names, the regex wins (it is what the model was trained with): deepseek-llm
and deepseek-coder on non-ASCII whitespace (llama.cpp turns it into a vertical
tab before its std::wregex runs, so U+3000 misses the CJK ranges), youtu and
tiny_aya on camelCase (llama.cpp collapses the Lu and Ll classes into one),
tiny_aya on digits (llama.cpp runs AFMoE's digit splitter instead). Every
other pre tested gives llama-server's ids (tests/test_gguf_tokenizer.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

# llama_token_type in llama.cpp (gguf.TokenType has the same numbers).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# --- Split regexes, in tokenizer.json (Oniguruma) form --------------------
# Where llama.cpp rewrote a tokenizer.json regex for its own engine (no
# `(?i:...)`, lookaheads for \p{Lu}...), it keeps the original in a comment;
# that original is used here, since the `tokenizers` library runs it as is.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_JAIS2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
    r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (  # the same string builders/gguf_export.py matches to name `qwen35`
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_LLM = (
    r"[\r\n]",
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",  # noqa: E501
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
_DEEPSEEK_V3_MAIN = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPARK2_5_MAIN = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"
)
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_YOUTU = (
    "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# llama.cpp's own form (it names no tokenizer.json original); Oniguruma has lookaheads.
_GRANITE_EMB_MULTI = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"  # noqa: E501
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"  # noqa: E501
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_BAILINGMOE = (  # the tokenizer.json original; Oniguruma has possessive quantifiers
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_EXAONE_MOE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
)
_MINICPM5_MAIN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _Pre:
    """One llama.cpp pre-tokenizer type: its regexes and the flags
    llama_vocab::impl::load sets with it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a whole word found in the vocab is one token
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token


def _pres() -> dict[str, _Pre]:
    def same(pre: _Pre, *names: str) -> dict[str, _Pre]:
        return dict.fromkeys(names, pre)

    llama3 = _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)
    gpt2 = _Pre((_GPT2,))
    digits_gpt2 = (r"\p{N}", _GPT2)
    qwen2 = _Pre((_QWEN2,))
    deepseek_v3 = _Pre(
        (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _DEEPSEEK_V3_MAIN)
    )
    gpt4o = _Pre((_GPT4O,))
    return {
        "default": _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
        **same(llama3, "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
               "midm-2.0", "lfm2", "jina-v5-nano"),
        "jais-2": _Pre((_JAIS2,)),
        **same(_Pre((_LLAMA3,)), "dbrx", "smaug-bpe", "chatglm-bpe"),
        "deepseek-llm": _Pre(_DEEPSEEK_LLM),
        "deepseek-coder": _Pre(
            (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}")
        ),
        **same(deepseek_v3, "deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
        "spark2_5": _Pre(
            (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _SPARK2_5_MAIN, r"\p{N}")
        ),
        "youtu": _Pre(_YOUTU, ignore_merges=True),
        "falcon": _Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
        **same(_Pre(digits_gpt2), "starcoder", "refact", "codeshell", "exaone", "minerva-7b",
               "mellum2", "smollm", "command-r"),
        **same(gpt2, "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
               "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais",
               "exaone4", "trillion", "granite-docling"),
        **same(qwen2, "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open",
               "grok-2", "stablelm2", "megrez"),
        "qwen35": _Pre((_QWEN35,)),
        **same(_Pre((_BLOOM,)), "poro-chat", "bloom", "gpt3-finnish"),
        **same(_Pre((_LLAMA3,), ignore_merges=True), "glm4", "glm5"),
        "viking": _Pre((_BLOOM, r"\p{N}")),
        "tekken": _Pre((_TEKKEN,), ignore_merges=True, add_bos=True),
        **same(gpt4o, "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
        "granite-embed-multi-97m": _Pre((_GRANITE_EMB_MULTI,), ignore_merges=True),
        **same(_Pre((r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O)), "tiny_aya", "cohere2moe"),
        **same(_Pre((_BAILINGMOE,)), "bailingmoe", "bailingmoe2", "llada-moe"),
        "seed-coder": _Pre((_SEED_CODER,)),
        "ufakzeka": _Pre((_UFAKZEKA,)),
        "laguna": _Pre((r"[^\n]+|[\n]+", _QWEN2)),
        "exaone-moe": _Pre((_EXAONE_MOE,)),
        "minicpm5": _Pre((r"\p{N}{1,3}", _MINICPM5_MAIN), ignore_merges=True),
    }  # fmt: skip


# `tokenizer.ggml.pre` -> how llama.cpp splits text before BPE. Names it
# knows but that are left out: kimi-k2 and afmoe (hand-written splitters in
# unicode.cpp), chameleon (image/sentinel patterns), superbpe (a zero-width
# split), whitespace / gemma4 / sarvam-moe (not byte-level: the `gemma4`
# tokenizer model is rebuilt on its own, below), jina-v1-en /
# jina-v2-code / roberta-bpe (embedding models that add SEP).
PRE_TOKENIZERS: dict[str, _Pre] = _pres()

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space


class UnsupportedTokenizer(ValueError):
    """The GGUF describes a tokenizer this module cannot rebuild faithfully."""


def _field(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key)
    return default if value is None else value


# Tokens llama.cpp ends generation on by their text, and makes CONTROL
# whatever type the file gave them (llama_vocab::impl::load; it warns that
# such a file is "probably a bug in the model").
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
))  # fmt: skip
# gpt-oss's channel markers, which llama.cpp always renders (USER_DEFINED).
_ALWAYS_USER_DEFINED = frozenset(("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))


def _effective_types(tokens: list[str], types: list[int]) -> list[int]:
    """The token types llama.cpp acts on: the file's, with its two overrides."""
    out = []
    for text, kind in zip(tokens, types, strict=True):
        if text in _ALWAYS_USER_DEFINED:
            kind = _USER_DEFINED
        elif text in _EOG_TEXTS and kind != _CONTROL:
            kind = _CONTROL
        out.append(kind)
    return out


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    """CONTROL (and UNKNOWN) tokens are special; USER_DEFINED ones are added
    but not special. llama.cpp matches both whole in the raw text, as the
    vocabulary spells them (tokenizer_st_partition), CONTROL ones only with
    parse_special, which is what `encode_special_tokens = False` (the
    default) does for special ones."""
    added = []
    for text, kind in zip(tokens, _effective_types(tokens, types), strict=True):
        if kind in (_CONTROL, _UNKNOWN):
            added.append(AddedToken(text, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            added.append(AddedToken(text, special=False, normalized=False))
    return added


def eog_token_ids(meta: Mapping[str, Any]) -> list[int]:
    """The ids llama.cpp ends generation on (its special_eog_ids, less the
    FIM ones): eos, eot and eom ids, and the tokens named by _EOG_TEXTS.
    For config.json's eos_token_id, which mlx-lm stops on."""
    tokens = _field(meta, "tokenizer.ggml.tokens") or []
    ids = {
        i
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (i := _field(meta, f"tokenizer.ggml.{key}")) is not None
    }
    ids |= {i for i, text in enumerate(tokens) if text in _EOG_TEXTS}
    # llama.cpp's workaround for o200k_harmony and solar-open: there `<|end|>`
    # closes a message, not the turn.
    present = set(tokens)
    if {"<|return|>", "<|call|>"} <= present or {"<|calls|>", "<|flush|>"} <= present:
        ids -= {i for i, text in enumerate(tokens) if text == "<|end|>"}
    return sorted(ids)


def _vocab(tokens: list[str]) -> dict[str, int]:
    # Later duplicates win, as in llama.cpp's token_to_id map.
    return {text: i for i, text in enumerate(tokens)}


def _merges(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    raw = _field(meta, "tokenizer.ggml.merges")
    if raw is None:
        raise UnsupportedTokenizer("BPE GGUF without tokenizer.ggml.merges")
    pairs = []
    for merge in raw:
        # llama.cpp splits at the first space after the first character, so
        # a merge whose left part is itself a space still parses.
        cut = merge.find(" ", 1)
        if cut < 0:
            raise UnsupportedTokenizer(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    return pairs


def _bos_eos_processor(
    bos: str | None, eos: str | None, ids: dict[str, int], *, add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing | None:
    if not ((add_bos and bos) or (add_eos and eos)):
        return None
    head = f"{bos}:0 " if add_bos and bos else ""
    tail = f" {eos}:0" if add_eos and eos else ""
    tail_b = f" {eos}:1" if add_eos and eos else ""
    head_b = f"{bos}:1 " if add_bos and bos else ""
    used = {t for t, on in ((bos, add_bos), (eos, add_eos)) if on and t}
    return processors.TemplateProcessing(
        single=f"{head}$A:0{tail}",
        pair=f"{head}$A:0{tail} {head_b}$B:1{tail_b}",
        special_tokens=[(t, ids[t]) for t in sorted(used)],
    )


def _byte_level(
    meta: Mapping[str, Any], tokens: list[str], types: list[int]
) -> tuple[Tokenizer, _Pre]:
    pre_name = _field(meta, "tokenizer.ggml.pre") or "default"
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise UnsupportedTokenizer(
            f"GGUF pre-tokenizer {pre_name!r} is not one specgate can rebuild "
            f"(known: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    tok = Tokenizer(
        models.BPE(
            vocab=_vocab(tokens),
            merges=_merges(meta),
            ignore_merges=pre.ignore_merges,
            fuse_unk=False,
        )
    )
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok, pre


def _gemma4(meta: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    """Gemma 4's BPE: merges over raw UTF-8 (not GPT-2's byte alphabet), spaces
    written as ▁, byte tokens `<0xXX>` for what the vocabulary lacks.

    llama.cpp (pre type GEMMA4) escapes spaces, splits the text only into
    runs of newlines and runs of anything else, and takes a whole newline run
    as one token when the vocabulary has it (ggml-org/llama.cpp#21343). The
    newline-run tokens are therefore added tokens here: matched whole, longest
    first, before the BPE runs."""
    tok = Tokenizer(
        models.BPE(vocab=_vocab(tokens), merges=_merges(meta), fuse_unk=False, byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    newline_runs = [t for t in tokens if t and not t.strip("\n")]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in newline_runs])
    return tok


def _generate_merges(
    tokens: list[str], scores: list[float], types: list[int]
) -> list[tuple[str, str]]:
    """Merges a SentencePiece vocabulary implies: every split of a token into
    two tokens, best-scoring result first (transformers' generate_merges, the
    same order llama.cpp's SPM tokenizer merges in). Only NORMAL tokens take
    part: control, byte and unused ones are never built from pieces."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED)}
    found: list[tuple[float, int, int, int, int, str, str]] = []
    for text, i in normal.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            li, ri = normal.get(left), normal.get(right)
            if li is not None and ri is not None:
                found.append((-scores[i], len(left), len(right), li, ri, left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece(
    meta: Mapping[str, Any], tokens: list[str], types: list[int]
) -> tuple[Tokenizer, bool]:
    scores = _field(meta, "tokenizer.ggml.scores")
    if scores is None:
        raise UnsupportedTokenizer("SentencePiece GGUF without tokenizer.ggml.scores")
    unk_id = _field(meta, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(
        models.BPE(
            vocab=_vocab(tokens),
            merges=_generate_merges(tokens, list(scores), types),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # llama.cpp (llm_tokenizer_spm) escapes spaces as ▁ and, with
    # add_space_prefix (on unless the file says otherwise), puts one space
    # before every run of text that starts the input or follows a special
    # token; the `tokenizers` normalizer runs once per such run, so Prepend
    # does the same.
    prefix = bool(_field(meta, "tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPM_SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPM_SPACE)])
    parts = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        parts.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(parts)
    return tok, prefix


def tokenizer_metadata(reader: Any) -> dict[str, Any]:
    """What tokenizer_files reads from a GGUF reader (gguf_file.GGUFFile, or gguf.GGUFReader): every
    `tokenizer.*` key, the architecture and its context length, as values."""
    arch = (
        reader.fields["general.architecture"].contents()
        if "general.architecture" in reader.fields
        else None
    )
    wanted = {"general.architecture", f"{arch}.context_length"}
    return {
        k: f.contents()
        for k, f in reader.fields.items()
        if k.startswith("tokenizer.") or k in wanted
    }


def tokenizer_files(reader: Any) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json
    (filename -> text) for the tokenizer a GGUF reader (gguf_file.GGUFFile) describes.

    Raises UnsupportedTokenizer for a tokenizer model or pre-tokenizer it
    cannot rebuild the way llama.cpp tokenizes."""
    return tokenizer_files_from_metadata(tokenizer_metadata(reader))


def tokenizer_files_from_metadata(meta: Mapping[str, Any]) -> dict[str, str]:
    """tokenizer_files from GGUF metadata already read (key -> value, as
    tokenizer_metadata gives it)."""
    model = _field(meta, "tokenizer.ggml.model")
    tokens = _field(meta, "tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise UnsupportedTokenizer("the GGUF has no tokenizer (tokenizer.ggml.model / tokens)")
    types = _field(meta, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise UnsupportedTokenizer(f"{len(tokens)} tokens but {len(types)} token types")

    if model == "gpt2":
        tok, pre = _byte_level(meta, tokens, types)
        add_bos_default = pre.add_bos
    elif model == "llama":
        tok, _ = _sentencepiece(meta, tokens, types)
        add_bos_default = True
    elif model == "gemma4":
        tok = _gemma4(meta, tokens)
        add_bos_default = False
    else:
        raise UnsupportedTokenizer(
            f"GGUF tokenizer model {model!r} is not one specgate can rebuild (gpt2, llama, gemma4)"
        )
    tok.add_tokens(_added_tokens(tokens, types))

    def special(key: str) -> str | None:
        i = _field(meta, f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = special("bos_token_id"), special("eos_token_id")
    unk, pad = special("unknown_token_id"), special("padding_token_id")
    add_bos = bool(_field(meta, "tokenizer.ggml.add_bos_token", add_bos_default))
    if model == "gemma4":
        # Gemma 4 files set the flag, and llama.cpp forces it on (#21500),
        # but the reference tokenizer adds no BOS: the chat template writes
        # `<bos>` itself (transformers' GGUF loader follows the reference).
        add_bos = False
    add_eos = bool(_field(meta, "tokenizer.ggml.add_eos_token", False))
    ids = _vocab(tokens)
    if (post := _bos_eos_processor(bos, eos, ids, add_bos=add_bos, add_eos=add_eos)) is not None:
        tok.post_processor = post
    elif model == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    specials = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
    specials = {k: v for k, v in specials.items() if v is not None}
    arch = _field(meta, "general.architecture")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        # llama.cpp's clean_spaces touches only llama_detokenize, not the
        # pieces llama-server streams; transformers ignores it for BPE anyway.
        "clean_up_tokenization_spaces": False,
    }
    if (ctx := _field(meta, f"{arch}.context_length")) is not None:
        config["model_max_length"] = int(ctx)
    if (template := _chat_template(meta)) is not None:
        config["chat_template"] = template
    return {
        "tokenizer.json": tok.to_str(pretty=False),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
        "special_tokens_map.json": json.dumps(specials, indent=2, ensure_ascii=False),
    }


def _chat_template(meta: Mapping[str, Any]) -> str | list[dict[str, str]] | None:
    """The default template, or HF's list form when the file also carries
    named ones (`tokenizer.chat_template.<name>`, e.g. tool_use)."""
    default = _field(meta, "tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = [
        {"name": k[len(prefix) :], "template": _field(meta, k)}
        for k in meta
        if k.startswith(prefix)
    ]
    if not named:
        return default
    if default is not None:
        named.insert(0, {"name": "default", "template": default})
    return named
