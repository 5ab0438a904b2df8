"""mlx-lm's load, with what it refuses wrongly or lets through wrongly made clear.

- A GGUF file is imported into an MLX checkpoint directory first
  (engines/checkpoints/gguf_import/), once per file content.

- A hub repo id while HF_HUB_OFFLINE is set is looked up in the local cache
  only; one that is not there is "not downloaded", in those words.
- A checkpoint without a tokenizer is refused: transformers would build an
  empty one, every prompt would encode to no tokens, and every request would
  fail as "the prompt is empty".
- A text-only save (transformers' Qwen3_5ForCausalLM: `qwen3_5_text`, flat
  config, `model.*` weights) loads with the mlx-lm model that reads that
  layout, named for this one load (mlx-lm's `model_config`), not by editing
  mlx-lm's MODEL_REMAPPING for the whole process.
- Arrays a module keeps outside its parameters (a RoPE's `_freqs`: Gemma-4's
  proportional RoPE, Llama-3 and YaRN scaling) are evaluated here. mlx-lm
  evaluates the parameters only; the rest stays a lazy graph on the loading
  thread's stream, and the engine thread that first runs the model fails
  with "There is no Stream(cpu, 0) in current thread".
- A decoder saved without its head (transformers' AutoModel save, the
  layout of Qwen3-Embedding: `embed_tokens.*`, `layers.*`, no `model.`
  prefix, no `lm_head`) loads with the family's model, its weights named as
  mlx-lm names them, through a subclass made for this one load.
- `dequantize`: the quantized layers are dequantized (mlx-lm's own
  dequantize_model) and every floating weight cast to bfloat16, for the
  model setting `dequantize` (gateway/config.py says when it pays).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from specgate.engines.checkpoints.families import TEXT_ONLY_MODEL_TYPES, mlx_lm_module
from specgate.engines.checkpoints.locate import hub_offline, looks_local, not_downloaded
from specgate.engines.checkpoints.reader import read_tokenizer

log = logging.getLogger(__name__)


class CheckpointLoadError(Exception):
    """A checkpoint that cannot be loaded; the message says why and what to do."""


def load(path: str, distribution=None, dequantize: bool = False) -> tuple[Any, Any, dict]:
    """(model, TokenizerWrapper, config) as mlx_lm.load returns them; with
    a `distribution` (engines/distributed/lockstep.py), this rank's shard of
    the model; `dequantize`: its quantized layers as bfloat16 ones."""
    import mlx.core as mx
    import mlx_lm  # lazily: it pulls in transformers

    from specgate.engines.home import use_mlx_kernel_cache

    use_mlx_kernel_cache(mx.__version__)
    root = local_checkpoint(path)
    _check_tokenizer(root)
    if _headless(root):
        model, tokenizer, config = _load_headless(root, _model_config(root), distribution is not None)
    else:
        model, tokenizer, config = mlx_lm.load(str(root), model_config=_model_config(root),
                                               return_config=True, lazy=distribution is not None)
    if distribution is not None:
        from specgate.engines.distributed.lockstep import shard_model

        try:
            shard_model(model, distribution)
        except ValueError as e:
            raise CheckpointLoadError(f"{root}: {e}") from None
        mx.eval(model.parameters())
    if dequantize:
        from mlx_lm.utils import dequantize_model

        # bfloat16, not the float16 the scales dequantize to: MLX's CPU
        # forward took 1.6-2.7x as long in float16 (SmolLM2 on x86).
        model = dequantize_model(model)
        model.set_dtype(mx.bfloat16)
        mx.eval(model.parameters())
    evaluate_buffers(model)
    if not tokenizer.encode("Hello, world"):
        raise CheckpointLoadError(f"{root}: its tokenizer encodes text to no tokens; "
                                  "copy the original model's tokenizer files into it")
    return model, tokenizer, config


def weight_names(root: Path) -> list[str]:
    """The tensor names of a checkpoint's safetensors (its index's, or each
    file's header), without reading a tensor."""
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            return list(json.loads(index.read_text()).get("weight_map", {}))
        except (OSError, ValueError, AttributeError):
            return []
    names: list[str] = []
    for file in sorted(root.glob("model*.safetensors")):
        try:
            with safe_open(str(file), framework="numpy") as f:
                names += list(f.keys())
        except Exception:  # mlx-lm's own load says what is wrong with the file
            return []
    return names


def _headless(root: Path) -> bool:
    """Saved as a bare decoder (AutoModel): no `model.` prefix, no head."""
    names = weight_names(root)
    return (any(n.startswith(("embed_tokens.", "layers.")) for n in names)
            and not any(n.startswith(("model.", "lm_head.")) for n in names))  # fmt: skip


