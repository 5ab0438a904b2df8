"""Images through a real gateway (issue 46): OpenAI `image_url` parts from the
`openai` SDK, Anthropic `image` blocks from the `anthropic` SDK, Responses
`input_image` parts, on a tiny Qwen3.5-VL checkpoint in the published
layout. Every answer is held against mlx-vlm's own greedy generate on the
same files (test_vision.reference); the prefix cache reports the same
image's tokens as cached and not another's; bad images get a 400 in each
API's shape while the server keeps serving."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading

import anthropic
import httpx
import openai
import pytest
from conftest import start_gateway, stop_gateway
from test_vision import picture, reference

from specgate.gateway.config import ImageUrlConfig
from specgate.gateway.errors import APIError
from specgate.gateway.serving.images import ImageRef, read

N = 14
QUESTION = "What is it?"


def png(seed: int, shape=(64, 96)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(picture(seed, shape)).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class _Files(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files():
    """Images on a loopback HTTP server, for image URLs."""
    _Files.files = {"/a.png": png(0), "/big.png": png(9, (512, 512))}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def server(vlm, tiny_model, tmp_path_factory):
    gw = start_gateway(
        {"server": {"image_urls": {"fetch": True, "max_bytes": "256KiB", "timeout_s": 5}},
         "models": [{"id": "vlm", "path": str(vlm), "engines": ["mlx_plain", "mlx_mtp"],
                     "max_context": 160},
                    {"id": "tiny", "path": str(tiny_model)}]},
        tmp_path_factory.mktemp("vision-gateway"),
    )  # fmt: skip
    yield gw
    stop_gateway(gw)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from specgate.builders.vision import build_qwen35_vl

    return build_qwen35_vl(tmp_path_factory.mktemp("vlm") / "qwen35-vl", seed=0)


@pytest.fixture(scope="module")
def want(vlm):
    """mlx-vlm's answers, as text, per image seed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(vlm))
    return {seed: tok.decode(reference(vlm, [picture(seed)], QUESTION)) for seed in (0, 1)}


def openai_parts(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]  # fmt: skip


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


def chat(server, url: str, **extra):
    return sdk(server).chat.completions.create(model="vlm", messages=openai_parts(url), max_tokens=N,
                                               temperature=0, **extra)  # fmt: skip


def test_openai_image_url_parts_answer_as_mlx_vlm_and_the_cache_knows_the_image(server, want):
    first = chat(server, data_url(png(0)))
    assert first.choices[0].message.content == want[0]
    again = chat(server, data_url(png(0)))
    assert again.choices[0].message.content == want[0]
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 12 and again.usage.prompt_tokens == first.usage.prompt_tokens > cached
    other = chat(server, data_url(png(1)))
    assert other.choices[0].message.content == want[1]
    assert other.usage.prompt_tokens_details.cached_tokens < 8  # the text before the image at most
    # MTP after the image: the same tokens.
    forced = chat(server, data_url(png(1)), extra_headers={"X-Specgate-Method": "mtp"})
    assert forced.choices[0].message.content == want[1]


def test_an_image_url_is_fetched_where_the_server_allows_it(server, files, want):
    assert chat(server, f"{files}/a.png").choices[0].message.content == want[0]
    with pytest.raises(openai.BadRequestError) as err:  # past image_urls.max_bytes
        chat(server, f"{files}/big.png")
    assert "max_bytes" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        chat(server, f"{files}/missing.png")
    assert "HTTP 404" in err.value.message


def test_anthropic_image_blocks(server, want):
    """(Its base64 is wrapped at 76 characters a line, as `base64 a.png` writes it.)"""
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    reply = client.messages.create(model="vlm", max_tokens=N, extra_body={"temperature": 0}, messages=[{
        "role": "user", "content": [
            {"type": "text", "text": "Look: "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.encodebytes(png(0)).decode()}},
            {"type": "text", "text": QUESTION}]}])  # fmt: skip
    assert reply.content[0].text == want[0]
    counted = client.messages.count_tokens(model="vlm", messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(png(0)).decode()}}]}])  # fmt: skip
    assert counted.input_tokens > 6  # the image's tokens, not its one marker


def test_responses_input_image(server, want):
    r = sdk(server).responses.create(model="vlm", max_output_tokens=N, temperature=0, input=[{
        "role": "user", "content": [
            {"type": "input_text", "text": "Look: "},
            {"type": "input_image", "image_url": data_url(png(1))},
            {"type": "input_text", "text": QUESTION}]}])  # fmt: skip
    assert r.output_text == want[1]


