"""Tool calling through the openai client, with the real test model: a required or named
choice always gives a parseable call with valid arguments, streamed or not; `auto` returns
the model's text or its parsed calls; a tool loop (call, `tool` message, answer) runs; bad
tool requests are 400s naming their field."""
import json

import openai
import pytest

from conftest import MODEL_NAME, Server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 30}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call):
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    else:
        assert call.function.name == "get_time" and set(args) == {"tz"}
    assert call.id.startswith("call_") and call.type == "function"


def streamed(stream):
    """A streamed answer put together as a client does: content, calls by index, finish."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for t in c.delta.tool_calls or []:
            if t.index not in calls:
                # A call's first piece carries its id and name.
                assert t.id and t.function and t.function.name, t
                calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": "", "fragments": 0}
            call = calls[t.index]
            if t.function and t.function.arguments:
                call["arguments"] += t.function.arguments
                call["fragments"] += 1
        finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_choices_always_call(client, temperature):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
        temperature=temperature, seed=2, max_tokens=120,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.tool_calls
    for call in c.message.tool_calls:
        check_call(call)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=temperature, seed=2, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False,
    )
    c = r.choices[0]
    assert c.finish_reason == "stop"
    [call] = c.message.tool_calls
    assert call.function.name == "get_time"
    check_call(call)


def test_streamed_calls(client):
    """Streamed calls come as id and name, then argument fragments, and put together they
    are the calls of the same answer unstreamed."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        request = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=choice,
                       temperature=0, max_tokens=120)
        content, calls, finish = streamed(client.chat.completions.create(stream=True, **request))
        assert content == ""
        assert calls and finish in ("tool_calls", "stop")
        for call in calls:
            assert call["id"].startswith("call_")
            assert call["fragments"] > 1, call
        whole = client.chat.completions.create(**request).choices[0].message.tool_calls
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (c.function.name, json.loads(c.function.arguments)) for c in whole
        ]


def test_none_and_default_answer_in_text(client):
    for extra in ({"tool_choice": "none"}, {}):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=20, **extra,
        )
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content


def test_a_tool_loop(client):
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120,
    )
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40,
    )
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400s(client, extra, param):
    body = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 5, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.body["param"] == param, e.value.body


@pytest.fixture(scope="module")
def auto_client():
    from openai import OpenAI
    s = Server("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield OpenAI(base_url=s.base + "/v1", api_key="unused")
    s.stop()


def test_auto_parses_the_model_s_calls_or_returns_its_text(auto_client):
    # The prompt goes into the prefix cache first, so that both answers compared below
    # prefill the same uncached rest: a prefill of another shape sums in another order, and
    # a near tie may then go the other way (seen on an AMD EPYC VM, greedy).
    auto_client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=1)
    for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2)):
        r = auto_client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=temperature, seed=seed, max_tokens=60,
        )
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            for call in c.message.tool_calls:
                assert call.function.name
                json.loads(call.function.arguments)
        else:
            assert c.message.content
        content, calls, finish = streamed(auto_client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=temperature, seed=seed, max_tokens=60,
            stream=True,
        ))
        assert (content or None, [x["name"] for x in calls]) == (
            c.message.content, [x.function.name for x in c.message.tool_calls or []])
