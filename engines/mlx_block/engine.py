"""The block-drafter engines: DFlash and DSpark drafters beside the target."""

from __future__ import annotations

from pathlib import Path

from engines.base import GenerationRequest
from engines.loading import LoadedModel
from engines.mlx_block.decoder import DFlashDecoder, DSparkDecoder
from engines.mlx_block.dflash import DFlashDrafter, load_dflash
from engines.mlx_block.dspark import DSparkDrafter, load_dspark
from engines.spec_engine import SpecEngine


def check_pairing(drafter: DFlashDrafter, hidden_size: int, num_layers: int, vocab: int) -> None:
    """A drafter built for another target fails here, by name, not with a shape error later."""
    a = drafter.args
    if a.hidden_size != hidden_size:
        raise ValueError(f"drafter hidden_size {a.hidden_size} != target's {hidden_size}")
    bad = [i for i in a.target_layer_ids if not -1 <= i < num_layers]  # -1: embeddings
    if bad:
        raise ValueError(f"drafter reads target layers {bad}; the target has {num_layers}")
    if not 0 <= a.mask_token_id < vocab:
        raise ValueError(f"drafter mask_token_id {a.mask_token_id} outside the target's vocab ({vocab})")
    if a.vocab_size is not None and a.vocab_size != vocab:
        raise ValueError(f"drafter vocab_size {a.vocab_size} != target's {vocab}")
    if a.block_size < (1 if isinstance(drafter, DSparkDrafter) else 2):
        # A DFlash block's first position is the last committed token.
        raise ValueError(f"drafter block_size {a.block_size} leaves nothing to propose")


class MLXDFlashEngine(SpecEngine):
    name = "mlx_dflash"
    method = "dflash"
    load_drafter = staticmethod(load_dflash)
    # The drafter is conditioned on the target's layer outputs for every
    # context token, which the shared prefix cache does not keep: starting
    # from it would leave the drafter blind to the cached prefix. So block
    # engines prefill the whole prompt (their finished caches still serve
    # the other engines).
    reads_prefix_cache = False

    def __init__(self, model_id: str, loaded: LoadedModel, drafter_path: str | Path, *,
                 max_context: int, max_queue: int = 64, prefill_step_size: int = 512,
                 kernels: str = "auto", verify_depth: int | None = None, kernel_guard=None):  # fmt: skip
        """verify_depth: the most drafts a round verifies (the model's
        block_depth; default the drafter's max_drafts); widths up to it + 1
        are proved at load."""
        super().__init__(model_id, loaded, max_context=max_context, max_queue=max_queue,
                         prefill_step_size=prefill_step_size, kernels=kernels,
                         kernel_guard=kernel_guard)  # fmt: skip
        self.drafter = self.load_drafter(drafter_path)
        check_pairing(self.drafter, self.trunk.hidden_size,
                      self.trunk.num_layers, self.trunk.vocab_size)
        self.wire_kernels(min(verify_depth or self.max_drafts, self.max_drafts))

    @property
    def max_drafts(self) -> int:
        return self.drafter.args.block_size - 1  # the block's first position is the last token

    def make_decoder(self, request: GenerationRequest, cache: list | None,
                     cached_tokens: int) -> DFlashDecoder:
        return DFlashDecoder(self.trunk, self.drafter, request, cache, cached_tokens,
                             self.tokenizer, self.prefill_step_size)  # fmt: skip


class MLXDSparkEngine(MLXDFlashEngine):
    name = "mlx_dspark"
    method = "dspark"
    load_drafter = staticmethod(load_dspark)

    @property
    def max_drafts(self) -> int:
        return self.drafter.args.block_size  # one proposal per block position

    def make_decoder(self, request: GenerationRequest, cache: list | None,
                     cached_tokens: int) -> DSparkDecoder:
        return DSparkDecoder(self.trunk, self.drafter, request, cache, cached_tokens,
                             self.tokenizer, self.prefill_step_size)  # fmt: skip
