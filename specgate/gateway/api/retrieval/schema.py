"""The request bodies of the embeddings and rerank routes, validated with pydantic.

Bounds: at most MAX_INPUTS inputs (OpenAI's 2,048) and MAX_DOCUMENTS
documents a request; each input within the model's context and all of a
request's within MAX_TOTAL_TOKENS (OpenAI's 300,000), checked once they are
tokenized (serving/vectors.py). Token-id inputs are taken as OpenAI takes
them (a list of ints, or a list of such lists). Unknown fields are accepted,
as on OpenAI's other routes.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from specgate.gateway.api.plain_json import refuse_unsafe_json

MAX_INPUTS = 2048
MAX_DOCUMENTS = 1024

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1)

    _plain_json = model_validator(mode="before")(refuse_unsafe_json)


class EmbeddingRequest(_Body):
    """OpenAI's /v1/embeddings."""

    input: StrictStr | TokenIds | Annotated[list[StrictStr], Field(min_length=1)] \
        | Annotated[list[TokenIds], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _bounded(self):
        items = self.items()
        if len(items) > MAX_INPUTS:
            raise ValueError(f"input: at most {MAX_INPUTS} inputs a request (got {len(items)})")
        if any(isinstance(i, str) and not i for i in items):
            raise ValueError("input: an input is empty; each must have at least one character")
        return self

    def items(self) -> list[str] | list[list[int]]:
        """Each input: a text, or token ids."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if given and isinstance(given[0], int):
            return [given]
        return list(given)


class Document(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: StrictStr


class RerankRequest(_Body):
    """/v1/rerank as Jina and Cohere shape it (vLLM and llama-server take the same)."""

    query: StrictStr = Field(min_length=1)
    documents: Annotated[list[StrictStr | Document], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: Annotated[StrictInt, Field(ge=1)] | None = None
    return_documents: StrictBool = True
    # Cohere's: each document is cut to this many tokens, which the client asks for.
    max_tokens_per_doc: Annotated[StrictInt, Field(ge=1)] | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class OllamaEmbedRequest(_Body):
    """Ollama's /api/embed: `truncate` (default true, as Ollama's) cuts an
    input to the context rather than refusing it; `options` and
    `keep_alive` steer Ollama's runner and are ignored here."""

    input: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_INPUTS)]
    truncate: StrictBool = True
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = None

    def items(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class OllamaEmbeddingsRequest(_Body):
    """Ollama's older /api/embeddings: one `prompt`, one `embedding` back."""

    prompt: StrictStr
