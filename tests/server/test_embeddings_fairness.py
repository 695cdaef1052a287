"""A large embeddings request neither freezes the streams running beside it nor exceeds OpenAI's 2,048 inputs
(issue 39, item 9): the server embeds it a slice at a time between decode steps. Real server on loopback, the
openai client, inter-token gaps of a real stream measured while the embeddings run."""

from __future__ import annotations

import threading
import time

import pytest

from support.server import start_server, stop_server

openai = pytest.importorskip("openai")

INPUTS = 2048


@pytest.fixture(scope="module")
def client(model_dir):  # noqa: F811
    proc, url = start_server(model_dir, "--max-body-bytes", str(1 << 22))
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    stop_server(proc)


def _inputs(n: int) -> list[str]:
    return [f"Story {i}: once upon a time a little cat named Tom found a big red ball." for i in range(n)]


def test_a_stream_keeps_flowing_while_a_large_embeddings_request_runs(client) -> None:
    model = client.models.list().data[0].id
    client.embeddings.create(model=model, input=_inputs(4))  # warm
    arrivals: list[float] = []

    def stream() -> None:
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a story."}],
                                             max_tokens=480, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        for _ in out:
            arrivals.append(time.monotonic())

    streaming = threading.Thread(target=stream)
    streaming.start()
    deadline = time.monotonic() + 60
    while len(arrivals) < 5 and streaming.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(arrivals) >= 5, "the stream did not start"
    start = time.monotonic()
    raw = client.embeddings.with_raw_response.create(model=model, input=_inputs(INPUTS))
    end = time.monotonic()
    streaming.join()
    result = raw.parse()  # after the stream: decoding 2,048 vectors here would hold this process's GIL
    assert len(result.data) == INPUTS and [d.index for d in result.data] == list(range(INPUTS))
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if a >= start and b <= end]
    assert end - start > 1.0 and len(during) >= 5, (end - start, len(during))  # the stream ran during it
    assert arrivals[-1] > start + 0.8 * (end - start)  # the stream ran through (nearly) all of the request
    # in one piece, the embeddings froze the stream for nearly the whole request (8.2 s of 9.6 s, busy machine);
    # a slice at a time, the longest gap is a few slices (~1 s there)
    assert max(during) < (end - start) / 4, (max(during), end - start)


def test_more_than_2048_inputs_are_refused_naming_the_field(client) -> None:
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=model, input=["a cat"] * (INPUTS + 1))
    assert caught.value.body["param"] == "input" and "2048" in caught.value.body["message"]
    assert len(client.embeddings.create(model=model, input=[[1, 2, 3]] * INPUTS).data) == INPUTS
