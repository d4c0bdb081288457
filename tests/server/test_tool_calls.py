"""Tool calling: the parsers and the streaming hold-back without a model, then the openai SDK's
agent loop against the tiny model (whose calls are forced by tool_choice, its weights being random)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from kiln.runtime.errors import InvalidRequestError
from kiln.server.http.openai_routes import tool_instructions
from kiln.server.tool_calls import StreamedContent, Tools, choose_parser, parse
from tests.tiny_model import CHATML_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_hermes_and_llama3_calls_are_parsed():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>'
    content, calls = parse(text, "hermes")
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].id != calls[1].id
    content, calls = parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": 2}}', "llama3_json")
    assert content is None and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": 2}
    assert parse("just words", "hermes") == ("just words", [])
    assert parse('{"not": "a call"}', "llama3_json") == ('{"not": "a call"}', [])
    assert parse("<tool_call>{broken</tool_call>", "hermes")[1] == []


def test_arguments_written_as_json_text_are_the_object_and_others_no_call():
    """Models trained on OpenAI's wire format write the arguments as a JSON string: they are
    sent once encoded (not a string of a string), and arguments that are no object make no call."""
    quoted = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    [call] = parse(quoted, "hermes")[1]
    assert json.loads(call.arguments) == {"city": "Paris"}
    [call] = parse('{"name": "get_time", "parameters": "{\\"zone\\": 2}"}', "llama3_json")[1]
    assert json.loads(call.arguments) == {"zone": 2}
    [call] = parse('<tool_call>{"name": "get_time", "arguments": null}</tool_call>', "hermes")[1]
    assert call.arguments == "{}"
    for arguments in ('"Paris"', '[1, 2]', '3', 'true', '"{not json"'):
        text = f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
        assert parse(text, "hermes") == (text, []), arguments


def test_streaming_holds_back_only_what_may_be_a_call():
    stream = StreamedContent("hermes")
    sent = [stream.feed(piece) for piece in ("Sure", ", one moment <tool", '_call>{"name": "get_time", ',
                                             '"arguments": {"zone": 3}}</tool_call>')]
    assert "".join(sent) == "Sure, one moment "
    tail, calls = stream.finish()
    assert tail == "" and calls[0].name == "get_time"
    plain = StreamedContent("hermes")
    assert plain.feed("a < b") == "a < b" and plain.finish() == ("", [])
    partial = StreamedContent("hermes")
    assert partial.feed("x <tool") == "x " and partial.finish() == ("<tool", [])


def test_tools_are_checked_and_the_parser_follows_the_template():
    assert Tools.of(None, None) is None
    assert Tools.of([WEATHER], {"type": "function", "function": {"name": "get_weather"}}).named == "get_weather"
    for tools, choice, param in (([{"type": "function"}], None, "tools"), ([WEATHER], "sometimes", "tool_choice"),
                                 ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                 (None, "required", "tool_choice"), ([WEATHER, TIME, WEATHER], None, "tools")):
        with pytest.raises(InvalidRequestError) as error:
            Tools.of(tools, choice)
        assert error.value.param == param
    assert choose_parser("auto", "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert choose_parser("auto", "<|python_tag|>{{ tools }}") == "llama3_json"
    assert choose_parser("llama3_json", "<tool_call>") == "llama3_json"
    # A template without tools of its own gets them as a system message, in the Hermes format.
    assert "<tools>" in tool_instructions(Tools.of([WEATHER], None)) and "get_weather" in tool_instructions(
        Tools.of([WEATHER], None))


# ChatML that shows the tools by name: the tiny model's context (256 tokens) has no room for schemas.
TOOLS_TEMPLATE = CHATML_TEMPLATE.replace(
    "{% for message in messages %}",
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}")


@pytest.fixture(scope="module")
def tools_server(start_server, tiny_artifacts):
    return start_server("--artifacts", tiny_artifacts, "--served-model-name", "tiny", "--chat-template",
                        TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def client(tools_server):
    with openai.OpenAI(base_url=tools_server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def check_weather(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f")
    return arguments


@pytest.mark.e2e
def test_the_sdk_agent_loop(client):
    """Call (forced) -> tool result -> answer, with the SDK's own types, as an agent does."""
    first = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, TIME], max_tokens=180,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    check_weather(call)
    messages = CHAT + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                            tool_choice="none", max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    required = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER, TIME], max_tokens=180,
                                              tool_choice="required", temperature=1.0, seed=3)
    [call] = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and json.loads(call.function.arguments)


@pytest.mark.e2e
def test_streamed_tool_calls(client):
    stream = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER], max_tokens=180, stream=True,
                                            tool_choice="required")
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    check_weather(calls[0])
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()


@pytest.mark.e2e
def test_auto_without_a_call_is_plain_content_and_bad_tools_are_400(client, tools_server):
    response = client.chat.completions.create(model="tiny", messages=CHAT, tools=[WEATHER], max_tokens=6)
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content is not None
    for body, param in (({"tools": [{"type": "function", "function": {}}]}, "tools"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                         "tool_choice"),
                        ({"functions": [WEATHER["function"]]}, "functions"),
                        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"}, "tool_choice")):
        response = httpx.post(tools_server.url + "/v1/chat/completions",
                              json={"model": "tiny", "messages": CHAT, "max_tokens": 4, **body}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_langchain_bind_tools_and_with_structured_output(tools_server):
    """LangChain's ChatOpenAI, unchanged: a forced tool call, and a schema-constrained answer."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    @tool
    def get_time(zone: int) -> str:
        """The time in a time zone (hours from UTC)."""
        return f"12:00 UTC{zone:+d}"

    class City(BaseModel):
        name: str = Field(max_length=12)
        population: int = Field(ge=0, le=1_000_000)

    chat = ChatOpenAI(model="tiny", base_url=tools_server.url + "/v1", api_key="unused", temperature=0,
                      max_retries=0, max_tokens=120, timeout=60)
    reply = chat.bind_tools([get_time], tool_choice="get_time").invoke("What time is it in Tokyo?")
    [call] = reply.tool_calls
    assert call["name"] == "get_time" and isinstance(call["args"]["zone"], int) and call["id"]
    assert get_time.invoke(call["args"]).startswith("12:00")
    for method in ("json_schema", "function_calling"):
        city = chat.with_structured_output(City, method=method).invoke("Name a city and its population.")
        assert isinstance(city, City), method
