"""OpenAI Responses API request bodies (POST /v1/responses), validated with
pydantic, and their reduction to chat-template messages.

What is served: `input` as a string or as items (messages with text
content, function calls and their outputs), `instructions`, function
`tools`, `tool_choice`, `text.format`, `max_output_tokens`, sampling,
`previous_response_id` (gateway/api/responses_api.py keeps responses per key).
Known fields specgate cannot honour are refused by name. `reasoning.effort`
asks a reasoning model to think, or not (gateway/api/thinking.py); its
thinking comes back as a reasoning item with the text in the clear, so an
`include` of encrypted reasoning has nothing to add. Reasoning items a
client sends back are dropped from the context.
"""

from __future__ import annotations

import json
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
from specgate.gateway.api.openai_schema import FunctionName
from specgate.gateway.api.plain_json import json_object_text, refuse_unsafe_json
from specgate.gateway.api.structured import ForcedTools, JsonOutput
from specgate.gateway.api.thinking import EFFORTS, ThinkingAsk, from_effort
from specgate.gateway.config import ThinkingConfig

UNSUPPORTED = {
    "background": "background responses are not supported",
    "conversation": "conversations are not supported; send previous_response_id or the items",
    "prompt": "prompt templates are not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses",
}
HARMLESS = {"background": (False, None), "top_logprobs": (0, None), "conversation": (None,),
            "prompt": (None,)}  # fmt: skip
INCLUDABLE = {"reasoning.encrypted_content"}  # nothing to add: reasoning is in the clear


class _ItemPart(BaseModel):
    # Clients send output items back as the API gave them (ids, status, an
    # output_text's annotations and logprobs), and may send fields of newer
    # API versions: accepted, and dropped here, so a stored conversation
    # (responses_api.ResponseStore) holds only the fields read.
    model_config = ConfigDict(extra="ignore")


class InputText(_ItemPart):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class MessageItem(_ItemPart):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[InputText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_ItemPart):
    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1)
    name: FunctionName
    arguments: StrictStr

    @field_validator("arguments")
    @classmethod
    def json_object(cls, v: str) -> str:
        json_object_text(v)
        return v


class FunctionCallOutputItem(_ItemPart):
    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1)
    output: StrictStr | list[InputText]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_ItemPart):
    type: Literal["reasoning"]


Item = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]


def _item_with_type(value: Any) -> Any:
    # A message may leave out its type ({"role": ..., "content": ...}).
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return value | {"type": "message"}
    return value


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_template_input(self) -> dict[str, Any]:
        fn = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn | {"parameters": self.parameters or {
            "type": "object", "properties": {}}}}  # fmt: skip


class NamedTool(BaseModel):
    type: Literal["function"]
    name: FunctionName


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def schema_given(self):
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError('a "json_schema" format names its schema and gives it')
        return self


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity: a hint

    format: TextFormat | None = None


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="allow")  # summary: the whole text is given, no summary

    effort: Literal[EFFORTS] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    _plain_json = model_validator(mode="before")(refuse_unsafe_json)

    model: StrictStr = Field(min_length=1)
    input: StrictStr | list[Annotated[Item, Field()]]
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: StrictInt | None = None  # a specgate extension, as on chat completions
    previous_response_id: StrictStr | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, StrictStr] | None = None
    user: str | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["disabled"] | None = None
    include: list[StrictStr] | None = None

    @model_validator(mode="after")
    def includable(self):
        unknown = sorted(set(self.include or ()) - INCLUDABLE)
        if unknown:
            raise ValueError(f"include: {', '.join(unknown)} cannot be included")
        return self

    @model_validator(mode="before")
    @classmethod
    def typed_items(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = data | {"input": [_item_with_type(v) for v in data["input"]]}
        return data

    @model_validator(mode="after")
    def refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in HARMLESS.get(name, ()):
                raise ValueError(f"{name}: {UNSUPPORTED[name]}")
        if not self.tools and self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: the request has no tools to choose from")
        if any(t.strict for t in self.tools or []) and self.forced_tools is None:
            raise ValueError("tools: strict functions are honoured with a forced call only "
                             '(tool_choice "required" or a named function)')
        return self

    def thinking_ask(self, settings: ThinkingConfig) -> ThinkingAsk:
        return from_effort(self.reasoning.effort if self.reasoning else None, settings)

    @property
    def items(self) -> list:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return [i for i in self.input if not isinstance(i, ReasoningItem)]

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return [t.as_template_input() for t in self.tools or []]

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> ForcedTools | None:
        choice = self.tool_choice
        if choice == "required" or isinstance(choice, NamedTool):
            return ForcedTools(self.template_tools, None if choice == "required" else choice.name,
                               self.parallel_tool_calls is not False, "tool_choice")  # fmt: skip
        return None

    @property
    def json_output(self) -> JsonOutput | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        return JsonOutput(fmt.schema_, "text.format")

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
        )


def template_messages(instructions: str | None, items: list) -> list[dict[str, Any]]:
    """Items as chat-template messages: function calls join the assistant
    turn they follow, their outputs become tool messages."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.name, "arguments": json.loads(item.arguments or "{}")}})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return out
