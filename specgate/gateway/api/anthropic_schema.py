"""Anthropic Messages API request bodies, validated with pydantic.

Bounds are Anthropic's own (temperature 0..1, max_tokens required). A user
message's images go to a model that takes them (gateway/serving/images.py),
a tool result's become a line saying one was left out (`TOOL_RESULT_IMAGE`);
content blocks specgate cannot give a model (documents, search results) are
refused by name; fields that only steer Anthropic's service (metadata, service_tier,
cache_control on blocks) are accepted and ignored. `thinking` is accepted
in every form clients send (Claude Code sends `adaptive` on every turn) and
maps onto a reasoning model's thinking (gateway/api/thinking.py); a model
that cannot think answers without. A thinking block sent back goes to the
chat template as the turn's `reasoning_content` when its signature is this
server's (the template decides whether it is shown again: Qwen3.x's keep
the turn in progress's thinking and drop earlier turns', as Anthropic
does). One whose signature is not (another server's, a client's own text)
is dropped rather than refused: it would end an agent's session that moved
between servers, and leaving it out costs only the model's view of its
own earlier thinking.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from specgate.engines.base import SamplingParams
from specgate.gateway.api.plain_json import refuse_unsafe_json
from specgate.gateway.api.structured import ForcedTools
from specgate.gateway.api.thinking import UNSAID, ThinkingAsk, from_switch, verify
from specgate.gateway.config import ThinkingConfig
from specgate.gateway.serving.images import TOOL_RESULT_IMAGE, ImageRef

log = logging.getLogger(__name__)

# Fields Anthropic defines that specgate cannot honour, with what to say.
UNSUPPORTED = {
    "mcp_servers": "MCP connectors are not supported",
    "container": "code-execution containers are not supported",
    "output_format": "structured outputs are not supported",
}


class _Block(BaseModel):
    # cache_control, citations and the like steer Anthropic's service only.
    model_config = ConfigDict(extra="allow")


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: StrictStr = Field(min_length=1)
    name: StrictStr = Field(min_length=1)
    input: dict[str, Any]


class ImageSource(BaseModel):
    type: Literal["base64", "url"]
    media_type: StrictStr | None = None  # (the bytes say what they are)
    data: StrictStr | None = None
    url: StrictStr | None = None

    @model_validator(mode="after")
    def complete(self):
        if self.type == "base64" and self.data is None:
            raise ValueError("source.data: a base64 image carries its data")
        if self.type == "url" and self.url is None:
            raise ValueError("source.url: a url image names it")
        return self


class ImageBlock(_Block):
    """An image (gateway/serving/images.py), for a model that takes them."""

    type: Literal["image"]
    source: ImageSource


class ToolResultBlock(_Block):
    """A tool's output. Its images (Claude Code's Read of a PNG, a screenshot
    tool's) become a line saying so (gateway/serving/images.py's
    TOOL_RESULT_IMAGE)."""

    type: Literal["tool_result"]
    tool_use_id: StrictStr = Field(min_length=1)
    content: StrictStr | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: StrictBool = False

    @property
    def text(self) -> str:
        text = (
            self.content
            if isinstance(self.content, str)
            else "".join(b.text if isinstance(b, TextBlock) else TOOL_RESULT_IMAGE for b in self.content)
        )
        # The template has no place for the flag, so the model reads it as words.
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Block):
    """An assistant turn's thinking, sent back as clients do (module docstring)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: StrictStr | None = None
    signature: StrictStr | None = None

    def verified(self) -> str:
        """Its text where this server signed it, else "" (logged)."""
        if self.type != "thinking" or not self.thinking:
            return ""
        if verify(self.thinking, self.signature):
            return self.thinking
        log.debug("a thinking block whose signature is not this server's was left out")
        return ""


class ServerRecordBlock(_Block):
    """What one of Anthropic's server tools did (a web search and its
    results, ...), sent back in the history: no tool here ran it and no
    model here reads it, so it is left out of the context."""

    type: Literal["server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                  "code_execution_tool_result", "bash_code_execution_tool_result",
                  "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
                  "container_upload", "tool_search_tool_result"]  # fmt: skip


class UnsupportedBlock(_Block):
    type: Literal["document", "search_result"]

    @model_validator(mode="after")
    def refuse(self):
        raise ValueError(f"{self.type} content blocks are not supported")


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | ServerRecordBlock
    | ImageBlock | UnsupportedBlock,
    Field(discriminator="type"),
]