def _load_headless(root: Path, model_config: dict | None, lazy: bool) -> tuple[Any, Any, dict]:
    from mlx_lm.utils import _get_classes, load_model, load_tokenizer

    def classes(config: dict):
        model_class, args_class = _get_classes(config)

        def sanitize(self, weights: dict) -> dict:
            weights = {f"model.{k}": v for k, v in weights.items()}
            return model_class.sanitize(self, weights) if hasattr(model_class, "sanitize") else weights

        # Its family stays the module it comes from (engines/targets/ picks by it).
        made = type(f"Headless{model_class.__name__}", (model_class,),
                    {"sanitize": sanitize, "__module__": model_class.__module__})  # fmt: skip
        return made, args_class

    model, config = load_model(root, lazy, model_config=model_config, get_model_classes=classes)
    tokenizer = load_tokenizer(root, eos_token_ids=config.get("eos_token_id", None))
    return model, tokenizer, config


def imported_gguf(path: str) -> Path:
    """The MLX checkpoint directory of the GGUF file at `path`, imported now
    if it was not before (blocking: every weight is read and written once),
    with a log line every tenth of the way."""
    from specgate.engines.checkpoints.gguf_import import GGUFImportError, import_gguf

    logged = [0]

    def progress(done: int, total: int, tensor: str) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth > logged[0]:
            logged[0] = tenth
            log.info("importing %s for MLX: %d%% (%s)", Path(path).name, tenth * 10, tensor)

    if not Path(path).expanduser().is_file():
        raise CheckpointLoadError(f"{path} does not exist")
    try:
        return import_gguf(path, progress=progress)
    except GGUFImportError as e:
        raise CheckpointLoadError(f"{path}: {e}") from None


def local_checkpoint(path: str) -> Path:
    """The local directory of `path`: itself, or a hub repo's snapshot (from
    the cache when offline, else downloaded as mlx-lm would)."""
    local = Path(path).expanduser()
    if local.exists():
        return local
    if looks_local(path):
        raise CheckpointLoadError(f"{path} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    offline = hub_offline()  # read now: huggingface_hub read it at import
    try:
        return Path(snapshot_download(path, allow_patterns=DEFAULT_ALLOW_PATTERNS,
                                      local_files_only=offline))
    except HFValidationError:
        raise CheckpointLoadError(
            f"{path} does not exist: it is no local path, and not a Hugging Face repo id "
            "(org/name) either") from None
    except RepositoryNotFoundError:
        raise CheckpointLoadError(
            f"{path} is not a local path, and the Hugging Face hub has no such model (or it is "
            "gated or private: `hf auth login`)") from None
    except LocalEntryNotFoundError as e:  # offline, or the hub could not be reached
        if offline:
            raise CheckpointLoadError(not_downloaded(path)) from None
        raise CheckpointLoadError(
            f"{path} is not a local path and not downloaded, and downloading it failed: {e}"
        ) from None


def downloaded_checkpoint(path: str) -> Path | None:
    """The local directory of `path` if it is there already (a directory, or
    a hub repo in the local cache), never downloading; else None."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

        return Path(snapshot_download(path, allow_patterns=DEFAULT_ALLOW_PATTERNS,
                                      local_files_only=True))  # fmt: skip
    except Exception:  # not a repo id, or not in the cache
        return None


def _check_tokenizer(root: Path) -> None:
    t = read_tokenizer(root)
    if t.error:
        raise CheckpointLoadError(f"{root}: its tokenizer files cannot be read ({t.error})")
    if not t.vocab_files:
        raise CheckpointLoadError(
            f"{root} has no tokenizer (tokenizer.json / tokenizer_config.json missing): copy the "
            "original model's tokenizer files into it")


def _model_config(root: Path) -> dict | None:
    """The model_type to load as, where mlx-lm has no model under the
    checkpoint's own (a text-only save); None: the checkpoint's config as it is."""
    try:
        model_type = json.loads((root / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # mlx-lm's own load says what is wrong with it
    module = mlx_lm_module(model_type)
    if model_type in TEXT_ONLY_MODEL_TYPES and module == TEXT_ONLY_MODEL_TYPES[model_type]:
        return {"model_type": module}
    return None


def evaluate_buffers(model) -> None:
    """Evaluate every array any submodule holds, its private ones (`_freqs`,
    which `parameters()` leaves out) included."""
    import mlx.core as mx

    mx.eval([v for m in model.modules() for v in m.values() if isinstance(v, mx.array)])
