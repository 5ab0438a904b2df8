"""The Responses API's tools as a model sees them, and its calls as the
client expects them back (Codex CLI sends every kind; issue 41).

- `function`: shown as it is; a call is a `function_call` item.
- `custom` (freeform): its input is one text, not JSON. Shown to the model
  as a function with one string parameter, `input`, whose description
  gives the tool's grammar; a call is a `custom_tool_call` item with that
  text as `input`. With a grammar (`lark` or `regex`) the input is held to
  it (gateway/api/structured.py), in a forced call or among free text.
- `namespace`: function and custom tools grouped under a name (Codex's
  multi-agent tools, MCP servers). Flattened into the model's list as
  `<namespace>__<name>` (`<namespace><name>` where the namespace already
  ends in `__`, as Codex's `mcp__server__` ones do); a call comes back
  under the namespace, with the tool's own name and a `namespace` field,
  which is how Codex routes it (tried against Codex 0.171: a flattened name
  is "unsupported call").
- `local_shell`: shown as a function taking a command (argv); a call is a
  `local_shell_call` item with an `exec` action.
- Hosted tools, which OpenAI runs on its side (web_search, file_search,
  code_interpreter, image_generation, computer use, hosted MCP, tool
  search, its shell and apply_patch): specgate cannot run them, so the
  model does not see them (a debug log names them) and the request goes on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from specgate.gateway.api.openai_schema import FunctionName
from specgate.gateway.api.structured import ToolGrammar
from specgate.gateway.api.tools import ToolCall
from specgate.gateway.serving.generation import new_id

log = logging.getLogger(__name__)

HOSTED = (
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
    "file_search", "computer", "computer_use_preview", "mcp", "code_interpreter",
    "image_generation", "programmatic_tool_calling", "tool_search", "shell", "apply_patch",
)  # fmt: skip
LOCAL_SHELL = "local_shell"


class _Tool(BaseModel):
    # Fields of newer API versions (defer_loading, allowed_callers, ...) are
    # accepted and not read.
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_Tool):
    type: Literal["function"]
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class GrammarFormat(_Tool):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: StrictStr = Field(min_length=1)


class FreeText(_Tool):
    type: Literal["text"]


class CustomTool(_Tool):
    type: Literal["custom"]
    name: FunctionName
    description: StrictStr | None = None
    format: Annotated[GrammarFormat | FreeText, Field(discriminator="type")] | None = None


class NamespaceTool(_Tool):
    type: Literal["namespace"]
    name: FunctionName
    description: StrictStr | None = None
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]]


class LocalShellTool(_Tool):
    type: Literal["local_shell"]


class HostedTool(BaseModel):
    model_config = ConfigDict(extra="allow")  # echoed back in the response as sent

    type: Literal[HOSTED]


Tool = Annotated[
    FunctionTool | CustomTool | NamespaceTool | LocalShellTool | HostedTool,
    Field(discriminator="type"),
]

_LOCAL_SHELL_PARAMETERS = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"},
                    "description": "The command and its arguments (argv)."},
        "working_directory": {"type": "string"},
        "timeout_ms": {"type": "integer"},
    },
    "required": ["command"],
}  # fmt: skip


def model_name(namespace: str | None, name: str) -> str:
    """The name a model sees (and calls) a tool by."""
    if namespace is None:
        return name
    return namespace + name if namespace.endswith("__") else f"{namespace}__{name}"


@dataclass(frozen=True)
class ServedTool:
    """One tool in the model's list: what it is to the client."""

    kind: Literal["function", "custom", "local_shell"]
    name: str  # the client's
    namespace: str | None
    template: dict  # OpenAI-shaped, as the chat template and the call parsers read it
    grammar: ToolGrammar | None = None  # a custom tool's input grammar


