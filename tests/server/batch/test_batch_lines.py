"""OpenAI's batch file format (server/batch/lines.py): which lines are requests, the 400 each other line gets, and
what a resumed run skips in an output file (a line cut by a kill, a line known by its number)."""

from __future__ import annotations

import json

import pytest

from nexttoken.errors import NextTokenError
from nexttoken.server.batch.lines import BatchError, output_line, parse_requests, refusal, resume

GOOD = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1}}


@pytest.mark.parametrize("line,param,says", [
    ("{oops", None, "line 1: not valid JSON"),
    ("[1, 2]", None, "line 1: not a JSON object"),
    (json.dumps({**GOOD, "custom_id": 7}), "custom_id", "custom_id must be a string, got 7"),
    (json.dumps({**GOOD, "extra": 1}), "extra", "unknown field 'extra'"),
    (json.dumps({**GOOD, "method": "GET"}), "method", "method must be \"POST\", got 'GET'"),
    (json.dumps({**GOOD, "url": "/v1/moderations"}), "url", "url '/v1/moderations' is not a batch endpoint"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "body"}), "body", "body is required"),
    (json.dumps({**GOOD, "body": {**GOOD["body"], "stream": True}}), "body.stream", "stream is not supported"),
])
def test_a_line_that_is_no_request_gets_a_400_naming_the_field(line, param, says):
    [request] = parse_requests([line])
    answer = refusal(request)
    assert answer["response"]["status_code"] == 400 and answer["error"] is None
    error = answer["response"]["body"]["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert says in error["message"]


def test_a_request_line_keeps_its_body_and_blank_lines_are_skipped():
    [request] = parse_requests(["", json.dumps(GOOD), "  "])
    assert (request.line, request.custom_id, request.url, request.error) == (2, "a", "/v1/completions", None)
    assert json.loads(request.body) == GOOD["body"]
    [only] = parse_requests([json.dumps(GOOD)], ("/v1/chat/completions",))  # a server batch's one endpoint
    assert "is not the batch endpoint: use /v1/chat/completions" in only.error["error"]["message"]


def test_a_duplicate_custom_id_is_a_typed_error_naming_it():
    with pytest.raises(BatchError, match="custom_id 'a' is on line 1 and line 3") as e:
        parse_requests([json.dumps(GOOD), json.dumps({**GOOD, "custom_id": "b"}), json.dumps(GOOD)])
    assert isinstance(e.value, NextTokenError)


def test_resume_skips_answered_lines_and_drops_a_line_cut_by_a_kill(tmp_path):
    requests = parse_requests([json.dumps(GOOD), "{oops", json.dumps({**GOOD, "custom_id": "b"})])
    out = tmp_path / "results.jsonl"
    assert resume(out, requests) == requests  # no output file yet
    with pytest.raises(BatchError, match="does not exist: create it first"):
        resume(tmp_path / "missing" / "results.jsonl", requests)
    done = [json.dumps(output_line(requests[0], 200, {"ok": 1})), json.dumps(refusal(requests[1]))]
    out.write_text("\n".join(done) + "\n" + json.dumps(output_line(requests[2], 200, {}))[:25])
    assert resume(out, requests) == [requests[2]]  # "b" was cut short: it runs again
    assert out.read_text() == "\n".join(done) + "\n"


def test_an_output_file_of_another_batch_is_refused(tmp_path):
    out = tmp_path / "results.jsonl"
    other = parse_requests([json.dumps({**GOOD, "custom_id": "zzz"})])[0]
    out.write_text(json.dumps(output_line(other, 200, {})) + "\n")
    with pytest.raises(BatchError, match="answers custom_id 'zzz', which the input does not have"):
        resume(out, parse_requests([json.dumps(GOOD)]))
    out.write_text("not an answer\n")
    with pytest.raises(BatchError, match="is not a batch output file"):
        resume(out, parse_requests([json.dumps(GOOD)]))
