"""Translating between specgate's engine types and llama-server's /completion API.

Pure functions, tested directly. What llama-server (b11312) does differently
from specgate's sampling (engines/sampling.py), and what we do about it:

- Sampler order: llama.cpp's default chain applies temperature *last*, after
  top-k/top-p/min-p, which changes which tokens top-p and min-p keep. We send
  `samplers` in specgate's order: penalties -> temperature -> top-k -> top-p
  -> min-p (the final `dist` draw is appended by llama.cpp).
- Defaults: llama-server's own defaults are top_k 40, top_p 0.95, min_p 0.05
  and a 0.8 temperature; every field is sent explicitly so none leaks in.
- Repetition penalty: the same formula and, with `repeat_last_n` covering the
  whole request, the same window (prompt + output, vLLM's meaning).
- Presence/frequency penalties: llama.cpp counts prompt tokens too; specgate
  (like OpenAI) counts generated tokens only. Not expressible: refused.
- Logprobs: llama.cpp reports log-softmax of the raw logits, specgate of the
  logits after penalties: equal without penalties, refused with them. With
  draft-mtp, llama-server reports no probabilities for tokens that came out
  of a speculative round: refused there.
- Seeds: honoured (same seed, same output on the same server), but llama.cpp
  draws its own random stream, so a seed does not reproduce an MLX engine's
  sample; the distribution is the same.
- Grammars: a JSON-schema constraint goes as `json_schema` (llama.cpp turns
  it into its own grammar), its fixed prefix (a forced call's opening tag)
  as prompt, the engine writing prefix and suffix into the text. llama.cpp samples first and masks only to
  resample a token the grammar refuses, which is the masked distribution
  greedy but not above temperature 0: refused there, and for grammars that
  are not one JSON schema (a forced tool call).
- Determinism: llama.cpp's CPU kernels are not batch-invariant. A token's
  hidden state depends on how many rows its forward pass had (flash
  attention tiles 64+ query rows and splits one row's KV over the threads
  past 512 cells; Q8_0 matmuls go through llamafile's sgemm for several
  rows, vec_dot for one), so a prompt whose prefix comes from the slot's
  cache (evaluated in other batches, or token by token as output) yields
  other logits than the same prompt evaluated cold, and greedy text
  drifts once two candidates are close (bench/llamacpp_divergence.py). A
  request that asks for determinism (temperature 0, or a seed) is sent
  with `cache_prompt: false`: every such request evaluates its whole
  prompt the same way, so the same request gives the same text whatever
  the cache held. Speculation (verify batches of k+1 rows) and
  concurrent requests in other slots (a shared batch) can still change it
  (README, "GGUF models through llama.cpp", says how often).
- Thinking budgets: llama-server's own reasoning-budget sampler, which
  counts as engines/grammar/thinking.py does (the budget's tokens after the
  opening marker, then the closing one forced); the opening marker of a
  prompt that opened the thinking goes as its `generation_prompt`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specgate.engines.base import (
    FinishReason,
    GenerationRequest,
    Method,
    PrefillProgress,
    Refusal,
    RoundStats,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
)

SAMPLER_ORDER = ("penalties", "temperature", "top_k", "top_p", "min_p")
_SEED_MODULUS = 2**31 - 1  # llama.cpp reads the seed through an int32 field; -1 means random


def refusal(sampling: SamplingParams, speculative: bool) -> Refusal | None:
    """Why llama-server cannot serve these sampling parameters exactly, if it cannot."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(sampling, name) != 0.0:
            return Refusal(
                "penalties",
                f"{name}: llama.cpp counts the prompt's tokens in this penalty, specgate (like "
                "OpenAI) only the generated ones, so llama-server cannot apply it exactly",
                name,
            )
    if sampling.logprobs and speculative:
        return Refusal(
            "unsupported_params",
            "logprobs: llama-server reports no token probabilities for tokens produced by "
            "speculation",
            "logprobs",
        )
    constraint = sampling.constraint
    if constraint is not None and constraint.json_schema is None:
        return Refusal(
            "unsupported_params",
            f"{constraint.param}: llama-server takes one JSON schema, so a forced tool call "
            "there is one call in Qwen's JSON (hermes) format: set parallel_tool_calls false "
            "(Anthropic: disable_parallel_tool_use)",
            constraint.param,
        )
    if constraint is not None and not sampling.greedy:
        return Refusal(
            "unsupported_params",
            f"{constraint.param}: llama-server applies a grammar after its samplers (it samples, "
            "then resamples from the masked distribution if the token breaks the grammar), so "
            "above temperature 0 it does not sample specgate's masked distribution; use "
            "temperature 0, or an MLX engine",
            constraint.param,
        )
    if sampling.logprobs and sampling.repetition_penalty != 1.0:
        return Refusal(
            "penalties",
            "logprobs: with repetition_penalty, llama-server reports probabilities before the "
            "penalty and specgate after it",
            "logprobs",
        )
    return None


