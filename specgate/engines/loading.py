"""Load each model's weights once, however many engines serve it."""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from specgate.engines import kernel_wiring  # (on CUDA: prompt kernels built side by side at load)
from specgate.engines.base import CacheSettings
from specgate.engines.cache.prefix_cache import PrefixCache, set_ram_budget
from specgate.engines.embedding.pooling import Pooling, read_pooling
from specgate.engines.fair_lock import FairLock
from specgate.engines.forwards.one_row import compile_one_row
from specgate.engines.forwards.quantized_kv import group_size_for, quantize_caches
from specgate.engines.grammar.matcher import Grammars
from specgate.engines.precision import upcast_on_cpu
from specgate.kernels import hook

log = logging.getLogger(__name__)


class UrgentProofs:
    """Proofs of this model's kernels that something waits for: a
    speculative engine's lone verify widths, which its first speculative
    token waits on. The plain engine's proofs (every width 1..16 for its
    batches: 225 s on a fresh H100) yield `LoadedModel.proving` to them
    between two verdicts, and wait until none is pending to go on."""

    def __init__(self) -> None:
        self._pending = 0
        self._changed = threading.Condition()

    def begin(self) -> None:
        """One more urgent proof pending (its wait for the lock included)."""
        with self._changed:
            self._pending += 1

    def end(self) -> None:
        with self._changed:
            self._pending -= 1
            self._changed.notify_all()

    @property
    def pending(self) -> bool:
        return self._pending > 0

    def wait_none(self, stop: threading.Event) -> None:
        """Until no urgent proof is pending (or `stop` is set)."""
        with self._changed:
            while self._pending and not stop.is_set():
                self._changed.wait(0.5)


@dataclass
class LoadedModel:
    path: str
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict
    prefix_cache: PrefixCache  # shared by every engine serving this model
    # Engines serving these weights take it around each step (a prefill
    # chunk, a round, a batch step), so they never run MLX work on them at
    # once. Engines of other models have their own and run alongside: a long
    # prefill of one model does not hold up another's decoding.
    lock: FairLock = field(default_factory=FairLock)
    # Held by the engine proving this model's kernels off its load path
    # (engines/mlx_spec/engine.py), so its engines prove one after another
    # and each later one reads back the verdicts the first recorded.
    proving: threading.Lock = field(default_factory=threading.Lock)
    # ... and the proofs a first speculative token waits for, which go first.
    urgent_proofs: UrgentProofs = field(default_factory=UrgentProofs)
    # A model over several ranks (engines/distributed/lockstep.py): its lock, and the
    # decisions its engines share with the other ranks. None on one machine.
    lockstep: Any = None
    # Cast to float32 on a CPU with OpenBLAS (engines/precision.py): its
    # drafters and heads follow, and its prefix-cache files are its own.
    upcast: bool = False
    # How its checkpoint pools hidden states into a vector, where it says so
    # (sentence-transformers' modules.json: an embedding model); None: a
    # generating model, or an embedding model that declares nothing.
    pooling: Pooling | None = None
    # Its attention layers' KV cache quantized to this many bits (the model
    # setting `kv_bits`; engines/forwards/quantized_kv.py), None: as computed.
    kv_bits: int | None = None
    # A vision-language checkpoint's image side (engines/vision/), else None;
    # `images_refused` says why a checkpoint with a vision tower has none.
    vision: Any = None
    images_refused: str | None = None

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config", self.config)

    @property
    def vocab_size(self) -> int:
        return self.text_config["vocab_size"]

    @property
    def max_position_embeddings(self) -> int | None:
        return self.text_config.get("max_position_embeddings")

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Constrained decoding for this model's requests (engines/grammar/matcher.py)."""
        # Keyed by path and load: a reloaded model's tokenizer may differ.
        return Grammars(self.tokenizer, self.vocab_size, f"{self.path}#{id(self)}")