class ModelTools:
    """A request's tools as the model sees them (flattened, hosted ones
    left out) and the way back from a call to the item the client expects.
    Raises ValueError where two tools would reach the model by one name."""

    def __init__(self, tools: list | None, param: str = "tools"):
        self.served: dict[str, ServedTool] = {}
        self.left_out: list[str] = []
        for i, tool in enumerate(tools or []):
            where = f"{param}.{i}"
            if isinstance(tool, NamespaceTool):
                for j, inner in enumerate(tool.tools):
                    self._add(inner, tool.name, f"{where}.tools.{j}")
            elif isinstance(tool, HostedTool):
                self.left_out.append(tool.type)
            else:
                self._add(tool, None, where)
        if self.left_out:
            log.debug("tools left out (hosted tools specgate cannot run): %s", self.left_out)

    def _add(self, tool, namespace: str | None, where: str) -> None:
        if isinstance(tool, LocalShellTool):
            served = ServedTool("local_shell", LOCAL_SHELL, None, _function(
                LOCAL_SHELL, "Run a command on the user's machine.", _LOCAL_SHELL_PARAMETERS))  # fmt: skip
        elif isinstance(tool, CustomTool):
            fmt = tool.format if isinstance(tool.format, GrammarFormat) else None
            grammar = fmt and ToolGrammar(fmt.syntax, fmt.definition, f"{where}.format.definition")
            served = ServedTool("custom", tool.name, namespace, _function(
                model_name(namespace, tool.name), tool.description, _freeform_parameters(fmt)),
                grammar)  # fmt: skip
        else:
            served = ServedTool("function", tool.name, namespace, _function(
                model_name(namespace, tool.name), tool.description, tool.parameters or {
                    "type": "object", "properties": {}}))  # fmt: skip
        seen = model_name(namespace, served.name)
        if seen in self.served:
            raise ValueError(f"{where}: two tools reach the model as '{seen}' (a namespace's "
                             f"tools are named <namespace>__<name>)")  # fmt: skip
        self.served[seen] = served

    @property
    def template(self) -> list[dict]:
        return [s.template for s in self.served.values()]

    @property
    def grammars(self) -> dict[str, ToolGrammar]:
        """Custom tools' input grammars, by the name the model sees."""
        return {n: s.grammar for n, s in self.served.items() if s.grammar is not None}

    @property
    def freeform(self) -> frozenset[str]:
        return frozenset(n for n, s in self.served.items() if s.kind == "custom")

    def output_item(self, call: ToolCall) -> dict:
        """A model's call as the response's output item (a call to a name
        no tool has is a function_call under that name, for the client to
        refuse)."""
        served = self.served.get(call.name)
        where = {"namespace": served.namespace} if served and served.namespace else {}
        if served is not None and served.kind == "custom":
            return {"id": new_id("ctc"), "type": "custom_tool_call", "status": "completed",
                    "call_id": new_id("call"), "name": served.name,
                    "input": _freeform_input(call.arguments)} | where  # fmt: skip
        if served is not None and served.kind == "local_shell":
            command = call.arguments.get("command")
            if isinstance(command, str):  # one command line, as Codex runs its own
                command = ["bash", "-lc", command]
            if isinstance(command, list) and all(isinstance(c, str) for c in command):
                return {"id": new_id("lsh"), "type": "local_shell_call", "status": "completed",
                        "call_id": new_id("call"),
                        "action": {"type": "exec", "command": command, "env": {},
                                   "timeout_ms": call.arguments.get("timeout_ms"),
                                   "working_directory": call.arguments.get("working_directory"),
                                   "user": None}}  # fmt: skip
        return {"id": new_id("fc"), "type": "function_call", "status": "completed",
                "call_id": new_id("call"), "name": served.name if served else call.name,
                "arguments": json.dumps(call.arguments)} | where  # fmt: skip


def _function(name: str, description: str | None, parameters: dict) -> dict:
    fn = {"name": name} | ({"description": description} if description else {})
    return {"type": "function", "function": fn | {"parameters": parameters}}


def _freeform_parameters(fmt: GrammarFormat | None) -> dict:
    """A custom tool's one text input; the model is told its grammar."""
    if fmt is None:
        about = "The tool's input: free text, not JSON."
    elif fmt.syntax == "lark":
        about = f"The tool's input: text (not JSON) in this Lark grammar:\n{fmt.definition}"
    else:
        about = (
            f"The tool's input: text (not JSON) matching this regular expression:\n{fmt.definition}"
        )
    return {"type": "object", "properties": {"input": {"type": "string", "description": about}},
            "required": ["input"]}  # fmt: skip


def _freeform_input(arguments: dict) -> str:
    """A custom tool's input from a call's arguments: its `input`, or a
    lone text argument a model named otherwise, or the arguments as JSON."""
    value = arguments.get("input")
    if isinstance(value, str):
        return value
    texts = [v for v in arguments.values() if isinstance(v, str)]
    if len(arguments) == 1 and texts:
        return texts[0]
    return json.dumps(arguments)