class Message(BaseModel):
    # "system": instructions in the middle of the conversation (Claude Code
    # 2.1.332 sends its environment so, after the first user turn).
    role: Literal["user", "assistant", "system"]
    content: StrictStr | list[Block]

    @model_validator(mode="after")
    def blocks_in_place(self):
        if isinstance(self.content, list):
            kinds = {b.type for b in self.content}
            if self.role == "system" and kinds - {"text"}:
                raise ValueError("a system message carries text blocks only")
            if self.role == "user" and "tool_use" in kinds:
                raise ValueError("tool_use blocks belong in assistant messages")
            if self.role == "assistant" and "tool_result" in kinds:
                raise ValueError("tool_result blocks belong in user messages")
            if self.role == "user" and kinds & {"thinking", "redacted_thinking"}:
                raise ValueError("thinking blocks belong in assistant messages")
            if self.role != "user" and "image" in kinds:
                raise ValueError("image blocks belong in user messages")
        return self

    def as_template_input(self) -> list[dict[str, Any]]:
        """One or more template messages: a user turn's tool results become
        `tool` messages (answering the calls before them), then its text."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        records = [b.type for b in self.content if isinstance(b, ServerRecordBlock)]
        if records:
            log.debug("left out of the context: server tools' records %s", records)
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        if self.role == "system":
            return [{"role": "system", "content": text}]
        if self.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            thought = "".join(b.verified() for b in self.content if isinstance(b, ThinkingBlock))
            if thought:
                msg["reasoning_content"] = thought
            calls = [b for b in self.content if isinstance(b, ToolUseBlock)]
            if calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.input}}
                    for c in calls
                ]  # fmt: skip
            return [msg]
        out = [
            {"role": "tool", "content": b.text, "tool_call_id": b.tool_use_id}
            for b in self.content
            if isinstance(b, ToolResultBlock)
        ]
        if any(isinstance(b, ImageBlock) for b in self.content):
            # Parts, in order: the template places each image's marker.
            parts = [{"type": "text", "text": b.text} if isinstance(b, TextBlock) else {"type": "image"}
                     for b in self.content if isinstance(b, TextBlock | ImageBlock)]  # fmt: skip
            out.append({"role": "user", "content": parts})
        elif text or not out:
            out.append({"role": "user", "content": text})
        return out


class Tool(BaseModel):
    """A client tool (`custom`, or no type), or one of Anthropic's own
    (`web_search_20250305`, `bash_20250124`, `text_editor_...`, ...): those
    run on Anthropic's side or have schemas only Anthropic's models are
    trained on, so they are left out of what the model sees (`hosted`), and
    the request is served without them."""

    model_config = ConfigDict(extra="allow")

    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None
    type: StrictStr | None = None

    @property
    def hosted(self) -> bool:
        return self.type not in (None, "custom")

    @model_validator(mode="after")
    def has_a_schema(self):
        if not self.hosted and self.input_schema is None:
            raise ValueError("input_schema: a client tool needs one")
        return self

    def as_template_input(self) -> dict[str, Any]:
        # OpenAI's key order: templates dump the tool as JSON, so order is tokens.
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn | {"parameters": self.input_schema}}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "none", "any", "tool"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool = False  # with any or tool: one call

    @model_validator(mode="after")
    def named(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name: given with type "tool", and only then')
        return self


class Thinking(BaseModel):
    """enabled (within budget_tokens), adaptive (the model's own measure:
    the model's `thinking.default` budget), disabled."""

    model_config = ConfigDict(extra="allow")  # display: the text is always given

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[StrictInt, Field(ge=1)] | None = None

    def ask(self, settings: ThinkingConfig) -> ThinkingAsk:
        if self.type == "enabled" and self.budget_tokens is not None:
            return ThinkingAsk(True, self.budget_tokens)
        return from_switch(self.type != "disabled", settings)


SystemPrompt = StrictStr | list[TextBlock]


class _Conversation(BaseModel):
    """What count_tokens and messages both take."""

    # Anthropic adds fields often; known ones we cannot honour are refused.
    model_config = ConfigDict(extra="allow")

    _plain_json = model_validator(mode="before")(refuse_unsafe_json)

    model: StrictStr = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: SystemPrompt | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value:
                raise ValueError(f"{name}: {UNSUPPORTED[name]}")
        if self.messages[-1].role == "assistant":
            raise ValueError(
                "messages: the last message must be the user's (continuing a "
                "prefilled assistant turn is not supported)"
            )
        if self.tool_choice is not None and self.tool_choice.type != "none" and not self.tools:
            raise ValueError("tool_choice: the request has no tools to choose from")
        hosted = [t.name for t in self.tools or [] if t.hosted]
        if hosted:
            log.debug("tools left out (Anthropic's own, not run here): %s", hosted)
        if (self.tool_choice is not None and self.tool_choice.type in ("any", "tool")
                and len(hosted) == len(self.tools or [])):
            raise ValueError("tool_choice: the request has no tools specgate can run (only "
                             "Anthropic's own)")  # fmt: skip
        if self.tool_choice is not None and self.tool_choice.name in hosted:
            raise ValueError(f"tool_choice: '{self.tool_choice.name}' is one of Anthropic's own "
                             "tools, which specgate cannot run")  # fmt: skip
        return self

    def image_refs(self) -> list[ImageRef]:
        """Its images, in prompt order."""
        return [ImageRef(f"messages.{i}.content.{j}.source", url=b.source.url, data=b.source.data)
                for i, m in enumerate(self.messages) if isinstance(m.content, list)
                for j, b in enumerate(m.content) if isinstance(b, ImageBlock)]  # fmt: skip

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        if self.system:
            text = (
                self.system
                if isinstance(self.system, str)
                else "".join(b.text for b in self.system)
            )
            out.append({"role": "system", "content": text})
        for m in self.messages:
            out.extend(m.as_template_input())
        return out

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return [t.as_template_input() for t in self.tools or [] if not t.hosted]

    def thinking_ask(self, settings: ThinkingConfig) -> ThinkingAsk:
        return self.thinking.ask(settings) if self.thinking is not None else UNSAID

    @property
    def parse_tools(self) -> bool:
        return bool(self.template_tools) and (self.tool_choice is None
                                              or self.tool_choice.type != "none")  # fmt: skip

    @property
    def parallel_tool_use(self) -> bool:
        """More than one call in a turn (tool_choice's disable_parallel_tool_use)."""
        return self.tool_choice is None or not self.tool_choice.disable_parallel_tool_use

    @property
    def forced_tools(self) -> ForcedTools | None:
        choice = self.tool_choice
        if choice is None or choice.type not in ("any", "tool"):
            return None
        return ForcedTools(self.template_tools, choice.name, not choice.disable_parallel_tool_use,
                           "tool_choice")  # fmt: skip


class CountTokensRequest(_Conversation):
    pass


class MessagesRequest(_Conversation):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    metadata: dict[str, Any] | None = None  # user_id, for Anthropic's abuse checks: ignored

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
        )