# Weights load once per path while an engine holds them: when the last
# engine of a path is gone (its model unloaded), so are they, and a later
# load reads them again.
_loaded: weakref.WeakValueDictionary[str, LoadedModel] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def prepare_for_decoding(model: nn.Module) -> None:
    """What loading does to a whole (unsharded) model for one-row steps, both
    exact: each layer's q/k/v and gate/up in one launch each (kernels/hook.py
    says why), then its one-row step as compiled halves (forwards/one_row.py;
    after the fusing, as the traces keep the arrays they were made with).
    Benches that build a model in memory call it too, to time what is served."""
    hook.fuse_siblings(model)
    compile_one_row(model)


def _vision(path: Path, config: dict, model: nn.Module):
    """(its image side, why it has none) for a checkpoint with a vision tower."""
    if "vision_config" not in config:
        return None, None
    from specgate.engines import vision

    if (why := vision.unsupported(config)) is not None:
        return None, why
    try:
        return vision.load(str(path), config, model), None
    except Exception as e:  # its text is served all the same; image requests get the reason
        log.warning("%s: no images: %s", path, e)
        return None, str(e) if isinstance(e, vision.VisionError) else f"its vision tower: {e}"


def load_mlx_model(path: str, cache: CacheSettings | None = None, distribution=None,
                   chat_template: str | None = None, dequantize: bool = False,
                   kv_bits: int | None = None, kv_group_size: int = 64) -> LoadedModel:  # fmt: skip
    """mlx-lm load, memoised by resolved path.

    `path` is a local directory, a hub repo id or a GGUF file (imported to
    an MLX checkpoint first, engines/checkpoints/gguf_import/); only a hub repo id that is
    not already in the local hub cache downloads anything (never while
    HF_HUB_OFFLINE is set). CheckpointLoadError says what is missing: the
    path, the download, the tokenizer (engines/mlx_load.py). `cache`: the
    prefix cache's settings (the first load of a path decides them).
    `distribution` (engines/distributed/lockstep.Distribution): this rank's shard, with
    the lockstep as its lock and no prefix cache (whose hits would differ
    between ranks whose entries differ in size, so evictions do too).
    `chat_template`: the model config's, set on this load's tokenizer; a
    load with another template (or none) of the same path is another load,
    so one model's template never reaches another's. `dequantize`: the model
    setting (engines/mlx_load.py): another load of the path,
    with prefix-cache files of its own (its KV differs). `kv_bits`: its KV
    cache quantized (engines/forwards/quantized_kv.py), likewise another load
    with files of its own.
    """
    # lazily: mlx-lm pulls in transformers
    from specgate.engines.checkpoints.gguf_pick import is_gguf_file
    from specgate.engines.mlx_load import imported_gguf, load, local_checkpoint

    # A GGUF (by its magic: an Ollama blob has no suffix) is served from its
    # MLX import, made on first use.
    if Path(path).expanduser().is_file() and is_gguf_file(Path(path).expanduser()):
        path = str(imported_gguf(path))
    key = str(Path(path).resolve()) if Path(path).exists() else path
    memo = key
    if chat_template is not None:
        memo += "#chat_template:" + hashlib.sha256(chat_template.encode()).hexdigest()[:16]
    if dequantize:
        memo += "#dequantized"
    if kv_bits is not None:
        memo += f"#kv{kv_bits}g{kv_group_size}"
    with _lock:
        loaded = _loaded.get(memo)
        if loaded is None:
            model, tokenizer, config = load(path, distribution, dequantize)
            pooling = read_pooling(local_checkpoint(path))  # (PoolingError: refused by name)
            upcast = upcast_on_cpu(model, key)
            if chat_template is not None:
                # Set on the Hugging Face tokenizer mlx-lm's wrapper renders with.
                tokenizer.chat_template = chat_template
            if distribution is None:
                # A rank's shard has sharded linears: neither applies to it.
                prepare_for_decoding(model)
                # On CUDA: MLX's prompt kernels built side by side meanwhile.
                kernel_wiring.prebuild_forward(model)
                kv = _quantized_kv(model, config, kv_bits, kv_group_size)
                prefix = _prefix_cache(key, model, cache or CacheSettings(), dequantize, upcast, kv)
                vision, refused = _vision(local_checkpoint(path), config, model)
                loaded = _loaded[memo] = LoadedModel(key, model, tokenizer, config, prefix,
                                                     upcast=upcast, pooling=pooling,
                                                     kv_bits=kv_bits, vision=vision,
                                                     images_refused=refused)  # fmt: skip
            else:
                from specgate.engines.distributed.lockstep import Lockstep

                _quantized_kv(model, config, kv_bits, kv_group_size)
                prefix = _prefix_cache(key, model, CacheSettings(disk_bytes=0))
                prefix.resize(0)
                lockstep = Lockstep(distribution.group, distribution.rank_timeout_s)
                loaded = _loaded[memo] = LoadedModel(key, model, tokenizer, config, prefix,
                                                     lock=lockstep, lockstep=lockstep,
                                                     upcast=upcast, pooling=pooling,
                                                     kv_bits=kv_bits)  # fmt: skip
            if prefix.disk is not None:  # its queued writes finish, then its thread ends
                weakref.finalize(loaded, prefix.disk.close)
            weakref.finalize(loaded, mx.clear_cache)  # MLX's freed buffers back to the OS
        return loaded


