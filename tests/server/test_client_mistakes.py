"""Options that can only fail inside the engine (every token banned, a DRY penalty past float32) are client
mistakes: GenerationConfig refuses them with GenerationConfigError naming the option, and the server answers 400
naming the request field, through the real openai client, and keeps serving (issue 39, item 9)."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from nexttoken.errors import GenerationConfigError
from nexttoken.generation.config import GenerationConfig
from nexttoken.generation.processors.llamacpp import DRY

openai = pytest.importorskip("openai")

VOCAB = 512  # stories260k's
BAN = float("-inf")

# (extra_body, the field the 400 names): each used to be a 500 ("probability tensor contains inf", an overflow)
MISTAKES = [
    ({"dry_multiplier": 1e308}, "dry_multiplier"),
    ({"dry_multiplier": 1.0, "dry_base": 1e308}, "dry_base"),
    ({"sequence_bias": [[[i], -1e300] for i in range(VOCAB)]}, "sequence_bias"),  # -1e300: -inf, see _raw
    ({"begin_suppress_tokens": list(range(VOCAB))}, "begin_suppress_tokens"),
    ({"min_tokens": 8, "stop_token_ids": list(range(VOCAB))}, "min_tokens"),
    ({"suppress_tokens": list(range(VOCAB)), "temperature": 1.0}, "suppress_tokens"),
    ({"suppress_tokens": list(range(VOCAB)), "temperature": 0.0}, "suppress_tokens"),  # was 200 of banned tokens
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60,
                         http_client=httpx.Client(transport=_InfinityTransport()))


class _InfinityTransport(httpx.HTTPTransport):
    """Python's JSON encoder (the openai client's) refuses -inf; JSON writes it as a number past float64's range,
    which the server's parser reads as -inf. So -1e300 in a body goes out as -1e400: the client's request, with the
    one value JSON cannot otherwise carry."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read().replace(b"-1e+300", b"-1e400")
        request = httpx.Request(request.method, request.url, headers={**request.headers,
                                "content-length": str(len(body))}, content=body)
        return super().handle_request(request)


@pytest.mark.parametrize("extra, field", MISTAKES, ids=[f for _, f in MISTAKES])
def test_a_mistake_is_a_400_naming_its_field_and_the_server_keeps_serving(client, extra, field) -> None:
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Tell me a story about a cat and a dog."}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=messages, max_tokens=8, extra_body=extra)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == field, caught.value.body
    message = caught.value.body["message"]
    assert field in message
    assert ("leaves no token" in message) == (not field.startswith("dry")), message
    ok = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("options, field", [
    ({"suppress_tokens": list(range(VOCAB))}, "suppress_tokens"),
    ({"bad_words_ids": [[i] for i in range(VOCAB)]}, "bad_words_ids"),
    ({"sequence_bias": {(i,): BAN for i in range(VOCAB)}}, "sequence_bias"),
    ({"suppress_tokens": list(range(VOCAB // 2)), "begin_suppress_tokens": list(range(VOCAB // 2, VOCAB))},
     "begin_suppress_tokens"),
    ({"min_new_tokens": 3, "eos_token_id": 2, "stop_token_ids": [i for i in range(VOCAB) if i != 2]},
     "min_new_tokens"),
])
def test_the_library_names_the_option_that_bans_the_last_token(options, field) -> None:
    cfg = GenerationConfig().updated(**options)
    with pytest.raises(GenerationConfigError, match=f"^{field} leaves no token"):
        cfg.check_vocabulary(VOCAB)


@pytest.mark.parametrize("options", [
    {"suppress_tokens": list(range(VOCAB - 1))},  # one id left
    {"sequence_bias": {(i,): -100.0 for i in range(VOCAB)}},  # finite: unlikely, not banned
    {"sequence_bias": {(i, i): BAN for i in range(VOCAB)}},  # two-token sequences ban only after their prefix
    {"stop_token_ids": list(range(VOCAB))},  # stop ids are banned only while min_new_tokens holds
    {"bad_words_ids": [[i] for i in range(VOCAB)], "eos_token_id": 2},  # a one-EOS bad word is dropped
])
def test_bans_that_leave_a_token_are_accepted(options) -> None:
    GenerationConfig().updated(**options).check_vocabulary(VOCAB)


@pytest.mark.parametrize("name, value", [("dry_multiplier", 1e308), ("dry_multiplier", 101.0), ("dry_base", 1e308),
                                         ("dry_base", 10.5)])
def test_dry_values_past_float32_are_refused(name, value) -> None:
    with pytest.raises(GenerationConfigError, match=name):
        GenerationConfig().updated(**{name: value})


def test_the_largest_dry_penalty_stays_finite() -> None:
    ids = torch.tensor([[5, 6] * 60 + [5]])  # a 120-token repetition: the match is capped at 50
    scores = torch.zeros(1, VOCAB)
    out = DRY(100.0, 10.0, allowed_length=1)(ids, scores)
    assert math.isfinite(out.min().item()) and out[0, 6] == -torch.finfo(torch.float32).max
    assert (out[0, :6] == 0).all()


def test_a_tool_message_without_tool_call_id_is_a_400(client) -> None:
    model = client.models.list().data[0].id
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, max_tokens=4, messages=[*turn, {"role": "tool", "content": "21"}])
    assert "tool_call_id" in caught.value.body["message"] and "messages" in str(caught.value.body["param"])
    ok = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                        messages=[*turn, {"role": "tool", "tool_call_id": "call_1", "content": "21"}])
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_a_method_a_path_does_not_take_is_a_405_naming_every_method_it_takes(client) -> None:
    root = str(client.base_url).rstrip("/")  # .../v1
    plain = {"content-type": "text/plain"}
    models = httpx.post(root + "/models", headers=plain, content="x")  # was 415: the media type checked first
    assert models.status_code == 405 and models.headers["allow"] == "GET"
    stored = httpx.post(root + "/responses/resp_1", headers=plain, content="x")
    assert stored.status_code == 405 and stored.headers["allow"] == "DELETE, GET"  # DELETE was left out
    assert httpx.post(root + "/chat/completions", headers=plain, content="x").status_code == 415  # still
