"""OpenAI Responses API request bodies (POST /v1/responses), validated with
pydantic, and their reduction to chat-template messages.

What is served: `input` as a string or as items (messages, function,
custom-tool and local-shell calls and their outputs), `instructions`,
`tools` of every kind Codex CLI sends (gateway/api/responses_tools.py:
function, custom, namespace, local_shell; hosted ones are left out),
`tool_choice`, `text.format`, `max_output_tokens`, sampling,
`previous_response_id` (gateway/api/responses_api.py keeps responses per
key), `store`. Fields that change what an answer means and that specgate
cannot honour (background, conversation, prompt templates, logprobs) are
refused by name; hints it has nothing to act on (prompt_cache_key,
service_tier, text.verbosity, reasoning.summary, client_metadata, ...) are
read past with a debug log. `reasoning.effort` asks a reasoning model to
think, or not (gateway/api/thinking.py); its thinking comes back as a
reasoning item with the text in the clear, so an `include` of encrypted
reasoning has nothing to add. Reasoning items a client sends back
(Codex's, with encrypted_content) are dropped from the context, as are the
records of hosted tools' calls (web_search_call, ...). An `input_image` in
a user message goes to a model that takes images (gateway/serving/images.py);
any other image, file or audio is a line saying it was left out.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from specgate.engines.base import SamplingParams
from specgate.gateway.api.openai_schema import FunctionName
from specgate.gateway.api.plain_json import json_object_text, refuse_unsafe_json
from specgate.gateway.api.responses_tools import (
    HOSTED,
    LOCAL_SHELL,
    FunctionTool,
    ModelTools,
    NamespaceTool,
    Tool,
    model_name,
)
from specgate.gateway.api.structured import ForcedTools, JsonOutput
from specgate.gateway.api.thinking import EFFORTS, ThinkingAsk, from_effort
from specgate.gateway.config import ThinkingConfig
from specgate.gateway.serving.images import ImageRef

log = logging.getLogger(__name__)

UNSUPPORTED = {
    "background": "background responses are not supported",
    "conversation": "conversations are not supported; send previous_response_id or the items",
    "prompt": "prompt templates are not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses",
}
HARMLESS = {"background": (False, None), "top_logprobs": (0, None), "conversation": (None,),
            "prompt": (None,)}  # fmt: skip
# Nothing to include for any of these: reasoning is in the clear, and specgate
# runs no hosted tool. Logprobs it would have to leave out, so those are refused.
INCLUDABLE = {
    "reasoning.encrypted_content", "web_search_call.results", "web_search_call.action.sources",
    "file_search_call.results", "code_interpreter_call.outputs",
    "computer_call_output.output.image_url", "message.input_image.image_url",
}  # fmt: skip
# Items that record what a hosted tool or OpenAI's own machinery did:
# nothing a model here can read, so they are left out of its context.
RECORDS = (
    "web_search_call", "file_search_call", "computer_call", "computer_call_output",
    "image_generation_call", "code_interpreter_call", "tool_search_call", "tool_search_output",
    "additional_tools", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
    "mcp_call", "shell_call", "shell_call_output", "apply_patch_call", "apply_patch_call_output",
    "compaction", "compaction_summary", "compaction_trigger", "program", "program_output",
)  # fmt: skip


class _ItemPart(BaseModel):
    # Clients send output items back as the API gave them (ids, status, an
    # output_text's annotations and logprobs), and may send fields of newer
    # API versions: accepted, and dropped here, so a stored conversation
    # (responses_api.ResponseStore) holds only the fields read.
    model_config = ConfigDict(extra="ignore")


class InputText(_ItemPart):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class RefusalPart(_ItemPart):
    type: Literal["refusal"]
    refusal: StrictStr

    @property
    def text(self) -> str:
        return self.refusal


class MediaPart(_ItemPart):
    """An image, file or audio a model here cannot read: the model is told
    one was left out (a view_image tool's output must not end a session in
    a 400)."""

    type: Literal["input_image", "input_file", "input_audio"]
    image_url: StrictStr | None = None  # an input_image's: a data URL, or http(s)

    @property
    def text(self) -> str:
        return f"[{self.type[len('input_') :]} left out: this model reads text only]"

    @property
    def image(self) -> bool:
        """An image a vision-language model takes (gateway/serving/images.py)."""
        return self.type == "input_image" and self.image_url is not None


Part = Annotated[InputText | RefusalPart | MediaPart, Field(discriminator="type")]


def _joined(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(_ItemPart):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[Part]

    @property
    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(_ItemPart):
    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1)
    name: FunctionName
    arguments: StrictStr
    namespace: FunctionName | None = None

    @field_validator("arguments")
    @classmethod
    def json_object(cls, v: str) -> str:
        json_object_text(v)
        return v


class FunctionCallOutputItem(_ItemPart):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: StrictStr = Field(min_length=1)
    output: StrictStr | list[Part]

    @property
    def text(self) -> str:
        return _joined(self.output)


class CustomToolCallItem(_ItemPart):
    type: Literal["custom_tool_call"]
    call_id: StrictStr = Field(min_length=1)
    name: FunctionName
    input: StrictStr
    namespace: FunctionName | None = None


class LocalShellAction(_ItemPart):
    type: Literal["exec"]
    command: list[StrictStr]
    working_directory: StrictStr | None = None
    timeout_ms: StrictInt | None = None


class LocalShellCallItem(_ItemPart):
    type: Literal["local_shell_call"]
    call_id: StrictStr = Field(min_length=1)
    action: LocalShellAction


class LocalShellCallOutputItem(_ItemPart):
    type: Literal["local_shell_call_output"]
    id: StrictStr = Field(min_length=1)  # the call's
    output: StrictStr


class ReasoningItem(_ItemPart):
    type: Literal["reasoning"]


class RecordItem(_ItemPart):
    type: Literal[RECORDS]


Item = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | CustomToolCallItem
    | LocalShellCallItem | LocalShellCallOutputItem | ReasoningItem | RecordItem,
    Field(discriminator="type"),
]


def _item_with_type(value: Any) -> Any:
    # A message may leave out its type ({"role": ..., "content": ...}).
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return value | {"type": "message"}
    return value


class NamedTool(BaseModel):
    type: Literal["function", "custom"]
    name: FunctionName


class HostedChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal[HOSTED]


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
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | HostedChoice | None = None
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

    _tools: ModelTools = PrivateAttr(default_factory=lambda: ModelTools(None))

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
        ignored = sorted(set(self.model_extra or ()) - set(UNSUPPORTED))
        if ignored:
            log.debug("/v1/responses: read past %s (nothing here acts on them)", ignored)
        self._tools = ModelTools(self.tools)
        if isinstance(self.tool_choice, HostedChoice):
            raise ValueError(f"tool_choice: '{self.tool_choice.type}' is a tool OpenAI runs on its "
                             "side; specgate cannot run it")  # fmt: skip
        if not self._tools.served and self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: the request has no tools to choose from")
        if any(t.strict for t in self._functions()) and self.forced_tools is None:
            raise ValueError("tools: strict functions are honoured with a forced call only "
                             '(tool_choice "required" or a named function)')
        return self

    def thinking_ask(self, settings: ThinkingConfig) -> ThinkingAsk:
        return from_effort(self.reasoning.effort if self.reasoning else None, settings)

    def _functions(self) -> list[FunctionTool]:
        out = []
        for tool in self.tools or []:
            inner = tool.tools if isinstance(tool, NamespaceTool) else [tool]
            out += [t for t in inner if isinstance(t, FunctionTool)]
        return out

    @property
    def items(self) -> list:
        """The input's items a model reads (reasoning and hosted tools'
        records left out: debug log)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        dropped = [i.type for i in self.input if isinstance(i, ReasoningItem | RecordItem)]
        if dropped:
            log.debug("/v1/responses: input items left out of the model's context: %s", dropped)
        return [i for i in self.input if not isinstance(i, ReasoningItem | RecordItem)]

    @property
    def model_tools(self) -> ModelTools:
        return self._tools

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return self._tools.template

    @property
    def parse_tools(self) -> bool:
        return bool(self._tools.served) and self.tool_choice != "none"

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


