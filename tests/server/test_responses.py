"""OpenAI's Responses API (/v1/responses) through the official SDK, against the tiny model: the
same conversation as /v1/chat/completions renders and samples the same, whole or streamed as
OpenAI's events, cut short as `incomplete`, constrained by text.format; and what it refuses."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from kiln.runtime.request import Event
from kiln.runtime.sampling import SamplingParams
from kiln.server.protocol import ResponsesRequest, ResponsesTextFormat
from kiln.server.http.responses_routes import ResponseView
from tests.server.test_structured_output import PERSON, check_person

pytestmark = pytest.mark.e2e
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def chat_twin(client, messages, max_tokens):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)


def test_text_input_is_a_user_message(client):
    response = client.responses.create(model="tiny", input="Tell me a story.", max_output_tokens=8, temperature=0,
                                       metadata={"run": "1"}, store=False)
    chat = chat_twin(client, [{"role": "user", "content": "Tell me a story."}], 8)
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"] and message.content[0].annotations == []
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    assert response.metadata == {"run": "1"} and response.temperature == 0 and response.top_p == 1
    assert response.text.format.type == "text" and response.tools == [] and response.max_output_tokens == 8


def test_messages_with_instructions_render_as_chat_does(client):
    response = client.responses.create(
        model="tiny", instructions="You are terse.", max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
               {"role": "user", "content": "Name a color."}])
    chat = chat_twin(client, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello"},
                              {"role": "user", "content": "Name a color."}], 6)
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content
    assert response.instructions == "You are terse."


def test_max_output_tokens_leaves_it_incomplete(client):
    response = client.responses.create(model="tiny", input="Count to ten.", max_output_tokens=2, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output[0].status == "incomplete"


def test_streamed_events_build_the_same_text(client):
    whole = client.responses.create(model="tiny", input="Once upon a time", max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model="tiny", input="Once upon a time", max_output_tokens=12,
                                          temperature=0, stream=True))
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert kinds == STREAM_EVENTS + ["response.output_text.delta"] * len(deltas) + STREAM_END + \
        [f"response.{whole.status}"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and events[-4].text == whole.output_text


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    sure: bool


def test_the_sdk_stream_helper_parses_a_json_schema_reply(client):
    with client.responses.stream(model="tiny", input="Pick a color.", max_output_tokens=40, temperature=0,
                                 text_format=Pick) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    assert isinstance(final.output_parsed, Pick)
    assert final.text.format.type == "json_schema" and final.text.format.name == "Pick"


def test_text_format_json_schema_and_json_object(client):
    response = client.responses.create(
        model="tiny", input="Describe a person.", max_output_tokens=120, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert response.status == "completed"
    check_person(response.output_text)
    assert response.text.format.name == "person" and response.text.format.schema_ == PERSON
    anything = client.responses.create(model="tiny", input="JSON please.", max_output_tokens=60, temperature=0.8,
                                       text={"format": {"type": "json_object"}})
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)
    else:  # cut at max_output_tokens: still the start of an object
        assert anything.output_text.startswith("{")


@pytest.mark.parametrize("body,param,fragment", [
    ({"input": 5}, "input", "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input.0.content.0.type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input", "input.0.type"),
    ({"input": []}, "input", "no message"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", "'xml'"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format", "schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "bogus"}}}},
     "text.format", "bogus"),
    ({"input": "x", "text": {"format": "json"}}, "text", "text.format"),
    ({"input": "x", "temperature": "hot"}, "temperature", "temperature"),
    ({"input": "x", "temperature": -1}, "temperature", "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens", "context length"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools",
     "/v1/chat/completions"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "tools"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata", "metadata.k"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
])
def test_bad_requests_are_400_naming_the_field(tiny_server, body, param, fragment):
    response = httpx.post(tiny_server.url + "/v1/responses", json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_errors_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="tiny", input="Hi", previous_response_id="resp_123")
    assert error.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="Hi")


def test_a_client_that_leaves_a_stream_aborts_it(client, tiny_server):
    aborted = tiny_server.metric('kiln_sequences_finished_total{reason="abort"}', default=0)
    # No max_output_tokens: the rest of the context, far more than is read before leaving.
    with client.responses.create(model="tiny", input="Tell me a long story.", temperature=0, stream=True) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    assert tiny_server.wait_metric('kiln_sequences_finished_total{reason="abort"}', aborted + 1) == aborted + 1
    assert tiny_server.wait_metric("kiln_kv_pages_active", 0) == 0


def test_keys_and_form_encoded_bodies_as_on_the_other_routes(start_fake_server):
    port, _ = start_fake_server(api_keys=("secret",))
    url = f"http://127.0.0.1:{port}/v1/responses"
    body = json.dumps({"model": "fake", "input": "hi", "max_output_tokens": 2})
    assert httpx.post(url, content=body).status_code == 401
    # curl -d sends application/x-www-form-urlencoded: read as JSON, as every API route does.
    answer = httpx.post(url, content=body, headers={"Authorization": "Bearer secret",
                                                    "Content-Type": "application/x-www-form-urlencoded"})
    assert answer.status_code == 200 and answer.json()["usage"]["output_tokens"] == 2
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'kiln_requests_total{method="POST",model_name="fake",route="/v1/responses",status="200"} 1.0' in metrics


def test_a_failure_mid_stream_ends_it_with_response_failed():
    class Failing:  # a Generation whose sequence fails after one token
        async def events(self):
            yield 0, Event(0, text="Hel", token_ids=[1])
            yield 0, Event(0, finish_reason="error", error="the device fell over")

    view = ResponseView(ResponsesRequest(input="Hi"), ResponsesTextFormat(), "tiny", SamplingParams())

    async def read():
        return b"".join([chunk async for chunk in view.stream(Failing())])

    events = [block.split("\n") for block in asyncio.run(read()).decode().strip().split("\n\n")]
    assert all(name == f"event: {json.loads(data[len('data: '):])['type']}" for name, data in events)
    last = json.loads(events[-1][1][len("data: "):])
    assert [json.loads(data[len("data: "):])["type"] for _, data in events][-2:] == \
        ["response.output_text.delta", "response.failed"]
    assert last["response"]["status"] == "failed" and "the device fell over" in last["response"]["error"]["message"]
