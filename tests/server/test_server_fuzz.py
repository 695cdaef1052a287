"""A fuzzer driven by the server's own /openapi.json (schemathesis): every endpoint gets generated bodies, valid and
invalid, against a real server on loopback; no answer is a 5xx, and every answer is one the document describes
(its status, its content type, its body's schema), and a body outside the schema is refused. (A body inside the
schema may still be refused: the values of sampling options, and how they combine, are checked by
GenerationConfig, beyond what the schema says.) Bounded: a fixed number of derandomized examples per endpoint
and mode, on a short context so each generation is short."""

from __future__ import annotations

import pytest

from support.server import start_server, stop_server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402 - after the skip
from schemathesis.checks import positive_data_acceptance  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

EXAMPLES = 8  # per endpoint and mode


@pytest.fixture(scope="module")
def fuzzed(model_dir):  # noqa: F811
    proc, url = start_server(model_dir, "--max-model-len", "48", "--max-seqs-per-request", "8", "--max-n", "2",
                             "--max-body-bytes", str(1 << 20))
    yield url
    stop_server(proc)


def test_every_endpoint_keeps_its_documented_contract(fuzzed) -> None:
    api = schemathesis.openapi.from_url(fuzzed + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    for op in operations:
        # a GET without parameters, or a POST without a body (the admin routes), has no invalid form
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if op.method.upper() == "POST" and len(
            op.body) else (GenerationMode.POSITIVE,)
        for mode in modes:

            @given(op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def call(case) -> None:  # noqa: ANN001
                case.call_and_validate(timeout=60, excluded_checks=[positive_data_acceptance])

            call()
