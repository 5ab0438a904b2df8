"""Each engine's own per-model settings, typed once.

One pydantic class per kind of engine, named by the engine's registry
record (`EngineRecord.settings`, engines/registry.py). In a model's YAML the
engine's name is the key: `mlx_mtp: {depth: 3}`. gateway/config.py makes
one field per record from these classes, so the YAML is validated against
them once, and the validated object reaches the engine's builder as it is
(`BuildContext.settings_of(name)`). A new per-engine option is one field
here, plus the code that reads it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# llama-server's n-gram --spec-types (engines/llamacpp/process.py's
# NGRAM_TYPES, which a test holds equal to this).
NgramType = Literal["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod"]
# The lookup length llamacpp_ngram matches when its settings name none.
NGRAM_LOOKUP_DEFAULT = 4


class EngineSettings(BaseModel):
    """An engine with no settings of its own (plain decoding)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class DraftSettings(EngineSettings):
    """A speculative engine's: how deep its rounds go."""

    depth: int | None = None  # drafts verified per round; None: the most its drafter makes


class MTPSettings(DraftSettings):
    """Drafting one token per step from the model's own MTP head or a
    Gemma-4 -assistant drafter."""

    depth: int = Field(2, ge=1, le=8, description="tokens drafted per round "
                       "(llamacpp_mtp: llama-server's --spec-draft-n-max)")  # fmt: skip


class BlockSettings(DraftSettings):
    """A block drafter (DFlash, DSpark): a whole block drafted per forward."""

    depth: int | None = Field(None, ge=1, le=64, description="drafts verified per round; "
                              "default: every position the drafter proposes")  # fmt: skip


class NgramSettings(DraftSettings):
    """Drafting by copying from the context."""

    depth: int = Field(8, ge=1, le=64, description="the most tokens a round copies from the "
                       "context (llamacpp_ngram: the n-gram type's draft size)")  # fmt: skip


class MTPNgramSettings(NgramSettings):
    """Copying where the context has a match, the MTP head elsewhere."""

    mtp_depth: int = Field(2, ge=1, le=8, description="the most tokens the MTP head drafts in "
                           "a round where the context has no match")  # fmt: skip
    copy_match: int = Field(4, ge=2, le=64, description="matched tokens before a copy is "
                            "trusted over the head")  # fmt: skip


class LlamaCppNgramSettings(NgramSettings):
    """llama-server drafting from the context."""

    # Measured (bench/llamacpp_ngram.py; SmolLM2-135M Q4_1, this 2-core CPU
    # shared with other work, -t 1, reprinting 65 lines of code, 200 tokens,
    # 5 interleaved repeats, median [min, max] decode tok/s; drafted/accepted
    # over the 1,000 tokens), two runs:
    #   plain                      30.1 [25.1, 50.0] | 26.4 [21.6, 37.5]
    #   ngram-simple n=12 (llama.cpp's own)  30.5 [24.6, 51.9], 0 drafted
    #   ngram-simple n=4           34.8 [22.5, 37.9] | 27.5 [21.8, 40.3]  546/770 (71 %)
    #   ngram-simple n=3           29.6 [19.1, 41.9]                      572/946 (60 %)
    #   ngram-mod n-match=4        29.0 [20.3, 42.1]                      549/933 (59 %)
    #   ngram-mod n-match=24       31.7 [27.2, 48.1] | 34.6 [30.2, 49.4]  270/281 (96 %)
    #   ngram-map-k n=4            28.3 [25.2, 36.9] | 35.8 [22.5, 67.0]  522/647 (81 %)
    #   ngram-map-k4v n=4          35.3 [30.1, 45.6] | 35.5 [26.0, 46.9]  534/649 (82 %)
    # ngram-map-k4v at 4 was fastest in both runs (1.17x and 1.34x plain) and
    # wastes the fewest drafts of those that copy most; the spread is wide on
    # a shared CPU, so the margins over map-k and mod are not certain.
    type: NgramType = Field("ngram-map-k4v", description="llama-server's --spec-type (its "
                            "other knobs but the lookup length keep llama.cpp's defaults; set "
                            "them in llamacpp.extra_args)")  # fmt: skip
    # llama.cpp's own lookup lengths (12 tokens; ngram-mod's 24) are rarely
    # matched in a short context: on a prompt asking SmolLM2-135M to reprint
    # 65 lines of code, ngram-simple drafted nothing at 12.
    lookup: int | None = Field(None, ge=1, le=64, description="tokens of context matched before "
                               "a copy is drafted (--spec-ngram-*-size-n, ngram-mod's "
                               "--spec-ngram-mod-n-match); default: NGRAM_LOOKUP_DEFAULT")  # fmt: skip

    @property
    def lookup_length(self) -> int:
        return self.lookup or NGRAM_LOOKUP_DEFAULT


