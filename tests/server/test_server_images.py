"""Images through every entry point of a real server on loopback, serving a tiny random-weight Gemma 3 vision model
(tests/support/vision.py): the `openai` SDK (an image_url part in Chat, an input_image in Responses), the
`anthropic` SDK (an image block), Ollama's `ollama` client (`images`), llama.cpp's /completion
(`multimodal_data`, and `image_data` placed with `[img-N]`), and the chat page in a real headless Chromium (an
uploaded image reaches the request, read off the browser's own Network events, and the answer streams). The
reference is the library on the same folder: `LLM.chat` / `LLM.generate(prompt, images=...)` with the same image
give the same tokens. A broken, truncated, too large or one-too-many image, or a URL on loopback (the server
fetches remote images: --allow-remote-images, but only from public addresses), is a 400 in that API's own error
body naming the problem, and the server goes on serving."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
import torch
from PIL import Image

import nexttoken
from support.server import start_server, stop_server
from support.vision import gemma3_vlm

QUESTION = "What is in this picture?"
NEW = 8  # tokens each answer takes (ignore_eos: every API the same length)
# Gemma 3's chat template's rendering of one user turn (the /completion prompts write it out)
TURN = "<start_of_turn>user\n{}" + QUESTION + "<end_of_turn>\n<start_of_turn>model\n"


def _png(seed: int, shape=(30, 44, 3)) -> bytes:  # noqa: ANN001
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


PNG = _png(0)
B64 = base64.b64encode(PNG).decode()
URL = f"data:image/png;base64,{B64}"
TRUNCATED = base64.b64encode(_png(1, (64, 64, 3))[:200]).decode()
HUGE = base64.b64encode(_png(2, (1100, 1000, 3))).decode()  # 1.1 M pixels: over --max-image-pixels


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-vision")
    gemma3_vlm(folder, seed=2)
    proc, url = start_server(folder, "--served-model-name", "m", "--max-body-bytes", str(8 << 20),
                             "--max-images-per-request", "2", "--allow-remote-images",
                             "--max-image-pixels", "1000000")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = nexttoken.load(folder)
    yield url, llm
    torch.set_num_threads(before)
    stop_server(proc)


@pytest.fixture(scope="module")
def reference(served):
    """The library's answer to the question about PNG: its text and token counts."""
    _, llm = served
    image = Image.open(io.BytesIO(PNG))
    out = llm.chat([{"role": "user", "content": [{"type": "image", "image": image},
                                                  {"type": "text", "text": QUESTION}]}],
                   max_new_tokens=NEW, do_sample=False, ignore_eos=True)
    same = llm.generate(TURN.format("<start_of_image>"), images=[image], max_new_tokens=NEW, do_sample=False,
                        ignore_eos=True)
    assert same.text == out.text and len(out.token_ids) == NEW
    return out


@pytest.fixture(scope="module")
def until_eos(served):
    """The same, stopping at the end of the text (Ollama's options have no ignore_eos)."""
    _, llm = served
    return llm.chat([{"role": "user", "content": [{"type": "image", "image": Image.open(io.BytesIO(PNG))},
                                                  {"type": "text", "text": QUESTION}]}],
                    max_new_tokens=NEW, do_sample=False)


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_chat_image_url_part_gives_the_librarys_tokens(served, reference) -> None:
    url, _ = served
    client = _openai(url)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}},
                                             {"type": "text", "text": QUESTION}]}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=NEW, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == reference.text
    assert r.usage.prompt_tokens == len(reference.prompt_token_ids) and r.usage.completion_tokens == NEW
    counted = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=120).json()
    assert counted["tokens"] == reference.prompt_token_ids  # the image's tokens too
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=NEW, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference.text


def test_openai_responses_input_image_gives_the_librarys_tokens(served, reference) -> None:
    url, _ = served
    r = _openai(url).responses.create(model="m", max_output_tokens=NEW, temperature=0, extra_body={"ignore_eos": True},
                                      input=[{"role": "user", "content": [
                                          {"type": "input_image", "image_url": URL, "detail": "auto"},
                                          {"type": "input_text", "text": QUESTION}]}])
    assert r.output_text == reference.text and r.usage.input_tokens == len(reference.prompt_token_ids)
    upload = _openai(url).files.create(file=("photo.png", PNG), purpose="vision")  # the same image, by file id
    r = _openai(url).responses.create(model="m", max_output_tokens=NEW, temperature=0, extra_body={"ignore_eos": True},
                                      input=[{"role": "user", "content": [
                                          {"type": "input_image", "file_id": upload.id, "detail": "auto"},
                                          {"type": "input_text", "text": QUESTION}]}])
    assert r.output_text == reference.text


def test_anthropic_image_block_gives_the_librarys_tokens(served, reference) -> None:
    url, _ = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    r = client.messages.create(model="m", max_tokens=NEW, extra_body={"temperature": 0, "ignore_eos": True},
                               messages=[{"role": "user", "content": [
                                   {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                "data": B64}},
                                   {"type": "text", "text": QUESTION}]}])
    assert r.content[0].text == reference.text and r.usage.input_tokens == len(reference.prompt_token_ids)


