"""A request's images (server/images.py) and each API's image parts (the protocol modules), without a model:
data: URLs decoded under the limits, remote URLs fetched from a real HTTP server on loopback only where the flags
allow it (within the time and size limits, never from a private address without --allow-private-image-urls, a
redirect's target checked again), and Responses' `input_image`, Anthropic's `image` blocks and Ollama's `images`
written as the chat `image_url` parts the one request path loads."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
import time

import pytest
from PIL import Image

from nexttoken.images import ImageLimits
from nexttoken.server.anthropic.protocol import MessagesRequest, chat_body as anthropic_body
from nexttoken.server.http.errors import APIError
from nexttoken.server.images import ImageLoader, ImagePolicy, image_parts
from nexttoken.server.ollama.protocol import OllamaChatRequest, OllamaGenerateRequest, chat_body as ollama_body, \
    generate_messages
from nexttoken.server.openai.protocol import ChatCompletionRequest
from nexttoken.server.openai.responses import input_messages


def png(width: int = 5, height: int = 3, color: tuple = (200, 10, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def load(refs_urls: list[str], **policy) -> list:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in refs_urls]}]
    return asyncio.run(ImageLoader(ImagePolicy(**policy)).load(image_parts(messages)))


def refused(urls: list[str], **policy) -> APIError:
    with pytest.raises(APIError) as e:
        load(urls, **policy)
    assert e.value.status == 400
    return e.value


def test_data_urls_decode_in_order() -> None:
    a, b = png(5, 3, (1, 2, 3)), png(2, 7, (9, 9, 9))
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "x"},
                                             {"type": "image_url", "image_url": {"url": data_url(a)}},
                                             {"type": "image_url", "image_url": {"url": data_url(b)}}]}]
    refs = image_parts(messages)
    assert [r.param for r in refs] == ["messages.1.content.1", "messages.1.content.2"]
    images = asyncio.run(ImageLoader().load(refs))
    assert [(i.mode, i.size, i.getpixel((0, 0))) for i in images] == [("RGB", (5, 3), (1, 2, 3)),
                                                                      ("RGB", (2, 7), (9, 9, 9))]


@pytest.mark.parametrize("url, said", [
    ("data:image/png;base64,@@@", "not valid base64"),
    (data_url(b"not an image at all"), "cannot decode"),
    (data_url(png(64, 64)[:60]), "truncated"),
    (data_url(b"x", "text/plain"), "image/"),
])
def test_a_broken_image_is_a_400_naming_the_part_and_the_problem(url, said) -> None:
    error = refused([data_url(png()), url])
    assert error.param == "messages.0.content.1" and said in error.message, error.message


def test_the_limits_are_400s_naming_their_flags() -> None:
    assert "--max-images-per-request" in refused([data_url(png())] * 3, limits=ImageLimits(max_images=2)).message
    big = refused([data_url(png(100, 100))], limits=ImageLimits(max_pixels=5000))
    assert "--max-image-pixels" in big.message and "100x100" in big.message
    assert "bytes" in refused([data_url(png())], limits=ImageLimits(max_bytes=10)).message


# ---- remote images: a real HTTP server on loopback -----------------------------------------------------------------

class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/slow.png":
            time.sleep(2)
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        body = png(8, 8) if self.path != "/big.png" else png(8, 8) + b"\0" * 5000
        self.send_response(200 if self.path != "/gone.png" else 404)
        self.send_header("Content-Type", "image/png")
        if self.path != "/chunked.png":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _Quiet(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:  # noqa: ANN001
        pass  # a fetch stopped at the size limit closes the connection mid-body: expected


@pytest.fixture(scope="module")
def remote():
    server = _Quiet(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_urls_are_fetched_only_when_allowed(remote) -> None:
    assert "--allow-remote-images" in refused([remote + "/cat.png"]).message
    # allowed, but loopback is not a public address: the request-forgery guard
    error = refused([remote + "/cat.png"], allow_remote=True)
    assert "127.0.0.1" in error.message and "--allow-private-image-urls" in error.message
    assert "--allow-private-image-urls" in refused(["http://localhost:1/x.png"], allow_remote=True).message
    [image] = load([remote + "/cat.png"], allow_remote=True, allow_private=True)
    assert image.size == (8, 8) and image.getpixel((0, 0)) == (200, 10, 30)
    [moved] = load([remote + "/moved.png"], allow_remote=True, allow_private=True)
    assert moved.size == (8, 8)
    assert "ftp" in refused(["ftp://example.com/x.png"], allow_remote=True).message
    assert "not a valid URL" in refused(["http://[::1/x.png"], allow_remote=True).message


def test_remote_fetches_keep_to_the_size_and_time_limits(remote) -> None:
    allowed = dict(allow_remote=True, allow_private=True)
    small = ImageLimits(max_bytes=1000)
    assert "--max-image-bytes" in refused([remote + "/big.png"], limits=small, **allowed).message
    assert "--max-image-bytes" in refused([remote + "/chunked.png"], limits=ImageLimits(max_bytes=50),
                                          **allowed).message
    start = time.monotonic()
    assert "--remote-image-timeout" in refused([remote + "/slow.png"], timeout_s=0.3, **allowed).message
    assert time.monotonic() - start < 1.5
    assert "404" in refused([remote + "/gone.png"], **allowed).message


# ---- each API's image parts, as chat image_url parts -----------------------------------------------------------------

URL = data_url(png())


def test_chat_image_url_parts_are_validated() -> None:
    ok = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": URL, "detail": "low"}}]}]})
    assert ok.messages[0].content[1].image_url.url == URL
    for bad in ({"type": "image_url", "image_url": URL}, {"type": "image_url", "image_url": {"url": URL, "x": 1}},
                {"type": "image_url"}, {"type": "text", "text": "x", "image_url": {"url": URL}},
                {"type": "input_audio", "input_audio": {}}):
        with pytest.raises(ValueError):
            ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [bad]}]})


def test_responses_input_image_is_an_image_url_part_by_url_or_file_id() -> None:
    given = [{"role": "user", "content": [{"type": "input_text", "text": "what?"},
                                          {"type": "input_image", "image_url": URL, "detail": "auto"}]}]
    assert input_messages(given, images=True) == [{"role": "user", "content": [
        {"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": URL}}]}]
    with pytest.raises(APIError) as e:
        input_messages(given)
    assert e.value.param == "input[0].content[1].type" and "takes no images" in e.value.message
    by_id = [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]
    with pytest.raises(APIError) as e:
        input_messages(by_id, images=True)  # no file store
    assert e.value.param == "input[0].content[0].file_id"
    files = {"file-1": png()}
    [message] = input_messages(by_id, images=True, files=lambda file_id, param: files[file_id])
    [image] = load([message["content"][0]["image_url"]["url"]])
    assert image.size == (5, 3)


def test_anthropic_image_blocks_are_image_url_parts_in_block_order() -> None:
    b64 = URL.split(",")[1]
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "and"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})
    assert anthropic_body(req, images=True)["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": URL}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with pytest.raises(APIError) as e:
        anthropic_body(req)
    assert e.value.param == "messages[0].content[0].type" and "type 'image'" in e.value.message
    bad = req.model_copy(update={"messages": [req.messages[0].model_copy(update={"content": [
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]})]})
    with pytest.raises(APIError) as e:
        anthropic_body(bad, images=True)
    assert e.value.param == "messages[0].content[0].source"


def test_ollama_images_come_before_the_text() -> None:
    b64 = URL.split(",")[1]
    req = OllamaChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "what?", "images": [b64, URL]}]})
    parts = ollama_body(req, "m", images=True)["messages"][0]["content"]
    assert parts == [{"type": "image_url", "image_url": {"url": f"data:;base64,{b64}"}},
                     {"type": "image_url", "image_url": {"url": URL}}, {"type": "text", "text": "what?"}]
    [image] = load([parts[0]["image_url"]["url"]])
    assert image.size == (5, 3)
    with pytest.raises(APIError) as e:
        ollama_body(req, "m")
    assert e.value.param == "messages.0.images"
    gen = OllamaGenerateRequest.model_validate({"model": "m", "prompt": "p", "images": [b64]})
    assert generate_messages(gen, images=True)[0]["content"][0]["type"] == "image_url"


def test_the_encoder_cache_flag_defaults_to_the_engines() -> None:
    from nexttoken.engine.encoder import DEFAULT_ENCODER_CACHE_BYTES
    from nexttoken.server import cli

    assert cli.DEFAULT_ENCODER_CACHE_BYTES == DEFAULT_ENCODER_CACHE_BYTES