Task = Literal["generate", "embed", "rerank"]


class EmbeddingSettings(BaseModel):
    """A model that answers /v1/embeddings (task embed) or /v1/rerank (task
    rerank) rather than generating (engines/embedding/). Each value left
    unset is the checkpoint's: its sentence-transformers files
    (modules.json's pooling and Normalize), its config's Matryoshka sizes;
    a decoder that declares none pools its last token and normalizes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling: Literal["last", "mean", "cls"] | None = Field(
        None, description="hidden states to one vector: the last token's, the mean, or the first "
        "token's; default: the checkpoint's modules.json, else last")
    normalize: bool | None = Field(None, description="vectors of unit length; default: the "
                                   "checkpoint's (a Normalize module), else true")  # fmt: skip
    matryoshka: bool | None = Field(
        None, description="a request's `dimensions` may cut vectors to a prefix (Matryoshka "
        "training); default: config.json's matryoshka_dimensions or is_matryoshka")
    instruction: str | None = Field(None, min_length=1, max_length=1024, description="rerank: "
                                    "the Instruct line of each pair's prompt; default: "
                                    "Qwen3-Reranker's web-search one")  # fmt: skip
    max_batch_tokens: int | None = Field(None, gt=0, le=1 << 20, description="padded tokens "
                                         "per forward; default 16384 on a GPU, 2048 on a CPU")  # fmt: skip


class LlamaServerSettings(BaseModel):
    """How specgate runs llama-server for one GGUF model (the model's
    `llamacpp:` section; every llama.cpp engine of the model shares it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: Literal["boot", "first_use"] = "boot"
    idle_ttl_s: float | None = Field(None, gt=0, description="stop the process after this long idle")
    threads: int | None = Field(None, gt=0, description="-t; default: up to 8 cores")
    # --host and --port are specgate's, and so is the info log (no
    # --log-disable, no -lv below 3): it says the port.
    extra_args: tuple[str, ...] = Field((), description="passed through (e.g. [\"-ngl\", \"99\"])")
    read_timeout_s: float = Field(600.0, gt=0, description="longest silence in a stream before failing")
    # One event per batch of prompt (-b, 2048 tokens by default): raise it where
    # one batch or one token takes longer.
    progress_timeout_s: float = Field(60.0, gt=0, description="a request fails when llama-server "
                                      "makes no progress on it (no token, no prompt progress) "
                                      "for this long")  # fmt: skip
    # GET /health every health_interval_s; one answer missed (none within
    # health_timeout_s) makes the model unhealthy on /ready until the next
    # answer, and a process that misses health_failures in a row is stuck
    # (e.g. SIGSTOPped): it is killed, its requests fail, it restarts.
    health_interval_s: float = Field(1.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    health_failures: int = Field(3, ge=1)
    # llama.cpp's CPU kernels are not batch-invariant: a prompt whose prefix
    # came from the slot's cache can decode another greedy text than the
    # same prompt evaluated cold (engines/llamacpp/adapter.py, Determinism).
    reproducible: bool = Field(True, description="temperature-0 and seeded requests skip "
                               "llama-server's prompt cache, so what it held never changes their "
                               "text; false keeps the cache for them too (a re-sent prefix is not "
                               "evaluated again: much faster for agents that send temperature 0, "
                               "such as aider, but a warm cache may change greedy text)")  # fmt: skip
