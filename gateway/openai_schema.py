"""OpenAI request bodies, validated with pydantic.

Bounds are the OpenAI API's own where it has them. Fields a client may send
that specgate cannot honour yet are refused by name, never silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from engines.base import SamplingParams

# Fields we know and cannot honour yet, with what to tell the client.
UNSUPPORTED = {
    "tools": "tool calling is not supported yet",
    "functions": "function calling is not supported yet",
    "tool_choice": "tool calling is not supported yet",
    "response_format": "structured output (response_format) is not supported yet",
    "logit_bias": "logit_bias is not supported yet",
    "best_of": "best_of is not supported",
    "suffix": "suffix (insertion) is not supported",
    "echo": "echo is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
}
# Sent by common clients with a default meaning nothing to do.
HARMLESS_DEFAULTS = {
    "tools": ([], None),
    "tool_choice": ("none", "auto", None),
    "response_format": ({"type": "text"}, None),
    "logit_bias": ({}, None),
    "best_of": (1, None),
    "suffix": (None, ""),
    "echo": (False, None),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    # Unknown fields are accepted (OpenAI adds fields often); known ones we
    # cannot honour are refused in `refuse_unsupported`.
    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1)
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None  # -1 or 0: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: StrictInt | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    user: str | None = None
    # specgate extensions, as in vLLM: return the generated token ids; keep
    # generating past EOS (benchmarks need an exact number of tokens).
    return_token_ids: bool = False
    ignore_eos: bool = False

    @model_validator(mode="after")
    def refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in HARMLESS_DEFAULTS.get(name, ()):
                raise ValueError(f"{name}: {UNSUPPORTED[name]}")
        return self

    def sampling(self, logprobs: bool, top_logprobs: int) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        if isinstance(self.content, list):
            text = "".join(p.text for p in self.content)
        else:
            text = self.content or ""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text}


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    @property
    def token_limit(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class CompletionRequest(_Body):
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def single_prompt(self):
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("prompt: one prompt per request is supported (got a batch)")
            self.prompt = p[0]
        return self


