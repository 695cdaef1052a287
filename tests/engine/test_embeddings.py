"""Embeddings: `LLM.embed` equals transformers' `last_hidden_state` pooled the same way (last token, mean, first
token), normalized, on tiny random models of several families; batching changes nothing; `dimensions` cuts and
renormalizes; a sentence-transformers folder's pooling is used; and `/v1/embeddings` through the `openai` client
(floats and base64) gives the library's vectors, with OpenAI's error body for bad input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from support.server import start_server, stop_server
from support.tiny_models import PROMPTS, save_variant

import nexttoken

FAMILIES = ["llama-gqa", "qwen2-bias", "mistral-sliding", "gemma3-local-global-rope"]


def _reference(hf, prompt: list[int], pooling: str) -> torch.Tensor:
    """transformers: the base model's last_hidden_state for one prompt, pooled and normalized."""
    with torch.no_grad():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0].float()  # (T, C)
    pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return F.normalize(pooled, dim=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_embed_equals_transformers_pooled(name, tmp_path) -> None:
    hf = save_variant(name, tmp_path)
    llm = nexttoken.load(tmp_path)
    prompts = PROMPTS + [PROMPTS[1][:7]]  # lengths 4, 9, 6, 7: one batch with right padding
    for pooling in ("last", "mean", "cls"):
        got = torch.tensor(llm.embed(prompts, pooling=pooling))
        want = torch.stack([_reference(hf, p, pooling) for p in prompts])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        alone = torch.tensor([llm.embed(p, pooling=pooling)[0] for p in prompts])
        torch.testing.assert_close(got, alone, atol=2e-6, rtol=1e-5)  # padding in a batch changes nothing
    assert torch.allclose(got.norm(dim=1), torch.ones(len(prompts)))


def test_dimensions_normalize_and_model_pooling(tmp_path) -> None:
    hf = save_variant("llama-gqa", tmp_path)
    llm = nexttoken.load(tmp_path)
    raw = torch.tensor(llm.embed(PROMPTS[0], pooling="mean", normalize=False)[0])
    with torch.no_grad():
        want = hf.model(torch.tensor([PROMPTS[0]])).last_hidden_state[0].mean(0)
    torch.testing.assert_close(raw, want, atol=2e-5, rtol=1e-4)
    cut = torch.tensor(llm.embed(PROMPTS[0], pooling="mean", dimensions=8)[0])
    torch.testing.assert_close(cut, F.normalize(raw[:8], dim=0))
    with pytest.raises(nexttoken.NextTokenError, match="dimensions=65"):
        llm.embed(PROMPTS[0], dimensions=65)
    with pytest.raises(nexttoken.NextTokenError, match="pooling 'max'"):
        llm.embed(PROMPTS[0], pooling="max")
    # A sentence-transformers folder names its pooling: that is the default.
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                    "pooling_mode_mean_tokens": True}))
    assert nexttoken.load(tmp_path).embed(PROMPTS[0]) == llm.embed(PROMPTS[0], pooling="mean")


@pytest.fixture(scope="module")
def served(model_dir):  # noqa: F811
    proc, url = start_server(model_dir, "--pooling", "mean")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield url, client, client.models.list().data[0].id
    stop_server(proc)


def test_openai_client_embeddings_equal_the_library(served, model_dir) -> None:  # noqa: F811
    url, client, model = served
    llm = nexttoken.load(model_dir)
    texts = ["The little bird", "Tom saw a big dog in the park.", "Hi"]
    want = torch.tensor(llm.embed(texts, pooling="mean"))
    r = client.embeddings.create(model=model, input=texts, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == model
    torch.testing.assert_close(torch.tensor([d.embedding for d in r.data]), want, atol=1e-6, rtol=1e-5)
    assert r.usage.prompt_tokens == sum(len(llm.encode(t)) for t in texts)
    packed = client.embeddings.create(model=model, input=texts)  # the client asks for base64 and decodes it
    torch.testing.assert_close(torch.tensor([d.embedding for d in packed.data]), want, atol=1e-6, rtol=1e-5)
    ids = client.embeddings.create(model=model, input=[llm.encode(t) for t in texts], dimensions=16)
    torch.testing.assert_close(torch.tensor([d.embedding for d in ids.data]),
                               torch.tensor(llm.embed(texts, pooling="mean", dimensions=16)), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "dimensions": 100000}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [[10 ** 6]]}, "input"),
    ({"input": "x", "extra": 1}, "extra"),
])
def test_bad_input_gets_openai_error_then_server_serves(served, body, param) -> None:
    url, client, model = served
    r = httpx.post(url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert len(client.embeddings.create(model=model, input="ok").data) == 1
