"""Structured output over HTTP on the tiny model: whatever its random weights prefer, the text
matches the JSON schema, regex, choice or grammar asked for (or stops at max_tokens)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e
CHAT = [{"role": "user", "content": "Describe a person."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def check_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "tags"} and isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120 and set(value["tags"]) <= {"a", "b"}


@pytest.mark.parametrize("temperature,seed", [(0, None), (1.0, 1), (1.0, 2), (1.5, 3)])
def test_json_schema_through_the_sdk(client, temperature, seed):
    response = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=120, temperature=temperature, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    [choice] = response.choices
    assert choice.finish_reason == "stop", choice
    check_person(choice.message.content)


def test_json_object_and_streaming(client):
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, temperature=0.8, seed=4,
                                            stream=True, response_format={"type": "json_object"})
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert chunks[-1].choices[0].finish_reason == "length" and text.startswith("{")


def test_vllm_guided_fields_on_completions(client):
    regex = client.completions.create(model="tiny", prompt="The date:", max_tokens=20, temperature=1.0, seed=5,
                                      extra_body={"guided_regex": r"(19|20)\d\d-[01]\d-[0-3]\d"})
    assert re.fullmatch(r"(19|20)\d\d-[01]\d-[0-3]\d", regex.choices[0].text)
    choice = client.completions.create(model="tiny", prompt="Yes or no?", max_tokens=10, n=3, temperature=1.0,
                                       seed=6, extra_body={"guided_choice": ["yes", "no", "maybe not"]})
    assert {c.text for c in choice.choices} <= {"yes", "no", "maybe not"}
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
    expression = client.completions.create(model="tiny", prompt="Sum:", max_tokens=30, temperature=1.0, seed=7,
                                           extra_body={"guided_grammar": grammar})
    if expression.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", expression.choices[0].text)
    schema = client.completions.create(model="tiny", prompt="JSON:", max_tokens=120, temperature=0,
                                       extra_body={"structured_outputs": {"json": PERSON}})
    check_person(schema.choices[0].text)


def test_shortfin_generate_with_sglang_fields(tiny_server):
    body = {"text": "Number:", "sampling_params": {"max_completion_tokens": 12, "regex": "[1-9][0-9]{2}"}}
    response = httpx.post(tiny_server.url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert re.fullmatch("[1-9][0-9]{2}", response.json()["responses"][0]["responses"][0]["text"])


def test_repeated_schemas_return_every_page(tiny_server, client):
    for _ in range(3):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=120, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "p", "schema": PERSON}})
    assert tiny_server.wait_metric("kiln_kv_pages_active", 0) == 0
