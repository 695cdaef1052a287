"""Every field of the installed `anthropic` SDK's request and content-block types round-trips through
`/v1/messages`: the field tables of server/anthropic/protocol.py are checked against the SDK's own types (so a
field the SDK adds fails here until the server decides on it), and the real SDK drives the real SmolLM2 GGUF: a
tool-use turn sent back as `block.model_dump()`, and Claude Code's beta fields (`context_management`, ...)."""

from __future__ import annotations

import typing

import anthropic
import anthropic.types as stable
import anthropic.types.beta as beta
import anthropic.types.beta.message_create_params as beta_params
import anthropic.types.message_create_params as stable_params
import httpx
import jsonschema
import pytest
from conftest import requires_shared

from nexttoken.server.anthropic.protocol import BLOCK_FIELDS, IGNORED_KEYS, MessagesRequest, OutputConfig, \
    ThinkingConfig

pytestmark = requires_shared

WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# block type -> its SDK types: the request param and the response model (what `model_dump()` sends back)
SDK_BLOCKS = {"text": ("TextBlockParam", "TextBlock"), "tool_use": ("ToolUseBlockParam", "ToolUseBlock"),
              "thinking": ("ThinkingBlockParam", "ThinkingBlock"),
              "redacted_thinking": ("RedactedThinkingBlockParam", "RedactedThinkingBlock"),
              "tool_result": ("ToolResultBlockParam",)}
# A value of the SDK's type for each top-level request field (a field the SDK adds has none: the test says so).
SAMPLES = {
    "model": None, "messages": None, "max_tokens": None, "stop_sequences": ["\n\n\n"], "system": "Be brief.",
    "temperature": 0.0, "top_p": 1.0, "top_k": 1, "metadata": {"user_id": "u1"}, "service_tier": "auto",
    "cache_control": {"type": "ephemeral"}, "container": "c1", "diagnostics": {}, "inference_geo": "us",
    "speed": "standard", "user_profile_id": "p1", "workspace_id": "w1", "tools": [WEATHER],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, "thinking": {"type": "disabled"},
    "output_config": {"effort": "low"}, "stream": False, "betas": ["context-management-2025-06-27"],
    "billing_policy": {"type": "standard"}, "compaction": {"type": "auto"}, "fallback_credit_token": "t",
    "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}, "fallbacks": [{"model": "m2"}],
    "mcp_servers": [], "thread": {"id": "th1"},
}


def _fields(t: typing.Any) -> set[str]:
    """The field names of an SDK TypedDict (request param) or pydantic model (response)."""
    if hasattr(t, "model_fields"):
        return set(t.model_fields)
    return {k for klass in t.__mro__ for k in getattr(klass, "__annotations__", {})}


def _request_fields() -> set[str]:
    return {name for params in (stable_params, beta_params) for klass in (params.MessageCreateParamsBase,
            params.MessageCreateParamsNonStreaming) for name in _fields(klass)}


def test_every_sdk_request_field_is_known() -> None:
    fields = _request_fields()
    assert fields - set(SAMPLES) == set(), "the SDK added request fields: give each a sample and a decision"
    assert fields - set(MessagesRequest.model_fields) == set()


@pytest.mark.parametrize("kind", sorted(SDK_BLOCKS))
def test_every_sdk_block_field_is_known(kind) -> None:
    accepted = {"type", *BLOCK_FIELDS[kind], *IGNORED_KEYS}
    for module, prefix in ((stable, ""), (beta, "Beta")):
        for name in SDK_BLOCKS[kind]:
            assert _fields(getattr(module, prefix + name)) - accepted == set(), prefix + name


def test_every_sdk_tool_and_config_field_is_known() -> None:
    tool = {"type", "name", "description", "input_schema", *IGNORED_KEYS}
    for t in (stable.ToolParam, beta.BetaToolParam):
        assert _fields(t) - tool == set()
    thinking = [stable.ThinkingConfigEnabledParam, stable.ThinkingConfigAdaptiveParam, beta.BetaThinkingConfigParam]
    for t in [*thinking[:2], *typing.get_args(thinking[2])]:
        assert _fields(t) - set(ThinkingConfig.model_fields) == set(), t
    for t in (stable.OutputConfigParam, beta.BetaOutputConfigParam):
        assert _fields(t) - set(OutputConfig.model_fields) == set(), t


@pytest.fixture(scope="module")
def served(smollm2_server):
    # SmolLM2's template renders no tools: the default flags give hermes' preamble and <tool_call>
    url = smollm2_server
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    return url, client, client.models.list().data[0].id


def test_tool_use_turn_round_trips_as_model_dump(served) -> None:
    url, client, model = served
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    # greedy: sampled at the default temperature, 135M's city string runs past max_tokens about once in 70 calls
    # (a cut call is withheld and the turn ends "max_tokens"); the round trip, not sampling, is under test here
    first = client.messages.create(model=model, max_tokens=60, tools=[WEATHER], messages=ask,
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    sent_back = [b.model_dump() for b in first.content]
    assert "caller" in sent_back[-1] and "toolset_name" in sent_back[-1]  # the SDK's null fields travel
    turn = [*ask, {"role": "assistant", "content": sent_back},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C",
                                          "is_error": False, "cache_control": {"type": "ephemeral"}}]}]
    second = client.messages.create(model=model, max_tokens=30, tools=[WEATHER], messages=turn,
                                    tool_choice={"type": "none"})
    assert second.content[0].type == "text" and second.stop_reason in ("end_turn", "max_tokens")
    count = client.messages.count_tokens(model=model, tools=[WEATHER], messages=turn)
    assert count.input_tokens == second.usage.input_tokens


def test_every_request_field_is_accepted(served) -> None:
    """Each SDK request field, set to a value of its type, on a real request (Claude Code sends the beta ones)."""
    url, client, model = served
    extra = {k: v for k, v in SAMPLES.items() if v is not None}
    m = client.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                               extra_body=extra)
    assert m.type == "message" and m.usage.output_tokens >= 1
    m = client.beta.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                                    betas=["context-management-2025-06-27"], mcp_servers=[],
                                    context_management={"edits": [{"type": "clear_tool_uses_20250919"}]})
    assert m.type == "message"


def test_hosted_features_are_refused_by_name(served) -> None:
    url, client, model = served
    server = {"type": "url", "url": "https://mcp.example/sse", "name": "example"}
    with pytest.raises(anthropic.BadRequestError, match="MCP connector is a hosted feature"):
        client.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                               extra_body={"mcp_servers": [server]})
    block = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}}
    r = httpx.post(url + "/v1/messages", json={"model": model, "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [block]}]}, timeout=60)
    assert r.status_code == 400 and "hosted service's server tools" in r.json()["error"]["message"]
