"""A chat request's images, API-neutral: each API's parser names its images
as `ImageRef`s in prompt order (OpenAI's `image_url` parts, Anthropic's
`image` blocks, Responses' `input_image`); `with_images` reads their bytes
and has the model's engine put them in the rendered prompt
(Engine.prepare_images: decoding and preprocessing on the CPU workers).

Bytes come from a data URL or base64 (bounded by the server's body limit)
or, only where `server.image_urls.fetch` is on, from an http(s) URL,
fetched with its own size and time limits. Every failure is a 400 naming
the image's parameter; a model without an image side says why.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, replace

import httpx

from specgate.engines.base import EngineError, EngineOverloaded, ImageInput, MessageBoundaries
from specgate.engines.cpu import run_cpu
from specgate.gateway.config import ImageUrlConfig
from specgate.gateway.errors import APIError

MAX_IMAGES = 64  # a request's images: each is a vision-tower forward and its tokens


# What a model reads for an image inside a tool's output (Anthropic's
# tool_result, an OpenAI tool message): a chat template's tool turn holds
# text, and a 400 would end an agent's session, whose history repeats the
# image in every later request (Claude Code's Read of a PNG).
TOOL_RESULT_IMAGE = "[image left out: a tool result reaches the model as text only]"


@dataclass(frozen=True)
class ImageRef:
    """One image as a request names it: a URL (data: or http(s):), or
    base64 data with its media type; `param` is where, for errors."""

    param: str
    url: str | None = None
    data: str | None = None


def _bad(ref: ImageRef, why: str) -> APIError:
    return APIError(400, f"{ref.param}: {why}", param=ref.param, code="invalid_image")


def _decode_base64(text: str) -> bytes:
    # Line breaks and spaces are left out first, as Go's decoder (Ollama's)
    # does: `base64 image.png` wraps its lines at 76 characters.
    return base64.b64decode("".join(text.split()), validate=True)


async def _base64(ref: ImageRef, text: str) -> bytes:
    try:  # megabytes of it: on the CPU workers, not the event loop
        return await run_cpu(_decode_base64, text)
    except (binascii.Error, ValueError):
        raise _bad(ref, "the image's data is not valid base64") from None


async def _data_url(ref: ImageRef, url: str) -> bytes:
    head, sep, body = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise _bad(ref, "a data URL is data:<type>;base64,<data>")
    if not head.endswith(";base64"):
        raise _bad(ref, "a data URL's image must be base64-encoded (data:<type>;base64,...)")
    return await _base64(ref, body)


async def _fetched(ref: ImageRef, url: str, settings: ImageUrlConfig) -> bytes:
    if not url.startswith(("http://", "https://")):
        raise _bad(ref, "an image URL is a data: URL, or http(s) where the server fetches them")
    if not settings.fetch:
        raise _bad(ref, "this server does not fetch image URLs (server.image_urls.fetch is off); "
                        "send the image as a data URL (data:image/png;base64,...)")  # fmt: skip
    got = bytearray()
    try:
        async with httpx.AsyncClient(timeout=settings.timeout_s, follow_redirects=True,
                                     max_redirects=3) as client:  # fmt: skip
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise _bad(ref, f"fetching the image answered HTTP {response.status_code}")
                async for chunk in response.aiter_bytes():
                    got += chunk
                    if len(got) > settings.max_bytes:
                        raise _bad(ref, f"the image is larger than {settings.max_bytes} bytes "
                                        "(server.image_urls.max_bytes)")  # fmt: skip
    except httpx.HTTPError as e:
        raise _bad(ref, f"the image could not be fetched: {type(e).__name__}") from None
    return bytes(got)


async def read(ref: ImageRef, settings: ImageUrlConfig) -> bytes:
    if ref.data is not None:
        return await _base64(ref, ref.data)
    url = ref.url or ""
    if url.startswith("data:"):
        return await _data_url(ref, url)
    return await _fetched(ref, url, settings)


def _moved(at: int, images: tuple[ImageInput, ...]) -> int:
    """A token offset of the rendered prompt, in the prompt with its images'
    markers repeated: past each image whose marker is before it, by its
    length less the marker's one."""
    shift = 0
    for image in images:
        if image.start - shift < at:
            shift += image.length - 1
    return at + shift


async def with_images(engine, model_id: str, tokens: list[int], boundaries: MessageBoundaries,
                      refs: list[ImageRef], settings: ImageUrlConfig,
                      ) -> tuple[list[int], MessageBoundaries, tuple[ImageInput, ...]]:  # fmt: skip
    """The prompt and its boundaries with the images in, and the images."""
    if not refs:
        return tokens, boundaries, ()
    if len(refs) > MAX_IMAGES:
        raise APIError(400, f"{len(refs)} images: at most {MAX_IMAGES} a request",
                       param=refs[MAX_IMAGES].param, code="invalid_image")  # fmt: skip
    data = [await read(ref, settings) for ref in refs]
    try:
        expanded, images = await engine.prepare_images(tokens, data)
    except (EngineOverloaded, EngineError):
        raise
    except ValueError as e:  # (an ImageError says which image)
        param = refs[getattr(e, "index", 0)].param
        code = "context_length_exceeded" if type(e).__name__ == "TooManyTokens" else "invalid_image"
        raise APIError(400, f"{param}: {e}", param=param, code=code) from None
    moved = replace(boundaries, system=_moved(boundaries.system, images) if boundaries.system else 0,
                    history=_moved(boundaries.history, images) if boundaries.history else 0)  # fmt: skip
    return expanded, moved, images


def refused(engine, model_id: str, refs: list[ImageRef]) -> None:
    """A 400 before rendering when the model takes no images."""
    if refs and (why := engine.images_refused()) is not None:
        raise APIError(400, f"{refs[0].param}: model '{model_id}' does not take images: {why}",
                       param=refs[0].param, code="model_not_supported")  # fmt: skip
