"""Tiny embedding and reranker checkpoints in Qwen3-Embedding's and
Qwen3-Reranker's published layouts.

Qwen3-Embedding is saved as a bare decoder (transformers' AutoModel):
config.json still names `Qwen3ForCausalLM`, with tied embeddings, but the
tensors are `embed_tokens.*`, `layers.*`, `norm.*`, with no `model.`
prefix and no `lm_head`. Beside them, sentence-transformers' files:
modules.json (Transformer, then `1_Pooling` with last-token pooling, then
`2_Normalize`) and config_sentence_transformers.json (its query prompt).
Its tokenizer appends `<|endoftext|>` to every input (a TemplateProcessing
post-processor), which is the token whose hidden state is the vector.
Qwen3-Reranker is an ordinary Qwen3ForCausalLM checkpoint (its recipe is
the prompt, engines/embedding/rerank.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from ._build import save_safetensors, write_json
from .tiny import _qwen3_tensors, build_qwen3_dense
from .tokenizer import ENDOFTEXT, build_tokenizer, special_token_ids

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def build_qwen3_embedding(dest: Path, *, seed: int = 0, hidden_size: int = 64,
                          num_hidden_layers: int = 2, vocab_size: int = 2048,
                          dtype: str = "float32", pooling: str = "lasttoken",
                          normalize: bool = True) -> Path:  # fmt: skip
    """A random Qwen3 decoder in Qwen3-Embedding's layout (see the module
    docstring); `pooling` is sentence-transformers' mode name (lasttoken,
    mean_tokens, cls_token)."""
    dest = Path(dest)
    build_qwen3_dense(dest, seed=seed, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                      vocab_size=vocab_size, intermediate_size=2 * hidden_size,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
                      tie_word_embeddings=True, dtype=dtype)  # fmt: skip
    config = json.loads((dest / "config.json").read_text())
    for old in dest.glob("model*.safetensors*"):
        old.unlink()
    headless = {k.removeprefix("model."): v for k, v in _qwen3_tensors(seed, config).items()}
    save_safetensors(dest, headless, dtype)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})  # fmt: skip
        (dest / "2_Normalize").mkdir(exist_ok=True)
    write_json(dest / "modules.json", modules)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken")  # fmt: skip
    (dest / "1_Pooling").mkdir(exist_ok=True)
    write_json(dest / "1_Pooling" / "config.json",
               {"word_embedding_dimension": hidden_size, "include_prompt": True}
               | {f"pooling_mode_{m}": m == pooling for m in modes})  # fmt: skip
    write_json(dest / "config_sentence_transformers.json",
               {"prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
                "similarity_fn_name": "cosine"})  # fmt: skip
    _append_endoftext(dest, special_token_ids(vocab_size)[ENDOFTEXT])
    return dest


def _append_endoftext(dest: Path, eot: int) -> None:
    path = dest / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": ENDOFTEXT, "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": ENDOFTEXT, "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}},
                 {"SpecialToken": {"id": ENDOFTEXT, "type_id": 1}}],
        "special_tokens": {ENDOFTEXT: {"id": ENDOFTEXT, "ids": [eot], "tokens": [ENDOFTEXT]}},
    }  # fmt: skip
    path.write_text(json.dumps(tok, ensure_ascii=False))


def build_qwen3_reranker(dest: Path, *, seed: int = 0, hidden_size: int = 64,
                         num_hidden_layers: int = 2, vocab_size: int = 2048,
                         dtype: str = "float32") -> Path:  # fmt: skip
    """A random Qwen3ForCausalLM, as Qwen3-Reranker-0.6B is saved (tied
    embeddings); its small vocabulary has "yes" and "no" as single tokens,
    as Qwen's has (the recipe scores those two tokens)."""
    build_qwen3_dense(Path(dest), seed=seed, hidden_size=hidden_size,
                      num_hidden_layers=num_hidden_layers, vocab_size=vocab_size,
                      intermediate_size=2 * hidden_size, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=hidden_size // 4,
                      tie_word_embeddings=True, dtype=dtype, tokenizer=False)  # fmt: skip
    build_tokenizer(Path(dest), vocab_size=vocab_size, words=("yes", "no"))
    return Path(dest)
