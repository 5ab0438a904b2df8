"""Load each model's weights once, however many engines serve it."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.nn as nn

from engines.prefix_cache import PrefixCache


@dataclass
class LoadedModel:
    path: str
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict
    prefix_cache: PrefixCache  # shared by every engine serving this model

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config", self.config)

    @property
    def vocab_size(self) -> int:
        return self.text_config["vocab_size"]

    @property
    def max_position_embeddings(self) -> int | None:
        return self.text_config.get("max_position_embeddings")


# One machine, one accelerator: engine workers take this around each step, so
# two engines sharing one model's weights never run MLX work at once.
DEVICE_LOCK = threading.Lock()

_loaded: dict[str, LoadedModel] = {}
_lock = threading.Lock()


def load_mlx_model(path: str) -> LoadedModel:
    """mlx-lm load, memoised by resolved path.

    `path` is a local directory or a hub repo id; only a hub repo id that is
    not already in the local hub cache downloads anything.
    """
    from mlx_lm import load  # imported lazily: it pulls in transformers

    key = str(Path(path).resolve()) if Path(path).exists() else path
    with _lock:
        if key not in _loaded:
            model, tokenizer, config = load(path, return_config=True)
            _loaded[key] = LoadedModel(key, model, tokenizer, config, PrefixCache(key))
        return _loaded[key]