# What a request that asks for determinism (adapter docstring: Determinism)
# sends: its whole prompt evaluated cold, as every other such request is.
DETERMINISTIC_BODY = {"cache_prompt": False}


def deterministic(sampling: SamplingParams) -> bool:
    """Whether a request asks for reproducible text: greedy, or seeded."""
    return sampling.greedy or sampling.seed is not None


def deterministic_flags() -> list[str]:
    """llama-server flags specgate adds for determinism: none. Which flags
    would make cold and warm prompts equal depends on the weights' type
    (`-ub 32` kept a Q4_1 model batch-invariant; weights llamafile's sgemm
    takes need `-ub 1`, every token its own forward pass), and they cost
    every request's prefill; bench/llamacpp_divergence.py --small-ubatch
    measures one."""
    return []


def completion_body(request: GenerationRequest, prefix_tokens: list[int] = (),
                    reproducible: bool = True) -> dict:
    """The streaming /completion body for a request (token-id prompt, all
    samplers explicit); `prefix_tokens`: its constraint's fixed prefix, as
    prompt (the schema covers what follows)."""
    s = request.sampling
    body = {
        "prompt": [*request.prompt_tokens, *prefix_tokens],
        "n_predict": request.max_tokens,
        "stream": True,
        "return_tokens": True,
        # An event per batch of prompt evaluated: the engine's progress deadline
        # counts a long prefill as progress (engine.py).
        "return_progress": True,
        "cache_prompt": True,  # off for a deterministic request, below
        "samplers": list(SAMPLER_ORDER),
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repeat_penalty": s.repetition_penalty,
        "repeat_last_n": len(request.prompt_tokens) + request.max_tokens,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        # Off whatever the server was started with: not part of specgate's distribution.
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "typical_p": 1.0,
        "top_n_sigma": -1.0,
        "mirostat": 0,
        "min_keep": 0,
        "seed": -1 if s.seed is None else s.seed % _SEED_MODULUS,
        # specgate decides where generation stops: with no stop ids (ignore_eos)
        # the server must not stop at its end-of-generation tokens either.
        "ignore_eos": not request.stop_token_ids,
    }
    if reproducible and deterministic(s):  # (the model's llamacpp.reproducible)
        body |= DETERMINISTIC_BODY
    if s.logprobs:
        body["n_probs"] = max(1, s.top_logprobs)
    if s.constraint is not None:  # refusal() let only JSON schemas through
        body["json_schema"] = json.loads(s.constraint.json_schema)
    if s.thinking is not None and s.thinking.budget is not None:
        # The message's handler is what makes the closing tag the forced
        # sequence (b11312's server-schema.cpp): sent empty, it forces the tag alone.
        body |= {"reasoning_budget_tokens": s.thinking.budget,
                 "reasoning_budget_start_tag": s.thinking.start_text,
                 "reasoning_budget_end_tag": s.thinking.end_text,
                 "reasoning_budget_message": ""}  # fmt: skip
        if s.thinking.opened:
            body["generation_prompt"] = s.thinking.start_text
    return body


class _TemplateWords(dict):
    """A chat template as the vocabulary mlx-lm's thinking inference reads:
    a marker is "in" it when the template writes it."""

    def __init__(self, template: str):
        super().__init__()
        self.template = template

    def __contains__(self, word: object) -> bool:
        return isinstance(word, str) and word in self.template

    def __getitem__(self, word: str) -> int:
        return -1  # the ids come from llama-server


class _TemplateOnly:
    def __init__(self, template: str):
        self.words = _TemplateWords(template)

    def get_vocab(self) -> dict:
        return self.words

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return []


def thinking_markers(template: str | None) -> tuple[str, str] | None:
    """The thinking markers a chat template writes, among those mlx-lm
    knows (`tokenizer_utils._infer_thinking`), or None."""
    if not template:
        return None
    from mlx_lm.tokenizer_utils import _infer_thinking  # pinned mlx-lm (uv.lock)

    start, end, _, _ = _infer_thinking(_TemplateOnly(template))
    return None if start is None else (start, end)


@dataclass
class ChunkResult:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None
    cached_tokens: int = 0


_STOP_TYPES: dict[str, FinishReason] = {"eos": "stop", "word": "stop", "limit": "length"}