def _with_images(item: MessageItem) -> bool:
    return item.role == "user" and isinstance(item.content, list) and any(
        isinstance(p, MediaPart) and p.image for p in item.content)


def image_refs(items: list) -> list[ImageRef]:
    """The images of the user messages among `items`, in prompt order."""
    return [ImageRef(f"input.{i}.content.{j}.image_url", url=p.image_url)
            for i, item in enumerate(items) if isinstance(item, MessageItem) and _with_images(item)
            for j, p in enumerate(item.content) if isinstance(p, MediaPart) and p.image]  # fmt: skip


def template_messages(instructions: str | None, items: list,
                      images: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Items as chat-template messages: the instructions and the system or
    developer messages before any other as one system message, calls
    joining the assistant turn they follow (under the name the model sees
    the tool by), their outputs as tool messages. `images`: a user
    message's images stay parts (image_refs), for a model that takes them."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    for item in items:
        if isinstance(item, MessageItem) and images and _with_images(item):
            out.append({"role": "user", "content": [
                {"type": "image"} if isinstance(p, MediaPart) and p.image else {"type": "text", "text": p.text}
                for p in item.content]})  # fmt: skip
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            if role == "system" and out and all(m["role"] == "system" for m in out):
                # One system message at the start: Codex sends several
                # developer messages, and Qwen's templates refuse a system
                # message anywhere but first.
                out[0]["content"] += "\n\n" + item.text
            else:
                out.append({"role": role, "content": item.text})
            continue
        if isinstance(item, FunctionCallItem):
            name, arguments = model_name(item.namespace, item.name), json.loads(item.arguments or "{}")
        elif isinstance(item, CustomToolCallItem):
            name, arguments = model_name(item.namespace, item.name), {"input": item.input}
        elif isinstance(item, LocalShellCallItem):
            name = LOCAL_SHELL
            arguments = item.action.model_dump(exclude={"type"}, exclude_none=True)
        else:
            call_id = item.id if isinstance(item, LocalShellCallOutputItem) else item.call_id
            text = item.output if isinstance(item, LocalShellCallOutputItem) else item.text
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            continue
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        out[-1].setdefault("tool_calls", []).append(
            {"id": item.call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}})  # fmt: skip
    return out