def test_ollama_chat_images(server, vlm):
    """Ollama's /api/chat and /api/generate from the `ollama` SDK: a
    message's images (the SDK sends them base64) go before its text, as
    Ollama places them."""
    import ollama
    from mlx_vlm import generate
    from mlx_vlm.utils import load
    from PIL import Image

    model, processor = load(str(vlm))
    rendered = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True, tokenize=False)  # fmt: skip
    out = generate(model, processor, rendered, image=[Image.fromarray(picture(0))], max_tokens=N,
                   temperature=0.0, verbose=False)  # fmt: skip
    client = ollama.Client(host=server.base_url, timeout=120)
    reply = client.chat(model="vlm", messages=[{"role": "user", "content": QUESTION,
                                                "images": [png(0)]}],
                        options={"temperature": 0, "num_predict": N})  # fmt: skip
    assert reply.message.content == processor.tokenizer.decode(list(out.token_ids))
    # /api/generate's images: its prompt as one such user message.
    generated = client.generate(model="vlm", prompt=QUESTION, images=[png(0)],
                                options={"temperature": 0, "num_predict": N})  # fmt: skip
    assert generated.response == reply.message.content
    with pytest.raises(ollama.ResponseError, match="raw prompt has no place"):
        client.generate(model="vlm", prompt=QUESTION, images=[png(0)], raw=True)
    with pytest.raises(ollama.ResponseError, match="does not take images"):
        client.generate(model="tiny", prompt=QUESTION, images=[png(0)])


@pytest.mark.parametrize("url,words", [
    ("data:image/png;base64,@@@", "base64"),
    ("data:image/png," + "x" * 10, "base64-encoded"),
    (data_url(b"not an image at all"), "not an image"),
    (data_url(png(0)[:80]), "cannot be decoded"),
    ("ftp://example.com/a.png", "data: URL"),
])  # fmt: skip
def test_bad_images_are_a_400_naming_the_part(server, url, words):
    with pytest.raises(openai.BadRequestError) as err:
        chat(server, url)
    assert words in err.value.message
    assert err.value.body["param"] == "messages.0.content.1.image_url"
    assert chat(server, data_url(png(0))).choices[0].message.content  # still serving


def test_images_past_the_context_or_the_pixel_bound_are_refused_from_their_headers(server):
    """A large canvas costs nothing to send (a solid PNG compresses to a few
    KB): its tokens and pixels are checked from the header, before decoding."""
    from PIL import Image

    def solid(size, mode="RGB") -> bytes:
        out = io.BytesIO()
        Image.new(mode, size).save(out, "PNG")
        return out.getvalue()

    part = {"type": "image_url", "image_url": {"url": data_url(solid((1024, 1024)))}}
    question = {"type": "text", "text": QUESTION}  # each image 64 tokens once resized (tiny processor)
    with pytest.raises(openai.BadRequestError) as err:  # 192 image tokens: past a 160-token context
        sdk(server).chat.completions.create(model="vlm", max_tokens=4, messages=[
            {"role": "user", "content": [part, part, part, question]}])  # fmt: skip
    assert err.value.body["code"] == "context_length_exceeded"
    ok = sdk(server).chat.completions.create(model="vlm", max_tokens=4, messages=[
        {"role": "user", "content": [part, question]}])  # fmt: skip
    assert ok.usage.prompt_tokens > 64
    bomb = data_url(solid((9000, 9000), "1"))  # 81M pixels, 10 KB of PNG
    assert len(bomb) < 100_000
    with pytest.raises(openai.BadRequestError) as err:
        chat(server, bomb)
    assert "pixels" in err.value.message and err.value.body["code"] == "invalid_image"


def test_a_text_model_refuses_images_in_each_api(server):
    with pytest.raises(openai.BadRequestError) as err:
        sdk(server).chat.completions.create(model="tiny", messages=openai_parts(data_url(png(0))),
                                            max_tokens=4)  # fmt: skip
    assert "does not take images" in err.value.message
    r = httpx.post(f"{server.base_url}/v1/messages", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(0)).decode()}}]}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "does not take images" in r.json()["error"]["message"]


def test_a_server_that_does_not_fetch_says_so():
    ref = ImageRef("messages.0.content.0.image_url", url="https://example.com/a.png")
    with pytest.raises(APIError) as err:
        asyncio.run(read(ref, ImageUrlConfig()))
    assert "does not fetch image URLs" in err.value.message and err.value.status == 400


def test_message_boundaries_move_with_the_image_markers():
    """A snapshot point after an image (the prefix cache's, at a message's
    end) moves by the image's tokens less its one marker; one before it
    stays."""
    from specgate.engines.base import ImageInput
    from specgate.gateway.serving.images import _moved

    # Rendered: 5 tokens, marker at 5, 10 more, marker at 16, ...; expanded:
    # the first image takes 6 tokens (5..10), the second 4 (21..24).
    images = (ImageInput(5, (1, 4, 6), 6, None, "a"), ImageInput(21, (1, 4, 4), 4, None, "b"))
    assert [_moved(at, images) for at in (3, 5, 6, 16, 17, 30)] == [3, 5, 11, 21, 25, 38]