def read_chunk(chunk: dict, request: GenerationRequest) -> ChunkResult:
    """One streamed /completion chunk as specgate's tokens, text and finish reason.

    A token in the request's stop set ends generation and, as in the MLX
    engines, is not part of the output. Not for a prompt-progress event
    (read_progress): llama-server fills its `tokens` with a placeholder 0.
    """
    tokens = [int(t) for t in chunk.get("tokens") or []]
    text = chunk.get("content") or ""
    finish: FinishReason | None = None
    stops = request.stop_token_ids
    cut = next((i for i, t in enumerate(tokens) if t in stops), None)
    if cut is not None:
        tokens, finish = tokens[:cut], "stop"
        if cut == 0:
            text = ""  # the stop token's own text (if the server sent one) is not output
    elif chunk.get("stop"):
        finish = _STOP_TYPES.get(chunk.get("stop_type", ""), "stop")
    logprobs = None
    if request.sampling.logprobs and tokens:
        k = request.sampling.top_logprobs
        logprobs = [_logprob(p, k) for p in chunk.get("completion_probabilities") or []][: len(tokens)]
    timings = chunk.get("timings") or {}
    return ChunkResult(tokens, text, finish, logprobs, int(timings.get("cache_n", 0)))


def read_progress(chunk: dict) -> PrefillProgress | None:
    """A prompt-progress event (`return_progress`) as specgate's; its
    `processed` counts the cached tokens too, as PrefillProgress does. None
    for other chunks, and where it says nothing a stream would show: before
    the first batch, and after the last (the first token follows)."""
    p = chunk.get("prompt_progress")
    if not isinstance(p, dict):
        return None
    try:
        progress = PrefillProgress(int(p["processed"]), int(p["total"]), int(p.get("cache", 0)))
    except (KeyError, TypeError, ValueError):
        return None
    return progress if progress.cached < progress.processed < progress.total else None


def _logprob(p: dict, k: int) -> TokenLogprob:
    top = tuple(TopLogprob(int(t["id"]), t.get("token", ""), float(t["logprob"]))
                for t in (p.get("top_logprobs") or [])[:k])
    return TokenLogprob(int(p["id"]), p.get("token", ""), float(p["logprob"]), top)


# --- speculation counters from llama-server's /metrics ---------------------


@dataclass(frozen=True)
class SpecCounters:
    """llama-server's cumulative `llamacpp:spec_decode_*` counters."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    def minus(self, earlier: SpecCounters) -> SpecCounters:
        """Counts since `earlier`; a server that restarted counts from zero again."""
        if self.drafts < earlier.drafts or self.draft_tokens < earlier.draft_tokens:
            return self
        n = max(len(self.accepted_per_pos), len(earlier.accepted_per_pos))
        now = self.accepted_per_pos + (0,) * (n - len(self.accepted_per_pos))
        before = earlier.accepted_per_pos + (0,) * (n - len(earlier.accepted_per_pos))
        return SpecCounters(
            self.drafts - earlier.drafts,
            self.draft_tokens - earlier.draft_tokens,
            self.accepted - earlier.accepted,
            tuple(a - b for a, b in zip(now, before, strict=True)),
        )


def parse_spec_counters(text: str) -> SpecCounters:
    """Read the spec-decode counters out of llama-server's Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    per_pos: dict[int, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "llamacpp:spec_decode_num_accepted_tokens_per_pos_total":
                per_pos[int(sample.labels["position"])] = int(sample.value)
            else:
                values[sample.name] = sample.value
    n = max(per_pos) + 1 if per_pos else 0
    return SpecCounters(
        int(values.get("llamacpp:spec_decode_num_drafts_total", 0)),
        int(values.get("llamacpp:spec_decode_num_draft_tokens_total", 0)),
        int(values.get("llamacpp:spec_decode_num_accepted_tokens_total", 0)),
        tuple(per_pos.get(i, 0) for i in range(n)),
    )


def rounds_from_counters(model: str, method: Method, c: SpecCounters) -> list[RoundStats]:
    """Rounds whose totals are exactly `c`, for the one RoundStats sink.

    llama-server exports sums, not rounds. Acceptance is a prefix in every
    round, so round j accepted position i iff fewer than accepted_per_pos[i]
    rounds before it did: that rebuilds the per-position counts exactly. The
    rejected draft tokens are spread over the rounds; only their sum is known.
    """
    if c.drafts <= 0:
        return []
    accepted_len = [sum(1 for a in c.accepted_per_pos if a > j) for j in range(c.drafts)]
    rejected = max(0, c.draft_tokens - sum(accepted_len))
    rounds = []
    for j, n_ok in enumerate(accepted_len):
        extra = rejected // c.drafts + (1 if j < rejected % c.drafts else 0)
        drafted = n_ok + extra
        rounds.append(RoundStats(model, method, drafted, [True] * n_ok + [False] * extra,
                                 verify_width=drafted + 1))
    return rounds
