"""/openapi.json declares what the server accepts: every request body property that may be sent as null (OpenAI's,
Anthropic's and llama.cpp's clients send null for options left unset) is nullable in its JSON Schema. The
reference is `jsonschema` on the document's own schemas against what pydantic (the handlers' parser) accepts."""

from __future__ import annotations

import jsonschema
import pydantic
import pytest

from nexttoken.server.anthropic.protocol import MessagesRequest
from nexttoken.server.llamacpp.protocol import InfillRequest, LlamaCompletionRequest
from nexttoken.server.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                              EmbeddingRequest, TokenizeRequest)
from nexttoken.server.ollama.protocol import (OllamaChatRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest,
                                              OllamaGenerateRequest, OllamaShowRequest)
from nexttoken.server.openai.responses import ResponsesRequest

BODIES = {  # each model and a smallest body it accepts
    CompletionRequest: {"prompt": "x"}, ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]},
    TokenizeRequest: {"prompt": "x"}, DetokenizeRequest: {"tokens": [1]}, EmbeddingRequest: {"input": "x"},
    ResponsesRequest: {"input": "hi"}, InfillRequest: {"input_prefix": "a"}, LlamaCompletionRequest: {"prompt": "a"},
    MessagesRequest: {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    OllamaChatRequest: {"model": "m"}, OllamaGenerateRequest: {"model": "m"}, OllamaShowRequest: {},
    OllamaEmbedRequest: {"model": "m", "input": "x"}, OllamaEmbeddingsRequest: {"model": "m", "prompt": "x"},
}


@pytest.mark.parametrize("model", list(BODIES), ids=lambda m: m.__name__)
def test_every_property_that_takes_null_is_declared_nullable(model) -> None:
    schema = model.model_json_schema(by_alias=True)
    body = BODIES[model]
    jsonschema.validate(body, schema)
    undeclared = []
    for name in schema["properties"]:
        try:
            model.model_validate({**body, name: None})
        except pydantic.ValidationError:
            continue  # refused: the schema may say non-null
        try:
            jsonschema.validate({**body, name: None}, schema)
        except jsonschema.ValidationError:
            undeclared.append(name)
    assert not undeclared, f"{model.__name__} accepts null for {undeclared}, which its JSON Schema refuses"
