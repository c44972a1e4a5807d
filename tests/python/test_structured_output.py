"""Structured output through the openai client, with the real test model: every
constrained answer parses and satisfies its constraint, greedy and sampled, streamed or
not; constraints that cannot compile are 400s that name their field."""
import json
import re

import openai
import pytest
from pydantic import BaseModel, Field

from conftest import MODEL_NAME


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=100_000_000)


def strict_schema():
    """City's schema as OpenAI's strict mode sends it: no properties beyond those listed."""
    return {**City.model_json_schema(), "additionalProperties": False}


def ask(text):
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_parse_with_a_pydantic_model(client, temperature):
    r = client.chat.completions.parse(
        model=MODEL_NAME, messages=ask("Describe the city of Paris."),
        response_format=City, temperature=temperature, seed=3, max_tokens=200,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    city = choice.message.parsed
    assert isinstance(city, City)
    assert City.model_validate_json(choice.message.content) == city


def test_json_object(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=ask("Give a JSON object with a cat's name and age."),
        response_format={"type": "json_object"}, temperature=0, max_tokens=300,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_and_choice_through_extra_body(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=ask("What is a phone number in the format 555-0123?"),
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, temperature=0, max_tokens=20,
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].message.content)
    choices = ["positive", "negative", "neutral"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=ask("The sentiment of 'I love it' is?"),
            extra_body=body, temperature=1.0, seed=5, n=3, max_tokens=10,
        )
        assert [c.message.content in choices for c in r.choices] == [True] * 3


def test_streamed_json_schema_and_completions(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ask("Describe the city of Rome."), stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": strict_schema(), "strict": True}},
        temperature=0, max_tokens=200,
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    City.model_validate_json(text)
    # The completions endpoint takes the same constraints, here as a JSON string.
    r = client.completions.create(
        model=MODEL_NAME, prompt="A city in JSON:", max_tokens=200, temperature=0.7, seed=1, n=2,
        extra_body={"structured_outputs": {"json": json.dumps(strict_schema())}},
    )
    for c in r.choices:
        assert c.finish_reason == "stop"
        City.model_validate_json(c.text)


def test_a_length_cut_stays_length(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=ask("Describe a city."), max_tokens=4, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": strict_schema()}},
        logprobs=True, top_logprobs=2,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    assert len(r.choices[0].logprobs.content) == 4


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ({"guided_regex": "(", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "("}, "guided_regex"),
])
def test_bad_constraints_are_400s_naming_their_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=ask("hi"), max_tokens=5, extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    # The server keeps serving.
    r = client.chat.completions.create(model=MODEL_NAME, messages=ask("hi"), max_tokens=2)
    assert r.choices[0].finish_reason == "length"
