"""OpenAI request bodies, validated with pydantic.

Bounds are the OpenAI API's own where it has them. Fields a client may send
that specgate cannot honour yet are refused by name, never silently dropped.
A chat request asks a reasoning model to think with `reasoning_effort` or,
as vLLM and llama-server take it, `chat_template_kwargs.enable_thinking`
(gateway/api/thinking.py); other template variables are not passed to the
template (a client's variable is no place for strangers' Jinja input) and
are logged. An assistant message's `reasoning_content` goes to the template,
which decides whether it is shown again (Qwen3.x's keep the turn in progress's).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from specgate.engines.base import SamplingParams
from specgate.gateway.api.plain_json import json_object_text, refuse_unsafe_json
from specgate.gateway.api.structured import ForcedTools, JsonOutput
from specgate.gateway.api.thinking import (
    EFFORTS,
    ThinkingAsk,
    either,
    from_effort,
    from_switch,
)
from specgate.gateway.config import ThinkingConfig
from specgate.gateway.errors import APIError
from specgate.gateway.serving.images import TOOL_RESULT_IMAGE, ImageRef

log = logging.getLogger(__name__)

Effort = Literal[EFFORTS]

# Fields we know and cannot honour yet, with what to tell the client.
UNSUPPORTED = {
    "functions": "the legacy `functions` field is not supported; send `tools`",
    "function_call": "the legacy `function_call` field is not supported; send `tool_choice`",
    "logit_bias": "logit_bias is not supported yet",
    "best_of": "best_of is not supported",
    "suffix": "suffix (insertion) is not supported",
    "echo": "echo is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
}
# Sent by common clients with a default meaning nothing to do.
HARMLESS_DEFAULTS = {
    "functions": ([], None),
    "function_call": ("none", "auto", None),
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
    # As llama-server's: while a stream's prompt is prefilled, chunks with no
    # choices and a `prompt_progress` {total, cache, processed, time_ms}.
    return_progress: bool = False

    _plain_json = model_validator(mode="before")(refuse_unsafe_json)

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


class ImageURL(BaseModel):
    url: StrictStr  # a data URL, or http(s) where the server fetches them
    detail: Literal["auto", "low", "high"] | None = None  # (the model's processor sizes images)


class ImagePart(BaseModel):
    """An image (gateway/serving/images.py), for a model that takes them."""

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


# OpenAI's own rule for function names.
FunctionName = Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDef(BaseModel):
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None



class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef

    def as_template_input(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(BaseModel):
    name: FunctionName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    name: StrictStr = Field(min_length=1)
    arguments: StrictStr  # JSON text of an object, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def json_object(cls, v: str):
        json_object_text(v)
        return v


class AssistantToolCall(BaseModel):
    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None  # an assistant turn's thinking, as given

    @model_validator(mode="after")
    def tool_fields_in_place(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        return self

    @property
    def images(self) -> list[ImagePart]:
        """The images the model is shown: a tool message's are told as a line
        (TOOL_RESULT_IMAGE), which is not OpenAI's format but some clients'."""
        if self.role == "tool" or not isinstance(self.content, list):
            return []
        return [p for p in self.content if isinstance(p, ImagePart)]

    def as_template_input(self) -> dict[str, Any]:
        content: str | list[dict[str, Any]]
        if self.images:  # parts, in order: the template places each image's marker
            content = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                       for p in self.content]  # fmt: skip
        elif isinstance(self.content, list):
            content = "".join(p.text if isinstance(p, TextPart) else TOOL_RESULT_IMAGE
                              for p in self.content)  # fmt: skip
        else:
            content = self.content or ""
        role = "system" if self.role == "developer" else self.role
        msg: dict[str, Any] = {"role": role, "content": content}
        if self.tool_calls:
            # Templates take arguments as a mapping (Qwen's iterate over its items).
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": json.loads(c.function.arguments or "{}")}}
                for c in self.tool_calls
            ]
        if self.role == "tool":
            msg["tool_call_id"] = self.tool_call_id
        if self.role == "assistant" and self.reasoning_content:
            msg["reasoning_content"] = self.reasoning_content
        return msg


class JsonSchemaFormat(BaseModel):
    name: FunctionName
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema: strict or not


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema: given with type "json_schema", and only then')
        return self

    def json_output(self, param: str = "response_format") -> JsonOutput | None:
        if self.type == "text":
            return None
        return JsonOutput(self.json_schema.schema_ if self.json_schema else None, param)


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)

    def image_refs(self) -> list[ImageRef]:
        """Its images, in prompt order."""
        return [ImageRef(f"messages.{i}.content.{j}.image_url", url=p.image_url.url)
                for i, m in enumerate(self.messages) if m.images
                for j, p in enumerate(m.content) if isinstance(p, ImagePart)]  # fmt: skip
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: a forced call is one call
    response_format: ResponseFormat | None = None
    reasoning_effort: Effort | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's; enable_thinking is read

    def thinking_ask(self, settings: ThinkingConfig) -> ThinkingAsk:
        kwargs = dict(self.chat_template_kwargs or {})
        switch = kwargs.pop("enable_thinking", kwargs.pop("thinking", None))
        if switch is not None and not isinstance(switch, bool):
            raise APIError(400, "chat_template_kwargs.enable_thinking: expected true or false",
                           param="chat_template_kwargs")  # fmt: skip
        if kwargs:
            log.debug("chat_template_kwargs: not passed to the template: %s", ", ".join(kwargs))
        return either(from_effort(self.reasoning_effort, settings),
                      from_switch(switch, settings), "reasoning_effort")  # fmt: skip

    @field_validator("tool_choice")
    @classmethod
    def tools_to_choose(cls, choice, info):
        if not info.data.get("tools") and choice not in (None, "none", "auto"):
            raise ValueError("the request has no tools to choose from")
        return choice

    @model_validator(mode="after")
    def strict_when_forced(self):
        # A strict function's arguments follow its schema only where the
        # grammar holds the output to calls: a forced call.
        if any(t.function.strict for t in self.tools or []) and self.forced_tools is None:
            raise ValueError("tools: strict functions are honoured with a forced call only "
                             '(tool_choice "required" or a named function); leave strict unset '
                             'or false with tool_choice "auto"')
        return self

    @property
    def forced_tools(self) -> ForcedTools | None:
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            name = None if self.tool_choice == "required" else self.tool_choice.function.name
            return ForcedTools(self.template_tools, name, self.parallel_tool_calls is not False,
                               "tool_choice")  # fmt: skip
        return None

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return [t.as_template_input() for t in self.tools or []]

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

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


