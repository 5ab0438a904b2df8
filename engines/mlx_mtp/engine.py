"""The MTP engine: speculative decoding with a model's own MTP head."""

from __future__ import annotations

from engines.base import GenerationRequest
from engines.loading import LoadedModel
from engines.mlx_mtp.decoder import MTPDecoder
from engines.mlx_mtp.loading import load_mtp_head
from engines.spec_engine import SpecEngine


class MLXMTPEngine(SpecEngine):
    name = "mlx_mtp"
    method = "mtp"

    def __init__(self, model_id: str, loaded: LoadedModel, *, max_context: int,
                 max_queue: int = 64, prefill_step_size: int = 512, kernels: str = "auto",
                 verify_depth: int = 2, kernel_guard=None):  # fmt: skip
        """verify_depth: the deepest round the policy plans (the model's
        mtp_depth); verify widths up to it + 1 are proved at load."""
        super().__init__(model_id, loaded, max_context=max_context, max_queue=max_queue,
                         prefill_step_size=prefill_step_size, kernels=kernels,
                         kernel_guard=kernel_guard)  # fmt: skip
        self.head = load_mtp_head(loaded)
        self.wire_kernels(verify_depth)

    def make_decoder(self, request: GenerationRequest, cache: list | None,
                     cached_tokens: int) -> MTPDecoder:
        return MTPDecoder(self.trunk, self.head, request, cache, cached_tokens, self.tokenizer,
                          self.prefill_step_size)  # fmt: skip


def head_nbytes(engine: MLXMTPEngine) -> int:
    """Bytes of the head's own parameters (the trunk's are shared)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(engine.head.parameters()))