def _quantized_kv(model: nn.Module, config: dict, bits: int | None, group_size: int) -> str | None:
    """Hook the model's caches to quantize (None: no kv_bits); the variant's
    name, which its prefix-cache files are kept under."""
    if bits is None:
        return None
    size = group_size_for(config.get("text_config", config), group_size)
    quantize_caches(model, bits, size)
    return f"kv{bits}g{size}"


def _prefix_cache(key: str, model: nn.Module, settings: CacheSettings,
                  dequantize: bool = False, upcast: bool = False,
                  kv: str | None = None) -> PrefixCache:  # fmt: skip
    from mlx_lm.models.cache import RotatingKVCache, can_trim_prompt_cache, make_prompt_cache

    from specgate.engines.mlx_load import downloaded_checkpoint

    if settings.ram_bytes is not None:
        set_ram_budget(settings.ram_bytes)
    fresh = make_prompt_cache(model)
    classes = tuple(type(c).__name__ for c in fresh)
    disk = None
    root = downloaded_checkpoint(key) if settings.disk_bytes > 0 else None
    if root is not None:  # its files name the model's entries on disk
        from specgate.engines.cache.prefix_disk import DiskTier, prefix_digest
        from specgate.engines.home import prefix_cache_dir

        try:
            digest = prefix_digest(root)
            # Other weights or another compute type, other states: never
            # each other's files.
            for variant, on in (("dequantized", dequantize), ("float32", upcast), (kv, kv)):
                if on:
                    digest = hashlib.sha256(f"{digest}#{variant}".encode()).hexdigest()[:16]
            disk = DiskTier(prefix_cache_dir(), digest, settings.disk_bytes,
                            settings.disk_min_tokens)  # fmt: skip
        except OSError as e:  # an unreadable checkpoint file or cache directory
            log.warning("prefix cache of %s: no disk tier (%s)", key, e)
    return PrefixCache(
        key,
        disk=disk,
        cache_classes=classes,
        # Snapshots at message boundaries wherever a trunk cannot always be
        # cut back: recurrent state, or a sliding window once it has wrapped.
        trimmable=can_trim_prompt_cache(fresh)
        and not any(isinstance(c, RotatingKVCache) for c in fresh),
        snapshot_interval=settings.snapshot_interval,
    )


def flush_prefix_caches() -> None:
    """Wait for every model's queued disk writes (at shutdown)."""
    for loaded in list(_loaded.values()):
        if loaded.prefix_cache.disk is not None:
            loaded.prefix_cache.disk.flush()