def test_ollama_images_give_the_librarys_tokens(served, until_eos) -> None:
    url, _ = served
    client = ollama.Client(host=url, timeout=120)
    options = {"temperature": 0, "num_predict": NEW}
    r = client.chat(model="m", messages=[{"role": "user", "content": QUESTION, "images": [PNG]}], options=options)
    assert r.message.content == until_eos.text and r.prompt_eval_count == len(until_eos.prompt_token_ids)
    g = client.generate(model="m", prompt=QUESTION, images=[PNG], options=options)
    assert g.response == r.message.content
    assert "vision" in client.show("m").capabilities


def test_llamacpp_completion_multimodal_data_and_image_data(served, reference) -> None:
    url, _ = served
    options = {"n_predict": NEW, "temperature": 0, "ignore_eos": True}
    for prompt in ({"prompt": {"prompt_string": TURN.format("<__media__>"), "multimodal_data": [B64]}},
                   {"prompt": TURN.format("[img-12]"), "image_data": [{"data": B64, "id": 12}]}):
        r = httpx.post(url + "/completion", json={**prompt, **options}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["content"] == reference.text and body["tokens_evaluated"] == len(reference.prompt_token_ids)
        assert body["stop"] and body["tokens_predicted"] == NEW


def _ok(url: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}}]}], "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body, said", [
    ("/v1/chat/completions", {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{TRUNCATED}"}}]}]}, "truncated"),
    ("/v1/chat/completions", {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": URL}}] * 3}]}, "--max-images-per-request"),
    # remote URLs are fetched (--allow-remote-images), but never from a private or loopback address
    ("/v1/chat/completions", {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]}]}, "--allow-private-image-urls"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://localhost:9/cat.png"}}]}]},
     "--allow-private-image-urls"),
    ("/v1/responses", {"max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,@@"}]}]}, "base64"),
    ("/v1/responses", {"max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-nope"}]}]}, "file-nope"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": HUGE}}]}]},
     "--max-image-pixels"),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "x", "images": [B64, B64, B64]}]},
     "--max-images-per-request"),
    ("/api/generate", {"model": "m", "prompt": "x", "images": [base64.b64encode(b"GIF89a...").decode()]},
     "cannot decode"),
    ("/completion", {"prompt": {"prompt_string": "a <__media__>", "multimodal_data": [TRUNCATED]}}, "truncated"),
    ("/completion", {"prompt": "a [img-1]", "image_data": [{"data": B64, "id": 2}]}, "[img-1]"),
])
def test_a_bad_image_is_a_400_in_the_apis_body_and_the_server_goes_on(served, path, body, said) -> None:
    url, _ = served
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()
    message = error["error"]["message"] if path.startswith(("/v1/messages", "/v1/", "/completion")) \
        else error["error"]
    if path == "/v1/messages":
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    elif path.startswith("/api/"):
        assert isinstance(error["error"], str)
    else:
        assert set(error["error"]) == {"message", "type", "param", "code"}
    assert said in message, message
    _ok(url)


def test_the_chat_page_sends_an_uploaded_and_a_pasted_image_and_streams_the_answer(served, tmp_path) -> None:
    """The real browser: an image uploaded with the page's file input and one pasted into the message box reach
    the request as image_url data: URL parts (read off the browser's own Network events), and the streamed answer
    is the API's to the same body."""
    from support.cdp import Browser, browser_or_skip
    from support.webui import answered, chat_bodies, page_messages, press, set_option, wait_for

    url, _ = served
    path = tmp_path / "photo.png"
    path.write_bytes(PNG)
    b = Browser(browser_or_skip(), args=("--proxy-server=http://127.0.0.1:9",))  # nothing leaves loopback
    try:
        b.call("Network.enable")
        b.open(url + "/")
        wait_for(b, "document.body.dataset.model === 'm'")
        set_option(b, "temperature", 0)
        set_option(b, "max_tokens", NEW)
        set_option(b, "trace", False)
        root = b.call("DOM.getDocument")["root"]["nodeId"]
        node = b.call("DOM.querySelector", nodeId=root, selector="#image-input")["nodeId"]
        b.call("DOM.setFileInputFiles", files=[str(path)], nodeId=node)  # the user picks the file
        wait_for(b, "document.body.dataset.attached === '1'")
        b.eval(f"""(() => {{ const bytes = Uint8Array.from(atob({B64!r}), c => c.charCodeAt(0));
            const data = new DataTransfer(); data.items.add(new File([bytes], 'pasted.png', {{type: 'image/png'}}));
            document.getElementById('input').dispatchEvent(new ClipboardEvent('paste', {{clipboardData: data,
                bubbles: true, cancelable: true}})); }})()""")
        wait_for(b, "document.body.dataset.attached === '2'")
        assert b.eval("document.querySelectorAll('#attached img').length") == 2
        b.eval("document.getElementById('input').focus()")
        b.call("Input.insertText", text=QUESTION)
        answered(b, lambda: press(b, "Enter"))
        body = chat_bodies(b)[-1]
        assert body["messages"][-1] == {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": URL}}, {"type": "image_url", "image_url": {"url": URL}},
            {"type": "text", "text": QUESTION}]}
        shown = page_messages(b)[-1]
        assert shown["state"] == "done" and shown["deltas"] > 1 and b.eval("document.body.dataset.attached") == "0"
        assert b.eval("document.querySelectorAll('.msg.user .images img').length") == 2
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        r = httpx.post(url + "/v1/chat/completions", json=plain, timeout=120)
        assert r.status_code == 200 and shown["content"] == r.json()["choices"][0]["message"]["content"]
    finally:
        b.close()
