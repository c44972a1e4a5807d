"""ingot serve through the official openai client, on the real test model."""
import asyncio
import time

import json
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from conftest import MODEL_NAME, Server

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_completion_streamed_equals_plain(client):
    plain = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=12, **GREEDY)
    assert plain.usage.completion_tokens == 12
    stream = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=12, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == plain.choices[0].text


def test_chat_streamed_equals_plain(client):
    messages = [{"role": "user", "content": "Name a color."}]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, **GREEDY)
    assert plain.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, stream=True, **GREEDY)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain.choices[0].message.content


def test_n_logprobs_stop_and_usage(client):
    two = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=5, n=2, temperature=0.8, seed=3)
    assert len(two.choices) == 2
    lp = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3,", max_tokens=4, logprobs=3, **GREEDY)
    for token_lp, top in zip(lp.choices[0].logprobs.token_logprobs, lp.choices[0].logprobs.top_logprobs):
        assert len(top) == 3 and token_lp == max(top.values())
    chat_lp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True, top_logprobs=2, **GREEDY
    )
    assert len(chat_lp.choices[0].logprobs.content[0].top_logprobs) == 2
    full = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3,", max_tokens=12, **GREEDY).choices[0].text
    stop = full[5:8]
    cut = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3,", max_tokens=12, stop=[stop], **GREEDY).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    stream = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=6, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    usage = [c.usage for c in stream if c.usage]
    assert usage and usage[-1].completion_tokens == 6


def test_seed_reproduces(client):
    args = dict(model=MODEL_NAME, prompt="In a small village", max_tokens=16, temperature=0.8, top_p=0.9, seed=1234)
    assert client.completions.create(**args).choices[0].text == client.completions.create(**args).choices[0].text


def test_errors_surface_as_client_exceptions(client, server):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL_NAME, prompt="word " * 3000, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    keyed = Server("--api-key", "sekret")
    try:
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=keyed.base + "/v1", api_key="wrong").models.list()
        assert OpenAI(base_url=keyed.base + "/v1", api_key="sekret").models.list().data
    finally:
        keyed.stop()


def _wait_idle(server):
    deadline = time.time() + 30
    while True:
        m = server.metrics()
        if m["ingot:num_requests_running"] == 0 and m["ingot:num_requests_waiting"] == 0 and m["ingot:kv_cache_usage_perc"] == 0:
            return
        assert time.time() < deadline, f"not idle: {m}"
        time.sleep(0.05)


def test_64_concurrent_streams_then_200_disconnects(server):
    async def one(client, i):
        max_tokens = 4 + (i * 7) % 29
        stream = await client.completions.create(
            model=MODEL_NAME, prompt="Story number %d: " % i + "once " * (i % 9), max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True}, **GREEDY,
        )
        pieces, usage = 0, None
        async for c in stream:
            pieces += bool(c.choices)
            usage = c.usage or usage
        return max_tokens, pieces, usage.completion_tokens

    async def many():
        client = AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    for want, pieces, got in asyncio.run(many()):
        assert got == want and pieces == want
    _wait_idle(server)

    async def drop(i):
        # A raw connection that reads the first streamed event and hangs up.
        body = json.dumps({"model": MODEL_NAME, "prompt": "Tell me about %d" % i, "max_tokens": 500, "stream": True, "ignore_eos": True})
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write((
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}"
        ).encode())
        await writer.drain()
        while not (await reader.readline()).startswith(b"data:"):
            pass
        writer.close()
        await writer.wait_closed()

    async def drops():
        await asyncio.gather(*(drop(i) for i in range(200)))

    asyncio.run(drops())
    _wait_idle(server)
