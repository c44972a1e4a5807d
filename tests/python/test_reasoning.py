"""Reasoning parsers through the openai client, with the real test model (which never
writes `</think>`): under deepseek_r1 the template opens the thinking, so the whole answer
is `reasoning_content` and a structured-output constraint never starts; under qwen3 an
answer that does not open with `<think>` is all `content`. Streamed answers split as whole
ones do."""
import pytest
from openai import OpenAI

from conftest import MODEL_NAME, Server

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def clients():
    servers = [Server("--reasoning-parser", "deepseek_r1"), Server("--reasoning-parser", "qwen3")]
    yield [OpenAI(base_url=s.base + "/v1", api_key="unused") for s in servers]
    for s in servers:
        s.stop()


def chat(client, **extra):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=24, temperature=0, **extra)
    c = r.choices[0]
    return getattr(c.message, "reasoning_content", None), c.message.content, c.finish_reason


def streamed(client, **extra):
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=24, temperature=0,
                                                stream=True, **extra):
        c = chunk.choices[0]
        reasoning += getattr(c.delta, "reasoning_content", None) or ""
        content += c.delta.content or ""
        finish = c.finish_reason or finish
    return reasoning, content, finish


def test_deepseek_r1_answers_are_thinking_until_it_ends(clients):
    r1 = clients[0]
    reasoning, content, finish = chat(r1)
    assert reasoning and not content
    assert streamed(r1) == (reasoning, "", finish)
    # The constraint waits for the end of the thinking, which never comes here.
    reasoning, content, finish = chat(r1, response_format={"type": "json_object"})
    assert finish == "length" and reasoning and not content


def test_qwen3_answers_without_thinking_are_content(clients):
    qwen = clients[1]
    reasoning, content, finish = chat(qwen)
    assert content and reasoning is None
    assert streamed(qwen) == ("", content, finish)
