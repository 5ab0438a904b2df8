"""Ollama's request bodies (/api/chat, /api/generate, /api/show), validated
with pydantic.

Ollama's own rules where a client relies on them: `stream` is true unless
the request says false; tool calls carry their arguments as an object; an
empty `messages` or `prompt` only loads the model. Sampling `options` left
unset take specgate's defaults, as on every other API, not Ollama's
built-in ones (temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1),
which a model's Modelfile usually overrides and specgate has no Modelfile.

Read and honoured: the sampling options, `num_predict` (-1 and -2: up to
the end of the context), `stop`, `num_ctx` (checked against the model's
context), `format` ("json" or a JSON schema: the structured-output path),
`tools`, `logprobs`, `think` (true/false or an effort, as the other APIs'
asks: gateway/api/thinking.py). Accepted and ignored, with a debug log: `keep_alive`
(residency is the config's: `idle_ttl_s`, `pin`), options that steer
Ollama's runner (num_gpu, num_thread, use_mmap, ...), and fields and
options this version does not know (Ollama ignores unknown options too).
A chat message's `images` and /api/generate's (base64) go to a model that
takes images (gateway/serving/images.py), before the text as Ollama places
them. Refused by name when set: images with `raw`, `suffix`, a per-request
`template`, the deprecated `context`, and sampling specgate cannot do the
same way (mirostat, typical_p, tfs_z, a repeat_last_n window).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from specgate.engines.base import SamplingParams
from specgate.gateway.api import openai_schema
from specgate.gateway.api.plain_json import json_object_text, refuse_unsafe_json
from specgate.gateway.api.structured import JsonOutput
from specgate.gateway.api.thinking import ThinkingAsk, from_effort, from_switch
from specgate.gateway.config import ThinkingConfig
from specgate.gateway.serving.images import ImageRef

log = logging.getLogger(__name__)

# Options that steer how Ollama's runner loads and runs a model, none of
# which changes what is sampled: specgate's config decides those.
RUNNER_OPTIONS = frozenset({
    "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
    "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
    "penalize_newline", "mirostat_tau", "mirostat_eta",
})  # fmt: skip


def _ignored(what: str, names) -> None:
    for name in names:
        log.debug("ollama: %s %r ignored", what, name)


def _neutral(value, neutral, message: str):
    if value is not None and value != neutral:
        raise ValueError(message)
    return value


class Options(BaseModel):
    model_config = ConfigDict(extra="allow")

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None  # 0 or -1: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: StrictInt | None = None  # negative: a random seed, as Ollama's -1
    num_predict: Annotated[StrictInt, Field(ge=-2)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repeat_last_n: Annotated[StrictInt, Field(ge=-1)] | None = None  # -1: the whole context
    num_ctx: Annotated[StrictInt, Field(ge=1)] | None = None
    mirostat: StrictInt | None = None
    typical_p: StrictFloat | StrictInt | None = None
    tfs_z: StrictFloat | StrictInt | None = None

    @field_validator("num_predict")
    @classmethod
    def some_tokens(cls, v):
        if v == 0:
            raise ValueError("at least 1 token, or -1 (up to the end of the context)")
        return v

    @field_validator("mirostat")
    @classmethod
    def no_mirostat(cls, v):
        return _neutral(v, 0, "Mirostat sampling is not supported; leave it 0")

    @field_validator("typical_p")
    @classmethod
    def no_typical(cls, v):
        return _neutral(v, 1, "locally typical sampling is not supported; leave it 1.0")

    @field_validator("tfs_z")
    @classmethod
    def no_tail_free(cls, v):
        return _neutral(v, 1, "tail-free sampling is not supported; leave it 1.0")

    @model_validator(mode="after")
    def whole_context_penalties(self):
        if self.repeat_last_n not in (None, -1, 0) and self._penalised:
            raise ValueError(
                "repeat_last_n: specgate's penalties count every token of the context; "
                "send -1 (the whole context), 0 (no penalties) or leave it unset"
            )
        _ignored("option", self.model_extra or {})
        return self

    @property
    def _penalised(self) -> bool:
        return (self.repeat_penalty not in (None, 1.0) or bool(self.presence_penalty)
                or bool(self.frequency_penalty))  # fmt: skip

    def sampling(self, logprobs: bool, top_logprobs: int) -> SamplingParams:
        penalties = self.repeat_last_n != 0  # Ollama's 0: penalties off
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            min_p=self.min_p or 0.0,
            seed=None if self.seed is None or self.seed < 0 else self.seed,
            presence_penalty=(self.presence_penalty or 0.0) if penalties else 0.0,
            frequency_penalty=(self.frequency_penalty or 0.0) if penalties else 0.0,
            repetition_penalty=(self.repeat_penalty or 1.0) if penalties else 1.0,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )


class _Generation(BaseModel):
    """What /api/chat and /api/generate both take."""

    model_config = ConfigDict(extra="allow")

    _plain_json = model_validator(mode="before")(refuse_unsafe_json)

    model: StrictStr = Field(min_length=1)
    stream: StrictBool = True  # Ollama streams unless told not to
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: StrictStr | StrictInt | StrictFloat | None = None
    think: StrictBool | Literal["low", "medium", "high"] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def accepted(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        _ignored("field", self.model_extra or {})
        _ignored("field", [k for k in ("keep_alive",) if getattr(self, k) is not None])
        return self

    def thinking_ask(self, settings: ThinkingConfig) -> ThinkingAsk:
        """`think`: true or false, or an effort (gpt-oss's levels), as the
        other APIs' asks (gateway/api/thinking.py)."""
        if isinstance(self.think, str):
            return from_effort(self.think, settings)
        return from_switch(self.think, settings)

    @property
    def sampling_options(self) -> Options:
        return self.options or Options()

    @property
    def json_output(self) -> JsonOutput | None:
        if self.format == "json":
            return JsonOutput(None, "format")
        return JsonOutput(self.format, "format") if isinstance(self.format, dict) else None


def _content(text: str, images: list[str] | None) -> str | list[dict[str, Any]]:
    """A message's template content: its images, then its text, as Ollama places them."""
    if not images:
        return text
    return [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow")  # index

    name: StrictStr = Field(min_length=1)
    # An object, as Ollama sends it; JSON text of one, as OpenAI's clients do.
    arguments: dict[str, Any] | StrictStr = Field(default_factory=dict)

    @field_validator("arguments")
    @classmethod
    def an_object(cls, v):
        return json_object_text(v) if isinstance(v, str) else v


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")  # type

    id: StrictStr | None = None
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr | None = None
    images: list[StrictStr] | None = None  # base64, for a model that takes them
    tool_calls: list[ToolCall] | None = None
    tool_name: StrictStr | None = None  # a tool message: the tool that answered
    tool_call_id: StrictStr | None = None
    # An earlier turn's thinking: given to the template as the turn's
    # reasoning_content, which Qwen3.x's show only for the turn in progress
    # (a tool loop's), as the OpenAI route does.
    thinking: StrictStr | None = None

    @model_validator(mode="after")
    def calls_in_place(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        if self.images and self.role != "user":
            raise ValueError("images: only user messages carry images")
        return self

    def as_template_input(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": self.role, "content": _content(self.content or "", self.images)}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                | ({"id": c.id} if c.id else {})
                for c in self.tool_calls
            ]  # fmt: skip
        if self.role == "tool":
            msg |= {"tool_call_id": self.tool_call_id} if self.tool_call_id else {}
            msg |= {"name": self.tool_name} if self.tool_name else {}
        if self.role == "assistant" and self.thinking:
            msg["reasoning_content"] = self.thinking
        return msg


class Tool(openai_schema.Tool):
    type: Literal["function"] = "function"  # Ollama's clients may leave it out


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list)  # none: load the model only
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def ends_with_a_question(self):
        if self.messages and self.messages[-1].role == "assistant":
            raise ValueError("messages: the last message is the assistant's; continuing an "
                             "assistant message is not supported")  # fmt: skip
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]

    def image_refs(self) -> list[ImageRef]:
        """Its images, in prompt order."""
        return [ImageRef(f"messages.{i}.images.{j}", data=image)
                for i, m in enumerate(self.messages) for j, image in enumerate(m.images or [])]  # fmt: skip

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return [t.as_template_input() for t in self.tools or []]


class GenerateRequest(_Generation):
    prompt: StrictStr = ""  # empty: load the model only
    system: StrictStr | None = None
    raw: StrictBool = False  # the prompt as given, no chat template
    suffix: StrictStr | None = None
    template: StrictStr | None = None
    context: list[Any] | None = None
    images: list[StrictStr] | None = None  # base64, for a model that takes them

    @model_validator(mode="after")
    def refuse_unsupported(self):
        if self.images and self.raw:
            raise ValueError("images: a raw prompt has no place for them (the model's template "
                             "places an image's marker); send them without raw")  # fmt: skip
        if self.suffix:
            raise ValueError("suffix: fill-in-the-middle is not supported")
        if self.template:
            raise ValueError(
                "template: a per-request prompt template is not supported; "
                "specgate applies the model's own chat template (none with raw)"
            )
        if self.context:
            raise ValueError("context: the deprecated token history is not supported; send the "
                             "conversation to /api/chat as messages")  # fmt: skip
        if self.raw and self.system:
            raise ValueError("system: has no place in a raw prompt, which is sent as given")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """The prompt as one user message, its images before its text as
        Ollama places them (a chat message's, ChatMessage)."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [{"role": "user", "content": _content(self.prompt, self.images)}]

    def image_refs(self) -> list[ImageRef]:
        return [ImageRef(f"images.{j}", data=image) for j, image in enumerate(self.images or [])]


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbose

    _plain_json = model_validator(mode="before")(refuse_unsafe_json)

    model: StrictStr | None = Field(None, min_length=1)
    name: StrictStr | None = Field(None, min_length=1)  # what older clients send

    @model_validator(mode="after")
    def named(self):
        if not (self.model or self.name):
            raise ValueError("model: required")
        return self

    @property
    def model_name(self) -> str:
        return self.model or self.name or ""
